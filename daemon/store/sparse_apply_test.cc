// Sparse Apply: destinations that hold version N-1 get only the elements N changed, resharded
// (row and column TP shards, a strided fused destination, fp32 -> bf16 conversion), and end
// bit-exact with a full Apply of N into fresh buffers of the same layout; a dense step, a
// destination that does not hold N-1 and a skipped version take the full copy. Each case runs
// with the writes prepared as the version completed (StoreOptions::prepare_sparse: the engine's
// pause is the writing alone) and collected inside the Apply.

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "daemon/store/sparse_testing.h"
#include "daemon/store/store.h"

namespace refit {
namespace {

using std::chrono::milliseconds;

using namespace sparse_testing;  // NOLINT: the shared layouts and helpers

struct Fixture {
  Fixture() : prepare(GENERATE(true, false)), store(Options(prepare), &metrics) {}
  static StoreOptions Options(bool prepare) {
    StoreOptions o;
    o.retain = 2;
    o.node = "n";
    o.sparse_bytes_per_run = 0;  // sparse whenever it applies: these models are tiny
    o.sparse_prepared_bytes_per_run = 0;
    o.prepare_sparse = prepare;
    return o;
  }
  double Counter(const std::string& name) { return metrics.Get(name); }
  const bool prepare;
  Metrics metrics;
  Store store;
};

TEST_CASE_METHOD(Fixture, "a sparse Apply writes only what changed, bit-exact with a full Apply",
                 "[store][sparse]") {
  Host src(kW + kF + kQ), d1(kD1), d2(kD2);
  Randomize(src.data, src.size, 1);
  std::memset(d2.data, 0x33, kD2);  // the fused buffer's other tensor: never written
  auto src_id = store.RegisterBuffer("m", Role::kSource, std::move(src.owned), SourceSlices(), "t");
  REQUIRE(src_id.ok());
  auto d1_id = store.RegisterBuffer("m", Role::kDestination, std::move(d1.owned), Dest1(), "e");
  auto d2_id = store.RegisterBuffer("m", Role::kDestination, std::move(d2.owned), Dest2(), "e");
  REQUIRE(d1_id.ok());
  REQUIRE(d2_id.ok());

  struct Case {
    uint64_t version;
    double share;  // of words changed; 1: every byte rewritten
    bool sparse;
  };
  const std::vector<Case> cases = {
      {1, 1, false}, {2, 0.004, true}, {3, 0.01, true}, {4, 0, true},
      {5, 1, false}, {6, 0.004, true}, {8, 0.004, true}};  // 7 skipped: 8 still diffs against 6
  for (const Case& c : cases) {
    INFO("version " << c.version);
    if (c.share >= 1) {
      Randomize(src.data, src.size, static_cast<uint32_t>(c.version) + 100);
    } else {
      Step(src.data, src.size, c.share, static_cast<uint32_t>(c.version));
    }
    REQUIRE(store.Publish("m", c.version, {*src_id}).ok());
    REQUIRE(store.WaitForVersion("m", c.version, Clock::now() + milliseconds(5000), nullptr).ok());
    auto applied = store.Apply("m", c.version, {*d1_id, *d2_id});
    REQUIRE(applied.ok());
    CHECK(applied->sparse == c.sparse);
    CHECK(applied->prepared == (c.sparse && prepare));
    if (c.sparse) {
      // Only changed elements: far fewer bytes than the destinations hold.
      CHECK(applied->bytes_written <= (c.share * 4 + 0.001) * (kD1 + kD2) + 64);
      CHECK(applied->undo_bytes <= applied->bytes_written);
    }
    // The reference: a full Apply of the same version into fresh buffers of the same layouts.
    Host r1(kD1), r2(kD2);
    std::memset(r2.data, 0x33, kD2);
    auto r1_id = store.RegisterBuffer("m", Role::kDestination, std::move(r1.owned), Dest1(), "r");
    auto r2_id = store.RegisterBuffer("m", Role::kDestination, std::move(r2.owned), Dest2(), "r");
    REQUIRE(r1_id.ok());
    REQUIRE(r2_id.ok());
    auto full = store.Apply("m", c.version, {*r1_id, *r2_id});
    REQUIRE(full.ok());
    CHECK_FALSE(full->sparse);
    CHECK(std::memcmp(d1.data, r1.data, kD1) == 0);
    CHECK(std::memcmp(d2.data, r2.data, kD2) == 0);
    REQUIRE(store.ReleaseBuffer(*r1_id).ok());
    REQUIRE(store.ReleaseBuffer(*r2_id).ok());
    auto verified = store.Verify("m");
    CHECK(verified.ok());
  }
  CHECK(Counter("refit_apply_sparse_total") == 5);
  CHECK(Counter("refit_apply_sparse_prepared_total") == (prepare ? 5 : 0));
  // The last set's lists are kept for the next collection, counted; none without prepares.
  if (prepare) {
    CHECK(Counter("refit_sparse_prepared_bytes") > 0);
  } else {
    CHECK(Counter("refit_sparse_prepared_bytes") == 0);
  }
}

TEST_CASE_METHOD(Fixture, "a destination that does not hold N-1 gets the full copy",
                 "[store][sparse]") {
  Host src(kW + kF + kQ), d1(kD1), d2(kD1);
  Randomize(src.data, src.size, 5);
  auto src_id = store.RegisterBuffer("m", Role::kSource, std::move(src.owned), SourceSlices(), "t");
  auto d1_id = store.RegisterBuffer("m", Role::kDestination, std::move(d1.owned), Dest1(), "e");
  auto d2_id = store.RegisterBuffer("m", Role::kDestination, std::move(d2.owned), Dest1(), "e");
  REQUIRE(src_id.ok());
  REQUIRE(d1_id.ok());
  REQUIRE(d2_id.ok());
  REQUIRE(store.Publish("m", 1, {*src_id}).ok());
  REQUIRE(store.Apply("m", 1, {*d1_id}).ok());  // d2 holds nothing known
  Step(src.data, src.size, 0.004, 9);
  REQUIRE(store.Publish("m", 2, {*src_id}).ok());
  REQUIRE(store.WaitForVersion("m", 2, Clock::now() + milliseconds(5000), nullptr).ok());
  auto both = store.Apply("m", 2, {*d1_id, *d2_id});
  REQUIRE(both.ok());
  CHECK_FALSE(both->sparse);
  CHECK(std::memcmp(d1.data, d2.data, kD1) == 0);
}

TEST_CASE_METHOD(Fixture, "an engine that wrote into its buffer since gets the full copy",
                 "[store][sparse]") {
  CheckOverwrittenGetsFullCopy(store, 11);
}

TEST_CASE_METHOD(Fixture, "a new run's version of the same number never takes the old run's writes",
                 "[store][sparse]") {
  // Run "a": versions 1 (applied) and 2 (completed, its sparse Apply prepared, never applied).
  // Run "b" resumes from another checkpoint and publishes 1 and 2 again with other bytes: the
  // engine's Apply of the new 2 must write the new run's bytes, whatever was prepared for "a".
  Host src(kW + kF + kQ), d1(kD1), ref(kD1);
  Randomize(src.data, src.size, 71);
  auto src_id = store.RegisterBuffer("m", Role::kSource, std::move(src.owned), SourceSlices(), "t");
  auto d1_id = store.RegisterBuffer("m", Role::kDestination, std::move(d1.owned), Dest1(), "e");
  REQUIRE(src_id.ok());
  REQUIRE(d1_id.ok());
  REQUIRE(store.Publish("m", 1, {*src_id}, "a").ok());
  REQUIRE(store.Apply("m", 1, {*d1_id}).ok());
  Step(src.data, src.size, 0.004, 72);
  REQUIRE(store.Publish("m", 2, {*src_id}, "a").ok());
  REQUIRE(store.WaitForSparsePrepared("m", 2, Clock::now() + milliseconds(5000)).ok());
  // Run "b": its version 1 is run a's version 1 (the checkpoint both started from), its version 2
  // another step.
  Randomize(src.data, src.size, 71);
  REQUIRE(store.Publish("m", 1, {*src_id}, "b").ok());
  auto first = store.Apply("m", 1, {*d1_id});
  REQUIRE(first.ok());
  Step(src.data, src.size, 0.004, 73);
  REQUIRE(store.Publish("m", 2, {*src_id}, "b").ok());
  auto applied = store.Apply("m", 2, {*d1_id});
  REQUIRE(applied.ok());
  CHECK(applied->version == 2);
  auto ref_id = store.RegisterBuffer("m", Role::kDestination, std::move(ref.owned), Dest1(), "r");
  REQUIRE(ref_id.ok());
  REQUIRE(store.Apply("m", 2, {*ref_id}).ok());
  CHECK(std::memcmp(d1.data, ref.data, kD1) == 0);
}

TEST_CASE("the cost model keeps scattered steps on the full copy", "[store][sparse]") {
  // The default figures: 384 bytes of full copy per changed run collected inside the Apply, 160
  // where the writes were prepared as the version completed.
  const bool prepare = GENERATE(true, false);
  INFO("prepared: " << prepare);
  Metrics metrics;
  StoreOptions o;
  o.retain = 2;
  o.node = "n";
  o.prepare_sparse = prepare;
  Store store(o, &metrics);
  Host src(kW + kF + kQ), d1(kD1);
  Randomize(src.data, src.size, 21);
  auto src_id = store.RegisterBuffer("m", Role::kSource, std::move(src.owned), SourceSlices(), "t");
  auto d1_id = store.RegisterBuffer("m", Role::kDestination, std::move(d1.owned), Dest1(), "e");
  REQUIRE(src_id.ok());
  REQUIRE(d1_id.ok());
  REQUIRE(store.Publish("m", 1, {*src_id}).ok());
  REQUIRE(store.Apply("m", 1, {*d1_id}).ok());
  // 0.4 % of 24 K words: ~100 runs x 384 B > the 18 KiB a full Apply writes: full; prepared,
  // 1 %: ~240 runs x 160 B > 18 KiB: full.
  Step(src.data, src.size, prepare ? 0.01 : 0.004, 22);
  REQUIRE(store.Publish("m", 2, {*src_id}).ok());
  auto applied = store.Apply("m", 2, {*d1_id});
  REQUIRE(applied.ok());
  CHECK_FALSE(applied->sparse);
  // One changed element: sparse.
  src.data[100] ^= 1;
  REQUIRE(store.Publish("m", 3, {*src_id}).ok());
  applied = store.Apply("m", 3, {*d1_id});
  REQUIRE(applied.ok());
  CHECK(applied->sparse);
  CHECK(applied->prepared == prepare);
  CHECK(applied->bytes_written <= 2);
}

TEST_CASE("a version that changed everything is found dense from a sample of it",
          "[store][sparse]") {
  // 256 MiB, one bf16 tensor; every word changes from version 1 to 2. The certain rule alone
  // (changes past 1/8 of everything) would compare 32 MiB or more before it stops; the strided
  // sample stops after 8 MiB (+ a task per thread). Then a few changed words: sparse again,
  // the whole version compared, bit-exact with the source.
  Fixture f;
  constexpr uint64_t kBytes = uint64_t{256} << 20;
  Host src(kBytes), dst(kBytes);
  Randomize(src.data, kBytes, 5);
  const std::vector<TensorSlice> layout = {
      Slice("big", DType::kBF16, {static_cast<int64_t>(kBytes / 2)}, 0)};
  auto src_id = f.store.RegisterBuffer("m", Role::kSource, std::move(src.owned), layout, "t");
  auto dst_id = f.store.RegisterBuffer("m", Role::kDestination, std::move(dst.owned), layout, "e");
  REQUIRE(src_id.ok());
  REQUIRE(dst_id.ok());
  REQUIRE(f.store.Publish("m", 1, {*src_id}).ok());
  REQUIRE(f.store.Apply("m", 1, {*dst_id}).ok());
  const double before = f.Counter("refit_diff_bytes_total");
  for (uint64_t i = 0; i < kBytes; i += 2) src.data[i] = static_cast<uint8_t>(src.data[i] ^ 1);
  REQUIRE(f.store.Publish("m", 2, {*src_id}).ok());
  const double dense_diffed = f.Counter("refit_diff_bytes_total") - before;
  CHECK(dense_diffed >= 8.0 * (1 << 20));
  CHECK(dense_diffed <= 16.0 * (1 << 20));
  auto applied = f.store.Apply("m", 2, {*dst_id});
  REQUIRE(applied.ok());
  CHECK_FALSE(applied->sparse);
  CHECK(std::memcmp(dst.data, src.data, kBytes) == 0);
  // A few words change: compared in full, applied sparsely.
  for (uint64_t i = 0; i < 64; ++i) src.data[i * (kBytes / 64)] ^= 2;
  const double sparse_before = f.Counter("refit_diff_bytes_total");
  REQUIRE(f.store.Publish("m", 3, {*src_id}).ok());
  CHECK(f.Counter("refit_diff_bytes_total") - sparse_before == static_cast<double>(kBytes));
  applied = f.store.Apply("m", 3, {*dst_id});
  REQUIRE(applied.ok());
  CHECK(applied->sparse);
  CHECK(std::memcmp(dst.data, src.data, kBytes) == 0);
}

TEST_CASE("a sparse Apply on several threads is bit-exact with a full Apply", "[store][sparse]") {
  // Three workers, each with its own part of the undo record, over row items of a row shard
  // and a column shard of one [512, 512] bf16 weight; then an engine write caught by one worker
  // stops them all, every part is put back and the full copy runs.
  const bool prepare = GENERATE(true, false);
  INFO("prepared: " << prepare);
  Metrics metrics;
  StoreOptions o = Fixture::Options(prepare);
  o.sparse_threads = 3;
  Store store(o, &metrics);
  constexpr uint64_t kBytes = 512 * 512 * 2, kHalf = kBytes / 2;
  const std::vector<TensorSlice> source = {Slice("w", DType::kBF16, {512, 512}, 0)};
  const std::vector<TensorSlice> rows = {
      Slice("w", DType::kBF16, {512, 512}, 0, {256, 0}, {256, 512})};
  const std::vector<TensorSlice> cols = {
      Slice("w", DType::kBF16, {512, 512}, 0, {0, 256}, {512, 256})};
  Host src(kBytes), d1(kHalf), d2(kHalf);
  Randomize(src.data, src.size, 31);
  auto src_id = store.RegisterBuffer("m", Role::kSource, std::move(src.owned), source, "t");
  auto d1_id = store.RegisterBuffer("m", Role::kDestination, std::move(d1.owned), rows, "e");
  auto d2_id = store.RegisterBuffer("m", Role::kDestination, std::move(d2.owned), cols, "e");
  REQUIRE(src_id.ok());
  REQUIRE(d1_id.ok());
  REQUIRE(d2_id.ok());
  for (uint64_t version = 1; version <= 4; ++version) {
    INFO("version " << version);
    if (version > 1) Step(src.data, src.size, 0.01, static_cast<uint32_t>(version) + 40);
    if (version == 4) std::memset(d2.data + kHalf / 2, 0x5c, kHalf / 2);  // the engine wrote
    REQUIRE(store.Publish("m", version, {*src_id}).ok());
    REQUIRE(store.WaitForVersion("m", version, Clock::now() + milliseconds(5000), nullptr).ok());
    auto applied = store.Apply("m", version, {*d1_id, *d2_id});
    REQUIRE(applied.ok());
    CHECK(applied->sparse == (version == 2 || version == 3));
    CHECK(applied->prepared == (prepare && applied->sparse));
    Host r1(kHalf), r2(kHalf);
    auto r1_id = store.RegisterBuffer("m", Role::kDestination, std::move(r1.owned), rows, "r");
    auto r2_id = store.RegisterBuffer("m", Role::kDestination, std::move(r2.owned), cols, "r");
    REQUIRE(r1_id.ok());
    REQUIRE(r2_id.ok());
    REQUIRE(store.Apply("m", version, {*r1_id, *r2_id}).ok());
    CHECK(std::memcmp(d1.data, r1.data, kHalf) == 0);
    CHECK(std::memcmp(d2.data, r2.data, kHalf) == 0);
    REQUIRE(store.ReleaseBuffer(*r1_id).ok());
    REQUIRE(store.ReleaseBuffer(*r2_id).ok());
  }
  CHECK(metrics.Get("refit_apply_sparse_total") == 2);
}

}  // namespace
}  // namespace refit
