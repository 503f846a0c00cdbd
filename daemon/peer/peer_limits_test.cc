#include "daemon/peer/peer_limits.h"

#include <memory>
#include <vector>

#include "catch2/catch.hpp"

namespace refit::peer {
namespace {

TEST_CASE("peer names: lengths checked, text made printable and short", "[peer]") {
  CHECK(CheckNodeName("node-1").ok());
  CHECK(CheckNodeName("").code() == absl::StatusCode::kInvalidArgument);
  CHECK(CheckNodeName(std::string(255, 'n')).ok());
  CHECK(CheckNodeName(std::string(256, 'n')).code() == absl::StatusCode::kInvalidArgument);
  CHECK(CheckModelName(std::string(1024, 'm')).ok());
  CHECK(CheckModelName(std::string(1025, 'm')).code() == absl::StatusCode::kInvalidArgument);
  CHECK(Printable("a\nb\x01\\") == "a\\x0ab\\x01\\x5c");
  CHECK(Printable(std::string(1 << 20, 'x'), 8) == "xxxxxxxx...(1048576 bytes)");
  CHECK(SameBytes("abc", "abc"));
  CHECK_FALSE(SameBytes("abc", "abd"));
  CHECK_FALSE(SameBytes("abc", "ab"));
  CHECK(PeerHost("ipv4:10.0.0.2:41234") == "10.0.0.2");
  CHECK(PeerHost("ipv6:[fd00::2]:1") == "[fd00::2]");
  CHECK(PeerHost("unix:/x") == "unix:/x");
}

TEST_CASE("peer streams: per source, in all, and a newcomer takes the largest holder's oldest",
          "[peer]") {
  StreamLimiter limiter(/*total=*/6, /*per_source=*/4);
  std::vector<std::unique_ptr<StreamLimiter::Ticket>> attacker;
  for (int i = 0; i < 4; ++i) {
    auto t = limiter.Admit("host a", "Subscribe");
    REQUIRE(t.ok());
    attacker.push_back(std::move(*t));
  }
  // The fifth from the same source is refused; nobody else is affected.
  auto fifth = limiter.Admit("host a", "Subscribe");
  CHECK(fifth.status().code() == absl::StatusCode::kResourceExhausted);
  auto b1 = limiter.Admit("host b", "Subscribe");
  auto b2 = limiter.Admit("host b", "Subscribe");
  REQUIRE(b1.ok());
  REQUIRE(b2.ok());
  CHECK(limiter.open() == 6);
  // All taken: a newcomer from a third source takes host a's oldest place.
  auto c1 = limiter.Admit("host c", "Relay");
  REQUIRE(c1.ok());
  CHECK(attacker[0]->evicted());
  CHECK_FALSE(attacker[1]->evicted());
  CHECK_FALSE((*b1)->evicted());
  CHECK(limiter.open() == 6);
  CHECK(limiter.evictions() == 1);
  // a: 3, b: 2, c: 1. c again takes a's next (3 > 2); then a and c both hold 2 and b 2: full,
  // and nobody holds more than the newcomer would, so the newcomer is refused.
  auto c2 = limiter.Admit("host c", "Relay");
  REQUIRE(c2.ok());
  CHECK(attacker[1]->evicted());
  auto c3 = limiter.Admit("host c", "Relay");
  CHECK(c3.status().code() == absl::StatusCode::kResourceExhausted);
  // An evicted ticket gives back nothing twice; a live one frees its place.
  attacker[0].reset();
  attacker[1].reset();
  CHECK(limiter.open() == 6);
  b1->reset();
  CHECK(limiter.open() == 5);
  auto again = limiter.Admit("host b", "Subscribe");
  CHECK(again.ok());
}

}  // namespace
}  // namespace refit::peer
