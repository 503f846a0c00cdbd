#pragma once

// The staleness budget (PublishRequest.max_staleness = k): each model's budget and newest
// published version as this node heard them (a Publish here, or another node's announcement,
// PeerEvent.max_staleness), and which replicas (ModelStatus.replicas) hold the model more than k
// versions behind it: "stale". A monitor thread keeps the metrics current (refit_stale_replicas,
// refit_stale_models, refit_stale_seconds_total) and logs each change of a replica's state.
//
// Thread-safety: every method may be called from any thread. NotePublished only takes this
// object's lock (callable under other locks); the monitor reads the replica table.

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "daemon/common/mutex.h"
#include "daemon/common/worker_loop.h"
#include "daemon/fleet/replicas.h"
#include "daemon/metrics/metrics.h"

namespace refit::rl {

inline constexpr Gauge kStaleReplicas{
    "refit_stale_replicas",
    "Replica nodes (as this node hears their reports) more than their model's staleness budget "
    "behind the newest published version, over all models."};
inline constexpr Gauge kStaleModels{
    "refit_stale_models",
    "Models this node holds DESTINATION buffers for and is more than their staleness budget "
    "behind on."};
inline constexpr Counter kStaleSeconds{
    "refit_stale_seconds_total",
    "Seconds this node spent more than a model's staleness budget behind (summed over models)."};

struct Budget {
  uint32_t max_staleness = 0;  // 0: none
  uint64_t published = 0;      // the newest version published, as this node heard it
};

// Whether a replica holding `latest` is more than the budget behind.
inline bool IsStale(const Budget& budget, uint64_t latest) {
  return budget.max_staleness > 0 && budget.published > latest &&
         budget.published - latest > budget.max_staleness;
}

class Staleness {
 public:
  // This node's newest complete version of a model (the store's), read for this node's own
  // replica entry: the replica table hears it from the reporter, which may lag while it
  // reports to a slow peer. Empty: the table's entry only.
  using LocalLatest = std::function<uint64_t(const std::string& model)>;
  // Nothing owned; `replicas` and `metrics` outlive this object. `node` is this node.
  Staleness(std::string node, fleet::ReplicaTable* replicas, Metrics* metrics,
            std::chrono::milliseconds period = std::chrono::milliseconds(100),
            LocalLatest local_latest = nullptr);
  ~Staleness();  // Stop()

  void Start();
  void Stop();

  // `model`'s budget is `max_staleness` from now on (a Publish about to snapshot).
  void SetBudget(const std::string& model, uint32_t max_staleness);
  // The newest published version of `model` is `version`, with budget `max_staleness`.
  void NotePublished(const std::string& model, uint64_t version, uint32_t max_staleness);
  Budget Of(const std::string& model) const;
  // The replicas of `model` with their stale flag, sorted by node.
  struct ReplicaState {
    fleet::Replica replica;
    bool stale = false;
  };
  std::vector<ReplicaState> Replicas(const std::string& model) const;
  // Whether this node is a replica of `model` that is stale.
  bool NodeStale(const std::string& model) const;

 private:
  void Step();  // the monitor's turn

  const std::string node_;
  fleet::ReplicaTable* const replicas_;
  const LocalLatest local_latest_;
  Metrics* const metrics_;
  WorkerLoop monitor_;
  mutable common::Mutex mu_;
  std::map<std::string, Budget> budgets_ ABSL_GUARDED_BY(mu_);
  // Monitor thread only.
  std::set<std::pair<std::string, std::string>> stale_;  // (model, node) stale at the last step
  std::chrono::steady_clock::time_point last_step_;
};

}  // namespace refit::rl
