// The two state enums of an FSDP parameter group, numbered like upstream
// FSDP2's Python enums (enum.auto() starts at 1) so values cross the Python
// boundary unchanged.
#pragma once

#include <cstdint>

// Runtime classes hold pybind11 objects, which are hidden-visibility types;
// the classes must be too (they never cross the shared library's boundary).
#define FSDP_EXT_HIDDEN __attribute__((visibility("hidden")))

namespace fsdp_ext::fsdp {

// Where a group is in the training step. Groups go IDLE -> FORWARD -> IDLE ->
// PRE_BACKWARD -> POST_BACKWARD -> IDLE (the root's end-of-backward callback).
enum class TrainingState : int8_t { kForward = 1, kPreBackward = 2, kPostBackward = 3, kIdle = 4 };

// Which tensors the modules currently hold: the sharded DTensor parameters,
// the smaller-world sharded parameters kept after forward
// (reshard_after_forward=int), or the unsharded (all-gathered) parameters.
enum class ShardedState : int8_t { kSharded = 1, kShardedPostForward = 2, kUnsharded = 3 };

}  // namespace fsdp_ext::fsdp
