// Sparse Apply into fp8 destinations with block scales: destinations that hold N-1 get only the
// fp8 bytes and scales that N's quantization changed (a block whose amax did not change: its
// changed elements; one whose amax changed: its block and its scale), for [128, 128] blocks
// over TP column shards of a weight and its scale tensor and for per-row scales, and end bit
// for bit where a full Apply of N (a second store, fresh buffers of the same layouts) ends. An
// engine that wrote into its buffer, a skipped version and a destination registered since N-1
// was quantized take the full copy.

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "daemon/store/store.h"

namespace refit {
namespace {

using std::chrono::milliseconds;

// Source: bf16 w [512, 1024] ([128, 128] blocks: a [4, 8] scale grid), r [64, 256] (per-row
// scales, [64, 1]) and n [1000] (a bf16 tensor the engine keeps in bf16), back to back.
constexpr int64_t kRows = 512, kCols = 1024, kRRows = 64, kRCols = 256, kN = 1000;
constexpr uint64_t kWBytes = kRows * kCols * 2, kRBytes = kRRows * kRCols * 2, kNBytes = kN * 2;
// Destination k (TP2 column shards): w columns [512k, 512k + 512) in fp8, its columns [4k, 4k+4)
// of the scale grid; destination 0 also r in fp8 and its per-row scales, and n in bf16 (its plan
// reads the version's piece beside the derived slot).
constexpr uint64_t kShard = kRows * kCols / 2;  // fp8 bytes of a w shard
constexpr uint64_t kShardScales = 4 * 4 * 4;
constexpr uint64_t kROffset = kShard + kShardScales;
constexpr uint64_t kRScalesOffset = kROffset + kRRows * kRCols;
constexpr uint64_t kNOffset = kRScalesOffset + kRRows * 4;
constexpr uint64_t kD0 = kNOffset + kNBytes, kD1 = kShard + kShardScales;

TensorSlice Box(const std::string& name, DType dtype, std::vector<int64_t> shape,
                std::vector<int64_t> offsets, std::vector<int64_t> sizes, uint64_t at) {
  TensorSlice s;
  s.name = name;
  s.dtype = dtype;
  s.global_shape = std::move(shape);
  s.offsets = std::move(offsets);
  s.sizes = std::move(sizes);
  s.buffer_offset = at;
  return s;
}

TensorSlice Scaled(TensorSlice s, std::string scale, std::vector<int64_t> block) {
  s.scale_tensor = std::move(scale);
  s.scale_block = std::move(block);
  return s;
}

std::vector<TensorSlice> SourceLayout() {
  return {Box("w", DType::kBF16, {kRows, kCols}, {}, {}, 0),
          Box("r", DType::kBF16, {kRRows, kRCols}, {}, {}, kWBytes),
          Box("n", DType::kBF16, {kN}, {}, {}, kWBytes + kRBytes)};
}

std::vector<TensorSlice> DestLayout(int k) {
  std::vector<TensorSlice> out = {
      Scaled(Box("w", DType::kFP8E4M3, {kRows, kCols}, {0, 512 * k}, {kRows, 512}, 0), "w_s",
             {128, 128}),
      Box("w_s", DType::kFP32, {4, 8}, {0, 4 * k}, {4, 4}, kShard)};
  if (k == 0) {
    out.push_back(
        Scaled(Box("r", DType::kFP8E4M3, {kRRows, kRCols}, {}, {}, kROffset), "r_s", {1, kRCols}));
    out.push_back(Box("r_s", DType::kFP32, {kRRows, 1}, {}, {}, kRScalesOffset));
    out.push_back(Box("n", DType::kBF16, {kN}, {}, {}, kNOffset));
  }
  return out;
}

struct Host {
  explicit Host(uint64_t n) {
    auto region = AllocateHost(n);
    REQUIRE(region.ok());
    owned = std::move(region).value();
    data = owned->data();
    size = n;
    std::memset(data, 0xEE, n);
  }
  std::vector<uint8_t> Bytes() const { return {data, data + size}; }
  std::unique_ptr<Region> owned;
  uint8_t* data;
  uint64_t size;
};

uint16_t ToBf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return static_cast<uint16_t>(bits >> 16);
}

void SetBf16(uint8_t* p, uint64_t element, float f) {
  const uint16_t v = ToBf16(f);
  std::memcpy(p + 2 * element, &v, 2);
}

void Randomize(uint8_t* p, uint64_t bytes, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.03f);
  for (uint64_t e = 0; e < bytes / 2; ++e) SetBf16(p, e, normal(rng));
}

