// The c10d::Backend behind dist.init_process_group("fsdp_ext").
//
// Each method validates its arguments on the calling thread, wraps the
// tensors as byte spans, and queues one operation on the group's progress
// engine (comm::ProgressEngine), returning an FsdpExtWork. CPU tensors go over
// UCX and shared memory; CUDA tensors go to the group's CUDA path
// (cuda_collectives.hpp), which builds on this group's CPU transport.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "backend/cuda_collectives.hpp"
#include "backend/fsdp_ext_work.hpp"
#include "backend/op_label.hpp"
#include "comm/algorithms/algorithms.h"
#include "backend/peer_activity.hpp"
#include "comm/progress_engine.h"
#include "comm/shared_buffer_pool.h"
#include "comm/shared_memory_domain.h"
#include "comm/small_op_channel.h"

namespace fsdp_ext::backend {

class FsdpExtBackend : public c10d::Backend {
 public:
  // `nccl_factory` (may be empty): makes torch's NCCL group over the same
  // ranks and store, for CUDA tensors of ranks with GPUs of their own.
  FsdpExtBackend(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                 std::chrono::milliseconds timeout, std::string group_name,
                 NcclFactory nccl_factory = {});
  ~FsdpExtBackend() override;

  const std::string getBackendName() const override { return "fsdp_ext"; }
  bool supportsCoalescing() const override { return true; }
  bool supportsSplitting() const override { return true; }

  // What torch asks of a backend besides its ops (backend_surface.cpp).
  // The options the group was made with (timeout, name, global ranks):
  // ProcessGroup.split_group copies them for the new group.
  c10::intrusive_ptr<c10d::Backend::Options> getBackendOptions() override;
  // The ranks of this group among the default group's (from torch's
  // factory options; empty: the group's own ranks, as for the default group).
  void set_global_ranks(std::vector<uint64_t> global_ranks);
  // A new group over `ranks` (this group's ranks, this one among them) whose
  // members find each other through `store`; nullptr for a rank not in it.
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store,
                                          const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override;
  c10::intrusive_ptr<c10d::Backend> merge(const c10::intrusive_ptr<c10d::Store>& store,
                                          const c10::intrusive_ptr<Options>& opts,
                                          const int& rank, const int& size) override;
  // The group's collective sequence number: how many collectives this rank
  // has issued on it, the same on every rank while they agree (what
  // TORCH_DISTRIBUTED_DEBUG=DETAIL's wrapper compares). Counting starts at 0
  // when the group is made, so setting it needs no exchange (as gloo's).
  void setSequenceNumberForGroup() override {}
  uint64_t getSequenceNumberForGroup() override { return collective_seq_.load(); }
  // From now on every op's Work records when it started and ended
  // (Work._get_duration()).
  void enableCollectivesTiming() override { timing_enabled_.store(true); }

