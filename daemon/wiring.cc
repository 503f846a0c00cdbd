#include "daemon/wiring.h"

#include <algorithm>
#include <cstdlib>

#include "daemon/bucket/bucket_sync.h"
#include "daemon/common/logging.h"
#include "daemon/dataplane/data_plane.h"
#include "daemon/peer/delta_source.h"
#include "daemon/peer/peer_manager.h"
#include "daemon/peer/peer_service.h"
#include "daemon/state/version_ledger.h"
#include "daemon/store/store.h"

namespace refit {

void ConnectStoreEvents(const EventWiring& wiring) {
  // OnLocalVersionReady: the delta encoder first (its deltas decide when a version is
  // announced), then the Subscribe streams (layouts and versions that need no delta), then the
  // bucket. OnLayoutChanged: the Subscribe streams.
  wiring.store->AddListener(wiring.deltas);
  wiring.store->AddListener(wiring.peer_service);
  if (wiring.bucket_export) wiring.store->AddListener(wiring.bucket_export);
  // OnPullNeeded and OnVersionComplete: the pull worker and the replica reporter.
  wiring.store->AddListener(wiring.peers);
}

void HoldKeeper::OnHoldChanged(const std::string& model, uint64_t version) {
  absl::Status kept = ledger_->RecordHold(model, version);
  if (!kept.ok()) {
    Logger("store")->error("model={} hold {} not kept across restarts: {}", model, version,
                           kept.ToString());
  }
}

void OnDeltasPrepared(const EventWiring& wiring) {
  wiring.peer_service->NotifyChanged();
  if (wiring.bucket_export) wiring.bucket_export->Notify();
}

absl::StatusOr<std::unique_ptr<Region>> DataPlaneSlots::operator()(uint64_t size) const {
  return data_plane_->AllocateSlot(size);
}

std::chrono::milliseconds HealthStallBound(std::chrono::milliseconds fallback) {
  if (const char* usec = std::getenv("WATCHDOG_USEC"); usec && std::atoll(usec) > 0) {
    return std::max<std::chrono::milliseconds>(std::chrono::milliseconds(std::atoll(usec) / 2000),
                                               std::chrono::seconds(2));
  }
  return fallback;
}

}  // namespace refit
