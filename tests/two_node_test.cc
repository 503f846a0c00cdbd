// Two and three refitd processes on this machine acting as nodes: versions published on the
// trainer's node arrive on the engine's node over UCX (tcp or shared memory, as UCX_TLS says),
// bit-exact, resharded, verified, and only once every byte is there. What happens when a node
// dies, a lease runs out, or the engine is watched mid-pull: tests/two_node_liveness_test.

#include <signal.h>
#include <xxhash.h>

#include <array>
#include <cstring>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "grpcpp/grpcpp.h"
#include "proto/refit/v1/peer.grpc.pb.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/peer_probe.h"
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

TEST_CASE("a version moves between two daemons bit-exact, resharded", "[integration][two]") {
  TwoNodes nodes;
  auto& trainer = nodes.trainer;
  auto& engine = nodes.engine;

  // Trainer: two tensors, bf16 [1024, 512] and fp32 [3000] (1 MiB + 12 KB).
  const uint64_t a_bytes = 1024 * 512 * 2, b_bytes = 3000 * 4;
  SharedMemory src = MakeShm(a_bytes + b_bytes);
  auto s = trainer->RegisterBuffer(
      "m", v1::SOURCE, src.name(),
      {Slice("a", v1::BF16, {1024, 512}, 0), Slice("b", v1::FP32, {3000}, a_bytes)}, "trainer");
  REQUIRE(s.ok());
  // Engine: the second half of a's rows, and all of b.
  SharedMemory dst = MakeShm(512 * 512 * 2 + b_bytes);
  auto d = engine->RegisterBuffer("m", v1::DESTINATION, dst.name(),
                                  {Slice("a", v1::BF16, {1024, 512}, 0, {512, 0}, {512, 512}),
                                   Slice("b", v1::FP32, {3000}, 512 * 512 * 2)},
                                  "engine");
  REQUIRE(d.ok());

  for (uint64_t v = 1; v <= 3; ++v) {
    FillRandom(src, static_cast<uint32_t>(v));
    REQUIRE(trainer->Publish("m", v, {*s}).ok());
    auto got = engine->WaitForVersion("m", v, milliseconds(20000));
    REQUIRE(got.ok());
    CHECK(*got == v);
    auto applied = engine->Apply("m", v, {*d});
    REQUIRE(applied.ok());
    CHECK(std::memcmp(dst.data(), src.data() + 512 * 512 * 2, 512 * 512 * 2) == 0);
    CHECK(std::memcmp(dst.data() + 512 * 512 * 2, src.data() + a_bytes, b_bytes) == 0);
  }
  // Only the bytes the engine needs crossed: half of a, all of b, per version.
  auto status = engine->Status();
  REQUIRE(status.ok());
  CHECK(status->metrics().at("refit_data_bytes_received_total") == 3.0 * (512 * 512 * 2 + b_bytes));
  auto sent = trainer->Status();
  REQUIRE(sent.ok());
  CHECK(sent->metrics().at("refit_data_bytes_sent_total") == 3.0 * (512 * 512 * 2 + b_bytes));
}

