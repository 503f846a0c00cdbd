#pragma once

// Which nodes hold which complete version of each model: every node with DESTINATION buffers
// reports its newest complete version per model to the daemons it is connected to (Peer.Report,
// on every change and as a heartbeat), and each daemon keeps what it heard here. A node that
// stops reporting for kReplicaTtl is taken as gone. Feeds ModelStatus.replicas,
// WaitForReplicas, and the choice of relays (only nodes that report relaying).
//
// Thread-safety: every method may be called from any thread.

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/common/mutex.h"

namespace refit::fleet {

inline constexpr auto kReplicaTtl = std::chrono::seconds(6);
// A node silent this long is forgotten, not only left out; and the table holds at most
// kMaxReplicaNodes nodes (a report naming one more is refused RESOURCE_EXHAUSTED).
inline constexpr auto kReplicaForget = std::chrono::seconds(60);
inline constexpr size_t kMaxReplicaNodes = 4096;

struct ReplicaEntry {
  std::string model;
  uint64_t latest_version = 0;  // newest complete version there (0: none yet)
  // Rollback: the version the node holds the model back to (0: none), and whether every
  // DESTINATION buffer of it there holds that version.
  uint64_t rollback_version = 0;
  bool rolled_back = false;
};

struct Replica {
  std::string node;
  uint64_t latest_version = 0;
  bool relay = false;  // serves what it pulled to other nodes
  std::string site;    // its --site ("": none)
  uint64_t rollback_version = 0;
  bool rolled_back = false;
  // What WaitForReplicas counts: latest_version, or during a rollback the rollback version once
  // the node's destinations hold it (0 before).
  uint64_t Effective() const {
    if (rollback_version == 0) return latest_version;
    return rolled_back ? rollback_version : 0;
  }
};

struct ReplicasReached {
  uint64_t version = 0;            // the oldest version among `nodes` (>= the one waited for)
  std::vector<std::string> nodes;  // the nodes that hold it or newer, sorted
};

class ReplicaTable {
 public:
  using Clock = std::chrono::steady_clock;
  explicit ReplicaTable(std::function<Clock::time_point()> now = Clock::now);

  // `node` holds DESTINATION buffers of the models in `entries` (replacing what it said
  // before) and relays or not. RESOURCE_EXHAUSTED (nothing kept) when `node` is new and the
  // table holds kMaxReplicaNodes nodes that reported within kReplicaForget.
  absl::Status Report(const std::string& node, bool relay, std::vector<ReplicaEntry> entries,
                      const std::string& site = "");
  // What an origin said about `node` (its answer to this node's report: one origin's view):
  // the models in `entries` are updated, the node's other models are kept (another origin may
  // have named them), each model live for kReplicaTtl from when it was last heard. So the
  // member lists of several origins (trainer nodes) are merged, not replaced.
  absl::Status Merge(const std::string& node, bool relay, std::vector<ReplicaEntry> entries,
                     const std::string& site = "");
  // `node` is gone (its connection ended, or it said so).
  void Forget(const std::string& node);

  // The live replicas of `model`, sorted by node.
  std::vector<Replica> ReplicasOf(const std::string& model) const;
  // The live replicas of `model` that relay, sorted.
  std::vector<std::string> Relays(const std::string& model) const;
  // The same, by site (--site; "" for nodes without one).
  std::map<std::string, std::vector<std::string>> RelaysBySite(const std::string& model) const;

  // Blocks until `version` or newer is complete on at least `min_nodes` live replicas of
  // `model` (0: on all of them, and at least one). A replica rolled back (Rollback) counts with
  // its rollback version once every DESTINATION buffer there holds it, and not before
  // (Replica::Effective): the fleet is back when each replica applied it. DEADLINE_EXCEEDED past
  // `deadline` (the message says which replicas are behind), CANCELLED when `cancelled()`,
  // UNAVAILABLE after Shutdown.
  absl::StatusOr<ReplicasReached> WaitFor(const std::string& model, uint64_t version,
                                          uint32_t min_nodes, Clock::time_point deadline,
                                          const std::function<bool()>& cancelled);
  void Shutdown();
  // Nodes in the table (live or not yet forgotten).
  size_t size() const;

 private:
  struct Node {
    bool relay = false;
    std::string site;
    Clock::time_point heard;
    struct Held {
      ReplicaEntry entry;
      Clock::time_point heard;
    };
    std::map<std::string, Held> latest;  // by model: what was said, and when
  };
  std::vector<Replica> LiveLocked(const std::string& model) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops the nodes silent for kReplicaForget.
  void ForgetSilentLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Report and Merge: the node's entry, or RESOURCE_EXHAUSTED when it is new and the table full.
  absl::StatusOr<Node*> EntryLocked(const std::string& node) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const std::function<Clock::time_point()> now_;
  mutable common::Mutex mu_;
  common::CondVar changed_;
  std::map<std::string, Node> nodes_ ABSL_GUARDED_BY(mu_);
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace refit::fleet
