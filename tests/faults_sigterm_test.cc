// Fault suite (issue 18): SIGTERM under load. A trainer's node and an engine's node with a
// trainer publishing and an engine pulling and applying in a loop; both daemons get SIGTERM
// while versions are in flight. Each drains and exits 0 within 10 s (the time is a figure).
// $REFIT_FAULTS_ITERATIONS rounds (default 1).

#include <signal.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/faults.h"
#include "tests/testing/required.h"

namespace refit {
namespace {

using client::SharedMemory;
using client::Slice;
using std::chrono::milliseconds;
using testing::DaemonProcess;
using testing::MakeShm;

constexpr uint64_t kBytes = 64ull << 20;

}  // namespace

TEST_CASE("SIGTERM with publishes and pulls in flight drains within 10 s and exits 0",
          "[integration][faults][sigterm]") {
  std::vector<double> trainer_exit, engine_exit;
  const int rounds = testing::Iterations(1);
  for (int round = 0; round < rounds; ++round) {
    auto nodes = testing::StartPair({"--node=trainer-node"}, {"--node=engine-node"},
                                    {"UCX_TLS=tcp"}, {"UCX_TLS=tcp"});
    REQUIRE(nodes.ok());
    DaemonProcess& trainer_node = *nodes->trainer;
    DaemonProcess& engine_node = *nodes->engine;
    client::Client& tc = *nodes->trainer_client;
    client::Client& ec = *nodes->engine_client;
    SharedMemory src = MakeShm("sigterm", kBytes), dst = MakeShm("sigterm", kBytes);
    const std::vector<v1::TensorSlice> layout = {Slice("w", v1::BF16, {kBytes / 2})};
    auto s = tc.RegisterBuffer("m", v1::SOURCE, src.name(), layout, "trainer");
    auto d = ec.RegisterBuffer("m", v1::DESTINATION, dst.name(), layout, "engine");
    REQUIRE(s.ok());
    REQUIRE(d.ok());

    std::atomic<bool> stop{false};
    std::atomic<uint64_t> published{0}, applied{0};
    std::thread trainer([&] {
      for (uint64_t v = 1; !stop.load(); ++v) {
        testing::FillPattern(src, v);
        if (!tc.Publish("m", v, {*s}).ok()) return;
        published = v;
      }
    });
    std::thread engine([&] {
      uint64_t next = 1;
      while (!stop.load()) {
        auto got = ec.WaitForVersion("m", next, milliseconds(2000));
        if (!got.ok()) {
          if (got.status().code() == absl::StatusCode::kDeadlineExceeded) continue;
          return;
        }
        if (!ec.Apply("m", *got, {*d}).ok()) return;
        applied = *got;
        next = *got + 1;
      }
    });
    // Load for a while: several versions published and applied.
    for (int i = 0; i < 300 && applied.load() < 3; ++i)
      std::this_thread::sleep_for(milliseconds(50));
    CHECK(applied.load() >= 3);
    const double started = testing::Now();
    kill(engine_node.pid(), SIGTERM);
    kill(trainer_node.pid(), SIGTERM);
    const int engine_code = engine_node.Stop(SIGTERM, 20);
    engine_exit.push_back(testing::Now() - started);
    const int trainer_code = trainer_node.Stop(SIGTERM, 20);
    trainer_exit.push_back(testing::Now() - started);
    stop = true;
    trainer.join();
    engine.join();
    INFO("published " << published.load() << ", applied " << applied.load());
    CHECK(engine_code == 0);
    CHECK(trainer_code == 0);
    CHECK(engine_exit.back() < 10);
    CHECK(trainer_exit.back() < 10);
  }
  testing::PrintFigure("sigterm_engine_node_exit", engine_exit, "s");
  testing::PrintFigure("sigterm_trainer_node_exit", trainer_exit, "s");
}

}  // namespace refit
