#include "tests/testing/two_nodes.h"

#include <arpa/inet.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <random>
#include <thread>

#include "catch2/catch.hpp"
#include "tests/testing/required.h"

namespace refit::testing {

using client::SharedMemory;
using client::Slice;
using std::chrono::milliseconds;

SharedMemory MakeShm(uint64_t size) { return MakeShm("2n", size); }

void FillRandom(SharedMemory& shm, uint32_t seed) {
  std::mt19937_64 rng(seed);
  uint64_t* p = reinterpret_cast<uint64_t*>(shm.data());
  for (uint64_t i = 0; i < shm.size() / 8; ++i) p[i] = rng();
}

int ListenPort(const DaemonProcess& d) {
  auto c = d.Connect();
  REQUIRE(c.ok());
  auto s = (*c)->Status();
  REQUIRE(s.ok());
  return s->listen_port();
}

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

bool SharedMemoryTls() {
  const char* tls = std::getenv("UCX_TLS");
  return tls != nullptr && std::string(tls).find("sm") != std::string::npos;
}

TwoNodes::TwoNodes() {
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

Pair StartSourceAndEngine(const std::vector<std::string>& source_env,
                          const std::vector<std::string>& engine_args) {
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

Registered RegisterWhole(DaemonProcess& daemon, v1::Role role, const SharedMemory& shm,
                         int64_t elements) {
  auto c = daemon.Connect();
  REQUIRE(c.ok());
  auto id = (*c)->RegisterBuffer("big", role, shm.name(), {Slice("w", v1::UINT8, {elements})});
  REQUIRE(id.ok());
  return {std::move(c).value(), *id};
}

BigModel::BigModel(DaemonProcess& source, DaemonProcess& engine, int64_t bytes)
    : bytes(bytes),
      src(MakeShm(bytes)),
      dst(MakeShm(bytes)),
      trainer(RegisterWhole(source, v1::SOURCE, src, bytes)),
      inference(RegisterWhole(engine, v1::DESTINATION, dst, bytes)) {
  WaitConnected(*inference.client, 1);
}

void BigModel::Publish(uint64_t version, int value) {
  std::memset(src.data(), value, bytes);
  REQUIRE(trainer.client->Publish("big", version, {trainer.id}).ok());
}

bool BigModel::DestinationIs(uint8_t value) const {
  return std::all_of(dst.data(), dst.data() + bytes, [&](uint8_t b) { return b == value; });
}

}  // namespace refit::testing
