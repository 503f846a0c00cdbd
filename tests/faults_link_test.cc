// Fault suite (issue 18): a link down mid-pull. Two refitd in two network namespaces
// (r18f-a-TAG, r18f-b-TAG) joined by veth, the trainer's side slowed with tc tbf so the pull is
// under way when `ip link set down` takes the link away for $REFIT_FAULTS_OUTAGE_S seconds
// (default 5; scripts/faults.sh: 30). The engine's node reports it within 3 s (a waiting
// client gets UNAVAILABLE, Status shows the version abandoned); after the link is back the next
// version arrives bit-exact (the reported time is asserted within a generous bound; the
// figure is for scripts/faults.sh). Needs root and iproute2: where namespaces can't be made the
// test FAILS (it is never silently green).

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/faults.h"
#include "tests/testing/two_hosts.h"

namespace refit {
namespace {

using client::SharedMemory;
using client::Slice;
using std::chrono::milliseconds;
using testing::Sh;
using testing::TwoHosts;

double OutageSeconds() {
  const char* s = std::getenv("REFIT_FAULTS_OUTAGE_S");
  return s && std::atof(s) > 0 ? std::atof(s) : 5;
}

}  // namespace

TEST_CASE("a link down mid-pull is reported within 3 s; the next version is exact",
          "[integration][faults][link]") {
  TwoHosts hosts("r18f");
  if (!hosts.ok) FAIL("network namespaces r18f-* could not be made (needs root and iproute2)");
  // The trainer's side sends the bytes: slow it so the pull is still under way.
  REQUIRE(Sh("ip netns exec " + hosts.a + " tc qdisc add dev " + hosts.device_a +
             " root tbf rate 40mbit burst 64kb latency 500ms") == 0);
  const testing::HostNodes nodes = testing::StartHostNodes(hosts);
  client::Client& trainer = *nodes.trainer;
  client::Client& engine = *nodes.engine;
  constexpr uint64_t kBytes = 32 << 20;  // about 7 s at 40 Mbit/s
  auto src = SharedMemory::Create(testing::UniqueShmName("link"), kBytes);
  auto dst = SharedMemory::Create(testing::UniqueShmName("link"), kBytes);
  REQUIRE(src.ok());
  REQUIRE(dst.ok());
  const std::vector<v1::TensorSlice> layout = {Slice("w", v1::BF16, {kBytes / 2})};
  auto s = trainer.RegisterBuffer("m", v1::SOURCE, src->name(), layout, "trainer");
  auto d = engine.RegisterBuffer("m", v1::DESTINATION, dst->name(), layout, "engine");
  REQUIRE(s.ok());
  REQUIRE(d.ok());

  // Version 1 arrives whole; version 2's pull is cut.
  testing::FillPattern(*src, 1);
  REQUIRE(trainer.Publish("m", 1, {*s}).ok());
  REQUIRE(engine.WaitForVersion("m", 1, milliseconds(60000)).ok());
  REQUIRE(engine.Apply("m", 1, {*d}).ok());
  REQUIRE(testing::HoldsPattern(*dst, 1));
  const double abandoned_before = testing::Metric(engine, "refit_versions_abandoned_total");

  testing::FillPattern(*src, 2);
  REQUIRE(trainer.Publish("m", 2, {*s}).ok());
  std::atomic<double> waiter_done{-1};
  absl::StatusOr<uint64_t> waited = absl::UnknownError("not answered");
  auto waiter_client = nodes.engine_node->Connect();
  REQUIRE(waiter_client.ok());
  std::thread waiter([&] {
    waited = (*waiter_client)->WaitForVersion("m", 2, milliseconds(120000));
    waiter_done = testing::Now();
  });
  // Under way: some bytes of version 2 have arrived.
  bool pulling = false;
  for (int i = 0; i < 1000 && !pulling; ++i) {
    auto status = engine.Status();
    REQUIRE(status.ok());
    for (const auto& t : status->transfers()) pulling |= t.version() == 2 && t.bytes_done() > 0;
    if (!pulling) std::this_thread::sleep_for(milliseconds(10));
  }
  REQUIRE(pulling);
  const double down = testing::Now();
  REQUIRE(Sh("ip -n " + hosts.a + " link set " + hosts.device_a + " down") == 0);
  // Reported: the waiting client's answer, or the version abandoned in Status.
  double reported = -1;
  std::string how;
  while (testing::Now() - down < OutageSeconds() && reported < 0) {
    if (waiter_done.load() > 0) {
      reported = waiter_done.load() - down;
      how = "waiting client: " + waited.status().ToString();
    } else if (testing::Metric(engine, "refit_versions_abandoned_total") > abandoned_before) {
      reported = testing::Now() - down;
      how = "abandoned in Status";
    }
    std::this_thread::sleep_for(milliseconds(20));
  }
  while (testing::Now() - down < OutageSeconds()) std::this_thread::sleep_for(milliseconds(50));
  REQUIRE(Sh("ip -n " + hosts.a + " link set " + hosts.device_a + " up") == 0);
  const double up = testing::Now();
  REQUIRE(Sh("ip netns exec " + hosts.a + " tc qdisc del dev " + hosts.device_a + " root") == 0);
  testing::PrintFigureText(
      "link_down_reported_after",
      absl::StrCat(reported, " s (", how, "); outage ", OutageSeconds(), " s"));
  CHECK(reported >= 0);
  CHECK(reported < 10);  // the goal, < 3 s, is a figure (scripts/faults.sh): machines get busy
  CHECK(testing::HoldsPattern(*dst, 1));  // nothing of the cut version applied

  // Recovery: the next version arrives bit-exact.
  testing::FillPattern(*src, 3);
  REQUIRE(trainer.Publish("m", 3, {*s}).ok());
  auto got = engine.WaitForVersion("m", 3, milliseconds(120000));
  INFO(got.status().ToString());
  REQUIRE(got.ok());
  testing::PrintFigureText("link_recovered_after_up", absl::StrCat(testing::Now() - up, " s"));
  REQUIRE(engine.Apply("m", 3, {*d}).ok());
  CHECK(testing::HoldsPattern(*dst, 3));
  waiter.join();
  // The client waiting for version 2 or newer is answered once the link is back: by version 2
  // (pulled again from the start when the peer reconnects) or 3.
  INFO(waited.status().ToString());
  CHECK(waited.ok());
  if (waited.ok()) CHECK((*waited == 2 || *waited == 3));
}

}  // namespace refit
