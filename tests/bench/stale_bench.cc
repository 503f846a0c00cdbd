// stale_bench: how long an engine node spends flagged stale (PublishRequest.max_staleness)
// when its link is slowed. Three refitd in network namespaces on one bridge (tests/testing/
// fleet.h: the trainer's node, a fast engine node and a slow one, 1 Gbit/s each, no relaying);
// a trainer publishing a fresh full version (every byte changed, so no delta helps) every
// --period-ms with a budget of --k versions and a short deadline (it doesn't wait for the
// replicas: it keeps its cadence, as an asynchronous RL trainer would). Two phases in one run:
//   reference  the slow engine's link at 1 Gbit/s like the others;
//   slowed     its link at --slow-rate (tc tbf).
// Per phase: each engine's refit_stale_seconds_total over the phase (time it was flagged stale),
// as a fraction of the phase; its versions completed; and its median pull time (the timeline's
// "pulled" stage). Root only (namespaces). The last line is machine-readable.
//
//   bazel run //tests/bench:stale_bench -- [--versions=12] [--period-ms=500] [--mib=16]
//       [--slow-rate=100mbit] [--k=1]

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_format.h"
#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "tests/testing/fleet.h"

namespace refit {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

int Flag(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : fallback;
}

std::string FlagText(const char* name, const char* fallback) {
  const char* v = std::getenv(name);
  return v ? v : fallback;
}

struct Phase {
  std::string name;
  double seconds = 0;
  double stale_s[2] = {0, 0};
  uint64_t completed[2] = {0, 0};
  double pull_ms[2] = {0, 0};  // median "pulled" stage
  int publish_deadlines = 0;   // Publish answers DEADLINE_EXCEEDED (replicas behind)
};

double MedianPullMs(client::Client& c, uint64_t first, uint64_t last) {
  auto t = c.Timeline("m", 0, /*local=*/true);
  if (!t.ok() || t->nodes_size() == 0) return 0;
  std::vector<double> ms;
  for (const auto& v : t->nodes(0).versions()) {
    if (v.version() < first || v.version() > last) continue;
    for (const auto& s : v.stages()) {
      if (s.stage() == "pulled") ms.push_back((s.end_us() - s.start_us()) / 1e3);
    }
  }
  if (ms.empty()) return 0;
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

TEST_CASE("stale_bench") {
  const int versions = Flag("STALE_VERSIONS", 12);
  const int period_ms = Flag("STALE_PERIOD_MS", 500);
  const int mib = Flag("STALE_MIB", 16);
  const int k = Flag("STALE_K", 1);
  const std::string slow_rate = FlagText("STALE_SLOW_RATE", "100mbit");
  auto net = testing::Network::Create("rlsem", 3, "1gbit");
  REQUIRE(net.ok());
  testing::FleetOptions options;
  options.engines = 2;
  options.rows = int64_t{mib} * 1024 * 1024 / (testing::kFleetCols * 2);
  options.network = net->get();
  options.engine_args = {{"--relay=false"}, {"--relay=false"}};
  testing::Fleet fleet(options);
  std::vector<Phase> phases;
  uint64_t version = 0;
  for (const char* name : {"reference", "slowed"}) {
    Phase phase;
    phase.name = name;
    if (phase.name == "slowed") REQUIRE((*net)->SetRate(2, slow_rate).ok());
    // Start the phase with both engines at the newest version.
    testing::Fill(*fleet.source, ++version * 7919);
    fleet.Publish(version);
    fleet.CheckEngines(version);
    const uint64_t first = version + 1;
    double before[2];
    uint64_t held_before[2];
    for (int e = 0; e < 2; ++e) {
      before[e] = testing::Metric(*fleet.engines[e].client, "refit_stale_seconds_total");
      held_before[e] = version;
    }
    const auto start = Clock::now();
    for (int i = 0; i < versions; ++i) {
      const auto due = start + milliseconds(int64_t{period_ms} * (i + 1));
      testing::Fill(*fleet.source, ++version * 7919);
      v1::PublishRequest with;
      with.set_max_staleness(static_cast<uint32_t>(k));
      fleet.trainer->set_call_timeout(milliseconds(std::max(50, period_ms / 5)));
      auto published = fleet.trainer->Publish("m", version, {fleet.source_id}, with);
      fleet.trainer->set_call_timeout(milliseconds(60000));
      if (!published.ok()) {
        REQUIRE(published.status().code() == absl::StatusCode::kDeadlineExceeded);
        ++phase.publish_deadlines;
      }
      std::this_thread::sleep_until(due);
    }
    phase.seconds = std::chrono::duration<double>(Clock::now() - start).count();
    // Read the counters at the end of the publishing (a node still stale keeps counting).
    for (int e = 0; e < 2; ++e) {
      phase.stale_s[e] =
          testing::Metric(*fleet.engines[e].client, "refit_stale_seconds_total") - before[e];
      auto s = fleet.engines[e].client->Status();
      REQUIRE(s.ok());
      for (const auto& m : s->models()) {
        if (m.model() == "m") phase.completed[e] = m.latest_version() - held_before[e];
      }
    }
    if (phase.name == "slowed") REQUIRE((*net)->SetRate(2, "1gbit").ok());
    fleet.CheckEngines(version);  // both catch up before the next phase
    for (int e = 0; e < 2; ++e) {
      phase.pull_ms[e] = MedianPullMs(*fleet.engines[e].client, first, version);
    }
    phases.push_back(phase);
  }
  std::cout << absl::StrFormat(
      "stale_bench: %d MiB full versions every %d ms, %d per phase, max_staleness=%d, "
      "slowed link %s (the other links 1gbit)\n",
      mib, period_ms, versions, k, slow_rate);
  std::cout << absl::StrFormat("%-10s %-8s %8s %10s %8s %12s %10s\n", "phase", "engine", "stale s",
                               "stale frac", "done", "pull ms med", "deadlines");
  for (const Phase& p : phases) {
    for (int e = 0; e < 2; ++e) {
      std::cout << absl::StrFormat("%-10s %-8s %8.2f %10.2f %8d %12.1f %10d\n", p.name,
                                   e == 0 ? "fast" : "slow", p.stale_s[e], p.stale_s[e] / p.seconds,
                                   p.completed[e], p.pull_ms[e], p.publish_deadlines);
    }
  }
  std::cout << absl::StrFormat(
      "RESULT reference_slow_stale_s=%.2f slowed_slow_stale_s=%.2f slowed_fast_stale_s=%.2f "
      "phase_s=%.2f slowed_pull_ms=%.1f reference_pull_ms=%.1f\n",
      phases[0].stale_s[1], phases[1].stale_s[1], phases[1].stale_s[0], phases[1].seconds,
      phases[1].pull_ms[1], phases[0].pull_ms[1]);
}

}  // namespace refit
