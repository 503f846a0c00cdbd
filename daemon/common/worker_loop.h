#pragma once

// A background worker: one thread that runs a step each time it is notified, and with a period
// also every period. Notify() marks work pending: calls that come while a step runs, or before
// the thread wakes, fold into one more step (a step re-reads what it works on, so it needs no
// count). Stop() ends the loop after the step in progress. Notify before Start only marks work
// pending; Stop before Start (or without one) is fine.
//
// The daemon's workers that wait for "notified or stopped" use it: DeltaSource, BucketExport,
// BucketImport, PeerManager's replica reporter and LivenessProbe (the store's watchdog probe).
//
// Thread-safety: Notify and Stop may be called from any thread, Notify also under the caller's
// own locks (it only sets a flag). The step runs on the loop's thread only, never concurrently
// with itself. Start is called once, by the owner.

#include <chrono>
#include <functional>
#include <string>
#include <thread>
#include <utility>

#include "daemon/common/mutex.h"

namespace refit {

class WorkerLoop {
 public:
  struct Options {
    // Names the thread (as `top -H` and gdb show it, cut to 15 characters) and the log lines.
    std::string name;
    // Also runs the step every `period` without a Notify; zero: only when notified.
    std::chrono::milliseconds period{0};
    // Runs a first step at Start without a Notify.
    bool run_at_start = false;
  };

  explicit WorkerLoop(Options options);
  // Only when notified.
  explicit WorkerLoop(std::string name)
      : WorkerLoop(Options{std::move(name), std::chrono::milliseconds(0), false}) {}
  ~WorkerLoop();  // Stop()
  WorkerLoop(const WorkerLoop&) = delete;
  WorkerLoop& operator=(const WorkerLoop&) = delete;

  // Starts the thread running `step`. At most once; not after Stop.
  void Start(std::function<void()> step);
  void Notify();
  // Idempotent; waits for the step in progress (unless called from the step itself). No step
  // starts after it.
  void Stop();

  const std::string& name() const { return options_.name; }

 private:
  void Run();

  const Options options_;
  std::function<void()> step_;  // set by Start, before the thread starts
  common::Mutex mu_;
  common::CondVar wake_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  bool pending_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace refit
