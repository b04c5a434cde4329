#include "backend/cuda/ipc_route.hpp"

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <optional>

#include "backend/cuda/cuda_buffers.hpp"
#include "backend/cuda/cuda_path.hpp"
#include "backend/cuda/cuda_work.hpp"
#include "backend/fsdp_ext_backend.hpp"
#include "comm/descriptor_sharing.h"
#include "device/cuda_check.h"
#include "device/reduce_kernels.h"

namespace fsdp_ext::backend {
namespace {

// The host exchanges carry fixed-size records: every rank's record has the
// same layout, so a rank reads any peer's at a known offset.
constexpr size_t kReasonBytes = 160;

// The sharing probe's buffer: every rank writes a pattern of its own into
// it and reads each peer's back through the peer's handle, so a handle that
// opens other memory than it was made for (another allocation of a block,
// an offset lost) fails the probe instead of every later op's numbers.
constexpr size_t kProbeBytes = 256;

std::array<uint8_t, kProbeBytes> probe_pattern(int rank) {
  std::array<uint8_t, kProbeBytes> bytes{};
  for (size_t i = 0; i < kProbeBytes; ++i) {
    bytes[i] = static_cast<uint8_t>(i * 7 + static_cast<size_t>(rank) * 31 + 1);
  }
  return bytes;
}

// "" when `peer`'s probe, mapped here at `mapped`, holds what `peer` wrote.
std::string check_probe(int peer, const void* mapped) {
  std::array<uint8_t, kProbeBytes> seen{};
  device::check_cuda(cudaMemcpy(seen.data(), mapped, kProbeBytes, cudaMemcpyDeviceToHost),
                     "cudaMemcpy (reading a peer's probe buffer)");
  const std::array<uint8_t, kProbeBytes> wrote = probe_pattern(peer);
  const auto [got, want] = std::mismatch(seen.begin(), seen.end(), wrote.begin());
  if (got == seen.end()) return "";
  return "rank " + std::to_string(peer) + "'s probe buffer, opened here, has byte " +
         std::to_string(got - seen.begin()) + " = " + std::to_string(*got) + " where rank " +
         std::to_string(peer) + " wrote " + std::to_string(*want) +
         " (the handle maps other memory)";
}

class RecordWriter {
 public:
  template <typename T>
  void put(const T& value) {
    // Grow, then copy: a range insert here draws GCC 12's false
    // -Wstringop-overflow once a one-byte record came first.
    const size_t at = data_.size();
    data_.resize(at + sizeof(T));
    std::memcpy(data_.data() + at, &value, sizeof(T));
  }
  void put_reason(const std::string& reason) {
    char text[kReasonBytes] = {};
    std::strncpy(text, reason.c_str(), kReasonBytes - 1);
    put(text);
  }
  const std::vector<uint8_t>& bytes() const { return data_; }

 private:
  std::vector<uint8_t> data_;
};

class RecordReader {
 public:
  explicit RecordReader(const std::vector<uint8_t>& data) : data_(data) {}
  template <typename T>
  T get() {
    T value;
    TORCH_INTERNAL_ASSERT(offset_ + sizeof(T) <= data_.size(), "a short host record");
    std::memcpy(&value, data_.data() + offset_, sizeof(T));
    offset_ += sizeof(T);
    return value;
  }
  std::string get_reason() {
    const auto text = get<std::array<char, kReasonBytes>>();
    return std::string(text.data(), strnlen(text.data(), kReasonBytes));
  }

