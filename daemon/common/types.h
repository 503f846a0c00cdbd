#pragma once

// Domain types shared by the store, the planner, the delta code and the server. They mirror the
// refit.v1 messages but carry no protobuf: only daemon/server converts between the two.

#include <cstdint>
#include <string>
#include <vector>

namespace refit {

// Element types. The numeric values equal refit.v1.DType's.
enum class DType : int {
  kUnspecified = 0,
  kBF16 = 1,
  kFP16 = 2,
  kFP32 = 3,
  kFP8E4M3 = 4,
  kFP8E5M2 = 5,
  kINT8 = 6,
  kUINT8 = 7,
  kINT32 = 8,
  kINT64 = 9,
};

// Bytes per element; 0 for kUnspecified or an unknown value.
size_t DTypeSize(DType dtype);
// "bf16", "fp32", ...; "unspecified" for anything else.
const char* DTypeName(DType dtype);
// True for the floating-point types the daemon can convert between.
bool IsFloat(DType dtype);

enum class Role : int { kUnspecified = 0, kSource = 1, kDestination = 2 };
const char* RoleName(Role role);

// A hyperrectangle of one tensor placed in a buffer. `offsets` and `sizes` are normalized by
// NormalizeSlice: after it both have one entry per dimension of `global_shape`, and
// `buffer_strides` holds element strides for every dimension.
struct TensorSlice {
  std::string name;
  DType dtype = DType::kUnspecified;
  std::vector<int64_t> global_shape;
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
  uint64_t buffer_offset = 0;
  std::vector<int64_t> buffer_strides;
  // DESTINATION slices of dtype kFP8E4M3 only (daemon/plan/scales.h): quantize per block of
  // `scale_block` global elements, scales into the tensor `scale_tensor`. Empty: a plain cast.
  std::string scale_tensor;
  std::vector<int64_t> scale_block;

  // Elements in the slice (product of sizes).
  uint64_t NumElements() const;
  // True when the slice's elements are row-major contiguous in the buffer.
  bool IsContiguous() const;
};

// Returns "[0:4, 8:16]" for the box of `slice`, for error messages.
std::string BoxString(const std::vector<int64_t>& offsets, const std::vector<int64_t>& sizes);

}  // namespace refit
