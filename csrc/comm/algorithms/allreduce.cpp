// All-reduce over a bucket, in place.
//   direct: every rank sends its whole buffers to every other rank and
//           reduces all n contributions locally in rank order: one round, for
//           small messages; the same order everywhere gives identical results.
//   ring  : reduce-scatter into this rank's blocks, then all-gather the
//           blocks (each picks its own algorithm); each block is reduced once,
//           by its owner.
//   shm   : the same two phases through shared memory: each rank reduces its
//           block of every member straight out of the peers' buffers, in
//           place, then copies the peers' reduced blocks out of theirs.
#include "comm/algorithm_selection.h"
#include "comm/algorithms/algorithms.h"
#include "comm/algorithms/hierarchical.h"
#include "comm/algorithms/shared_source_exchange.h"
#include "comm/algorithms/span_helpers.h"

namespace fsdp_ext::comm {
namespace {

void allreduce_direct(OpContext& context, const std::vector<AllreduceMember>& bucket) {
  const int n = context.size();
  const int r = context.rank();
  for (const AllreduceMember& member : bucket) detail::pre_scale_in_place(member.data, member.spec);
  // contributions[m][p]: rank p's buffer for member m.
  std::vector<std::vector<const void*>> contributions(bucket.size(),
                                                      std::vector<const void*>(n, nullptr));
  std::vector<Request> requests;
  for (uint32_t m = 0; m < bucket.size(); ++m) {
    for (int k = 1; k < n; ++k) {
      const int from = detail::wrap(r - k, n);
      void* staging = context.scratch(bucket[m].data.bytes);
      contributions[m][from] = staging;
      requests.push_back(context.recv(from, m, staging, bucket[m].data.bytes));
    }
  }
  for (uint32_t m = 0; m < bucket.size(); ++m) {
    for (int k = 1; k < n; ++k) {
      requests.push_back(context.send(detail::wrap(r + k, n), m, bucket[m].data.data,
                                      bucket[m].data.bytes));
    }
  }
  context.wait_all(requests);
  for (size_t m = 0; m < bucket.size(); ++m) {
    const AllreduceMember& member = bucket[m];
    const size_t count = member.data.bytes / element_size(member.spec.type);
    contributions[m][r] = member.data.data;
    // Sum in rank order into a copy of rank 0's buffer (rank 0 can use its own).
    void* accumulator = r == 0 ? member.data.data : context.scratch(member.data.bytes);
    detail::copy_if_distinct(accumulator, contributions[m][0], member.data.bytes);
    for (int p = 1; p < n; ++p) {
      reduce_into(accumulator, contributions[m][p], count, member.spec.type, member.spec.kind);
    }
    detail::copy_if_distinct(member.data.data, accumulator, member.data.bytes);
    detail::post_divide(member.data.data, member.data.bytes, member.spec);
  }
}

void allreduce_ring(OpContext& context, const std::vector<AllreduceMember>& bucket) {
  const int n = context.size();
  const int r = context.rank();
  std::vector<ReduceScatterMember> scatter;
  std::vector<AllgatherMember> gather;
  for (const AllreduceMember& member : bucket) {
    const std::vector<MutableSpan> blocks =
        detail::split_blocks(member.data, element_size(member.spec.type), n);
    std::vector<ConstSpan> inputs;
    for (const MutableSpan& block : blocks) inputs.push_back(ConstSpan{block.data, block.bytes});
    scatter.push_back(ReduceScatterMember{inputs, blocks[r], member.spec});
    gather.push_back(AllgatherMember{inputs[r], blocks});
  }
  reduce_scatter(context, scatter);
  context.begin_next_collective();
  allgather(context, gather);
}

void allreduce_shared(OpContext& context, SharedMemoryDomain& domain,
                      const std::vector<AllreduceMember>& bucket) {
  const int n = context.size();
  const int r = context.rank();
  std::vector<std::vector<MutableSpan>> blocks;
  for (const AllreduceMember& member : bucket) {
    blocks.push_back(detail::split_blocks(member.data, element_size(member.spec.type), n));
  }
  // Phase 1: reduce this rank's block of every member out of the peers'
  // buffers, in place. Peers read only their own block p of this rank's
  // buffer, never block r, so block r can be overwritten while they read.
  // Large blocks of ordinary memory are offered as process memory
  // instead of being staged by their owner, and read here a cache-sized chunk
  // at a time, so the reduction takes them from cache.
  SharedSourceExchange inputs(context, domain, 0, /*staging_slot=*/0,
                              kAllreduceProcessReadMinBytes,
                              SharedExchangeKind::kAllReduceInputs);
  for (int p = 0; p < n; ++p) {
    if (p == r) continue;
    std::vector<ConstSpan> pieces;
    std::vector<size_t> sizes;
    for (size_t m = 0; m < bucket.size(); ++m) {
      pieces.push_back(ConstSpan{blocks[m][p].data, blocks[m][p].bytes});
      sizes.push_back(blocks[m][r].bytes);
    }
    inputs.offer(p, std::move(pieces));
    inputs.expect(p, std::move(sizes));
  }
  // Each rank's blocks are cut from its own tensors, so a peer whose tensor
  // is longer can still offer this rank a block of the expected size: the
  // tensors' sizes are checked too, so that every rank sees the mismatch
  // before it reads (not only the ranks whose blocks differ, while the
  // others read buffers their owner abandons). And their reductions: a
  // dtype of the same size (bf16 against fp16), another op or AVG against
  // SUM agree on every size.
  std::vector<size_t> whole_bytes;
  std::vector<ReduceSpec> reductions;
  for (const AllreduceMember& member : bucket) {
    whole_bytes.push_back(member.data.bytes);
    reductions.push_back(member.spec);
  }
  inputs.set_whole_bytes(whole_bytes);
  inputs.set_reductions(std::move(reductions));
  for (const AllreduceMember& member : bucket) detail::pre_scale_in_place(member.data, member.spec);
  inputs.exchange();
  for (size_t m = 0; m < bucket.size(); ++m) {
    MutableSpan mine = blocks[m][r];
    // Own block first, then the peers in rank order, as reduce-scatter does.
    // (AVG's divide included, block by block.)
    inputs.reduce_pieces(m, mine, mine.data, bucket[m].spec);
  }
  // Phase 2: every rank copies the peers' reduced blocks out of their
  // buffers (in place for buffers from the pool; large ordinary blocks with
  // process_vm_readv; the rest staged). A peer's phase-2 header also says it
  // has finished reading this rank's buffers in phase 1, so once every header
  // is in, blocks p can be overwritten.
  SharedSourceExchange results(context, domain, 2, /*staging_slot=*/1,
                               kAllreduceProcessReadMinBytes,
                               SharedExchangeKind::kAllReduceResults);
  std::vector<ConstSpan> reduced_blocks;
  for (size_t m = 0; m < bucket.size(); ++m) {
    reduced_blocks.push_back(ConstSpan{blocks[m][r].data, blocks[m][r].bytes});
  }
  for (int p = 0; p < n; ++p) {
    if (p == r) continue;
    std::vector<size_t> sizes;
    for (size_t m = 0; m < bucket.size(); ++m) sizes.push_back(blocks[m][p].bytes);
    results.offer(p, reduced_blocks);
    results.expect(p, std::move(sizes));
  }
  results.set_whole_bytes(std::move(whole_bytes));
  results.exchange();
  for (size_t m = 0; m < bucket.size(); ++m) {
    for (int p = 0; p < n; ++p) {
      if (p != r) results.copy_out(p, m, blocks[m][p].data);
    }
  }
  results.finish();
}

}  // namespace

void allreduce(OpContext& context, const std::vector<AllreduceMember>& bucket) {
  if (hierarchical_allreduce(context, bucket)) return;

  const int n = context.size();
  if (n == 1) {
    for (const AllreduceMember& member : bucket) {
      // A group of one still applies PREMUL_SUM's factor and AVG's divide.
      detail::pre_scale_in_place(member.data, member.spec);
      detail::post_divide(member.data.data, member.data.bytes, member.spec);
    }
    return;
  }
  size_t total = 0;
  for (const AllreduceMember& member : bucket) total += member.data.bytes;
  SharedMemoryDomain* shared = context.shared_memory();
  switch (select_allreduce(total, n, shared != nullptr)) {
    case Algorithm::kSharedMemory:
      return allreduce_shared(context, *shared, bucket);
    case Algorithm::kRing:
      return allreduce_ring(context, bucket);
    case Algorithm::kDirect:
      return detail::in_step_windows(context, bucket, 1,
                                     [&](const auto& window) { allreduce_direct(context, window); });
  }
}

void allreduce(OpContext& context, MutableSpan data, const ReduceSpec& spec) {
  allreduce(context, std::vector<AllreduceMember>{AllreduceMember{data, spec}});
}

}  // namespace fsdp_ext::comm