// An RL-like step: `share` of the bf16 elements move by 16 units in the last place (about one
// fp8 step), from seed `seed`.
void Step(uint8_t* p, uint64_t bytes, double share, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(0, 1);
  for (uint64_t e = 0; e < bytes / 2; ++e) {
    if (u(rng) < share) p[2 * e] ^= 0x10;
  }
}

StoreOptions Options(bool sparse) {
  StoreOptions o;
  o.retain = 2;
  o.node = "n";
  o.max_spare_slot_bytes = 1ull << 28;
  // These models are tiny: sparse whenever it applies; the reference never.
  o.sparse_bytes_per_run = sparse ? 0 : (1ull << 40);  // (and it applies into fresh buffers)
  o.sparse_prepared_bytes_per_run = sparse ? 0 : (1ull << 40);
  return o;
}

// Two stores fed the same versions: `store` applies into destinations that hold N-1, `ref`
// makes a full Apply of each version into fresh destinations of the same layouts.
struct Fixture {
  Fixture() {
    Randomize(src.data, src.size, 1);
    src_id = Register(store, std::move(src.owned));
    Host ref_src(kWBytes + kRBytes + kNBytes);
    ref_data = ref_src.data;
    ref_src_id = Register(ref, std::move(ref_src.owned));
    for (int k = 0; k < 2; ++k) {
      auto id = store.RegisterBuffer("m", Role::kDestination, std::move(dst[k].owned),
                                     DestLayout(k), "engine");
      REQUIRE(id.ok());
      dst_ids.push_back(*id);
      auto ref_id = ref.RegisterBuffer("m", Role::kDestination, std::move(ref_dst[k].owned),
                                       DestLayout(k), "reference");
      REQUIRE(ref_id.ok());
      ref_ids.push_back(*ref_id);
    }
  }
  static std::string Register(Store& s, std::unique_ptr<Region> region) {
    auto id = s.RegisterBuffer("m", Role::kSource, std::move(region), SourceLayout(), "trainer");
    REQUIRE(id.ok());
    return *id;
  }
  // Publishes the source's bytes as `version` in both stores.
  void Publish(uint64_t version) {
    std::memcpy(ref_data, src.data, src.size);
    for (auto [s, id] : {std::pair<Store*, std::string>{&store, src_id}, {&ref, ref_src_id}}) {
      REQUIRE(s->Publish("m", version, {id}).ok());
      auto got = s->WaitForVersion("m", version, Clock::now() + milliseconds(10000), nullptr);
      REQUIRE(got.ok());
      REQUIRE(*got == version);
    }
  }
  // Applies `version` in both stores and compares the destinations bit for bit.
  ApplyResult ApplyAndCompare(uint64_t version) {
    auto applied = store.Apply("m", version, dst_ids);
    REQUIRE(applied.ok());
    // A sparse Apply's writes were prepared as the version completed (the derived slot diffed
    // by then): the Apply only wrote.
    CHECK(applied->prepared == applied->sparse);
    // The reference: fresh buffers each time (a full Apply even where nothing changed).
    for (int k = 0; k < 2; ++k) {
      REQUIRE(ref.ReleaseBuffer(ref_ids[k]).ok());
      ref_dst[k] = Host(k == 0 ? kD0 : kD1);
      auto id = ref.RegisterBuffer("m", Role::kDestination, std::move(ref_dst[k].owned),
                                   DestLayout(k), "reference");
      REQUIRE(id.ok());
      ref_ids[k] = *id;
    }
    auto full = ref.Apply("m", version, ref_ids);
    REQUIRE(full.ok());
    CHECK_FALSE(full->sparse);
    CHECK(std::memcmp(dst[0].data, ref_dst[0].data, kD0) == 0);
    CHECK(std::memcmp(dst[1].data, ref_dst[1].data, kD1) == 0);
    CHECK(store.Verify("m").ok());
    return *applied;
  }
  double Counter(const std::string& name) { return metrics.Get(name); }

