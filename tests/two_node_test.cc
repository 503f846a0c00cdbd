// Two and three refitd processes on this machine acting as nodes: versions published on the
// trainer's node arrive on the engine's node over UCX (tcp or shared memory, as UCX_TLS says),
// bit-exact, and only once every byte is there and verified; a dead source leaves the engine on
// the previous version, and it recovers when the source is back.

#include <arpa/inet.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>
#include <xxhash.h>

#include <array>
#include <cstring>
#include <random>
#include <thread>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "grpcpp/grpcpp.h"
#include "proto/refit/v1/peer.grpc.pb.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/peer_probe.h"

namespace refit {
namespace {

using client::SharedMemory;
using client::Slice;
using std::chrono::milliseconds;
using testing::DaemonProcess;

SharedMemory MakeShm(uint64_t size) {
  auto shm = SharedMemory::Create(testing::UniqueShmName("2n"), size);
  REQUIRE(shm.ok());
  return std::move(shm).value();
}

void Fill(SharedMemory& shm, uint32_t seed) {
  std::mt19937_64 rng(seed);
  uint64_t* p = reinterpret_cast<uint64_t*>(shm.data());
  for (uint64_t i = 0; i < shm.size() / 8; ++i) p[i] = rng();
}

int ListenPort(DaemonProcess& d) {
  auto c = d.Connect();
  REQUIRE(c.ok());
  auto s = (*c)->Status();
  REQUIRE(s.ok());
  return s->listen_port();
}

// Waits until `client`'s daemon reports every peer connected.
void WaitConnected(client::Client& client, int peers) {
  for (int i = 0; i < 200; ++i) {
    auto s = client.Status();
    REQUIRE(s.ok());
    int connected = 0;
    for (const auto& p : s->peers()) connected += p.connected();
    if (connected == peers) return;
    std::this_thread::sleep_for(milliseconds(50));
  }
  FAIL("peers did not connect");
}

// Waits (up to 10 s) until `client`'s daemon has pulled some bytes of `version`.
void WaitPulling(client::Client& client, uint64_t version) {
  const auto started = std::chrono::steady_clock::now();
  while (std::chrono::steady_clock::now() - started < std::chrono::seconds(10)) {
    auto s = client.Status();
    REQUIRE(s.ok());
    for (const auto& t : s->transfers()) {
      if (t.version() == version && t.bytes_done() > 0) return;
    }
  }
  FAIL("no pull of version " << version << " under way");
}

// A trainer's node and an engine's node (--peers = the trainer's), connected, with a client
// to each.
struct TwoNodes {
  TwoNodes() {
    auto t = DaemonProcess::Start({"--node=trainer-node"});
    REQUIRE(t.ok());
    trainer_node = std::move(t).value();
    auto e = DaemonProcess::Start(
        {"--node=engine-node", "--peers=127.0.0.1:" + std::to_string(ListenPort(*trainer_node))});
    REQUIRE(e.ok());
    engine_node = std::move(e).value();
    auto tc = trainer_node->Connect();
    auto ec = engine_node->Connect();
    REQUIRE(tc.ok());
    REQUIRE(ec.ok());
    trainer = std::move(tc).value();
    engine = std::move(ec).value();
    WaitConnected(*engine, 1);
  }
  std::unique_ptr<DaemonProcess> trainer_node, engine_node;
  std::unique_ptr<client::Client> trainer, engine;
};

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
    Fill(src, static_cast<uint32_t>(v));
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
    Fill(src, static_cast<uint32_t>(100 + v));  // every byte changes: full pulls, no deltas
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

}  // namespace
}  // namespace refit

