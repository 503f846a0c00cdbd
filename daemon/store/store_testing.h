#pragma once

// What the store's tests (and the tests of packages that make a Store) share: the options they
// start from, and store listeners (StoreEvents) standing in for refitd's peer plane. Declare a
// listener before the Store it listens to, so that it outlives the store's last event.
// Test-only; not thread-safe beyond what the store's lock gives.

#include <string>
#include <utility>
#include <vector>

#include "daemon/store/store.h"

namespace refit::testing {

// StoreOptions with what refitd always sets and these tests rely on: retain 2 and a node name;
// the rest as StoreOptions leaves it (host slots, no limits, the held copy as delta base).
// These are the tests' own explicit values; refitd's defaults live in DaemonOptions
// (daemon/options.h) alone, and StoreOptionsFrom (daemon/component_options.h) carries them.
inline StoreOptions TestStoreOptions(std::string node = "node") {
  StoreOptions options;
  options.retain = 2;
  options.node = std::move(node);
  return options;
}

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
