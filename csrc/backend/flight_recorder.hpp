// torch's Flight Recorder for fsdp_ext groups: the last N ops of every group
// in this process, dumped in torch's own format (a pickled dict, version
// "2.10"), so that torch's analyser (python -m
// torch.distributed.flight_recorder.fr_trace, torchfrtrace) reads the dumps
// of all ranks of a job and names the op where they diverged.
//
// torch keeps its recorder inside libtorch and exports none of it, so a
// plugin cannot add to torch's; this one writes the same records:
//   * on with TORCH_FR_BUFFER_SIZE (or TORCH_NCCL_TRACE_BUFFER_SIZE) > 0:
//     that many entries, the oldest overwritten;
//   * an entry per op, made when it is queued ("scheduled"), marked
//     "started" and "completed" from the progress thread;
//   * dumped to torch's DebugInfoWriter file (TORCH_FR_DUMP_TEMP_FILE +
//     global rank) when a collective fails (timeout, lost peer, mismatch),
//     once per process, and on request (torch_fsdp_ext.dump_flight_recorder).
//
// Note [gloo's prefix in profiling names]
// fr_trace parses each entry's profiling_name as "<library>:<op>" and
// accepts only the libraries it knows (nccl, gloo, ...). Our entries carry
// gloo's prefix, the CPU library it knows, and op names from its
// vocabulary; the dump's comm_lib_version says they come from fsdp_ext.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace fsdp_ext::backend {

class FlightRecorder {
 public:
  static FlightRecorder& instance();
  bool enabled() const { return capacity_ > 0; }

  struct Op {
    std::string group_name;  // the group's uid (process_group[0])
    std::string group_desc;  // its description (process_group[1])
    const std::vector<uint64_t>* group_ranks;  // global ranks, for pg_config
    uint64_t collective_seq = 0;
    uint64_t p2p_seq = 0;
    uint64_t op_id = 0;
    std::string profiling_name;  // in fr_trace's vocabulary (Note above)
    bool is_p2p = false;
    std::chrono::milliseconds timeout{0};
  };
  // Records an op as it is queued; its id for started() and completed().
  uint64_t record(const Op& op, const std::vector<at::Tensor>& inputs,
                  const std::vector<at::Tensor>& outputs);
  void started(uint64_t id);
  void completed(uint64_t id);

  // The dump, pickled as torch's: {"version", "comm_lib_version", "pg_config",
  // "pg_status", "entries"}. `only_active`: entries not yet completed.
  std::string dump(bool only_active) const;
  // Writes the dump through torch's DebugInfoWriter for `global_rank` (its
  // TORCH_FR_DUMP_TEMP_FILE naming), at most once per process for failures.
  // Returns where it went ("" when the recorder is off); throws
  // std::runtime_error when torch's writer could not write the file.
  std::string write_dump(int global_rank);
  // The same, once per process, for a failed op: never throws (a dump it
  // could not write is logged, and "" returned).
  std::string write_dump_on_failure(int global_rank);

 private:
  FlightRecorder();
  struct Entry {
    uint64_t id = 0;
    Op op;
    int64_t pg_id = 0;
    int64_t time_created_ns = 0;
    int64_t time_started_ns = 0;  // 0: not started
    int64_t time_completed_ns = 0;  // 0: not completed
    std::vector<std::vector<int64_t>> input_sizes, output_sizes;
    std::vector<std::string> input_dtypes, output_dtypes;
  };
  Entry* find(uint64_t id);  // mutex_ held; null once overwritten

  const size_t capacity_;
  mutable std::mutex mutex_;
  std::vector<Entry> ring_;  // ring_[id % capacity_]
  uint64_t next_id_ = 0;
  // Groups in the order first seen: their pg_id, and their desc and ranks as
  // at their first op (both are set before a group's first op).
  std::map<std::string, int64_t> group_ids_;
  std::map<std::string, std::pair<std::string, std::vector<uint64_t>>> groups_;
  std::atomic<bool> dumped_on_failure_{false};
};

// The op's name in fr_trace's vocabulary, from our profiling title
// ("fsdp_ext:all_gather_into_tensor" -> "gloo:_all_gather_base").
// `peer`: the other rank of a send or receive (group ranks), else -1.
std::string flight_recorder_name(const char* profiling_title, int rank, int peer);

}  // namespace fsdp_ext::backend
