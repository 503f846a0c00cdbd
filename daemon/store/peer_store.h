#pragma once

// What the peer plane (daemon/peer) needs of the store, as one interface (issue 38: the store
// split along its seams): local snapshots to serve (LocalSnapshots), other nodes' sources and
// versions to record (RemoteSources), holds to follow (VersionHolds), what this node holds to
// report (ModelCatalog) and where a pull lands (PullLanding). Store implements it; daemon/peer
// depends on //daemon/store:peer_store, not on the store. Each part of the peer plane takes
// only the interface it uses (DeltaSource: LocalSnapshots; PeerEvents: RemoteSources; ...);
// the assemblies (PeerManager, PeerService) take this one.

#include "daemon/store/local_snapshots.h"
#include "daemon/store/model_catalog.h"
#include "daemon/store/pull_landing.h"
#include "daemon/store/remote_sources.h"
#include "daemon/store/version_holds.h"

namespace refit {

class PeerStore : public LocalSnapshots,
                  public RemoteSources,
                  public virtual VersionHolds,
                  public virtual ModelCatalog,
                  public PullLanding {
 public:
  ~PeerStore() override = default;
};

}  // namespace refit
