#pragma once

// Float format conversions on raw bit patterns, compiled both by g++ (host) and by nvcc (device
// kernels in gpu_kernels.cu). They give exactly what daemon/plan/dtype_convert.cc gives, bit for
// bit (cpu_kernels_test checks every 8- and 16-bit input and millions of fp32 ones against it):
//   - widening (to fp32) is exact; NaN payloads survive fp16/e5m2 -> fp32, e4m3's NaN becomes
//     the canonical quiet NaN;
//   - narrowing rounds once, to nearest with ties to even;
//   - bf16: NaN keeps its sign and top payload bits with the quiet bit set; overflow -> inf;
//   - fp16: NaN -> quiet 0x7e00 (sign kept); overflow -> inf;
//   - fp8 e4m3 (fn: no inf): NaN -> 0x7f, inf and overflow saturate to +-448;
//   - fp8 e5m2: NaN -> 0x7e, inf stays inf, finite overflow saturates to +-57344.
// CUDA's own intrinsics (__float2bfloat16_rn, __nv_cvt_float_to_fp8, ...) are not used: they
// canonicalize NaNs and differ from the CPU path in those corners, and a GPU apply must write
// the same bytes as a CPU apply.
//
// This header must stay free of workspace includes: the nvcc action sees only cuda/ headers.
// Pure functions; thread-safe.

#include <cstdint>

#if defined(__CUDACC__)
#define REFIT_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define REFIT_HOST_DEVICE inline
#endif

