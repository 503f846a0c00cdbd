#pragma once

// The pull worker: runs the store's PullJobs one at a time, in the order they came, through a
// pull::Puller, and hands each outcome to the store (Store::FinishPull). While a pull runs,
// RelayChannels frees no stub (BeginPull / EndPull) and Transfers tells its progress.
//
// Thread-safety: every method may be called from any thread; Queue also under the store's lock
// (it only queues).

#include <deque>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "daemon/common/mutex.h"
#include "daemon/metrics/metrics.h"
#include "daemon/peer/relay_channels.h"
#include "daemon/pull/puller.h"
#include "daemon/store/store.h"

namespace refit::peer {

struct Transfer {
  std::string model;
  uint64_t version = 0;
  uint64_t bytes_total = 0;
  uint64_t bytes_done = 0;
};

class PullWorker {
 public:
  // Nothing is owned.
  PullWorker(Store* store, pull::Puller* puller, RelayChannels* channels, Metrics* metrics);
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

  Store* const store_;
  pull::Puller* const puller_;
  RelayChannels* const channels_;
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