namespace refit {
namespace {

// A TCP port that was free a moment ago, for a daemon that must come back on the same address.
int FreePort() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  socklen_t len = sizeof(addr);
  REQUIRE(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0);
  close(fd);
  return ntohs(addr.sin_port);
}

struct Registered {
  std::unique_ptr<client::Client> client;
  std::string id;
};

Registered RegisterWhole(DaemonProcess& daemon, v1::Role role, const SharedMemory& shm,
                         int64_t elements) {
  auto c = daemon.Connect();
  REQUIRE(c.ok());
  auto id = (*c)->RegisterBuffer("big", role, shm.name(), {Slice("w", v1::UINT8, {elements})});
  REQUIRE(id.ok());
  return {std::move(c).value(), *id};
}

// Whether UCX_TLS names shared memory (the two_node_shm_test variant).
bool SharedMemoryTls() {
  const char* tls = std::getenv("UCX_TLS");
  return tls != nullptr && std::string(tls).find("sm") != std::string::npos;
}

// One `bytes`-sized tensor of model "big": a SOURCE on `source`, a DESTINATION on `engine`,
// whose daemon is connected to its one peer.
struct BigModel {
  BigModel(DaemonProcess& source, DaemonProcess& engine, int64_t bytes)
      : bytes(bytes),
        src(MakeShm(bytes)),
        dst(MakeShm(bytes)),
        trainer(RegisterWhole(source, v1::SOURCE, src, bytes)),
        inference(RegisterWhole(engine, v1::DESTINATION, dst, bytes)) {
    WaitConnected(*inference.client, 1);
  }
  // Fills the source buffer with `value` and publishes it as `version`.
  void Publish(uint64_t version, int value) {
    std::memset(src.data(), value, bytes);
    REQUIRE(trainer.client->Publish("big", version, {trainer.id}).ok());
  }
  bool DestinationIs(uint8_t value) const {
    return std::all_of(dst.data(), dst.data() + bytes, [&](uint8_t b) { return b == value; });
  }
  int64_t bytes;
  SharedMemory src, dst;
  Registered trainer, inference;
};

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
  Fill(first, 1);
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
  Fill(second, 2);
  REQUIRE(trainer->Publish("m", 2, {*s2}).ok());
  auto got = engine->WaitForVersion("m", 2, milliseconds(20000));
  INFO(got.status().ToString());
  REQUIRE(got.ok());
  REQUIRE(engine->Apply("m", 2, {*d}).ok());
  CHECK(std::memcmp(dst.data(), second.data() + kHalf, kHalf) == 0);
  CHECK(std::memcmp(dst.data() + kHalf, second.data(), kHalf) == 0);
}

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
  if (SharedMemoryTls()) {
    WARN("shared memory pulls too fast to outlast a lease here: covered by the tcp variant");
    return;
  }
  // The source keeps one version; the engine pins with a 0.5 s lease (renewed every 125 ms) and
  // pulls 256 MiB in 4 KiB reads, one at a time: a few seconds even with an idle, event-driven
  // data plane (128 MiB and a 1 s lease finished too soon on a quiet machine).
  // Deltas off: the delta encoder would hold older snapshots too.
  auto source = DaemonProcess::Start({"--node=src", "--retain=1", "--delta-threshold=0"});
  REQUIRE(source.ok());
  auto engine = DaemonProcess::Start(
      {"--node=dst", "--retain=10", "--chunk-bytes=4096", "--inflight=1", "--delta-threshold=0",
       "--peers=127.0.0.1:" + std::to_string(ListenPort(**source))},
      /*socket=*/"", {"REFIT_TEST_PIN_LEASE_MS=500"});
  REQUIRE(engine.ok());
  BigModel big(**source, **engine, 256 << 20);
  auto& inference = big.inference;
  big.Publish(1, 1);
  WaitPulling(*inference.client, 1);
  // Newer versions drop version 1 from the source's store at once; only the engine's pin holds
  // its slot. Past the lease, more versions would take that slot from the pool and overwrite
  // it, had the pin lapsed.
  big.Publish(2, 2);
  std::this_thread::sleep_for(milliseconds(750));  // past the lease
  // Checked before the next Publishes, not after: on a loaded machine four 256 MiB Publishes can
  // outlast the pull, and what matters is that the lease has run out while the pull goes on.
  auto status = inference.client->Status();
  REQUIRE(status.ok());
  bool still_pulling_1 = false;
  for (const auto& t : status->transfers()) still_pulling_1 |= t.version() == 1;
  CHECK(still_pulling_1);  // else the test proves nothing: make the pull slower
  for (uint64_t v = 3; v <= 6; ++v) big.Publish(v, static_cast<int>(v));

  // Version 1 completes, bit-exact. Or, since the pin bounds of issue 37 (one pin per reader
  // and model; a reader's newer pin lets its older one go), the source may refuse version 1's
  // remaining reads once the engine pinned a newer version: then version 1 is abandoned with a
  // refused transfer — never wrong bytes — and the newest version completes bit-exact instead.
  // (Keeping the pin of a pull in progress is left open: docs/security.md, "Bounded pins".)
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  uint64_t want = 1;
  bool held = false;
  while (!held && std::chrono::steady_clock::now() < deadline) {
    status = inference.client->Status();
    REQUIRE(status.ok());
    for (const auto& m : status->models()) {
      for (uint64_t v : m.versions()) held |= v == want;
      INFO("abandoned " << m.abandoned_version() << ": " << m.abandoned_error());
      if (m.abandoned_version() == 1) {
        if (want == 1) CHECK(m.abandoned_error().find("transfer") != std::string::npos);
        want = 6;
      } else {
        REQUIRE(m.abandoned_version() == 0);
      }
    }
    if (!held) std::this_thread::sleep_for(milliseconds(50));
  }
  REQUIRE(held);
  REQUIRE(inference.client->Apply("big", want, {inference.id}).ok());
  CHECK(big.DestinationIs(static_cast<uint8_t>(want)));
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
  Fill(src, 7);
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
  Fill(src, 8);
  REQUIRE(trainer.client->Publish("big", 2, {trainer.id}).ok());
  REQUIRE(r2.client->WaitForVersion("big", 2, milliseconds(60000)).ok());
  REQUIRE(r2.client->Apply("big", 2, {r2.id}).ok());
  CHECK(std::memcmp(d2.data(), src.data(), kBytes) == 0);
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
    for (int r = 0; r < 4; ++r) Fill(ranks[r], static_cast<uint32_t>(10 * v + r));
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

}  // namespace
}  // namespace refit

