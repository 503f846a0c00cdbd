#pragma once

// fp8 block quantization, element by element: the bit-exact rule of docs/api.md ("Engines"),
// shared by the CPU kernels (quantize_kernels.cc) and the GPU ones (gpu_quantize.cu), so both
// compute it from the same expressions:
//   per block, in fp32: amax = max |x|; s = amax / 448.0f (s = 1.0f where amax is 0);
//   q = e4m3fn(x / s), round to nearest even, saturating at +-448; the scale stored is s.
// Corners, fixed here so that every implementation writes the same bytes:
//   - amax is taken over the bit patterns of |x| (sign cleared), where a NaN compares above
//     inf: a block holding a NaN has a NaN amax, hence a NaN scale (the canonical 0x7fc00000);
//     a block holding an inf (and no NaN) has an inf scale;
//   - a quotient that is NaN becomes 0x7f (e4m3fn's NaN, sign dropped), whatever its payload.
//
// Like float_bits.h this header must stay free of workspace includes other than cuda/ ones.
// Pure functions; thread-safe.

#include <cstdint>
#include <cstring>

#include "cuda/float_bits.h"

namespace refit::cuda::fp8 {

inline constexpr uint32_t kAbsMask = 0x7fffffffu;
inline constexpr uint32_t kInfBits = 0x7f800000u;
inline constexpr uint32_t kCanonicalNaN = 0x7fc00000u;
inline constexpr uint8_t kE4M3NaN = 0x7f;
inline constexpr float kE4M3Max = 448.0f;

REFIT_HOST_DEVICE uint32_t BitsOf(float value) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(value);
#else
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
#endif
}

REFIT_HOST_DEVICE float FloatOf(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float value;
  std::memcpy(&value, &bits, sizeof(value));
  return value;
#endif
}

// a / b, rounded to nearest even (IEEE division, never a reciprocal approximation).
REFIT_HOST_DEVICE float Divide(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// True for the bit pattern of an inf or a NaN.
REFIT_HOST_DEVICE bool NonFinite(uint32_t bits) { return (bits & kAbsMask) >= kInfBits; }

// The block's scale from the largest |x| bit pattern of its elements.
REFIT_HOST_DEVICE float ScaleFromAmaxBits(uint32_t amax_bits) {
  if (amax_bits == 0) return 1.0f;
  if (amax_bits > kInfBits) return FloatOf(kCanonicalNaN);
  return Divide(FloatOf(amax_bits), kE4M3Max);
}

// One element: e4m3fn(x / s).
REFIT_HOST_DEVICE uint8_t QuantizeOne(float x, float s) {
  const uint32_t y = BitsOf(Divide(x, s));
  if ((y & kAbsMask) > kInfBits) return kE4M3NaN;
  return static_cast<uint8_t>(bits::FloatToE4M3(y));
}

}  // namespace refit::cuda::fp8
