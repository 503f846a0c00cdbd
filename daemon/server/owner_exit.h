#pragma once

// Owner exit: when a local client process exits (daemon/callers watches it with a pidfd), the
// buffers it registered are released, so that a killed trainer never stalls its model and a
// killed engine leaves nothing pinned. Published versions stay held; a version in flight that
// needed a released SOURCE buffer is abandoned by the store with a message naming it.
//
// Thread-safety: OnClientExit may be called from any thread.

#include "daemon/callers/local_listener.h"
#include "daemon/server/owners.h"
#include "daemon/server/server_metrics.h"
#include "daemon/store/buffer_registry.h"

namespace refit::server {

class OwnerExit final : public callers::ClientExitListener {
 public:
  // Not owned: `store` and `metrics` outlive this.
  OwnerExit(BufferRegistry* store, std::shared_ptr<Owners> owners, Metrics* metrics)
      : store_(store), owners_(std::move(owners)), metrics_(metrics) {
    metrics_->Declare(kOwnerExitReleases);
  }

  void OnClientExit(const callers::Caller& caller) override;

 private:
  BufferRegistry* const store_;
  const std::shared_ptr<Owners> owners_;
  Metrics* const metrics_;
};

}  // namespace refit::server
