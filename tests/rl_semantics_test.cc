// RL semantics in the sync layer (issue 35), with real refitd processes: the trainer's labels of
// a version reach the engines' Watch and Status; a staleness budget makes Publish wait for the
// replicas and flags a slowed engine node (Status, refitctl replicas, metrics, Watch) until it
// catches up; each version's timeline is gathered from the fleet by refitctl timeline, as text,
// JSON and a Chrome trace file.

#include <unistd.h>

#include <chrono>
#include <fstream>
#include <map>
#include <string>
#include <thread>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "nlohmann/json.hpp"
#include "tests/testing/daemon_process.h"
#include "tests/testing/fleet.h"

namespace refit {
namespace {

using client::Slice;
using std::chrono::milliseconds;
using testing::Fill;
using testing::Fleet;
using testing::Metric;
using Clock = std::chrono::steady_clock;

testing::FleetOptions Options(int engines, int64_t rows,
                              std::vector<std::vector<std::string>> engine_args = {},
                              std::vector<std::vector<std::string>> engine_env = {}) {
  testing::FleetOptions options;
  options.engines = engines;
  options.rows = rows;
  options.engine_args = std::move(engine_args);
  options.engine_env = std::move(engine_env);
  return options;
}

v1::PublishRequest With(std::map<std::string, std::string> labels, uint32_t max_staleness = 0) {
  v1::PublishRequest with;
  for (auto& [k, v] : labels) (*with.mutable_labels())[k] = v;
  with.set_max_staleness(max_staleness);
  return with;
}

const v1::ModelStatus* ModelOf(const v1::StatusResponse& status, const std::string& model) {
  for (const auto& m : status.models()) {
    if (m.model() == model) return &m;
  }
  return nullptr;
}

// Polls `ready` every 20 ms for up to `timeout`.
template <typename Ready>
bool Eventually(Ready ready, milliseconds timeout = milliseconds(10000)) {
  const auto until = Clock::now() + timeout;
  while (Clock::now() < until) {
    if (ready()) return true;
    std::this_thread::sleep_for(milliseconds(20));
  }
  return ready();
}

// The events of a Watch, read on a thread of its own.
struct Events {
  explicit Events(std::unique_ptr<client::Watcher> w) : watcher(std::move(w)) {
    reader = std::thread([this] {
      v1::VersionEvent event;
      while (watcher->Next(&event)) {
        std::lock_guard<std::mutex> lock(mu);
        events.push_back(event);
      }
    });
  }
  ~Events() {
    watcher->Cancel();
    reader.join();
  }
  std::vector<v1::VersionEvent> Get() {
    std::lock_guard<std::mutex> lock(mu);
    return events;
  }
  std::unique_ptr<client::Watcher> watcher;
  std::mutex mu;
  std::vector<v1::VersionEvent> events;
  std::thread reader;
};

}  // namespace

TEST_CASE("labels travel with a version to the engines; bad input publishes nothing",
          "[integration][rl]") {
  Fleet fleet(Options(2, 256));
  auto watch = fleet.engines[1].client->Watch("m");
  REQUIRE(watch.ok());
  Events events(std::move(watch).value());
  Fill(*fleet.source, 1);
  const std::map<std::string, std::string> labels = {
      {"step", "17"}, {"run", "grpo-7b"}, {"wall_time", "2026-12-03T08:00:00Z"}};
  auto published = fleet.trainer->Publish("m", 1, {fleet.source_id}, With(labels));
  REQUIRE(published.ok());
  fleet.CheckEngines(1);
  // Watch on an engine node delivers the trainer's labels with the version.
  REQUIRE(Eventually([&] { return !events.Get().empty(); }));
  const v1::VersionEvent event = events.Get().front();
  REQUIRE(event.version() == 1);
  REQUIRE(std::map<std::string, std::string>(event.labels().begin(), event.labels().end()) ==
          labels);
  // Status shows them per version, on the trainer's node and on the engines'.
  for (client::Client* c : {fleet.trainer.get(), fleet.engines[0].client.get()}) {
    auto status = c->Status();
    REQUIRE(status.ok());
    const v1::ModelStatus* m = ModelOf(*status, "m");
    REQUIRE(m);
    REQUIRE(m->version_labels_size() == 1);
    REQUIRE(m->version_labels(0).version() == 1);
    REQUIRE(m->version_labels(0).labels().at("step") == "17");
  }
  // Labels over 1 KiB: INVALID_ARGUMENT, nothing published (version 2 is still free).
  auto big = fleet.trainer->Publish("m", 2, {fleet.source_id},
                                    With({{"note", std::string(1020, 'x')}, {"step", "2"}}));
  REQUIRE(big.status().code() == absl::StatusCode::kInvalidArgument);
  REQUIRE(std::string(big.status().message()).find("1029 bytes") != std::string::npos);
  auto after = fleet.trainer->Status();
  REQUIRE(after.ok());
  REQUIRE(ModelOf(*after, "m")->latest_version() == 1);
  // max_staleness on a model no engine holds: FAILED_PRECONDITION, nothing published.
  auto lonely_shm = client::SharedMemory::Create(testing::UniqueShmName("rl-lonely"), 4096);
  REQUIRE(lonely_shm.ok());
  auto lonely = fleet.trainer->RegisterBuffer("lonely", v1::SOURCE, lonely_shm->name(),
                                              {Slice("w", v1::BF16, {2048}, 0)}, "trainer");
  REQUIRE(lonely.ok());
  auto refused = fleet.trainer->Publish("lonely", 1, {*lonely}, With({}, 2));
  REQUIRE(refused.status().code() == absl::StatusCode::kFailedPrecondition);
  REQUIRE(std::string(refused.status().message()).find("no node with DESTINATION buffers") !=
          std::string::npos);
  auto lonely_status = fleet.trainer->Status();
  REQUIRE(lonely_status.ok());
  REQUIRE(ModelOf(*lonely_status, "lonely")->latest_version() == 0);
  // The daemon keeps serving: the same numbers publish once the input is right.
  REQUIRE(fleet.trainer->Publish("lonely", 1, {*lonely}).ok());
  Fill(*fleet.source, 2);
  REQUIRE(fleet.trainer->Publish("m", 2, {fleet.source_id}, With({{"step", "18"}})).ok());
  fleet.CheckEngines(2);
  REQUIRE(Eventually([&] { return events.Get().size() >= 2; }));
  REQUIRE(events.Get()[1].labels().at("step") == "18");
}

TEST_CASE(
    "a staleness budget: Publish waits for the replicas, a slowed engine node is flagged "
    "until it catches up",
    "[integration][rl]") {
  const std::string slow_file = "/tmp/rl-semantics-slow-" + std::to_string(getpid());
  unlink(slow_file.c_str());
  // engine-1 is slowed: each pull waits 2.5 s while the file exists. No relaying, so engine-0
  // never waits for engine-1's stripes.
  Fleet fleet(Options(
      2, 256, {{"--relay=false"}, {"--relay=false"}},
      {{}, {"REFIT_FAULT_PULL_DELAY_MS=2500", "REFIT_FAULT_PULL_DELAY_FILE=" + slow_file}}));
  client::Client& trainer = *fleet.trainer;
  client::Client& slow = *fleet.engines[1].client;
  Fill(*fleet.source, 1);
  REQUIRE(trainer.Publish("m", 1, {fleet.source_id}, With({}, 1)).ok());
  fleet.CheckEngines(1);
  auto watch = slow.Watch("m");
  REQUIRE(watch.ok());
  Events events(std::move(watch).value());

  { std::ofstream(slow_file) << "slow"; }
  // Version 2 with k = 1: every replica holds 1 already.
  Fill(*fleet.source, 2);
  auto start = Clock::now();
  REQUIRE(trainer.Publish("m", 2, {fleet.source_id}, With({}, 1)).ok());
  REQUIRE(Clock::now() - start < milliseconds(1500));
  // Version 3 with k = 1 waits for version 2 on engine-1, which is 2.5 s away: past the
  // caller's 600 ms deadline, DEADLINE_EXCEEDED naming engine-1, answered before it fires.
  Fill(*fleet.source, 3);
  trainer.set_call_timeout(milliseconds(600));
  start = Clock::now();
  auto waited = trainer.Publish("m", 3, {fleet.source_id}, With({}, 1));
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  trainer.set_call_timeout(milliseconds(60000));
  INFO(waited.status().ToString());
  REQUIRE(waited.status().code() == absl::StatusCode::kDeadlineExceeded);
  REQUIRE(std::string(waited.status().message()).find("engine-1 at 1") != std::string::npos);
  REQUIRE(std::string(waited.status().message()).find("version 3 is published") !=
          std::string::npos);
  REQUIRE(seconds >= 0.4);
  REQUIRE(seconds < 1.5);
  // Published 3, engine-1 at 1, k = 1: stale, in Status, refitctl replicas, metrics and Watch.
  REQUIRE(fleet.engines[0].client->WaitForVersion("m", 3, milliseconds(10000)).ok());
  REQUIRE(Eventually([&] { return Metric(trainer, "refit_stale_replicas") == 1; }));
  auto status = trainer.Status();
  REQUIRE(status.ok());
  const v1::ModelStatus* m = ModelOf(*status, "m");
  REQUIRE(m->max_staleness() == 1);
  REQUIRE(m->published_version() == 3);
  REQUIRE(m->replicas_size() == 2);
  REQUIRE(m->replicas(0).node() == "engine-0");
  REQUIRE_FALSE(m->replicas(0).stale());
  REQUIRE(m->replicas(1).node() == "engine-1");
  REQUIRE(m->replicas(1).stale());
  auto cli = testing::RunCommand({testing::RunfilePath("client/refitctl"),
                                  "--socket=" + fleet.trainer_node->socket(), "replicas", "m"});
  INFO(cli.out << cli.err);
  REQUIRE(cli.exit_code == 0);
  REQUIRE(cli.out.find("STALE") != std::string::npos);
  REQUIRE(cli.out.find("staleness budget: 1") != std::string::npos);
  auto cli_json =
      testing::RunCommand({testing::RunfilePath("client/refitctl"),
                           "--socket=" + fleet.trainer_node->socket(), "replicas", "m", "--json"});
  auto replicas = nlohmann::json::parse(cli_json.out);
  REQUIRE(replicas[1]["stale"] == true);
  REQUIRE(replicas[0]["stale"] == false);
  // The slowed node knows it is stale.
  REQUIRE(Eventually([&] { return Metric(slow, "refit_stale_models") == 1; }));
  auto own = slow.Status();
  REQUIRE(own.ok());
  REQUIRE(ModelOf(*own, "m")->stale());
  REQUIRE(Eventually([&] {
    for (const auto& e : events.Get()) {
      if (e.stale_notice() && e.stale()) return true;
    }
    return false;
  }));
  // Recovery: the link is fast again; engine-1 catches up and is no longer stale.
  unlink(slow_file.c_str());
  REQUIRE(slow.WaitForVersion("m", 3, milliseconds(20000)).ok());
  REQUIRE(Eventually([&] { return Metric(trainer, "refit_stale_replicas") == 0; }));
  REQUIRE(Eventually([&] { return Metric(slow, "refit_stale_models") == 0; }));
  REQUIRE(Metric(slow, "refit_stale_seconds_total") > 0.2);
  REQUIRE(Eventually([&] {
    auto e = events.Get();
    return !e.empty() && !e.back().stale();
  }));
  bool told_stale = false, told_fresh = false;
  for (const auto& e : events.Get()) {
    if (e.stale()) told_stale = true;
    if (told_stale && !e.stale()) told_fresh = true;
  }
  REQUIRE(told_fresh);
  // Within budget again: Publish(4) with k = 1 answers without waiting long.
  Fill(*fleet.source, 4);
  start = Clock::now();
  REQUIRE(trainer.Publish("m", 4, {fleet.source_id}, With({}, 1)).ok());
  REQUIRE(Clock::now() - start < milliseconds(3000));
  fleet.CheckEngines(4);
}

TEST_CASE("a relayed version's timeline: every node's stages in order, and a Perfetto trace",
          "[integration][rl]") {
  // The trainer's node and two engine nodes that relay stripes to each other.
  Fleet fleet(Options(2, 4096));  // 32 MiB
  fleet.PublishAndCheck(1);
  fleet.PublishAndCheck(2);
  for (testing::FleetEngine& e : fleet.engines) {
    REQUIRE(e.client->Apply("m", 2, {e.buffer}).ok());
  }
  // Gathered from one engine node: every node of the fleet.
  auto timeline = fleet.engines[1].client->Timeline("m", 2);
  REQUIRE(timeline.ok());
  INFO(timeline->DebugString());
  std::map<std::string, std::map<std::string, v1::TimelineStage>> stages;  // node -> stage
  for (const auto& node : timeline->nodes()) {
    REQUIRE(node.error().empty());
    REQUIRE(node.versions_size() == 1);
    REQUIRE(node.versions(0).version() == 2);
    for (const auto& s : node.versions(0).stages()) stages[node.node()][s.stage()] = s;
  }
  REQUIRE(stages.size() == 3);
  const auto& t = stages["trainer"];
  REQUIRE(t.count("published"));
  REQUIRE(t.count("complete"));
  // The version completes on the trainer's node inside the Publish call that made it whole.
  REQUIRE(t.at("published").start_us() <= t.at("complete").start_us());
  REQUIRE(t.at("complete").start_us() <= t.at("published").end_us());
  bool relayed = false;
  for (const char* engine : {"engine-0", "engine-1"}) {
    INFO(engine);
    const auto& e = stages[engine];
    for (const char* stage : {"announced", "pulled", "verified", "complete", "applied"}) {
      INFO(stage);
      REQUIRE(e.count(stage));
    }
    REQUIRE(e.at("announced").detail() == "by trainer");
    // Clocks of one host: published, announced, pulled, verified, complete, applied in order.
    REQUIRE(t.at("published").start_us() <= e.at("announced").start_us());
    REQUIRE(e.at("announced").start_us() <= e.at("pulled").start_us());
    REQUIRE(e.at("pulled").end_us() <= e.at("verified").end_us());
    REQUIRE(e.at("verified").end_us() <= e.at("complete").start_us());
    REQUIRE(e.at("complete").start_us() <= e.at("applied").start_us());
    REQUIRE(e.at("applied").detail().find("by pid ") == 0);
    const std::string& from = e.at("pulled").detail();
    REQUIRE(from.find("trainer") != std::string::npos);
    if (from.find(" (relay) ") != std::string::npos) relayed = true;
  }
  REQUIRE(relayed);
  // The serving side says so too: the trainer's node announced it to the engines, and an
  // engine node served pieces of it to the other as it pulled them.
  REQUIRE(t.count("announced"));
  REQUIRE(t.at("announced").detail().rfind("to engine-", 0) == 0);
  REQUIRE(stages["engine-0"].count("relayed") + stages["engine-1"].count("relayed") >= 1);
  // refitctl timeline: the text Gantt, --json, and --trace=FILE (Chrome trace events).
  const std::string trace = fleet.engines[0].daemon->dir() + "/trace.json";
  auto cli = testing::RunCommand({testing::RunfilePath("client/refitctl"),
                                  "--socket=" + fleet.trainer_node->socket(), "timeline", "m", "2",
                                  "--trace=" + trace});
  INFO(cli.out << cli.err);
  REQUIRE(cli.exit_code == 0);
  REQUIRE(cli.out.find("m version 2: from ") != std::string::npos);
  for (const char* line : {"trainer  published", "engine-1 pulled", "engine-0 applied"}) {
    REQUIRE(cli.out.find(line) != std::string::npos);
  }
  std::ifstream file(trace);
  const auto parsed = nlohmann::json::parse(file);  // throws (fails the test) when not JSON
  std::map<std::string, int> processes;
  std::map<int, std::vector<std::string>> names;  // pid -> stage names, in order
  for (const auto& e : parsed["traceEvents"]) {
    if (e["ph"] == "M" && e["name"] == "process_name") {
      processes[e["args"]["name"]] = e["pid"];
    } else if (e["ph"] == "X" || e["ph"] == "i") {
      REQUIRE(e["ts"].get<int64_t>() >= 0);
      REQUIRE(e["args"]["version"] == 2);
      names[e["pid"].get<int>()].push_back(e["name"]);
    }
  }
  REQUIRE(processes.size() == 3);
  const auto& b = names[processes["engine-1"]];
  const std::vector<std::string> expected = {"announced", "pulled", "verified", "complete",
                                             "applied"};
  std::vector<std::string> seen;
  for (const std::string& n : b) {
    if (std::find(expected.begin(), expected.end(), n) != expected.end()) seen.push_back(n);
  }
  REQUIRE(seen == expected);
  auto json =
      testing::RunCommand({testing::RunfilePath("client/refitctl"),
                           "--socket=" + fleet.trainer_node->socket(), "timeline", "m", "--json"});
  REQUIRE(json.exit_code == 0);
  auto versions = nlohmann::json::parse(json.out)["versions"];
  REQUIRE(versions.size() == 2);
  REQUIRE(versions[1]["nodes"].size() == 3);
}

}  // namespace refit
