// How FSDP splits one dimension of a parameter over the shard ranks: every
// rank owns ceil(size / world) slots, the last ranks' slots partly or wholly
// padding (upstream FSDP2's layout, which torch.chunk also gives). The one
// place this is computed: sharding at fully_shard (Python calls it through
// _C._fsdp_shard_extent), re-padding after load_state_dict(assign=True), the
// post-forward shards of reshard_after_forward=int, and the reduce-scatter
// layout (copy_kernels.cpp's padded_chunk_numel).
#pragma once

#include <algorithm>
#include <cstdint>

namespace fsdp_ext::fsdp {

struct ShardExtent {
  int64_t padded;  // slots every rank holds along the dimension
  int64_t start;   // the first real index this rank owns
  int64_t length;  // real (unpadded) indices this rank owns, 0..padded
};

inline ShardExtent shard_extent(int64_t size, int64_t world, int64_t rank) {
  const int64_t padded = (size + world - 1) / world;
  const int64_t start = std::min(rank * padded, size);
  return {padded, start, std::max<int64_t>(0, std::min(padded, size - start))};
}

}  // namespace fsdp_ext::fsdp
