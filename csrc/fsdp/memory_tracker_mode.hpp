// Whether torch's memory tracker is watching: a
// torch.distributed._tools.mem_tracker.MemTracker (FSDPMemTracker is one) on
// the torch dispatch mode stack.
//
// Why: such a tracker counts a tensor from the dispatched op that made it,
// and a storage's size from torch.UntypedStorage.resize_, which it patches.
// The runtime's host buffers come from its block cache, made below the
// dispatcher, and its unsharded storages are freed and re-allocated in C++,
// so the tracker would see neither (and FSDPMemTracker fails on a
// collective's buffer it never saw made). While one is watching, those
// buffers are made and resized the way upstream's are. Only for a tracker:
// other modes (selective activation checkpointing's, CommDebugMode) keep
// the cache, and a fake-tensor mode must not turn the buffers fake.
#pragma once

#include "fsdp/training_state.hpp"  // FSDP_EXT_HIDDEN

namespace fsdp_ext::fsdp {

// Cheap when no dispatch mode is active (a thread-local read); otherwise
// looks at the mode stack with the GIL.
FSDP_EXT_HIDDEN bool memory_tracker_active();

}  // namespace fsdp_ext::fsdp
