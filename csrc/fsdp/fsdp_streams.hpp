// FsdpStreams: the side streams FSDP runs its collectives on when parameters
// live on an accelerator (CUDA), and the events that order them against the
// compute stream (upstream FSDP2's FSDPCommContext streams).
//
//   all_gather_copy_in  copy-in of the next group's shards while the current
//                       group computes (forward and backward unshards)
//   all_gather          the all-gather collective itself
//   reduce_scatter      gradient copy-in's consumer: the reduce-scatter and
//                       the work after it (divide, cast, accumulate)
//   all_reduce          HSDP's all-reduce across replicas
//
// The first three have high priority so that communication kernels are not
// queued behind compute. A stream "waits" by an event recorded on the other
// stream; the host never blocks here. Everything goes through c10's
// device-generic Stream/Event (the device's guard implementation, registered
// by torch's CUDA library at load), so this file needs no CUDA headers and
// builds with a CPU-only torch, where it is never instantiated.
//
// Memory: a tensor allocated while stream S is current belongs to S in the
// caching allocator, which may hand its block to the next allocation on S as
// soon as the host drops the tensor. A buffer written on one stream and read
// on another is therefore kept by the runtime (with the event of its last
// use) until the allocating stream has waited for that event: Note [keeping
// collective buffers alive across streams] in comm_context.hpp. No
// record_stream on this path.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <memory>

#include "fsdp/training_state.hpp"  // FSDP_EXT_HIDDEN

namespace fsdp_ext::fsdp {

// An event recorded on a stream, shared by whoever must wait for it.
using StreamEvent = std::shared_ptr<c10::Event>;

class FSDP_EXT_HIDDEN FsdpStreams {
 public:
  // `device`: an accelerator device with an index (cuda:N).
  explicit FsdpStreams(c10::Device device);

  c10::Device device() const { return device_; }
  // The stream the caller is issuing compute on now (autograd's, the user's).
  c10::Stream current() const;
  c10::Stream all_gather_copy_in() const { return all_gather_copy_in_; }
  c10::Stream all_gather() const { return all_gather_; }
  c10::Stream reduce_scatter() const { return reduce_scatter_; }
  c10::Stream all_reduce() const { return all_reduce_; }

  // An event marking everything enqueued on `stream` so far.
  StreamEvent record(c10::Stream stream) const;
  // `waiter` runs nothing more until `event` has happened (no-op for null).
  static void wait_event(c10::Stream waiter, const StreamEvent& event);
  // `waiter` waits for everything enqueued on `waited` so far.
  void wait_stream(c10::Stream waiter, c10::Stream waited) const;
  // Both all-gather streams wait for `event` (a buffer they allocate from may
  // be reused only after it, or data they read is written before it).
  void all_gather_streams_wait(const StreamEvent& event) const;

 private:
  c10::Device device_;
  c10::Stream all_gather_copy_in_;
  c10::Stream all_gather_;
  c10::Stream reduce_scatter_;
  c10::Stream all_reduce_;
};

}  // namespace fsdp_ext::fsdp