  Metrics metrics, ref_metrics;
  Store store{Options(true), &metrics};
  Store ref{Options(false), &ref_metrics};
  Host src{kWBytes + kRBytes + kNBytes};
  uint8_t* ref_data = nullptr;
  std::string src_id, ref_src_id;
  Host dst[2] = {Host(kD0), Host(kD1)};
  Host ref_dst[2] = {Host(kD0), Host(kD1)};
  std::vector<std::string> dst_ids, ref_ids;
};

// The scales of destination 0's shard of w ([4, 4]) and r ([64]), as bit patterns.
std::vector<uint32_t> Scales(const uint8_t* d0) {
  std::vector<uint32_t> out(16 + kRRows);
  std::memcpy(out.data(), d0 + kShard, 16 * 4);
  std::memcpy(out.data() + 16, d0 + kRScalesOffset, kRRows * 4);
  return out;
}

// Of destination 0's w blocks (4 x 4 of [128, 128]): how many kept their scale while some of
// their fp8 bytes changed between `before` and `after`.
int BlocksChangedUnderTheSameScale(const std::vector<uint8_t>& before,
                                   const std::vector<uint8_t>& after) {
  int blocks = 0;
  for (int br = 0; br < 4; ++br) {
    for (int bc = 0; bc < 4; ++bc) {
      const uint64_t scale_at = kShard + 4 * (br * 4 + bc);
      if (std::memcmp(before.data() + scale_at, after.data() + scale_at, 4) != 0) continue;
      bool changed = false;
      for (int r = 0; r < 128 && !changed; ++r) {
        const uint64_t at = (br * 128 + r) * 512 + bc * 128;
        changed = std::memcmp(before.data() + at, after.data() + at, 128) != 0;
      }
      blocks += changed;
    }
  }
  return blocks;
}

TEST_CASE_METHOD(Fixture,
                 "a sparse Apply into fp8 destinations with block scales is bit-exact with a "
                 "full Apply",
                 "[store][sparse][fp8]") {
  constexpr uint64_t kDestBytes = kD0 + kD1;
  // 1: full (nothing held yet).
  Publish(1);
  auto applied = ApplyAndCompare(1);
  CHECK_FALSE(applied.sparse);
  CHECK(applied.bytes_written == kDestBytes);

  // 2: an RL-like step, 1 % of the elements: some fp8 bytes change under unchanged scales.
  std::vector<uint8_t> before = dst[0].Bytes();
  Step(src.data, src.size, 0.01, 2);
  Publish(2);
  double bytes_before = Counter("refit_apply_bytes_total");
  applied = ApplyAndCompare(2);
  CHECK(applied.sparse);
  CHECK(applied.bytes_written > 0);
  CHECK(applied.bytes_written < kDestBytes / 20);
  CHECK(applied.undo_bytes <= applied.bytes_written);
  CHECK(Counter("refit_apply_bytes_total") - bytes_before == applied.bytes_written);
  CHECK(BlocksChangedUnderTheSameScale(before, dst[0].Bytes()) > 0);

  // 3: two amaxes up: block (1, 1) of w in shard 0 (row 200, column 150) and row 7 of r. Their
  // scales change (and every fp8 byte of them may); a few elements elsewhere become tiny (their
  // blocks' scales stay).
  before = dst[0].Bytes();
  SetBf16(src.data, 200 * kCols + 150, 1.0f);
  SetBf16(src.data + kWBytes, 7 * kRCols + 3, -1.0f);
  SetBf16(src.data, 5 * kCols + 5, 0.0005f);
  SetBf16(src.data, 300 * kCols + 400, -0.0005f);
  SetBf16(src.data, 100 * kCols + 900, 0.0005f);
  SetBf16(src.data + kWBytes, 20 * kRCols + 9, 0.0005f);
  Publish(3);
  applied = ApplyAndCompare(3);
  CHECK(applied.sparse);
  CHECK(applied.bytes_written < kDestBytes / 10);
  const std::vector<uint32_t> old_scales = Scales(before.data()), new_scales = Scales(dst[0].data);
  for (size_t i = 0; i < old_scales.size(); ++i) {
    INFO("scale " << i);
    CHECK((old_scales[i] != new_scales[i]) == (i == 1 * 4 + 1 || i == 16 + 7));
  }
  CHECK(BlocksChangedUnderTheSameScale(before, dst[0].Bytes()) > 0);
  // The whole block went out again under its new scale: at least its elements that moved.
  int moved_in_block = 0;
  for (int r = 128; r < 256; ++r) {
    for (int c = 128; c < 256; ++c)
      moved_in_block += before[r * 512 + c] != dst[0].data[r * 512 + c];
  }
  CHECK(moved_in_block > 128 * 128 / 4);

  // 4: nothing changed: sparse, nothing written.
  Publish(4);
  applied = ApplyAndCompare(4);
  CHECK(applied.sparse);
  CHECK(applied.bytes_written == 0);

  // 5: the amaxes back down (their scales shrink) and a step.
  SetBf16(src.data, 200 * kCols + 150, 0.01f);
  SetBf16(src.data + kWBytes, 7 * kRCols + 3, 0.01f);
  Step(src.data, src.size, 0.004, 5);
  Publish(5);
  applied = ApplyAndCompare(5);
  CHECK(applied.sparse);

  // 6: a new random version: dense, the full copy.
  Randomize(src.data, src.size, 6);
  Publish(6);
  applied = ApplyAndCompare(6);
  CHECK_FALSE(applied.sparse);

  // 7, then 9 (8 skipped: 9 was diffed against 8, which the destinations do not hold): sparse,
  // then the full copy.
  Step(src.data, src.size, 0.004, 7);
  Publish(7);
  CHECK(ApplyAndCompare(7).sparse);
  Step(src.data, src.size, 0.004, 8);
  Publish(8);
  Step(src.data, src.size, 0.004, 9);
  Publish(9);
  CHECK_FALSE(ApplyAndCompare(9).sparse);
  CHECK(Counter("refit_apply_sparse_total") == 5);
  // Over the run: the sparse Applies wrote far less than the model's fp8 destinations hold.
  CHECK(Counter("refit_apply_bytes_total") < 3.5 * kDestBytes);
}

