#pragma once

// Who hears what at run time: the store's events (StoreEvents) and DeltaSource's "a version is
// prepared", connected in one place. docs/architecture.md ("Store events") draws the flow.

#include <cstdint>
#include <string>

#include "daemon/store/store.h"

namespace refit {
namespace state {
class VersionLedger;
}  // namespace state
namespace bucket {
class BucketExport;
}  // namespace bucket
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

}  // namespace refit
