#include "backend/flight_recorder.hpp"

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/ivalue.h>
#include <c10/core/ScalarType.h>
#include <c10/util/Logging.h>
#include <torch/csrc/distributed/c10d/FlightRecorder.hpp>
#include <torch/csrc/jit/serialization/pickle.h>
#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <typeinfo>
#include <unordered_map>

namespace fsdp_ext::backend {
namespace {

size_t capacity_from_environment() {
  for (const char* name : {"TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"}) {
    const char* value = std::getenv(name);
    if (value == nullptr || *value == '\0') continue;
    char* end = nullptr;
    const long long entries = std::strtoll(value, &end, 10);
    return (end && *end == '\0' && entries > 0) ? static_cast<size_t>(entries) : 0;
  }
  return 0;
}

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

c10::Dict<c10::IValue, c10::IValue> any_dict() {
  return c10::Dict<c10::IValue, c10::IValue>(c10::AnyType::get(), c10::AnyType::get());
}

c10::List<c10::IValue> sizes_list(const std::vector<std::vector<int64_t>>& all) {
  c10::List<c10::IValue> list(c10::AnyType::get());
  for (const auto& sizes : all) list.push_back(c10::List<int64_t>(sizes));
  return list;
}

c10::List<c10::IValue> string_list(const std::vector<std::string>& all) {
  c10::List<c10::IValue> list(c10::AnyType::get());
  for (const auto& text : all) list.push_back(text);
  return list;
}

std::string ranks_text(const std::vector<uint64_t>& ranks) {
  std::string text = "[";
  for (size_t i = 0; i < ranks.size(); ++i) text += (i ? ", " : "") + std::to_string(ranks[i]);
  return text + "]";
}

}  // namespace

std::string flight_recorder_name(const char* profiling_title, int rank, int peer) {
  // Our op names that fr_trace spells otherwise (components/types.py).
  static const std::unordered_map<std::string, std::string> renamed = {
      {"all_gather_into_tensor", "_all_gather_base"},
      {"reduce_scatter_tensor", "_reduce_scatter_base"},
      {"all_reduce_coalesced", "allreduce_coalesced"},
      {"all_gather_coalesced", "ALLGATHER_coalesced"},
      {"recvAnySource", "recv"},
  };
  std::string op = profiling_title;
  const auto colon = op.find(':');
  if (colon != std::string::npos) op = op.substr(colon + 1);
  const auto found = renamed.find(op);
  if (found != renamed.end()) op = found->second;
  if (op == "send") op += " " + std::to_string(rank) + "->" + std::to_string(peer);
  if (op == "recv") op += " " + std::to_string(rank) + "<-" + std::to_string(peer);
  return "gloo:" + op;  // Note [gloo's prefix in profiling names]
}

FlightRecorder& FlightRecorder::instance() {
  // Never destroyed: ops may complete on progress threads during exit.
  static FlightRecorder* recorder = new FlightRecorder();
  return *recorder;
}

FlightRecorder::FlightRecorder() : capacity_(capacity_from_environment()) {
  ring_.resize(capacity_);
}

uint64_t FlightRecorder::record(const Op& op, const std::vector<at::Tensor>& inputs,
                                const std::vector<at::Tensor>& outputs) {
  Entry entry;
  entry.op = op;
  entry.op.group_ranks = nullptr;  // the group's ranks are kept once, in groups_
  entry.time_created_ns = now_ns();
  for (const at::Tensor& tensor : inputs) {
    entry.input_sizes.push_back(tensor.sizes().vec());
    entry.input_dtypes.push_back(c10::toString(tensor.scalar_type()));
  }
  for (const at::Tensor& tensor : outputs) {
    entry.output_sizes.push_back(tensor.sizes().vec());
    entry.output_dtypes.push_back(c10::toString(tensor.scalar_type()));
  }
  std::lock_guard<std::mutex> lock(mutex_);
  const auto known = group_ids_.emplace(op.group_name, static_cast<int64_t>(group_ids_.size()));
  if (known.second) {
    groups_[op.group_name] = {op.group_desc,
                              op.group_ranks ? *op.group_ranks : std::vector<uint64_t>{}};
  }
  entry.pg_id = known.first->second;
  const uint64_t id = next_id_++;
  entry.id = id;
  ring_[id % capacity_] = std::move(entry);
  return id;
}

FlightRecorder::Entry* FlightRecorder::find(uint64_t id) {
  Entry& entry = ring_[id % capacity_];
  return entry.id == id ? &entry : nullptr;
}

void FlightRecorder::started(uint64_t id) {
  const int64_t now = now_ns();
  std::lock_guard<std::mutex> lock(mutex_);
  if (Entry* entry = find(id)) {
    if (entry->time_started_ns == 0) entry->time_started_ns = now;
  }
}

void FlightRecorder::completed(uint64_t id) {
  const int64_t now = now_ns();
  std::lock_guard<std::mutex> lock(mutex_);
  if (Entry* entry = find(id)) {
    if (entry->time_started_ns == 0) entry->time_started_ns = now;
    entry->time_completed_ns = now;
  }
}

std::string FlightRecorder::dump(bool only_active) const {
  auto entries = c10::List<c10::IValue>(c10::AnyType::get());
  auto pg_config = any_dict();
  auto pg_status = any_dict();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const uint64_t first = next_id_ > capacity_ ? next_id_ - capacity_ : 0;
    for (uint64_t id = first; id < next_id_; ++id) {
      const Entry& e = ring_[id % capacity_];
      const bool completed = e.time_completed_ns != 0;
      if (only_active && completed) continue;
      auto d = any_dict();
      d.insert("record_id", static_cast<int64_t>(e.id));
      d.insert("pg_id", e.pg_id);
      d.insert("process_group", c10::ivalue::Tuple::create(e.op.group_name, e.op.group_desc));
      d.insert("collective_seq_id", static_cast<int64_t>(e.op.collective_seq));
      d.insert("p2p_seq_id", static_cast<int64_t>(e.op.p2p_seq));
      d.insert("op_id", static_cast<int64_t>(e.op.op_id));
      d.insert("profiling_name", e.op.profiling_name);
      d.insert("time_created_ns", e.time_created_ns);
      if (completed) {
        d.insert("duration_ms",
                 static_cast<double>(e.time_completed_ns - e.time_started_ns) / 1e6);
      }
      d.insert("input_sizes", sizes_list(e.input_sizes));
      d.insert("input_dtypes", string_list(e.input_dtypes));
      d.insert("output_sizes", sizes_list(e.output_sizes));
      d.insert("output_dtypes", string_list(e.output_dtypes));
      d.insert("state", completed ? "completed" : e.time_started_ns ? "started" : "scheduled");
      d.insert("time_discovered_started_ns",
               e.time_started_ns ? c10::IValue(e.time_started_ns) : c10::IValue());
      d.insert("time_discovered_completed_ns",
               completed ? c10::IValue(e.time_completed_ns) : c10::IValue());
      d.insert("retired", completed);
      d.insert("timeout_ms", static_cast<int64_t>(e.op.timeout.count()));
      d.insert("is_p2p", e.op.is_p2p);
      d.insert("frames", c10::List<c10::IValue>(c10::AnyType::get()));
      entries.push_back(d);
    }
    for (const auto& [name, group] : groups_) {
      auto config = any_dict();
      config.insert("name", name);
      config.insert("desc", group.first);
      config.insert("ranks", ranks_text(group.second));
      pg_config.insert(name, config);
    }
  }
  auto result = any_dict();
  result.insert("version", "2.10");
  result.insert("comm_lib_version", "fsdp_ext (torch_fsdp_ext): ops of fsdp_ext groups; "
                                    "profiling names carry gloo's prefix for fr_trace");
  result.insert("pg_config", pg_config);
  result.insert("pg_status", pg_status);
  result.insert("entries", entries);
  const std::vector<char> bytes = torch::jit::pickle(result);
  return std::string(bytes.begin(), bytes.end());
}

