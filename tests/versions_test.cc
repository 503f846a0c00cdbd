// Which version engines hold (issue 32 item 4, issue 33 item 3), with real refitd processes on
// several nodes, real gRPC and UCX between them:
// - Rollback on an engine's node takes every engine node (and the trainer's) back to a retained
//   version: Watch delivers a rollback event, Apply(0) / WaitForVersion answer it, newer
//   versions are held back until Resume, WaitForReplicas counts the nodes once they applied it;
//   bad input (a version no longer retained, Resume of a model not held back, Apply of a newer
//   version while held, an engine that wrote into its buffer) gets its code and changes nothing.
// - Runs: a trainer's node restarted with --state-dir, a trainer resuming from an older step
//   under a new run with no manual command: the engine's node follows it (Watch names the run,
//   Status too) and applies the resumed versions bit-exact.

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstring>
#include <future>
#include <random>
#include <thread>
#include <vector>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/required.h"
#include "tests/testing/two_nodes.h"

namespace refit {
namespace {

using client::SharedMemory;
using client::Slice;
using std::chrono::milliseconds;
using testing::DaemonProcess;
using testing::ListenPort;
using testing::MakeShm;

constexpr int64_t kRows = 256, kCols = 512;  // bf16 [256, 512]: 256 KiB
constexpr uint64_t kBytes = kRows * kCols * 2;

std::vector<uint8_t> Fill(SharedMemory& shm, uint32_t seed) {
  std::mt19937_64 rng(seed);
  uint64_t* p = reinterpret_cast<uint64_t*>(shm.data());
  for (uint64_t i = 0; i < shm.size() / 8; ++i) p[i] = rng();
  return std::vector<uint8_t>(shm.data(), shm.data() + shm.size());
}

bool Same(const SharedMemory& shm, const std::vector<uint8_t>& bytes) {
  return std::memcmp(shm.data(), bytes.data(), bytes.size()) == 0;
}

v1::ModelStatus StatusOf(client::Client& c, const std::string& model) {
  auto s = testing::ModelStatusOf(c, model);
  REQUIRE(s.ok());
  return *s;
}

// Waits up to 20 s for `ok` to hold.
template <typename Ok>
bool Eventually(Ok ok) {
  for (int i = 0; i < 400; ++i) {
    if (ok()) return true;
    std::this_thread::sleep_for(milliseconds(50));
  }
  return ok();
}

// The next Watch event within 20 s (a failed REQUIRE otherwise).
v1::VersionEvent NextEvent(client::Watcher& watcher) {
  v1::VersionEvent event;
  auto next = std::async(std::launch::async, [&] { return watcher.Next(&event); });
  if (next.wait_for(std::chrono::seconds(20)) != std::future_status::ready) {
    watcher.Cancel();
    next.wait();
    FAIL("no Watch event within 20 s");
  }
  REQUIRE(next.get());
  return event;
}

bool KnowsModel(client::Client& c, const std::string& model) {
  return testing::ModelStatusOf(c, model).ok();
}

TEST_CASE("a rollback asked on one engine's node takes the fleet back, until Resume",
          "[integration][two]") {
  auto trainer_node = DaemonProcess::Start({"--node=trainer-node", "--retain=3"});
  REQUIRE(trainer_node.ok());
  const std::string peers = "--peers=127.0.0.1:" + std::to_string(ListenPort(**trainer_node));
  auto engine_a = DaemonProcess::Start({"--node=engine-a", "--retain=3", peers});
  auto engine_b = DaemonProcess::Start({"--node=engine-b", "--retain=3", peers});
  REQUIRE(engine_a.ok());
  REQUIRE(engine_b.ok());
  auto trainer = (*trainer_node)->Connect();
  auto ea = (*engine_a)->Connect();
  auto eb = (*engine_b)->Connect();
  REQUIRE(trainer.ok());
  REQUIRE(ea.ok());
  REQUIRE(eb.ok());

  SharedMemory src = MakeShm("rb-src", kBytes);
  auto s = (*trainer)->RegisterBuffer("m", v1::SOURCE, src, {Slice("w", v1::BF16, {kRows, kCols})},
                                      "trainer");
  REQUIRE(s.ok());
  REQUIRE(Eventually([&] { return KnowsModel(**ea, "m") && KnowsModel(**eb, "m"); }));
  SharedMemory dst_a = MakeShm("rb-a", kBytes);
  SharedMemory dst_b = MakeShm("rb-b", kBytes);
  auto da = (*ea)->RegisterBuffer("m", v1::DESTINATION, dst_a,
                                  {Slice("w", v1::BF16, {kRows, kCols})}, "engine-a");
  auto db = (*eb)->RegisterBuffer("m", v1::DESTINATION, dst_b,
                                  {Slice("w", v1::BF16, {kRows, kCols})}, "engine-b");
  REQUIRE(da.ok());
  REQUIRE(db.ok());

  std::vector<std::vector<uint8_t>> published(5);
  for (uint64_t v = 1; v <= 3; ++v) {
    published[v] = Fill(src, static_cast<uint32_t>(v));
    REQUIRE((*trainer)->Publish("m", v, {*s}).ok());
    for (auto* c : {&*ea, &*eb}) {
      auto got = (**c).WaitForVersion("m", v, milliseconds(20000));
      INFO(got.status().ToString());
      REQUIRE(got.ok());
    }
  }
  REQUIRE((*ea)->Apply("m", 3, {*da}).ok());
  REQUIRE((*eb)->Apply("m", 3, {*db}).ok());
  auto watch_b = (*eb)->Watch("m");
  REQUIRE(watch_b.ok());

  // Bad input first: nothing changes.
  auto too_old = (*ea)->Rollback("m", 7);
  REQUIRE_FALSE(too_old.ok());
  CHECK(too_old.status().code() == absl::StatusCode::kNotFound);
  CHECK(std::string(too_old.status().message()).find("oldest retained is 1") != std::string::npos);
  auto not_held = (*eb)->Resume("m");
  REQUIRE_FALSE(not_held.ok());
  CHECK(not_held.code() == absl::StatusCode::kFailedPrecondition);
  CHECK(StatusOf(**ea, "m").rollback_version() == 0);

  // Asked on engine A; engine B (which only the trainer's node connects to) follows.
  auto rolled = (*ea)->Rollback("m", 2);
  INFO(rolled.status().ToString());
  REQUIRE(rolled.ok());
  CHECK(*rolled == 2);
  v1::VersionEvent event = NextEvent(**watch_b);
  CHECK(event.version() == 2);
  CHECK(event.rollback());
  CHECK(StatusOf(**trainer, "m").rollback_version() == 2);
  CHECK(StatusOf(**ea, "m").rollback_version() == 2);
  CHECK(StatusOf(**eb, "m").rollback_version() == 2);

  // The fleet is not back until each engine applied it.
  REQUIRE(Eventually([&] {
    const auto m = StatusOf(**trainer, "m");
    int told = 0;
    for (const auto& r : m.replicas()) told += r.rollback_version() == 2 ? 1 : 0;
    return told == 2;
  }));
  auto early = (*trainer)->WaitForReplicas("m", 2, 0, milliseconds(300));
  CHECK(early.status().code() == absl::StatusCode::kDeadlineExceeded);
  // An engine that wrote into its buffer since: the rollback's Apply writes every byte.
  std::memset(dst_b.data(), 0x5a, 4096);
  auto ap_a = (*ea)->Apply("m", 0, {*da});
  auto ap_b = (*eb)->Apply("m", event.version(), {*db});
  REQUIRE(ap_a.ok());
  REQUIRE(ap_b.ok());
  CHECK(ap_a->version() == 2);
  CHECK(Same(dst_a, published[2]));
  CHECK(Same(dst_b, published[2]));
  auto back = (*trainer)->WaitForReplicas("m", 2, 0, milliseconds(20000));
  INFO(back.status().ToString());
  REQUIRE(back.ok());
  CHECK(back->nodes_size() == 2);
  CHECK(back->version() == 2);

  // Newer versions are held back: WaitForVersion doesn't move, an explicit newer Apply is
  // refused and changes nothing; the pull itself continues into retention.
  published[4] = Fill(src, 4);
  REQUIRE((*trainer)->Publish("m", 4, {*s}).ok());
  REQUIRE(Eventually([&] {
    const auto m = StatusOf(**eb, "m");
    return m.latest_version() == 4;
  }));
  auto waited = (*eb)->WaitForVersion("m", 3, milliseconds(500));
  CHECK(waited.status().code() == absl::StatusCode::kDeadlineExceeded);
  auto target = (*eb)->WaitForTarget("m", 1, "", milliseconds(2000));
  REQUIRE(target.ok());
  CHECK(target->version() == 2);
  CHECK(target->rollback());
  auto refused = (*eb)->Apply("m", 4, {*db});
  REQUIRE_FALSE(refused.ok());
  CHECK(refused.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(Same(dst_b, published[2]));
  // The target is kept beside --retain newer ones.
  const auto held = StatusOf(**eb, "m");
  CHECK(std::find(held.versions().begin(), held.versions().end(), 2u) != held.versions().end());

  // Resume (asked on the trainer's node this time): the newest version is the target again.
  REQUIRE((*trainer)->Resume("m").ok());
  event = NextEvent(**watch_b);
  CHECK(event.version() == 4);
  CHECK_FALSE(event.rollback());
  REQUIRE(Eventually([&] { return StatusOf(**ea, "m").rollback_version() == 0; }));
  auto ap4 = (*eb)->Apply("m", 0, {*db});
  REQUIRE(ap4.ok());
  CHECK(ap4->version() == 4);
  CHECK(Same(dst_b, published[4]));
  auto again = (*ea)->Resume("m");
  CHECK(again.code() == absl::StatusCode::kFailedPrecondition);

  // refitctl speaks both.
  const std::string refitctl = testing::RunfilePath("client/refitctl");
  auto out =
      testing::RunCommand({refitctl, "--socket=" + (*engine_a)->socket(), "rollback", "m", "3"});
  INFO(out.out << out.err);
  CHECK(out.exit_code == 0);
  CHECK(out.out.find("rolled back to version 3") != std::string::npos);
  CHECK(Eventually([&] {
    out = testing::RunCommand({refitctl, "--socket=" + (*engine_b)->socket(), "status"});
    return out.out.find("rolled back to version 3") != std::string::npos;
  }));
  out = testing::RunCommand({refitctl, "--socket=" + (*engine_b)->socket(), "rollback", "m", "1"});
  CHECK(out.exit_code == 1);
  CHECK(out.err.find("oldest retained is") != std::string::npos);
  // Version 1 was dropped by --retain: NOT_FOUND over gRPC too, naming the oldest retained; the
  // rollback in force and the engine's bytes stay as they were.
  auto dropped = (*eb)->Rollback("m", 1);
  REQUIRE_FALSE(dropped.ok());
  CHECK(dropped.status().code() == absl::StatusCode::kNotFound);
  CHECK(std::string(dropped.status().message()).find("oldest retained is ") != std::string::npos);
  CHECK(StatusOf(**eb, "m").rollback_version() == 3);
  CHECK(Same(dst_b, published[4]));
  out = testing::RunCommand({refitctl, "--socket=" + (*engine_b)->socket(), "resume", "m"});
  CHECK(out.exit_code == 0);
  out = testing::RunCommand({refitctl, "--socket=" + (*engine_b)->socket(), "resume", "m"});
  CHECK(out.exit_code == 1);
}

TEST_CASE("Apply racing a Rollback: every Apply is whole, and after it Apply(0) is the rollback's",
          "[integration]") {
  auto node = DaemonProcess::Start({"--node=solo", "--retain=3"});
  REQUIRE(node.ok());
  auto c = (*node)->Connect();
  REQUIRE(c.ok());
  SharedMemory src = MakeShm("race-src", kBytes);
  SharedMemory dst = MakeShm("race-dst", kBytes);
  auto s =
      (*c)->RegisterBuffer("m", v1::SOURCE, src, {Slice("w", v1::BF16, {kRows, kCols})}, "trainer");
  auto d = (*c)->RegisterBuffer("m", v1::DESTINATION, dst, {Slice("w", v1::BF16, {kRows, kCols})},
                                "engine");
  REQUIRE(s.ok());
  REQUIRE(d.ok());
  std::vector<std::vector<uint8_t>> published(4);
  for (uint64_t v = 1; v <= 3; ++v) {
    published[v] = Fill(src, static_cast<uint32_t>(100 + v));
    REQUIRE((*c)->Publish("m", v, {*s}).ok());
  }
  REQUIRE((*c)->WaitForVersion("m", 3, milliseconds(20000)).ok());
  std::atomic<bool> stop{false};
  std::vector<uint64_t> versions;
  int failures = 0, torn = 0;
  std::thread engine([&] {
    while (!stop) {
      auto r = (*c)->Apply("m", 0, {*d});
      if (!r.ok()) {
        ++failures;
        continue;
      }
      versions.push_back(r->version());
      if (r->version() > 3 || !Same(dst, published[r->version()])) ++torn;
    }
  });
  std::this_thread::sleep_for(milliseconds(100));
  auto rolled = (*c)->Rollback("m", 2);
  std::this_thread::sleep_for(milliseconds(200));
  stop = true;
  engine.join();
  REQUIRE(rolled.ok());
  CHECK(failures == 0);
  CHECK(torn == 0);
  REQUIRE_FALSE(versions.empty());
  CHECK(versions.back() == 2);
  // Once the rollback's version was applied, no Apply(0) went back to the newer one.
  auto first2 = std::find(versions.begin(), versions.end(), 2u);
  REQUIRE(first2 != versions.end());
  CHECK(std::count(first2, versions.end(), 3u) == 0);
  CHECK(Same(dst, published[2]));
  auto status = StatusOf(**c, "m");
  REQUIRE(status.buffers_size() == 2);
  for (const auto& b : status.buffers()) {
    if (b.role() == v1::DESTINATION) CHECK(b.applied_version() == 2);
  }
}

TEST_CASE("a trainer resumed from an older step under a new run, on a restarted node, is followed",
          "[integration][two]") {
  char tmpl[] = "/tmp/refit-versions-XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  const std::string state = std::string(tmpl) + "/state";
  auto first = DaemonProcess::Start({"--node=trainer-node", "--state-dir=" + state});
  REQUIRE(first.ok());
  const int port = ListenPort(**first);
  const std::string socket = (*first)->socket();
  auto engine_node =
      DaemonProcess::Start({"--node=engine-node", "--peers=127.0.0.1:" + std::to_string(port)});
  REQUIRE(engine_node.ok());
  auto engine = (*engine_node)->Connect();
  REQUIRE(engine.ok());

  SharedMemory src = MakeShm("run-src", kBytes);
  SharedMemory dst = MakeShm("run-dst", kBytes);
  std::string d;
  {
    auto trainer = (*first)->Connect();
    REQUIRE(trainer.ok());
    (*trainer)->set_restart_timeout(milliseconds(0));
    auto s = (*trainer)->RegisterBuffer("m", v1::SOURCE, src,
                                        {Slice("w", v1::BF16, {kRows, kCols})}, "trainer");
    REQUIRE(s.ok());
    REQUIRE(Eventually([&] { return KnowsModel(**engine, "m"); }));
    auto dd = (*engine)->RegisterBuffer("m", v1::DESTINATION, dst,
                                        {Slice("w", v1::BF16, {kRows, kCols})}, "engine");
    REQUIRE(dd.ok());
    d = *dd;
    for (uint64_t v : {600, 601}) {
      Fill(src, static_cast<uint32_t>(v));
      REQUIRE((*trainer)->Publish("m", v, {*s}, "run-a").ok());
      auto got = (*engine)->WaitForVersion("m", v, milliseconds(20000));
      INFO(got.status().ToString());
      REQUIRE(got.ok());
    }
    REQUIRE((*engine)->Apply("m", 601, {d}).ok());
    CHECK(StatusOf(**engine, "m").run() == "run-a");
  }
  auto watch = (*engine)->Watch("m");
  REQUIRE(watch.ok());

  // The trainer's node goes down hard and comes back on the same address and --state-dir.
  CHECK((*first)->Stop(SIGKILL) == 128 + SIGKILL);
  first->reset();
  std::unique_ptr<DaemonProcess> second;
  for (int i = 0; i < 50 && !second; ++i) {
    auto restarted = DaemonProcess::Start({"--node=trainer-node", "--state-dir=" + state,
                                           "--listen=127.0.0.1:" + std::to_string(port)},
                                          socket);
    if (restarted.ok()) {
      second = std::move(restarted).value();
    } else {
      std::this_thread::sleep_for(milliseconds(200));  // the port may still be held a moment
    }
  }
  REQUIRE(second);
  auto trainer = second->Connect();
  REQUIRE(trainer.ok());
  auto s = (*trainer)->RegisterBuffer("m", v1::SOURCE, src, {Slice("w", v1::BF16, {kRows, kCols})},
                                      "trainer");
  REQUIRE(s.ok());

  // The same run may not reuse a number (remembered across the restart) ...
  auto reused = (*trainer)->Publish("m", 500, {*s});
  REQUIRE_FALSE(reused.ok());
  CHECK(reused.status().code() == absl::StatusCode::kFailedPrecondition);
  // ... a new run may: the resume from step 500, no drop anywhere.
  const std::vector<uint8_t> v500 = Fill(src, 500);
  auto resumed = (*trainer)->Publish("m", 500, {*s}, "run-b");
  INFO(resumed.status().ToString());
  REQUIRE(resumed.ok());
  v1::VersionEvent event = NextEvent(**watch);
  CHECK(event.version() == 500);
  CHECK(event.run() == "run-b");
  CHECK_FALSE(event.rollback());
  auto ap = (*engine)->Apply("m", 0, {d});
  REQUIRE(ap.ok());
  CHECK(ap->version() == 500);
  CHECK(Same(dst, v500));
  const auto m = StatusOf(**engine, "m");
  CHECK(m.run() == "run-b");
  CHECK(m.skipped_version() == 0);
  const std::string refitctl = testing::RunfilePath("client/refitctl");
  auto out = testing::RunCommand({refitctl, "--socket=" + (*engine_node)->socket(), "status"});
  CHECK(out.out.find("run: run-b (after run-a)") != std::string::npos);

  // The new run goes on under its own name (empty: the current run), as deltas or in full.
  const std::vector<uint8_t> v501 = Fill(src, 501);
  REQUIRE((*trainer)->Publish("m", 501, {*s}).ok());
  event = NextEvent(**watch);
  CHECK(event.version() == 501);
  CHECK(event.run() == "run-b");
  REQUIRE((*engine)->Apply("m", 501, {d}).ok());
  CHECK(Same(dst, v501));
  // WaitForVersion with the run the engine knew: answers with the new run's version at once.
  auto target = (*engine)->WaitForTarget("m", 602, "run-a", milliseconds(2000));
  REQUIRE(target.ok());
  CHECK(target->version() == 501);
  CHECK(target->run() == "run-b");
  // The run left is not taken back.
  auto back = (*trainer)->Publish("m", 700, {*s}, "run-a");
  REQUIRE_FALSE(back.ok());
  CHECK(back.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(StatusOf(**trainer, "m").run() == "run-b");
}

TEST_CASE("a rollback outlives a restarted refitd (--state-dir) until Resume",
          "[integration][restart]") {
  char tmpl[] = "/tmp/refit-hold-XXXXXX";
  REQUIRE(mkdtemp(tmpl) != nullptr);
  const std::string state = std::string(tmpl) + "/state";
  auto first = DaemonProcess::Start({"--node=one", "--state-dir=" + state, "--retain=3"});
  REQUIRE(first.ok());
  const std::string socket = (*first)->socket();
  SharedMemory src = MakeShm("hold-src", kBytes);
  SharedMemory dst = MakeShm("hold-dst", kBytes);
  const std::vector<v1::TensorSlice> layout = {Slice("w", v1::BF16, {kRows, kCols})};
  std::vector<uint8_t> v2;
  {
    auto c = (*first)->Connect();
    REQUIRE(c.ok());
    auto s = (*c)->RegisterBuffer("m", v1::SOURCE, src, layout, "trainer");
    auto d = (*c)->RegisterBuffer("m", v1::DESTINATION, dst, layout, "engine");
    REQUIRE(s.ok());
    REQUIRE(d.ok());
    for (uint64_t v : {1, 2, 3}) {
      const auto bytes = Fill(src, static_cast<uint32_t>(v));
      if (v == 2) v2 = bytes;
      REQUIRE((*c)->Publish("m", v, {*s}).ok());
    }
    REQUIRE((*c)->Rollback("m", 2).ok());
    auto ap = (*c)->Apply("m", 0, {*d});
    REQUIRE(ap.ok());
    CHECK(ap->version() == 2);
    CHECK(Same(dst, v2));
  }
  CHECK((*first)->Stop(SIGKILL) == 128 + SIGKILL);
  first->reset();

  // The same --state-dir: still held back to 2, before any buffer registers.
  auto second = DaemonProcess::Start({"--node=one", "--state-dir=" + state, "--retain=3"}, socket);
  REQUIRE(second.ok());
  auto c = (*second)->Connect();
  REQUIRE(c.ok());
  auto s = (*c)->RegisterBuffer("m", v1::SOURCE, src, layout, "trainer");
  auto d = (*c)->RegisterBuffer("m", v1::DESTINATION, dst, layout, "engine");
  REQUIRE(s.ok());
  REQUIRE(d.ok());
  CHECK(StatusOf(**c, "m").rollback_version() == 2);
  auto watch = (*c)->Watch("m");
  REQUIRE(watch.ok());
  v1::VersionEvent event = NextEvent(**watch);
  CHECK(event.version() == 2);
  CHECK(event.rollback());
  const std::vector<uint8_t> v4 = Fill(src, 4);
  REQUIRE((*c)->Publish("m", 4, {*s}).ok());
  REQUIRE(StatusOf(**c, "m").latest_version() == 4);
  // Newer versions stay held back: refused, the engine's buffer untouched.
  auto newer = (*c)->Apply("m", 4, {*d});
  CHECK(newer.status().code() == absl::StatusCode::kFailedPrecondition);
  auto target = (*c)->Apply("m", 0, {*d});
  CHECK(target.status().code() == absl::StatusCode::kFailedPrecondition);
  INFO(target.status().ToString());
  CHECK(std::string(target.status().message()).find("rolled back to version 2") !=
        std::string::npos);
  CHECK(Same(dst, v2));
  // Resume: the newest is the target again, and stays so across the next restart.
  REQUIRE((*c)->Resume("m").ok());
  auto ap = (*c)->Apply("m", 0, {*d});
  REQUIRE(ap.ok());
  CHECK(ap->version() == 4);
  CHECK(Same(dst, v4));
  CHECK((*second)->Stop(SIGKILL) == 128 + SIGKILL);
  second->reset();
  auto third = DaemonProcess::Start({"--node=one", "--state-dir=" + state, "--retain=3"}, socket);
  REQUIRE(third.ok());
  auto c3 = (*third)->Connect();
  REQUIRE(c3.ok());
  REQUIRE((*c3)->RegisterBuffer("m", v1::DESTINATION, dst, layout, "engine").ok());
  CHECK(StatusOf(**c3, "m").rollback_version() == 0);
  auto resumed = (*c3)->Resume("m");
  CHECK(resumed.code() == absl::StatusCode::kFailedPrecondition);
}

}  // namespace
}  // namespace refit