 private:
  const std::vector<uint8_t>& data_;
  size_t offset_ = 0;
};

// The first rank whose record (starting with an ok byte and a reason) says
// it failed, as "rank R: reason"; "" when every rank succeeded.
std::string first_failure(const std::vector<std::vector<uint8_t>>& records) {
  for (size_t r = 0; r < records.size(); ++r) {
    RecordReader reader(records[r]);
    const auto ok = reader.get<uint8_t>();
    const std::string reason = reader.get_reason();
    if (!ok) return "rank " + std::to_string(r) + ": " + reason;
  }
  return "";
}

// The IPC handle of the allocation holding `tensor` and the tensor's offset
// in it; nullopt when it has none. The group's own buffers carry the handle
// they got when made; torch's memory is exported only with legacy sharing
// (`torch_memory_too`: peers cannot open its legacy handles otherwise).
// torch's caching allocator finds an allocation by the
// start of its block (the storage's start, not a view's data pointer), and
// refuses (throws) for expandable segments and memory it did not allocate:
// those have no legacy handle, and the op is staged.
std::optional<device::IpcBuffer> export_tensor(const GroupCudaBuffers& buffers,
                                               const at::Tensor& tensor,
                                               bool torch_memory_too) {
  if (std::optional<device::IpcBuffer> own = buffers.exported(tensor)) return own;
  if (!torch_memory_too) return std::nullopt;
  size_t allocation_bytes = 0;
  void* base = nullptr;
  try {
    base = c10::cuda::CUDACachingAllocator::getBaseAllocation(tensor.storage().mutable_data(),
                                                              &allocation_bytes);
  } catch (const c10::Error&) {
    return std::nullopt;
  }
  if (base == nullptr) return std::nullopt;
  return device::export_buffer(base, tensor.data_ptr());
}

const char* kNoHandle =
    "its buffer has no handle peers can open (torch's memory where the group shares "
    "buffers as file descriptors, or memory from cuMemCreate, e.g. "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)";

// What a rank says of one tensor peers may read: where it is (empty for a
// tensor no peer reads), and enough for every rank to check that all ranks
// passed the same.
struct SharedTensor {
  device::IpcBuffer buffer{};
  uint64_t bytes = 0;
  c10::ScalarType dtype = c10::ScalarType::Undefined;
};

// A rank's record of the buffers' round: an ok byte and a reason (every
// round's), then its tensors. The count goes first: records of ranks that
// pass different counts differ in length, which the host round itself
// refuses on every rank.
std::vector<uint8_t> write_shared_record(const std::string& failure,
                                         const std::vector<SharedTensor>& tensors) {
  RecordWriter record;
  record.put<uint8_t>(failure.empty());
  record.put_reason(failure);
  record.put<uint32_t>(static_cast<uint32_t>(tensors.size()));
  for (const SharedTensor& tensor : tensors) {
    record.put(tensor.buffer);
    record.put<uint64_t>(tensor.bytes);
    record.put<int32_t>(static_cast<int32_t>(tensor.dtype));
  }
  return record.bytes();
}

struct SharedRecord {
  bool ok = false;
  std::string reason;
  std::vector<SharedTensor> tensors;
};

SharedRecord read_shared_record(const std::vector<uint8_t>& bytes) {
  RecordReader reader(bytes);
  SharedRecord record;
  record.ok = reader.get<uint8_t>() != 0;
  record.reason = reader.get_reason();
  record.tensors.resize(reader.get<uint32_t>());
  for (SharedTensor& tensor : record.tensors) {
    tensor.buffer = reader.get<device::IpcBuffer>();
    tensor.bytes = reader.get<uint64_t>();
    tensor.dtype = static_cast<c10::ScalarType>(reader.get<int32_t>());
  }
  return record;
}

}  // namespace

