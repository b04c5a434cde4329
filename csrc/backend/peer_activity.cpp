#include "backend/peer_activity.hpp"

#include <chrono>

namespace fsdp_ext::backend {
namespace {
constexpr auto kPostInterval = std::chrono::milliseconds(200);

std::vector<uint8_t> bytes_of(const std::string& text) {
  return std::vector<uint8_t>(text.begin(), text.end());
}
}  // namespace

PeerActivityBoard::PeerActivityBoard(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                     std::function<comm::EngineActivity()> read_activity)
    : store_(std::move(store)), rank_(rank), size_(size),
      read_activity_(std::move(read_activity)) {
  // Posted once before any op, so every key exists when a peer reads it.
  std::string first_post = format(read_activity_());
  store_->set(key(rank_), bytes_of(first_post));
  // The poster compares against what the store holds, not against what it
  // reads when it starts: an op may complete before the thread first runs
  // (a loaded host), and that change must still be posted.
  poster_ = std::thread([this, first_post] { post_loop(first_post); });
}

PeerActivityBoard::~PeerActivityBoard() { stop(); }

void PeerActivityBoard::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  stop_requested_.notify_all();
  if (poster_.joinable()) poster_.join();
}

std::string PeerActivityBoard::key(int rank) const {
  return "fsdp_ext/activity/" + std::to_string(rank);
}

std::string PeerActivityBoard::format(const comm::EngineActivity& activity) {
  std::string text = std::to_string(activity.seq) + "|";
  if (activity.in_collective) {
    return text + "in " + activity.op + " op #" + std::to_string(activity.seq);
  }
  if (activity.seq == 0) return text + "not in any collective (none begun yet)";
  return text + "not in any collective (the last one it began: " + activity.op + " op #" +
         std::to_string(activity.seq) + ")";
}

void PeerActivityBoard::post_loop(std::string posted) {
  std::unique_lock<std::mutex> lock(mutex_);
  while (!stop_requested_.wait_for(lock, kPostInterval, [this] { return stopping_; })) {
    const std::string now = format(read_activity_());
    if (now == posted) continue;
    lock.unlock();
    try {
      store_->set(key(rank_), bytes_of(now));
      posted = now;
    } catch (const std::exception&) {
      // The store went away (its host failed, or the job is ending): the
      // backend reports failures through its ops, not from this thread.
    }
    lock.lock();
  }
}

std::string PeerActivityBoard::describe_others(
    const comm::EngineActivity& mine, const std::function<std::string(int)>& name_rank) const {
  const std::string same_as_mine = format(mine);
  std::string out;
  try {
    for (int rank = 0; rank < size_; ++rank) {
      if (rank == rank_) continue;
      if (!store_->check({key(rank)})) continue;
      const std::vector<uint8_t> raw = store_->get(key(rank));
      const std::string text(raw.begin(), raw.end());
      if (text == same_as_mine) continue;  // in this op too: not the one missing
      out += (out.empty() ? "" : "; ") + name_rank(rank) + ": " + text.substr(text.find('|') + 1);
    }
  } catch (const std::exception& error) {
    return " What the peers were doing is unknown (the store failed: " +
           std::string(error.what()).substr(0, 200) + ").";
  }
  if (out.empty()) return " Every peer reported being in this op.";
  return " Peers not in this op: " + out + ".";
}

}  // namespace fsdp_ext::backend
