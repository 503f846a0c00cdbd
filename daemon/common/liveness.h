#pragma once

// Which of the daemon's workers are alive: each long-lived worker thread (the data plane, the
// store's quantizer, the peer pulls) holds a Worker and says when it is busy, when it makes
// progress and when it is idle. A worker busy without progress for longer than a stall bound is
// stuck; the daemon then stops pinging systemd's watchdog and answers health NOT_SERVING,
// naming it (daemon/main.cc, Daemon::StuckWorkers), so that systemd restarts a wedged daemon
// instead of a loop that merely sleeps well.
//
// Thread-safety: Worker's methods are lock-free and called by its own thread; Register and
// Stuck may be called from any thread.

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "daemon/common/mutex.h"
#include "daemon/common/worker_loop.h"

namespace refit {

class Liveness {
 public:
  class Worker {
   public:
    explicit Worker(std::string name) : name_(std::move(name)) {}
    const std::string& name() const { return name_; }
    // Starts a unit of work (progress counts from now).
    void Busy() {
      last_progress_ns_.store(Now(), std::memory_order_relaxed);
      busy_.store(true, std::memory_order_relaxed);
    }
    // The work moved on (a read landed, a block was quantized, a loop turned).
    void Progress() { last_progress_ns_.store(Now(), std::memory_order_relaxed); }
    // Waiting for work: never stuck while idle.
    void Idle() { busy_.store(false, std::memory_order_relaxed); }

    bool busy() const { return busy_.load(std::memory_order_relaxed); }
    // Nanoseconds since the last progress (or Busy).
    int64_t SinceProgressNs() const {
      return Now() - last_progress_ns_.load(std::memory_order_relaxed);
    }

   private:
    static int64_t Now() {
      return std::chrono::duration_cast<std::chrono::nanoseconds>(
                 std::chrono::steady_clock::now().time_since_epoch())
          .count();
    }
    const std::string name_;
    std::atomic<bool> busy_{false};
    std::atomic<int64_t> last_progress_ns_{0};
  };

  // A worker that lives as long as this registry. Names need not be unique.
  Worker* Register(std::string name) {
    common::MutexLock lock(mu_);
    workers_.emplace_back(std::move(name));
    return &workers_.back();
  }

  // "name (busy 42.0 s without progress)" for every worker busy without progress for longer
  // than `stall`; empty when all is well.
  std::vector<std::string> Stuck(std::chrono::milliseconds stall) const;

 private:
  mutable common::Mutex mu_;
  std::deque<Worker> workers_ ABSL_GUARDED_BY(mu_);  // stable addresses
};

// A worker for something that has no thread of its own (the store, behind its lock): every
// `interval` it runs `probe` as a unit of work. A probe that blocks (the lock held by a wedged
// caller) leaves the worker busy without progress, so the watchdog sees the component stuck.
class LivenessProbe {
 public:
  LivenessProbe(Liveness::Worker* worker, std::function<void()> probe,
                std::chrono::milliseconds interval);
  ~LivenessProbe();  // Stop()
  void Stop();       // waits for a probe in progress

 private:
  void Probe();
  Liveness::Worker* const worker_;
  const std::function<void()> probe_;
  WorkerLoop loop_;  // periodic, from Start
};

}  // namespace refit
