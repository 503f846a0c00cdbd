// Two and three refitd processes on this machine acting as nodes: versions published on the
// trainer's node arrive on the engine's node over UCX (tcp or shared memory, as UCX_TLS says),
// bit-exact, and only once every byte is there and verified; a dead source leaves the engine on
// the previous version, and it recovers when the source is back.

#include <signal.h>

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

TEST_CASE("a version moves between two daemons bit-exact, resharded", "[integration][two]") {
  auto trainer_node = DaemonProcess::Start({"--node=trainer-node"});
  REQUIRE(trainer_node.ok());
  const int trainer_port = ListenPort(**trainer_node);
  auto engine_node = DaemonProcess::Start(
      {"--node=engine-node", "--peers=127.0.0.1:" + std::to_string(trainer_port)});
  REQUIRE(engine_node.ok());
  auto trainer = (*trainer_node)->Connect();
  auto engine = (*engine_node)->Connect();
  REQUIRE(trainer.ok());
  REQUIRE(engine.ok());
  WaitConnected(**engine, 1);

  // Trainer: two tensors, bf16 [1024, 512] and fp32 [3000] (1 MiB + 12 KB).
  const uint64_t a_bytes = 1024 * 512 * 2, b_bytes = 3000 * 4;
  SharedMemory src = MakeShm(a_bytes + b_bytes);
  auto s = (*trainer)->RegisterBuffer(
      "m", v1::SOURCE, src.name(),
      {Slice("a", v1::BF16, {1024, 512}, 0), Slice("b", v1::FP32, {3000}, a_bytes)}, "trainer");
  REQUIRE(s.ok());
  // Engine: the second half of a's rows, and all of b.
  SharedMemory dst = MakeShm(512 * 512 * 2 + b_bytes);
  auto d = (*engine)->RegisterBuffer(
      "m", v1::DESTINATION, dst.name(),
      {Slice("a", v1::BF16, {1024, 512}, 0, {512, 0}, {512, 512}),
       Slice("b", v1::FP32, {3000}, 512 * 512 * 2)},
      "engine");
  REQUIRE(d.ok());

  for (uint64_t v = 1; v <= 3; ++v) {
    Fill(src, static_cast<uint32_t>(v));
    REQUIRE((*trainer)->Publish("m", v, {*s}).ok());
    auto got = (*engine)->WaitForVersion("m", v, milliseconds(20000));
    REQUIRE(got.ok());
    CHECK(*got == v);
    auto applied = (*engine)->Apply("m", v, {*d});
    REQUIRE(applied.ok());
    CHECK(std::memcmp(dst.data(), src.data() + 512 * 512 * 2, 512 * 512 * 2) == 0);
    CHECK(std::memcmp(dst.data() + 512 * 512 * 2, src.data() + a_bytes, b_bytes) == 0);
  }
  // Only the bytes the engine needs crossed: half of a, all of b, per version.
  auto status = (*engine)->Status();
  REQUIRE(status.ok());
  CHECK(status->metrics().at("refit_data_bytes_received_total") ==
        3.0 * (512 * 512 * 2 + b_bytes));
  auto sent = (*trainer)->Status();
  REQUIRE(sent.ok());
  CHECK(sent->metrics().at("refit_data_bytes_sent_total") == 3.0 * (512 * 512 * 2 + b_bytes));
}

}  // namespace
}  // namespace refit
