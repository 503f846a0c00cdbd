// Two refitd processes as a trainer's node and an engine's node (--retain=1): what the model's
// version slots cost on each, as Status reports it (held, spare, in flight, within
// (retain + 1) x the node's share), over full and delta versions; and a model that can't fit
// under the engine's --max-slot-memory is refused with the numbers, before anything is pulled,
// while the other model keeps arriving.

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

constexpr uint64_t kMiB = 1 << 20;

v1::ModelStatus ModelOf(client::Client& client, const std::string& model) {
  auto m = testing::ModelStatusOf(client, model);
  REQUIRE(m.ok());
  return *m;
}

// Until `ok(status of model)` or 10 s; the last status either way.
template <typename Ok>
v1::ModelStatus Eventually(client::Client& client, const std::string& model, Ok ok) {
  v1::ModelStatus m;
  for (int i = 0; i < 200; ++i) {
    m = ModelOf(client, model);
    if (ok(m)) break;
    std::this_thread::sleep_for(milliseconds(50));
  }
  return m;
}

void CheckWithinBudget(const v1::ModelStatus& m, uint64_t share) {
  INFO(m.model() << ": held " << m.held_bytes() << " spare " << m.spare_bytes() << " in flight "
                 << m.in_flight_bytes() << " budget " << m.budget_bytes());
  CHECK(m.share_bytes() == share);
  CHECK(m.budget_bytes() == 2 * share);  // --retain=1
  CHECK(m.held_bytes() + m.spare_bytes() + m.in_flight_bytes() <= m.budget_bytes());
}

