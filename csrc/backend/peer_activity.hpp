// What each rank of a group is doing, posted to the group's store, so that a
// timed-out op can say what the missing peers were last doing without asking
// them (they may be stuck, or gone).
//
// One thread per process, shared by every group of the process, posts each
// group's EngineActivity for this rank ("in all_reduce op #12", "not in any
// collective (last began barrier op #11)") whenever it changed, at most
// every kPostInterval; ops never touch the store. The report is therefore
// up to that interval stale, which is far below any collective timeout.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <functional>
#include <memory>
#include <string>

#include "comm/progress_engine.h"

namespace fsdp_ext::backend {

class PeerActivityBoard {
 public:
  PeerActivityBoard(c10::intrusive_ptr<c10d::Store> store, int rank, int size,
                    std::function<comm::EngineActivity()> read_activity);
  ~PeerActivityBoard();
  PeerActivityBoard(const PeerActivityBoard&) = delete;
  PeerActivityBoard& operator=(const PeerActivityBoard&) = delete;

  // "rank 1: in all_reduce op #12; rank 3: not in any collective (...)" for
  // every other rank whose last post differs from `mine` (this rank, in the
  // op that timed out), or a sentence saying all were in it. Never blocks on
  // a missing key; a store that fails is reported as such.
  std::string describe_others(const comm::EngineActivity& mine,
                              const std::function<std::string(int)>& name_rank) const;

  static std::string format(const comm::EngineActivity& activity);
  // Ends this board's posts; when it returns, the poster no longer reads
  // the activity. Safe to call twice.
  void stop();

  // What the process's poster thread holds of one board.
  struct Posting;

 private:
  std::string key(int rank) const;

  int rank_;
  int size_;
  std::shared_ptr<Posting> posting_;  // holds the store, shared with the poster
};

}  // namespace fsdp_ext::backend
