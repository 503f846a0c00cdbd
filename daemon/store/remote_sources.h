#pragma once

// Other nodes' SOURCE buffers and versions, as this node's peer connections learn them (issue
// 38: the store split along its seams): what daemon/peer's event handling (PeerEvents) tells
// the store. Store implements it; the peer plane depends on //daemon/store:remote_sources, not
// on the store.

#include <cstdint>
#include <string>
#include <vector>

#include "daemon/store/store_types.h"

namespace refit {

class RemoteSources {
 public:
  virtual ~RemoteSources() = default;

  // `node` has these SOURCE buffers for `model` (replaces what it had before; empty: none).
  virtual void SetRemoteSources(const std::string& node, const std::string& model,
                                std::vector<SourceLayout> sources) = 0;
  // Fills the slot pool with the staging slots pulls of `model` will need (--retain + 1 per
  // remote piece), once per remote layout, when this node has DESTINATION buffers for it.
  // Faults memory in: call it outside any lock the caller holds dear.
  virtual void ReserveStaging(const std::string& model) = 0;
  // Every SOURCE buffer of `model` on `node` has published `version`, readable at `pieces`.
  // `deltas` are the deltas `node` offers for the pieces (see RemoteDeltaRef).
  // `run` names the announcing daemon's process (HelloResponse.instance): a version number not
  // newer than the one held here, announced by another run of that node than the one it came
  // from, is a reused number; it is skipped, logged and shown (ModelInfo.skipped_version).
  // `trainer_run` (PeerEvent.trainer_run): the trainer's run of `version`; another run than the
  // model's current one (and none it left) starts that run here (Store::StartRun), so its
  // versions are taken even below the ones held.
  // (The defaults are the same in Store's override.)
  virtual void AnnounceRemoteVersion(const std::string& node, const std::string& model,
                                     uint64_t version, std::vector<RemotePieceRef> pieces,
                                     std::vector<RemoteDeltaRef> deltas = {},
                                     const std::string& run = "",
                                     const std::string& trainer_run = "") = 0;
  // `node` (a node with SOURCE buffers of `model`) holds the model back to `version` (0: it
  // resumed): this node follows (Rollback / Resume here).
  virtual void FollowHold(const std::string& node, const std::string& model, uint64_t version) = 0;
  // `node` is gone: its sources stay expected (no version completes without them) and a pull
  // from it fails.
  virtual void ForgetRemoteVersions(const std::string& node) = 0;
};

}  // namespace refit
