#pragma once

// Who a node reads each part of a version from, when several nodes pull the same version.
//
// A piece (one SOURCE buffer's snapshot, published on its origin node) is cut into chunks on
// the checksum grid (kChecksumChunkBytes), and its chunks are dealt round-robin into S stripes.
// Each stripe travels down a tree of its own over the pulling nodes: a d-ary heap over the
// pullers in name order, rotated by s * ceil(K / S) for stripe s, whose root reads from the
// origin and whose other nodes read from their parent in that heap. With S = min(K, fanout)
// and d = fanout, every node is an inner node of at most one stripe's tree, so each node
// uploads about one piece's worth per version, downloads one, and the origin uploads each
// chunk once (to the stripe's root). For K <= fanout the trees are one level deep: node s
// reads stripe s from the origin and serves it to every other puller (scatter, then all
// gather), pipelined chunk by chunk.
//
// Pure functions: the daemon's pull (daemon/pull) and the fan-out simulator
// (daemon/fleet/fanout_sim) both call them, so what the simulator measures is what runs.

#include <cstdint>
#include <string>
#include <vector>

namespace refit::fleet {

// Children per node in a stripe's tree, and so the most stripes a piece is cut into.
inline constexpr int kDefaultFanout = 8;

// Stripes for `pullers` nodes pulling one version (at least 1).
int StripeCount(size_t pullers, int fanout = kDefaultFanout);

// The stripe of chunk `chunk` of a piece. `salt` (PieceSalt) spreads the first chunks of
// different pieces over different stripes.
int StripeOf(uint64_t chunk, uint64_t salt, int stripes);
uint64_t PieceSalt(const std::string& origin, const std::string& buffer_id);

// The node `self` reads stripe `stripe` from: `origin`, or another of `pullers`. `pullers` is
// every node pulling the version (self included), sorted and without duplicates; a `self` not
// among them reads from the origin.
std::string ParentFor(const std::vector<std::string>& pullers, const std::string& origin,
                      const std::string& self, int stripe, int stripes,
                      int fanout = kDefaultFanout);

// The chain of nodes from the origin's child down to `self` in stripe `stripe`'s tree (the
// nodes whose pipelines self's bytes pass through), root first, self last.
std::vector<std::string> PathTo(const std::vector<std::string>& pullers, const std::string& self,
                                int stripe, int stripes, int fanout = kDefaultFanout);

}  // namespace refit::fleet
