// What a model's version slots cost on a node: held + spare + in flight never pass
// (retain + 1) x the node's share, on a trainer's node and an engine's node, over full versions
// and deltas; a version that can't fit under --max-slot-memory is refused up front.

#include <cstring>

#include "catch2/catch.hpp"
#include "daemon/store/store.h"
#include "daemon/store/store_testing.h"

namespace refit {
namespace {

StoreOptions Options(uint32_t retain, uint64_t max_slot_bytes = 0) {
  StoreOptions options;
  options.retain = retain;
  options.max_slot_bytes = max_slot_bytes;
  options.node = "node";
  return options;
}

TensorSlice Whole(const std::string& name, uint64_t elements) {
  TensorSlice s;
  s.name = name;
  s.dtype = DType::kBF16;
  s.global_shape = {static_cast<int64_t>(elements)};
  return s;
}

std::unique_ptr<Region> Memory(uint64_t size) {
  auto region = AllocateHost(size);
  REQUIRE(region.ok());
  return std::move(region).value();
}

ModelInfo Info(const Store& store, const std::string& model) {
  for (const ModelInfo& info : store.Models()) {
    if (info.name == model) return info;
  }
  FAIL("no model " << model);
  return {};
}

// The bound, as Status reports it and as the slot pool holds it (one model: every slot).
void CheckBound(const Store& store, const Metrics& metrics, const std::string& model,
                uint64_t share, uint32_t retain) {
  const ModelInfo info = Info(store, model);
  INFO("held " << info.held_bytes << " spare " << info.spare_bytes << " in flight "
               << info.in_flight_bytes << " pool " << metrics.Get(kSlotMemoryBytes));
  CHECK(info.share_bytes == share);
  CHECK(info.budget_bytes == (retain + 1) * share);
  CHECK(info.held_bytes + info.spare_bytes + info.in_flight_bytes <= info.budget_bytes);
  CHECK(metrics.Get(kSlotMemoryBytes) <= static_cast<double>(info.budget_bytes));
  CHECK(metrics.Get(kSlotMemoryBytes) ==
        static_cast<double>(info.held_bytes + info.spare_bytes + info.in_flight_bytes));
}

TEST_CASE("a trainer's node holds at most (retain + 1) versions, the delta base included",
          "[store][memory]") {
  const uint32_t retain = GENERATE(1u, 2u);
  const uint64_t share = 4096;
  Metrics metrics;
  testing::SnapshotReader reader;  // snapshots for peers
  Store store(Options(retain), &metrics);
  store.AddListener(&reader);
  auto region = Memory(share);
  uint8_t* bytes = region->data();
  auto id = store.RegisterBuffer("m", Role::kSource, std::move(region), {Whole("w", share / 2)},
                                 "trainer");
  REQUIRE(id.ok());
  CheckBound(store, metrics, "m", share, retain);
  CHECK(Info(store, "m").spare_bytes == (retain + 1) * share);  // warmed for what comes

  for (uint64_t v = 1; v <= 6; ++v) {
    // The delta encoder holds the previous version (its base) while this one is published.
    std::shared_ptr<const LocalSnapshot> base;
    if (v > 1) {
      auto held = store.GetLocalSnapshot("m", v - 1);
      REQUIRE(held.ok());
      base = *held;
    }
    std::memset(bytes, static_cast<int>(v), share);
    REQUIRE(store.Publish("m", v, {*id}).ok());
    CheckBound(store, metrics, "m", share, retain);
    base.reset();  // encoded
    CheckBound(store, metrics, "m", share, retain);
    const ModelInfo info = Info(store, "m");
    CHECK(info.held_bytes == std::min<uint64_t>(v, retain) * share);
    CHECK(info.in_flight_bytes == 0);
  }
  // Steady state: the held versions and one spare slot for the next, no more.
  CHECK(metrics.Get(kSlotMemoryBytes) == static_cast<double>((retain + 1) * share));
}

// An engine's node: destinations for a model another node publishes.
struct Engine {
  explicit Engine(uint32_t retain, uint64_t max_slot_bytes = 0)
      : store(Options(retain, max_slot_bytes), &metrics) {
    store.AddListener(&recorder);
  }
  absl::StatusOr<std::string> Register(uint64_t bytes) {
    return store.RegisterBuffer("m", Role::kDestination, Memory(bytes), {Whole("w", bytes / 2)},
                                "engine");
  }
  void Sources(uint64_t bytes) {
    TensorSlice w = Whole("w", bytes / 2);
    w.offsets = {0};
    w.sizes = w.global_shape;
    w.buffer_strides = {1};
    store.SetRemoteSources(
        "trainer", "m",
        {{"trainer-1", std::make_shared<std::vector<TensorSlice>>(std::vector<TensorSlice>{w}),
          bytes}});
  }
  Metrics metrics;
  std::vector<PullJob> jobs;
  testing::PullRecorder recorder{&jobs};
  Store store;
};

TEST_CASE("an engine's node holds at most (retain + 1) versions over full and delta pulls",
          "[store][memory]") {
  const uint32_t retain = GENERATE(1u, 2u);
  const uint64_t share = 8192;
  Engine e(retain);
  REQUIRE(e.Register(share).ok());
  e.Sources(share);
  e.store.ReserveStaging("m");
  CheckBound(e.store, e.metrics, "m", share, retain);

  for (uint64_t v = 1; v <= 7; ++v) {
    // Every other version comes as a delta from the one held.
    std::vector<RemoteDeltaRef> deltas;
    if (v % 2 == 0) deltas.push_back({"trainer-1", v - 1, v, "delta-key", 100});
    e.store.AnnounceRemoteVersion("trainer", "m", v, {{"trainer-1", "key", share}}, deltas);
    REQUIRE(e.jobs.size() == v);
    const PullJob::Fetch& fetch = e.jobs.back().fetches.at(0);
    CHECK((fetch.base != nullptr) == (v % 2 == 0));
    // The data plane stages the version (a delta builds it from the base) ...
    auto slot = e.store.AcquireSlot(fetch.bytes);
    REQUIRE(slot.ok());
    if (fetch.base) std::memcpy((*slot)->data(), fetch.base->data(), fetch.bytes);
    CHECK(Info(e.store, "m").in_flight_bytes == share);
    CheckBound(e.store, e.metrics, "m", share, retain);
    // ... and the staging slot becomes the held version's slot: no second copy.
    e.store.FinishPull(e.jobs.back(), absl::OkStatus(), {*slot});
    slot->reset();
    e.jobs.back().fetches[0].base.reset();  // the data plane is done with the job
    REQUIRE(e.store.LatestVersion("m") == v);
    CheckBound(e.store, e.metrics, "m", share, retain);
    const ModelInfo info = Info(e.store, "m");
    CHECK(info.held_bytes == std::min<uint64_t>(v, retain) * share);
    CHECK(info.in_flight_bytes == 0);
  }
  CHECK(e.metrics.Get(kSlotMemoryBytes) == static_cast<double>((retain + 1) * share));

  // A failed pull's staging slot is kept only within the budget too.
  e.store.AnnounceRemoteVersion("trainer", "m", 8, {{"trainer-1", "key", share}});
  {
    auto slot = e.store.AcquireSlot(share);
    REQUIRE(slot.ok());
  }
  e.store.FinishPull(e.jobs.back(), absl::UnavailableError("the trainer went away"), {});
  CheckBound(e.store, e.metrics, "m", share, retain);
}

TEST_CASE("a model that can't fit under --max-slot-memory is refused up front, with numbers",
          "[store][memory]") {
  SECTION("a SOURCE buffer larger than the limit: RESOURCE_EXHAUSTED at RegisterBuffer") {
    Metrics metrics;
    Store store(Options(1, /*max_slot_bytes=*/16384), &metrics);
    auto small =
        store.RegisterBuffer("small", Role::kSource, Memory(4096), {Whole("w", 2048)}, "trainer");
    REQUIRE(small.ok());
    REQUIRE(store.Publish("small", 1, {*small}).ok());
    auto big =
        store.RegisterBuffer("big", Role::kSource, Memory(16384), {Whole("w", 8192)}, "trainer");
    INFO(big.status().ToString());
    CHECK(big.status().code() == absl::StatusCode::kResourceExhausted);
    const std::string message(big.status().message());
    CHECK(message.find("model big") != std::string::npos);
    CHECK(message.find("16384 bytes") != std::string::npos);
    CHECK(message.find("--max-slot-memory=16384") != std::string::npos);
    CHECK(message.find("4096 other models") != std::string::npos);
    // Nothing else changed: the other model keeps its version and publishes the next.
    CHECK(store.LatestVersion("small") == 1);
    REQUIRE(store.Publish("small", 2, {*small}).ok());
    for (const ModelInfo& info : store.Models()) CHECK(info.name != "big");
  }

  SECTION("an engine's next version that would not fit: refused before the pull starts") {
    const uint64_t share = 8192;
    Engine e(/*retain=*/1, /*max_slot_bytes=*/12288);  // 1.5 x the model
    REQUIRE(e.Register(share).ok());
    e.Sources(share);
    CHECK(Info(e.store, "m").memory_warning.find("--retain=1 needs 16384 bytes") !=
          std::string::npos);
    e.store.AnnounceRemoteVersion("trainer", "m", 1, {{"trainer-1", "key", share}});
    REQUIRE(e.jobs.size() == 1);
    auto slot = e.store.AcquireSlot(share);
    REQUIRE(slot.ok());
    e.store.FinishPull(e.jobs.back(), absl::OkStatus(), {*slot});
    slot->reset();
    REQUIRE(e.store.LatestVersion("m") == 1);
    CHECK(Info(e.store, "m").memory_warning.find("its next version would not fit") !=
          std::string::npos);

    e.store.AnnounceRemoteVersion("trainer", "m", 2, {{"trainer-1", "key", share}});
    CHECK(e.jobs.size() == 1);  // no pull started
    const ModelInfo info = Info(e.store, "m");
    CHECK(info.latest_version == 1);
    CHECK(info.abandoned_version == 2);
    INFO(info.abandoned_error);
    CHECK(info.abandoned_error.find("RESOURCE_EXHAUSTED") != std::string::npos);
    CHECK(info.abandoned_error.find("version 2 not pulled: its staging takes 8192 bytes") !=
          std::string::npos);
    CHECK(info.abandoned_error.find("8192 of --max-slot-memory=12288 are in use") !=
          std::string::npos);
    CHECK(e.metrics.Get(kSlotMemoryBytes) == 8192.0);  // version 1, still held
  }

  SECTION("an engine's destinations for a model too big for the limit: RegisterBuffer refuses") {
    Engine e(/*retain=*/1, /*max_slot_bytes=*/4096);
    e.Sources(8192);
    auto refused = e.Register(8192);
    INFO(refused.status().ToString());
    CHECK(refused.status().code() == absl::StatusCode::kResourceExhausted);
    CHECK(refused.status().message().find("one version takes 8192 bytes") != std::string::npos);
  }
}

}  // namespace
}  // namespace refit
