#pragma once

// How the data plane's loop waits for progress while bytes are in flight (issue 36): after a
// turn that completed nothing of its own, either it POLLS ON (yields and Polls the transport
// again) or it BLOCKS on the transport's armed wake fd (Transport::ArmWhileBusy / WakeFd) until
// the next network event.
//
// Why it is a choice: polling keeps a core busy for the whole transfer, and on a slow link
// that core is what the kernel's TCP work needs (at K engines on two cores, the daemons' CPU,
// not the links, set the pace). Blocking costs a wake-up per network event, which on a link
// as fast as the CPU (loopback, a fast NIC: a read completes every few microseconds) halved a
// pull's throughput. So the policy measures the rate at which bytes move through this node in
// windows of ProgressOptions::window — its own reads that completed, and the bytes its
// transport served to peers reading here (Transport::bytes_served: a relay node mostly
// serves) — and:
//   - in the first window of a transfer, where no rate is known yet, it behaves as the loop
//     did before: polls on while anything happened within `flowing`, else blocks;
//   - later it polls on while the last window's rate was at least `poll_rate`, and otherwise
//     blocks with interrupt moderation: armed waits start at least `moderation` apart, so that
//     the events of a slow, steady flow (a TCP segment every few microseconds) are handled a
//     batch per wake-up instead of one wake-up each.
// A transfer starts at the first turn, and again after the loop was idle (nothing in flight
// anywhere, Idle) for a window or longer.
//
// The policy reads no clock: every time comes in as an argument, so tests drive it with made-up
// times. Thread-safety: none; the data-plane thread owns it.

#include <chrono>
#include <cstdint>

namespace refit::dataplane {

struct ProgressOptions {
  // Rates are measured over windows this long (at least this long: a window ends at the first
  // turn past it).
  std::chrono::microseconds window{50'000};
  // At or above this rate (bytes per second, reads and served together) the loop polls on: a
  // wake-up per completion would cost more than the core it saves.
  double poll_rate = 300.0 * (1 << 20);
  // Below it, armed waits start at least this far apart.
  std::chrono::microseconds moderation{1000};
  // In a transfer's first window: poll on while the loop got anything done this recently.
  std::chrono::microseconds flowing{100};
};

class ProgressPolicy {
 public:
  using Clock = std::chrono::steady_clock;

  // One turn's view of the loop, after a turn that completed nothing of its own while
  // something is in flight.
  struct Sample {
    Clock::time_point now;
    uint64_t bytes_read = 0;      // the loop's own reads completed so far (running total)
    uint64_t bytes_served = 0;    // Transport::bytes_served() (running total)
    Clock::time_point active_at;  // when the loop last got anything done
  };
  enum class Action {
    kPollOn,  // yield (or nap briefly) and Poll again
    kBlock,   // wait until `arm_at` for posted work only, then arm the transport and block
  };
  struct Turn {
    Action action = Action::kPollOn;
    // kBlock: when the loop may arm the transport (<= now: at once). Until then events gather
    // unseen; posted work still wakes the loop (which then asks again and gets the same time).
    Clock::time_point arm_at;
  };

  explicit ProgressPolicy(ProgressOptions options = {}) : options_(options) {}

  // What to do next; see the file comment.
  Turn Next(const Sample& sample);
  // Nothing is in flight (no reads of its own, the transport has nothing to send or serve):
  // the next transfer starts afresh if it comes a window or more from now.
  void Idle(Clock::time_point now);

  // The rate of the last full window, bytes per second; negative while in a first window.
  double rate() const { return first_window_ ? -1.0 : rate_; }

 private:
  void Start(const Sample& sample);

  const ProgressOptions options_;
  bool started_ = false;
  bool first_window_ = true;
  Clock::time_point window_start_{};
  uint64_t window_bytes_ = 0;  // reads + served at window_start_
  double rate_ = 0;
  bool idle_ = false;
  Clock::time_point idle_since_{};
  // The arm the last kBlock turn allowed (it may still lie ahead: a nap cut short by work).
  Clock::time_point last_arm_{};
};

}  // namespace refit::dataplane
