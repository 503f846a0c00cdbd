#include "daemon/fleet/stripes.h"

#include <catch2/catch.hpp>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace refit::fleet {
namespace {

std::vector<std::string> Nodes(int k) {
  std::vector<std::string> nodes;
  for (int i = 0; i < k; ++i) nodes.push_back("engine-" + std::to_string(1000 + i));
  return nodes;
}

// Per node: how many (stripe, child) edges it serves, i.e. stripes' worth of bytes it uploads.
std::map<std::string, int> Uploads(const std::vector<std::string>& nodes, int fanout) {
  const int stripes = StripeCount(nodes.size(), fanout);
  std::map<std::string, int> up;
  for (int s = 0; s < stripes; ++s) {
    for (const std::string& n : nodes) ++up[ParentFor(nodes, "trainer", n, s, stripes, fanout)];
  }
  return up;
}

}  // namespace

TEST_CASE("one puller reads everything from the origin", "[fleet]") {
  const std::vector<std::string> one = {"e0"};
  REQUIRE(StripeCount(1) == 1);
  REQUIRE(ParentFor(one, "t", "e0", 0, 1) == "t");
  REQUIRE(StripeOf(12345, 99, 1) == 0);
}

TEST_CASE("up to the fanout: scatter to stripe owners, then everyone reads from them", "[fleet]") {
  const auto nodes = Nodes(4);
  const int stripes = StripeCount(nodes.size());
  REQUIRE(stripes == 4);
  for (int s = 0; s < stripes; ++s) {
    for (int i = 0; i < 4; ++i) {
      const std::string parent = ParentFor(nodes, "t", nodes[i], s, stripes);
      REQUIRE(parent == (i == s ? std::string("t") : nodes[s]));
    }
  }
}

TEST_CASE("the origin sends each stripe once and no node uploads more than one piece", "[fleet]") {
  for (int k : {2, 3, 4, 5, 8, 9, 16, 31, 64, 256, 300}) {
    const auto nodes = Nodes(k);
    const int stripes = StripeCount(nodes.size());
    const auto up = Uploads(nodes, kDefaultFanout);
    INFO("k=" << k);
    REQUIRE(up.at("trainer") == stripes);  // one child per stripe: the stripe's root
    for (const std::string& n : nodes) {
      // Each edge carries one stripe (1/stripes of the piece): about one piece's worth at
      // most (twice that for the few nodes where the rotated trees' inner nodes wrap around).
      const int edges = up.count(n) ? up.at(n) : 0;
      REQUIRE(edges <= (k % stripes == 0 || k <= kDefaultFanout ? stripes : 2 * stripes));
    }
  }
}

TEST_CASE("every stripe's tree reaches every puller without cycles, shallowly", "[fleet]") {
  for (int k : {1, 4, 7, 64, 256}) {
    const auto nodes = Nodes(k);
    const int stripes = StripeCount(nodes.size());
    for (int s = 0; s < stripes; ++s) {
      for (const std::string& n : nodes) {
        const auto path = PathTo(nodes, n, s, stripes);
        REQUIRE(path.back() == n);
        REQUIRE(path.size() <= 4);  // 256 nodes, fanout 8: three levels and the root
        REQUIRE(ParentFor(nodes, "t", path.front(), s, stripes) == "t");
        std::set<std::string> seen(path.begin(), path.end());
        REQUIRE(seen.size() == path.size());
        for (size_t i = 1; i < path.size(); ++i) {
          REQUIRE(ParentFor(nodes, "t", path[i], s, stripes) == path[i - 1]);
        }
      }
    }
  }
}

TEST_CASE("chunks spread evenly over stripes, and a stranger reads from the origin", "[fleet]") {
  std::map<int, int> count;
  const uint64_t salt = PieceSalt("trainer", "trainer/3");
  for (uint64_t c = 0; c < 64; ++c) ++count[StripeOf(c, salt, 4)];
  for (int s = 0; s < 4; ++s) REQUIRE(count[s] == 16);
  REQUIRE(ParentFor(Nodes(4), "t", "not-a-puller", 1, 4) == "t");
}

}  // namespace refit::fleet

namespace refit::fleet {

// Two sites: the trainer and a0, a1 in site "a"; b0, b1, b2 in site "b". Every node of a site
// reads each chunk from its own site, except each stripe's root in "b", which reads it from the
// root of that chunk's stripe in "a": so each chunk crosses into "b" once, from a node that
// pulls it anyway (the trainer still sends each chunk once).
TEST_CASE("sites: each chunk crosses into a site once, from the origin site's stripe root",
          "[fleet]") {
  const std::vector<std::string> a = {"a0", "a1"}, b = {"b0", "b1", "b2"};
  auto view_of = [&](const std::string& self, const std::string& site) {
    SiteView view;
    view.self = self;
    view.site = site;
    view.local = site == "a" ? a : b;
    view.remote[site == "a" ? "b" : "a"] = site == "a" ? b : a;
    view.origin_sites["t"] = "a";
    return view;
  };
  const uint64_t salt = PieceSalt("t", "piece");
  for (uint64_t chunk = 0; chunk < 64; ++chunk) {
    int from_trainer = 0, into_b = 0;
    for (const std::string& n : a) {
      const std::string source = SourceOf(view_of(n, "a"), "t", chunk, salt);
      REQUIRE((source == "t" || source == "a0" || source == "a1"));
      REQUIRE(source != n);
      from_trainer += source == "t";
    }
    for (const std::string& n : b) {
      const std::string source = SourceOf(view_of(n, "b"), "t", chunk, salt);
      REQUIRE(source != "t");  // site "a" has pullers: the trainer sends each chunk once
      REQUIRE(source != n);
      if (source == "a0" || source == "a1") {
        ++into_b;
        // The node of "a" that reads this chunk from the trainer.
        const std::string root_a = RootOf(a, StripeOf(chunk, salt, 2), 2);
        REQUIRE(source == root_a);
      }
    }
    REQUIRE(from_trainer == 1);
    REQUIRE(into_b == 1);
  }
  // Across: the other site's pullers and origins are across, this site's are not.
  const SiteView b0 = view_of("b0", "b");
  REQUIRE(b0.Across("a1"));
  REQUIRE(b0.Across("t"));
  REQUIRE_FALSE(b0.Across("b2"));
  REQUIRE(b0.Relaying());
}

TEST_CASE(
    "sites: a site with no puller of the origin's site reads from the origin; no sites is "
    "the one-site tree",
    "[fleet]") {
  SiteView lone;
  lone.self = "b0";
  lone.site = "b";
  lone.local = {"b0"};
  lone.origin_sites["t"] = "a";  // nobody else pulls in "a"
  const uint64_t salt = PieceSalt("t", "piece");
  for (uint64_t chunk = 0; chunk < 16; ++chunk) REQUIRE(SourceOf(lone, "t", chunk, salt) == "t");
  REQUIRE_FALSE(lone.Relaying());
  // No --site anywhere: everything is site "", as ParentFor alone says.
  SiteView plain;
  plain.self = "e1";
  plain.local = {"e0", "e1", "e2"};
  for (uint64_t chunk = 0; chunk < 16; ++chunk) {
    const int stripe = StripeOf(chunk, salt, 3);
    REQUIRE(SourceOf(plain, "t", chunk, salt) == ParentFor(plain.local, "t", "e1", stripe, 3));
  }
}

}  // namespace refit::fleet
