#pragma once

// Reading one stripe of a piece from a relay: another node pulling the same version, which
// streams (Peer.Relay) the ranges that have landed in its staging slot; this side reads each
// one from that slot over the data plane as soon as it is announced, into its own staging slot
// at the same offsets. Whatever the relay can't give — it doesn't plan to hold it, it went
// away, it stalled, a read failed — is handed back, to be read from the origin.
//
// Nothing the relay sends is trusted: the caller verifies every byte against the origin's
// checksums afterwards (Puller::Verify), and a relay's stream is only a hint of where to read.
//
// Thread-safety: one RelayRead per call; it blocks the calling thread until it is done.

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "daemon/dataplane/data_plane.h"
#include "daemon/fleet/stripes.h"
#include "daemon/pull/stream_watchdog.h"
#include "daemon/store/pull_landing.h"
#include "proto/refit/v1/peer.grpc.pb.h"

namespace refit::pull {

using Ranges = std::vector<std::pair<uint64_t, uint64_t>>;

struct RelayReadResult {
  Ranges read;          // read from the relay (sorted, merged)
  Ranges leftover;      // still to read from the origin (sorted, merged)
  uint64_t bytes = 0;   // the bytes of `read`
  std::string why;      // why there is a leftover, for the log ("" when none)
  bool failed = false;  // the relay failed, stalled or went away (not just another layout)
  // Offset of each read of `read` -> {length, XXH3-64 of what it brought}, for Verify.
  std::unordered_map<uint64_t, std::pair<uint64_t, uint64_t>> hashes;
};

struct RelayReadRequest {
  std::string self;  // this node
  std::string model;
  uint64_t version = 0;
  PullJob::Fetch fetch;                 // the piece, as the origin offered it
  std::string relay;                    // the node to read from
  Ranges wanted;                        // sorted, disjoint, within fetch.ranges
  std::shared_ptr<Region> slot;         // this node's staging slot for the piece
  dataplane::DataPlane::Landed landed;  // told of each read that lands (may be null)
  std::string site;                     // this node's --site (said to the relay)
  StreamLimits limits;                  // when a silent or stalled relay is given up on
};

// `stub`: the relay's control channel (null: everything is leftover).
RelayReadResult ReadFromRelay(const RelayReadRequest& request, v1::Peer::Stub* stub,
                              dataplane::DataPlane* data_plane);

// `fetch.ranges` cut on the checksum grid and dealt to the node each chunk is read from
// (fleet::SourceOf): the origin (fetch.node), a puller of this node's site, or a puller of the
// origin's site.
std::map<std::string, Ranges> ByParent(const PullJob::Fetch& fetch, const fleet::SiteView& view);

// Range arithmetic on sorted, disjoint [begin, end) lists.
Ranges Intersect(const Ranges& a, const Ranges& b);
Ranges Subtract(const Ranges& a, const Ranges& b);
void Merge(Ranges* ranges);  // sorts and merges overlapping or touching ranges
uint64_t Total(const Ranges& ranges);

}  // namespace refit::pull
