// A fleet across network namespaces: one trainer's node and four engine nodes, each in its own
// namespace on one bridge, each node's link throttled (tc tbf, both directions), so every
// version is in flight for seconds and relays serve each other over separate network stacks.
// Bit-exact versions through relays, deltas with relays on, engines of different layouts, a
// relay killed mid-transfer, a relay serving corrupted bytes (test build of refitd), and
// WaitForReplicas with its deadline. Needs root and iproute2: where namespaces can't be made,
// every case FAILS (it is never silently green).

#include <signal.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <thread>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "tests/testing/fleet.h"

namespace refit {
namespace {

using std::chrono::milliseconds;
using testing::Fill;
using testing::Fleet;
using testing::FleetOptions;
using testing::Metric;
using testing::Network;

// 200 Mbit/s per link: a 32 MiB version needs at least 1.3 s on the trainer's uplink.
constexpr char kRate[] = "200mbit";
constexpr int kEngines = 4;

std::unique_ptr<Network> MakeNetwork() {
  return testing::RequireNetwork("r16", kEngines + 1, kRate);
}

FleetOptions InNetwork(Network* network, int64_t rows) {
  FleetOptions options;
  options.engines = kEngines;
  options.rows = rows;
  options.network = network;
  return options;
}

double TrainerSent(Fleet& fleet) { return Metric(*fleet.trainer, "refit_data_bytes_sent_total"); }

}  // namespace

TEST_CASE(
    "netns fleet: versions arrive bit-exact through relays; WaitForReplicas and its "
    "deadline",
    "[integration][netns][fanout]") {
  auto network = MakeNetwork();
  Fleet fleet(InNetwork(network.get(), 4096));  // 32 MiB
  const double model = static_cast<double>(fleet.ModelBytes());
  for (uint64_t v = 1; v <= 3; ++v) {
    const double sent_before = TrainerSent(fleet), relayed_before = fleet.RelaySent();
    Fill(*fleet.source, v * 7919);
    fleet.Publish(v);
    if (v == 2) {
      // In flight for over a second: a short deadline passes before any replica has it, and
      // says so with DEADLINE_EXCEEDED; nothing else changes.
      auto early = fleet.trainer->WaitForReplicas("m", 2, 1, milliseconds(200));
      REQUIRE(early.status().code() == absl::StatusCode::kDeadlineExceeded);
      // A quorum of two arrives before all four need to.
      auto quorum = fleet.trainer->WaitForReplicas("m", 2, 2, milliseconds(60000));
      REQUIRE(quorum.ok());
      REQUIRE(quorum->version() >= 2);
      REQUIRE(quorum->nodes_size() >= 2);
    }
    auto all = fleet.trainer->WaitForReplicas("m", v, 0, milliseconds(60000));
    REQUIRE(all.ok());
    REQUIRE(all->nodes_size() == kEngines);
    fleet.CheckEngines(v);
    std::this_thread::sleep_for(milliseconds(500));  // the pins' releases carry the counts
    const double sent = TrainerSent(fleet) - sent_before;
    const double relayed = fleet.RelaySent() - relayed_before;
    INFO("version " << v << ": the trainer's node sent " << sent / model << " models, relays "
                    << relayed / model);
    REQUIRE(sent >= 0.9 * model);
    REQUIRE(sent <= 1.25 * model);
    REQUIRE(relayed >= 2.5 * model);
  }
  // Every replica is known with its version; more replicas than exist, or a version never
  // published, wait out their deadline.
  auto status = fleet.trainer->Status();
  REQUIRE(status.ok());
  REQUIRE(status->models_size() == 1);
  REQUIRE(status->models(0).replicas_size() == kEngines);
  for (const auto& r : status->models(0).replicas()) REQUIRE(r.latest_version() == 3);
  auto too_many = fleet.trainer->WaitForReplicas("m", 3, kEngines + 1, milliseconds(300));
  REQUIRE(too_many.status().code() == absl::StatusCode::kDeadlineExceeded);
  auto unpublished = fleet.trainer->WaitForReplicas("m", 4, 1, milliseconds(300));
  REQUIRE(unpublished.status().code() == absl::StatusCode::kDeadlineExceeded);
  // An engine asks the same of its own daemon, which learns the others' versions by reports.
  auto from_engine = fleet.engines[1].client->WaitForReplicas("m", 3, 0, milliseconds(10000));
  REQUIRE(from_engine.ok());
  REQUIRE(from_engine->nodes_size() == kEngines);
}

TEST_CASE("netns fleet: deltas with relays on; a node without the base gets full bytes",
          "[integration][netns][fanout]") {
  auto network = MakeNetwork();
  Fleet fleet(InNetwork(network.get(), 4096));
  const double model = static_cast<double>(fleet.ModelBytes());
  fleet.PublishAndCheck(1);
  const double deltas_before = fleet.Sum("refit_delta_versions_total");
  for (uint64_t v = 2; v <= 3; ++v) {
    const double sent_before = TrainerSent(fleet), relayed_before = fleet.RelaySent();
    fleet.Touch(v, 4096);  // ~8 K of 16 M elements change
    fleet.Publish(v);
    fleet.CheckEngines(v);
    std::this_thread::sleep_for(milliseconds(500));
    const double sent = TrainerSent(fleet) - sent_before;
    const double relayed = fleet.RelaySent() - relayed_before;
    std::cout << "delta version " << v << ": the trainer's node sent " << sent << " bytes, relays "
              << relayed << " (delta bytes received on the engines: "
              << fleet.Sum("refit_delta_bytes_received_total") << " in all so far)\n";
    INFO("version " << v << ": trainer sent " << sent << " bytes, relays " << relayed);
    REQUIRE(sent < 0.25 * model);  // deltas, not full bytes, to each of four nodes
    REQUIRE(relayed > 0);          // delta chunks relayed between the engines
  }
  REQUIRE(fleet.Sum("refit_delta_versions_total") - deltas_before == 2 * kEngines);
  // engine-3 comes back with nothing: its first version is full bytes, the others' a delta.
  fleet.RestartEngine(3);
  fleet.WaitForFleet();
  fleet.Touch(4, 4096);
  fleet.Publish(4);
  fleet.CheckEngines(4);
  // Whatever it pulled first after the restart (version 3 or 4) came in full.
  REQUIRE(Metric(*fleet.engines[3].client, "refit_full_versions_total") >= 1);
  REQUIRE(fleet.Sum("refit_delta_versions_total", {3}) - deltas_before == 3 * (kEngines - 1));
}

TEST_CASE(
    "netns fleet: with --delta-base=destination each engine stages every version, the second "
    "too, in one slot; the trainer's node sends one model per version",
    "[integration][netns][fanout]") {
  // Issue 36: version 2 took 2-4x the others. The relay board still held version 1's slot
  // when version 2's pull asked the pool for one, so each engine faulted in a second slot
  // (seconds on a loaded machine) while its readers gave up on it and read from the trainer.
  // Counted, not timed: the engines' slot memory and the trainer's bytes.
  auto network = MakeNetwork();
  FleetOptions options = InNetwork(network.get(), 4096);  // 32 MiB
  options.engine_args.assign(kEngines, {"--delta-base=destination"});
  Fleet fleet(std::move(options));
  const double model = static_cast<double>(fleet.ModelBytes());
  for (uint64_t v = 1; v <= 3; ++v) {
    const double sent_before = TrainerSent(fleet);
    fleet.PublishAndCheck(v);  // every engine Applies: the held copy goes, as in the bench
    std::this_thread::sleep_for(milliseconds(500));  // the pins' releases carry the counts
    const double sent = TrainerSent(fleet) - sent_before;
    std::cout << "destination base, version " << v << ": the trainer's node sent " << sent / model
              << " models; engines' slot memory:";
    for (auto& engine : fleet.engines) {
      std::cout << " " << Metric(*engine.client, "refit_slot_memory_bytes") / model;
    }
    std::cout << " models\n";
    if (v == 1) continue;  // the engines may not know each other as relays yet
    INFO("version " << v << ": the trainer's node sent " << sent / model << " models");
    REQUIRE(sent <= 1.05 * model);
    for (size_t i = 0; i < fleet.engines.size(); ++i) {
      const double slots = Metric(*fleet.engines[i].client, "refit_slot_memory_bytes");
      INFO("engine " << i << " holds " << slots / model << " models of version slots");
      REQUIRE(slots <= 1.01 * model);
    }
  }
}

TEST_CASE("netns fleet: engines of different layouts share relays, each gets its bytes",
          "[integration][netns][fanout]") {
  auto network = MakeNetwork();
  FleetOptions options = InNetwork(network.get(), 4096);
  options.half = {false, true, false, true};
  Fleet fleet(std::move(options));
  const double model = static_cast<double>(fleet.ModelBytes());
  for (uint64_t v = 1; v <= 2; ++v) {
    const double sent_before = TrainerSent(fleet), relayed_before = fleet.RelaySent();
    fleet.PublishAndCheck(v);
    std::this_thread::sleep_for(milliseconds(500));
    const double sent = TrainerSent(fleet) - sent_before;
    const double relayed = fleet.RelaySent() - relayed_before;
    INFO("version " << v << ": trainer sent " << sent / model << " models, relays "
                    << relayed / model);
    REQUIRE(sent <= 1.6 * model);  // half-row engines don't relay the rows they don't hold
    REQUIRE(relayed > 0.5 * model);
  }
}

TEST_CASE("netns fleet: a relay killed mid-transfer; the others complete bit-exact",
          "[integration][netns][fanout]") {
  auto network = MakeNetwork();
  Fleet fleet(InNetwork(network.get(), 8192));  // 64 MiB: over 2.7 s on the trainer's link
  fleet.PublishAndCheck(1);
  Fill(*fleet.source, 2 * 7919);
  fleet.Publish(2);
  // Kill engine-0 while version 2 is partly on it (and it serves its stripes to the others).
  fleet.WaitMidVersion(0, 2);
  REQUIRE(fleet.engines[0].daemon->Stop(SIGKILL) == 128 + SIGKILL);
  const double from_relays = fleet.Sum("refit_relay_bytes_received_total", {0});
  fleet.CheckEngines(2, {0});
  INFO("the three others read " << from_relays << " bytes from relays");
  REQUIRE(fleet.Sum("refit_relay_bytes_received_total", {0}) > 0);
  fleet.PublishAndCheck(3, {0});
  // It comes back empty and catches up with the rest.
  fleet.RestartEngine(0);
  fleet.WaitForFleet();
  fleet.PublishAndCheck(4);
}

// Strict since UCX's tcp zero-copy sends are off (ucx_options.cc): with them, 1 run in 3 a *live*
// engine aborted here when the relay was SIGKILLed mid-stream ("uct_iface.h:884 Assertion
// `comp->count > 0' failed ... status=-80": UCX 1.13 completed its half-written gather reply to
// the relay twice; daemon/transport/ucx/ucx_peer_kill_test).
TEST_CASE("netns fleet: a relay killed mid-version is replaced within about a second, timed",
          "[integration][netns][fanout]") {
  auto network = MakeNetwork();
  Fleet fleet(InNetwork(network.get(), 8192));  // 64 MiB: over 2.7 s on the trainer's link
  using Clock = std::chrono::steady_clock;
  auto seconds_since = [](Clock::time_point t) {
    return std::chrono::duration<double>(Clock::now() - t).count();
  };
  fleet.PublishAndCheck(1);
  // The same version without a kill, for its time.
  Fill(*fleet.source, 2 * 7919);
  fleet.Publish(2);
  auto start = Clock::now();
  fleet.CheckEngines(2);
  const double plain = seconds_since(start);
  Fill(*fleet.source, 3 * 7919);
  fleet.Publish(3);
  start = Clock::now();
  fleet.WaitMidVersion(0, 3, 1.0 / 8, 1.0 / 2);
  std::vector<double> before;
  for (size_t i = 1; i < fleet.engines.size(); ++i) {
    before.push_back(Metric(*fleet.engines[i].client, "refit_relay_failovers_total"));
  }
  REQUIRE(fleet.engines[0].daemon->Stop(SIGKILL) == 128 + SIGKILL);
  const auto killed = Clock::now();
  // Each live node that was still reading from engine-0 counts the failover when it has posted
  // the reads of what engine-0 owed it to the trainer's node; one that had read all of it
  // already finishes without one.
  std::vector<double> replaced(fleet.engines.size(), -1);
  for (bool waiting = true; waiting && seconds_since(killed) < 60;) {
    waiting = false;
    for (size_t i = 1; i < fleet.engines.size(); ++i) {
      if (replaced[i] >= 0) continue;
      if (Metric(*fleet.engines[i].client, "refit_relay_failovers_total") > before[i - 1]) {
        replaced[i] = seconds_since(killed);
        continue;
      }
      auto s = fleet.engines[i].client->Status();
      REQUIRE(s.ok());
      if (s->models_size() == 1 && s->models(0).latest_version() >= 3) continue;  // done
      waiting = true;
    }
    std::this_thread::sleep_for(milliseconds(5));
  }
  fleet.CheckEngines(3, {0});
  const double with_kill = seconds_since(start);
  double slowest = 0;
  int failed_over = 0;
  for (size_t i = 1; i < fleet.engines.size(); ++i) {
    if (replaced[i] < 0) continue;
    ++failed_over;
    slowest = std::max(slowest, replaced[i]);
  }
  std::printf(
      "relay killed mid-version: %d live node(s) read from a new source, the last %.3f s after "
      "the kill; the version took %.3f s (%.3f s without a kill: %+.3f s)\n",
      failed_over, slowest, with_kill, plain, with_kill - plain);
  REQUIRE(failed_over >= 1);
  REQUIRE(slowest <= 2.0);  // the goal is 1 s; loosely, on a shared 2-core machine
}

TEST_CASE("netns fleet: a relay serving corrupted bytes is caught, the chunks are refetched",
          "[integration][netns][fanout]") {
  auto network = MakeNetwork();
  FleetOptions options = InNetwork(network.get(), 4096);
  // engine-0 (test build of refitd) flips a byte in what it serves, after verifying its own
  // copy: only the others' checks against the trainer's digests can catch it.
  options.engine_env = {{"REFIT_FAULT_RELAY_FLIP=1000"}};
  Fleet fleet(std::move(options));
  fleet.PublishAndCheck(1, {0});
  const double rejected = fleet.Sum("refit_relay_chunks_rejected_total", {0});
  INFO("chunks rejected: " << rejected);
  REQUIRE(rejected > 0);
  fleet.PublishAndCheck(2, {0});
  // A small change: a delta, whose chunks may come through the same relay; what it flips fails
  // the checksums in the origin's delta header and is read from the trainer's node again.
  fleet.Touch(3, 4096);
  fleet.Publish(3);
  fleet.CheckEngines(3, {0});
  REQUIRE(fleet.Sum("refit_delta_versions_total", {0}) == 3);
}

}  // namespace refit

