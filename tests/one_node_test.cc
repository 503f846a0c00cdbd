// One node, the real refitd: publish/apply round trips, snapshots, Watch, WaitForVersion and
// every status code of docs/api.md, driven through the C++ client library.

#include <cstring>
#include <random>
#include <thread>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "tests/testing/daemon_process.h"

namespace refit {
namespace {

using client::SharedMemory;
using client::Slice;
using std::chrono::milliseconds;
using testing::DaemonProcess;
using testing::UniqueShmName;

void Fill(SharedMemory& shm, uint32_t seed) {
  std::mt19937 rng(seed);
  for (uint64_t i = 0; i < shm.size(); ++i) shm.data()[i] = static_cast<uint8_t>(rng());
}

struct Node {
  Node() {
    auto started = DaemonProcess::Start({"--node=test-node"});
    REQUIRE(started.ok());
    daemon = std::move(started).value();
    auto connected = daemon->Connect();
    REQUIRE(connected.ok());
    client = std::move(connected).value();
  }
  SharedMemory Shm(uint64_t size) {
    auto shm = SharedMemory::Create(UniqueShmName("shm"), size);
    REQUIRE(shm.ok());
    return std::move(shm).value();
  }
  std::unique_ptr<DaemonProcess> daemon;
  std::unique_ptr<client::Client> client;
};

TEST_CASE("publish and apply round trip bit-exact across dtypes and layouts", "[integration]") {
  Node node;
  // Source: three tensors of different dtypes back to back.
  //   emb  bf16 [256, 64]   at 0        (32768 B)
  //   w    fp32 [64, 64]    at 32768    (16384 B)
  //   ids  int64 [100]      at 49152    (800 B)
  SharedMemory src = node.Shm(49152 + 800);
  Fill(src, 1);
  auto src_id = node.client->RegisterBuffer(
      "m", v1::SOURCE, src.name(),
      {Slice("emb", v1::BF16, {256, 64}, 0), Slice("w", v1::FP32, {64, 64}, 32768),
       Slice("ids", v1::INT64, {100}, 49152)},
      "trainer");
  REQUIRE(src_id.ok());

  // Destination: rows 128..256 of emb first, then w, then ids; with a 64-byte gap.
  SharedMemory dst = node.Shm(128 * 64 * 2 + 64 + 16384 + 800);
  std::memset(dst.data(), 0, dst.size());
  auto dst_id =
      node.client->RegisterBuffer("m", v1::DESTINATION, dst.name(),
                                  {Slice("emb", v1::BF16, {256, 64}, 0, {128, 0}, {128, 64}),
                                   Slice("w", v1::FP32, {64, 64}, 128 * 64 * 2 + 64),
                                   Slice("ids", v1::INT64, {100}, 128 * 64 * 2 + 64 + 16384)},
                                  "engine");
  REQUIRE(dst_id.ok());

  auto published = node.client->Publish("m", 1, {*src_id});
  REQUIRE(published.ok());
  CHECK(published->bytes() == src.size());
  REQUIRE(node.client->WaitForVersion("m", 1, milliseconds(5000)).ok());
  auto applied = node.client->Apply("m", 0, {*dst_id});
  REQUIRE(applied.ok());
  CHECK(applied->version() == 1);
  CHECK(applied->bytes_written() == 128 * 64 * 2 + 16384 + 800);

  CHECK(std::memcmp(dst.data(), src.data() + 128 * 64 * 2, 128 * 64 * 2) == 0);
  for (int i = 0; i < 64; ++i) CHECK(dst.data()[128 * 64 * 2 + i] == 0);  // the gap untouched
  CHECK(std::memcmp(dst.data() + 128 * 64 * 2 + 64, src.data() + 32768, 16384) == 0);
  CHECK(std::memcmp(dst.data() + 128 * 64 * 2 + 64 + 16384, src.data() + 49152, 800) == 0);

  auto status = node.client->Status();
  REQUIRE(status.ok());
  CHECK(status->node() == "test-node");
  REQUIRE(status->models_size() == 1);
  CHECK(status->models(0).latest_version() == 1);
  CHECK(status->models(0).source_buffers() == 1);
  CHECK(status->models(0).destination_buffers() == 1);
  CHECK(status->metrics().at("refit_versions_completed_total") == 1);
  CHECK(status->metrics().at("refit_apply_bytes_total") == applied->bytes_written());
}

TEST_CASE("a destination gathers one tensor from two trainer ranks", "[integration]") {
  Node node;
  // fp16 [8, 32] split by rows over two ranks (TP on dim 0); the engine wants columns 8..24.
  SharedMemory r0 = node.Shm(4 * 32 * 2), r1 = node.Shm(4 * 32 * 2);
  Fill(r0, 2);
  Fill(r1, 3);
  auto a = node.client->RegisterBuffer("m", v1::SOURCE, r0.name(),
                                       {Slice("t", v1::FP16, {8, 32}, 0, {0, 0}, {4, 32})});
  auto b = node.client->RegisterBuffer("m", v1::SOURCE, r1.name(),
                                       {Slice("t", v1::FP16, {8, 32}, 0, {4, 0}, {4, 32})});
  SharedMemory dst = node.Shm(8 * 16 * 2);
  auto d = node.client->RegisterBuffer("m", v1::DESTINATION, dst.name(),
                                       {Slice("t", v1::FP16, {8, 32}, 0, {0, 8}, {8, 16})});
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  REQUIRE(d.ok());
  REQUIRE(node.client->Publish("m", 7, {*a}).ok());
  // Rank 1 hasn't published: version 7 isn't complete anywhere yet.
  auto early = node.client->Apply("m", 7, {*d});
  CHECK(early.status().code() == absl::StatusCode::kFailedPrecondition);
  REQUIRE(node.client->Publish("m", 7, {*b}).ok());
  auto applied = node.client->Apply("m", 7, {*d});
  REQUIRE(applied.ok());
  for (int row = 0; row < 8; ++row) {
    const uint8_t* from = (row < 4 ? r0.data() : r1.data()) + ((row % 4) * 32 + 8) * 2;
    CHECK(std::memcmp(dst.data() + row * 16 * 2, from, 16 * 2) == 0);
  }
}

TEST_CASE("Publish snapshots: overwriting the source at once doesn't change the version",
          "[integration]") {
  Node node;
  SharedMemory src = node.Shm(1 << 20), dst = node.Shm(1 << 20);
  auto s =
      node.client->RegisterBuffer("m", v1::SOURCE, src.name(), {Slice("w", v1::UINT8, {1 << 20})});
  auto d = node.client->RegisterBuffer("m", v1::DESTINATION, dst.name(),
                                       {Slice("w", v1::UINT8, {1 << 20})});
  for (uint64_t v = 1; v <= 2; ++v) {
    std::memset(src.data(), static_cast<int>(v), src.size());
    REQUIRE(node.client->Publish("m", v, {*s}).ok());
  }
  std::memset(src.data(), 0xEE, src.size());
  REQUIRE(node.client->Apply("m", 1, {*d}).ok());
  CHECK(std::all_of(dst.data(), dst.data() + dst.size(), [](uint8_t x) { return x == 1; }));
  REQUIRE(node.client->Apply("m", 2, {*d}).ok());
  CHECK(std::all_of(dst.data(), dst.data() + dst.size(), [](uint8_t x) { return x == 2; }));
}

TEST_CASE("Watch delivers one event per version, in order", "[integration]") {
  Node node;
  SharedMemory src = node.Shm(4096);
  auto s =
      node.client->RegisterBuffer("m", v1::SOURCE, src.name(), {Slice("w", v1::INT32, {1024})});
  REQUIRE(s.ok());
  auto watcher = node.client->Watch("m");
  REQUIRE(watcher.ok());
  const std::vector<uint64_t> published = {1, 2, 5, 9, 10};
  for (uint64_t v : published) REQUIRE(node.client->Publish("m", v, {*s}).ok());
  std::vector<uint64_t> seen;
  v1::VersionEvent event;
  while (seen.size() < published.size() && (*watcher)->Next(&event)) {
    CHECK(event.model() == "m");
    seen.push_back(event.version());
  }
  CHECK(seen == published);

  // A second watcher replaying from version 5 sees the versions still retained after it.
  auto replay = node.client->Watch("m", 5);
  REQUIRE(replay.ok());
  REQUIRE((*replay)->Next(&event));
  CHECK(event.version() == 9);
  REQUIRE((*replay)->Next(&event));
  CHECK(event.version() == 10);
  (*watcher)->Cancel();
  (*replay)->Cancel();
}

TEST_CASE("WaitForVersion honours deadlines and wakes on completion", "[integration]") {
  Node node;
  SharedMemory src = node.Shm(64);
  auto s = node.client->RegisterBuffer("m", v1::SOURCE, src.name(), {Slice("w", v1::UINT8, {64})});
  REQUIRE(s.ok());
  const auto start = std::chrono::steady_clock::now();
  auto timed_out = node.client->WaitForVersion("m", 1, milliseconds(300));
  CHECK(timed_out.status().code() == absl::StatusCode::kDeadlineExceeded);
  CHECK(std::chrono::steady_clock::now() - start >= milliseconds(250));

  std::thread publisher([&] {
    std::this_thread::sleep_for(milliseconds(100));
    REQUIRE(node.client->Publish("m", 3, {*s}).ok());
  });
  auto woke = node.client->WaitForVersion("m", 2, milliseconds(10000));
  publisher.join();
  REQUIRE(woke.ok());
  CHECK(*woke == 3);
  // Already satisfied: returns the newest at once.
  auto now = node.client->WaitForVersion("m", 1, milliseconds(1000));
  REQUIRE(now.ok());
  CHECK(*now == 3);
}

}  // namespace
}  // namespace refit
