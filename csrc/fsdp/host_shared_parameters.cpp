#include "fsdp/host_shared_parameters.hpp"

#include <c10/util/Exception.h>
#include <poll.h>
#include <pybind11/pybind11.h>
#include <signal.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <optional>
#include <thread>

namespace fsdp_ext::fsdp {
namespace {

// Spin this long before sleeping between looks: a peer a few microseconds
// behind costs no sleep, a slow one no core.
constexpr auto kSpin = std::chrono::microseconds(50);
constexpr auto kSleep = std::chrono::microseconds(20);
// How often a waiting rank looks at its peers' liveness.
constexpr auto kLivenessEvery = std::chrono::milliseconds(5);

int open_pidfd(int64_t pid) {
#ifdef SYS_pidfd_open
  return static_cast<int>(::syscall(SYS_pidfd_open, static_cast<pid_t>(pid), 0));
#else
  (void)pid;
  return -1;
#endif
}

// Whether the process behind `pidfd` (or, without one, `pid`) has exited.
// A pidfd is readable once its process exits, zombie or not.
bool has_exited(const comm::UniqueFd& pidfd, int64_t pid) {
  if (pidfd.valid()) {
    pollfd p{pidfd.get(), POLLIN, 0};
    return ::poll(&p, 1, 0) > 0;
  }
  return ::kill(static_cast<pid_t>(pid), 0) != 0 && errno == ESRCH;
}

std::atomic_ref<uint64_t> atomic(uint64_t* address) { return std::atomic_ref<uint64_t>(*address); }

}  // namespace

HostSharedParameters::HostSharedParameters(at::Tensor control, int64_t rank,
                                           const std::vector<int64_t>& group_ranks,
                                           const std::vector<int64_t>& pids,
                                           std::chrono::milliseconds timeout, std::string label)
    : control_(std::move(control)),
      rank_(rank),
      group_ranks_(group_ranks),
      pids_(pids),
      timeout_(timeout),
      label_(std::move(label)) {
  const int64_t ranks = static_cast<int64_t>(pids_.size());
  TORCH_CHECK_VALUE(rank_ >= 0 && rank_ < ranks, label_, ": rank ", rank_, " of ", ranks);
  TORCH_CHECK_VALUE(static_cast<int64_t>(group_ranks_.size()) == ranks, label_, ": ",
                    group_ranks_.size(), " group ranks for ", ranks, " pids");
  TORCH_CHECK_VALUE(control_.is_contiguous() && control_.nbytes() >=
                        static_cast<size_t>(ranks * kControlBytesPerRank),
                    label_, ": a control block of ", control_.nbytes(), " bytes for ", ranks,
                    " ranks (", kControlBytesPerRank, " each)");
  TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(control_.data_ptr()) % 64 == 0, label_,
                    ": the control block is not 64-byte aligned");
  for (int64_t r = 0; r < ranks; ++r) {
    pidfds_.emplace_back(r == rank_ ? -1 : open_pidfd(pids_[r]));
  }
}

uint64_t* HostSharedParameters::word(int64_t rank, Word which) const {
  char* base = static_cast<char*>(control_.data_ptr()) + rank * kControlBytesPerRank;
  return reinterpret_cast<uint64_t*>(base) + which;
}

void HostSharedParameters::enter(uint64_t epoch) {
  atomic(word(rank_, kEntered)).store(epoch, std::memory_order_release);
  wait_for_all(kEntered, epoch);
}

void HostSharedParameters::enter_unchanged(uint64_t epoch) {
  atomic(word(rank_, kEntered)).store(epoch, std::memory_order_release);
}

void HostSharedParameters::publish(uint64_t epoch) {
  // Release: this rank's slot writes are visible to whoever sees the word.
  atomic(word(rank_, kPublished)).store(epoch, std::memory_order_release);
  wait_for_all(kPublished, epoch);
}

void HostSharedParameters::wait_for_all(Word which, uint64_t epoch) {
  using Clock = std::chrono::steady_clock;
  const int64_t ranks = static_cast<int64_t>(pids_.size());
  const auto start = Clock::now();
  auto next_liveness = start + kLivenessEvery;
  // Another thread of this process (a backend's) may need the GIL while we
  // wait on other processes.
  std::optional<pybind11::gil_scoped_release> no_gil;
  for (int64_t r = 0; r < ranks; ++r) {
    while (atomic(word(r, which)).load(std::memory_order_acquire) < epoch) {
      const auto now = Clock::now();
      if (now - start < kSpin) continue;
      if (!no_gil && PyGILState_Check()) no_gil.emplace();
      if (now >= next_liveness) {
        next_liveness = now + kLivenessEvery;
        const char* phase = which == kEntered ? "enter" : "publish its shards for";
        if (has_exited(pidfds_[r], pids_[r])) {
          C10_THROW_ERROR(DistBackendError,
                          label_ + ": rank " + std::to_string(group_ranks_[r]) + " (pid " +
                              std::to_string(pids_[r]) + ") of this host exited while rank " +
                              std::to_string(group_ranks_[rank_]) + " waited for it to " + phase +
                              " unshard " + std::to_string(epoch));
        }
        if (now - start > timeout_) {
          C10_THROW_ERROR(DistBackendError,
                          label_ + ": rank " + std::to_string(group_ranks_[rank_]) +
                              " waited " + std::to_string(timeout_.count()) + " ms for rank " +
                              std::to_string(group_ranks_[r]) + " (pid " + std::to_string(pids_[r]) + ") to " +
                              phase + " unshard " + std::to_string(epoch));
        }
      }
      std::this_thread::sleep_for(kSleep);
    }
  }
}

}  // namespace fsdp_ext::fsdp
