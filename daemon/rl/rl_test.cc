#include <catch2/catch.hpp>
#include <chrono>
#include <string>
#include <thread>

#include "daemon/rl/labels.h"
#include "daemon/rl/staleness.h"
#include "daemon/rl/timeline.h"

namespace refit::rl {
namespace {

TEST_CASE("labels: at most 1 KiB of keys and values, no empty key") {
  Labels ok{{"step", "17"}, {"run", std::string(1024 - 4 - 2 - 3, 'x')}};
  CHECK(CheckLabels(ok).ok());
  ok["a"] = "";  // one byte more
  const absl::Status over = CheckLabels(ok);
  CHECK(over.code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(over.message()).find("1025 bytes") != std::string::npos);
  CHECK(CheckLabels({{"", "v"}}).code() == absl::StatusCode::kInvalidArgument);
  CHECK(CheckLabels({}).ok());
}

TEST_CASE("labels: kept per version, the newest 16, first publisher wins") {
  VersionLabels table;
  CHECK(table.SetIfAbsent("m", 1, {{"step", "1"}}));
  CHECK_FALSE(table.SetIfAbsent("m", 1, {{"step", "other"}}));
  CHECK(table.Get("m", 1).at("step") == "1");
  CHECK(table.Get("m", 2).empty());
  CHECK(table.Get("other", 1).empty());
  for (uint64_t v = 2; v <= 20; ++v) table.Set("m", v, {{"step", std::to_string(v)}});
  auto recent = table.Recent("m");
  REQUIRE(recent.size() == VersionLabels::kKeepVersions);
  CHECK(recent.front().first == 5);
  CHECK(recent.back().first == 20);
  table.Erase("m", 20);
  CHECK(table.Get("m", 20).empty());
  table.Set("m", 19, {});
  CHECK(table.Get("m", 19).empty());
}

TEST_CASE("timeline: stages in order, repeats dropped, newest 8 versions kept") {
  Timeline timeline;
  timeline.Record("m", 1, kStagePublished, 100, 200, "by pid 1");
  timeline.Mark("m", 1, kStageAnnounced, "by t");
  timeline.Mark("m", 1, kStageAnnounced, "by t");      // repeated: dropped
  timeline.Record("m", 1, kStageComplete, 300, 250);   // end before start: a point
  timeline.Record("m", 1, kStageQuantized, 150, 160);  // sorted by start
  auto got = timeline.Get("m", 1);
  REQUIRE(got.size() == 1);
  REQUIRE(got[0].stages.size() == 4);
  CHECK(got[0].stages[0].stage == kStagePublished);
  CHECK(got[0].stages[0].end_us == 200);
  CHECK(got[0].stages[1].stage == kStageQuantized);
  CHECK(got[0].stages[2].stage == kStageComplete);
  CHECK(got[0].stages[2].end_us == 300);
  CHECK(got[0].stages[3].stage == kStageAnnounced);
  timeline.Mark("m", 0, kStageComplete);  // version 0: nothing
  for (uint64_t v = 2; v <= 12; ++v) timeline.Mark("m", v, kStageComplete);
  auto all = timeline.Get("m");
  REQUIRE(all.size() == Timeline::kKeepVersions);
  CHECK(all.front().version == 5);
  timeline.Mark("m", 3, kStageApplied);  // older than every version kept: not recorded
  CHECK(timeline.Get("m", 3).empty());
  for (int i = 0; i < 100; ++i) timeline.Mark("m", 12, kStageApplied, std::to_string(i));
  CHECK(timeline.Get("m", 12)[0].stages.size() == Timeline::kMaxStages);
}

TEST_CASE("staleness: replicas more than k behind the newest published are stale") {
  CHECK_FALSE(IsStale({0, 10}, 1));  // no budget
  CHECK_FALSE(IsStale({2, 10}, 8));
  CHECK(IsStale({2, 10}, 7));
  CHECK_FALSE(IsStale({2, 10}, 12));  // ahead (a new run)
  auto now = fleet::ReplicaTable::Clock::now();
  fleet::ReplicaTable replicas([&now] { return now; });
  Metrics metrics;
  Staleness staleness("a", &replicas, &metrics, std::chrono::milliseconds(10));
  REQUIRE(replicas.Report("a", true, {{"m", 3}}).ok());
  REQUIRE(replicas.Report("b", true, {{"m", 6}}).ok());
  staleness.NotePublished("m", 6, 2);
  auto states = staleness.Replicas("m");
  REQUIRE(states.size() == 2);
  CHECK(states[0].stale);
  CHECK_FALSE(states[1].stale);
  CHECK(staleness.NodeStale("m"));
  CHECK(staleness.Of("m").published == 6);
  staleness.Start();
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  CHECK(metrics.Get("refit_stale_replicas") == 1);
  CHECK(metrics.Get("refit_stale_models") == 1);
  CHECK(metrics.Get("refit_stale_seconds_total") > 0.05);
  REQUIRE(replicas.Report("a", true, {{"m", 5}}).ok());
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  CHECK_FALSE(staleness.NodeStale("m"));
  CHECK(metrics.Get("refit_stale_replicas") == 0);
  CHECK(metrics.Get("refit_stale_models") == 0);
  const double spent = metrics.Get("refit_stale_seconds_total");
  std::this_thread::sleep_for(std::chrono::milliseconds(60));
  CHECK(metrics.Get("refit_stale_seconds_total") == spent);
  staleness.Stop();
}

}  // namespace
}  // namespace refit::rl