std::unique_ptr<IpcRoute> IpcRoute::try_create(CudaPath& path, const OpLabel& label,
                                               const std::string& handles,
                                               std::chrono::milliseconds timeout,
                                               std::string* why_not) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(path.device()));
  std::unique_ptr<IpcRoute> route(new IpcRoute(path));
  const int size = path.size();
  const int rank = path.rank();
  FsdpExtBackend& group = path.group();

  // 1. This rank's events, exported.
  std::string failure;
  try {
    route->ready_ = std::make_unique<device::SharedEvent>();
    route->mid_ = std::make_unique<device::SharedEvent>();
    route->done_ = std::make_unique<device::SharedEvent>();
  } catch (const std::exception& error) {
    failure = error.what();
  }
  RecordWriter events;
  events.put<uint8_t>(failure.empty());
  events.put_reason(failure);
  for (const auto* event : {route->ready_.get(), route->mid_.get(), route->done_.get()}) {
    events.put(event ? event->handle() : cudaIpcEventHandle_t{});
  }
  const auto event_records = group.exchange_bytes(label, events.bytes(), timeout);
  if (!(*why_not = first_failure(event_records)).empty()) return nullptr;

  // 2. The peers' events opened.
  try {
    route->peer_ready_.resize(size);
    route->peer_mid_.resize(size);
    route->peer_done_.resize(size);
    for (int peer = 0; peer < size; ++peer) {
      if (peer == rank) continue;
      RecordReader reader(event_records[peer]);
      reader.get<uint8_t>();
      reader.get_reason();
      route->peer_ready_[peer] = std::make_unique<device::PeerEvent>(reader.get<cudaIpcEventHandle_t>());
      route->peer_mid_[peer] = std::make_unique<device::PeerEvent>(reader.get<cudaIpcEventHandle_t>());
      route->peer_done_[peer] = std::make_unique<device::PeerEvent>(reader.get<cudaIpcEventHandle_t>());
    }
  } catch (const std::exception& error) {
    failure = "opening a peer's CUDA IPC event: " + std::string(error.what());
  }
  RecordWriter opened;
  opened.put<uint8_t>(failure.empty());
  opened.put_reason(failure);
  if (!(*why_not = first_failure(group.exchange_bytes(label, opened.bytes(), timeout))).empty()) {
    return nullptr;
  }

  // 3. How buffers are shared: legacy handles where peers can open them
  // (they also cover torch's own memory), else file descriptors (the
  // group's own buffers only).
  if (handles != "descriptors") {
    route->legacy_refusal_ = route->probe_sharing(label, device::IpcKind::kLegacy, timeout);
    if (route->legacy_refusal_.empty()) return route;
    if (handles == "legacy") {
      *why_not = "legacy IPC handles (FSDP_EXT_CUDA_IPC_HANDLES=legacy): " + route->legacy_refusal_;
      return nullptr;
    }
  }
  const std::string descriptor_refusal =
      route->probe_sharing(label, device::IpcKind::kDescriptor, timeout);
  if (descriptor_refusal.empty()) return route;
  *why_not = handles == "descriptors"
                 ? "file descriptors (FSDP_EXT_CUDA_IPC_HANDLES=descriptors): " + descriptor_refusal
                 : "legacy IPC handles: " + route->legacy_refusal_ +
                       "; file descriptors: " + descriptor_refusal;
  return nullptr;
}

std::string IpcRoute::probe_sharing(const OpLabel& label, device::IpcKind kind,
                                    std::chrono::milliseconds timeout) {
  const int size = path_.size();
  const int rank = path_.rank();
  FsdpExtBackend& group = path_.group();
  GroupCudaBuffers& buffers = path_.buffers();
  // A buffer of the group's own is the probe: torch's allocator may hand out
  // memory without a legacy handle (expandable segments), where the
  // group's buffers still have one. It goes back to the pool at the end,
  // which keeps it (and the peers' mappings of it stay valid).
  std::string failure;
  std::optional<device::IpcBuffer> exported;
  std::array<char, comm::DescriptorServer::kMaxAddressBytes + 1> address{};
  at::Tensor probe;
  try {
    if (kind == device::IpcKind::kDescriptor) {
      buffers.share_by_descriptors();
      const std::string listening = buffers.descriptor_address();
      std::memcpy(address.data(), listening.data(),
                  std::min(listening.size(), address.size() - 1));
    }
    probe = buffers.allocate(label, kProbeBytes, at::TensorOptions().dtype(at::kByte));
    const std::array<uint8_t, kProbeBytes> pattern = probe_pattern(rank);
    device::check_cuda(
        cudaMemcpy(probe.data_ptr(), pattern.data(), kProbeBytes, cudaMemcpyHostToDevice),
        "cudaMemcpy (the probe buffer's pattern)");
    // On the device before any peer reads it (after the exchange below).
    device::check_cuda(cudaDeviceSynchronize(), "cudaDeviceSynchronize (the probe's pattern)");
    exported = buffers.exported(probe);
    if (!exported || exported->kind != kind) {
      failure = kind == device::IpcKind::kLegacy
                    ? "cudaIpcGetMemHandle refused a buffer of the group"
                    : "a buffer of the group was not made to be shared as a file descriptor";
    }
  } catch (const std::exception& error) {
    failure = error.what();
  }
  RecordWriter mine;
  mine.put<uint8_t>(failure.empty());
  mine.put_reason(failure);
  mine.put(exported.value_or(device::IpcBuffer{}));
  mine.put(address);
  const auto records = group.exchange_bytes(label, mine.bytes(), timeout);
  std::string refusal = first_failure(records);
  if (!refusal.empty()) return refusal;

  // The peers' probe buffers opened (they stay in the map, as any buffer).
  try {
    std::vector<std::string> servers(size);
    std::vector<device::IpcBuffer> probes(size);
    for (int peer = 0; peer < size; ++peer) {
      RecordReader reader(records[peer]);
      reader.get<uint8_t>();
      reader.get_reason();
      probes[peer] = reader.get<device::IpcBuffer>();
      const auto text = reader.get<decltype(address)>();
      servers[peer] = std::string(text.data(), strnlen(text.data(), text.size()));
    }
    if (kind == device::IpcKind::kDescriptor) peer_memory_.set_descriptor_servers(servers);
    for (int peer = 0; peer < size && failure.empty(); ++peer) {
      if (peer != rank) failure = check_probe(peer, peer_memory_.open(peer, probes[peer], [] {}));
    }
  } catch (const std::exception& error) {
    failure = error.what();
  }
  RecordWriter opened;
  opened.put<uint8_t>(failure.empty());
  opened.put_reason(failure);
  refusal = first_failure(group.exchange_bytes(label, opened.bytes(), timeout));
  if (refusal.empty()) sharing_ = kind;
  return refusal;
}

