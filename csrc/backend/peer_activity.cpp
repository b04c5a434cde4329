#include "backend/peer_activity.hpp"

#include <algorithm>
#include <chrono>
#include <mutex>
#include <thread>
#include <vector>

namespace fsdp_ext::backend {
namespace {
constexpr auto kPostInterval = std::chrono::milliseconds(200);

std::vector<uint8_t> bytes_of(const std::string& text) {
  return std::vector<uint8_t>(text.begin(), text.end());
}
}  // namespace

struct PeerActivityBoard::Posting {
  // Held while this board is posted; stop() takes it, so once stop()
  // returns the poster never reads the activity (the engine may be gone).
  std::mutex mutex;
  bool stopped = false;
  c10::intrusive_ptr<c10d::Store> store;
  std::string key;
  std::function<comm::EngineActivity()> read_activity;
  // What the store holds for this rank: the poster compares against it, not
  // against what it read last, so a change made before the poster first ran
  // (an op completing at once on a loaded host) is still posted.
  std::string posted;

  void post_if_changed() {
    std::lock_guard<std::mutex> lock(mutex);
    if (stopped) return;
    const std::string now = format(read_activity());
    if (now == posted) return;
    try {
      store->set(key, bytes_of(now));
      posted = now;
    } catch (const std::exception&) {
      // The store went away (its host failed, or the job is ending): the
      // backend reports failures through its ops, not from this thread.
    }
  }
};

namespace {
// The process's one poster: a thread started with the first board, which
// wakes every kPostInterval and posts each live board that changed. It lives
// as long as the process (the object is never destroyed, the thread is
// detached), so no group waits for it to start or stop; with no boards left
// it only sleeps. Several groups used to run a thread each.
class ActivityPoster {
 public:
  static ActivityPoster& of_this_process() {
    static ActivityPoster* poster = new ActivityPoster();
    return *poster;
  }

  void add(std::shared_ptr<PeerActivityBoard::Posting> posting) {
    std::lock_guard<std::mutex> lock(mutex_);
    postings_.push_back(std::move(posting));
    if (!started_) {
      started_ = true;
      std::thread([this] { loop(); }).detach();
    }
  }

  void remove(const PeerActivityBoard::Posting* posting) {
    std::lock_guard<std::mutex> lock(mutex_);
    postings_.erase(std::remove_if(postings_.begin(), postings_.end(),
                                   [posting](const auto& p) { return p.get() == posting; }),
                    postings_.end());
  }

 private:
  void loop() {
    for (;;) {
      std::this_thread::sleep_for(kPostInterval);
      std::vector<std::shared_ptr<PeerActivityBoard::Posting>> live;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        live = postings_;
      }
      // Outside the registry's lock: a slow store delays other boards' posts,
      // never a group's creation or destruction.
      for (const auto& posting : live) posting->post_if_changed();
    }
  }

  std::mutex mutex_;
  std::vector<std::shared_ptr<PeerActivityBoard::Posting>> postings_;
  bool started_ = false;
};
}  // namespace

PeerActivityBoard::PeerActivityBoard(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                                     std::function<comm::EngineActivity()> read_activity)
    : rank_(rank), size_(size), posting_(std::make_shared<Posting>()) {
  posting_->store = std::move(store);
  posting_->key = key(rank_);
  posting_->read_activity = std::move(read_activity);
  // Posted once before any op, so every key exists when a peer reads it.
  posting_->posted = format(posting_->read_activity());
  posting_->store->set(posting_->key, bytes_of(posting_->posted));
  ActivityPoster::of_this_process().add(posting_);
}

PeerActivityBoard::~PeerActivityBoard() { stop(); }

void PeerActivityBoard::stop() {
  ActivityPoster::of_this_process().remove(posting_.get());
  std::lock_guard<std::mutex> lock(posting_->mutex);  // waits out a post in progress
  posting_->stopped = true;
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

std::string PeerActivityBoard::describe_others(
    const comm::EngineActivity& mine, const std::function<std::string(int)>& name_rank) const {
  const std::string same_as_mine = format(mine);
  std::string out;
  try {
    for (int rank = 0; rank < size_; ++rank) {
      if (rank == rank_) continue;
      if (!posting_->store->check({key(rank)})) continue;
      const std::vector<uint8_t> raw = posting_->store->get(key(rank));
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
