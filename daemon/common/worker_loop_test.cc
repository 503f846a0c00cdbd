#include "daemon/common/worker_loop.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "catch2/catch.hpp"

namespace refit {
namespace {

using std::chrono::milliseconds;

// Counts the steps a loop ran; a step can be held on a gate to make Notify calls pile up.
struct Steps {
  std::mutex mu;
  std::condition_variable cv;
  int count = 0;
  bool gate_closed = false;

  void Step() {
    std::unique_lock<std::mutex> lock(mu);
    ++count;
    cv.notify_all();
    cv.wait(lock, [this] { return !gate_closed; });
  }
  // Waits (at most 10 s) until at least `n` steps ran; returns the count.
  int WaitFor(int n) {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait_for(lock, std::chrono::seconds(10), [&] { return count >= n; });
    return count;
  }
  int Count() {
    std::lock_guard<std::mutex> lock(mu);
    return count;
  }
  void Gate(bool closed) {
    {
      std::lock_guard<std::mutex> lock(mu);
      gate_closed = closed;
    }
    cv.notify_all();
  }
};

TEST_CASE("a WorkerLoop steps once per Notify, and not without one", "[worker_loop]") {
  Steps steps;
  WorkerLoop loop("test-loop");
  loop.Start([&] { steps.Step(); });
  std::this_thread::sleep_for(milliseconds(50));
  CHECK(steps.Count() == 0);  // no period, no run_at_start: nothing to do
  loop.Notify();
  CHECK(steps.WaitFor(1) == 1);
  loop.Notify();
  CHECK(steps.WaitFor(2) == 2);
  std::this_thread::sleep_for(milliseconds(50));
  CHECK(steps.Count() == 2);
}

TEST_CASE("Notify calls during a step fold into one more step", "[worker_loop]") {
  Steps steps;
  WorkerLoop loop("test-fold");
  loop.Start([&] { steps.Step(); });
  steps.Gate(true);
  loop.Notify();
  REQUIRE(steps.WaitFor(1) == 1);  // the first step runs and is held at the gate
  for (int i = 0; i < 5; ++i) loop.Notify();
  steps.Gate(false);
  CHECK(steps.WaitFor(2) == 2);
  std::this_thread::sleep_for(milliseconds(100));
  CHECK(steps.Count() == 2);
}

TEST_CASE("a Notify before Start is kept; run_at_start steps once by itself", "[worker_loop]") {
  SECTION("notified before Start") {
    Steps steps;
    WorkerLoop loop("test-early");
    loop.Notify();
    loop.Start([&] { steps.Step(); });
    CHECK(steps.WaitFor(1) == 1);
  }
  SECTION("run_at_start") {
    Steps steps;
    WorkerLoop::Options options;
    options.name = "test-at-start";
    options.run_at_start = true;
    WorkerLoop loop(options);
    loop.Start([&] { steps.Step(); });
    CHECK(steps.WaitFor(1) == 1);
    std::this_thread::sleep_for(milliseconds(50));
    CHECK(steps.Count() == 1);
  }
}

TEST_CASE("a periodic WorkerLoop steps every period without a Notify", "[worker_loop]") {
  Steps steps;
  WorkerLoop::Options options;
  options.name = "test-periodic";
  options.period = milliseconds(10);
  WorkerLoop loop(options);
  loop.Start([&] { steps.Step(); });
  CHECK(steps.WaitFor(3) >= 3);
}

TEST_CASE("Stop waits for the step in progress and no step starts after it", "[worker_loop]") {
  Steps steps;
  WorkerLoop loop("test-stop");
  loop.Start([&] { steps.Step(); });
  steps.Gate(true);
  loop.Notify();
  REQUIRE(steps.WaitFor(1) == 1);
  std::atomic<bool> stopped{false};
  std::thread stopper([&] {
    loop.Stop();
    stopped = true;
  });
  std::this_thread::sleep_for(milliseconds(50));
  CHECK_FALSE(stopped);  // the step is still held at the gate
  loop.Notify();         // after Stop: never runs
  steps.Gate(false);
  stopper.join();
  CHECK(stopped);
  std::this_thread::sleep_for(milliseconds(50));
  CHECK(steps.Count() == 1);
  loop.Stop();  // idempotent
}

TEST_CASE("Stop without Start, and Start after Stop, run nothing", "[worker_loop]") {
  Steps steps;
  {
    WorkerLoop loop("test-unstarted");
    loop.Notify();
    loop.Stop();
    loop.Start([&] { steps.Step(); });
  }
  CHECK(steps.Count() == 0);
}

}  // namespace
}  // namespace refit