std::string FlightRecorder::write_dump(int global_rank) {
  if (!enabled()) return "";
  c10d::DebugInfoWriter& writer = c10d::DebugInfoWriter::getWriter(global_rank);
  const std::string target = writer.getWriterTarget();
  const std::string bytes = dump(/*only_active=*/false);
  // torch's own writer logs a file it cannot open or write and returns as
  // if it had written it; a user then looks for a dump that is not there.
  // Its target is a plain file: remove the previous dump first, so that
  // what is there afterwards is this one or nothing. A writer registered by
  // someone else (DebugInfoWriter::registerWriter) is taken at its word.
  const bool torchs_writer = typeid(writer) == typeid(c10d::DebugInfoWriter);
  if (torchs_writer) std::remove(target.c_str());
  writer.write(bytes);
  struct stat written {};
  if (torchs_writer && (stat(target.c_str(), &written) != 0 ||
                        static_cast<size_t>(written.st_size) != bytes.size())) {
    throw std::runtime_error(
        "the Flight Recorder dump could not be written to " + target +
        " (check that TORCH_FR_DUMP_TEMP_FILE names a writable directory and prefix)");
  }
  return target;
}

std::string FlightRecorder::write_dump_on_failure(int global_rank) {
  if (!enabled() || dumped_on_failure_.exchange(true)) return "";
  try {
    return write_dump(global_rank);
  } catch (const std::exception& error) {
    LOG(ERROR) << "fsdp_ext: " << error.what();
    return "";
  }
}

}  // namespace fsdp_ext::backend
