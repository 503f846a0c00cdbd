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
#include <map>
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

// The root of stripe `stripe`'s tree over `pullers` (sorted, not empty): the node that reads
// that stripe from the origin.
const std::string& RootOf(const std::vector<std::string>& pullers, int stripe, int stripes);

// Sites (--site): the nodes of one site relay among themselves, and each version enters a site
// once. A node's stripe trees span only the pullers of its own site; where it is a stripe's
// root and the origin lies in another site, it reads that stripe's chunks from the roots of
// the origin site's trees (nodes pulling the same version there, so the origin still sends each
// chunk once), or from the origin when that site has no puller. Nodes without --site form the
// site "".
struct SiteView {
  std::string self;                // this node
  std::string site;                // this node's site
  std::vector<std::string> local;  // the pullers of this node's site, self included, sorted
  // The relaying pullers of every other site, each list sorted and not empty.
  std::map<std::string, std::vector<std::string>> remote;
  // The site of each origin node (absent: this node's own).
  std::map<std::string, std::string> origin_sites;
  int fanout = kDefaultFanout;

  // Whether any other node may read from this one or this one from another node.
  bool Relaying() const { return local.size() > 1 || !remote.empty(); }
  const std::string& SiteOf(const std::string& origin) const;
  // Whether `node` (an origin or a puller in the view) lies in another site than this node.
  bool Across(const std::string& node) const;
};

// The node `view.self` reads chunk `chunk` of a piece published on `origin` (salt: PieceSalt)
// from: the origin, a puller of its own site (its parent in the chunk's stripe tree), or the
// root of that chunk's stripe tree in the origin's site.
std::string SourceOf(const SiteView& view, const std::string& origin, uint64_t chunk,
                     uint64_t salt);

}  // namespace refit::fleet
