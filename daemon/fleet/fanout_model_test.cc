#include "daemon/fleet/fanout_model.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "daemon/fleet/stripes.h"

namespace refit::fleet {
namespace {

constexpr uint64_t kMiB = uint64_t{1} << 20;
constexpr double kGbit = 1e9 / 8;

SimScenario Fleet(int engines, uint64_t model_bytes = 64 * kMiB, int trainers = 1,
                  int pieces_per_trainer = 1, double latency_s = 100e-6) {
  FleetSpec f;
  f.trainers = trainers;
  f.pieces_per_trainer = pieces_per_trainer;
  f.engines = engines;
  f.model_bytes = model_bytes;
  f.link_bytes_per_s = kGbit;
  f.latency_s = latency_s;
  absl::StatusOr<SimScenario> s = MakeFleet(f);
  REQUIRE(s.ok());
  return *s;
}

SimResult Run(const SimScenario& s) {
  absl::StatusOr<SimResult> r = Simulate(s);
  INFO(r.status().ToString());
  REQUIRE(r.ok());
  return *r;
}

bool IsOrigin(const SimScenario& s, int node) {
  for (const SimPiece& p : s.pieces) {
    if (p.origin == node) return true;
  }
  return false;
}

}  // namespace

TEST_CASE("one engine: the model's bytes over the link plus a round trip", "[fanout]") {
  const uint64_t bytes = 64 * kMiB;
  for (PairSharing sharing : {PairSharing::kInOrder, PairSharing::kFair})
    for (double latency : {0.0, 1e-3, 20e-3}) {
      SimScenario s = Fleet(1, bytes, 1, 1, latency);
      s.pair_sharing = sharing;
      const SimResult r = Run(s);
      // The request takes one latency to reach the origin, the last byte one more to land; with
      // 16 reads in flight the link never idles in between.
      INFO("latency " << latency);
      REQUIRE(r.time_s == Approx(bytes / kGbit + 2 * latency).epsilon(1e-9));
      REQUIRE(r.nodes[1].bytes_received == bytes);
    }
}

TEST_CASE("without failures the origin sends each chunk exactly once", "[fanout]") {
  for (int k : {2, 4, 8, 9, 16, 64}) {
    const SimScenario s = Fleet(k);
    const SimResult r = Run(s);
    INFO("k=" << k);
    REQUIRE(r.nodes[0].chunks_sent == 16);  // 64 MiB in 4 MiB chunks
    REQUIRE(r.nodes[0].bytes_sent == 64 * kMiB);
    REQUIRE(r.nodes[0].bytes_aborted == 0);
    for (int e = 1; e <= k; ++e) REQUIRE(r.nodes[e].bytes_received == 64 * kMiB);
  }
}

TEST_CASE("bytes are conserved: what was sent is what landed, once per puller", "[fanout]") {
  for (int k : {3, 8, 32}) {
    const SimScenario s = Fleet(k, 100 * kMiB + 12345, 2, 3);
    const SimResult r = Run(s);
    uint64_t sent = 0, received = 0, expected = 0;
    for (const SimNodeResult& n : r.nodes) {
      sent += n.bytes_sent;
      received += n.bytes_received;
    }
    for (const SimPiece& p : s.pieces) expected += p.bytes * p.pullers.size();
    INFO("k=" << k);
    REQUIRE(sent == received);
    REQUIRE(received == expected);
  }
}

TEST_CASE("engines upload exactly what ParentFor routes through them", "[fanout]") {
  for (int k : {4, 8, 20}) {
    const SimScenario s = Fleet(k, 96 * kMiB, 1, 2);
    const SimResult r = Run(s);
    std::map<std::string, uint64_t> expected;
    for (const SimPiece& p : s.pieces) {
      std::vector<std::string> names;
      for (int q : p.pullers) names.push_back(s.nodes[q].name);
      const std::string& origin = s.nodes[p.origin].name;
      const int stripes = StripeCount(names.size());
      const uint64_t salt = PieceSalt(origin, p.buffer_id);
      std::vector<uint64_t> stripe_bytes(stripes, 0);
      for (uint64_t c = 0; c * s.chunk_bytes < p.bytes; ++c) {
        stripe_bytes[StripeOf(c, salt, stripes)] +=
            std::min(s.chunk_bytes, p.bytes - c * s.chunk_bytes);
      }
      for (const std::string& n : names) {
        for (int st = 0; st < stripes; ++st) {
          expected[ParentFor(names, origin, n, st, stripes)] += stripe_bytes[st];
        }
      }
    }
    INFO("k=" << k);
    for (size_t n = 0; n < s.nodes.size(); ++n) {
      REQUIRE(r.nodes[n].bytes_sent == expected[s.nodes[n].name]);
    }
  }
}

TEST_CASE("relays forward chunk by chunk: the pipeline costs a few chunks, not a stripe",
          "[fanout]") {
  // 256 MiB in 8 stripes of 8 chunks; each stripe flows at 1/8 of a link, so one hop costs
  // 8 chunk-times when served in order, and the whole stripe when 16 fair-shared reads land
  // together.
  const double chunk_time = 8 * 4 * kMiB / kGbit;
  const double one = Run(Fleet(1, 256 * kMiB)).time_s;
  SimScenario s = Fleet(8, 256 * kMiB);
  const double in_order = Run(s).time_s;
  REQUIRE(in_order < one + 1.5 * chunk_time);
  s.pair_sharing = PairSharing::kFair;
  const double fair = Run(s).time_s;
  REQUIRE(fair > one + 6 * chunk_time);
  s.inflight = 1;
  REQUIRE(Run(s).time_s < one + 1.5 * chunk_time);
}

TEST_CASE("a relay killed mid-transfer: every live engine still completes", "[fanout]") {
  for (Failover failover : {Failover::kChildren, Failover::kSubtree}) {
    for (int k : {2, 8, 64}) {
      SimScenario s = Fleet(k, 128 * kMiB);
      s.failover = failover;
      const double healthy = Run(s).time_s;
      const int victim = BusiestRelay(s);
      REQUIRE(victim > 0);
      REQUIRE_FALSE(IsOrigin(s, victim));
      s.kills.push_back({victim, healthy / 2});
      const SimResult r = Run(s);
      INFO("k=" << k << " failover=" << static_cast<int>(failover));
      REQUIRE(r.nodes[victim].killed);
      for (size_t n = 1; n < s.nodes.size(); ++n) {
        if (static_cast<int>(n) == victim) continue;
        REQUIRE(r.nodes[n].done_s > 0);
        REQUIRE(r.nodes[n].bytes_received == 128 * kMiB);
      }
      // The dead relay's stripe is read from the origin again, but not the whole model per node.
      REQUIRE(r.nodes[0].bytes_sent + r.nodes[0].bytes_aborted > 128 * kMiB);
      REQUIRE(r.time_s > healthy);
      REQUIRE(r.time_s >= healthy / 2 + s.detect_delay_s);
    }
  }
}

TEST_CASE("without relaying the origin's uplink carries one model per engine", "[fanout]") {
  SimScenario s = Fleet(4);
  s.relay = false;
  const SimResult r = Run(s);
  REQUIRE(r.nodes[0].bytes_sent == 4 * 64 * kMiB);
  for (int e = 1; e <= 4; ++e) REQUIRE(r.nodes[e].bytes_sent == 0);
  REQUIRE(r.time_s == Approx(4 * 64 * kMiB / kGbit).epsilon(1e-3));
}

TEST_CASE("several origins each send their own pieces once", "[fanout]") {
  const SimScenario s = Fleet(16, 256 * kMiB, 4, 2);
  const SimResult r = Run(s);
  for (int t = 0; t < 4; ++t) REQUIRE(r.nodes[t].bytes_sent == 64 * kMiB);
  // Four uplinks feed the fleet: faster than one trainer would, bounded by each downlink.
  REQUIRE(r.time_s >= 256 * kMiB / kGbit);
}

TEST_CASE("sharded replicas: each engine receives only its shard", "[fanout]") {
  FleetSpec f;
  f.trainers = 2;
  f.pieces_per_trainer = 4;
  f.engines = 8;
  f.replicas = 2;
  f.model_bytes = 64 * kMiB;
  f.link_bytes_per_s = kGbit;
  absl::StatusOr<SimScenario> s = MakeFleet(f);
  REQUIRE(s.ok());
  const SimResult r = Run(*s);
  for (int e = 2; e < 10; ++e) REQUIRE(r.nodes[e].bytes_received == 16 * kMiB);
}

TEST_CASE("malformed scenarios are refused", "[fanout]") {
  SimScenario s = Fleet(4);
  s.kills.push_back({0, 0.1});  // the origin
  REQUIRE(Simulate(s).status().code() == absl::StatusCode::kInvalidArgument);
  s = Fleet(4);
  s.pieces[0].pullers.push_back(0);  // the origin pulling its own piece
  REQUIRE(Simulate(s).status().code() == absl::StatusCode::kInvalidArgument);
  s = Fleet(4);
  s.nodes[2].down_bytes_per_s = 0;
  REQUIRE(Simulate(s).status().code() == absl::StatusCode::kInvalidArgument);
  FleetSpec f;
  f.engines = 6;
  f.replicas = 4;
  REQUIRE(MakeFleet(f).status().code() == absl::StatusCode::kInvalidArgument);
}

}  // namespace refit::fleet

