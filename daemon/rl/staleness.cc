#include "daemon/rl/staleness.h"

#include <algorithm>

#include "daemon/common/logging.h"

namespace refit::rl {

Staleness::Staleness(std::string node, fleet::ReplicaTable* replicas, Metrics* metrics,
                     std::chrono::milliseconds period, LocalLatest local_latest)
    : node_(std::move(node)),
      replicas_(replicas),
      local_latest_(std::move(local_latest)),
      metrics_(metrics),
      monitor_(WorkerLoop::Options{"staleness", period, true}) {
  metrics_->Declare(kStaleReplicas);
  metrics_->Declare(kStaleModels);
  metrics_->Declare(kStaleSeconds);
}

Staleness::~Staleness() { Stop(); }

void Staleness::Start() {
  last_step_ = std::chrono::steady_clock::now();
  monitor_.Start([this] { Step(); });
}

void Staleness::Stop() { monitor_.Stop(); }

void Staleness::NotePublished(const std::string& model, uint64_t version, uint32_t max_staleness) {
  if (version == 0) return;
  {
    common::MutexLock lock(mu_);
    Budget& budget = budgets_[model];
    budget.published = version;
    budget.max_staleness = max_staleness;
  }
  monitor_.Notify();
}

void Staleness::SetBudget(const std::string& model, uint32_t max_staleness) {
  {
    common::MutexLock lock(mu_);
    budgets_[model].max_staleness = max_staleness;
  }
  monitor_.Notify();
}

Budget Staleness::Of(const std::string& model) const {
  common::MutexLock lock(mu_);
  auto it = budgets_.find(model);
  return it == budgets_.end() ? Budget() : it->second;
}

std::vector<Staleness::ReplicaState> Staleness::Replicas(const std::string& model) const {
  const Budget budget = Of(model);
  std::vector<ReplicaState> out;
  if (!replicas_) return out;
  for (fleet::Replica r : replicas_->ReplicasOf(model)) {
    if (r.node == node_ && local_latest_) {
      r.latest_version = std::max(r.latest_version, local_latest_(model));
    }
    out.push_back({r, IsStale(budget, r.latest_version)});
  }
  return out;
}

bool Staleness::NodeStale(const std::string& model) const {
  for (const ReplicaState& r : Replicas(model)) {
    if (r.replica.node == node_) return r.stale;
  }
  return false;
}

void Staleness::Step() {
  std::map<std::string, Budget> budgets;
  {
    common::MutexLock lock(mu_);
    budgets = budgets_;
  }
  const auto now = std::chrono::steady_clock::now();
  const double elapsed = std::chrono::duration<double>(now - last_step_).count();
  last_step_ = now;
  std::set<std::pair<std::string, std::string>> stale;
  size_t own = 0;
  for (const auto& [model, budget] : budgets) {
    if (budget.max_staleness == 0) continue;
    for (const ReplicaState& r : Replicas(model)) {
      if (!r.stale) continue;
      stale.emplace(model, r.replica.node);
      if (r.replica.node == node_) ++own;
    }
  }
  for (const auto& key : stale) {
    if (stale_.count(key)) continue;
    const Budget& budget = budgets[key.first];
    Logger("fleet")->warn(
        "model={} replica {} is stale: more than {} versions behind version {} (max_staleness)",
        key.first, key.second, budget.max_staleness, budget.published);
  }
  for (const auto& key : stale_) {
    if (!stale.count(key)) {
      Logger("fleet")->info("model={} replica {} is within its staleness budget again", key.first,
                            key.second);
    }
  }
  // The time since the last step was spent as that step found this node (within a period).
  size_t own_before = 0;
  for (const auto& key : stale_) {
    if (key.second == node_) ++own_before;
  }
  if (own_before > 0) metrics_->Add(kStaleSeconds, elapsed * static_cast<double>(own_before));
  stale_ = std::move(stale);
  metrics_->Set(kStaleReplicas, static_cast<double>(stale_.size()));
  metrics_->Set(kStaleModels, static_cast<double>(own));
}

}  // namespace refit::rl
