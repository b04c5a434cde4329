// HostSharedParameters: the agreement between the ranks of one host that
// share one copy of a group's unsharded parameters
// (FSDPModule.set_host_shared_parameters).
//
// Every rank of the shard group maps the same memory: the parameters, each
// padded to its full size and laid out one after another, and a control
// block with two epoch words per rank. An unshard writes no collective: each
// rank copies its own shard into its slot of every parameter, and the
// parameters every rank registers are views of that memory.
//
// Note [ordering of host-shared unsharded parameters]
// A rank must not overwrite its slots while a slower rank of the host may
// still read the previous values, and must not read the parameters before
// every rank has written its slots. Each unshard of the group is an epoch e
// (every rank counts its unshards of the group, in the same order, as it
// issues the same collectives):
//   1. enter(e): this rank is done with epoch e - 1. It entered e only after
//      resharding e - 1 (a group is unsharded once at a time), so nothing of
//      its own still reads those values, or the values are unchanged
//      (autograd's saved views read by the backward of the same step: its
//      re-unshard writes what it wrote before). It then waits until every
//      rank of the host has entered e.
//   2. it writes its slots (the shard, cast to the parameter dtype);
//   3. publish(e): its slots are complete; it waits until every rank has
//      published e, and only then lets the module read the parameters.
// So the writes of epoch e happen after every rank has left e - 1 and before
// any rank reads e, through reshard after forward (True, False, an int:
// the same memory, nothing to keep per rank), prefetches (an unshard issued
// early is the same epoch, only earlier), several forwards per backward,
// activation checkpointing (recomputation reads epoch e, unchanged), gradient
// accumulation (no write between the unshards but the same values) and the
// optimizer step (it changes the shards, which reach the shared copy only at
// the next epoch's step 2, after everyone has entered it). The waits are
// the same synchronisation an all-gather has; they add no ordering a
// collective would not.
//
// Note [host-shared parameters across hosts]
// When the shard group spans H hosts with L ranks each, every host maps its
// own copy, with the same layout (every shard-group rank's slot), and the
// waits above are among the L ranks of the host. The rank at position l on
// each host forms column l. At step 2, after writing its own slots, a rank
// sends them to its column peers (point-to-point on the shard group, one
// message per parameter and peer, tag kColumnTag) and receives theirs
// straight into their slots of its host's memory: only the other hosts'
// shards cross the network, each once per host, and nothing is copied out.
// It publishes (step 3) once its sends and receives are done
// (wait_for_unshard), so the epoch's writes by the network, too, come after
// every rank of the host entered it and before any reads it; and its own
// slots, which its sends read, are not rewritten before the next epoch's
// enter. The exchange is issued at unshard and waited at wait_for_unshard,
// so a prefetched unshard overlaps the wire with compute, as an all-gather.
//
// A rank that exits while another waits for it is an error for the waiting
// rank within milliseconds (its pidfd becomes readable); a rank that hangs
// is an error after the group's timeout. Both name the rank and the phase.
#pragma once

#include <ATen/ATen.h>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "comm/unique_fd.h"
#include "fsdp/training_state.hpp"  // FSDP_EXT_HIDDEN

namespace fsdp_ext::fsdp {

class FSDP_EXT_HIDDEN HostSharedParameters {
 public:
  // Bytes of control block per rank: one cache line, so no two ranks'
  // words share one.
  static constexpr int64_t kControlBytesPerRank = 64;
  // The tag of the column exchange's messages (Note [host-shared parameters
  // across hosts]): apart from the tags users pick for their own.
  static constexpr int kColumnTag = 0x48535030;  // "HSP0"

  // `control`: kControlBytesPerRank * pids.size() bytes of the memory every
  // rank of this host maps, zeroed before first use; `rank`: this rank's
  // position among them; `group_ranks` and `pids`: their shard-group ranks
  // (which errors name) and processes, in that order; `label` names the
  // group in errors.
  HostSharedParameters(at::Tensor control, int64_t rank, const std::vector<int64_t>& group_ranks,
                       const std::vector<int64_t>& pids, std::chrono::milliseconds timeout,
                       std::string label);

  void enter(uint64_t epoch);    // steps 1 of the note
  void publish(uint64_t epoch);  // step 3

 private:
  enum Word { kEntered = 0, kPublished = 1 };
  uint64_t* word(int64_t rank, Word which) const;
  void wait_for_all(Word which, uint64_t epoch);

  at::Tensor control_;  // keeps the mapping alive
  int64_t rank_;  // position among this host's ranks
  std::vector<int64_t> group_ranks_;
  std::vector<int64_t> pids_;
  std::vector<comm::UniqueFd> pidfds_;  // by rank; invalid for this rank
  std::chrono::milliseconds timeout_;
  std::string label_;
};

}  // namespace fsdp_ext::fsdp
