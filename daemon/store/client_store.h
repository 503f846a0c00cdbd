#pragma once

// What the client API (daemon/server) needs of the store, as one interface (issue 38: the store
// split along its seams): buffers lent and taken back (BufferRegistry), a trainer's versions
// (VersionPublishing), an engine's waits (VersionWaits) and installs (Installer), holds and
// drops (VersionHolds, FleetControl) and what the node holds (ModelCatalog). Store implements
// it; daemon/server depends on //daemon/store:client_store, not on the store, and each of its
// parts takes only the interface it uses (OwnerExit and Leases: BufferRegistry).
//
// VersionHolds and ModelCatalog are also parts of PeerStore (peer_store.h): both inherit them
// virtually, so that Store, which implements both, has one of each.

#include "daemon/store/buffer_registry.h"
#include "daemon/store/fleet_control.h"
#include "daemon/store/installer.h"
#include "daemon/store/model_catalog.h"
#include "daemon/store/version_holds.h"
#include "daemon/store/version_publishing.h"
#include "daemon/store/version_waits.h"

namespace refit {

class ClientStore : public BufferRegistry,
                    public VersionPublishing,
                    public VersionWaits,
                    public Installer,
                    public FleetControl,
                    public virtual VersionHolds,
                    public virtual ModelCatalog {
 public:
  ~ClientStore() override = default;
};

}  // namespace refit
