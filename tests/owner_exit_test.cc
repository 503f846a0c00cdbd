// Owner exit (issue 18): a buffer is released within 5 s after the process that registered it
// exits; its published versions stay held; a version in flight that needed it is abandoned
// with a message naming it; the successor's next version completes. And `refitctl release`.
// The dead processes are real ones (tests/testing/as_client), SIGKILLed or ending without
// releasing anything.

#include <signal.h>

#include <chrono>
#include <cstring>
#include <string>
#include <thread>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "tests/testing/daemon_process.h"

namespace refit {
namespace {

using client::SharedMemory;
using client::Slice;
using testing::ChildProcess;
using testing::DaemonProcess;
using Clock = std::chrono::steady_clock;

constexpr int64_t kRows = 256, kCols = 1024;  // as_client's tensor "w": bf16, 512 KiB
constexpr uint64_t kBytes = kRows * kCols * 2;

// as_client holding a buffer of `model`: registered (and published `version` when SOURCE).
std::unique_ptr<ChildProcess> Hold(const DaemonProcess& daemon, const std::string& role,
                                   const std::string& model, uint64_t version,
                                   std::string* buffer_id) {
  auto child = ChildProcess::Spawn({testing::RunfilePath("tests/testing/as_client"),
                                    daemon.socket(), "hold", role, model, std::to_string(version)});
  REQUIRE(child.ok());
  auto line = (*child)->ReadLine();
  REQUIRE(line.ok());
  INFO(*line);
  REQUIRE(line->rfind("OK ", 0) == 0);
  *buffer_id = line->substr(3);
  return std::move(child).value();
}

const v1::ModelStatus* FindModel(const v1::StatusResponse& status, const std::string& model) {
  for (const v1::ModelStatus& m : status.models()) {
    if (m.model() == model) return &m;
  }
  return nullptr;
}

// Seconds until `model` has `sources` SOURCE and `destinations` DESTINATION buffers on the
// daemon; -1 past 10 s.
double SecondsUntilBuffers(client::Client& c, const std::string& model, uint32_t sources,
                           uint32_t destinations) {
  const auto start = Clock::now();
  while (Clock::now() - start < std::chrono::seconds(10)) {
    auto status = c.Status();
    REQUIRE(status.ok());
    const v1::ModelStatus* m = FindModel(*status, model);
    const uint32_t s = m ? m->source_buffers() : 0, d = m ? m->destination_buffers() : 0;
    if (s == sources && d == destinations) {
      return std::chrono::duration<double>(Clock::now() - start).count();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return -1;
}

double Metric(client::Client& c, const std::string& name) {
  auto status = c.Status();
  REQUIRE(status.ok());
  auto it = status->metrics().find(name);
  return it == status->metrics().end() ? -1 : it->second;
}

SharedMemory Make(const std::string& tag, int fill) {
  auto shm = SharedMemory::Create(testing::UniqueShmName(tag), kBytes);
  REQUIRE(shm.ok());
  std::memset(shm->data(), fill, kBytes);
  return std::move(shm).value();
}

}  // namespace

TEST_CASE("a killed trainer's buffer is released; its versions stay; the successor completes",
          "[integration][liveness]") {
  auto daemon = DaemonProcess::Start();
  REQUIRE(daemon.ok());
  auto c = (*daemon)->Connect();
  REQUIRE(c.ok());
  auto& engine = **c;

  std::string dead_id;
  auto trainer = Hold(**daemon, "SOURCE", "m", 1, &dead_id);
  auto dst = Make("owner-dst", 0);
  auto dst_id = engine.RegisterBuffer("m", v1::DESTINATION, dst.name(),
                                      {Slice("w", v1::BF16, {kRows, kCols}, 0)}, "engine");
  REQUIRE(dst_id.ok());
  REQUIRE(engine.WaitForVersion("m", 1, std::chrono::seconds(10)).ok());

  const double before = Metric(engine, "refit_owner_exit_releases_total");
  REQUIRE(trainer->Stop(SIGKILL) == 128 + SIGKILL);
  const double seconds = SecondsUntilBuffers(engine, "m", 0, 1);
  INFO("released after " << seconds << " s");
  REQUIRE(seconds >= 0);
  REQUIRE(seconds < 5);
  REQUIRE(Metric(engine, "refit_owner_exit_releases_total") == before + 1);
  // Its buffer is gone; its published version is not.
  REQUIRE(engine.ReleaseBuffer(dead_id).code() == absl::StatusCode::kNotFound);
  auto applied = engine.Apply("m", 1, {*dst_id});
  REQUIRE(applied.ok());
  for (uint64_t i = 0; i < kBytes; ++i) REQUIRE(dst.data()[i] == 0x5a);

  // The successor (same layout) publishes the next version, and it completes.
  auto src = Make("owner-src", 0x11);
  auto successor = engine.RegisterBuffer("m", v1::SOURCE, src.name(),
                                         {Slice("w", v1::BF16, {kRows, kCols}, 0)}, "successor");
  REQUIRE(successor.ok());
  REQUIRE(engine.Publish("m", 2, {*successor}).ok());
  auto v2 = engine.WaitForVersion("m", 2, std::chrono::seconds(5));
  REQUIRE(v2.ok());
  REQUIRE(*v2 == 2);
  REQUIRE(engine.Apply("m", 2, {*dst_id}).ok());
  REQUIRE(std::memcmp(dst.data(), src.data(), kBytes) == 0);
  REQUIRE((*daemon)->running());
}

TEST_CASE("a version in flight that needed a dead rank's buffer is abandoned, naming it",
          "[integration][liveness]") {
  auto daemon = DaemonProcess::Start();
  REQUIRE(daemon.ok());
  auto c = (*daemon)->Connect();
  REQUIRE(c.ok());
  auto& rank0 = **c;

  // Rank 0 (this process) holds tensor "a"; rank 1 (as_client) holds "w".
  auto a = Make("owner-a", 0x01);
  auto a_id = rank0.RegisterBuffer("m", v1::SOURCE, a.name(),
                                   {Slice("a", v1::BF16, {kRows, kCols}, 0)}, "rank0");
  REQUIRE(a_id.ok());
  std::string rank1_id;
  auto rank1 = Hold(**daemon, "SOURCE", "m", 1, &rank1_id);
  REQUIRE(rank0.Publish("m", 1, {*a_id}).ok());
  REQUIRE(rank0.WaitForVersion("m", 1, std::chrono::seconds(10)).ok());

  // Rank 0 publishes 2; rank 1 dies before it does: 2 can never be whole.
  REQUIRE(rank0.Publish("m", 2, {*a_id}).ok());
  rank1->CloseStdin();  // it ends without releasing anything
  REQUIRE(rank1->Stop(0) == 0);
  REQUIRE(SecondsUntilBuffers(rank0, "m", 1, 0) >= 0);
  auto status = rank0.Status();
  REQUIRE(status.ok());
  const v1::ModelStatus* m = FindModel(*status, "m");
  REQUIRE(m != nullptr);
  REQUIRE(m->latest_version() == 1);
  REQUIRE(m->abandoned_version() == 2);
  INFO(m->abandoned_error());
  REQUIRE(m->abandoned_error().find(rank1_id) != std::string::npos);
  REQUIRE(m->abandoned_error().find("exited") != std::string::npos);
  auto waited = rank0.WaitForVersion("m", 2, std::chrono::milliseconds(500));
  REQUIRE(waited.status().code() == absl::StatusCode::kDeadlineExceeded);
  REQUIRE(std::string(waited.status().message()).find("abandoned") != std::string::npos);
  REQUIRE(Metric(rank0, "refit_versions_abandoned_total") == 1);

  // The successor of rank 1 registers "w" again; version 3 completes with both ranks.
  auto w = Make("owner-w", 0x33);
  auto w_id = rank0.RegisterBuffer("m", v1::SOURCE, w.name(),
                                   {Slice("w", v1::BF16, {kRows, kCols}, 0)}, "rank1-successor");
  REQUIRE(w_id.ok());
  REQUIRE(rank0.Publish("m", 3, {*a_id}).ok());
  REQUIRE(rank0.Publish("m", 3, {*w_id}).ok());
  auto v3 = rank0.WaitForVersion("m", 3, std::chrono::seconds(5));
  REQUIRE(v3.ok());
  REQUIRE(*v3 == 3);
}

TEST_CASE("a dead engine's destination is released too; refitctl release",
          "[integration][liveness]") {
  auto daemon = DaemonProcess::Start();
  REQUIRE(daemon.ok());
  auto c = (*daemon)->Connect();
  REQUIRE(c.ok());
  auto& trainer = **c;
  auto src = Make("owner-rel-src", 0x42);
  auto src_id = trainer.RegisterBuffer("m", v1::SOURCE, src.name(),
                                       {Slice("w", v1::BF16, {kRows, kCols}, 0)}, "trainer");
  REQUIRE(src_id.ok());
  std::string engine_id;
  auto engine = Hold(**daemon, "DESTINATION", "m", 0, &engine_id);
  REQUIRE(SecondsUntilBuffers(trainer, "m", 1, 1) >= 0);
  REQUIRE(engine->Stop(SIGKILL) == 128 + SIGKILL);
  REQUIRE(SecondsUntilBuffers(trainer, "m", 1, 0) >= 0);

  // An operator releases a buffer by id; a second time it is gone.
  const std::string refitctl = testing::RunfilePath("client/refitctl");
  auto released =
      testing::RunCommand({refitctl, "--socket=" + (*daemon)->socket(), "release", *src_id});
  INFO(released.out << released.err);
  REQUIRE(released.exit_code == 0);
  REQUIRE(released.out.find("released") != std::string::npos);
  REQUIRE(SecondsUntilBuffers(trainer, "m", 0, 0) >= 0);
  auto again = testing::RunCommand(
      {refitctl, "--socket=" + (*daemon)->socket(), "release", *src_id, "--json"});
  REQUIRE(again.exit_code == 1);
  REQUIRE(again.err.find("does not exist") != std::string::npos);
  REQUIRE((*daemon)->running());
  REQUIRE(trainer.Status().ok());
}

TEST_CASE("a process refitd cannot watch holds its buffers on a lease the client renews",
          "[integration][liveness]") {
  // refitd in a pid namespace of its own: SO_PEERCRED says pid 0 for this test's processes,
  // as for a trainer pod beside a refitd pod without hostPID.
  auto daemon = DaemonProcess::Start(
      {}, "", {}, {"/usr/bin/unshare", "--pid", "--fork", "--kill-child", "--mount-proc"});
  REQUIRE(daemon.ok());
  auto c = (*daemon)->Connect();
  REQUIRE(c.ok());
  auto& engine = **c;
  auto dst = Make("lease-dst", 0);
  v1::RegisterBufferRequest request;
  request.set_model("m");
  request.set_role(v1::DESTINATION);
  request.mutable_memory()->mutable_host_shm()->set_name(dst.name());
  *request.add_tensors() = Slice("w", v1::BF16, {kRows, kCols}, 0);
  // refitd answers with a lease (it cannot watch this process); the client renews it.
  auto dst_id = engine.RegisterBuffer(request);
  REQUIRE(dst_id.ok());

  std::string trainer_id;
  auto trainer = Hold(**daemon, "SOURCE", "m", 1, &trainer_id);
  REQUIRE(engine.WaitForVersion("m", 1, std::chrono::seconds(10)).ok());
  // Past a whole lease (10 s), both are still there: their clients renew.
  std::this_thread::sleep_for(std::chrono::seconds(12));
  REQUIRE(SecondsUntilBuffers(engine, "m", 1, 1) >= 0);
  REQUIRE(Metric(engine, "refit_owner_exit_releases_total") == 0);

  // Dead, it renews no more: released within the lease.
  REQUIRE(trainer->Stop(SIGKILL) == 128 + SIGKILL);
  const auto start = Clock::now();
  double seconds = -1;
  while (Clock::now() - start < std::chrono::seconds(15)) {
    auto status = engine.Status();
    REQUIRE(status.ok());
    const v1::ModelStatus* m = FindModel(*status, "m");
    if (m && m->source_buffers() == 0) {
      seconds = std::chrono::duration<double>(Clock::now() - start).count();
      REQUIRE(m->destination_buffers() == 1);  // the live engine's, renewed all along
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  INFO("released after " << seconds << " s");
  REQUIRE(seconds >= 0);
  REQUIRE(seconds < 11);
  REQUIRE(Metric(engine, "refit_owner_exit_releases_total") == 1);
  REQUIRE(engine.Apply("m", 1, {*dst_id}).ok());  // its published version stays
  REQUIRE(dst.data()[0] == 0x5a);
}

}  // namespace refit