TEST_CASE_METHOD(Fixture, "an engine that wrote into its fp8 buffer since gets the full copy",
                 "[store][sparse][fp8]") {
  Publish(1);
  ApplyAndCompare(1);
  Step(src.data, src.size, 0.004, 11);
  Publish(2);
  std::memset(dst[1].data, 0x11, kShard);  // the engine overwrote its shard of w
  const auto applied = ApplyAndCompare(2);
  CHECK_FALSE(applied.sparse);
  CHECK(Counter("refit_apply_sparse_total") == 0);
  // Holding 2 again: the next step is sparse.
  Step(src.data, src.size, 0.004, 12);
  Publish(3);
  CHECK(ApplyAndCompare(3).sparse);
}

TEST_CASE_METHOD(Fixture,
                 "a destination registered after N-1 was quantized: N-1 is quantized again "
                 "with the new batch, N is sparse",
                 "[store][sparse][fp8]") {
  Publish(1);
  ApplyAndCompare(1);
  // Another engine's buffer (a new quantization batch for the model): N-1's derived slot is of
  // the old batch; the quantizer quantizes N-1 again with the new one to diff N against it.
  Host extra(kD1);
  auto extra_id = store.RegisterBuffer("m", Role::kDestination, std::move(extra.owned),
                                       DestLayout(1), "engine2");
  REQUIRE(extra_id.ok());
  const double quantized = Counter("refit_quantized_values_total");
  Step(src.data, src.size, 0.004, 21);
  Publish(2);
  CHECK(Counter("refit_quantized_values_total") - quantized ==
        2 * static_cast<double>(kRows * kCols + kRRows * kRCols));
  CHECK(ApplyAndCompare(2).sparse);
  REQUIRE(store.Apply("m", 2, {*extra_id}).ok());  // holds nothing known: the full copy
  CHECK(std::memcmp(extra.data, dst[1].data, kD1) == 0);
  // No destination holds the newest version when the next arrives: nothing diffed.
  REQUIRE(store.ReleaseBuffer(*extra_id).ok());
  Step(src.data, src.size, 0.004, 22);
  Publish(3);
  Step(src.data, src.size, 0.004, 23);
  Publish(4);
  CHECK_FALSE(ApplyAndCompare(4).sparse);
}

}  // namespace
}  // namespace refit
