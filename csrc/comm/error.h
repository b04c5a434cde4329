// Errors raised by the torch-free communication core.
//
// The core never crashes or hangs on a failed transfer: every failure becomes a
// CommError carrying what went wrong and which peer was involved. The c10d
// adapter turns it into torch.distributed.DistBackendError for Python.
#pragma once

#include <stdexcept>
#include <string>

namespace fsdp_ext::comm {

enum class ErrorKind {
  kTimeout,    // a peer did not arrive within the operation's deadline
  kTransport,  // UCX reported a failure (peer gone, truncated message, ...)
  kMismatch,   // ranks disagreed on sizes: a peer sent a different byte count
  kAborted,    // the group was aborted or shut down with the op pending
  kBroken,     // an earlier failure left the group unusable
  kPeerLost,   // a peer process exited or its connection failed
  kDevice,     // a CUDA runtime call failed (csrc/device)
  kPeerFailed, // a peer's collective failed and it stopped the group (its
               // failure notice: comm/failure_notice.h)
  kPeerLeft,   // a peer destroyed the group after its last collective, and
               // this rank's collective comes after that one (its departure
               // notice: Note [a peer that destroyed the group]); keep this last
};

const char* error_kind_name(ErrorKind kind);

class CommError : public std::runtime_error {
 public:
  CommError(ErrorKind kind, const std::string& message)
      : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

}  // namespace fsdp_ext::comm