std::string IpcRoute::describe_sharing() const {
  if (sharing_ == device::IpcKind::kLegacy) return "buffers shared by legacy IPC handles";
  return "the group's own buffers shared as file descriptors, other memory staged (" +
         (legacy_refusal_.empty() ? std::string("FSDP_EXT_CUDA_IPC_HANDLES=descriptors")
                                  : "legacy IPC handles: " + legacy_refusal_) +
         ")";
}

bool IpcRoute::exchange_buffers(const OpLabel& label, const std::vector<at::Tensor>& shared,
                                int read_from, std::chrono::milliseconds timeout,
                                std::vector<std::vector<void*>>* peer_pointers,
                                std::string* failure_here) {
  const int size = path_.size();
  const int rank = path_.rank();
  // Only a buffer some peer reads is exported and opened (a broadcast's root's).
  const auto read_by_peers = [read_from](int r) { return read_from < 0 || read_from == r; };
  // A failure before this round (failure_here) is carried by it and raised
  // on every rank; kNoHandle makes every rank stage the op.
  std::string failure = *failure_here;
  std::vector<SharedTensor> mine(shared.size());
  for (size_t i = 0; i < shared.size(); ++i) {
    mine[i].bytes = shared[i].nbytes();
    mine[i].dtype = shared[i].scalar_type();
    if (!failure.empty() || shared[i].numel() == 0 || !read_by_peers(rank)) continue;
    std::optional<device::IpcBuffer> exported =
        export_tensor(path_.buffers(), shared[i], sharing_ == device::IpcKind::kLegacy);
    if (!exported) {
      failure = kNoHandle;
      continue;
    }
    mine[i].buffer = *exported;
  }
  std::vector<SharedRecord> records;
  for (const auto& bytes :
       path_.group().exchange_bytes(label, write_shared_record(failure, mine), timeout)) {
    records.push_back(read_shared_record(bytes));
  }
  failure_here->clear();
  bool staged = false;
  for (int peer = 0; peer < size; ++peer) {
    const SharedRecord& record = records[peer];
    if (record.ok) continue;
    if (record.reason != kNoHandle) {
      C10_THROW_ERROR(DistBackendError,
                      label.prefix() + "rank " + std::to_string(peer) + ": " + record.reason);
    }
    staged = true;
  }
  // Every rank sees every record and checks each against its own: a
  // mismatch is refused on every rank, before any reads a peer's memory.
  for (int peer = 0; peer < size; ++peer) {
    const std::vector<SharedTensor>& theirs = records[peer].tensors;
    TORCH_CHECK_VALUE(theirs.size() == shared.size(), label.prefix(), "rank ", peer, " passed ",
                      theirs.size(), " tensors where this rank passed ", shared.size());
    for (size_t i = 0; i < shared.size(); ++i) {
      TORCH_CHECK_VALUE(theirs[i].bytes == mine[i].bytes && theirs[i].dtype == mine[i].dtype,
                        label.prefix(), "tensor sizes or dtypes differ between ranks: rank ",
                        peer, " passed ", theirs[i].bytes, " bytes of ", theirs[i].dtype,
                        " as tensor ", i, " where this rank passed ", mine[i].bytes,
                        " bytes of ", mine[i].dtype);
    }
  }
  if (staged) return false;

  peer_pointers->assign(size, std::vector<void*>(shared.size(), nullptr));
  peer_memory_.begin_op();
  const auto drain = [this] { path_.stream().synchronize(); };
  for (int peer = 0; peer < size; ++peer) {
    for (size_t i = 0; i < shared.size(); ++i) {
      if (peer == rank) {
        (*peer_pointers)[peer][i] = shared[i].data_ptr();
      } else if (shared[i].numel() > 0 && read_by_peers(peer) && failure_here->empty()) {
        // A peer's buffer that cannot be opened fails this rank's part; the
        // next host round tells the others (they are already past this one).
        try {
          (*peer_pointers)[peer][i] =
              peer_memory_.open(peer, records[peer].tensors[i].buffer, drain);
        } catch (const std::exception& error) {
          *failure_here = "opening rank " + std::to_string(peer) + "'s buffer: " + error.what();
        }
      }
    }
  }
  return true;
}

