// Two refitd processes, the engine's with --delta-base=destination (issue 20, part 2): five
// versions, four of them deltas applied to the engine's own buffers; each lands bit-exact, and
// between versions the engine's node holds no copy of the model (its slots: at most one
// version, the one being pulled). A destination the engine scribbled on between versions is no
// base: a full pull, counted in refit_delta_base_fallbacks_total, and still bit-exact.

#include <stdlib.h>

#include <cstring>
#include <random>
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

constexpr uint64_t kShare = 4 << 20;  // tensor "w", bf16, as two DESTINATION halves

double Metric(client::Client& client, const std::string& name) {
  auto status = client.Status();
  REQUIRE(status.ok());
  auto it = status->metrics().find(name);
  REQUIRE(it != status->metrics().end());
  return it->second;
}

TEST_CASE(
    "the engine's buffers are the delta base: 1 x plus the deltas, bit-exact, and a "
    "scribbled destination forces a full pull",
    "[integration][delta_base]") {
  auto pair = testing::StartPair({"--node=r20-trainer", "--retain=2"},
                                 {"--node=r20-engine", "--retain=2", "--delta-base=m=destination"});
  REQUIRE(pair.ok());
  client::Client& trainer = *pair->trainer_client;
  client::Client& engine = *pair->engine_client;

  const int64_t elements = kShare / 2;
  SharedMemory src = MakeShm("r20dbase", kShare);
  SharedMemory lo = MakeShm("r20dbase", kShare / 2);
  SharedMemory hi = MakeShm("r20dbase", kShare / 2);
  auto s = trainer.RegisterBuffer("m", v1::SOURCE, src.name(), {Slice("w", v1::BF16, {elements})},
                                  "trainer");
  REQUIRE(s.ok());
  // Resharded: each engine buffer holds half of "w".
  auto half = [&](int64_t first) {
    return Slice("w", v1::BF16, {elements}, 0, {first}, {elements / 2});
  };
  auto d_lo = engine.RegisterBuffer("m", v1::DESTINATION, lo.name(), {half(0)}, "engine");
  REQUIRE(d_lo.ok());
  auto d_hi =
      engine.RegisterBuffer("m", v1::DESTINATION, hi.name(), {half(elements / 2)}, "engine");
  REQUIRE(d_hi.ok());
  auto exact = [&] {
    return std::memcmp(lo.data(), src.data(), kShare / 2) == 0 &&
           std::memcmp(hi.data(), src.data() + kShare / 2, kShare / 2) == 0;
  };

  std::mt19937_64 rng(20);
  uint16_t* w = reinterpret_cast<uint16_t*>(src.data());
  for (int64_t i = 0; i < elements; ++i) w[i] = static_cast<uint16_t>(rng());
  auto next_version = [&](uint64_t v) {
    if (v > 1) {
      for (int i = 0; i < 2000; ++i) ++w[rng() % elements];  // a delta's worth
    }
    REQUIRE(trainer.Publish("m", v, {*s}).ok());
    auto got = engine.WaitForVersion("m", v, milliseconds(20000));
    REQUIRE(got.ok());
    REQUIRE(*got == v);
    REQUIRE(engine.Apply("m", v, {*d_lo, *d_hi}).ok());
    CHECK(exact());
  };
  for (uint64_t v = 1; v <= 5; ++v) {
    next_version(v);
    const auto status_m = testing::ModelStatusOf(engine, "m");
    REQUIRE(status_m.ok());
    const v1::ModelStatus& m = *status_m;
    INFO("version " << v << ": held " << m.held_bytes() << " spare " << m.spare_bytes()
                    << " in flight " << m.in_flight_bytes());
    CHECK(m.delta_base() == "destination");
    CHECK(m.destination_base_version() == v);
    CHECK(m.held_bytes() == 0);  // the destinations are the copy
    // At most one version's slots on the engine's node, ever (the one pulled, built in place).
    CHECK(m.held_bytes() + m.spare_bytes() + m.in_flight_bytes() <= kShare);
    CHECK(Metric(engine, "refit_slot_memory_bytes") <= static_cast<double>(kShare));
  }
  CHECK(Metric(engine, "refit_delta_versions_total") == 4);
  CHECK(Metric(engine, "refit_delta_base_fallbacks_total") == 0);
  const double full_before = Metric(engine, "refit_full_versions_total");

  // refitctl status says which base the model uses.
  const std::string refitctl = testing::RunfilePath("client/refitctl");
  auto shown = testing::RunCommand({refitctl, "--socket=" + pair->engine->socket(), "status"});
  CHECK(shown.exit_code == 0);
  INFO(shown.out);
  CHECK(shown.out.find("delta base: destination (version 5 held only in the DESTINATION "
                       "buffers)") != std::string::npos);

  // The engine writes into its second buffer between versions: that is no base any more.
  hi.data()[12345] ^= 0x5a;
  next_version(6);
  CHECK(Metric(engine, "refit_delta_base_fallbacks_total") == 1);
  CHECK(Metric(engine, "refit_full_versions_total") == full_before + 1);
  CHECK(testing::ModelStatusOf(engine, "m")->held_bytes() == 0);
  // And the version after is a delta on the destinations again.
  next_version(7);
  CHECK(Metric(engine, "refit_delta_versions_total") == 5);
  CHECK(Metric(engine, "refit_delta_base_fallbacks_total") == 1);
  CHECK(Metric(engine, "refit_slot_memory_bytes") <= static_cast<double>(kShare));
}

