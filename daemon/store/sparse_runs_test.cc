// The run-list sparse Apply (store_sparse_runs.cc: what GPU DESTINATION buffers take) through
// the test seam StoreOptions::sparse_run_writers, with the host RunWriter (the CPU twins of the
// GPU run kernels) on host destinations: bit-exact with a full Apply over several delta
// versions (row and column TP shards, a fused destination with a row stride, a column-major
// one, fp32 -> bf16 and fp32 -> fp16 conversion),
// bytes_written equal to the runs' bytes; a byte flipped under the write is DATA_LOSS with every
// destination exactly as before; an engine that wrote since gets the full copy.

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "cuda/run_writer.h"
#include "daemon/store/sparse_testing.h"
#include "daemon/store/store.h"

namespace refit {
namespace {

using std::chrono::milliseconds;

using namespace sparse_testing;  // NOLINT: the shared layouts and helpers

class Writers;

// The host RunWriter, counting what it is given; flips a destination byte after its Scatter
// while its owner has flips left.
class CountingWriter final : public cuda::RunWriter {
 public:
  CountingWriter(std::unique_ptr<cuda::RunWriter> inner, Writers* owner, const Region& dst)
      : inner_(std::move(inner)), owner_(owner), dst_(dst) {}
  absl::Status Upload(const std::vector<cuda::ByteRun>& runs,
                      const std::vector<uint8_t>& values) override;
  absl::Status SaveOld(uint8_t* old) override { return inner_->SaveOld(old); }
  absl::Status Scatter() override;
  absl::Status ReadBack(uint8_t* landed) override { return inner_->ReadBack(landed); }
  absl::Status Restore(const uint8_t* old) override { return inner_->Restore(old); }

