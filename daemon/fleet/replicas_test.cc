#include "daemon/fleet/replicas.h"

#include <catch2/catch.hpp>
#include <thread>

namespace refit::fleet {
namespace {
using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;
}  // namespace

TEST_CASE("replicas: reports, relays, and nodes that go silent", "[fleet]") {
  Clock::time_point now = Clock::now();
  ReplicaTable table([&] { return now; });
  REQUIRE(table.Report("e1", true, {{"m", 4}}).ok());
  REQUIRE(table.Report("e2", false, {{"m", 3}, {"other", 9}}).ok());
  auto replicas = table.ReplicasOf("m");
  REQUIRE(replicas.size() == 2);
  REQUIRE(replicas[0].node == "e1");
  REQUIRE(replicas[0].latest_version == 4);
  REQUIRE(replicas[1].latest_version == 3);
  REQUIRE(table.Relays("m") == std::vector<std::string>{"e1"});
  REQUIRE(table.ReplicasOf("nope").empty());
  now += kReplicaTtl + milliseconds(1);
  REQUIRE(table.ReplicasOf("m").empty());
  REQUIRE(table.Report("e2", true, {{"m", 5}}).ok());
  REQUIRE(table.Relays("m") == std::vector<std::string>{"e2"});
  table.Forget("e2");
  REQUIRE(table.ReplicasOf("m").empty());
}

TEST_CASE("replicas: WaitFor a quorum, all of them, and past the deadline", "[fleet]") {
  ReplicaTable table;
  REQUIRE(table.Report("e1", true, {{"m", 2}}).ok());
  REQUIRE(table.Report("e2", true, {{"m", 1}}).ok());
  auto one = table.WaitFor("m", 2, 1, Clock::now() + milliseconds(100), nullptr);
  REQUIRE(one.ok());
  REQUIRE(one->nodes == std::vector<std::string>{"e1"});
  auto late = table.WaitFor("m", 2, 0, Clock::now() + milliseconds(100), nullptr);
  REQUIRE(late.status().code() == absl::StatusCode::kDeadlineExceeded);
  REQUIRE(std::string(late.status().message()).find("e2 at 1") != std::string::npos);
  std::thread reporter([&] {
    std::this_thread::sleep_for(milliseconds(30));
    REQUIRE(table.Report("e2", true, {{"m", 3}}).ok());
  });
  auto all = table.WaitFor("m", 2, 0, Clock::now() + milliseconds(5000), nullptr);
  reporter.join();
  REQUIRE(all.ok());
  REQUIRE(all->nodes.size() == 2);
  REQUIRE(all->version == 2);
  auto none = table.WaitFor("unknown", 1, 0, Clock::now() + milliseconds(20), nullptr);
  REQUIRE(none.status().code() == absl::StatusCode::kDeadlineExceeded);
  REQUIRE(std::string(none.status().message()).find("no node") != std::string::npos);
  table.Shutdown();
  REQUIRE(table.WaitFor("m", 9, 1, Clock::now() + milliseconds(5000), nullptr).status().code() ==
          absl::StatusCode::kUnavailable);
}

}  // namespace refit::fleet

namespace refit::fleet {

TEST_CASE("replicas: several origins' member lists are merged, each model aging on its own",
          "[fleet]") {
  using std::chrono::milliseconds;
  std::chrono::steady_clock::time_point now = std::chrono::steady_clock::now();
  ReplicaTable table([&] { return now; });
  // Trainer node A serves model "a", trainer node B model "b"; each answers with what it knows
  // of engine e1: both models stay.
  REQUIRE(table.Merge("e1", true, {{"a", 3}}, "east").ok());
  REQUIRE(table.Merge("e1", true, {{"b", 7}}, "east").ok());
  REQUIRE(table.ReplicasOf("a").size() == 1);
  REQUIRE(table.ReplicasOf("a")[0].latest_version == 3);
  REQUIRE(table.ReplicasOf("a")[0].site == "east");
  REQUIRE(table.ReplicasOf("b").size() == 1);
  REQUIRE(table.RelaysBySite("b").at("east") == std::vector<std::string>{"e1"});
  // Only B keeps answering: "a" ages out, "b" stays.
  now += kReplicaTtl / 2;
  REQUIRE(table.Merge("e1", true, {{"b", 8}}, "east").ok());
  now += kReplicaTtl / 2 + milliseconds(1);
  REQUIRE(table.Merge("e1", true, {{"b", 9}}, "east").ok());
  REQUIRE(table.ReplicasOf("a").empty());
  REQUIRE(table.ReplicasOf("b").size() == 1);
  REQUIRE(table.ReplicasOf("b")[0].latest_version == 9);
  // The node's own report is the whole truth: it replaces what origins said.
  REQUIRE(table.Report("e1", true, {{"c", 1}}).ok());
  REQUIRE(table.ReplicasOf("b").empty());
  REQUIRE(table.ReplicasOf("c").size() == 1);
}

}  // namespace refit::fleet
