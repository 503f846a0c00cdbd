#pragma once

// Who enters a site through this node: each version should cross into a site once, each chunk
// through one node there (the root of its stripe in that site's trees, fleet::SourceOf). A
// node serving relayed stripes to nodes of other sites records, per piece and reading site,
// which node asked for which bytes (RelayRequest.wanted); two nodes of one site asking for the
// same bytes are two entries into that site for them (their views of the site differ: a
// mistyped --site, a node the others can't reach), so the bytes cross twice. Detected here and
// said (the caller warns naming both nodes); nothing is refused: the version completes
// everywhere either way.
//
// Thread-safety: every method may be called from any thread.

#include <cstdint>
#include <deque>
#include <map>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "daemon/common/mutex.h"
#include "daemon/fleet/relay_board.h"

namespace refit::fleet {

class EntryClaims {
 public:
  // Pieces remembered at most (the oldest forgotten first).
  static constexpr size_t kPiecesKept = 256;

  struct Conflict {
    std::string other;   // the node of the same site that asked for some of the same bytes first
    uint64_t bytes = 0;  // how many of the bytes both asked for
    // The first conflict of this model version and site (warn on this one only).
    bool first = false;
  };
  // `node` of site `site` reads `wanted` (sorted, disjoint) of `key` across sites from this
  // node. Returns the first other node of `site` that asked for some of the same bytes of
  // `key`, or other == "" when none did.
  Conflict Claim(const RelayKey& key, const std::string& site, const std::string& node,
                 const Ranges& wanted);

 private:
  using Piece = std::tuple<RelayKey, std::string>;  // (key, reading site)
  common::Mutex mu_;
  // Piece -> node -> the bytes it asked for (merged).
  std::map<Piece, std::map<std::string, Ranges>> claims_ ABSL_GUARDED_BY(mu_);
  std::deque<Piece> order_ ABSL_GUARDED_BY(mu_);  // insertion order, for forgetting
  // (model, version, site) with a conflict said already (cleared past kPiecesKept).
  std::set<std::tuple<std::string, uint64_t, std::string>> said_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::fleet
