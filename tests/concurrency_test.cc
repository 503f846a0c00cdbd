// Concurrency against the real refitd: no reader ever sees a torn version, and several clients
// work at once while refitctl polls the daemon.

#include <atomic>
#include <cstring>
#include <thread>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/required.h"

namespace refit {
namespace {

using client::SharedMemory;
using client::Slice;
using std::chrono::milliseconds;
using testing::MakeShm;

TEST_CASE("no reader sees a torn version", "[integration][concurrency]") {
  auto daemon = testing::DaemonProcess::Start({"--retain=3"});
  REQUIRE(daemon.ok());
  auto trainer = (*daemon)->Connect();
  REQUIRE(trainer.ok());

  // Two trainer ranks, each holding half of one tensor; a version is complete only when both
  // halves are in, so a torn read would show two patterns.
  constexpr int64_t kRows = 512, kCols = 1024;  // 1 MiB of uint8 per rank
  SharedMemory rank0 = MakeShm("c", kRows * kCols), rank1 = MakeShm("c", kRows * kCols);
  auto r0 = (*trainer)->RegisterBuffer(
      "m", v1::SOURCE, rank0.name(),
      {Slice("w", v1::UINT8, {2 * kRows, kCols}, 0, {0, 0}, {kRows, kCols})});
  auto r1 = (*trainer)->RegisterBuffer(
      "m", v1::SOURCE, rank1.name(),
      {Slice("w", v1::UINT8, {2 * kRows, kCols}, 0, {kRows, 0}, {kRows, kCols})});
  REQUIRE(r0.ok());
  REQUIRE(r1.ok());

  constexpr int kReaders = 3;
  constexpr uint64_t kVersions = 60;
  std::atomic<bool> done{false};
  std::atomic<int> applies{0};
  std::vector<std::thread> readers;
  std::atomic<int> torn{0};
  for (int r = 0; r < kReaders; ++r) {
    readers.emplace_back([&] {
      auto engine = (*daemon)->Connect();
      REQUIRE(engine.ok());
      SharedMemory dst = MakeShm("c", 2 * kRows * kCols);
      auto d = (*engine)->RegisterBuffer("m", v1::DESTINATION, dst.name(),
                                         {Slice("w", v1::UINT8, {2 * kRows, kCols})});
      REQUIRE(d.ok());
      while (!done.load()) {
        auto applied = (*engine)->Apply("m", 0, {*d});
        if (!applied.ok()) {
          REQUIRE(applied.status().code() == absl::StatusCode::kFailedPrecondition);
          continue;  // nothing complete yet
        }
        const uint8_t expected = static_cast<uint8_t>(applied->version());
        const uint8_t* p = dst.data();
        if (!std::all_of(p, p + dst.size(), [&](uint8_t x) { return x == expected; })) {
          torn++;
        }
        applies++;
      }
    });
  }
  for (uint64_t v = 1; v <= kVersions; ++v) {
    std::memset(rank0.data(), static_cast<int>(v), rank0.size());
    std::memset(rank1.data(), static_cast<int>(v), rank1.size());
    REQUIRE((*trainer)->Publish("m", v, {*r0}).ok());
    std::this_thread::yield();
    REQUIRE((*trainer)->Publish("m", v, {*r1}).ok());
  }
  // Let the readers see the last version a few times.
  REQUIRE((*trainer)->WaitForVersion("m", kVersions, milliseconds(5000)).ok());
  std::this_thread::sleep_for(milliseconds(100));
  done = true;
  for (auto& t : readers) t.join();
  CHECK(torn.load() == 0);
  CHECK(applies.load() > kReaders);
}

TEST_CASE("four clients register, publish and apply at once while refitctl polls",
          "[integration][concurrency]") {
  auto daemon = testing::DaemonProcess::Start();
  REQUIRE(daemon.ok());
  const std::string refitctl = testing::RunfilePath("client/refitctl");
  std::atomic<bool> done{false};
  std::atomic<int> polls{0}, poll_failures{0};
  std::thread poller([&] {
    while (!done.load()) {
      auto result =
          testing::RunCommand({refitctl, "--socket=" + (*daemon)->socket(), "status", "--json"});
      if (result.exit_code != 0 || result.out.find("\"node\"") == std::string::npos) {
        poll_failures++;
        UNSCOPED_INFO("refitctl exit " << result.exit_code << ": " << result.err << result.out);
      }
      polls++;
    }
  });

  constexpr int kClients = 4;
  std::vector<std::thread> clients;
  std::atomic<int> verified{0};
  for (int c = 0; c < kClients; ++c) {
    clients.emplace_back([&, c] {
      auto client = (*daemon)->Connect();
      REQUIRE(client.ok());
      const std::string model = "model-" + std::to_string(c);
      const uint64_t bytes = 256 * 1024 * (c + 1);
      SharedMemory src = MakeShm("c", bytes), dst = MakeShm("c", bytes);
      auto s = (*client)->RegisterBuffer(model, v1::SOURCE, src.name(),
                                         {Slice("w", v1::BF16, {int64_t(bytes / 2)})});
      auto d = (*client)->RegisterBuffer(model, v1::DESTINATION, dst.name(),
                                         {Slice("w", v1::BF16, {int64_t(bytes / 2)})});
      REQUIRE(s.ok());
      REQUIRE(d.ok());
      for (uint64_t v = 1; v <= 15; ++v) {
        std::memset(src.data(), static_cast<int>(v * 16 + c), bytes);
        REQUIRE((*client)->Publish(model, v, {*s}).ok());
        auto applied = (*client)->Apply(model, 0, {*d});
        REQUIRE(applied.ok());
        REQUIRE(applied->version() == v);
        REQUIRE(std::memcmp(src.data(), dst.data(), bytes) == 0);
        verified++;
      }
      REQUIRE((*client)->ReleaseBuffer(*s).ok());
      REQUIRE((*client)->ReleaseBuffer(*d).ok());
    });
  }
  for (auto& t : clients) t.join();
  done = true;
  poller.join();
  CHECK(verified.load() == kClients * 15);
  CHECK(polls.load() >= 1);
  CHECK(poll_failures.load() == 0);

  auto client = (*daemon)->Connect();
  REQUIRE(client.ok());
  auto status = (*client)->Status();
  REQUIRE(status.ok());
  CHECK(status->models_size() == kClients);
  for (const auto& m : status->models()) {
    CHECK(m.latest_version() == 15);
    CHECK(m.source_buffers() == 0);  // released
  }
}

}  // namespace
}  // namespace refit
