#include "comm/failure_notice.h"

#include <algorithm>
#include <cstring>

#include "comm/tag_scheme.h"

namespace fsdp_ext::comm {
namespace {

// "fnt1": the header's first word, so that a message of another layout (a
// later version's, say) reads as foreign rather than as garbage.
constexpr uint32_t kMagic = 0x31746e66;

struct Header {
  uint32_t magic;
  uint32_t kind;
  uint64_t seq;
};

}  // namespace

std::vector<uint8_t> encode_failure_notice(uint64_t seq, ErrorKind kind,
                                           const std::string& message) {
  const Header header{kMagic, static_cast<uint32_t>(kind), seq};
  const size_t text = std::min(message.size(), FailureNoticeInbox::kMaxBytes - sizeof(Header));
  std::vector<uint8_t> bytes(sizeof(Header) + text);
  std::memcpy(bytes.data(), &header, sizeof(Header));
  std::memcpy(bytes.data() + sizeof(Header), message.data(), text);
  return bytes;
}

bool decode_failure_notice(const uint8_t* bytes, size_t length, FailureNotice* notice) {
  Header header{};
  if (length < sizeof(Header)) return false;
  std::memcpy(&header, bytes, sizeof(Header));
  if (header.magic != kMagic || header.kind > static_cast<uint32_t>(ErrorKind::kPeerLeft)) {
    return false;
  }
  notice->seq = header.seq;
  notice->kind = static_cast<ErrorKind>(header.kind);
  notice->message.assign(reinterpret_cast<const char*>(bytes) + sizeof(Header),
                         length - sizeof(Header));
  return true;
}

void FailureNoticeInbox::start(Transport& transport) {
  request_ = Request{};
  transport.post_recv(request_, tag::failure_notice(0), tag::kMatchAnySender, buffer_,
                      sizeof(buffer_));
  posted_ = true;
}

bool FailureNoticeInbox::poll(Transport& transport, FailureNotice* notice) {
  if (!posted_ || !transport.test(request_)) return false;
  posted_ = false;
  if (request_.status == UCS_ERR_MESSAGE_TRUNCATED) {
    // A notice longer than any this build sends: its sender is known.
    notice->sender = tag::sender_of(request_.matched_tag);
    notice->kind = ErrorKind::kTransport;
    notice->message = "it sent a failure notice longer than this build reads (a different "
                      "fsdp_ext version?)";
    return true;
  }
  // Canceled at shutdown, or the receive failed without matching a message
  // (no sender to name): no notice.
  if (request_.status != UCS_OK) return false;
  notice->sender = tag::sender_of(request_.matched_tag);
  if (!decode_failure_notice(buffer_, request_.received, notice)) {
    notice->kind = ErrorKind::kTransport;
    notice->message = "it sent a failure notice of " + std::to_string(request_.received) +
                      " bytes that this build cannot read (a different fsdp_ext version?)";
  }
  return true;
}

Request FailureNoticeInbox::take_pending() {
  Request pending;
  pending.finished = true;  // nothing to retire
  if (posted_ && !request_.finished) pending = request_;
  posted_ = false;
  request_ = Request{};
  return pending;
}

}  // namespace fsdp_ext::comm