 private:
  std::unique_ptr<cuda::RunWriter> inner_;
  Writers* owner_;
  const Region& dst_;
  uint64_t first_run_at_ = 0;
};

class Writers final : public cuda::RunWriters {
 public:
  absl::StatusOr<std::unique_ptr<cuda::RunWriter>> Open(const Region& dst) override {
    auto inner = cuda::OpenHostRunWriter(dst);
    if (!inner.ok()) return inner.status();
    ++opened;
    return std::unique_ptr<cuda::RunWriter>(
        new CountingWriter(std::move(inner).value(), this, dst));
  }
  int opened = 0;
  uint64_t runs = 0;
  uint64_t run_bytes = 0;  // the uploaded runs' bytes
  int flips = 0;           // Scatters that flip a byte after writing
};

absl::Status CountingWriter::Upload(const std::vector<cuda::ByteRun>& runs,
                                    const std::vector<uint8_t>& values) {
  for (const cuda::ByteRun& run : runs) owner_->run_bytes += run.bytes;
  owner_->runs += runs.size();
  if (!runs.empty()) first_run_at_ = runs[0].dst_offset;
  return inner_->Upload(runs, values);
}

absl::Status CountingWriter::Scatter() {
  absl::Status status = inner_->Scatter();
  if (status.ok() && owner_->flips > 0) {
    --owner_->flips;
    dst_.data()[first_run_at_] ^= 0x5a;  // a byte changes under the write
  }
  return status;
}

// Each case runs with the runs prepared as the version completed (StoreOptions::prepare_sparse)
// and collected inside the Apply.
struct Fixture {
  Fixture() : prepare(GENERATE(true, false)), store(Options(&writers, prepare), &metrics) {}
  static StoreOptions Options(Writers* writers, bool prepare) {
    StoreOptions o;
    o.retain = 2;
    o.node = "n";
    o.gpu_sparse_bytes_per_run = 0;  // sparse whenever it applies: these models are tiny
    o.gpu_sparse_prepared_bytes_per_run = 0;
    o.prepare_sparse = prepare;
    o.sparse_run_writers = writers;
    return o;
  }
  const bool prepare;
  Writers writers;
  Metrics metrics;
  Store store;
};

TEST_CASE_METHOD(Fixture, "a run-list sparse Apply is bit-exact with a full Apply",
                 "[store][sparse][runs]") {
  Host src(kW + kF + kQ), d1(kD1), d2(kD2), d3(kD3);
  Randomize(src.data, src.size, 1);
  std::memset(d2.data, 0x33, kD2);  // the fused buffer's other tensor: never written
  auto src_id = store.RegisterBuffer("m", Role::kSource, std::move(src.owned), SourceSlices(), "t");
  REQUIRE(src_id.ok());
  auto d1_id = store.RegisterBuffer("m", Role::kDestination, std::move(d1.owned), Dest1(), "e");
  auto d2_id = store.RegisterBuffer("m", Role::kDestination, std::move(d2.owned), Dest2(), "e");
  auto d3_id = store.RegisterBuffer("m", Role::kDestination, std::move(d3.owned), Dest3(), "e");
  REQUIRE(d1_id.ok());
  REQUIRE(d2_id.ok());
  REQUIRE(d3_id.ok());
  struct Case {
    uint64_t version;
    double share;  // of words changed; 1: every byte rewritten
    bool sparse;
  };
  const std::vector<Case> cases = {{1, 1, false},    {2, 0.004, true}, {3, 0.01, true},
                                   {4, 0, true},     {5, 1, false},    {6, 0.004, true},
                                   {8, 0.004, true}, {9, 0.05, true}};  // 7 skipped
  int sparse_applies = 0;
  for (const Case& c : cases) {
    INFO("version " << c.version);
    if (c.share >= 1) {
      Randomize(src.data, src.size, static_cast<uint32_t>(c.version) + 100);
    } else {
      Step(src.data, src.size, c.share, static_cast<uint32_t>(c.version));
    }
    // Counted from the Publish: a prepared Apply's writers may be opened and uploaded as the
    // version completes (small runs against the destination: these are).
    writers.run_bytes = 0;
    writers.runs = 0;
    const int opened = writers.opened;
    REQUIRE(store.Publish("m", c.version, {*src_id}).ok());
    REQUIRE(store.WaitForVersion("m", c.version, Clock::now() + milliseconds(5000), nullptr).ok());
    REQUIRE(store.WaitForSparsePrepared("m", c.version, Clock::now() + milliseconds(5000)).ok());
    const int opened_ahead = writers.opened - opened;
    auto applied = store.Apply("m", c.version, {*d1_id, *d2_id, *d3_id});
    REQUIRE(applied.ok());
    CHECK(applied->sparse == c.sparse);
    CHECK(applied->prepared == (c.sparse && prepare));
    if (c.sparse) {
      ++sparse_applies;
      // Through the writers (not the host sparse Apply), the runs' bytes and nothing else.
      CHECK(writers.opened - opened == (c.share > 0 ? 3 : 0));
      if (!prepare) CHECK(opened_ahead == 0);
      // 0.4 %: the fused buffer's ~56 runs and their bytes take under 1/16 of its 40 KiB.
      if (prepare && c.share == 0.004) CHECK(opened_ahead > 0);
      CHECK(applied->bytes_written == writers.run_bytes);
      CHECK(applied->undo_bytes == applied->bytes_written);
      CHECK(applied->bytes_written <= (c.share * 4 + 0.001) * (kD1 + kD2 + kD3) + 64);
      if (c.share > 0) CHECK(writers.runs > 0);
    } else {
      CHECK(writers.opened == opened);
    }
    // The reference: a full Apply of the same version into fresh buffers of the same layouts.
    Host r1(kD1), r2(kD2), r3(kD3);
    std::memset(r2.data, 0x33, kD2);
    auto r1_id = store.RegisterBuffer("m", Role::kDestination, std::move(r1.owned), Dest1(), "r");
    auto r2_id = store.RegisterBuffer("m", Role::kDestination, std::move(r2.owned), Dest2(), "r");
    auto r3_id = store.RegisterBuffer("m", Role::kDestination, std::move(r3.owned), Dest3(), "r");
    REQUIRE(r1_id.ok());
    REQUIRE(r2_id.ok());
    REQUIRE(r3_id.ok());
    auto full = store.Apply("m", c.version, {*r1_id, *r2_id, *r3_id});
    REQUIRE(full.ok());
    CHECK_FALSE(full->sparse);
    CHECK(std::memcmp(d1.data, r1.data, kD1) == 0);
    CHECK(std::memcmp(d2.data, r2.data, kD2) == 0);
    CHECK(std::memcmp(d3.data, r3.data, kD3) == 0);
    REQUIRE(store.ReleaseBuffer(*r1_id).ok());
    REQUIRE(store.ReleaseBuffer(*r2_id).ok());
    REQUIRE(store.ReleaseBuffer(*r3_id).ok());
    CHECK(store.Verify("m").ok());
  }
  CHECK(metrics.Get("refit_apply_sparse_total") == sparse_applies);
}

TEST_CASE_METHOD(Fixture, "a byte flipped under a run-list write is DATA_LOSS, all put back",
                 "[store][sparse][runs]") {
  Host src(kW + kF + kQ), d1(kD1), d2(kD2);
  Randomize(src.data, src.size, 41);
  std::memset(d2.data, 0x33, kD2);
  auto src_id = store.RegisterBuffer("m", Role::kSource, std::move(src.owned), SourceSlices(), "t");
  auto d1_id = store.RegisterBuffer("m", Role::kDestination, std::move(d1.owned), Dest1(), "e");
  auto d2_id = store.RegisterBuffer("m", Role::kDestination, std::move(d2.owned), Dest2(), "e");
  REQUIRE(src_id.ok());
  REQUIRE(d1_id.ok());
  REQUIRE(d2_id.ok());
  REQUIRE(store.Publish("m", 1, {*src_id}).ok());
  REQUIRE(store.Apply("m", 1, {*d1_id, *d2_id}).ok());
  Step(src.data, src.size, 0.01, 42);
  REQUIRE(store.Publish("m", 2, {*src_id}).ok());
  REQUIRE(store.WaitForVersion("m", 2, Clock::now() + milliseconds(5000), nullptr).ok());
  const std::vector<uint8_t> before1(d1.data, d1.data + kD1), before2(d2.data, d2.data + kD2);
  writers.flips = 1;  // d1's Scatter: the first destination written
  auto applied = store.Apply("m", 2, {*d1_id, *d2_id});
  CHECK(writers.flips == 0);
  REQUIRE_FALSE(applied.ok());
  CHECK(applied.status().code() == absl::StatusCode::kDataLoss);
  // Both destinations exactly as before: d1's flipped byte and its runs, and d2's runs, put back.
  CHECK(std::memcmp(d1.data, before1.data(), kD1) == 0);
  CHECK(std::memcmp(d2.data, before2.data(), kD2) == 0);
  CHECK(metrics.Get("refit_apply_verify_failures_total") == 1);
}

TEST_CASE_METHOD(Fixture, "a run-list Apply into a buffer the engine wrote since is a full copy",
                 "[store][sparse][runs]") {
  CheckOverwrittenGetsFullCopy(store, 51);
}

TEST_CASE("a run-list sparse Apply on several threads is bit-exact with a full Apply",
          "[store][sparse][runs]") {
  // The collection cut into chunks on three threads, appended in order, over a row shard and a
  // column shard of one [512, 512] bf16 weight.
  const bool prepare = GENERATE(true, false);
  INFO("prepared: " << prepare);
  Writers writers;
  Metrics metrics;
  StoreOptions o = Fixture::Options(&writers, prepare);
  o.sparse_threads = 3;
  Store store(o, &metrics);
  constexpr uint64_t kBytes = 512 * 512 * 2, kHalf = kBytes / 2;
  const std::vector<TensorSlice> source = {Slice("w", DType::kBF16, {512, 512}, 0)};
  const std::vector<TensorSlice> rows = {
      Slice("w", DType::kBF16, {512, 512}, 0, {256, 0}, {256, 512})};
  const std::vector<TensorSlice> cols = {
      Slice("w", DType::kBF16, {512, 512}, 0, {0, 256}, {512, 256})};
  Host src(kBytes), d1(kHalf), d2(kHalf);
  Randomize(src.data, src.size, 61);
  auto src_id = store.RegisterBuffer("m", Role::kSource, std::move(src.owned), source, "t");
  auto d1_id = store.RegisterBuffer("m", Role::kDestination, std::move(d1.owned), rows, "e");
  auto d2_id = store.RegisterBuffer("m", Role::kDestination, std::move(d2.owned), cols, "e");
  REQUIRE(src_id.ok());
  REQUIRE(d1_id.ok());
  REQUIRE(d2_id.ok());
  for (uint64_t version = 1; version <= 4; ++version) {
    INFO("version " << version);
    if (version > 1) Step(src.data, src.size, 0.01, static_cast<uint32_t>(version) + 60);
    writers.run_bytes = 0;  // (a prepared Apply's writers may upload as the version completes)
    REQUIRE(store.Publish("m", version, {*src_id}).ok());
    REQUIRE(store.WaitForVersion("m", version, Clock::now() + milliseconds(5000), nullptr).ok());
    auto applied = store.Apply("m", version, {*d1_id, *d2_id});
    REQUIRE(applied.ok());
    CHECK(applied->sparse == (version > 1));
    CHECK(applied->prepared == (prepare && version > 1));
    if (version > 1) CHECK(applied->bytes_written == writers.run_bytes);
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
  CHECK(metrics.Get("refit_apply_sparse_total") == 3);
}

}  // namespace
}  // namespace refit
