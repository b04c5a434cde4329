#include "comm/algorithms/shared_source_exchange.h"

#include <cstring>
#include <map>
#include <string>
#include <utility>

#include "comm/algorithms/span_helpers.h"
#include "comm/error.h"

namespace fsdp_ext::comm {
namespace {
// Pieces read as process memory arrive this much at a time (a multiple of
// every element size, small enough to stay in L2 while reduced).
constexpr size_t kReduceChunkBytes = 256 << 10;

// A reduction as the headers carry it (SharedPiece::reduction; never 0):
// the dtype, the op, and whether the result is divided (AVG).
constexpr uint32_t kAveragedBit = 1u << 16;
uint32_t reduction_code(const ReduceSpec& spec) {
  return (static_cast<uint32_t>(spec.type) + 1) | (static_cast<uint32_t>(spec.kind) + 1) << 8 |
         (spec.post_divisor != 1.0 ? kAveragedBit : 0);
}

std::string describe_reduction(uint32_t code) {
  const auto type = static_cast<DataType>((code & 0xff) - 1);
  const auto kind = static_cast<ReduceKind>(((code >> 8) & 0xff) - 1);
  return std::string(data_type_name(type)) + " " +
         ((code & kAveragedBit) ? "AVG" : reduce_kind_name(kind));
}
}  // namespace

const char* shared_exchange_kind_name(uint32_t kind) {
  switch (static_cast<SharedExchangeKind>(kind)) {
    case SharedExchangeKind::kUnnamed: return "an unnamed exchange";
    case SharedExchangeKind::kAllGather: return "an all-gather";
    case SharedExchangeKind::kAllReduceInputs: return "an all-reduce (its first phase)";
    case SharedExchangeKind::kAllReduceResults: return "an all-reduce (its second phase)";
    case SharedExchangeKind::kBroadcast: return "a broadcast";
    case SharedExchangeKind::kReduceScatter: return "a reduce-scatter";
  }
  return "an exchange of another build";
}

SharedSourceExchange::SharedSourceExchange(OpContext& context, SharedMemoryDomain& domain,
                                           uint32_t first_step, int staging_slot,
                                           size_t process_read_min_bytes, SharedExchangeKind kind)
    : context_(context),
      domain_(domain),
      header_step_(first_step),
      staging_slot_(staging_slot),
      process_read_min_bytes_(process_read_min_bytes),
      kind_(kind),
      offers_(context.size()),
      offered_(context.size(), false),
      expected_(context.size()),
      expecting_(context.size(), false),
      headers_out_(context.size()),
      headers_in_(context.size()),
      sources_(context.size()) {}

void SharedSourceExchange::offer(int peer, std::vector<ConstSpan> pieces) {
  offers_[peer] = std::move(pieces);
  offered_[peer] = true;
}

void SharedSourceExchange::expect(int peer, std::vector<size_t> piece_bytes) {
  expected_[peer] = std::move(piece_bytes);
  expecting_[peer] = true;
}

void SharedSourceExchange::exchange() {
  const int n = context_.size();
  // Locate every offered piece; stage those outside shared memory, each
  // distinct range once (an all-gather offers the same input to every peer).
  std::map<std::pair<const void*, size_t>, SharedPiece> located;
  std::vector<std::pair<const void*, size_t>> to_stage;
  size_t staging_bytes = 0;
  for (int p = 0; p < n; ++p) {
    for (const ConstSpan& piece : offers_[p]) {
      const auto key = std::make_pair(piece.data, piece.bytes);
      if (piece.bytes == 0 || located.count(key)) continue;
      if (std::optional<SharedPiece> found = domain_.locate(piece.data, piece.bytes)) {
        located[key] = *found;
        domain_.count_offered(SharedMemoryDomain::Offer::kInPlace);
      } else if (domain_.process_reads() && piece.bytes >= process_read_min_bytes_) {
        SharedPiece direct;
        direct.in_process_memory = 1;
        direct.process_address = reinterpret_cast<uint64_t>(piece.data);
        located[key] = direct;
        domain_.count_offered(SharedMemoryDomain::Offer::kProcessMemory);
      } else {
        domain_.count_offered(SharedMemoryDomain::Offer::kStaged);
        located[key] = SharedPiece{};
        to_stage.push_back(key);
        staging_bytes += align_for_staging(piece.bytes);
      }
    }
  }
  if (!to_stage.empty()) {
    char* cursor = domain_.staging(staging_slot_, staging_bytes);
    for (const auto& key : to_stage) {
      std::memcpy(cursor, key.first, key.second);
      located[key] = *domain_.locate(cursor, key.second);
      cursor += align_for_staging(key.second);
    }
  }

  std::vector<Request> requests;
  for (int p = 0; p < n; ++p) {
    if (!expecting_[p]) continue;
    headers_in_[p].resize(expected_[p].size());
    requests.push_back(context_.recv(p, header_step_, headers_in_[p].data(),
                                     headers_in_[p].size() * sizeof(SharedPiece)));
  }
  for (int p = 0; p < n; ++p) {
    if (!offered_[p]) continue;
    headers_out_[p].resize(offers_[p].size());
    for (size_t i = 0; i < offers_[p].size(); ++i) {
      const ConstSpan& piece = offers_[p][i];
      if (piece.bytes != 0) headers_out_[p][i] = located[{piece.data, piece.bytes}];
      headers_out_[p][i].bytes = piece.bytes;
      headers_out_[p][i].exchange_kind = static_cast<uint32_t>(kind_);
      if (i < whole_bytes_.size()) headers_out_[p][i].whole_bytes = whole_bytes_[i];
      if (i < reductions_.size()) headers_out_[p][i].reduction = reduction_code(reductions_[i]);
    }
    requests.push_back(context_.send(p, header_step_, headers_out_[p].data(),
                                     headers_out_[p].size() * sizeof(SharedPiece)));
  }
  context_.wait_all(requests);

  for (int p = 0; p < n; ++p) {
    if (!expecting_[p]) continue;
    sources_[p].assign(expected_[p].size(), nullptr);
    for (size_t i = 0; i < expected_[p].size(); ++i) {
      const SharedPiece& piece = headers_in_[p][i];
      if (piece.exchange_kind != static_cast<uint32_t>(kind_)) {
        throw CommError(ErrorKind::kMismatch,
                        context_.description() + ": rank " + std::to_string(p) + " is in " +
                            shared_exchange_kind_name(piece.exchange_kind) +
                            " where this rank is in " +
                            shared_exchange_kind_name(static_cast<uint32_t>(kind_)) +
                            " (the ranks called different collectives, or the same ones in "
                            "another order)");
      }
      if (i < reductions_.size() && piece.reduction != reduction_code(reductions_[i])) {
        const std::string theirs =
            piece.reduction == 0 ? "no reduction" : describe_reduction(piece.reduction);
        throw CommError(ErrorKind::kMismatch,
                        context_.description() + ": rank " + std::to_string(p) +
                            " reduces tensor " + std::to_string(i) + " as " + theirs +
                            " where this rank reduces it as " +
                            describe_reduction(reduction_code(reductions_[i])) +
                            " (the ranks' dtypes or reduce ops differ)");
      }
      if (i < whole_bytes_.size() && piece.whole_bytes != whole_bytes_[i]) {
        throw CommError(ErrorKind::kMismatch,
                        context_.description() + ": rank " + std::to_string(p) + "'s tensor " +
                            std::to_string(i) + " has " + std::to_string(piece.whole_bytes) +
                            " bytes where this rank's has " + std::to_string(whole_bytes_[i]) +
                            " (tensor sizes differ between ranks)");
      }
      if (piece.bytes != expected_[p][i]) {
        throw CommError(ErrorKind::kMismatch,
                        context_.description() + ": rank " + std::to_string(p) + " has " +
                            std::to_string(piece.bytes) + " bytes for tensor " +
                            std::to_string(i) + " but this rank expects " +
                            std::to_string(expected_[p][i]) +
                            " (tensor sizes differ between ranks)");
      }
      if (piece.bytes != 0 && !piece.in_process_memory) sources_[p][i] = domain_.map_peer(p, piece);
    }
  }
}

void SharedSourceExchange::reduce_pieces(size_t index, MutableSpan output, const void* own,
                                         const ReduceSpec& spec) {
  const int n = context_.size();
  const int r = context_.rank();
  char* out = static_cast<char*>(output.data);
  const char* own_bytes = static_cast<const char*>(own);
  std::vector<const void*> others;
  for (size_t offset = 0; offset < output.bytes; offset += kReduceChunkBytes) {
    const size_t bytes = std::min(kReduceChunkBytes, output.bytes - offset);
    others.clear();
    for (int p = 0; p < n; ++p) {
      if (p == r) continue;
      if (const char* source = sources_[p][index]) {
        others.push_back(source + offset);
        continue;
      }
      if (chunks_ == nullptr) {
        chunks_ = static_cast<char*>(context_.scratch(kReduceChunkBytes * (n - 1)));
      }
      char* chunk = chunks_ + kReduceChunkBytes * (p < r ? p : p - 1);
      copy_range(p, index, offset, bytes, chunk);
      others.push_back(chunk);
    }
    detail::reduce_sources(MutableSpan{out + offset, bytes}, own_bytes + offset, others, spec);
  }
}

void SharedSourceExchange::finish() {
  const int n = context_.size();
  std::vector<Request> requests;
  for (int p = 0; p < n; ++p) {
    if (offered_[p]) requests.push_back(context_.recv(p, header_step_ + 1, nullptr, 0));
  }
  for (int p = 0; p < n; ++p) {
    if (expecting_[p]) requests.push_back(context_.send(p, header_step_ + 1, nullptr, 0));
  }
  context_.wait_all(requests);
}

}  // namespace fsdp_ext::comm