namespace refit::fleet {

// The calibration of docs/fanout-simulator.md: one goodput factor, fitted once on T(1) of the
// 2026-12-03 12:29 run (500 Mbit/s, 256 MiB: 4.518 s), then held against the real runs it is
// within 15 % of. (Not asserted, as measured: K = 4 and 8 on the fully busy 2-core machine,
// 18 % and 33 % above the model, which has no CPU.)
TEST_CASE("the calibrated model: one goodput factor, within 15 % of the real runs",
          "[fanout][calibration]") {
  struct Real {
    double gbit;
    int k;
    double seconds;
  };
  const double fitted_on = 4.518;  // T(1) at 500 Mbit/s
  auto simulate = [](double gbit, double goodput, int k) {
    FleetSpec f;
    f.engines = k;
    f.model_bytes = 256 * kMiB;
    f.link_bytes_per_s = gbit * kGbit * goodput;
    absl::StatusOr<SimScenario> s = MakeFleet(f);
    REQUIRE(s.ok());
    return Run(*s).time_s;
  };
  const double goodput = simulate(0.5, 1.0, 1) / fitted_on;
  CHECK(goodput == Approx(0.951).margin(0.001));
  const std::vector<Real> real = {
      {0.5, 1, 4.518},                                    // 2026-12-03 12:29, fitted here
      {1.0, 1, 2.319}, {1.0, 2, 2.433},                   // 2026-12-03 12:23, load 44
      {1.0, 1, 2.254}, {1.0, 2, 2.392}, {1.0, 4, 2.725},  // 2026-12-01 23:52, load 8-10
  };
  for (const Real& r : real) {
    const double t = simulate(r.gbit, goodput, r.k);
    INFO(r.gbit << " Gbit/s, K = " << r.k << ": model " << t << " s, measured " << r.seconds);
    CHECK(std::abs(t - r.seconds) <= 0.15 * r.seconds);
  }
}

}  // namespace refit::fleet
