// Fault suite (issue 18): a byte flipped in transit. The test build's data plane flips one
// byte of every Nth read that lands on the engine's node (REFIT_FAULT_TRANSIT_FLIP=1/N), before
// it is hashed, as a byte corrupted on the wire would be. Every flip is detected (the chunk
// fails the source's checksum: refit_pull_chunks_refetched_total counts it), refetched, and
// never applied: each version lands in the engine bit-exact.
// $REFIT_FAULTS_ITERATIONS versions (default 20; scripts/faults.sh runs 1,000).

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

constexpr uint64_t kBytes = 4 << 20;

}  // namespace

TEST_CASE("bytes flipped in transit are all detected, refetched and never applied",
          "[integration][faults][transit]") {
  auto nodes = testing::StartPair({"--node=trainer-node"}, {"--node=engine-node"}, {"UCX_TLS=tcp"},
                                  {"UCX_TLS=tcp", "REFIT_FAULT_TRANSIT_FLIP=1/2"});
  REQUIRE(nodes.ok());
  auto& trainer = *nodes->trainer_client;
  auto& engine = *nodes->engine_client;

  SharedMemory src = MakeShm("transit", kBytes), dst = MakeShm("transit", kBytes);
  const std::vector<v1::TensorSlice> layout = {Slice("w", v1::BF16, {kBytes / 2})};
  auto s = trainer.RegisterBuffer("m", v1::SOURCE, src.name(), layout, "trainer");
  auto d = engine.RegisterBuffer("m", v1::DESTINATION, dst.name(), layout, "engine");
  REQUIRE(s.ok());
  REQUIRE(d.ok());
  const int versions = testing::Iterations(20);
  int exact = 0;
  for (int v = 1; v <= versions; ++v) {
    testing::FillPattern(src, v);
    REQUIRE(trainer.Publish("m", v, {*s}).ok());
    auto got = engine.WaitForVersion("m", v, milliseconds(30000));
    INFO("version " << v << ": " << got.status().ToString());
    REQUIRE(got.ok());
    REQUIRE(engine.Apply("m", v, {*d}).ok());
    exact += testing::HoldsPattern(dst, v);
  }
  const double flips = testing::Metric(engine, "refit_test_transit_flips_total");
  const double refetched = testing::Metric(engine, "refit_pull_chunks_refetched_total");
  const double received = testing::Metric(engine, "refit_data_bytes_received_total");
  testing::PrintFigureText("transit_flips", std::to_string(static_cast<long>(flips)));
  testing::PrintFigureText("transit_chunks_refetched",
                           std::to_string(static_cast<long>(refetched)));
  testing::PrintFigureText("transit_versions_exact",
                           std::to_string(exact) + "/" + std::to_string(versions));
  testing::PrintFigureText("transit_bytes_received", std::to_string(static_cast<long>(received)));
  CHECK(exact == versions);          // never applied
  REQUIRE(flips >= versions / 2.0);  // the fault did fire
  // Each flip lands in one chunk and fails it: 100 % detected (and each refetched).
  CHECK(refetched == flips);
}

}  // namespace refit
