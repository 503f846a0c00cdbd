// --delta-base=destination in the store: once every DESTINATION buffer holds the newest version
// its held copy is released, the next delta's base is rebuilt from the destinations and checked
// against that version's digests; a destination written since, or one that never got the
// version, means a full pull; the destinations only ever see whole versions.

#include <cstring>

#include "catch2/catch.hpp"
#include "daemon/store/store.h"
#include "daemon/store/store_testing.h"

namespace refit {
namespace {

constexpr uint64_t kShare = 8192;  // the trainer's one SOURCE buffer: tensor "w", bf16

uint8_t ByteOf(uint64_t version, uint64_t i) { return static_cast<uint8_t>(i * 7 + version * 13); }

std::vector<uint8_t> VersionBytes(uint64_t version) {
  std::vector<uint8_t> out(kShare);
  for (uint64_t i = 0; i < kShare; ++i) out[i] = ByteOf(version, i);
  return out;
}

// Elements [first, first + count) of "w" (kShare / 2 bf16 elements).
TensorSlice Part(uint64_t first, uint64_t count) {
  TensorSlice s;
  s.name = "w";
  s.dtype = DType::kBF16;
  s.global_shape = {static_cast<int64_t>(kShare / 2)};
  s.offsets = {static_cast<int64_t>(first)};
  s.sizes = {static_cast<int64_t>(count)};
  s.buffer_strides = {1};
  return s;
}

// "w" as 16 x 256, columns [first, first + count) of it: strided copies.
constexpr int64_t kRows = 16, kCols = 256;
TensorSlice Columns(int64_t first, int64_t count) {
  TensorSlice s;
  s.name = "w";
  s.dtype = DType::kBF16;
  s.global_shape = {kRows, kCols};
  s.offsets = {0, first};
  s.sizes = {kRows, count};
  s.buffer_strides = {count, 1};
  return s;
}

// An engine's node with --delta-base=destination, resharded: two DESTINATION buffers, each one
// half of "w" (its first and second half, or with `columns` its left and right columns).
struct Engine {
  explicit Engine(bool columns = false) : store(Options(), &metrics), columns(columns) {
    store.AddListener(&recorder);
    for (int half = 0; half < 2; ++half) Register(half);
    const TensorSlice source = columns ? Columns(0, kCols) : Part(0, kShare / 2);
    store.SetRemoteSources(
        "trainer", "m",
        {{"trainer-1", std::make_shared<std::vector<TensorSlice>>(std::vector<TensorSlice>{source}),
          kShare}});
  }
  static StoreOptions Options() {
    StoreOptions options;
    options.retain = 2;
    options.node = "engine";
    REQUIRE(ParseDeltaBase("destination", &options.delta_base, &options.delta_base_models).ok());
    return options;
  }
  void Register(int half) {
    auto region = AllocateHost(kShare / 2);
    REQUIRE(region.ok());
    bytes[half] = (*region)->data();
    std::memset(bytes[half], 0, kShare / 2);
    auto id = store.RegisterBuffer(
        "m", Role::kDestination, std::move(region).value(),
        {columns ? Columns(half * kCols / 2, kCols / 2) : Part(half * kShare / 4, kShare / 4)},
        "engine");
    REQUIRE(id.ok());
    ids[half] = *id;
  }
  // The trainer announces `version`, with a delta from the one before when `delta`.
  const PullJob::Fetch& Announce(uint64_t version, bool delta) {
    std::vector<RemoteDeltaRef> deltas;
    if (delta) deltas.push_back({"trainer-1", version - 1, version, "delta-key", 100});
    const size_t before = jobs.size();
    store.AnnounceRemoteVersion("trainer", "m", version, {{"trainer-1", "key", kShare}}, deltas);
    REQUIRE(jobs.size() == before + 1);
    return jobs.back().fetches.at(0);
  }
  // The data plane's part: stage `version` (into `slot` when given) and finish the pull.
  void Finish(uint64_t version, std::shared_ptr<Region> slot = nullptr) {
    if (!slot) {
      auto acquired = store.AcquireSlot(kShare);
      REQUIRE(acquired.ok());
      slot = *acquired;
    }
    const std::vector<uint8_t> want = VersionBytes(version);
    std::memcpy(slot->data(), want.data(), kShare);
    store.FinishPull(jobs.back(), absl::OkStatus(), {slot});
    jobs.back().fetches[0].base.reset();
    REQUIRE(store.LatestVersion("m") == version);
  }
  // Where byte i of destination `half` is in the source: the same byte of its half, or of its
  // columns (kCols bytes of each row: 128 bf16 columns).
  uint64_t At(int half, uint64_t i) const {
    return columns ? i / kCols * 2 * kCols + half * kCols + i % kCols : half * kShare / 2 + i;
  }
  // Both destinations hold `version` exactly.
  bool Holds(uint64_t version) const {
    for (int half = 0; half < 2; ++half) {
      for (uint64_t i = 0; i < kShare / 2; ++i) {
        if (bytes[half][i] != ByteOf(version, At(half, i))) return false;
      }
    }
    return true;
  }
  ModelInfo Info() const {
    for (const ModelInfo& info : store.Models()) {
      if (info.name == "m") return info;
    }
    FAIL("no model m");
    return {};
  }
  Metrics metrics;
  std::vector<PullJob> jobs;
  testing::PullRecorder recorder{&jobs};
  Store store;
  const bool columns;
  uint8_t* bytes[2] = {nullptr, nullptr};
  std::string ids[2];
};

TEST_CASE("--delta-base parses one mode, or modes per model, and refuses anything else",
          "[store][delta_base]") {
  DeltaBase base = DeltaBase::kHeld;
  std::map<std::string, DeltaBase> models;
  REQUIRE(ParseDeltaBase("held", &base, &models).ok());
  CHECK(base == DeltaBase::kHeld);
  REQUIRE(ParseDeltaBase("destination,critic=held", &base, &models).ok());
  CHECK(base == DeltaBase::kDestination);
  CHECK(models == std::map<std::string, DeltaBase>{{"critic", DeltaBase::kHeld}});
  REQUIRE(ParseDeltaBase("policy=destination", &base, &models).ok());
  CHECK(base == DeltaBase::kHeld);
  CHECK(models.at("policy") == DeltaBase::kDestination);
  for (const char* bad :
       {"", "dest", "held,destination", "p=held,p=held", "=held", "p=", "destination,", "p=gpu"}) {
    INFO(bad);
    absl::Status status = ParseDeltaBase(bad, &base, &models);
    CHECK(status.code() == absl::StatusCode::kInvalidArgument);
    CHECK(status.message().find("--delta-base=") != std::string::npos);
  }
}

TEST_CASE("the destinations are the delta base once every one holds the version",
          "[store][delta_base]") {
  const bool columns = GENERATE(false, true);  // contiguous copies, or strided ones
  INFO("columns " << columns);
  Engine e(columns);
  CHECK(e.Info().delta_base == "destination");
  CHECK_FALSE(e.Announce(1, false).destination_base);  // nothing to start from
  e.Finish(1);
  // One destination applied: the held copy stays (the other still needs it).
  REQUIRE(e.store.Apply("m", 1, {e.ids[0]}).ok());
  CHECK(e.Info().held_bytes == kShare);
  CHECK(e.Info().destination_base_version == 0);
  REQUIRE(e.store.Apply("m", 1, {e.ids[1]}).ok());
  REQUIRE(e.Holds(1));
  CHECK(e.Info().held_bytes == 0);
  CHECK(e.Info().destination_base_version == 1);
  // The held copy is gone: an Apply of that version again says why.
  auto again = e.store.Apply("m", 1, {e.ids[0], e.ids[1]});
  CHECK(again.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(again.status().message().find("--delta-base=destination") != std::string::npos);
  // Verify still answers: the destinations against the digests of the released copy.
  auto verified = e.store.Verify("m");
  INFO(verified.status().ToString());
  REQUIRE(verified.ok());
  REQUIRE(verified->size() == 2);
  for (const VerifyResult& r : *verified) {
    CHECK(r.checked);
    CHECK(r.version == 1);
  }

  for (uint64_t v = 2; v <= 5; ++v) {
    const PullJob::Fetch& fetch = e.Announce(v, true);
    CHECK(fetch.destination_base);
    CHECK(fetch.base == nullptr);
    CHECK(fetch.base_version == v - 1);
    auto base = e.store.BaseFromDestinations("m", fetch);
    REQUIRE(base.ok());
    CHECK(std::memcmp((*base)->data(), VersionBytes(v - 1).data(), kShare) == 0);
    // The base slot is the staging slot: at most one version's slots on the node (1 x).
    CHECK(e.metrics.Get(kSlotMemoryBytes) == static_cast<double>(kShare));
    e.Finish(v, *base);  // the deltas applied in place
    base->reset();
    // Never torn: until the Apply the engine sees the previous version, whole.
    CHECK(e.Holds(v - 1));
    REQUIRE(e.store.Apply("m", v, {e.ids[0], e.ids[1]}).ok());
    CHECK(e.Holds(v));
    CHECK(e.Info().held_bytes == 0);
    CHECK(e.metrics.Get(kSlotMemoryBytes) == static_cast<double>(kShare));  // one spare
  }
  CHECK(e.metrics.Get(kDeltaBaseFallbacks) == 0);
}

TEST_CASE("a destination written since its Apply is no base: named, and a full pull follows",
          "[store][delta_base]") {
  const bool columns = GENERATE(false, true);  // contiguous copies, or strided ones
  INFO("columns " << columns);
  Engine e(columns);
  e.Announce(1, false);
  e.Finish(1);
  REQUIRE(e.store.Apply("m", 1, {e.ids[0], e.ids[1]}).ok());
  e.bytes[1][10] ^= 0xff;  // the engine scribbles on its second half
  // Verify finds it with the held copy released (against the digests taken before).
  auto verified = e.store.Verify("m");
  CHECK(verified.status().code() == absl::StatusCode::kDataLoss);
  CHECK(verified.status().message().find("buffer " + e.ids[1] + ": w") != std::string::npos);
  const PullJob::Fetch& fetch = e.Announce(2, true);
  REQUIRE(fetch.destination_base);
  auto base = e.store.BaseFromDestinations("m", fetch);
  INFO(base.status().ToString());
  CHECK(base.status().code() == absl::StatusCode::kFailedPrecondition);
  CHECK(base.status().message().find("buffer " + e.ids[1] + ": w") != std::string::npos);
  // Contiguous copies name just the buffer written; strided ones, every buffer whose copies
  // share the range that differs (here both halves interleave in every row).
  if (!columns) CHECK(base.status().message().find(e.ids[0]) == std::string::npos);
  // The data plane pulls in full; the engine still sees what it wrote until the Apply.
  e.Finish(2);
  CHECK(e.bytes[1][10] == static_cast<uint8_t>(ByteOf(1, e.At(1, 10)) ^ 0xff));
  REQUIRE(e.store.Apply("m", 2, {e.ids[0], e.ids[1]}).ok());
  CHECK(e.Holds(2));
  CHECK(e.Info().destination_base_version == 2);
}

TEST_CASE("without an Apply of the newest version the destinations are no base",
          "[store][delta_base]") {
  Engine e;
  e.Announce(1, false);
  e.Finish(1);
  SECTION("not applied yet: the held copy (kept for that Apply) is the base") {
    const PullJob::Fetch& fetch = e.Announce(2, true);
    CHECK(fetch.base != nullptr);
    CHECK_FALSE(fetch.destination_base);
    CHECK(e.metrics.Get(kDeltaBaseFallbacks) == 0);
  }
  SECTION("applied, then a buffer registered again (it never got it): a full pull, counted") {
    REQUIRE(e.store.Apply("m", 1, {e.ids[0], e.ids[1]}).ok());
    REQUIRE(e.Info().held_bytes == 0);
    REQUIRE(e.store.ReleaseBuffer(e.ids[1]).ok());
    e.Register(1);
    const PullJob::Fetch& fetch = e.Announce(2, true);
    CHECK(fetch.base == nullptr);
    CHECK_FALSE(fetch.destination_base);
    CHECK(fetch.deltas.empty());
    CHECK(e.metrics.Get(kDeltaBaseFallbacks) == 1);
    e.Finish(2);
    REQUIRE(e.store.Apply("m", 2, {e.ids[0], e.ids[1]}).ok());
    CHECK(e.Holds(2));
  }
  SECTION("a buffer released after the pull was planned: BaseFromDestinations refuses") {
    REQUIRE(e.store.Apply("m", 1, {e.ids[0], e.ids[1]}).ok());
    const PullJob::Fetch& fetch = e.Announce(2, true);
    REQUIRE(fetch.destination_base);
    REQUIRE(e.store.ReleaseBuffer(e.ids[0]).ok());  // its owner may write it at will now
    auto base = e.store.BaseFromDestinations("m", fetch);
    INFO(base.status().ToString());
    CHECK(base.status().code() == absl::StatusCode::kFailedPrecondition);
  }
}

}  // namespace
}  // namespace refit

namespace refit {
namespace {

TEST_CASE("a peer's delta from a version to itself never chains: the pull is planned in full",
          "[store][delta_base][hostile]") {
  // The store looks for deltas leading from the version it holds to the announced one. A delta
  // 1 -> 1 (a peer's, unchecked) made that search loop forever under the store's lock.
  Engine e;
  e.Announce(1, false);
  e.Finish(1);
  std::vector<RemoteDeltaRef> deltas = {{"trainer-1", 1, 1, "loop-key", 100}};
  const size_t before = e.jobs.size();
  e.store.AnnounceRemoteVersion("trainer", "m", 2, {{"trainer-1", "key", kShare}}, deltas);
  REQUIRE(e.jobs.size() == before + 1);
  CHECK(e.jobs.back().fetches.at(0).deltas.empty());
}

}  // namespace
}  // namespace refit
