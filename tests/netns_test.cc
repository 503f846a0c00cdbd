// Two daemons in two network namespaces joined by a veth pair: the bytes cross separate network
// stacks over TCP. Needs root and iproute2; where namespaces can't be made the test fails, naming
// what it could not do (never green without the transfer it checks).

#include <unistd.h>

#include <cstring>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/two_hosts.h"

namespace refit {
namespace {

using client::SharedMemory;
using client::Slice;
using std::chrono::milliseconds;
using testing::TwoHosts;

TEST_CASE("two daemons in two network namespaces sync over veth", "[integration][netns]") {
  TwoHosts hosts("refit");
  if (!hosts.ok) {
    FAIL(
        "cannot create network namespaces refit-* here (needs root and iproute2): the "
        "cross-namespace transfer was NOT tested");
  }
  const testing::HostNodes nodes = testing::StartHostNodes(hosts);
  client::Client& trainer = *nodes.trainer;
  client::Client& engine = *nodes.engine;
  constexpr int64_t kBytes = 8 << 20;
  auto src = SharedMemory::Create(testing::UniqueShmName("ns"), kBytes);
  auto dst = SharedMemory::Create(testing::UniqueShmName("ns"), kBytes);
  REQUIRE(src.ok());
  REQUIRE(dst.ok());
  auto s =
      trainer.RegisterBuffer("m", v1::SOURCE, src->name(), {Slice("w", v1::BF16, {kBytes / 2})});
  auto d = engine.RegisterBuffer("m", v1::DESTINATION, dst->name(),
                                 {Slice("w", v1::BF16, {kBytes / 2})});
  REQUIRE(s.ok());
  REQUIRE(d.ok());
  std::mt19937 rng(5);
  for (uint64_t v = 1; v <= 2; ++v) {
    for (int64_t i = 0; i < kBytes; ++i) src->data()[i] = static_cast<uint8_t>(rng());
    REQUIRE(trainer.Publish("m", v, {*s}).ok());
    REQUIRE(engine.WaitForVersion("m", v, milliseconds(30000)).ok());
    REQUIRE(engine.Apply("m", v, {*d}).ok());
    CHECK(std::memcmp(src->data(), dst->data(), kBytes) == 0);
  }
  auto status = engine.Status();
  REQUIRE(status.ok());
  REQUIRE(status->peers_size() == 1);
  CHECK(status->peers(0).node() == "host-a");
  CHECK(status->peers(0).address() == "192.0.2.1:7070");
  CHECK(status->metrics().at("refit_data_bytes_received_total") == 2.0 * kBytes);
}

}  // namespace
}  // namespace refit
