// Two refitd processes on this machine acting as nodes, when something goes wrong or is watched
// mid-pull: a dead source leaves the engine on the previous version and it recovers when the
// source is back; a dead receiver doesn't stop the source serving another; a pull longer than
// its pin's lease renews it; SIGTERM mid-pull stops promptly; Status and `refitctl watch` show a
// pull in flight. Over UCX tcp or shared memory, as UCX_TLS says (the two variants in BUILD).

#include <signal.h>

#include <cstring>
#include <thread>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/two_nodes.h"

namespace refit {
namespace {

using client::SharedMemory;
using client::Slice;
using std::chrono::milliseconds;
using testing::BigModel;
using testing::DaemonProcess;
using testing::FillRandom;
using testing::FreePort;
using testing::ListenPort;
using testing::MakeShm;
using testing::Pair;
using testing::Registered;
using testing::RegisterWhole;
using testing::SharedMemoryTls;
using testing::StartSourceAndEngine;
using testing::TwoNodes;
using testing::WaitConnected;
using testing::WaitPulling;

TEST_CASE("a source killed mid-transfer leaves the engine on the previous version; it recovers",
          "[integration][two][failure]") {
  const int port = FreePort();
  const std::string listen = "--listen=127.0.0.1:" + std::to_string(port);
  auto source = DaemonProcess::Start({"--node=src", listen});
  REQUIRE(source.ok());
  // Small reads, one at a time, so that the pull takes long enough to be interrupted: 64 MiB
  // over tcp; over shared memory, where a read is a memcpy from the source's mapped slot,
  // 256 MiB in 4 KiB reads.
  const bool shm = SharedMemoryTls();
  auto engine =
      DaemonProcess::Start({"--node=dst", shm ? "--chunk-bytes=4096" : "--chunk-bytes=8192",
                            "--inflight=1", "--peers=127.0.0.1:" + std::to_string(port)});
  REQUIRE(engine.ok());
  const int64_t kBytes = shm ? 256 << 20 : 64 << 20;
  BigModel big(**source, **engine, kBytes);
  auto& inference = big.inference;

  big.Publish(1, 1);
  REQUIRE(inference.client->WaitForVersion("big", 1, milliseconds(60000)).ok());

  big.Publish(2, 2);
  // Kill the source once the pull of version 2 is under way.
  WaitPulling(*inference.client, 2);
  (*source)->Stop(SIGKILL);

  // Version 2 never shows: waiting for it times out, applying it is refused, 1 is intact.
  auto waited = inference.client->WaitForVersion("big", 2, milliseconds(3000));
  CHECK(waited.status().code() == absl::StatusCode::kDeadlineExceeded);
  const absl::Status refused = inference.client->Apply("big", 2, {inference.id}).status();
  CHECK(refused.code() == absl::StatusCode::kFailedPrecondition);
  // The error says why: the version was abandoned because the peer went away.
  INFO(refused.ToString());
  CHECK(refused.message().find("abandoned") != std::string::npos);
  CHECK(refused.message().find("UNAVAILABLE") != std::string::npos);
  auto applied = inference.client->Apply("big", 0, {inference.id});
  REQUIRE(applied.ok());
  CHECK(applied->version() == 1);
  CHECK(big.DestinationIs(1));
  auto status = inference.client->Status();
  REQUIRE(status.ok());
  REQUIRE(status->peers_size() == 1);
  CHECK_FALSE(status->peers(0).connected());
  REQUIRE(status->models_size() == 1);
  CHECK(status->models(0).abandoned_version() == 2);
  CHECK(status->models(0).abandoned_error().rfind("UNAVAILABLE", 0) == 0);
  // `refitctl watch` on a terminal says so too (script(1) gives it a pty).
  const std::string refitctl = testing::RunfilePath("client/refitctl");
  auto watched = testing::RunCommand({"/usr/bin/timeout", "2", "/usr/bin/script", "-qec",
                                      refitctl + " --socket=" + (*engine)->socket() + " watch big",
                                      "/dev/null"});
  INFO(watched.out);
  CHECK(watched.out.find("big version 2 abandoned: UNAVAILABLE") != std::string::npos);

  // The source comes back on the same address and publishes version 3.
  auto again = DaemonProcess::Start({"--node=src", listen});
  REQUIRE(again.ok());
  auto trainer2 = RegisterWhole(**again, v1::SOURCE, big.src, kBytes);
  std::memset(big.src.data(), 3, kBytes);
  REQUIRE(trainer2.client->Publish("big", 3, {trainer2.id}).ok());
  auto recovered = inference.client->WaitForVersion("big", 3, milliseconds(60000));
  REQUIRE(recovered.ok());
  CHECK(*recovered == 3);
  REQUIRE(inference.client->Apply("big", 3, {inference.id}).ok());
  CHECK(big.DestinationIs(3));
  status = inference.client->Status();
  REQUIRE(status.ok());
  CHECK(status->models(0).abandoned_version() == 0);  // a newer version completed since
}

TEST_CASE("a pull longer than its pin's lease renews it: retention can't recycle the slot",
          "[integration][two][failure]") {
  // The source keeps one version; the engine pins with a 2 s lease, renewed every 0.5 s, and
  // pulls 32 MiB in 4 KiB reads, one at a time, each read waiting 1 ms first (test build:
  // REFIT_FAULT_READ_PACE_US): at least 8 s, four leases, however fast the machine. (It used to
  // be 256 MiB unpaced with a 0.5 s lease, which the source raised to its 1 s minimum: on a
  // loaded machine a 1 s stall of the engine let the pin lapse, the source refused the rest and
  // version 1 was abandoned, so the case accepted either outcome.) A renewal may come up to
  // 1.5 s late before the pin lapses. Deltas off: the delta encoder would hold older snapshots.
  constexpr int64_t kBytes = 32 << 20;
  auto source = DaemonProcess::Start({"--node=src", "--retain=1", "--delta-threshold=0"});
  REQUIRE(source.ok());
  auto engine = DaemonProcess::Start(
      {"--node=dst", "--retain=10", "--chunk-bytes=4096", "--inflight=1", "--delta-threshold=0",
       "--peers=127.0.0.1:" + std::to_string(ListenPort(**source))},
      /*socket=*/"", {"REFIT_TEST_PIN_LEASE_MS=2000", "REFIT_FAULT_READ_PACE_US=1000"});
  REQUIRE(engine.ok());
  BigModel big(**source, **engine, kBytes);
  auto& inference = big.inference;
  big.Publish(1, 1);
  WaitPulling(*inference.client, 1);
  const auto pulling = std::chrono::steady_clock::now();
  // Newer versions drop version 1 from the source's store at once; only the engine's pin holds
  // its slot. Past the lease, more versions would take that slot from the pool and overwrite
  // it, had the pin lapsed.
  big.Publish(2, 2);
  std::this_thread::sleep_until(pulling + milliseconds(2500));  // past the lease
  auto status = inference.client->Status();
  REQUIRE(status.ok());
  bool still_pulling_1 = false;
  for (const auto& t : status->transfers()) still_pulling_1 |= t.version() == 1;
  REQUIRE(still_pulling_1);  // the pace makes the pull outlast the lease
  for (uint64_t v = 3; v <= 6; ++v) big.Publish(v, static_cast<int>(v));

  // Version 1 completes, bit-exact, and is never abandoned.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  bool held = false;
  while (!held && std::chrono::steady_clock::now() < deadline) {
    status = inference.client->Status();
    REQUIRE(status.ok());
    REQUIRE(status->models_size() == 1);
    const auto& m = status->models(0);
    INFO("abandoned " << m.abandoned_version() << ": " << m.abandoned_error());
    REQUIRE(m.abandoned_version() == 0);
    for (uint64_t v : m.versions()) held |= v == 1;
    if (!held) std::this_thread::sleep_for(milliseconds(50));
  }
  REQUIRE(held);
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - pulling).count();
  INFO("version 1's pull took about " << took << " s");
  CHECK(took > 4.0);  // two leases at least: renewed, not merely within one lease
  REQUIRE(inference.client->Apply("big", 1, {inference.id}).ok());
  CHECK(big.DestinationIs(1));
}

TEST_CASE("a receiver killed mid-transfer doesn't stop the source serving another",
          "[integration][two][failure]") {
  auto source = DaemonProcess::Start({"--node=src"});
  REQUIRE(source.ok());
  const std::string peers = "--peers=127.0.0.1:" + std::to_string(ListenPort(**source));
  auto doomed =
      DaemonProcess::Start({"--node=doomed", "--chunk-bytes=4096", "--inflight=1", peers});
  auto survivor = DaemonProcess::Start({"--node=survivor", peers});
  REQUIRE(doomed.ok());
  REQUIRE(survivor.ok());
  constexpr int64_t kBytes = 32 << 20;
  SharedMemory src = MakeShm(kBytes), d1 = MakeShm(kBytes), d2 = MakeShm(kBytes);
  FillRandom(src, 7);
  auto trainer = RegisterWhole(**source, v1::SOURCE, src, kBytes);
  auto r1 = RegisterWhole(**doomed, v1::DESTINATION, d1, kBytes);
  auto r2 = RegisterWhole(**survivor, v1::DESTINATION, d2, kBytes);
  WaitConnected(*r1.client, 1);
  WaitConnected(*r2.client, 1);

  REQUIRE(trainer.client->Publish("big", 1, {trainer.id}).ok());
  // Kill the receiver once bytes are flowing: UCX 1.13 can abort a process whose peer dies in
  // the middle of connection setup (openucx/ucx#8175), which is not what this test is about.
  bool flowing = false;
  for (int i = 0; i < 1000 && !flowing; ++i) {
    auto status = r1.client->Status();
    REQUIRE(status.ok());
    for (const auto& t : status->transfers()) flowing = flowing || t.bytes_done() > (1 << 20);
    if (!flowing) std::this_thread::sleep_for(milliseconds(10));
  }
  CHECK(flowing);
  (*doomed)->Stop(SIGKILL);
  REQUIRE(r2.client->WaitForVersion("big", 1, milliseconds(60000)).ok());
  REQUIRE(r2.client->Apply("big", 1, {r2.id}).ok());
  CHECK(std::memcmp(d2.data(), src.data(), kBytes) == 0);

  // And the source still publishes and serves.
  FillRandom(src, 8);
  REQUIRE(trainer.client->Publish("big", 2, {trainer.id}).ok());
  REQUIRE(r2.client->WaitForVersion("big", 2, milliseconds(60000)).ok());
  REQUIRE(r2.client->Apply("big", 2, {r2.id}).ok());
  CHECK(std::memcmp(d2.data(), src.data(), kBytes) == 0);
}

TEST_CASE("Status and refitctl show a pull in flight and each version completing",
          "[integration][two]") {
  Pair p = StartSourceAndEngine({}, {"--chunk-bytes=16384", "--inflight=1"});
  constexpr int64_t kBytes = 32 << 20;
  SharedMemory src = MakeShm(kBytes), dst = MakeShm(kBytes);
  auto s =
      p.trainer->RegisterBuffer("m", v1::SOURCE, src.name(), {Slice("w", v1::UINT8, {kBytes})});
  auto d = p.inference->RegisterBuffer("m", v1::DESTINATION, dst.name(),
                                       {Slice("w", v1::UINT8, {kBytes})});
  REQUIRE(s.ok());
  REQUIRE(d.ok());
  const std::string refitctl = testing::RunfilePath("client/refitctl");
  std::string watch_out;
  std::thread watch([&] {
    // Ends after its timeout (longer than the slow pull below): it only has to see version 1.
    auto r = testing::RunCommand({"/usr/bin/timeout", "20", refitctl,
                                  "--socket=" + p.engine->socket(), "watch", "m", "--json"});
    watch_out = r.out;
  });
  std::this_thread::sleep_for(milliseconds(300));
  REQUIRE(p.trainer->Publish("m", 1, {*s}).ok());
  bool seen_in_flight = false;
  for (int i = 0; i < 400 && !seen_in_flight; ++i) {
    auto status = p.inference->Status();
    REQUIRE(status.ok());
    for (const auto& t : status->transfers()) {
      CHECK(t.model() == "m");
      CHECK(t.version() == 1);
      CHECK(t.bytes_total() == kBytes);
      seen_in_flight = seen_in_flight || (t.bytes_done() > 0 && t.bytes_done() < kBytes);
    }
    std::this_thread::sleep_for(milliseconds(10));
  }
  CHECK(seen_in_flight);
  REQUIRE(p.inference->WaitForVersion("m", 1, milliseconds(60000)).ok());
  auto after = p.inference->Status();
  REQUIRE(after.ok());
  CHECK(after->transfers_size() == 0);
  watch.join();
  CHECK(watch_out.find("{\"model\": \"m\", \"version\": 1, \"rollback\": false, \"run\": \"\"}") !=
        std::string::npos);
}

TEST_CASE("SIGTERM during a pull stops the receiver cleanly and promptly", "[integration][two]") {
  Pair p = StartSourceAndEngine({}, {"--chunk-bytes=4096", "--inflight=1"});
  constexpr int64_t kBytes = 64 << 20;
  SharedMemory src = MakeShm(kBytes), dst = MakeShm(kBytes);
  auto s =
      p.trainer->RegisterBuffer("m", v1::SOURCE, src.name(), {Slice("w", v1::UINT8, {kBytes})});
  auto d = p.inference->RegisterBuffer("m", v1::DESTINATION, dst.name(),
                                       {Slice("w", v1::UINT8, {kBytes})});
  REQUIRE(s.ok());
  REQUIRE(d.ok());
  REQUIRE(p.trainer->Publish("m", 1, {*s}).ok());
  std::this_thread::sleep_for(milliseconds(200));  // 16k reads of 4 KiB: still pulling
  p.inference.reset();
  const auto start = std::chrono::steady_clock::now();
  CHECK(p.engine->Stop(SIGTERM) == 0);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
  // The source is unharmed.
  auto status = p.trainer->Status();
  REQUIRE(status.ok());
  CHECK(status->models(0).latest_version() == 1);
}

}  // namespace
}  // namespace refit
