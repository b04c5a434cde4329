// What torch asks of a backend besides its ops, as gloo answers it: the
// group's options, and new groups split from or merged into this one
// (ProcessGroup.split_group, dist.split_group where torch offers it).
#include <c10/util/Exception.h>

#include <algorithm>
#include <numeric>

#include "backend/fsdp_ext_backend.hpp"
#include "backend/tensor_validation.hpp"

namespace fsdp_ext::backend {

c10::intrusive_ptr<c10d::Backend::Options> FsdpExtBackend::getBackendOptions() {
  auto options = c10::make_intrusive<c10d::Backend::Options>(getBackendName(), default_timeout_);
  options->group_name = group_name_;
  options->group_desc = pg_desc_;
  options->global_ranks_in_group = global_ranks_;
  return options;
}

void FsdpExtBackend::set_global_ranks(std::vector<uint64_t> global_ranks) {
  TORCH_CHECK_VALUE(global_ranks.empty() || global_ranks.size() == static_cast<size_t>(size_),
                    label("init").prefix(), "expected ", size_, " global ranks but got ",
                    global_ranks.size());
  if (global_ranks.empty()) {
    // torch gives the default group no list: its ranks are the global ones.
    global_ranks.resize(size_);
    std::iota(global_ranks.begin(), global_ranks.end(), uint64_t{0});
  }
  global_ranks_ = std::move(global_ranks);
}

c10::intrusive_ptr<c10d::Backend> FsdpExtBackend::split(
    const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
    const c10::intrusive_ptr<Options>& opts) {
  const OpLabel l = label("split");
  for (int rank : ranks) check_rank(l, rank, "new group's");
  const auto me = std::find(ranks.begin(), ranks.end(), rank_);
  if (me == ranks.end()) return nullptr;
  const int new_rank = static_cast<int>(me - ranks.begin());
  const auto timeout = opts ? opts->timeout : default_timeout_;
  std::string name = opts && !opts->group_name.empty() ? opts->group_name
                                                       : group_name_ + ":split";
  // The new group's CUDA tensors take its IPC or staged route: torch's NCCL
  // group is made by our Python factory, which a split does not pass through.
  auto backend = c10::make_intrusive<FsdpExtBackend>(store, new_rank,
                                                     static_cast<int>(ranks.size()), timeout,
                                                     std::move(name));
  if (opts && !opts->group_desc.empty()) backend->setGroupDesc(opts->group_desc);
  std::vector<uint64_t> global;
  for (int rank : ranks) {
    global.push_back(global_ranks_[rank]);
  }
  backend->set_global_ranks(std::move(global));
  return backend;
}

c10::intrusive_ptr<c10d::Backend> FsdpExtBackend::merge(
    const c10::intrusive_ptr<c10d::Store>& store, const c10::intrusive_ptr<Options>& opts,
    const int& rank, const int& size) {
  const auto timeout = opts ? opts->timeout : default_timeout_;
  std::string name = opts && !opts->group_name.empty() ? opts->group_name
                                                       : group_name_ + ":merge";
  auto backend = c10::make_intrusive<FsdpExtBackend>(store, rank, size, timeout, std::move(name));
  if (opts && !opts->group_desc.empty()) backend->setGroupDesc(opts->group_desc);
  return backend;
}

}  // namespace fsdp_ext::backend
