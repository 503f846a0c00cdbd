#pragma once

// Who hears what at run time, and the small adapters a refitd's parts are connected through:
// the store's events (StoreEvents) and DeltaSource's "a version is prepared", connected in one
// place; docs/architecture.md ("Store events") draws the flow. Each adapter is a named class
// (a function object where the part it is handed to takes a std::function), so that
// Daemon::Start reads as an assembly and each connection can be found by name.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/common/liveness.h"
#include "daemon/memory/slot_pool.h"
#include "daemon/store/store.h"

namespace refit {
namespace state {
class VersionLedger;
}  // namespace state
namespace bucket {
class BucketExport;
}  // namespace bucket
namespace dataplane {
class DataPlane;
}  // namespace dataplane
namespace peer {
class DeltaSource;
class PeerManager;
class PeerService;
}  // namespace peer

// The components a refitd connects; not owned. `bucket_export` is null without
// --bucket-export. The listeners must outlive the store's last event (Daemon::Impl's order).
struct EventWiring {
  Store* store = nullptr;
  peer::DeltaSource* deltas = nullptr;
  peer::PeerService* peer_service = nullptr;
  peer::PeerManager* peers = nullptr;
  bucket::BucketExport* bucket_export = nullptr;
};

// Keeps each model's rollback hold in --state-dir (state::VersionLedger::RecordHold), so that a
// restarted refitd starts held back (Store::SeedHolds) until Resume.
class HoldKeeper : public StoreEvents {
 public:
  explicit HoldKeeper(state::VersionLedger* ledger) : ledger_(ledger) {}
  void OnHoldChanged(const std::string& model, uint64_t version) override;

 private:
  state::VersionLedger* ledger_;
};

// Adds the store's listeners (Store::AddListener), in the order they hear each event.
void ConnectStoreEvents(const EventWiring& wiring);

// DeltaSource's "ready" callback: a version's deltas are encoded (or given up on), so it may be
// announced to subscribers and written to the bucket.
void OnDeltasPrepared(const EventWiring& wiring);

// DeltaSource's "ready", bound to the wiring as it stands when it is called (the peer service
// and the exporter are made after the DeltaSource, before anything publishes).
class DeltasPrepared {
 public:
  explicit DeltasPrepared(const EventWiring* wiring) : wiring_(wiring) {}
  void operator()() const { OnDeltasPrepared(*wiring_); }

 private:
  const EventWiring* wiring_;
};

// The store's host slots made by the data plane (registered with the transport, so that a peer
// daemon on this host maps them): StoreOptions::host_slot_allocator without a GPU.
class DataPlaneSlots {
 public:
  explicit DataPlaneSlots(dataplane::DataPlane* data_plane) : data_plane_(data_plane) {}
  absl::StatusOr<std::unique_ptr<Region>> operator()(uint64_t size) const;

 private:
  dataplane::DataPlane* data_plane_;
};

// The watchdog's probe of the store (LivenessProbe): the store has no thread, so the probe
// takes its lock; a caller wedged while holding it shows as "store" in StuckWorkers.
class StoreProbe {
 public:
  explicit StoreProbe(Store* store) : store_(store) {}
  void operator()() const { store_->Probe(); }

 private:
  Store* store_;
};

// This node's newest complete version of a model, for rl::Staleness (its LocalLatest).
class StoreLatestVersion {
 public:
  explicit StoreLatestVersion(const Store* store) : store_(store) {}
  uint64_t operator()(const std::string& model) const { return store_->LatestVersion(model); }

 private:
  const Store* store_;
};

// Health's stall check (HealthService::SetStallCheck): the workers busy without progress for
// longer than `stall` (Liveness::Stuck).
class StallCheck {
 public:
  StallCheck(Liveness* liveness, std::chrono::milliseconds stall)
      : liveness_(liveness), stall_(stall) {}
  std::vector<std::string> operator()() const { return liveness_->Stuck(stall_); }

 private:
  Liveness* liveness_;
  std::chrono::milliseconds stall_;
};

// The stall bound health uses: `fallback`, or under systemd's watchdog (WATCHDOG_USEC) the
// bound main.cc uses, half its interval and at least 2 s.
std::chrono::milliseconds HealthStallBound(std::chrono::milliseconds fallback);

}  // namespace refit
