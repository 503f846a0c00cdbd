#pragma once

// The receiving side of delta sync. For the fetches of a PullJob that offer a base (a verified
// older version of the piece held here) and a chain of deltas, FetchDeltas reads each delta's
// header from the source, works out which chunks cover the byte ranges this node needs (a
// resharded destination needs only part of each source buffer), reads just those chunks,
// copies the needed ranges of the base into a fresh staging slot and applies the chain in
// order. The pull worker then verifies the staging slot against the source's checksums exactly
// as after a full pull, so a delta can never make a wrong version visible.
//
// Relaying: with `relays` (several nodes pulling the version), each step's payload is cut on
// the checksum grid and striped over the pullers exactly as full bytes are (daemon/fleet/
// stripes.h): a stripe's root reads it from the origin, the others from that root through
// Peer.Relay, while it lands there; each step is on this node's RelayBoard as the piece
// DeltaPieceId(buffer, base), so only a node pulling the same delta (same base) serves it.
// Headers always come from the origin: they carry every chunk's payload and target checksums,
// so a relay's bytes are checked against the origin's digests when applied; a step whose
// relayed chunks fail is read again from the origin (refit_relay_chunks_rejected_total).
//
// A fetch falls back to the full bytes (its slot comes back null) when the deltas it would
// read exceed `threshold` × the bytes it needs, or when anything about them fails; the reason
// is logged. Thread-safety: call from one thread at a time (the pull worker).

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "daemon/dataplane/data_plane.h"
#include "daemon/fleet/relay_board.h"
#include "daemon/fleet/stripes.h"
#include "daemon/memory/region.h"
#include "daemon/pull/pull_metrics.h"
#include "daemon/store/pull_landing.h"
#include "proto/refit/v1/peer.grpc.pb.h"

namespace refit::pull {

using dataplane::DataPlane;

// The RelayBoard piece id of the delta `base_version` -> the pulled version of `buffer_id`.
std::string DeltaPieceId(const std::string& buffer_id, uint64_t base_version);

struct DeltaRelays {
  fleet::SiteView view;                // who pulls it, by site; !view.Relaying(): no relaying
  fleet::RelayBoard* board = nullptr;  // where this node offers what it fetched
  std::function<v1::Peer::Stub*(const std::string& node)> stub;  // null when not connected
};

struct DeltaResult {
  std::vector<std::shared_ptr<Region>> staging;  // per fetch: built from deltas, or null
  // Per fetch built from whole delta chunks: what they changed (the elements they wrote, with
  // the new words, gathered while each chunk was in cache), so that the store's sparse Apply
  // needs no diff of the piece; null otherwise.
  std::vector<std::shared_ptr<const ChangeList>> changes;
  std::vector<uint64_t> wire;  // per fetch: delta bytes read for it
  // Per fetch: every needed byte lies in whole delta chunks, so applying them checked each
  // chunk's target checksum and the source need not hash anything for it.
  std::vector<bool> verified;
  std::vector<uint64_t> from_relays;        // per fetch: of `wire`, what relays served
  std::map<std::string, uint64_t> relayed;  // bytes read from each relay
};

// Brings the fetches of `job` that offer a base and deltas up to date (see above).
// `relays` may be null (everything from the origin).
DeltaResult FetchDeltas(const PullJob& job, DataPlane* data_plane, PullLanding* store,
                        double threshold, Metrics* metrics, const DeltaRelays* relays = nullptr);

}  // namespace refit::pull
