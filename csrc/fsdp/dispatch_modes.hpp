// The torch dispatch modes the runtime must serve differently: the two whose
// active state changes how it makes and frees memory.
//
// memory_tracker_active(): torch's memory tracker is watching, a
// torch.distributed._tools.mem_tracker.MemTracker (FSDPMemTracker is one) on
// the dispatch mode stack. Such a tracker counts a tensor from the dispatched
// op that made it, and a storage's size from torch.UntypedStorage.resize_,
// which it patches. The runtime's host buffers come from its block cache,
// made below the dispatcher, and its unsharded storages are freed and
// re-allocated in C++, so the tracker would see neither (and FSDPMemTracker
// fails on a collective's buffer it never saw made). While one is watching,
// those buffers are made and resized the way upstream's are. Other modes
// (selective activation checkpointing's, CommDebugMode) keep the cache.
//
// fake_mode_active(): a FakeTensorMode is active (torch keeps it apart from
// the mode stack, under its FAKE key). Its tensors have no data, so a step on
// fake parameters (a fake process group and FSDPMemTracker estimating a
// model's memory without running it, as torchtitan's memory estimation does)
// needs every buffer made through the dispatcher, where the mode turns it
// fake, every storage resized through torch.UntypedStorage.resize_, and every
// copy done with ATen ops (copy_kernels.hpp), as upstream's are.
#pragma once

#include "fsdp/training_state.hpp"  // FSDP_EXT_HIDDEN

namespace fsdp_ext::fsdp {

// Cheap when no dispatch mode is active (a thread-local read); otherwise
// looks at the mode stack with the GIL.
FSDP_EXT_HIDDEN bool memory_tracker_active();

// A thread-local read.
FSDP_EXT_HIDDEN bool fake_mode_active();

// Buffers and storages go through the dispatcher and Python's resize_ (either
// mode above) instead of the block cache and C++.
inline bool allocations_through_dispatcher() {
  return fake_mode_active() || memory_tracker_active();
}

}  // namespace fsdp_ext::fsdp
