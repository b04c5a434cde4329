#include "fsdp/fsdp_streams.hpp"

#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>

namespace fsdp_ext::fsdp {
namespace {

// Stream priorities as torch's: lower is higher; -1 is the highest CUDA
// offers (upstream asks for the same with Stream(priority=-1)).
constexpr int kHighPriority = -1;
constexpr int kDefaultPriority = 0;

c10::Stream new_stream(c10::Device device, int priority) {
  return c10::impl::VirtualGuardImpl(device.type()).getNewStream(device, priority);
}

c10::Device checked(c10::Device device) {
  TORCH_CHECK_VALUE(!device.is_cpu() && device.has_index(),
                    "fsdp_ext FsdpStreams: an accelerator device with an index, got ",
                    device.str());
  return device;
}

}  // namespace

FsdpStreams::FsdpStreams(c10::Device device)
    : device_(checked(device)),
      all_gather_copy_in_(new_stream(device_, kHighPriority)),
      all_gather_(new_stream(device_, kHighPriority)),
      reduce_scatter_(new_stream(device_, kHighPriority)),
      // As upstream: the all-reduce runs after the reduce-scatter it follows
      // and never blocks compute, so it keeps the default priority.
      all_reduce_(new_stream(device_, kDefaultPriority)) {}

c10::Stream FsdpStreams::current() const {
  return c10::impl::VirtualGuardImpl(device_.type()).getStream(device_);
}

StreamEvent FsdpStreams::record(c10::Stream stream) const {
  auto event = std::make_shared<c10::Event>(device_.type());
  event->record(stream);
  return event;
}

void FsdpStreams::wait_event(c10::Stream waiter, const StreamEvent& event) {
  if (event) event->block(waiter);
}

void FsdpStreams::wait_stream(c10::Stream waiter, c10::Stream waited) const {
  if (waiter == waited) return;
  wait_event(waiter, record(waited));
}

void FsdpStreams::all_gather_streams_wait(const StreamEvent& event) const {
  wait_event(all_gather_copy_in_, event);
  wait_event(all_gather_, event);
}

}  // namespace fsdp_ext::fsdp