namespace refit {

TEST_CASE(
    "netns fleet: two trainer nodes each publish half; bounded engines merge both member "
    "lists and relay to each other within --max-peer-connections",
    "[integration][netns][fanout]") {
  // Issue 36, part 4: each engine's --peers names the two trainer nodes only (bounded mode);
  // it learns the other engines from both trainers' answers to its replica reports (merged,
  // not replaced). (The cap on incoming relay readers binding: tests/fleet_bounded_test.)
  auto network = testing::RequireNetwork("r16t2", kEngines + 2, kRate);
  FleetOptions options = InNetwork(network.get(), 4096);  // 32 MiB, 16 MiB per trainer node
  options.trainers = 2;
  options.peers_trainer_only = true;
  // Two trainers and the three other engines: room for every channel, none for more.
  options.engine_args.assign(kEngines, {"--max-peer-connections=5"});
  Fleet fleet(std::move(options));
  for (uint64_t v = 1; v <= 3; ++v) {
    const Fleet::HalvesSent sent = fleet.PublishAndCheckHalves(v);
    INFO("version " << v << ": trainer nodes sent " << sent.first << " and " << sent.second
                    << " of their halves, relays " << sent.relayed);
    REQUIRE(sent.first >= 0.9);
    REQUIRE(sent.second >= 0.9);
    // From version 2 on every engine knows the others: each half leaves its trainer once.
    const double most = v == 1 ? 1.25 : 1.05;
    REQUIRE(sent.first <= most);
    REQUIRE(sent.second <= most);
    if (v > 1) REQUIRE(sent.relayed >= 2 * 2.5);  // 3/4 of each half to each of 4 nodes
  }
  // Merged member lists: every engine knows the other three as replicas while its --peers
  // named only the two trainer nodes; incoming relay readers stayed within the cap.
  for (auto& e : fleet.engines) {
    auto status = e.client->Status();
    REQUIRE(status.ok());
    REQUIRE(status->models(0).replicas_size() == kEngines);
    REQUIRE(Metric(*e.client, "refit_peer_channels_open") <= 5);
    REQUIRE(status->peers_size() == 2);  // --peers: the two trainer nodes
  }
  for (client::Client* t : {fleet.trainer.get(), fleet.second_trainer.get()}) {
    auto status = t->Status();
    REQUIRE(status.ok());
    REQUIRE(status->models(0).replicas_size() == kEngines);
  }
}

}  // namespace refit
