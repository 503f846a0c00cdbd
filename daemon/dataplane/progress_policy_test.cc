// ProgressPolicy on made-up times (no clock, no sleeping): what the data plane's loop does after
// a turn that completed nothing, as the bytes through the node flow fast, slowly, or not at all.

#include "daemon/dataplane/progress_policy.h"

#include <chrono>
#include <cstdint>

#include "catch2/catch.hpp"

namespace refit::dataplane {
namespace {

using Action = ProgressPolicy::Action;
using Clock = ProgressPolicy::Clock;
using std::chrono::microseconds;
using std::chrono::milliseconds;

constexpr uint64_t kMiB = 1 << 20;

// The loop as the policy sees it: a time, the running byte counts, when it last did anything.
struct Loop {
  Clock::time_point now = Clock::time_point{} + std::chrono::hours(1);
  uint64_t read = 0;
  uint64_t served = 0;
  Clock::time_point active_at = now;

  // Time passes with `read_bytes` / `served_bytes` moved meanwhile; the loop last got
  // something done `quiet` ago.
  void Advance(Clock::duration by, uint64_t read_bytes = 0, uint64_t served_bytes = 0,
               Clock::duration quiet = milliseconds(1)) {
    now += by;
    read += read_bytes;
    served += served_bytes;
    active_at = now - quiet;
  }
  ProgressPolicy::Turn Next(ProgressPolicy& policy) const {
    return policy.Next({now, read, served, active_at});
  }
};

// Options with the defaults' meaning spelled out, so the cases read without them.
ProgressOptions Options() {
  ProgressOptions options;
  options.window = milliseconds(50);
  options.poll_rate = 300.0 * kMiB;
  options.moderation = milliseconds(1);
  options.flowing = microseconds(100);
  return options;
}

// Runs one window at `mib_per_s` of reads (and `served_mib_per_s` served) and ends it.
void Window(ProgressPolicy& policy, Loop& loop, double mib_per_s, double served_mib_per_s = 0) {
  const auto read = static_cast<uint64_t>(mib_per_s * kMiB / 20);  // 50 ms' worth
  const auto served = static_cast<uint64_t>(served_mib_per_s * kMiB / 20);
  loop.Advance(milliseconds(50), read, served);
  loop.Next(policy);
}

// What a fresh policy does right after its first window, in which the node read at
// `mib_per_s` and served `served_mib_per_s`.
Action AfterFirstWindow(double mib_per_s, double served_mib_per_s = 0) {
  ProgressPolicy policy(Options());
  Loop loop;
  loop.Next(policy);
  Window(policy, loop, mib_per_s, served_mib_per_s);
  return loop.Next(policy).action;
}

TEST_CASE(
    "in a transfer's first window the loop polls on while things happen, else blocks at "
    "once",
    "[progress]") {
  ProgressPolicy policy(Options());
  Loop loop;
  // Something got done 10 us ago: bytes are flowing, poll on (a fast link's next completion is
  // microseconds away).
  loop.Advance(microseconds(0), 4 * kMiB, 0, microseconds(10));
  auto turn = loop.Next(policy);
  CHECK(turn.action == Action::kPollOn);
  CHECK(policy.rate() < 0);  // no rate known yet
  // Nothing for 1 ms: block, armed at once (no moderation before a rate is known).
  loop.Advance(milliseconds(1), 0, 0, milliseconds(1));
  turn = loop.Next(policy);
  CHECK(turn.action == Action::kBlock);
  CHECK(turn.arm_at == loop.now);
  loop.Advance(microseconds(200), 0, 0, microseconds(200));
  turn = loop.Next(policy);
  CHECK(turn.action == Action::kBlock);
  CHECK(turn.arm_at == loop.now);
}

TEST_CASE("a slow rate blocks, with armed waits at least the moderation apart", "[progress]") {
  ProgressPolicy policy(Options());
  Loop loop;
  loop.Next(policy);
  Window(policy, loop, 30);  // 30 MiB/s: a 250 Mbit/s link
  CHECK(policy.rate() == Approx(30.0 * kMiB));
  // Even right after a completion (active now), the rate decides: block.
  loop.Advance(microseconds(10), 0, 0, microseconds(0));
  auto turn = loop.Next(policy);
  REQUIRE(turn.action == Action::kBlock);
  const auto first_arm = turn.arm_at;
  CHECK(first_arm <= loop.now + milliseconds(1));
  // Asked again before that arm (posted work ended the nap): the same arm.
  loop.Advance(microseconds(300));
  turn = loop.Next(policy);
  REQUIRE(turn.action == Action::kBlock);
  CHECK(turn.arm_at == first_arm);
  // The loop armed then, and an event ended the armed wait 100 us later: the next arm is a
  // moderation after the last.
  loop.now = first_arm + microseconds(100);
  loop.active_at = loop.now;
  loop.read += kMiB;
  turn = loop.Next(policy);
  REQUIRE(turn.action == Action::kBlock);
  CHECK(turn.arm_at == first_arm + milliseconds(1));
  const auto second_arm = turn.arm_at;
  // Long after the last arm (the armed wait timed out): arm at once.
  loop.now = second_arm + milliseconds(5);
  turn = loop.Next(policy);
  REQUIRE(turn.action == Action::kBlock);
  CHECK(turn.arm_at == loop.now);
}

TEST_CASE("a fast rate polls on, even between completions", "[progress]") {
  ProgressPolicy policy(Options());
  Loop loop;
  loop.Next(policy);
  Window(policy, loop, 1000);  // ~1 GiB/s: loopback
  CHECK(policy.rate() == Approx(1000.0 * kMiB));
  loop.Advance(milliseconds(2), 0, 0, milliseconds(2));  // nothing for 2 ms
  CHECK(loop.Next(policy).action == Action::kPollOn);
  // Just above the threshold too; just below it, block.
  CHECK(AfterFirstWindow(310) == Action::kPollOn);
  CHECK(AfterFirstWindow(290) == Action::kBlock);
}

TEST_CASE("bytes served to peers count with the node's own reads", "[progress]") {
  // A relay: it reads at 100 MiB/s and serves 400 MiB/s to the nodes reading from it.
  ProgressPolicy relay(Options());
  Loop loop;
  loop.Next(relay);
  Window(relay, loop, 100, 400);
  CHECK(relay.rate() == Approx(500.0 * kMiB));
  CHECK(loop.Next(relay).action == Action::kPollOn);
  // The same reads without the serving: block.
  CHECK(AfterFirstWindow(100) == Action::kBlock);
  // Serving alone (a source node, nothing of its own in flight) counts too.
  CHECK(AfterFirstWindow(0, 350) == Action::kPollOn);
  CHECK(AfterFirstWindow(0, 250) == Action::kBlock);
}

TEST_CASE("when the rate falls back the loop blocks again", "[progress]") {
  ProgressPolicy policy(Options());
  Loop loop;
  loop.Next(policy);
  Window(policy, loop, 800);
  CHECK(loop.Next(policy).action == Action::kPollOn);
  Window(policy, loop, 20);  // the link got busy with other traffic
  CHECK(policy.rate() == Approx(20.0 * kMiB));
  CHECK(loop.Next(policy).action == Action::kBlock);
  Window(policy, loop, 600);  // and fast again
  CHECK(loop.Next(policy).action == Action::kPollOn);
}

TEST_CASE("nothing moving blocks; after idleness the next transfer starts afresh", "[progress]") {
  ProgressPolicy policy(Options());
  Loop loop;
  loop.Next(policy);
  Window(policy, loop, 0);  // in flight, but nothing moved for a whole window
  CHECK(policy.rate() == 0);
  CHECK(loop.Next(policy).action == Action::kBlock);

  // A fast transfer, then nothing in flight for 20 ms (shorter than a window): the same
  // transfer, judged by its rate.
  ProgressPolicy fast(Options());
  Loop lull;
  lull.Next(fast);
  Window(fast, lull, 100);
  fast.Idle(lull.now);
  lull.Advance(milliseconds(20), 0, 0, milliseconds(5));
  CHECK(lull.Next(fast).action == Action::kBlock);  // 100 MiB/s and nothing flowing
  CHECK(fast.rate() == Approx(100.0 * kMiB));
  // Idle for a window or more: a new transfer, whose first window polls while things happen.
  fast.Idle(lull.now);
  lull.Advance(milliseconds(60), kMiB, 0, microseconds(5));
  CHECK(lull.Next(fast).action == Action::kPollOn);
  CHECK(fast.rate() < 0);
  // Idle called on every sleep counts from the first of them.
  fast.Idle(lull.now);
  lull.Advance(milliseconds(30));
  fast.Idle(lull.now);
  lull.Advance(milliseconds(30), 0, 0, microseconds(5));
  CHECK(lull.Next(fast).action == Action::kPollOn);
  CHECK(fast.rate() < 0);
}

TEST_CASE("a window's bytes count once it ends, over the time it really took", "[progress]") {
  ProgressPolicy policy(Options());
  Loop loop;
  loop.Next(policy);
  Window(policy, loop, 50);  // slow
  REQUIRE(loop.Next(policy).action == Action::kBlock);
  // 40 ms into the next window, 100 MiB arrived (2.5 GiB/s so far): the window hasn't ended,
  // the last full window's rate still decides.
  loop.Advance(milliseconds(40), 100 * kMiB);
  CHECK(loop.Next(policy).action == Action::kBlock);
  CHECK(policy.rate() == Approx(50.0 * kMiB));
  // The window ends at the first turn past 50 ms, here at 80 ms: (100 + 20) MiB over 80 ms.
  loop.Advance(milliseconds(40), 20 * kMiB);
  CHECK(loop.Next(policy).action == Action::kPollOn);
  CHECK(policy.rate() == Approx(120.0 * kMiB / 0.080));
  // The next window starts there: 10 MiB over the following 50 ms is slow again.
  loop.Advance(milliseconds(30), 10 * kMiB);
  CHECK(loop.Next(policy).action == Action::kPollOn);  // still the last full window's rate
  loop.Advance(milliseconds(20));
  CHECK(loop.Next(policy).action == Action::kBlock);
  CHECK(policy.rate() == Approx(10.0 * kMiB / 0.050));
}

}  // namespace
}  // namespace refit::dataplane
