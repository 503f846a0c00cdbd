#pragma once

// The pull worker: runs the store's PullJobs one at a time, in the order they came, through a
// pull::Puller, and hands each outcome to the store (Store::FinishPull). While a pull runs,
// RelayChannels frees no stub (BeginPull / EndPull) and Transfers tells its progress. What it
// needs of each is a narrow interface below (PeerManager adapts the Puller and the store's
// PullLanding; RelayChannels is a PullsInFlight), so that it is unit-tested alone
// (pull_worker_test).
//
// Thread-safety: every method may be called from any thread; Queue also under the store's lock
// (it only queues).

#include <deque>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "daemon/common/mutex.h"
#include "daemon/metrics/metrics.h"
#include "daemon/pull/puller.h"
#include "daemon/store/pull_landing.h"
#include "daemon/store/store_types.h"

namespace refit::peer {

// Runs one pull to its end (pull::Puller::Pull).
class PullRunner {
 public:
  virtual ~PullRunner() = default;
  virtual pull::PullOutcome Run(const PullJob& job) = 0;
};

// Where a pull's outcome goes (Store::FinishPull).
class PullFinisher {
 public:
  virtual ~PullFinisher() = default;
  virtual void Finish(const PullJob& job, absl::Status status,
                      std::vector<std::shared_ptr<Region>> staging) = 0;
};

// Told when a pull starts and ends (RelayChannels: no stub is freed in between).
class PullsInFlight {
 public:
  virtual ~PullsInFlight() = default;
  virtual void BeginPull() = 0;
  virtual void EndPull() = 0;
};

// The adapters refitd uses.
class PullerRunner final : public PullRunner {
 public:
  explicit PullerRunner(pull::Puller* puller) : puller_(puller) {}
  pull::PullOutcome Run(const PullJob& job) override { return puller_->Pull(job); }

 private:
  pull::Puller* const puller_;
};
class StoreFinisher final : public PullFinisher {
 public:
  explicit StoreFinisher(PullLanding* store) : store_(store) {}
  void Finish(const PullJob& job, absl::Status status,
              std::vector<std::shared_ptr<Region>> staging) override {
    store_->FinishPull(job, std::move(status), std::move(staging));
  }

 private:
  PullLanding* const store_;
};

struct Transfer {
  std::string model;
  uint64_t version = 0;
  uint64_t bytes_total = 0;
  uint64_t bytes_done = 0;
};

class PullWorker {
 public:
  // Nothing is owned.
  PullWorker(PullRunner* runner, PullFinisher* finisher, PullsInFlight* in_flight,
             Metrics* metrics);
  ~PullWorker();  // Stop()

  void Start();
  // Ends the loop once the pull in flight ends (the caller makes it fail: PeerLinks::Stop and
  // RelayChannels::Stop drop the endpoints); the jobs still queued are dropped.
  void Stop();

  void Queue(const PullJob& job);
  // The pull in flight, if any.
  std::vector<Transfer> Transfers() const;

 private:
  void Run();

  PullRunner* const runner_;
  PullFinisher* const finisher_;
  PullsInFlight* const in_flight_;
  Metrics* const metrics_;

  mutable common::Mutex mu_;
  common::CondVar wake_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<PullJob> jobs_ ABSL_GUARDED_BY(mu_);
  // The pull in flight: bytes_done = received counter now - at its start.
  std::optional<Transfer> current_ ABSL_GUARDED_BY(mu_);
  double received_at_start_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;
};

}  // namespace refit::peer
