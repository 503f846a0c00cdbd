// Float conversions through fp32: every bf16, fp16 and fp8 value is exact in fp32, so widening is
// exact and narrowing rounds once (round to nearest, ties to even).

#include "daemon/plan/dtype_convert.h"

#include <cstdint>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "daemon/common/types.h"

namespace refit::plan {
namespace {

uint32_t FloatBits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return bits;
}

// A narrow binary float format: `mant` fraction bits, exponent bias `bias`.
struct Format {
  int mant;
  int bias;
  uint32_t max_finite;  // bit pattern (no sign) of the largest finite value
  uint32_t overflow;    // what a finite value past max rounds to: inf, or max_finite (saturating)
  uint32_t inf;         // pattern for +-inf inputs
  uint32_t nan;         // pattern for NaN inputs (a quiet NaN)
};

constexpr Format kFP16{10, 15, 0x7bff, 0x7c00, 0x7c00, 0x7e00};
// e4m3fn has no inf: saturating conversion maps inf and overflow to +-448; NaN is 0x7f.
constexpr Format kE4M3{3, 7, 0x7e, 0x7e, 0x7e, 0x7f};
// e5m2 keeps inf; finite overflow saturates to +-57344.
constexpr Format kE5M2{2, 15, 0x7b, 0x7b, 0x7c, 0x7e};

// Shifts `value` right by `shift` rounding to nearest, ties to even.
uint64_t ShiftRoundEven(uint64_t value, int shift) {
  if (shift <= 0) return value << -shift;
  if (shift >= 64) return 0;
  const uint64_t kept = value >> shift;
  const uint64_t rest = value & ((uint64_t{1} << shift) - 1);
  const uint64_t half = uint64_t{1} << (shift - 1);
  return kept + ((rest > half || (rest == half && (kept & 1))) ? 1 : 0);
}

// fp32 bits -> `format` bits (sign in the top bit of a width of 1 + exponent + mant bits).
template <int kWidth>
uint32_t Narrow(uint32_t bits, const Format& f) {
  const uint32_t sign = (bits >> 31) << (kWidth - 1);
  const uint32_t exp_field = (bits >> 23) & 0xff;
  const uint32_t frac = bits & 0x7fffff;
  if (exp_field == 0xff) return sign | (frac ? f.nan : f.inf);
  if (exp_field == 0 && frac == 0) return sign;
  // |value| = m * 2^(e - 23) with m < 2^24.
  const int e = exp_field == 0 ? -126 : static_cast<int>(exp_field) - 127;
  const uint64_t m = exp_field == 0 ? frac : (frac | 0x800000);
  const int emin = 1 - f.bias;
  uint64_t out;
  if (e >= emin) {
    // Normal in the target (or overflowing): a carry out of the fraction bumps the exponent.
    const uint64_t q = ShiftRoundEven(m, 23 - f.mant);
    const int64_t biased = e + f.bias;
    if (biased >= 64) return sign | f.overflow;
    out = (static_cast<uint64_t>(biased) << f.mant) + (q - (uint64_t{1} << f.mant));
  } else {
    out = ShiftRoundEven(m, 23 - f.mant + (emin - e));  // subnormal; may round up to min normal
  }
  if (out > f.max_finite) return sign | f.overflow;
  return sign | static_cast<uint32_t>(out);
}

uint32_t FloatToBF16(uint32_t bits) {
  if ((bits & 0x7fffffff) > 0x7f800000) return (bits >> 16) | 0x40;  // quiet NaN, sign kept
  return (bits + 0x7fff + ((bits >> 16) & 1)) >> 16;
}

// Widening: exact.
uint32_t FP16ToFloat(uint32_t h) {
  const uint32_t sign = (h & 0x8000) << 16;
  const uint32_t exp = (h >> 10) & 0x1f;
  const uint32_t frac = h & 0x3ff;
  if (exp == 0x1f) return sign | 0x7f800000 | (frac << 13);
  if (exp != 0) return sign | ((exp + 112) << 23) | (frac << 13);
  if (frac == 0) return sign;
  return sign | FloatBits(static_cast<float>(frac) * 0x1p-24f);  // subnormal: exact
}

uint32_t E4M3ToFloat(uint32_t b) {
  const uint32_t sign = (b & 0x80) << 24;
  const uint32_t exp = (b >> 3) & 0xf;
  const uint32_t frac = b & 0x7;
  if (exp == 0xf && frac == 0x7) return sign | 0x7fc00000;
  if (exp != 0) return sign | ((exp + 120) << 23) | (frac << 20);
  if (frac == 0) return sign;
  return sign | FloatBits(static_cast<float>(frac) * 0x1p-9f);
}

uint32_t E5M2ToFloat(uint32_t b) { return FP16ToFloat(b << 8); }

uint32_t LoadAsFloatBits(const uint8_t* p, DType dtype) {
  switch (dtype) {
    case DType::kBF16: {
      uint16_t v;
      std::memcpy(&v, p, 2);
      return static_cast<uint32_t>(v) << 16;
    }
    case DType::kFP16: {
      uint16_t v;
      std::memcpy(&v, p, 2);
      return FP16ToFloat(v);
    }
    case DType::kFP32: {
      uint32_t v;
      std::memcpy(&v, p, 4);
      return v;
    }
    case DType::kFP8E4M3:
      return E4M3ToFloat(*p);
    case DType::kFP8E5M2:
      return E5M2ToFloat(*p);
    default:
      return 0;
  }
}

void StoreFromFloatBits(uint32_t bits, uint8_t* p, DType dtype) {
  switch (dtype) {
    case DType::kBF16: {
      const uint16_t v = static_cast<uint16_t>(FloatToBF16(bits));
      std::memcpy(p, &v, 2);
      return;
    }
    case DType::kFP16: {
      const uint16_t v = static_cast<uint16_t>(Narrow<16>(bits, kFP16));
      std::memcpy(p, &v, 2);
      return;
    }
    case DType::kFP32:
      std::memcpy(p, &bits, 4);
      return;
    case DType::kFP8E4M3:
      *p = static_cast<uint8_t>(Narrow<8>(bits, kE4M3));
      return;
    case DType::kFP8E5M2:
      *p = static_cast<uint8_t>(Narrow<8>(bits, kE5M2));
      return;
    default:
      return;
  }
}

template <DType kFrom, DType kTo>
void ConvertTyped(const uint8_t* src, int64_t src_step, uint8_t* dst, int64_t dst_step,
                  uint64_t count) {
  for (uint64_t i = 0; i < count; ++i) {
    StoreFromFloatBits(LoadAsFloatBits(src, kFrom), dst, kTo);
    src += src_step;
    dst += dst_step;
  }
}

using ConvertFn = void (*)(const uint8_t*, int64_t, uint8_t*, int64_t, uint64_t);

template <DType kFrom>
ConvertFn PickTo(DType to) {
  switch (to) {
    case DType::kBF16:
      return &ConvertTyped<kFrom, DType::kBF16>;
    case DType::kFP16:
      return &ConvertTyped<kFrom, DType::kFP16>;
    case DType::kFP32:
      return &ConvertTyped<kFrom, DType::kFP32>;
    case DType::kFP8E4M3:
      return &ConvertTyped<kFrom, DType::kFP8E4M3>;
    case DType::kFP8E5M2:
      return &ConvertTyped<kFrom, DType::kFP8E5M2>;
    default:
      return nullptr;
  }
}

ConvertFn Pick(DType from, DType to) {
  switch (from) {
    case DType::kBF16:
      return PickTo<DType::kBF16>(to);
    case DType::kFP16:
      return PickTo<DType::kFP16>(to);
    case DType::kFP32:
      return PickTo<DType::kFP32>(to);
    case DType::kFP8E4M3:
      return PickTo<DType::kFP8E4M3>(to);
    case DType::kFP8E5M2:
      return PickTo<DType::kFP8E5M2>(to);
    default:
      return nullptr;
  }
}

}  // namespace

