// Note [a failure told to the peers]
// A collective that fails on one rank leaves the group unusable there (its
// later tags would no longer line up with the peers'), but the peers do not
// always see that failure themselves. The rank that detects a mismatch is
// the one holding the other collective's message. A peer whose part was only
// sends (a broadcast's root, a rank of the other host's column) waits for its
// timeout when a send is large enough to need the receiver (rendezvous); with
// small (eager) sends its op completes and its next one would time out. So
// would a rank further down a tree or ring that waits for data the failed
// rank will never forward. So the failing rank sends every peer a short
// notice: its rank, the op's number, the kind of failure and its message. A rank that receives one fails what it is
// waiting on, naming that rank and its reason, and refuses further work, as
// after a lost peer. Not quite at once: for a short grace (kNoticeGrace,
// progress_engine.cpp) the rank's own checks may report the failure first,
// in its own words, when it can see it too (a mismatch whose message it
// holds, a timeout of its own a moment later). A notice whose sender has
// exited (it failed, then its script raised) is reported at once and in
// place of the exit; a notice from a live peer while another peer is lost
// is that loss's consequence, and the loss is reported.
//
// The notice travels as a tagged UCX message in the point-to-point half of
// the tag space with a bit of its own (tag_scheme.h), so no user receive
// and no collective receive can take it. Each engine keeps one receive for
// it, from any sender, posted from the start of its progress thread until
// the first notice arrives. Only the first notice counts (the others stay
// unread until the worker's end: Note [messages nobody received],
// transport.cpp). A rank that failed because of a notice
// does not send one again, and a lost peer (every rank watches its peers
// itself) and an abort (this rank's own decision) send none; a rank whose
// own check fails during the grace does send (at most one notice per rank
// and group: its group is broken from then on).
//
// Scale: the failing rank makes an endpoint to every rank it had none to
// (Note [an endpoint on first use] keeps them few otherwise), waits at most
// kNoticeFlush for the notices to leave, and leaves the rest in flight.
// With every rank failing at once (a group-wide timeout) that is N(N-1)
// small messages and as many connections as a full mesh. A rank on the
// same host also learns of a stop from the small-op channel's `stopped` word
// (small_op_channel.h); the notice covers the UCX paths and other hosts.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm/error.h"
#include "comm/transport.h"

namespace fsdp_ext::comm {

struct FailureNotice {
  int sender = -1;
  uint64_t seq = 0;  // the op that failed there (0: not a numbered op)
  ErrorKind kind = ErrorKind::kTransport;
  std::string message;
};

// The wire form: a fixed header, then the message, cut to fit kMaxBytes.
std::vector<uint8_t> encode_failure_notice(uint64_t seq, ErrorKind kind,
                                           const std::string& message);
// False when `bytes` is not a notice (a short or foreign message).
bool decode_failure_notice(const uint8_t* bytes, size_t length, FailureNotice* notice);

// The receiving end: one posted receive for notices from any peer. Progress
// thread only after start().
class FailureNoticeInbox {
 public:
  static constexpr size_t kMaxBytes = 2048;

  // Posts the receive (on the progress thread, which retires it).
  void start(Transport& transport);
  // True once a notice arrived (then `*notice` holds it); the receive is not
  // posted again. A malformed notice is reported as one from its sender with
  // what could be read of it.
  bool poll(Transport& transport, FailureNotice* notice);
  // The receive while it is still pending, for the caller to cancel and
  // retire; afterwards the inbox holds nothing.
  Request take_pending();

 private:
  Request request_;
  bool posted_ = false;
  uint8_t buffer_[kMaxBytes];
};

}  // namespace fsdp_ext::comm