namespace refit::cuda::bits {

// The float dtypes, numbered as refit::DType (cpu_kernels.cc checks that they agree).
inline constexpr int kBF16 = 1;
inline constexpr int kFP16 = 2;
inline constexpr int kFP32 = 3;
inline constexpr int kE4M3 = 4;
inline constexpr int kE5M2 = 5;

// `value >> shift` (shift >= 1) rounded to nearest, ties to even.
REFIT_HOST_DEVICE uint32_t ShiftRightRoundEven(uint32_t value, int shift) {
  if (shift >= 32) return 0;  // value < 2^24 here: less than half of the last unit
  const uint32_t kept = value >> shift;
  const uint32_t rest = value & ((uint32_t{1} << shift) - 1);
  const uint32_t half = uint32_t{1} << (shift - 1);
  return kept + ((rest > half || (rest == half && (kept & 1u) != 0)) ? 1u : 0u);
}

// fp32 bits -> a narrower binary format with kMant fraction bits and exponent bias kBias,
// whose sign bit is bit kSignBit. kMaxFinite: largest finite magnitude code; kOverflow: what a
// finite value past it becomes; kInf / kNaN: the codes for infinite and NaN inputs.
template <int kMant, int kBias, uint32_t kMaxFinite, uint32_t kOverflow, uint32_t kInf,
          uint32_t kNaN, int kSignBit>
REFIT_HOST_DEVICE uint32_t NarrowFloat(uint32_t bits) {
  const uint32_t sign = (bits >> 31) << kSignBit;
  const uint32_t magnitude = bits & 0x7fffffffu;
  if (magnitude >= 0x7f800000u) return sign | (magnitude == 0x7f800000u ? kInf : kNaN);
  if (magnitude == 0) return sign;
  // magnitude = significand * 2^(exponent - 23), significand < 2^24.
  const int biased = static_cast<int>(magnitude >> 23);
  const int exponent = biased == 0 ? -126 : biased - 127;
  const uint32_t significand = (magnitude & 0x7fffffu) | (biased == 0 ? 0u : 0x800000u);
  constexpr int kMinExponent = 1 - kBias;  // of the target's normal numbers
  uint32_t code;
  if (exponent >= kMinExponent) {
    // The rounded significand lies in [2^kMant, 2^(kMant+1)]: adding it to the exponent steps
    // (less one, for its leading bit) lets a rounding carry move into the exponent field.
    code = (static_cast<uint32_t>(exponent - kMinExponent) << kMant) +
           ShiftRightRoundEven(significand, 23 - kMant);
  } else {
    // A subnormal of the target (which may round up to the smallest normal: same code).
    code = ShiftRightRoundEven(significand, 23 - kMant + (kMinExponent - exponent));
  }
  return sign | (code > kMaxFinite ? kOverflow : code);
}

REFIT_HOST_DEVICE uint32_t FloatToBF16(uint32_t bits) {
  if ((bits & 0x7fffffffu) > 0x7f800000u) return (bits >> 16) | 0x40u;
  return (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
}

REFIT_HOST_DEVICE uint32_t FloatToFP16(uint32_t bits) {
  return NarrowFloat<10, 15, 0x7bff, 0x7c00, 0x7c00, 0x7e00, 15>(bits);
}

REFIT_HOST_DEVICE uint32_t FloatToE4M3(uint32_t bits) {
  return NarrowFloat<3, 7, 0x7e, 0x7e, 0x7e, 0x7f, 7>(bits);
}

REFIT_HOST_DEVICE uint32_t FloatToE5M2(uint32_t bits) {
  return NarrowFloat<2, 15, 0x7b, 0x7b, 0x7c, 0x7e, 7>(bits);
}

// A subnormal `fraction` * 2^(min_exponent - frac_bits), renormalized into fp32 bits.
REFIT_HOST_DEVICE uint32_t SubnormalToFloat(uint32_t fraction, int frac_bits, int min_exponent) {
  int exponent = min_exponent;
  const uint32_t lead = uint32_t{1} << frac_bits;
  while ((fraction & lead) == 0) {
    fraction <<= 1;
    --exponent;
  }
  return (static_cast<uint32_t>(exponent + 127) << 23) |
         ((fraction & (lead - 1)) << (23 - frac_bits));
}

REFIT_HOST_DEVICE uint32_t FP16ToFloat(uint32_t half) {
  const uint32_t sign = (half & 0x8000u) << 16;
  const uint32_t exponent = (half >> 10) & 0x1fu;
  const uint32_t fraction = half & 0x3ffu;
  if (exponent == 0x1f) return sign | 0x7f800000u | (fraction << 13);
  if (exponent != 0) return sign | ((exponent + 112) << 23) | (fraction << 13);
  if (fraction == 0) return sign;
  return sign | SubnormalToFloat(fraction, 10, -14);
}

REFIT_HOST_DEVICE uint32_t E4M3ToFloat(uint32_t byte) {
  const uint32_t sign = (byte & 0x80u) << 24;
  const uint32_t exponent = (byte >> 3) & 0xfu;
  const uint32_t fraction = byte & 0x7u;
  if (exponent == 0xf && fraction == 0x7) return sign | 0x7fc00000u;
  if (exponent != 0) return sign | ((exponent + 120) << 23) | (fraction << 20);
  if (fraction == 0) return sign;
  return sign | SubnormalToFloat(fraction, 3, -6);
}

// e5m2 is the top byte of an fp16.
REFIT_HOST_DEVICE uint32_t E5M2ToFloat(uint32_t byte) { return FP16ToFloat(byte << 8); }

// Raw element bits of dtype kCode -> fp32 bits.
template <int kCode>
REFIT_HOST_DEVICE uint32_t ToFloatBits(uint32_t raw) {
  if constexpr (kCode == kBF16) return raw << 16;
  if constexpr (kCode == kFP16) return FP16ToFloat(raw);
  if constexpr (kCode == kFP32) return raw;
  if constexpr (kCode == kE4M3) return E4M3ToFloat(raw);
  if constexpr (kCode == kE5M2) return E5M2ToFloat(raw);
  return 0;
}

// fp32 bits -> raw element bits of dtype kCode.
template <int kCode>
REFIT_HOST_DEVICE uint32_t FromFloatBits(uint32_t bits) {
  if constexpr (kCode == kBF16) return FloatToBF16(bits);
  if constexpr (kCode == kFP16) return FloatToFP16(bits);
  if constexpr (kCode == kFP32) return bits;
  if constexpr (kCode == kE4M3) return FloatToE4M3(bits);
  if constexpr (kCode == kE5M2) return FloatToE5M2(bits);
  return 0;
}

// One element from kFrom to kTo.
template <int kFrom, int kTo>
REFIT_HOST_DEVICE uint32_t ConvertBits(uint32_t raw) {
  if constexpr (kFrom == kTo) {
    return raw;
  } else {
    return FromFloatBits<kTo>(ToFloatBits<kFrom>(raw));
  }
}

}  // namespace refit::cuda::bits
