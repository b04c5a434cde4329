// How often the transfers in flight make progress, learned from when the
// engine saw them do so.
//
// Why: over TCP, UCX wakes the worker's fd for arrivals only (see
// engine_wakeup.h). A stream that waits for socket room, or for the next
// fragment of a rendezvous to be acknowledged, moves on only when the
// engine calls progress. On a slow link those events come a fraction of a
// millisecond apart (1 Gbit/s, 16 MiB all-gather: most gaps 0.5-1 ms), and
// sleeping in growing slices between them let the wire idle a third of the
// time (59 % of the link; spinning throughout: 97 %). Knowing the cadence,
// the engine naps through the first half of a gap and spins across the
// rest, so it is awake when the next event is due without burning the
// whole gap.
#pragma once

#include <chrono>

namespace fsdp_ext::comm {

class ProgressCadence {
 public:
  using Clock = std::chrono::steady_clock;

  // Longest gap still taken as the cadence of one stream. A longer one means
  // the stream paused (a peer late to an op, a new op after idling): the
  // cadence is forgotten and the engine sleeps as usual.
  static constexpr Clock::duration kMaxGap = std::chrono::milliseconds(2);

  void note_progress(Clock::time_point now);
  // The smoothed gap between progress events, or zero when there is no
  // stream (nothing seen yet, or the last gap exceeded kMaxGap).
  Clock::duration gap() const { return gap_; }

 private:
  Clock::time_point last_{};
  bool seen_ = false;
  Clock::duration gap_{0};
};

}  // namespace fsdp_ext::comm
