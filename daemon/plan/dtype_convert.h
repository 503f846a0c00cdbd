#pragma once

// Element conversion between dtypes: bf16, fp16, fp32, fp8 e4m3 and e5m2 to each other with
// IEEE round-to-nearest-even (fp8 saturating), and identity copies for every dtype. Pure
// functions, thread-safe.

#include <cstdint>

#include "absl/status/status.h"
#include "daemon/common/types.h"

namespace refit::plan {

// OK when elements of `from` can be written as `to` (same dtype, or float to float);
// INVALID_ARGUMENT otherwise.
absl::Status CheckConvertible(DType from, DType to);

// Converts `count` elements; strides are in elements of each side's dtype.
void ConvertRun(const uint8_t* src, DType src_dtype, int64_t src_stride, uint8_t* dst,
                DType dst_dtype, int64_t dst_stride, uint64_t count);

}  // namespace refit::plan