std::string IpcRoute::all_recorded(const OpLabel& label, device::SharedEvent& event,
                            const std::vector<std::unique_ptr<device::PeerEvent>>& peers,
                            std::chrono::milliseconds timeout, std::string failure_here) {
  if (failure_here.empty()) {
    try {
      event.record(path_.stream().stream());
    } catch (const std::exception& error) {
      failure_here = error.what();
    }
  }
  RecordWriter mine;
  mine.put<uint8_t>(failure_here.empty());
  mine.put_reason(failure_here);
  const std::string failure = first_failure(path_.group().exchange_bytes(label, mine.bytes(),
                                                                         timeout));
  // Every rank has the same records: all fail here together, none waits on.
  if (!failure.empty()) C10_THROW_ERROR(DistBackendError, label.prefix() + failure);
  try {
    for (int peer = 0; peer < path_.size(); ++peer) {
      if (peer != path_.rank()) peers[peer]->wait(path_.stream().stream());
    }
  } catch (const std::exception& error) {
    return error.what();
  }
  return "";
}

WorkPtr IpcRoute::run(const OpLabel& label, CudaOp& op) {
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(path_.device()));
  const int size = path_.size();
  const int rank = path_.rank();
  const cudaStream_t stream = path_.stream().stream();
  // This rank's failure: carried by the next round, where every rank then
  // raises it (Note [a failure between host rounds] in ipc_route.hpp).
  std::string failure;
  const auto guarded = [&failure](auto&& enqueue) {
    if (!failure.empty()) return;
    try {
      enqueue();
    } catch (const std::exception& error) {
      failure = error.what();
    }
  };
  guarded([&] {
    path_.follow_current_stream();
    ready_->record(stream);
  });
  std::vector<std::vector<void*>> peer;  // [rank][tensor]: where that rank's buffer is mapped
  const int read_from = op.kind == CudaOp::Kind::kBroadcast ? op.root : -1;
  if (!exchange_buffers(label, op.inputs, read_from, op.timeout, &peer, &failure)) {
    return path_.run_staged(label, op);
  }
  // Before anything is enqueued: whatever a later round raises, the tensors'
  // memory is then not reused before the group's stream is done with it
  // (peers' reads are ordered before that stream's end by the `done` round).
  // Also after a failure of this rank's own: its peers, told only at the
  // next round, may already be reading its buffers.
  try {
    path_.record_stream(op);
  } catch (const std::exception& error) {
    if (failure.empty()) failure = error.what();
  }
  guarded([&] {
    for (int p = 0; p < size; ++p) {
      if (p != rank) peer_ready_[p]->wait(stream);
    }
  });

  const auto copy = [stream](void* dst, const void* src, size_t bytes) {
    if (bytes == 0 || dst == src) return;
    device::check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream),
                       "cudaMemcpyAsync (from a peer's buffer)");
  };
  const auto offset = [](void* base, size_t bytes) { return static_cast<char*>(base) + bytes; };
  switch (op.kind) {
    case CudaOp::Kind::kAllgather:
      guarded([&] {
        // Each rank pulls every rank's input into its own output.
        for (size_t i = 0; i < op.inputs.size(); ++i) {
          const size_t part = op.inputs[i].nbytes();
          for (int p = 0; p < size; ++p) {
            copy(offset(op.outputs[i].data_ptr(), p * part), peer[p][i], part);
          }
        }
      });
      break;
    case CudaOp::Kind::kReduceScatter:
      // Each rank reduces its block of every rank's input, starting with its
      // own, then the others in rank order: the order of comm's one-host
      // reduce-scatters, so a block rounds as on the staged route.
      guarded([&] {
        for (size_t i = 0; i < op.inputs.size(); ++i) {
          const size_t part = op.outputs[i].nbytes();
          std::vector<const void*> blocks{offset(peer[rank][i], rank * part)};
          for (int p = 0; p < size; ++p) {
            if (p != rank) blocks.push_back(offset(peer[p][i], rank * part));
          }
          device::reduce_on_device(op.outputs[i].data_ptr(), blocks.data(), size,
                                   op.outputs[i].numel(), op.spec, stream);
        }
      });
      break;
    case CudaOp::Kind::kAllreduce: {
      // Phase 1: each rank reduces its share of every tensor in its own
      // buffer; phase 2, once every rank's share is done: each rank copies
      // the other shares from their owners.
      const auto share = [size](const at::Tensor& t, int p) {
        const int64_t per = (t.numel() + size - 1) / size;
        const int64_t begin = std::min<int64_t>(t.numel(), per * p);
        const int64_t end = std::min<int64_t>(t.numel(), begin + per);
        return std::make_pair(begin * t.element_size(), (end - begin));
      };
      guarded([&] {
        for (size_t i = 0; i < op.inputs.size(); ++i) {
          const auto [begin, count] = share(op.inputs[i], rank);
          std::vector<const void*> blocks(size);
          for (int p = 0; p < size; ++p) blocks[p] = offset(peer[p][i], begin);
          device::reduce_on_device(offset(op.inputs[i].data_ptr(), begin), blocks.data(), size,
                                   count, op.spec, stream);
        }
      });
      failure = all_recorded(label, *mid_, peer_mid_, op.timeout, failure);
      guarded([&] {
        for (size_t i = 0; i < op.inputs.size(); ++i) {
          for (int p = 0; p < size; ++p) {
            if (p == rank) continue;
            const auto [begin, count] = share(op.inputs[i], p);
            copy(offset(op.inputs[i].data_ptr(), begin), offset(peer[p][i], begin),
                 count * op.inputs[i].element_size());
          }
        }
      });
      break;
    }
    case CudaOp::Kind::kBroadcast:
      guarded([&] {
        if (rank != op.root) {
          copy(op.inputs[0].data_ptr(), peer[op.root][0], op.inputs[0].nbytes());
        }
      });
      break;
    case CudaOp::Kind::kOther:
      TORCH_INTERNAL_ASSERT(false, "the IPC route got an op it does not implement");
  }
  // After the last round no peer waits for this rank: a wait it could not
  // enqueue is raised here alone.
  const std::string unordered = all_recorded(label, *done_, peer_done_, op.timeout, failure);
  if (!unordered.empty()) C10_THROW_ERROR(DistBackendError, label.prefix() + unordered);
  return c10::make_intrusive<CudaWork>(rank, c10d::OpType::UNKNOWN, label.op, op.outputs,
                                       path_.stream());
}

}  // namespace fsdp_ext::backend
