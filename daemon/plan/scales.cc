#include "daemon/plan/scales.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace refit::plan {
namespace {

absl::Status Invalid(const TensorSlice& slice, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("tensor ", slice.name, ": ", what));
}

std::string Dims(const std::vector<int64_t>& dims) {
  return absl::StrCat("[", absl::StrJoin(dims, ", "), "]");
}

}  // namespace

bool IsScaled(const TensorSlice& slice) {
  return !slice.scale_tensor.empty() || !slice.scale_block.empty();
}

// ceil(x / block) for x >= 0 and block > 0, without the overflow of (x + block - 1) / block
// (x near INT64_MAX: undefined behaviour, issue 37).
// Blocks are powers of two nearly always ([128, 128]): a shift and a mask, not a division (one per
// dimension of 200,000 slices at RegisterBuffer).
static bool PowerOfTwo(int64_t block) { return block > 0 && (block & (block - 1)) == 0; }
static int64_t CeilDiv(int64_t x, int64_t block) {
  if (PowerOfTwo(block)) return (x >> __builtin_ctzll(block)) + ((x & (block - 1)) != 0 ? 1 : 0);
  return x / block + (x % block != 0 ? 1 : 0);
}
static bool OnBlock(int64_t x, int64_t block) {
  return PowerOfTwo(block) ? (x & (block - 1)) == 0 : x % block == 0;
}

absl::Status CheckScaledSlice(const TensorSlice& slice) {
  if (slice.dtype != DType::kFP8E4M3) {
    return Invalid(slice, absl::StrCat("scale_tensor and scale_block need dtype FP8_E4M3, not ",
                                       DTypeName(slice.dtype)));
  }
  if (slice.scale_tensor.empty()) return Invalid(slice, "scale_block without a scale_tensor");
  if (slice.scale_tensor == slice.name) return Invalid(slice, "is its own scale_tensor");
  const size_t rank = slice.global_shape.size();
  if (slice.scale_block.size() != rank) {
    return Invalid(slice, absl::StrCat("scale_block ", Dims(slice.scale_block),
                                       " does not match rank ", rank, " of global_shape"));
  }
  for (size_t d = 0; d < rank; ++d) {
    const int64_t block = slice.scale_block[d];
    if (block <= 0) {
      return Invalid(slice, absl::StrCat("non-positive scale_block ", Dims(slice.scale_block)));
    }
    const int64_t begin = slice.offsets[d];
    int64_t end = 0;
    if (__builtin_add_overflow(begin, slice.sizes[d], &end)) {
      return Invalid(slice, absl::StrCat("box ", BoxString(slice.offsets, slice.sizes),
                                         " overflows 64-bit arithmetic"));
    }
    if (!OnBlock(begin, block) || (!OnBlock(end, block) && end != slice.global_shape[d])) {
      return Invalid(slice,
                     absl::StrCat("box ", BoxString(slice.offsets, slice.sizes),
                                  " cuts through blocks of ", Dims(slice.scale_block),
                                  " (a shard of a block-scaled tensor must hold whole blocks)"));
    }
  }
  return absl::OkStatus();
}

std::vector<int64_t> ScaleShape(const TensorSlice& scaled) {
  std::vector<int64_t> shape;
  for (size_t d = 0; d < scaled.global_shape.size(); ++d) {
    const int64_t block = scaled.scale_block[d];
    shape.push_back(CeilDiv(scaled.global_shape[d], block));
  }
  return shape;
}

void ScaleBox(const TensorSlice& scaled, std::vector<int64_t>* offsets,
              std::vector<int64_t>* sizes) {
  offsets->clear();
  sizes->clear();
  for (size_t d = 0; d < scaled.global_shape.size(); ++d) {
    const int64_t block = scaled.scale_block[d];
    offsets->push_back(scaled.offsets[d] / block);
    sizes->push_back(CeilDiv(scaled.sizes[d], block));
  }
}

absl::Status CheckScaleSlice(const TensorSlice& scaled, const TensorSlice& scale) {
  if (IsScaled(scale)) {
    return Invalid(scale, absl::StrCat("is the scale_tensor of ", scaled.name,
                                       " and cannot have scales of its own"));
  }
  if (scale.dtype != DType::kFP32) {
    return Invalid(
        scale, absl::StrCat("scales of ", scaled.name, " are FP32, not ", DTypeName(scale.dtype)));
  }
  // ScaleShape(scaled), compared without making it (once per scaled slice at RegisterBuffer).
  bool same = scale.global_shape.size() == scaled.global_shape.size() &&
              scaled.scale_block.size() == scaled.global_shape.size();
  for (size_t d = 0; same && d < scaled.global_shape.size(); ++d) {
    same = scaled.scale_block[d] > 0 &&
           scale.global_shape[d] == CeilDiv(scaled.global_shape[d], scaled.scale_block[d]);
  }
  if (!same) {
    const std::vector<int64_t> expected = ScaleShape(scaled);
    return Invalid(scale,
                   absl::StrCat("global_shape ", Dims(scale.global_shape), " of the scales of ",
                                scaled.name, " should be ", Dims(expected), " (ceil of ",
                                Dims(scaled.global_shape), " / ", Dims(scaled.scale_block), ")"));
  }
  return absl::OkStatus();
}

}  // namespace refit::plan
