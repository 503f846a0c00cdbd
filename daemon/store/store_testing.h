#pragma once

// Store listeners for the store's tests (StoreEvents), standing in for refitd's peer plane.
// Declare one before the Store it listens to, so that it outlives the store's last event.
// Test-only; not thread-safe beyond what the store's lock gives.

#include <vector>

#include "daemon/store/store.h"

namespace refit::testing {

// Reads local snapshots, as the peer plane does: the store keeps them (GetLocalSnapshot).
class SnapshotReader final : public StoreEvents {
 public:
  bool WantsLocalSnapshots() const override { return true; }
};

// Records the pulls the store asks for into `jobs` (the test finishes them with FinishPull).
class PullRecorder final : public StoreEvents {
 public:
  explicit PullRecorder(std::vector<PullJob>* jobs) : jobs_(jobs) {}
  void OnPullNeeded(const PullJob& job) override { jobs_->push_back(job); }

 private:
  std::vector<PullJob>* const jobs_;
};

}  // namespace refit::testing
