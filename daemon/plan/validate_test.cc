// NormalizeAndValidateBuffer and SliceByteExtent.

#include <chrono>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "catch2/catch.hpp"
#include "daemon/common/types.h"
#include "daemon/plan/plan.h"
#include "daemon/plan/scales.h"

namespace refit::plan {
namespace {

TensorSlice Slice(std::string name, DType dtype, std::vector<int64_t> shape) {
  TensorSlice s;
  s.name = std::move(name);
  s.dtype = dtype;
  s.global_shape = std::move(shape);
  return s;
}

// Expects INVALID_ARGUMENT whose message contains `needle`.
void ExpectInvalid(std::vector<TensorSlice> slices, uint64_t region, const std::string& needle) {
  const absl::Status status = NormalizeAndValidateBuffer(slices, region);
  INFO(status.ToString());
  REQUIRE(status.code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(status.message()).find(needle) != std::string::npos);
}

TEST_CASE("normalization fills offsets, sizes and row-major strides", "[validate]") {
  std::vector<TensorSlice> slices{Slice("w", DType::kBF16, {4, 6, 8})};
  REQUIRE(NormalizeAndValidateBuffer(slices, 4 * 6 * 8 * 2).ok());
  CHECK(slices[0].offsets == std::vector<int64_t>{0, 0, 0});
  CHECK(slices[0].sizes == std::vector<int64_t>{4, 6, 8});
  CHECK(slices[0].buffer_strides == std::vector<int64_t>{48, 8, 1});
  CHECK(SliceByteExtent(slices[0]) == std::make_pair<uint64_t, uint64_t>(0, 384));

  // Strides are row-major over the slice's sizes, not the global shape.
  TensorSlice part = Slice("w", DType::kFP32, {10, 10});
  part.offsets = {2, 3};
  part.sizes = {4, 5};
  part.buffer_offset = 8;
  std::vector<TensorSlice> parts{part};
  REQUIRE(NormalizeAndValidateBuffer(parts, 8 + 4 * 5 * 4).ok());
  CHECK(parts[0].buffer_strides == std::vector<int64_t>{5, 1});
  CHECK(SliceByteExtent(parts[0]) == std::make_pair<uint64_t, uint64_t>(8, 88));
}

TEST_CASE("footprint up to the region's last byte is accepted, one past is not", "[validate]") {
  TensorSlice s = Slice("w", DType::kFP16, {3, 5});
  s.buffer_offset = 1;  // not aligned to the element size: allowed
  std::vector<TensorSlice> ok{s};
  CHECK(NormalizeAndValidateBuffer(ok, 1 + 30).ok());
  ExpectInvalid({s}, 30, "tensor w");
  ExpectInvalid({s}, 30, "region of 30 bytes");
  // A strided footprint: the last element is at (2 * 7 + 4) elements.
  TensorSlice strided = s;
  strided.buffer_offset = 0;
  strided.buffer_strides = {7, 1};
  std::vector<TensorSlice> fits{strided};
  CHECK(NormalizeAndValidateBuffer(fits, 19 * 2).ok());
  ExpectInvalid({strided}, 19 * 2 - 1, "run past");
}

TEST_CASE("malformed slices are INVALID_ARGUMENT naming the tensor", "[validate]") {
  const TensorSlice good = Slice("layer.w", DType::kFP32, {4, 4});
  TensorSlice s = good;

  s.dtype = DType::kUnspecified;
  ExpectInvalid({s}, 1 << 20, "layer.w: unspecified or unknown dtype");
  s.dtype = static_cast<DType>(42);
  ExpectInvalid({s}, 1 << 20, "layer.w: unspecified or unknown dtype");

  s = good;
  s.name = "";
  ExpectInvalid({s}, 1 << 20, "empty name");

  s = good;
  s.global_shape = {};
  ExpectInvalid({s}, 1 << 20, "layer.w: empty global_shape");
  s.global_shape = {4, 0};
  ExpectInvalid({s}, 1 << 20, "layer.w: non-positive global_shape");
  s.global_shape = {-4, 4};
  ExpectInvalid({s}, 1 << 20, "layer.w: non-positive global_shape");

  s = good;
  s.offsets = {0};
  ExpectInvalid({s}, 1 << 20, "layer.w: offsets");
  s = good;
  s.sizes = {4, 4, 1};
  ExpectInvalid({s}, 1 << 20, "layer.w: sizes");
  s = good;
  s.buffer_strides = {1};
  ExpectInvalid({s}, 1 << 20, "layer.w: buffer_strides");

  s = good;
  s.offsets = {-1, 0};
  s.sizes = {2, 4};
  ExpectInvalid({s}, 1 << 20, "layer.w: negative offset");
  s = good;
  s.sizes = {0, 4};
  ExpectInvalid({s}, 1 << 20, "layer.w: non-positive size");
  s.sizes = {2, -1};
  ExpectInvalid({s}, 1 << 20, "layer.w: non-positive size");
  s = good;
  s.offsets = {3, 0};
  s.sizes = {2, 4};
  ExpectInvalid({s}, 1 << 20, "layer.w: box [3:5, 0:4] is outside");
  s.offsets = {0, 1};
  s.sizes = {4, 4};
  ExpectInvalid({s}, 1 << 20, "outside");
  s.offsets = {0, 5};
  s.sizes = {};  // the rest of the tensor from offset 5: empty
  ExpectInvalid({s}, 1 << 20, "non-positive size");
  s = good;
  s.offsets = {INT64_MAX, 0};
  s.sizes = {2, 4};
  ExpectInvalid({s}, 1 << 20, "outside");
}

TEST_CASE("strides: zero or negative only where the size is 1; overflow rejected", "[validate]") {
  TensorSlice s = Slice("w", DType::kBF16, {4, 4});
  s.buffer_strides = {0, 1};
  ExpectInvalid({s}, 1 << 20, "w: non-positive buffer_strides");
  s.buffer_strides = {-4, 1};
  ExpectInvalid({s}, 1 << 20, "non-positive buffer_strides");
  s.offsets = {2, 0};
  s.sizes = {1, 4};  // one row: its stride is never used
  s.buffer_strides = {-4, 1};
  std::vector<TensorSlice> one_row{s};
  REQUIRE(NormalizeAndValidateBuffer(one_row, 8).ok());
  CHECK(SliceByteExtent(one_row[0]) == std::make_pair<uint64_t, uint64_t>(0, 8));
  s.buffer_strides = {0, 1};
  std::vector<TensorSlice> zero{s};
  CHECK(NormalizeAndValidateBuffer(zero, 8).ok());

  TensorSlice huge = Slice("big", DType::kINT64, {1 << 20, 4});
  huge.buffer_strides = {INT64_MAX / 2, 1};
  ExpectInvalid({huge}, UINT64_MAX, "big: buffer_strides");
  huge.buffer_strides = {4, 1};
  huge.buffer_offset = UINT64_MAX - 16;
  ExpectInvalid({huge}, UINT64_MAX, "run past");
  TensorSlice many = Slice("many", DType::kINT8, {INT64_MAX, INT64_MAX});
  ExpectInvalid({many}, UINT64_MAX, "too many elements");
}

TEST_CASE("slices overlapping themselves are rejected", "[validate]") {
  TensorSlice s = Slice("w", DType::kFP32, {4, 4});
  s.buffer_strides = {1, 1};  // element (0, 1) and (1, 0) share bytes
  ExpectInvalid({s}, 1 << 20, "w: buffer_strides");
  s.buffer_strides = {2, 1};  // rows of 4 every 2 elements
  ExpectInvalid({s}, 1 << 20, "overlap itself");
  s.buffer_strides = {4, 4};
  ExpectInvalid({s}, 1 << 20, "overlap itself");
}

TEST_CASE("contiguous slices sharing a byte are rejected; touching ones are fine", "[validate]") {
  TensorSlice a = Slice("a", DType::kFP32, {4});
  TensorSlice b = Slice("b", DType::kFP32, {4});
  b.buffer_offset = 16;
  std::vector<TensorSlice> touching{a, b};
  CHECK(NormalizeAndValidateBuffer(touching, 32).ok());
  b.buffer_offset = 15;
  ExpectInvalid({a, b}, 32, "b: shares bytes of its buffer with tensor a [0:4]");
  // Reported on the later slice whatever the byte order.
  b.buffer_offset = 0;
  a.buffer_offset = 12;
  ExpectInvalid({a, b}, 32, "tensor b: shares bytes");
  // The same tensor twice at the same place.
  ExpectInvalid({a, a}, 32, "shares bytes");
}

TEST_CASE("column-concatenated slices interleave without sharing bytes", "[validate]") {
  // Row r of the fused [6, 10] buffer: a's 4 columns then b's 6 columns.
  TensorSlice a = Slice("a", DType::kBF16, {6, 4});
  a.buffer_strides = {10, 1};
  TensorSlice b = Slice("b", DType::kBF16, {6, 6});
  b.buffer_offset = 4 * 2;
  b.buffer_strides = {10, 1};
  std::vector<TensorSlice> fused{a, b};
  REQUIRE(NormalizeAndValidateBuffer(fused, 60 * 2).ok());

  // b one column to the left: column 3 of each row is shared.
  b.buffer_offset = 3 * 2;
  ExpectInvalid({a, b}, 60 * 2, "b: shares bytes");
  // Shifted by one byte only: still a shared byte.
  b.buffer_offset = 4 * 2 - 1;
  ExpectInvalid({a, b}, 60 * 2, "b: shares bytes");

  // A contiguous slice in the gap after a's last row is fine; one reaching a row is not.
  TensorSlice c = Slice("c", DType::kBF16, {6});
  c.buffer_offset = (5 * 10 + 4) * 2;
  b.buffer_offset = 4 * 2;
  b.sizes = {5, 6};
  b.global_shape = {6, 6};
  std::vector<TensorSlice> gap{a, b, c};
  REQUIRE(NormalizeAndValidateBuffer(gap, 60 * 2).ok());
  c.buffer_offset = (4 * 10 + 4) * 2 - 2;
  ExpectInvalid({a, b, c}, 60 * 2, "shares bytes");
}

TEST_CASE("transposed and padded layouts validate exactly", "[validate]") {
  // a is [3, 5] stored column-major; b fills the padding column of a padded [5, 4] pitch.
  TensorSlice a = Slice("a", DType::kFP32, {3, 5});
  a.buffer_strides = {1, 4};  // column j at 4 * j: elements 0..2, pad at 3
  TensorSlice b = Slice("b", DType::kFP32, {5});
  b.buffer_offset = 3 * 4;
  b.buffer_strides = {4};
  std::vector<TensorSlice> ok{a, b};
  REQUIRE(NormalizeAndValidateBuffer(ok, 20 * 4).ok());
  b.buffer_offset = 2 * 4;
  ExpectInvalid({a, b}, 20 * 4, "shares bytes");
  // Two interleaved every-other-element slices, with different dtypes at the byte level.
  TensorSlice even = Slice("even", DType::kFP16, {8});
  even.buffer_strides = {2};
  TensorSlice odd = Slice("odd", DType::kFP16, {8});
  odd.buffer_offset = 2;
  odd.buffer_strides = {2};
  std::vector<TensorSlice> interleaved{even, odd};
  REQUIRE(NormalizeAndValidateBuffer(interleaved, 32).ok());
  TensorSlice bytes = Slice("bytes", DType::kUINT8, {1});
  bytes.buffer_offset = 31;
  ExpectInvalid({even, odd, bytes}, 32, "shares bytes");
  bytes.buffer_offset = 32;
  std::vector<TensorSlice> after{even, odd, bytes};
  REQUIRE(NormalizeAndValidateBuffer(after, 33).ok());
}

TEST_CASE("interleaved large slices validate quickly", "[validate]") {
  // Two [100000, 64] halves of a [100000, 128] column-fused buffer: 100k runs each.
  const int64_t rows = 100000;
  TensorSlice a = Slice("a", DType::kBF16, {rows, 64});
  a.buffer_strides = {128, 1};
  TensorSlice b = a;
  b.name = "b";
  b.buffer_offset = 64 * 2;
  std::vector<TensorSlice> fused{a, b};
  REQUIRE(NormalizeAndValidateBuffer(fused, rows * 128 * 2).ok());
  // Overlap in the very last row only.
  TensorSlice c = Slice("c", DType::kBF16, {1});
  c.buffer_offset = ((rows - 1) * 128 + 127) * 2;
  ExpectInvalid({a, b, c}, rows * 128 * 2, "c: shares bytes");
}

TEST_CASE("thousands of strided columns validate in O(n log n)", "[validate][hostile]") {
  // 8,000 one-column slices of a [64, 8000] FP32 matrix (issue 37: 21.6 s pair by pair).
  const int64_t rows = 64, cols = 8000;
  std::vector<TensorSlice> columns;
  for (int64_t c = 0; c < cols; ++c) {
    TensorSlice s = Slice("col" + std::to_string(c), DType::kFP32, {rows, 1});
    s.buffer_offset = static_cast<uint64_t>(c) * 4;
    s.buffer_strides = {cols, 1};
    columns.push_back(s);
  }
  const uint64_t region = static_cast<uint64_t>(rows * cols * 4);
  auto start = std::chrono::steady_clock::now();
  std::vector<TensorSlice> ok = columns;
  REQUIRE(NormalizeAndValidateBuffer(ok, region).ok());
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  INFO("8000 columns x 64 rows validated in " << seconds << " s");
  CHECK(seconds < 2.0);
  // The same with one column shifted by one byte into its neighbour: found, and named.
  columns[4321].buffer_offset += 1;
  ExpectInvalid(columns, region, "shares bytes of its buffer with");
  // Two columns at the same offset.
  columns[4321].buffer_offset = 4320 * 4;
  ExpectInvalid(columns, region, "col4321");
}

TEST_CASE("interleavings too big to check are refused, not checked for hours",
          "[validate][hostile]") {
  // Columns of one matrix, each its own slice: 1,024 columns of 8,192 rows are 8 M runs, past
  // what the sorting check takes (2^22); pair by pair it would be 2^19 pairs of 8,192 rows.
  const int64_t rows = 8192, cols = 1024;
  std::vector<TensorSlice> columns;
  for (int64_t c = 0; c < cols; ++c) {
    TensorSlice s = Slice("col" + std::to_string(c), DType::kBF16, {rows, 1});
    s.buffer_offset = static_cast<uint64_t>(c) * 2;
    s.buffer_strides = {cols, 1};
    columns.push_back(s);
  }
  ExpectInvalid(columns, static_cast<uint64_t>(rows * cols * 2), "too many to check");
  // A small cluster (16 columns, checked pair by pair) of 2^22 rows each: 120 pairs of 4 M runs,
  // past what the pairwise checks may walk (2^26).
  const int64_t tall = int64_t{1} << 22, narrow = 16;
  std::vector<TensorSlice> tall_columns;
  for (int64_t c = 0; c < narrow; ++c) {
    TensorSlice s = Slice("tall" + std::to_string(c), DType::kBF16, {tall, 1});
    s.buffer_offset = static_cast<uint64_t>(c) * 2;
    s.buffer_strides = {narrow, 1};
    tall_columns.push_back(s);
  }
  ExpectInvalid(tall_columns, static_cast<uint64_t>(tall * narrow * 2), "too many to check");
  // Four such columns (6 pairs, 2^24 runs walked) are still checked, and pass.
  tall_columns.resize(4);
  for (auto& s : tall_columns) s.buffer_strides = {4, 1};
  REQUIRE(NormalizeAndValidateBuffer(tall_columns, static_cast<uint64_t>(tall * 4 * 2)).ok());
}

TEST_CASE("scale shapes near INT64_MAX: no signed overflow", "[validate][hostile]") {
  // (x + block - 1) / block overflowed for x near INT64_MAX (undefined behaviour; issue 37).
  const int64_t huge = std::numeric_limits<int64_t>::max();
  TensorSlice s = Slice("w", DType::kFP8E4M3, {huge, 2});
  s.scale_tensor = "w_scale";
  s.scale_block = {128, 2};
  s.offsets = {0, 0};
  s.sizes = {huge, 2};
  CHECK(ScaleShape(s) == std::vector<int64_t>{huge / 128 + 1, 1});
  std::vector<int64_t> offsets, sizes;
  ScaleBox(s, &offsets, &sizes);
  CHECK(sizes == std::vector<int64_t>{huge / 128 + 1, 1});
  // A box whose end overflows is INVALID_ARGUMENT.
  s.offsets = {128, 0};
  const absl::Status status = CheckScaledSlice(s);
  CHECK(status.code() == absl::StatusCode::kInvalidArgument);
  CHECK(std::string(status.message()).find("overflow") != std::string::npos);
  // And through the buffer check, huge shapes are refused before any of that.
  std::vector<TensorSlice> slices{Slice("w", DType::kFP8E4M3, {huge, 2})};
  CHECK(NormalizeAndValidateBuffer(slices, 1 << 20).code() == absl::StatusCode::kInvalidArgument);
}

// fp8 weights [256, 256] with [128, 128] block scales, laid out as an engine does: the weights
// in one part of the buffer, the scale tensors in another, each weight beside its scales in the
// slice order (two ascending lanes of offsets, merged rather than sorted).
std::vector<TensorSlice> ScaledBuffer(int tensors) {
  std::vector<TensorSlice> slices;
  for (int t = 0; t < tensors; ++t) {
    TensorSlice scale = Slice("w" + std::to_string(t) + "_scale_inv", DType::kFP32, {2, 2});
    scale.buffer_offset = static_cast<uint64_t>(tensors) * 65536 + static_cast<uint64_t>(t) * 16;
    TensorSlice w = Slice("w" + std::to_string(t), DType::kFP8E4M3, {256, 256});
    w.buffer_offset = static_cast<uint64_t>(t) * 65536;
    w.scale_tensor = scale.name;
    w.scale_block = {128, 128};
    slices.push_back(scale);
    slices.push_back(w);
  }
  return slices;
}

TEST_CASE("scaled slices are checked in the normalizing pass, after its own errors",
          "[validate][scales]") {
  const uint64_t region = 3 * (65536 + 16);
  bool scaled = false;
  std::vector<TensorSlice> ok = ScaledBuffer(3);
  REQUIRE(NormalizeAndValidateScaledBuffer(ok, region, true, &scaled).ok());
  CHECK(scaled);
  CHECK(ok[1].sizes == std::vector<int64_t>{256, 256});
  std::vector<TensorSlice> plain{Slice("w", DType::kBF16, {4})};
  scaled = true;
  REQUIRE(NormalizeAndValidateScaledBuffer(plain, 8, false, &scaled).ok());
  CHECK_FALSE(scaled);

  auto expect = [&](std::vector<TensorSlice> slices, bool allowed, const std::string& needle) {
    bool unused = false;
    const absl::Status status = NormalizeAndValidateScaledBuffer(slices, region, allowed, &unused);
    INFO(status.ToString());
    REQUIRE(status.code() == absl::StatusCode::kInvalidArgument);
    CHECK(std::string(status.message()).find(needle) != std::string::npos);
  };
  // A SOURCE buffer (scales not allowed): the first scaled slice named (RegisterBuffer's check,
  // moved here from the store).
  expect(ScaledBuffer(3), false, "tensor w0: scale_tensor and scale_block are for DESTINATION");
  // A DESTINATION: CheckScaledSlice's errors, the first slice's.
  std::vector<TensorSlice> cut = ScaledBuffer(3);
  cut[3].scale_block = {0, 128};
  cut[5].scale_block = {128};  // a later slice's error is not the one told
  expect(cut, true, "tensor w1: non-positive scale_block [0, 128]");
  std::vector<TensorSlice> wrong_dtype = ScaledBuffer(3);
  wrong_dtype[5].dtype = DType::kBF16;
  wrong_dtype[5].global_shape = {128, 128};  // 32 KiB of bf16: inside its 64 KiB
  wrong_dtype[5].scale_block = {128, 128};
  expect(wrong_dtype, true, "tensor w2: scale_tensor and scale_block need dtype FP8_E4M3");
  // An error of the normalization (here: two slices sharing bytes, found after every slice's
  // own checks) wins over a scaled slice's, as when the store ran the two one after the other.
  std::vector<TensorSlice> both = ScaledBuffer(3);
  both[1].scale_block = {0, 128};
  both[5].buffer_offset = 65536 + 100;
  expect(both, true, "tensor w2: shares bytes of its buffer with tensor w1");
  expect(both, false, "tensor w2: shares bytes of its buffer with tensor w1");
}

TEST_CASE("slices in a few interleaved ascending lanes, or in any order, validate the same",
          "[validate]") {
  // Lanes: weights and scales (2), then 5 lanes (more than are merged: sorted instead), then
  // descending offsets; in each a shared byte is found and named the same.
  for (int lanes : {2, 5, 0}) {
    std::vector<TensorSlice> slices;
    const int n = 40;
    for (int i = 0; i < n; ++i) {
      TensorSlice s = Slice("t" + std::to_string(i), DType::kBF16, {8});
      if (lanes == 0) {
        s.buffer_offset = static_cast<uint64_t>(n - 1 - i) * 16;
      } else {
        s.buffer_offset = static_cast<uint64_t>((i % lanes) * n + i / lanes) * 16;
      }
      slices.push_back(s);
    }
    std::vector<TensorSlice> copy = slices;
    INFO("lanes " << lanes);
    REQUIRE(NormalizeAndValidateBuffer(copy, 16 * 200).ok());
    slices[7].buffer_offset = slices[30].buffer_offset + 8;  // t7 over half of t30
    ExpectInvalid(slices, 16 * 200, "tensor t30: shares bytes of its buffer with tensor t7");
  }
}

}  // namespace
}  // namespace refit::plan