TEST_CASE("a column-split pull is verified from sums the source took at Publish",
          "[integration][two]") {
  // The engine holds the right half of every row (4 KiB of each 8 KiB row): one short range per
  // row, off the source's 4 MiB checksum grid. The source hashes those ranges for the first
  // version a peer asks about, and from then on at Publish, while each block is in cache.
  TwoNodes nodes;
  constexpr int64_t kRows = 512, kCols = 4096;  // bf16
  constexpr uint64_t kRow = kCols * 2, kHalf = kRow / 2;
  SharedMemory src = MakeShm(kRows * kRow);
  auto s = nodes.trainer->RegisterBuffer("m", v1::SOURCE, src.name(),
                                         {Slice("w", v1::BF16, {kRows, kCols})}, "trainer");
  REQUIRE(s.ok());
  SharedMemory dst = MakeShm(kRows * kHalf);
  auto d = nodes.engine->RegisterBuffer(
      "m", v1::DESTINATION, dst.name(),
      {Slice("w", v1::BF16, {kRows, kCols}, 0, {0, kCols / 2}, {kRows, kCols / 2})}, "engine");
  REQUIRE(d.ok());

  auto hashed_on_demand = [&] {
    auto status = nodes.trainer->Status();
    REQUIRE(status.ok());
    auto it = status->metrics().find("refit_checksum_bytes_hashed_total");
    return it == status->metrics().end() ? 0.0 : it->second;
  };
  for (uint64_t v = 1; v <= 4; ++v) {
    FillRandom(src, static_cast<uint32_t>(100 + v));  // every byte changes: full pulls, no deltas
    REQUIRE(nodes.trainer->Publish("m", v, {*s}).ok());
    auto got = nodes.engine->WaitForVersion("m", v, milliseconds(20000));
    REQUIRE(got.ok());
    REQUIRE(*got == v);
    REQUIRE(nodes.engine->Apply("m", v, {*d}).ok());
    for (int64_t row = 0; row < kRows; ++row) {
      INFO("version " << v << " row " << row);
      REQUIRE(std::memcmp(dst.data() + row * kHalf, src.data() + row * kRow + kHalf, kHalf) == 0);
    }
    // Version 1: every range hashed when asked for; later versions: none.
    CHECK(hashed_on_demand() == static_cast<double>(kRows * kHalf));
  }
  auto status = nodes.engine->Status();
  REQUIRE(status.ok());
  CHECK(status->metrics().at("refit_data_bytes_received_total") == 4.0 * kRows * kHalf);

  // The peer Checksum RPC itself: runs and plain ranges give XXH3 of the bytes; a run past the
  // piece's end, or too long, is refused whole and the daemon keeps serving.
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(ListenPort(*nodes.trainer_node)),
                                     grpc::InsecureChannelCredentials());
  auto peer = v1::Peer::NewStub(channel);
  // Asked as a reader does: inside its grant (a pin of the version, the key it was sent).
  testing::PeerProbe probe(ListenPort(*nodes.trainer_node));
  const std::string key = probe.KeysFor("probe", "m", 4)[*s];
  REQUIRE_FALSE(key.empty());
  REQUIRE(probe.Pin("probe", "m", 4).ok());
  auto ask = [&](const std::vector<std::array<uint64_t, 4>>& runs, v1::ChecksumResponse* response,
                 const std::vector<std::array<uint64_t, 2>>& ranges = {}) {
    v1::ChecksumRequest request;
    request.set_model("m");
    request.set_version(4);
    request.set_buffer_id(*s);
    request.set_node("probe");
    request.set_remote_key(key);
    for (const auto& [offset, length, stride, count] : runs) {
      v1::RangeRun* run = request.add_runs();
      run->set_offset(offset);
      run->set_length(length);
      run->set_stride(stride);
      run->set_count(count);
    }
    for (const auto& [offset, length] : ranges) {
      v1::ByteRange* range = request.add_ranges();
      range->set_offset(offset);
      range->set_length(length);
    }
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    return peer->Checksum(&context, request, response).error_code();
  };
  v1::ChecksumResponse response;
  REQUIRE(ask({{kHalf, kHalf, kRow, 3}, {5, 100, 0, 1}}, &response) == grpc::StatusCode::OK);
  REQUIRE(response.sums_size() == 4);
  for (int i = 0; i < 3; ++i) {
    CHECK(response.sums(i) == XXH3_64bits(src.data() + kHalf + i * kRow, kHalf));
  }
  CHECK(response.sums(3) == XXH3_64bits(src.data() + 5, 100));
  response.Clear();
  REQUIRE(ask({}, &response, {{kRow + kHalf, kHalf}}) == grpc::StatusCode::OK);  // older peers
  REQUIRE(response.xxh3_size() == 1);
  CHECK(response.xxh3(0) == XXH3_64bits(src.data() + kRow + kHalf, kHalf));
  const uint64_t size = kRows * kRow;
  CHECK(ask({{kHalf, kHalf, kRow, kRows + 1}}, &response) == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(ask({{0, 1, size, 2}}, &response) == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(ask({{1, 1, ~0ull, 3}}, &response) == grpc::StatusCode::INVALID_ARGUMENT);  // overflow
  CHECK(ask({{0, 1, 0, 1ull << 40}}, &response) == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(ask({{0, 100, 50, 3}}, &response) == grpc::StatusCode::INVALID_ARGUMENT);  // overlap
  // More bytes than the piece holds in one call (each run alone is fine).
  CHECK(ask({{0, kRow, kRow, kRows}, {0, kRow, kRow, kRows}}, &response) ==
        grpc::StatusCode::INVALID_ARGUMENT);
  REQUIRE(ask({{0, kRow, kRow, kRows}}, &response) == grpc::StatusCode::OK);
  CHECK(response.sums_size() == kRows);
  CHECK(ask({}, &response, {{size - 1, 2}}) == grpc::StatusCode::INVALID_ARGUMENT);
  CHECK(nodes.trainer->Status().ok());
}

TEST_CASE("a source that registers again with another layout: the engine follows it",
          "[integration][two]") {
  // Layouts go to peers only when they change; this is the change.
  TwoNodes nodes;
  auto& trainer = nodes.trainer;
  auto& engine = nodes.engine;

  constexpr uint64_t kBytes = 256 * 256 * 2, kHalf = kBytes / 2;
  SharedMemory dst = MakeShm(kBytes);
  auto d = engine->RegisterBuffer("m", v1::DESTINATION, dst.name(),
                                  {Slice("a", v1::BF16, {256, 256})}, "engine");
  REQUIRE(d.ok());

  // Version 1: the whole tensor, in order.
  SharedMemory first = MakeShm(kBytes);
  auto s1 = trainer->RegisterBuffer("m", v1::SOURCE, first.name(),
                                    {Slice("a", v1::BF16, {256, 256})}, "t1");
  REQUIRE(s1.ok());
  FillRandom(first, 1);
  REQUIRE(trainer->Publish("m", 1, {*s1}).ok());
  REQUIRE(engine->WaitForVersion("m", 1, milliseconds(20000)).ok());
  REQUIRE(engine->Apply("m", 1, {*d}).ok());
  CHECK(std::memcmp(dst.data(), first.data(), kBytes) == 0);

  // Version 2: another buffer, same size, the two halves of the rows swapped in memory.
  REQUIRE(trainer->ReleaseBuffer(*s1).ok());
  SharedMemory second = MakeShm(kBytes);
  auto s2 = trainer->RegisterBuffer("m", v1::SOURCE, second.name(),
                                    {Slice("a", v1::BF16, {256, 256}, 0, {128, 0}, {128, 256}),
                                     Slice("a", v1::BF16, {256, 256}, kHalf, {0, 0}, {128, 256})},
                                    "t2");
  REQUIRE(s2.ok());
  FillRandom(second, 2);
  REQUIRE(trainer->Publish("m", 2, {*s2}).ok());
  auto got = engine->WaitForVersion("m", 2, milliseconds(20000));
  INFO(got.status().ToString());
  REQUIRE(got.ok());
  REQUIRE(engine->Apply("m", 2, {*d}).ok());
  CHECK(std::memcmp(dst.data(), second.data() + kHalf, kHalf) == 0);
  CHECK(std::memcmp(dst.data() + kHalf, second.data(), kHalf) == 0);
}

TEST_CASE("sources split across two daemons: the engine pulls from both (three nodes)",
          "[integration][three]") {
  auto a = DaemonProcess::Start({"--node=trainer-a"});
  auto b = DaemonProcess::Start({"--node=trainer-b"});
  REQUIRE(a.ok());
  REQUIRE(b.ok());
  auto engine_node = DaemonProcess::Start(
      {"--node=engine", "--peers=127.0.0.1:" + std::to_string(ListenPort(**a)) +
                            ",127.0.0.1:" + std::to_string(ListenPort(**b))});
  REQUIRE(engine_node.ok());
  // TP4 over two nodes, two ranks each: fp16 [64, 1024] split by rows into four.
  const std::vector<int64_t> shape{64, 1024};
  const uint64_t rank_bytes = 16 * 1024 * 2;
  std::vector<SharedMemory> ranks;
  std::vector<Registered> sources;
  for (int r = 0; r < 4; ++r) {
    ranks.push_back(MakeShm(rank_bytes));
    auto c = (r < 2 ? *a : *b)->Connect();
    REQUIRE(c.ok());
    auto id = (*c)->RegisterBuffer("tp", v1::SOURCE, ranks.back().name(),
                                   {Slice("w", v1::FP16, shape, 0, {16 * r, 0}, {16, 1024})});
    REQUIRE(id.ok());
    sources.push_back({std::move(c).value(), *id});
  }
  SharedMemory dst = MakeShm(4 * rank_bytes);
  auto engine = (*engine_node)->Connect();
  REQUIRE(engine.ok());
  auto d = (*engine)->RegisterBuffer("tp", v1::DESTINATION, dst.name(),
                                     {Slice("w", v1::FP16, shape, 0)});
  REQUIRE(d.ok());
  WaitConnected(**engine, 2);

  for (uint64_t v = 1; v <= 2; ++v) {
    for (int r = 0; r < 4; ++r) FillRandom(ranks[r], static_cast<uint32_t>(10 * v + r));
    for (int r = 0; r < 3; ++r) {
      REQUIRE(sources[r].client->Publish("tp", v, {sources[r].id}).ok());
    }
    // Three of four ranks published: not complete anywhere.
    CHECK((*engine)->WaitForVersion("tp", v, milliseconds(500)).status().code() ==
          absl::StatusCode::kDeadlineExceeded);
    REQUIRE(sources[3].client->Publish("tp", v, {sources[3].id}).ok());
    REQUIRE((*engine)->WaitForVersion("tp", v, milliseconds(20000)).ok());
    REQUIRE((*engine)->Apply("tp", v, {*d}).ok());
    for (int r = 0; r < 4; ++r) {
      CHECK(std::memcmp(dst.data() + r * rank_bytes, ranks[r].data(), rank_bytes) == 0);
    }
  }
}

TEST_CASE("tensors of several sizes up to 256 MiB arrive bit-exact", "[integration][two]") {
  Pair p = StartSourceAndEngine();
  // 1 byte, an odd size, a chunk and a bit, and 256 MiB: one buffer each side.
  const std::vector<int64_t> sizes = {1, 4097, (4 << 20) + 3, 256 << 20};
  uint64_t total = 0;
  std::vector<v1::TensorSlice> slices;
  for (size_t i = 0; i < sizes.size(); ++i) {
    slices.push_back(Slice("t" + std::to_string(i), v1::UINT8, {sizes[i]}, total));
    total += static_cast<uint64_t>(sizes[i]);
  }
  SharedMemory src = MakeShm(total), dst = MakeShm(total);
  FillRandom(src, 99);
  auto s = p.trainer->RegisterBuffer("sizes", v1::SOURCE, src.name(), slices);
  auto d = p.inference->RegisterBuffer("sizes", v1::DESTINATION, dst.name(), slices);
  REQUIRE(s.ok());
  REQUIRE(d.ok());
  REQUIRE(p.trainer->Publish("sizes", 1, {*s}).ok());
  REQUIRE(p.inference->WaitForVersion("sizes", 1, milliseconds(120000)).ok());
  REQUIRE(p.inference->Apply("sizes", 1, {*d}).ok());
  CHECK(std::memcmp(src.data(), dst.data(), total) == 0);
}

TEST_CASE("a restarted receiver pulls the newest version again", "[integration][two]") {
  Pair p = StartSourceAndEngine();
  SharedMemory src = MakeShm(1 << 20), dst = MakeShm(1 << 20);
  auto s =
      p.trainer->RegisterBuffer("m", v1::SOURCE, src.name(), {Slice("w", v1::UINT8, {1 << 20})});
  REQUIRE(s.ok());
  for (uint64_t v = 1; v <= 3; ++v) {
    FillRandom(src, static_cast<uint32_t>(v));
    REQUIRE(p.trainer->Publish("m", v, {*s}).ok());
  }
  FillRandom(src, 3);  // what version 3 holds
  // A receiver that starts now (or restarts) gets the newest version, not the history.
  p.inference.reset();
  p.engine->Stop(SIGKILL);
  auto engine = DaemonProcess::Start(
      {"--node=dst", "--peers=127.0.0.1:" + std::to_string(ListenPort(*p.source))});
  REQUIRE(engine.ok());
  auto inference = (*engine)->Connect();
  REQUIRE(inference.ok());
  auto d =
      (*inference)
          ->RegisterBuffer("m", v1::DESTINATION, dst.name(), {Slice("w", v1::UINT8, {1 << 20})});
  REQUIRE(d.ok());
  auto got = (*inference)->WaitForVersion("m", 1, milliseconds(20000));
  REQUIRE(got.ok());
  CHECK(*got == 3);
  REQUIRE((*inference)->Apply("m", 0, {*d}).ok());
  CHECK(std::memcmp(src.data(), dst.data(), 1 << 20) == 0);
}

TEST_CASE("a source of an older release (plain checksum ranges only) still verifies pulls",
          "[integration][two]") {
  // The engine asks with RangeRun runs; this source ignores them (REFIT_FAULT_...), as a
  // release before them would, and the engine asks again with plain ranges.
  Pair p = StartSourceAndEngine({"REFIT_FAULT_CHECKSUM_WITHOUT_RUNS=1"});
  constexpr int64_t kRows = 256, kCols = 2048;  // bf16, 4 KiB rows; the engine holds half
  SharedMemory src = MakeShm(kRows * kCols * 2), dst = MakeShm(kRows * kCols);
  auto s = p.trainer->RegisterBuffer("m", v1::SOURCE, src.name(),
                                     {Slice("w", v1::BF16, {kRows, kCols})});
  auto d = p.inference->RegisterBuffer(
      "m", v1::DESTINATION, dst.name(),
      {Slice("w", v1::BF16, {kRows, kCols}, 0, {0, kCols / 2}, {kRows, kCols / 2})});
  REQUIRE(s.ok());
  REQUIRE(d.ok());
  for (uint64_t v = 1; v <= 2; ++v) {
    FillRandom(src, static_cast<uint32_t>(v + 7));
    REQUIRE(p.trainer->Publish("m", v, {*s}).ok());
    REQUIRE(p.inference->WaitForVersion("m", v, milliseconds(20000)).ok());
    REQUIRE(p.inference->Apply("m", v, {*d}).ok());
    for (int64_t row = 0; row < kRows; ++row) {
      INFO("version " << v << " row " << row);
      // The right half of each row (columns kCols / 2 on: kCols bytes in).
      REQUIRE(std::memcmp(dst.data() + row * kCols, src.data() + row * kCols * 2 + kCols, kCols) ==
              0);
    }
  }
  auto status = p.inference->Status();
  REQUIRE(status.ok());
  CHECK(status->metrics().at("refit_data_bytes_received_total") == 2.0 * kRows * kCols);
  // The source really ignores runs (so the pulls above went through the fallback).
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(ListenPort(*p.source)),
                                     grpc::InsecureChannelCredentials());
  testing::PeerProbe probe(ListenPort(*p.source));
  v1::ChecksumRequest request;
  request.set_model("m");
  request.set_version(2);
  request.set_buffer_id(*s);
  request.set_node("probe");
  request.set_remote_key(probe.KeysFor("probe", "m", 2)[*s]);
  REQUIRE(probe.Pin("probe", "m", 2).ok());
  v1::RangeRun* run = request.add_runs();
  run->set_offset(0);
  run->set_length(100);
  run->set_count(1);
  v1::ChecksumResponse response;
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
  REQUIRE(v1::Peer::NewStub(channel)->Checksum(&context, request, &response).ok());
  CHECK(response.sums_size() == 0);
  CHECK(response.xxh3_size() == 0);
}

TEST_CASE("a checksum mismatch is fetched again; a persistent one fails the version",
          "[integration][two][failure]") {
  SECTION("one bad reply: the chunk is fetched again and the version completes") {
    Pair p = StartSourceAndEngine({"REFIT_FAULT_CORRUPT_CHECKSUMS=1"});
    SharedMemory src = MakeShm(1 << 20), dst = MakeShm(1 << 20);
    FillRandom(src, 1);
    auto s =
        p.trainer->RegisterBuffer("m", v1::SOURCE, src.name(), {Slice("w", v1::UINT8, {1 << 20})});
    auto d = p.inference->RegisterBuffer("m", v1::DESTINATION, dst.name(),
                                         {Slice("w", v1::UINT8, {1 << 20})});
    REQUIRE(p.trainer->Publish("m", 1, {*s}).ok());
    REQUIRE(p.inference->WaitForVersion("m", 1, milliseconds(20000)).ok());
    REQUIRE(p.inference->Apply("m", 1, {*d}).ok());
    CHECK(std::memcmp(src.data(), dst.data(), 1 << 20) == 0);
    auto status = p.inference->Status();
    REQUIRE(status.ok());
    // The 1 MiB arrived twice: once, and once more after the bad checksum.
    CHECK(status->metrics().at("refit_data_bytes_received_total") == 2.0 * (1 << 20));
  }
  SECTION("always bad: the version is never shown, the previous one stays") {
    Pair p = StartSourceAndEngine({"REFIT_FAULT_CORRUPT_CHECKSUMS=1000000"});
    SharedMemory src = MakeShm(1 << 20), dst = MakeShm(1 << 20);
    auto s =
        p.trainer->RegisterBuffer("m", v1::SOURCE, src.name(), {Slice("w", v1::UINT8, {1 << 20})});
    auto d = p.inference->RegisterBuffer("m", v1::DESTINATION, dst.name(),
                                         {Slice("w", v1::UINT8, {1 << 20})});
    REQUIRE(p.trainer->Publish("m", 1, {*s}).ok());
    CHECK(p.inference->WaitForVersion("m", 1, milliseconds(3000)).status().code() ==
          absl::StatusCode::kDeadlineExceeded);
    CHECK(p.inference->Apply("m", 1, {*d}).status().code() ==
          absl::StatusCode::kFailedPrecondition);
  }
}

}  // namespace
}  // namespace refit
