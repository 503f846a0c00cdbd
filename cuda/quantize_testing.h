#pragma once

// A reference of the fp8 block quantization rule (docs/api.md "Engines"), written from the text
// of the rule and independently of fp8_block.h: amax with std::fabs and an explicit NaN check,
// the e4m3fn cast through plan::ConvertRun (the daemon's own dtype conversion). Tests of the
// kernels (CPU and GPU) and of the store compare bytes with it. Test-only; pure functions.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "daemon/common/types.h"
#include "daemon/plan/dtype_convert.h"

namespace refit::cuda::testing {

// Quantized bytes and scales of a row-major [rows, cols] fp32 matrix (an N-D tensor's last
// dimension as columns; `block_of_row` gives the scale row of each row).
struct ReferenceQuantized {
  std::vector<uint8_t> q;     // rows x cols
  std::vector<float> scales;  // scale_rows x ceil(cols / block_cols)
  uint64_t nonfinite = 0;
};

inline float ReferenceScale(float amax) {
  if (std::isnan(amax)) {
    float nan;
    const uint32_t bits = 0x7fc00000u;
    std::memcpy(&nan, &bits, 4);
    return nan;
  }
  return amax == 0.0f ? 1.0f : amax / 448.0f;
}

inline uint8_t ReferenceE4M3(float y) {
  if (std::isnan(y)) return 0x7f;
  uint8_t out = 0;
  plan::ConvertRun(reinterpret_cast<const uint8_t*>(&y), DType::kFP32, 1, &out, DType::kFP8E4M3, 1,
                   1);
  return out;
}

inline ReferenceQuantized ReferenceQuantize(const std::vector<float>& x, uint64_t rows,
                                            uint64_t cols, uint64_t block_cols,
                                            const std::vector<uint32_t>& block_of_row,
                                            uint64_t scale_rows) {
  const uint64_t col_blocks = (cols + block_cols - 1) / block_cols;
  std::vector<float> amax(scale_rows * col_blocks, 0.0f);
  std::vector<char> has_nan(amax.size(), 0);
  ReferenceQuantized out;
  for (uint64_t r = 0; r < rows; ++r) {
    for (uint64_t c = 0; c < cols; ++c) {
      const float v = x[r * cols + c];
      const uint64_t b = block_of_row[r] * col_blocks + c / block_cols;
      if (std::isnan(v)) {
        has_nan[b] = 1;
      } else {
        amax[b] = std::max(amax[b], std::fabs(v));
      }
      if (!std::isfinite(v)) ++out.nonfinite;
    }
  }
  out.scales.resize(amax.size());
  for (size_t b = 0; b < amax.size(); ++b) {
    out.scales[b] = ReferenceScale(has_nan[b] ? NAN : amax[b]);
  }
  out.q.resize(rows * cols);
  for (uint64_t r = 0; r < rows; ++r) {
    for (uint64_t c = 0; c < cols; ++c) {
      const float s = out.scales[block_of_row[r] * col_blocks + c / block_cols];
      out.q[r * cols + c] = ReferenceE4M3(x[r * cols + c] / s);
    }
  }
  return out;
}

// bf16 bits -> fp32, exactly.
inline float Bf16ToFloat(uint16_t v) {
  const uint32_t bits = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint32_t FloatBits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  return bits;
}

}  // namespace refit::cuda::testing
