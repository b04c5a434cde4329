#include "comm/progress_cadence.h"

namespace fsdp_ext::comm {

void ProgressCadence::note_progress(Clock::time_point now) {
  const Clock::duration gap = now - last_;
  const bool first = !seen_;
  seen_ = true;
  last_ = now;
  if (first || gap > kMaxGap) {
    gap_ = Clock::duration::zero();
  } else if (gap_ == Clock::duration::zero()) {
    gap_ = gap;
  } else {
    // A quarter of each new gap: steady under a burst of back-to-back
    // events, and within a few events of a cadence that changed.
    gap_ += (gap - gap_) / 4;
  }
}

}  // namespace fsdp_ext::comm
