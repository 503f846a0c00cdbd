#pragma once

// The remote-sources view (issue 38: the store split along its seams): what other nodes told
// this one of each model — their SOURCE layouts, the newest version all their sources
// published, the pieces and deltas to read it from, the hold they announced, the slots of a
// version handed over whole. An object of its own with its own lock; the store's core asks it
// whether a version can complete from other nodes and what to pull (cluster.cc) and writes
// into it what daemon/peer reports (RemoteSources).
//
// Lock order (docs/architecture.md, "The store's parts and their locks"): Store::mu_, then
// RemoteView::mu_, a leaf: nothing is called while it is held. Readers that need nothing else
// (SourceNodes) take it alone.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "daemon/common/mutex.h"
#include "daemon/memory/region.h"
#include "daemon/store/store_types.h"

namespace refit {

// What one other node told of one model.
struct RemoteNode {
  std::vector<SourceLayout> sources;
  std::string run;          // the run (daemon instance) that announced `announced`
  std::string trainer_run;  // the trainer's run of `announced` (PeerEvent.trainer_run)
  uint64_t hold = 0;        // the rollback target it announced last (PeerEvent.rollback_version)
  uint64_t announced = 0;   // newest version all its sources published; 0: none known
  std::vector<RemotePieceRef> pieces;
  std::vector<RemoteDeltaRef> deltas;
  // Imported whole (Import): the slots of version `announced`, by buffer id.
  std::map<std::string, std::shared_ptr<Region>> imported;
};

class RemoteView {
 public:
  using Nodes = std::map<std::string, RemoteNode>;  // by node name

  // ---- What other nodes report ----
  // `node` has these SOURCE buffers for `model` (replaces what it had; empty: none).
  void SetSources(const std::string& model, const std::string& node,
                  std::vector<SourceLayout> sources);
  // `node` handed over `version` of `model` whole (a bucket): its layouts and a slot per layout.
  // Returns true when the layout kept the same buffers and sizes (the store's plans stand).
  bool Import(const std::string& model, const std::string& node, uint64_t version,
              std::vector<SourceLayout> layouts, std::vector<std::shared_ptr<Region>> slots);
  // Every source of `node` published `version` of `model`, readable as `pieces` (and `deltas`
  // from earlier versions). Returns the version it had announced before (0: none).
  uint64_t Announce(const std::string& model, const std::string& node, uint64_t version,
                    std::vector<RemotePieceRef> pieces, std::vector<RemoteDeltaRef> deltas,
                    const std::string& run, const std::string& trainer_run);
  // `node` holds `model` back to `version` (0: none). False when it was already that, or when
  // `node` told nothing of `model` before.
  bool SetHold(const std::string& model, const std::string& node, uint64_t version);
  // `node` went away: the versions it announced are forgotten (its layouts stay).
  void Forget(const std::string& node);
  // `model` is forgotten here (the store erased it).
  void Erase(const std::string& model);

  // ---- What the store asks ----
  // What the nodes told of `model` (a copy: layouts share their slices).
  Nodes Of(const std::string& model) const;
  // Whether some other node has SOURCE buffers of `model`.
  bool HasSources(const std::string& model) const;
  // The other nodes with SOURCE buffers of `model`, by name.
  std::vector<std::string> SourceNodes(const std::string& model) const;
  // The run that announced the version `node` announced last ("" : none).
  std::string RunOf(const std::string& model, const std::string& node) const;
  // The version every node with SOURCE buffers of `model` announced, of the trainer's run
  // `run` (a node that names another trainer run is waited for); 0 while one has announced
  // none, they disagree (a laggard), or no node has sources.
  uint64_t Agreed(const std::string& model, const std::string& run) const;
  // `node`'s deltas of `buffer_id` leading from version `from` to exactly `to`, in order, each
  // moving forward; empty when there is no such chain (or from >= to).
  std::vector<RemoteDeltaRef> DeltaChain(const std::string& model, const std::string& node,
                                         const std::string& buffer_id, uint64_t from,
                                         uint64_t to) const;

 private:
  mutable common::Mutex mu_;
  std::map<std::string, Nodes> models_ ABSL_GUARDED_BY(mu_);  // by model name
};

}  // namespace refit
