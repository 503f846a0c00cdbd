// fp8 destinations with block scales through the store: Apply writes exactly the bytes and
// scales of the rule's reference (cuda/quantize_testing.h) for whole tensors, TP shards of the
// weight and its scale tensor, other shardings of the source, per-row and per-tensor scales and
// fused expert tensors; the version is quantized once, when it completes; bad layouts are
// refused at RegisterBuffer; inf/NaN sources are counted and never fail anything.

#include <cmath>
#include <cstring>
#include <random>

#include "catch2/catch.hpp"
#include "cuda/quantize_testing.h"
#include "daemon/store/store.h"

namespace refit {
namespace {

using std::chrono::milliseconds;

StoreOptions Options() {
  StoreOptions options;
  options.retain = 2;
  options.max_spare_slot_bytes = 1ull << 30;
  options.node = "test";
  return options;
}

struct TestBuffer {
  explicit TestBuffer(uint64_t size) {
    auto region = AllocateHost(size);
    REQUIRE(region.ok());
    owned = std::move(region).value();
    data = owned->data();
    std::memset(data, 0xEE, size);
  }
  std::unique_ptr<Region> Lend() { return std::move(owned); }
  std::unique_ptr<Region> owned;
  uint8_t* data;
};

uint64_t Elements(const std::vector<int64_t>& shape) {
  uint64_t n = 1;
  for (int64_t d : shape) n *= static_cast<uint64_t>(d);
  return n;
}

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

TensorSlice Whole(const std::string& name, DType dtype, std::vector<int64_t> shape, uint64_t at) {
  return Box(name, dtype, shape, {}, {}, at);
}

TensorSlice Scaled(TensorSlice s, std::string scale, std::vector<int64_t> block) {
  s.scale_tensor = std::move(scale);
  s.scale_block = std::move(block);
  return s;
}

std::vector<int64_t> ScaleShape(const std::vector<int64_t>& shape,
                                const std::vector<int64_t>& block) {
  std::vector<int64_t> out;
  for (size_t d = 0; d < shape.size(); ++d) out.push_back((shape[d] + block[d] - 1) / block[d]);
  return out;
}

std::vector<uint16_t> RandomBf16(uint64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.03f);
  std::vector<uint16_t> out(n);
  for (auto& v : out) {
    const float f = normal(rng);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    v = static_cast<uint16_t>(bits >> 16);
  }
  return out;
}

// The reference of a whole tensor (rank 1 to 3), scales laid out as the scale tensor.
cuda::testing::ReferenceQuantized Reference(const std::vector<uint16_t>& x,
                                            const std::vector<int64_t>& shape,
                                            const std::vector<int64_t>& block) {
  const size_t rank = shape.size();
  const std::vector<int64_t> grid = ScaleShape(shape, block);
  const uint64_t cols = static_cast<uint64_t>(shape.back());
  const uint64_t rows = Elements(shape) / cols;
  std::vector<uint32_t> map(rows);
  for (uint64_t r = 0; r < rows; ++r) {
    uint64_t rest = r, row = 0, weight = 1;
    for (size_t d = rank - 1; d-- > 0;) {
      const uint64_t i = rest % static_cast<uint64_t>(shape[d]);
      rest /= static_cast<uint64_t>(shape[d]);
      row += i / static_cast<uint64_t>(block[d]) * weight;
      weight *= static_cast<uint64_t>(grid[d]);
    }
    map[r] = static_cast<uint32_t>(row);
  }
  std::vector<float> wide(x.size());
  for (size_t i = 0; i < x.size(); ++i) wide[i] = cuda::testing::Bf16ToFloat(x[i]);
  return cuda::testing::ReferenceQuantize(wide, rows, cols, static_cast<uint64_t>(block.back()),
                                          map, Elements(grid) / static_cast<uint64_t>(grid.back()));
}

struct Fixture {
  Metrics metrics;
  Store store{Options(), &metrics};

  // Registers `x` (bf16, row-major `shape`) as one SOURCE buffer; returns its id.
  std::string Source(const std::string& name, const std::vector<int64_t>& shape,
                     const std::vector<uint16_t>& x) {
    TestBuffer buffer(x.size() * 2);
    std::memcpy(buffer.data, x.data(), x.size() * 2);
    auto id = store.RegisterBuffer("m", Role::kSource, buffer.Lend(),
                                   {Whole(name, DType::kBF16, shape, 0)}, "trainer");
    REQUIRE(id.ok());
    return *id;
  }