namespace refit {
namespace {

struct Pair {
  std::unique_ptr<DaemonProcess> source, engine;
  std::unique_ptr<client::Client> trainer, inference;
};

Pair StartPair(const std::vector<std::string>& source_env = {},
               const std::vector<std::string>& engine_args = {}) {
  Pair p;
  auto source = DaemonProcess::Start({"--node=src"}, "", source_env);
  REQUIRE(source.ok());
  p.source = std::move(source).value();
  std::vector<std::string> args = {"--node=dst",
                                   "--peers=127.0.0.1:" + std::to_string(ListenPort(*p.source))};
  args.insert(args.end(), engine_args.begin(), engine_args.end());
  auto engine = DaemonProcess::Start(args);
  REQUIRE(engine.ok());
  p.engine = std::move(engine).value();
  auto t = p.source->Connect();
  auto i = p.engine->Connect();
  REQUIRE(t.ok());
  REQUIRE(i.ok());
  p.trainer = std::move(t).value();
  p.inference = std::move(i).value();
  WaitConnected(*p.inference, 1);
  return p;
}

TEST_CASE("tensors of several sizes up to 256 MiB arrive bit-exact", "[integration][two]") {
  Pair p = StartPair();
  // 1 byte, an odd size, a chunk and a bit, and 256 MiB: one buffer each side.
  const std::vector<int64_t> sizes = {1, 4097, (4 << 20) + 3, 256 << 20};
  uint64_t total = 0;
  std::vector<v1::TensorSlice> slices;
  for (size_t i = 0; i < sizes.size(); ++i) {
    slices.push_back(Slice("t" + std::to_string(i), v1::UINT8, {sizes[i]}, total));
    total += static_cast<uint64_t>(sizes[i]);
  }
  SharedMemory src = MakeShm(total), dst = MakeShm(total);
  Fill(src, 99);
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
  Pair p = StartPair();
  SharedMemory src = MakeShm(1 << 20), dst = MakeShm(1 << 20);
  auto s =
      p.trainer->RegisterBuffer("m", v1::SOURCE, src.name(), {Slice("w", v1::UINT8, {1 << 20})});
  REQUIRE(s.ok());
  for (uint64_t v = 1; v <= 3; ++v) {
    Fill(src, static_cast<uint32_t>(v));
    REQUIRE(p.trainer->Publish("m", v, {*s}).ok());
  }
  Fill(src, 3);  // what version 3 holds
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
  Pair p = StartPair({"REFIT_FAULT_CHECKSUM_WITHOUT_RUNS=1"});
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
    Fill(src, static_cast<uint32_t>(v + 7));
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
    Pair p = StartPair({"REFIT_FAULT_CORRUPT_CHECKSUMS=1"});
    SharedMemory src = MakeShm(1 << 20), dst = MakeShm(1 << 20);
    Fill(src, 1);
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
    Pair p = StartPair({"REFIT_FAULT_CORRUPT_CHECKSUMS=1000000"});
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

namespace refit {
namespace {

TEST_CASE("Status and refitctl show a pull in flight and each version completing",
          "[integration][two]") {
  Pair p = StartPair({}, {"--chunk-bytes=16384", "--inflight=1"});
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

}  // namespace
}  // namespace refit

namespace refit {
namespace {

TEST_CASE("SIGTERM during a pull stops the receiver cleanly and promptly", "[integration][two]") {
  Pair p = StartPair({}, {"--chunk-bytes=4096", "--inflight=1"});
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