absl::Status CheckConvertible(DType from, DType to) {
  if (DTypeSize(from) == 0 || DTypeSize(to) == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot convert ", DTypeName(from), " to ", DTypeName(to), ": unknown dtype"));
  }
  if (from == to || (IsFloat(from) && IsFloat(to))) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("cannot convert ", DTypeName(from), " to ", DTypeName(to)));
}

void ConvertRun(const uint8_t* src, DType src_dtype, int64_t src_stride, uint8_t* dst,
                DType dst_dtype, int64_t dst_stride, uint64_t count) {
  const int64_t src_step = src_stride * static_cast<int64_t>(DTypeSize(src_dtype));
  const int64_t dst_step = dst_stride * static_cast<int64_t>(DTypeSize(dst_dtype));
  if (src_dtype == dst_dtype) {
    const size_t elem = DTypeSize(src_dtype);
    if (src_stride == 1 && dst_stride == 1) {
      std::memcpy(dst, src, count * elem);
      return;
    }
    for (uint64_t i = 0; i < count; ++i) {
      std::memcpy(dst, src, elem);
      src += src_step;
      dst += dst_step;
    }
    return;
  }
  if (ConvertFn fn = Pick(src_dtype, dst_dtype)) fn(src, src_step, dst, dst_step, count);
}

}  // namespace refit::plan