  // Allocation from the group (FSDP2's set_allocate_memory_from_process_group
  // _for_comm): CPU tensors in shared memory, and CUDA tensors in device
  // buffers exported once (CudaBuffers), that peers read in place. Only
  // offered where that is real: every rank on one host and able to map the
  // others' memory (decided at init; FSDP_EXT_SHARED_MEMORY=0 turns it off),
  // and for CUDA a build with the CUDA path whose route, once chosen, reads
  // in place (allocation.cpp).
  bool supportsTensorAlloc(c10::DeviceIndex device_index) override;
  // Why this group does not hand out buffers on cuda:`device` ("": it does).
  std::string why_no_cuda_buffers(int device) const;
  at::Tensor allocateTensor(long size, at::TensorOptions options = {}) override;
  bool shared_memory_enabled() const { return shared_memory_ && shared_memory_->enabled(); }
  comm::SharedPoolStats pool_stats() const { return pool_->stats(); }
  size_t mapped_peer_segments() const;
  const comm::ProgressEngine& engine() const { return *engine_; }
  // How small collectives ran (tests check the path an op took): finished
  // on the calling thread, handed to the engine part way, or queued whole.
  struct SmallOpCounts {
    bool enabled = false;
    uint64_t on_caller = 0;
    uint64_t handed_over = 0;
    uint64_t queued = 0;
  };
  SmallOpCounts small_op_counts() const {
    return {small_ops_enabled_, small_on_caller_.load(), small_handed_over_.load(),
            small_queued_.load()};
  }
  const comm::SharedMemoryDomain& shared_memory_domain() const { return *shared_memory_; }
  void setTimeout(std::chrono::milliseconds timeout) override;
  std::chrono::milliseconds default_timeout() const { return default_timeout_; }

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  // COO sparse tensors, summed as gloo sums them (allreduce hands sparse
  // tensors here): the bitwise result DDP with sparse gradients gets on gloo.
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors,
                                        const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  // outputs[r][i] receives rank r's inputs[i]: one bucket of all-gathers.
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(
      std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(
      std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(
      at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(
      std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs,
                                          std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank,
                                      int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors,
                                               int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;
  // gloo's monitored barrier (monitored_barrier.cpp): rank 0 names the ranks
  // that did not arrive within the timeout. torch's dist.monitored_barrier
  // refuses every backend not named gloo; torch_fsdp_ext.monitored_barrier
  // and ProcessGroup.monitored_barrier reach this.
  void monitoredBarrier(const c10d::BarrierOptions& opts, bool wait_all_ranks) override;

  void startCoalescing() override;
  c10::intrusive_ptr<c10d::Work> endCoalescing() override;

  void abort() override;
  void shutdown() override;

  // The CUDA path's host side: every rank's `local` bytes (the same length
  // on every rank), gathered through this group's CPU transport under the
  // CUDA op's label, so an error or a timeout names that op. Blocks.
  std::vector<std::vector<uint8_t>> exchange_bytes(const OpLabel& label,
                                                   const std::vector<uint8_t>& local,
                                                   std::chrono::milliseconds timeout);
  // The CUDA path's part of a collective failed on this rank before its host
  // collective, which the peers are in or about to enter: fails this rank's
  // op as a collective of the group, so that the peers hear of it (Note [a
  // failure told to the peers]) and fail within seconds instead of at their
  // timeout. The group is broken afterwards, as after any failed
  // collective. Always throws (DistBackendError naming the op and `reason`).
  [[noreturn]] void fail_collective(const OpLabel& label, std::chrono::milliseconds timeout,
                                    const std::string& reason);
  // How this group's CUDA ops run ("" before its first CUDA op).
  std::string cuda_route_description() const;
  // The group's device buffers on `device` (-1: the current one), made at
  // its first CUDA allocation or when its CUDA path is made; the IPC route
  // exports them. A rank uses one device per group.
  std::shared_ptr<CudaBuffers> cuda_buffers(const OpLabel& label, int device);
  // Where this group's CUDA ops took their data, and its device buffers'
  // counters (zero before its first CUDA op / allocation).
  CudaPathCounters cuda_path_counters() const;
  CudaBuffers::Stats cuda_buffer_stats() const;

  // Shuts down every live fsdp_ext backend (registered with Python's atexit,
  // so threads and UCX resources are released before interpreter teardown).
  static void shutdown_all();

 private:
  using Body = std::function<void(comm::OpContext&)>;

  // The members an op contributes to a bucket, so that same-kind ops issued
  // between startCoalescing and endCoalescing run as one fused bucket.
  struct BucketMembers {
    std::vector<comm::AllgatherMember> allgather;
    std::vector<comm::ReduceScatterMember> reduce_scatter;
    std::vector<comm::AllreduceMember> allreduce;
    bool empty() const {
      return allgather.empty() && reduce_scatter.empty() && allreduce.empty();
    }
  };
  static Body bucket_body(std::shared_ptr<const BucketMembers> members);

  OpLabel label(const char* op) const;
  // The Work of an op about to be queued or run: its profiler record over
  // `inputs`, its sequence numbers (taken here for ops with a profiling
  // title, those a user issued: collective, or point-to-point with `peer`),
  // timing when enabled, and its Flight Recorder entry when that is on.
  c10::intrusive_ptr<FsdpExtWork> make_work(c10d::OpType type, const char* profiling_title,
                                            bool collective,
                                            const std::vector<at::Tensor>& inputs,
                                            std::vector<at::Tensor> outputs,
                                            std::chrono::microseconds wait_spin,
                                            std::chrono::milliseconds timeout, int peer = -1);
  // The group's CUDA path when `tensors` are CUDA tensors (made at the
  // group's first CUDA collective), nullptr when they are CPU tensors;
  // refuses a mix of devices, naming both. A point-to-point op cannot make
  // the path (that is collective) and runs only on a route that has it
  // (CudaCollectives::runs_point_to_point): else NotImplementedError.
  CudaCollectives* cuda_route(const OpLabel& label, const std::vector<at::Tensor>& tensors,
                              bool point_to_point = false);
  // Runs `op` on the CUDA path. Inside a coalescing batch it runs at once
  // (its host exchanges and staged CPU ops bypass the batch) and the batch's
  // Work is its end (Note [CUDA ops in a coalescing batch], coalescing.cpp).
  WorkPtr run_on_cuda(CudaCollectives& cuda, const OpLabel& label, CudaOp op);
  // all_gather_into_tensor under a given label (the public op and exchange_bytes).
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor(const OpLabel& label, at::Tensor& output,
                                                       at::Tensor& input,
                                                       std::chrono::milliseconds timeout);
  std::chrono::milliseconds resolve_timeout(std::chrono::milliseconds requested) const;
  // How long wait() on an op over these tensors polls (Note [how long a wait
  // polls]): by their bytes, and whether this group spans hosts.
  std::chrono::microseconds wait_spin_for_tensors(const std::vector<at::Tensor>& tensors) const;
  // Queues one op (or adds it to the open coalescing batch) and returns its
  // Work. `inputs`: the tensors the op reads (an in-place op lists its
  // tensors as both), kept alive until it ends and shown in its profiler
  // record, as gloo's.
  c10::intrusive_ptr<c10d::Work> enqueue(const OpLabel& label, c10d::OpType type,
                                         const char* profiling_title, bool collective,
                                         std::chrono::milliseconds timeout,
                                         std::vector<at::Tensor> outputs,
                                         std::vector<at::Tensor> inputs, Body body,
                                         std::shared_ptr<const BucketMembers> bucket = nullptr,
                                         int peer = -1);
  // Every tensor an op touches, each once (an in-place op lists its tensors
  // as inputs and outputs): what it keeps alive until it ends.
  static std::vector<at::Tensor> tensors_of_op(const std::vector<at::Tensor>& inputs,
                                               const std::vector<at::Tensor>& outputs);
  // enqueue() for ops that are buckets (all-gather, reduce-scatter, all-reduce).
  c10::intrusive_ptr<c10d::Work> enqueue_bucket(const OpLabel& label, c10d::OpType type,
                                                const char* profiling_title,
                                                std::chrono::milliseconds timeout,
                                                std::vector<at::Tensor> outputs,
                                                std::vector<at::Tensor> inputs,
                                                BucketMembers bucket);

  // A small collective (at most SmallOpChannel::kMaxBytes per rank, group on
  // one host, nothing forced by FSDP_EXT_*_ALGO, not inside a coalescing
  // batch): whether it takes the small-op channel. The same answer on every
  // rank for the same call.
  bool use_small_ops(size_t bytes, const char* algorithm_variable);
  // Runs a small collective through the channel: on the calling thread when
  // the engine is idle (spinning at most the engine's spin time, then
  // handing the wait to the engine), else queued behind the engine's ops.
  // `start` publishes this rank's part as collective `seq`; `finish` computes its result once
  // every rank has published (both throw CommError, without the op's name).
  using SmallStart = std::function<void(comm::SmallOpChannel&, uint64_t seq)>;
  using SmallFinish = std::function<void(const comm::SmallOpChannel&)>;
  c10::intrusive_ptr<c10d::Work> run_small(const OpLabel& label, c10d::OpType type,
                                           const char* profiling_title,
                                           std::chrono::milliseconds timeout,
                                           std::vector<at::Tensor> outputs,
                                           std::vector<at::Tensor> inputs, SmallStart start,
                                           SmallFinish finish);

  std::chrono::milliseconds default_timeout_;
  std::string group_name_;
  std::vector<uint64_t> global_ranks_;
  // The group's store (already private to the group): monitored barriers.
  c10::intrusive_ptr<c10d::Store> store_;
  uint64_t monitored_barriers_ = 0;
  // See getSequenceNumberForGroup and enableCollectivesTiming.
  std::atomic<uint64_t> collective_seq_{0};
  std::atomic<uint64_t> p2p_seq_{0};
  std::atomic<uint64_t> ops_issued_{0};
  std::atomic<bool> timing_enabled_{false};
  std::shared_ptr<comm::SharedBufferPool> pool_;
  std::shared_ptr<comm::SharedMemoryDomain> shared_memory_;
  // Null when this rank offered no channel; used only when enabled (every
  // rank connected, agreed at init).
  std::shared_ptr<comm::SmallOpChannel> small_ops_;
  bool small_ops_enabled_ = false;
  std::atomic<uint64_t> small_on_caller_{0};
  std::atomic<uint64_t> small_handed_over_{0};
  std::atomic<uint64_t> small_queued_{0};
  // CUDA tensors: FSDP_EXT_CUDA_PATH and FSDP_EXT_CUDA_IPC_HANDLES, how to
  // make torch's NCCL group, and the path itself with its device, made at
  // the first CUDA op.
  CudaChoice cuda_choice_;
  NcclFactory nccl_factory_;
  mutable std::mutex cuda_mutex_;
  std::shared_ptr<CudaCollectives> cuda_;
  int cuda_device_ = -1;
  // Its own lock: the path's set-up (under cuda_mutex_) takes the buffers.
  mutable std::mutex cuda_buffers_mutex_;
  std::shared_ptr<CudaBuffers> cuda_buffers_;
  std::unique_ptr<comm::ProgressEngine> engine_;
  // After engine_: stopped (in shutdown) and destroyed before it.
  std::unique_ptr<PeerActivityBoard> activity_board_;

  // Coalescing: ops issued between startCoalescing and endCoalescing on the
  // coalescing thread become one queued operation.
  struct CoalescedOp {
    bool collective;
    bool receive_only;  // a recv: still runs after a peer's loss (comm/progress_engine.cpp)
    Body body;
    c10::intrusive_ptr<FsdpExtWork> work;
    std::shared_ptr<const BucketMembers> bucket;  // null: not fusible
  };
  static Body coalesced_body(std::shared_ptr<std::vector<CoalescedOp>> members);
  // Whether ops from this thread join the open batch (coalescing_mutex_ held):
  // not while this thread runs a CUDA op (run_on_cuda), whose own CPU ops
  // must run, not wait for the batch's end.
  bool coalescing_on_this_thread() const;
  std::mutex coalescing_mutex_;
  bool coalescing_ = false;
  std::thread::id coalescing_thread_;
  std::vector<CoalescedOp> coalesced_ops_;
  std::vector<at::Tensor> coalesced_tensors_;
  // The Works of CUDA ops issued inside the open batch, in issue order.
  std::vector<WorkPtr> coalesced_cuda_works_;
  std::chrono::milliseconds coalesced_timeout_{0};
};

}  // namespace fsdp_ext::backend
