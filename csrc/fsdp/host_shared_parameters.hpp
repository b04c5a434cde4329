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
// Note [the backward reuses the forward's host-shared values]
// Resharding a host-shared group frees nothing, so when its backward
// unshards it again, the memory still holds what the forward's unshard
// wrote and, across hosts, received. Re-sending it would cross the network
// a second time for nothing. So a backward unshard across hosts first
// compares this rank's slots with its current shards (cast as written),
// byte for byte: any change, through the optimizer, load_state_dict,
// `.data` or anything else, is seen. Unchanged, the rank writes nothing
// and enters without waiting (enter_unchanged: leaving its slots as they
// are cannot disturb a slower rank still reading them); changed, it enters
// and writes as in step 2. It then sends each column peer a flag (tag
// kColumnFlagTag): 1 when its slots changed, followed by their data. A
// peer's data is received only when its flag says it follows, and only
// once every rank of the host has entered (receiving writes this host's
// memory). Then step 3: publish and wait for every rank's publish, since a
// rank of the host may have written. So an unchanged backward moves a flag
// per peer instead of the shards, and ranks that disagree (shards changed
// on some ranks only) still exchange exactly what changed. Forward
// unshards always write and send (their receives are posted at unshard, so
// a prefetched unshard overlaps the wire with compute). Within one host
// the comparison would cost what the write costs, so every unshard writes.
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
  // The backward's changed-or-not flags (Note [the backward reuses the
  // forward's host-shared values]).
  static constexpr int kColumnFlagTag = 0x48535031;  // "HSP1"

  // `control`: kControlBytesPerRank * pids.size() bytes of the memory every
  // rank of this host maps, zeroed before first use; `rank`: this rank's
  // position among them; `group_ranks` and `pids`: their shard-group ranks
  // (which errors name) and processes, in that order; `label` names the
  // group in errors.
  HostSharedParameters(at::Tensor control, int64_t rank, const std::vector<int64_t>& group_ranks,
                       const std::vector<int64_t>& pids, std::chrono::milliseconds timeout,
                       std::string label);

  void enter(uint64_t epoch);    // steps 1 of the note
  // Step 1 for a rank that will write nothing: entered, without waiting.
  void enter_unchanged(uint64_t epoch);
  // The wait of step 1, for such a rank that writes after all (it receives
  // a changed column peer's slots into this host's memory).
  void wait_until_all_entered(uint64_t epoch) { wait_for_all(kEntered, epoch); }
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
