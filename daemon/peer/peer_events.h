#pragma once

// What a connected peer's Subscribe events change here: its SOURCE layouts (checked as this
// daemon checks its own clients'), its announced versions and deltas, the rollback it follows,
// and the trainer's labels, staleness budget and timeline mark of each announced version
// (daemon/rl). PeerLinks hands every event of every --peers stream to Apply.
//
// Thread-safety: Apply and Forget may be called from any thread (the store and rl::Parts
// lock for themselves).

#include <string>

#include "absl/status/status.h"
#include "daemon/fleet/replicas.h"
#include "daemon/rl/parts.h"
#include "daemon/store/remote_sources.h"
#include "daemon/store/store_types.h"
#include "proto/refit/v1/peer.pb.h"

namespace refit::peer {

class PeerEvents {
 public:
  // Nothing is owned; `replicas` may be null.
  PeerEvents(RemoteSources* store, rl::Parts rl, fleet::ReplicaTable* replicas)
      : store_(store), rl_(std::move(rl)), replicas_(replicas) {}

  // Applies `event` from `node`. An event about a model name no node can have is ignored (OK).
  // INVALID_ARGUMENT for layouts that are not a valid refitd's: the caller drops the peer (its
  // layouts so far stay, its versions are forgotten) and reconnects with backoff.
  absl::Status Apply(const std::string& node, const v1::PeerEvent& event);
  // `node` disconnected: its announced versions (and replica reports) are forgotten.
  void Forget(const std::string& node);

 private:
  // An event from `node` announcing a version: its labels, budget and timeline (daemon/rl).
  void NoteAnnounced(const std::string& node, const v1::PeerEvent& event);

  RemoteSources* const store_;
  const rl::Parts rl_;
  fleet::ReplicaTable* const replicas_;
};

// A peer's SOURCE layouts, checked as this daemon checks its own clients' (daemons of one
// release send normalized, valid ones; anything else is a bug or not a refitd): every slice
// inside its piece's bytes, no two sharing a byte.
absl::Status PeerLayouts(const v1::PeerEvent& event, std::vector<SourceLayout>* layouts);

// A peer's deltas of the version it announces, checked before the store sees them. Only those
// that go forward (base_version < version <= the event's version) and claim no more bytes than
// a piece may have are kept; the others are dropped and counted in `*dropped` (the version is
// then pulled in full where no good delta leads to it; a delta from a version to itself would
// chain forever where the store looks for a path from its version to the new one). More than
// kMaxDeltasPerEvent deltas in one event: INVALID_ARGUMENT, nothing kept.
inline constexpr int kMaxDeltasPerEvent = 1 << 16;
absl::Status PeerDeltas(const v1::PeerEvent& event, std::vector<RemoteDeltaRef>* deltas,
                        int* dropped);

}  // namespace refit::peer
