#include "daemon/dataplane/progress_policy.h"

#include <algorithm>

namespace refit::dataplane {

void ProgressPolicy::Start(const Sample& sample) {
  started_ = true;
  first_window_ = true;
  window_start_ = sample.now;
  window_bytes_ = sample.bytes_read + sample.bytes_served;
  rate_ = 0;
}

ProgressPolicy::Turn ProgressPolicy::Next(const Sample& sample) {
  const uint64_t moved = sample.bytes_read + sample.bytes_served;
  // A short lull (a relay between two readers' requests) is part of the transfer; after a
  // window's worth of idleness the next bytes are a new one, whose rate is not known yet.
  if (!started_ || (idle_ && sample.now - idle_since_ >= options_.window)) Start(sample);
  idle_ = false;
  if (sample.now - window_start_ >= options_.window) {
    const double seconds = std::chrono::duration<double>(sample.now - window_start_).count();
    rate_ = moved > window_bytes_ ? static_cast<double>(moved - window_bytes_) / seconds : 0.0;
    window_start_ = sample.now;
    window_bytes_ = moved;
    first_window_ = false;
  }
  const bool poll = first_window_ ? sample.now - sample.active_at < options_.flowing
                                  : rate_ >= options_.poll_rate;
  if (poll) return Turn{Action::kPollOn, sample.now};
  Turn turn{Action::kBlock, sample.now};
  if (last_arm_ > sample.now) {
    turn.arm_at = last_arm_;  // the nap before it was cut short by posted work
  } else if (!first_window_) {
    turn.arm_at = std::max(sample.now, last_arm_ + options_.moderation);
  }
  last_arm_ = turn.arm_at;
  return turn;
}

void ProgressPolicy::Idle(Clock::time_point now) {
  if (idle_) return;
  idle_ = true;
  idle_since_ = now;
}

}  // namespace refit::dataplane