  void PublishAndWait(uint64_t version, const std::vector<std::string>& ids) {
    REQUIRE(store.Publish("m", version, ids).ok());
    auto got = store.WaitForVersion("m", version, Clock::now() + milliseconds(10000), nullptr);
    REQUIRE(got.ok());
    REQUIRE(*got == version);
  }
};

void RequireScales(const uint8_t* at, const std::vector<float>& want) {
  for (size_t i = 0; i < want.size(); ++i) {
    float got;
    std::memcpy(&got, at + 4 * i, 4);
    INFO("scale " << i << " got " << got << " want " << want[i]);
    REQUIRE(cuda::testing::FloatBits(got) == cuda::testing::FloatBits(want[i]));
  }
}

TEST_CASE_METHOD(Fixture, "fp8 with block scales: a whole tensor, [128, 128] blocks",
                 "[store][fp8]") {
  const std::vector<int64_t> shape{300, 260}, block{128, 128};
  const auto x = RandomBf16(Elements(shape), 1);
  const std::string src = Source("w", shape, x);
  const auto grid = ScaleShape(shape, block);  // [3, 3]
  const uint64_t q_bytes = Elements(shape);
  TestBuffer dst(q_bytes + 64 + 4 * Elements(grid));
  auto dst_id =
      store.RegisterBuffer("m", Role::kDestination, dst.Lend(),
                           {Scaled(Whole("w", DType::kFP8E4M3, shape, 0), "w_scale_inv", block),
                            Whole("w_scale_inv", DType::kFP32, grid, q_bytes + 64)},
                           "engine");
  REQUIRE(dst_id.ok());
  PublishAndWait(1, {src});
  // Quantized when the version completed, before Apply.
  const double quantized = metrics.Get(kQuantizedValues);
  CHECK(quantized == static_cast<double>(Elements(shape)));
  auto applied = store.Apply("m", 1, {*dst_id});
  REQUIRE(applied.ok());
  CHECK(applied->bytes_written == q_bytes + 4 * Elements(grid));
  const auto ref = Reference(x, shape, block);
  REQUIRE(std::vector<uint8_t>(dst.data, dst.data + q_bytes) == ref.q);
  RequireScales(dst.data + q_bytes + 64, ref.scales);
  // Apply again: a copy of what was quantized, nothing quantized anew.
  REQUIRE(store.Apply("m", 1, {*dst_id}).ok());
  CHECK(metrics.Get(kQuantizedValues) == quantized);
  CHECK(store.Models()[0].latest_nonfinite_values == 0);
}

TEST_CASE_METHOD(Fixture,
                 "fp8 with block scales: TP shards of the weight and its scales, "
                 "from a source sharded otherwise",
                 "[store][fp8]") {
  const std::vector<int64_t> shape{256, 512}, block{128, 128};
  const auto x = RandomBf16(Elements(shape), 2);
  // Trainer: 4 row shards of 64 rows (every block band spans two of them).
  std::vector<std::string> sources;
  for (int64_t k = 0; k < 4; ++k) {
    TestBuffer b(64 * 512 * 2);
    std::memcpy(b.data, x.data() + k * 64 * 512, 64 * 512 * 2);
    auto id =
        store.RegisterBuffer("m", Role::kSource, b.Lend(),
                             {Box("w", DType::kBF16, shape, {k * 64, 0}, {64, 512}, 0)}, "trainer");
    REQUIRE(id.ok());
    sources.push_back(*id);
  }
  // Engine: TP2 column shards, each with its columns of the scale tensor [2, 4].
  const auto grid = ScaleShape(shape, block);
  std::vector<TestBuffer> dsts;
  std::vector<std::string> dst_ids;
  for (int64_t k = 0; k < 2; ++k) {
    dsts.emplace_back(256 * 256 + 4 * 4);
    auto id = store.RegisterBuffer(
        "m", Role::kDestination, dsts.back().Lend(),
        {Box("s", DType::kFP32, grid, {0, 2 * k}, {2, 2}, 256 * 256),
         Scaled(Box("w", DType::kFP8E4M3, shape, {0, 256 * k}, {256, 256}, 0), "s", block)},
        "engine");
    REQUIRE(id.ok());
    dst_ids.push_back(*id);
  }
  PublishAndWait(1, sources);
  REQUIRE(store.Apply("m", 1, dst_ids).ok());
  const auto ref = Reference(x, shape, block);
  for (int64_t k = 0; k < 2; ++k) {
    for (int64_t r = 0; r < 256; ++r) {
      INFO("shard " << k << " row " << r);
      REQUIRE(std::memcmp(dsts[k].data + r * 256, ref.q.data() + r * 512 + 256 * k, 256) == 0);
    }
    RequireScales(dsts[k].data + 256 * 256, {ref.scales[2 * k], ref.scales[2 * k + 1],
                                             ref.scales[4 + 2 * k], ref.scales[4 + 2 * k + 1]});
  }
}

TEST_CASE_METHOD(Fixture, "fp8 with block scales: per row, per tensor, 1-D and fused experts",
                 "[store][fp8]") {
  struct Case {
    std::vector<int64_t> shape, block;
  };
  const std::vector<Case> cases = {
      {{96, 200}, {1, 200}},       // per row
      {{96, 200}, {96, 200}},      // per tensor
      {{1000}, {128}},             // 1-D
      {{4, 64, 96}, {1, 32, 32}},  // fused experts [E, N, K], per-expert blocks
      {{4, 64, 96}, {4, 64, 96}},  // the same, one scale
  };
  int n = 0;
  for (const Case& c : cases) {
    const std::string name = "t" + std::to_string(n);
    const auto x = RandomBf16(Elements(c.shape), 10 + n);
    const std::string src = Source(name, c.shape, x);
    const auto grid = ScaleShape(c.shape, c.block);
    const uint64_t q_bytes = Elements(c.shape);
    TestBuffer dst(q_bytes + 64 + 4 * Elements(grid));
    auto dst_id = store.RegisterBuffer(
        "m", Role::kDestination, dst.Lend(),
        {Scaled(Whole(name, DType::kFP8E4M3, c.shape, 0), name + ".scale", c.block),
         Whole(name + ".scale", DType::kFP32, grid, q_bytes + 64)},
        "engine");
    REQUIRE(dst_id.ok());
    ++n;
    PublishAndWait(n, {src});
    REQUIRE(store.Apply("m", n, {*dst_id}).ok());
    const auto ref = Reference(x, c.shape, c.block);
    INFO("case " << n);
    REQUIRE(std::vector<uint8_t>(dst.data, dst.data + q_bytes) == ref.q);
    RequireScales(dst.data + q_bytes + 64, ref.scales);
    REQUIRE(store.ReleaseBuffer(*dst_id).ok());
    REQUIRE(store.ReleaseBuffer(src).ok());
  }
}

TEST_CASE_METHOD(Fixture,
                 "fp8 with block scales: a later version is quantized from its own "
                 "full bytes",
                 "[store][fp8]") {
  const std::vector<int64_t> shape{128, 256}, block{128, 128};
  auto x = RandomBf16(Elements(shape), 3);
  TestBuffer src(x.size() * 2);
  uint8_t* src_data = src.data;
  std::memcpy(src_data, x.data(), x.size() * 2);
  auto src_id = store.RegisterBuffer("m", Role::kSource, src.Lend(),
                                     {Whole("w", DType::kBF16, shape, 0)}, "trainer");
  REQUIRE(src_id.ok());
  TestBuffer dst(Elements(shape) + 8);
  auto dst_id = store.RegisterBuffer("m", Role::kDestination, dst.Lend(),
                                     {Scaled(Whole("w", DType::kFP8E4M3, shape, 0), "s", block),
                                      Whole("s", DType::kFP32, {1, 2}, Elements(shape))},
                                     "engine");
  REQUIRE(dst_id.ok());
  PublishAndWait(1, {*src_id});
  // An RL-like step: a few elements move by one ulp, one grows the block's amax.
  for (size_t i = 0; i < x.size(); i += 97) ++x[i];
  x[5] = 0x3f80;  // 1.0
  std::memcpy(src_data, x.data(), x.size() * 2);
  PublishAndWait(2, {*src_id});
  REQUIRE(store.Apply("m", 2, {*dst_id}).ok());
  const auto ref = Reference(x, shape, block);
  REQUIRE(std::vector<uint8_t>(dst.data, dst.data + Elements(shape)) == ref.q);
  RequireScales(dst.data + Elements(shape), ref.scales);
}

TEST_CASE_METHOD(Fixture, "fp8 with block scales: inf and NaN are quantized and counted",
                 "[store][fp8]") {
  const std::vector<int64_t> shape{256, 128}, block{128, 128};
  auto x = RandomBf16(Elements(shape), 4);
  x[7] = 0x7fc0;              // NaN in block 0
  x[200 * 128 + 3] = 0xff80;  // -inf in block 1
  x[201 * 128 + 3] = 0x7f80;  // +inf in block 1
  const std::string src = Source("w", shape, x);
  TestBuffer dst(Elements(shape) + 8);
  auto dst_id = store.RegisterBuffer("m", Role::kDestination, dst.Lend(),
                                     {Scaled(Whole("w", DType::kFP8E4M3, shape, 0), "s", block),
                                      Whole("s", DType::kFP32, {2, 1}, Elements(shape))},
                                     "engine");
  REQUIRE(dst_id.ok());
  PublishAndWait(1, {src});
  REQUIRE(store.Apply("m", 1, {*dst_id}).ok());
  const auto ref = Reference(x, shape, block);
  REQUIRE(std::vector<uint8_t>(dst.data, dst.data + Elements(shape)) == ref.q);
  RequireScales(dst.data + Elements(shape), ref.scales);
  float s0, s1;
  std::memcpy(&s0, dst.data + Elements(shape), 4);
  std::memcpy(&s1, dst.data + Elements(shape) + 4, 4);
  CHECK(std::isnan(s0));
  CHECK(std::isinf(s1));
  CHECK(store.Models()[0].latest_nonfinite_values == 3);
  CHECK(metrics.Get(kNonfiniteValues) == 3);
}

TEST_CASE_METHOD(Fixture, "fp8 with block scales: bad layouts are refused at RegisterBuffer",
                 "[store][fp8]") {
  const std::vector<int64_t> shape{256, 256}, block{128, 128};
  TestBuffer ints(256 * 256);
  REQUIRE(store
              .RegisterBuffer("m", Role::kSource, ints.Lend(),
                              {Whole("int_w", DType::kINT8, shape, 0)}, "trainer")
              .ok());
  const std::string src = Source("w", shape, RandomBf16(Elements(shape), 5));
  (void)src;
  auto refused = [&](std::vector<TensorSlice> slices, Role role = Role::kDestination) {
    TestBuffer b(1 << 20);
    auto id = store.RegisterBuffer("m", role, b.Lend(), std::move(slices), "engine");
    INFO(id.status().ToString());
    return id.status().code() == absl::StatusCode::kInvalidArgument;
  };
  const TensorSlice scale = Whole("s", DType::kFP32, {2, 2}, 1 << 19);
  // A shard cutting through blocks.
  CHECK(refused(
      {Scaled(Box("w", DType::kFP8E4M3, shape, {64, 0}, {128, 256}, 0), "s", block), scale}));
  CHECK(refused(
      {Scaled(Box("w", DType::kFP8E4M3, shape, {0, 0}, {256, 200}, 0), "s", block), scale}));
  // The scale tensor: wrong shape, wrong dtype, missing.
  CHECK(refused({Scaled(Whole("w", DType::kFP8E4M3, shape, 0), "s", block),
                 Whole("s", DType::kFP32, {2, 3}, 1 << 19)}));
  CHECK(refused({Scaled(Whole("w", DType::kFP8E4M3, shape, 0), "s", block),
                 Whole("s", DType::kBF16, {2, 2}, 1 << 19)}));
  CHECK(refused({Scaled(Whole("w", DType::kFP8E4M3, shape, 0), "missing", block)}));
  // A non-float source; scales on a non-fp8 slice, on a SOURCE, of the wrong rank.
  CHECK(refused({Scaled(Whole("int_w", DType::kFP8E4M3, shape, 0), "s", block), scale}));
  CHECK(refused({Scaled(Whole("w", DType::kBF16, shape, 0), "s", block), scale}));
  CHECK(refused({Scaled(Whole("x", DType::kFP8E4M3, shape, 0), "s", block), scale}, Role::kSource));
  CHECK(refused({Scaled(Whole("w", DType::kFP8E4M3, shape, 0), "s", {128}), scale}));
  CHECK(refused({Scaled(Whole("w", DType::kFP8E4M3, shape, 0), "s", {128, 0}), scale}));
  // The scale tensor is a source tensor.
  CHECK(refused({Scaled(Whole("w", DType::kFP8E4M3, shape, 0), "int_w", block)}));
  // A scale tensor registered later must fit; a source may not provide it.
  TestBuffer w(1 << 20);
  TestBuffer s(64);
  REQUIRE(store
              .RegisterBuffer("m", Role::kDestination, s.Lend(),
                              {Whole("s", DType::kFP32, {2, 2}, 0)}, "engine")
              .ok());
  REQUIRE(store
              .RegisterBuffer("m", Role::kDestination, w.Lend(),
                              {Scaled(Whole("w", DType::kFP8E4M3, shape, 0), "s", block)}, "engine")
              .ok());
  CHECK(refused({Whole("s", DType::kFP32, {3, 2}, 0)}));
  CHECK(refused({Whole("s", DType::kFP32, {2, 2}, 0)}, Role::kSource));
}

TEST_CASE_METHOD(Fixture,
                 "fp8 with block scales: scale slices found apart from their weights, in shards, "
                 "and across releases",
                 "[store][fp8]") {
  const std::vector<int64_t> shape{256, 256}, block{128, 128};
  const std::string src = Source("w", shape, RandomBf16(Elements(shape), 7));
  (void)src;
  (void)Source("v", shape, RandomBf16(Elements(shape), 8));
  auto registered = [&](std::vector<TensorSlice> slices) {
    TestBuffer b(1 << 20);
    auto id = store.RegisterBuffer("m", Role::kDestination, b.Lend(), std::move(slices), "engine");
    INFO(id.status().ToString());
    return id;
  };
  // Two row shards of w and two of its scale tensor, the scales not beside their weights (the
  // request's table finds them), a plain tensor between: accepted.
  auto both = registered(
      {Scaled(Box("w", DType::kFP8E4M3, shape, {0, 0}, {128, 256}, 0), "s", block),
       Whole("v", DType::kBF16, shape, 1 << 16),
       Scaled(Box("w", DType::kFP8E4M3, shape, {128, 0}, {128, 256}, 1 << 15), "s", block),
       Box("s", DType::kFP32, {2, 2}, {0, 0}, {1, 2}, 1 << 18),
       Box("s", DType::kFP32, {2, 2}, {1, 0}, {1, 2}, (1 << 18) + 8)});
  REQUIRE(both.ok());
  // Another fp8 tensor naming the same scale tensor with a shape its scales don't have: the
  // scale slices registered before are checked against it (INVALID_ARGUMENT, nothing changes).
  auto other = registered({Scaled(Whole("v", DType::kFP8E4M3, {256, 256}, 0), "s", {128, 64})});
  CHECK(other.status().code() == absl::StatusCode::kInvalidArgument);
  // A second shard of the scale tensor of another shape, apart from any weight: refused.
  auto bad_scale = registered({Box("s", DType::kFP32, {2, 3}, {0, 0}, {1, 3}, 0)});
  CHECK(bad_scale.status().code() == absl::StatusCode::kInvalidArgument);
  // The scale tensor as a SOURCE: refused while the fp8 slices are registered, ...
  TestBuffer s_src(64);
  CHECK(store
            .RegisterBuffer("m", Role::kSource, s_src.Lend(), {Whole("s", DType::kFP32, {2, 2}, 0)},
                            "trainer")
            .status()
            .code() == absl::StatusCode::kInvalidArgument);
  // ... and accepted once they are released (the model's tensors by name forget them).
  REQUIRE(store.ReleaseBuffer(*both).ok());
  TestBuffer s_src2(64);
  auto s_source = store.RegisterBuffer("m", Role::kSource, s_src2.Lend(),
                                       {Whole("s", DType::kFP32, {2, 2}, 0)}, "trainer");
  CHECK(s_source.ok());
  // Now a scale tensor that is a source is refused for fp8 slices.
  auto named_source = registered({Scaled(Whole("w", DType::kFP8E4M3, shape, 0), "s", block),
                                  Whole("s", DType::kFP32, {2, 2}, 1 << 18)});
  CHECK(named_source.status().code() == absl::StatusCode::kInvalidArgument);
  // A released source leaves the model's sources: the same tensor may come back in another
  // shape, and destinations are checked against that.
  REQUIRE(store.ReleaseBuffer(*s_source).ok());
  TestBuffer s_src3(64);
  CHECK(store
            .RegisterBuffer("m", Role::kSource, s_src3.Lend(),
                            {Whole("s", DType::kFP32, {4, 2}, 0)}, "trainer")
            .ok());
  CHECK(registered({Whole("s", DType::kFP32, {2, 2}, 0)}).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(registered({Whole("s", DType::kFP32, {4, 2}, 0)}).ok());
}

}  // namespace
}  // namespace refit