TEST_CASE(
    "Verify answers after the held copy was released: against the trainer's digests, OK, then "
    "DATA_LOSS for a flipped destination byte",
    "[integration][delta_base][verify]") {
  // Issue 32 item 3: the engine's node keeps no copy of the version its destinations hold
  // (--delta-base=destination released it after the Apply); Verify rebuilds the version from
  // the destinations and checks it against the XXH3 digests the trainer's node took at Publish
  // (as pulled and verified here), so it still answers, over gRPC and in refitctl.
  auto pair =
      testing::StartPair({"--node=r32v-trainer", "--retain=2"},
                         {"--node=r32v-engine", "--retain=2", "--delta-base=m=destination"});
  REQUIRE(pair.ok());
  client::Client& trainer = *pair->trainer_client;
  client::Client& engine = *pair->engine_client;
  const int64_t elements = kShare / 2;
  SharedMemory src = MakeShm("r20dbase", kShare);
  SharedMemory lo = MakeShm("r20dbase", kShare / 2);
  SharedMemory hi = MakeShm("r20dbase", kShare / 2);
  auto s = trainer.RegisterBuffer("m", v1::SOURCE, src.name(), {Slice("w", v1::BF16, {elements})},
                                  "trainer");
  REQUIRE(s.ok());
  auto half = [&](int64_t first) {
    return Slice("w", v1::BF16, {elements}, 0, {first}, {elements / 2});
  };
  auto d_lo = engine.RegisterBuffer("m", v1::DESTINATION, lo.name(), {half(0)}, "engine");
  auto d_hi =
      engine.RegisterBuffer("m", v1::DESTINATION, hi.name(), {half(elements / 2)}, "engine");
  REQUIRE(d_lo.ok());
  REQUIRE(d_hi.ok());
  std::mt19937_64 rng(32);
  uint16_t* w = reinterpret_cast<uint16_t*>(src.data());
  for (int64_t i = 0; i < elements; ++i) w[i] = static_cast<uint16_t>(rng());
  auto publish_and_apply = [&](uint64_t v) {
    REQUIRE(trainer.Publish("m", v, {*s}).ok());
    auto got = engine.WaitForVersion("m", v, milliseconds(20000));
    REQUIRE(got.ok());
    REQUIRE(engine.Apply("m", v, {*d_lo, *d_hi}).ok());
    REQUIRE(std::memcmp(lo.data(), src.data(), kShare / 2) == 0);
    REQUIRE(std::memcmp(hi.data(), src.data() + kShare / 2, kShare / 2) == 0);
  };
  publish_and_apply(1);
  for (int i = 0; i < 2000; ++i) ++w[rng() % elements];
  publish_and_apply(2);  // a delta applied to the destinations
  const auto status_m = testing::ModelStatusOf(engine, "m");
  REQUIRE(status_m.ok());
  REQUIRE(status_m->held_bytes() == 0);  // the held copy is gone: the destinations are it
  REQUIRE(status_m->destination_base_version() == 2);

  auto verified = engine.Verify("m");
  INFO(verified.status().ToString());
  REQUIRE(verified.ok());
  REQUIRE(verified->buffers_size() == 2);
  for (const auto& b : verified->buffers()) {
    CHECK(b.checked());
    CHECK(b.version() == 2);
    CHECK(b.stale_tensors().empty());
  }
  const std::string refitctl = testing::RunfilePath("client/refitctl");
  auto ok = testing::RunCommand({refitctl, "--socket=" + pair->engine->socket(), "verify", "m"});
  INFO(ok.out << ok.err);
  CHECK(ok.exit_code == 0);
  CHECK(ok.out.find("version 2  ok") != std::string::npos);

  // One byte of the second half flipped by someone else: DATA_LOSS naming that buffer and
  // tensor, not the other buffer; nothing is written, refitd serves on.
  hi.data()[777] ^= 0x10;
  const std::vector<uint8_t> lo_before(lo.data(), lo.data() + kShare / 2);
  const std::vector<uint8_t> hi_before(hi.data(), hi.data() + kShare / 2);
  auto flipped = engine.Verify("m");
  REQUIRE_FALSE(flipped.ok());
  CHECK(flipped.status().code() == absl::StatusCode::kDataLoss);
  const std::string message(flipped.status().message());
  INFO(message);
  CHECK(message.find("buffer " + *d_hi + ": w") != std::string::npos);
  CHECK(message.find(*d_lo) == std::string::npos);
  auto bad = testing::RunCommand({refitctl, "--socket=" + pair->engine->socket(), "verify", "m"});
  INFO(bad.out << bad.err);
  CHECK(bad.exit_code == 1);
  CHECK(bad.err.find(*d_hi) != std::string::npos);
  CHECK(std::memcmp(lo.data(), lo_before.data(), lo_before.size()) == 0);
  CHECK(std::memcmp(hi.data(), hi_before.data(), hi_before.size()) == 0);
  CHECK(testing::ModelStatusOf(engine, "m").ok());

  // The next version (a full pull: the flipped destination is no base) puts it right.
  for (int i = 0; i < 2000; ++i) ++w[rng() % elements];
  publish_and_apply(3);
  auto again = engine.Verify("m");
  INFO(again.status().ToString());
  CHECK(again.ok());
}

TEST_CASE("--delta-base is refused at start with a clear error", "[integration][delta_base]") {
  char dir[] = "/tmp/r20-delta-base-XXXXXX";
  REQUIRE(mkdtemp(dir) != nullptr);
  auto bad = testing::RunCommand({testing::RunfilePath("daemon/refitd"), "--node=r20-bad",
                                  std::string("--socket=") + dir + "/x.sock",
                                  "--listen=127.0.0.1:0", "--delta-base=m=somewhere"});
  INFO(bad.err);
  CHECK(bad.exit_code == 1);
  CHECK(bad.err.find("'m=somewhere' has no mode held|destination") != std::string::npos);
}

}  // namespace
}  // namespace refit