TEST_CASE("each node's slots stay within (retain + 1) x its share; too big is refused early",
          "[integration][memory]") {
  auto pair = testing::StartPair({"--node=trainer-node", "--retain=1"},
                                 {"--node=engine-node", "--retain=1", "--max-slot-memory=5MiB"});
  REQUIRE(pair.ok());
  client::Client& trainer = *pair->trainer_client;
  client::Client& engine = *pair->engine_client;

  const uint64_t share = 2 * kMiB;
  SharedMemory src = MakeShm("mem", share);
  SharedMemory dst = MakeShm("mem", share);
  auto s = trainer.RegisterBuffer("m", v1::SOURCE, src.name(),
                                  {Slice("w", v1::BF16, {int64_t{share / 2}})}, "trainer");
  REQUIRE(s.ok());
  auto d = engine.RegisterBuffer("m", v1::DESTINATION, dst.name(),
                                 {Slice("w", v1::BF16, {int64_t{share / 2}})}, "engine");
  REQUIRE(d.ok());
  // A second model, 4 MiB: its destinations come first; the engine's 5 MiB of slots hold m's
  // version and could take one of big's alone, but not both.
  SharedMemory big_dst = MakeShm("mem", 4 * kMiB);
  auto bd = engine.RegisterBuffer("big", v1::DESTINATION, big_dst.name(),
                                  {Slice("w", v1::BF16, {int64_t{2 * kMiB}})}, "engine");
  REQUIRE(bd.ok());

  std::mt19937_64 rng(7);
  uint16_t* w = reinterpret_cast<uint16_t*>(src.data());
  for (uint64_t i = 0; i < share / 2; ++i) w[i] = static_cast<uint16_t>(rng());
  for (uint64_t v = 1; v <= 5; ++v) {
    if (v > 1) {
      for (int i = 0; i < 1000; ++i) ++w[rng() % (share / 2)];  // a delta's worth
    }
    REQUIRE(trainer.Publish("m", v, {*s}).ok());
    auto got = engine.WaitForVersion("m", v, milliseconds(20000));
    REQUIRE(got.ok());
    REQUIRE(engine.Apply("m", v, {*d}).ok());
    CHECK(std::memcmp(dst.data(), src.data(), share) == 0);
    CheckWithinBudget(ModelOf(trainer, "m"), share);
    CheckWithinBudget(ModelOf(engine, "m"), share);
  }
  // Once the delta encoder and the pull have let go: one version held, one slot spare for the
  // next, nothing in flight, on either node.
  for (client::Client* c : {&trainer, &engine}) {
    const v1::ModelStatus m =
        Eventually(*c, "m", [](const v1::ModelStatus& m) { return m.in_flight_bytes() == 0; });
    CHECK(m.held_bytes() == share);
    CHECK(m.spare_bytes() == share);
    CHECK(m.in_flight_bytes() == 0);
  }
  // refitctl status says the same.
  const std::string refitctl = testing::RunfilePath("client/refitctl");
  auto shown = testing::RunCommand({refitctl, "--socket=" + pair->engine->socket(), "status"});
  CHECK(shown.exit_code == 0);
  INFO(shown.out);
  CHECK(shown.out.find("slots: 2.0 MiB held, 2.0 MiB spare, 0 B in flight; budget 4.0 MiB "
                       "(retain + 1 versions of 2.0 MiB)") != std::string::npos);
  auto received = engine.Status();
  REQUIRE(received.ok());
  CHECK(received->metrics().at("refit_delta_versions_total") >= 1);

  // big: one version (4 MiB) beside m's held 2 MiB passes the engine's 5 MiB. Said in Status as
  // soon as the trainer's layout is known, and refused before the pull, with the numbers.
  SharedMemory big_src = MakeShm("mem", 4 * kMiB);
  auto bs = trainer.RegisterBuffer("big", v1::SOURCE, big_src.name(),
                                   {Slice("w", v1::BF16, {int64_t{2 * kMiB}})}, "trainer");
  REQUIRE(bs.ok());
  const v1::ModelStatus warned = Eventually(
      engine, "big", [](const v1::ModelStatus& m) { return !m.memory_warning().empty(); });
  INFO(warned.memory_warning());
  CHECK(warned.memory_warning().find("its next version would not fit") != std::string::npos);
  auto warned_cli = testing::RunCommand({refitctl, "--socket=" + pair->engine->socket(), "status"});
  CHECK(warned_cli.out.find("  memory: its next version would not fit") != std::string::npos);
  REQUIRE(trainer.Publish("big", 1, {*bs}).ok());
  const v1::ModelStatus refused =
      Eventually(engine, "big", [](const v1::ModelStatus& m) { return m.abandoned_version(); });
  INFO(refused.abandoned_error());
  CHECK(refused.abandoned_version() == 1);
  CHECK(refused.latest_version() == 0);
  CHECK(refused.abandoned_error().find("RESOURCE_EXHAUSTED") != std::string::npos);
  CHECK(refused.abandoned_error().find("its staging takes 4194304 bytes") != std::string::npos);
  CHECK(refused.abandoned_error().find("--max-slot-memory=5242880") != std::string::npos);
  auto nothing = engine.Status();
  REQUIRE(nothing.ok());
  CHECK(nothing->metrics().at("refit_slot_memory_bytes") <= 5.0 * kMiB);

  // A third engine buffer for big, registered now that its layout is known and too big for the
  // slots left: RESOURCE_EXHAUSTED at RegisterBuffer. Nothing else changed: m's next version
  // still arrives and applies.
  SharedMemory huge_dst = MakeShm("mem", 8 * kMiB);
  auto huge_src = MakeShm("mem", 8 * kMiB);
  auto hs = trainer.RegisterBuffer("huge", v1::SOURCE, huge_src.name(),
                                   {Slice("w", v1::BF16, {int64_t{4 * kMiB}})}, "trainer");
  REQUIRE(hs.ok());
  absl::StatusOr<std::string> hd = absl::UnknownError("not registered");
  for (int i = 0; i < 200; ++i) {
    hd = engine.RegisterBuffer("huge", v1::DESTINATION, huge_dst.name(),
                               {Slice("w", v1::BF16, {int64_t{4 * kMiB}})}, "engine");
    if (!hd.ok()) break;  // the trainer's layout is known here now
    REQUIRE(engine.ReleaseBuffer(*hd).ok());
    std::this_thread::sleep_for(milliseconds(50));
  }
  INFO(hd.status().ToString());
  CHECK(hd.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK(std::string(hd.status().message()).find("one version takes 8388608 bytes") !=
        std::string::npos);

  for (int i = 0; i < 1000; ++i) ++w[rng() % (share / 2)];
  REQUIRE(trainer.Publish("m", 6, {*s}).ok());
  auto got = engine.WaitForVersion("m", 6, milliseconds(20000));
  REQUIRE(got.ok());
  REQUIRE(engine.Apply("m", 6, {*d}).ok());
  CHECK(std::memcmp(dst.data(), src.data(), share) == 0);
  CheckWithinBudget(ModelOf(engine, "m"), share);
}

}  // namespace
}  // namespace refit
