#include "daemon/fleet/replicas.h"

#include <algorithm>
#include <iterator>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace refit::fleet {

ReplicaTable::ReplicaTable(std::function<Clock::time_point()> now) : now_(std::move(now)) {}

absl::StatusOr<ReplicaTable::Node*> ReplicaTable::EntryLocked(const std::string& node) {
  ForgetSilentLocked();
  if (nodes_.size() >= kMaxReplicaNodes && !nodes_.count(node)) {
    return absl::ResourceExhaustedError(absl::StrCat("the replica table holds ", nodes_.size(),
                                                     " nodes (at most ", kMaxReplicaNodes, ")"));
  }
  return &nodes_[node];
}

absl::Status ReplicaTable::Report(const std::string& node, bool relay,
                                  std::vector<ReplicaEntry> entries, const std::string& site) {
  {
    common::MutexLock lock(mu_);
    absl::StatusOr<Node*> entry = EntryLocked(node);
    if (!entry.ok()) return entry.status();
    Node& n = **entry;
    n.relay = relay;
    n.site = site;
    n.heard = now_();
    n.latest.clear();
    for (ReplicaEntry& e : entries) {
      const std::string model = e.model;  // the right side is evaluated first (C++17)
      n.latest[model] = {std::move(e), n.heard};
    }
  }
  changed_.NotifyAll();
  return absl::OkStatus();
}

absl::Status ReplicaTable::Merge(const std::string& node, bool relay,
                                 std::vector<ReplicaEntry> entries, const std::string& site) {
  {
    common::MutexLock lock(mu_);
    absl::StatusOr<Node*> entry = EntryLocked(node);
    if (!entry.ok()) return entry.status();
    Node& n = **entry;
    n.relay = relay;
    n.site = site;
    n.heard = now_();
    for (ReplicaEntry& e : entries) {
      const std::string model = e.model;  // the right side is evaluated first (C++17)
      n.latest[model] = {std::move(e), n.heard};
    }
  }
  changed_.NotifyAll();
  return absl::OkStatus();
}

void ReplicaTable::ForgetSilentLocked() {
  const auto now = now_();
  for (auto it = nodes_.begin(); it != nodes_.end();) {
    if (now - it->second.heard > kReplicaForget) {
      it = nodes_.erase(it);
      continue;
    }
    auto& latest = it->second.latest;  // models no origin named for as long go too
    for (auto m = latest.begin(); m != latest.end();) {
      m = now - m->second.heard > kReplicaForget ? latest.erase(m) : std::next(m);
    }
    ++it;
  }
}

size_t ReplicaTable::size() const {
  common::MutexLock lock(mu_);
  return nodes_.size();
}

void ReplicaTable::Forget(const std::string& node) {
  {
    common::MutexLock lock(mu_);
    nodes_.erase(node);
  }
  changed_.NotifyAll();
}

std::vector<Replica> ReplicaTable::LiveLocked(const std::string& model) const {
  std::vector<Replica> out;
  const auto now = now_();
  for (const auto& [name, node] : nodes_) {
    if (now - node.heard > kReplicaTtl) continue;
    auto it = node.latest.find(model);
    if (it == node.latest.end() || now - it->second.heard > kReplicaTtl) continue;
    const ReplicaEntry& e = it->second.entry;
    out.push_back(
        {name, e.latest_version, node.relay, node.site, e.rollback_version, e.rolled_back});
  }
  return out;  // map order: sorted by node
}

std::vector<Replica> ReplicaTable::ReplicasOf(const std::string& model) const {
  common::MutexLock lock(mu_);
  return LiveLocked(model);
}

std::vector<std::string> ReplicaTable::Relays(const std::string& model) const {
  common::MutexLock lock(mu_);
  std::vector<std::string> out;
  for (const Replica& r : LiveLocked(model)) {
    if (r.relay) out.push_back(r.node);
  }
  return out;
}

std::map<std::string, std::vector<std::string>> ReplicaTable::RelaysBySite(
    const std::string& model) const {
  common::MutexLock lock(mu_);
  std::map<std::string, std::vector<std::string>> out;
  for (const Replica& r : LiveLocked(model)) {
    if (r.relay) out[r.site].push_back(r.node);
  }
  return out;
}

absl::StatusOr<ReplicasReached> ReplicaTable::WaitFor(const std::string& model, uint64_t version,
                                                      uint32_t min_nodes,
                                                      Clock::time_point deadline,
                                                      const std::function<bool()>& cancelled) {
  common::UniqueLock lock(mu_);
  while (true) {
    if (shutdown_) return absl::UnavailableError("refitd is shutting down");
    const std::vector<Replica> live = LiveLocked(model);
    ReplicasReached reached;
    reached.version = UINT64_MAX;
    std::vector<std::string> behind;
    for (const Replica& r : live) {
      const uint64_t at = r.Effective();
      if (at >= version && at > 0) {
        reached.nodes.push_back(r.node);
        reached.version = std::min(reached.version, at);
      } else if (r.rollback_version != 0) {
        behind.push_back(absl::StrCat(r.node, " rolling back to ", r.rollback_version,
                                      " (not applied there yet)"));
      } else {
        behind.push_back(absl::StrCat(r.node, " at ", r.latest_version));
      }
    }
    const size_t needed = min_nodes == 0 ? std::max<size_t>(1, live.size()) : min_nodes;
    if (reached.nodes.size() >= needed) return reached;
    if (cancelled && cancelled()) return absl::CancelledError("the caller went away");
    if (Clock::now() >= deadline) {
      return absl::DeadlineExceededError(absl::StrCat(
          "model ", model, ": version ", version, " is complete on ", reached.nodes.size(),
          " of the ", needed, " replica nodes waited for",
          live.empty() ? " (no node with DESTINATION buffers for this model has reported to "
                         "this daemon)"
                       : "",
          behind.empty() ? "" : absl::StrCat("; behind: ", absl::StrJoin(behind, ", "))));
    }
    // Reports arrive at least every heartbeat; a replica that goes silent leaves the live set
    // after kReplicaTtl, which a wake-up every 50 ms notices.
    changed_.WaitUntil(lock, std::min(deadline, Clock::now() + std::chrono::milliseconds(50)));
  }
}

void ReplicaTable::Shutdown() {
  {
    common::MutexLock lock(mu_);
    shutdown_ = true;
  }
  changed_.NotifyAll();
}

}  // namespace refit::fleet
