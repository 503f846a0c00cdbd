#pragma once

// What the sparse Apply tests share (sparse_apply_test, sparse_runs_test, sparse_gpu_test): a
// source layout of three tensors and two destination layouts that reshard it (row and column TP
// shards, a strided fused destination, fp32 -> bf16), host buffers, random bytes and RL-like
// steps; a third, column-major destination; the overwritten-destination check. Test-only.

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "daemon/common/types.h"
#include "daemon/memory/region.h"
#include "daemon/store/store.h"

namespace refit::sparse_testing {

inline TensorSlice Slice(const std::string& name, DType dtype, std::vector<int64_t> shape,
                         uint64_t buffer_offset, std::vector<int64_t> offsets = {},
                         std::vector<int64_t> sizes = {}, std::vector<int64_t> strides = {}) {
  TensorSlice s;
  s.name = name;
  s.dtype = dtype;
  s.global_shape = std::move(shape);
  s.buffer_offset = buffer_offset;
  s.offsets = std::move(offsets);
  s.sizes = std::move(sizes);
  s.buffer_strides = std::move(strides);
  return s;
}

struct Host {
  explicit Host(uint64_t size) {
    auto region = AllocateHost(size);
    REQUIRE(region.ok());
    owned = std::move(region).value();
    data = owned->data();
    this->size = size;
  }
  std::unique_ptr<Region> owned;
  uint8_t* data;
  uint64_t size;
};

// Source: w bf16 [64, 256] (32 KiB), f fp32 [1000], q bf16 [96, 64].
constexpr uint64_t kW = 64 * 256 * 2, kF = 1000 * 4, kQ = 96 * 64 * 2;
inline std::vector<TensorSlice> SourceSlices() {
  return {Slice("w", DType::kBF16, {64, 256}, 0), Slice("f", DType::kFP32, {1000}, kW),
          Slice("q", DType::kBF16, {96, 64}, kW + kF)};
}
// Destination 1: rows [32, 64) of w (row-parallel shard), f converted to bf16.
constexpr uint64_t kD1 = 32 * 256 * 2 + 1000 * 2;
inline std::vector<TensorSlice> Dest1() {
  return {Slice("w", DType::kBF16, {64, 256}, 0, {32, 0}, {32, 256}),
          Slice("f", DType::kBF16, {1000}, 32 * 256 * 2)};
}
// Destination 2: columns [128, 256) of w (column shard), q strided into a fused buffer: row
// stride 128 elements, q in the second half of each row (the first half is another tensor's).
constexpr uint64_t kD2 = 64 * 128 * 2 + 96 * 128 * 2;
inline std::vector<TensorSlice> Dest2() {
  return {Slice("w", DType::kBF16, {64, 256}, 0, {0, 128}, {64, 128}),
          Slice("q", DType::kBF16, {96, 64}, 64 * 128 * 2 + 64 * 2, {}, {}, {128, 1})};
}

inline void Randomize(uint8_t* p, uint64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  for (uint64_t i = 0; i < n; ++i) p[i] = static_cast<uint8_t>(rng() % 200);  // no NaNs
}

// An RL-like step: `share` of the 2-byte words change by one in their low byte.
inline void Step(uint8_t* p, uint64_t n, double share, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> u(0, 1);
  for (uint64_t i = 0; i + 1 < n; i += 2) {
    if (u(rng) < share) p[i] = static_cast<uint8_t>(p[i] ^ 1);
  }
}

// Destination 3: q column-major (element stride 96: one byte run per element written) and f
// converted to fp32 -> fp16 behind it.
constexpr uint64_t kD3 = 96 * 64 * 2 + 1000 * 2;
inline std::vector<TensorSlice> Dest3() {
  return {Slice("q", DType::kBF16, {96, 64}, 0, {}, {}, {1, 96}),
          Slice("f", DType::kFP16, {1000}, 96 * 64 * 2)};
}

// An engine that overwrote its destination between versions: `store`'s Apply of version 2 is a
// full copy (not sparse) and leaves the buffer exactly as a fresh buffer's full Apply of 2.
// `seed` seeds the source's bytes and the step.
inline void CheckOverwrittenGetsFullCopy(Store& store, uint32_t seed) {
  Host src(kW + kF + kQ), d1(kD1), ref(kD1);
  Randomize(src.data, src.size, seed);
  auto src_id = store.RegisterBuffer("m", Role::kSource, std::move(src.owned), SourceSlices(), "t");
  auto d1_id = store.RegisterBuffer("m", Role::kDestination, std::move(d1.owned), Dest1(), "e");
  REQUIRE(src_id.ok());
  REQUIRE(d1_id.ok());
  REQUIRE(store.Publish("m", 1, {*src_id}).ok());
  REQUIRE(store.Apply("m", 1, {*d1_id}).ok());
  Step(src.data, src.size, 0.004, seed + 1);
  REQUIRE(store.Publish("m", 2, {*src_id}).ok());
  REQUIRE(
      store.WaitForVersion("m", 2, Clock::now() + std::chrono::milliseconds(5000), nullptr).ok());
  std::memset(d1.data, 0xab, kD1);  // the engine overwrote its weights
  auto applied = store.Apply("m", 2, {*d1_id});
  REQUIRE(applied.ok());
  CHECK_FALSE(applied->sparse);
  auto ref_id = store.RegisterBuffer("m", Role::kDestination, std::move(ref.owned), Dest1(), "r");
  REQUIRE(ref_id.ok());
  REQUIRE(store.Apply("m", 2, {*ref_id}).ok());
  CHECK(std::memcmp(d1.data, ref.data, kD1) == 0);
}

}  // namespace refit::sparse_testing
