#include "daemon/fleet/entry_claims.h"

#include <catch2/catch.hpp>

namespace refit::fleet {

TEST_CASE("entry claims: one entry per chunk and site; a second node asking is named",
          "[fleet][sites]") {
  EntryClaims claims;
  const RelayKey key{"m", 3, "trainer", "b1"};
  // Site b's two stripe roots ask for disjoint chunks: no conflict.
  CHECK(claims.Claim(key, "b", "b-0", {{0, 4}, {8, 12}}).other.empty());
  CHECK(claims.Claim(key, "b", "b-1", {{4, 8}, {12, 16}}).other.empty());
  // The same node asking again (a second stream after a failover) is no second entry.
  CHECK(claims.Claim(key, "b", "b-0", {{0, 4}}).other.empty());
  // Another site's node asking for the same bytes is that site's entry: no conflict.
  CHECK(claims.Claim(key, "c", "c-0", {{0, 16}}).other.empty());
  // A third node of site b asking for bytes b-1 asked for: two entries, b-1 named.
  const EntryClaims::Conflict c = claims.Claim(key, "b", "b-2", {{5, 7}});
  CHECK(c.other == "b-1");
  CHECK(c.bytes == 2);
  CHECK(c.first);
  // Said once per version and site.
  CHECK(!claims.Claim(key, "b", "b-2", {{0, 2}}).first);
  // Another version of the piece starts afresh.
  CHECK(claims.Claim({"m", 4, "trainer", "b1"}, "b", "b-2", {{0, 16}}).other.empty());
}

TEST_CASE("entry claims: bounded; the oldest pieces are forgotten", "[fleet][sites]") {
  EntryClaims claims;
  for (uint64_t v = 1; v <= EntryClaims::kPiecesKept + 1; ++v) {
    CHECK(claims.Claim({"m", v, "t", "b"}, "b", "x", {{0, 1}}).other.empty());
  }
  // Version 1 was forgotten: y's claim on it meets nobody; the newest still conflicts.
  CHECK(claims.Claim({"m", 1, "t", "b"}, "b", "y", {{0, 1}}).other.empty());
  CHECK(claims.Claim({"m", EntryClaims::kPiecesKept + 1, "t", "b"}, "b", "y", {{0, 1}}).other ==
        "x");
}

}  // namespace refit::fleet
