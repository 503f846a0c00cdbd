// Conversions bit-exact against a reference written here: formats decoded with ldexp, rounding
// by searching the sorted list of every representable value (ties to the even pattern).
// Exhaustive over all 16-bit and 8-bit inputs; fp32 inputs random plus ties, neighbours of ties,
// subnormals, overflow, inf and NaN.

#include "daemon/plan/dtype_convert.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "catch2/catch.hpp"
#include "daemon/common/types.h"

namespace refit::plan {
namespace {

// A reference format: sign, `exp_bits`, `mant` fraction bits.
struct RefFormat {
  DType dtype;
  int exp_bits;
  int mant;
  bool ieee_specials;  // top exponent is inf/NaN (bf16, fp16, e5m2); else e4m3fn
  bool saturate;       // finite overflow goes to max (fp8) instead of inf
  int bits() const { return 1 + exp_bits + mant; }
  int bias() const { return (1 << (exp_bits - 1)) - 1; }
  uint32_t sign_bit() const { return uint32_t{1} << (bits() - 1); }
  uint32_t max_finite() const {
    if (!ieee_specials) return sign_bit() - 2;  // 0x7e: 0x7f is NaN
    return (((uint32_t{1} << exp_bits) - 2) << mant) | ((uint32_t{1} << mant) - 1);
  }
  uint32_t inf() const { return ((uint32_t{1} << exp_bits) - 1) << mant; }
  bool IsNaN(uint32_t p) const {
    const uint32_t mag = p & (sign_bit() - 1);
    if (!ieee_specials) return mag == sign_bit() - 1;
    return mag > inf();
  }
  double Decode(uint32_t p) const {
    const bool negative = p & sign_bit();
    const uint32_t mag = p & (sign_bit() - 1);
    if (IsNaN(p)) return std::copysign(NAN, negative ? -1.0 : 1.0);
    if (ieee_specials && mag == inf()) return negative ? -INFINITY : INFINITY;
    const uint32_t e = mag >> mant;
    const uint32_t m = mag & ((uint32_t{1} << mant) - 1);
    const double v = e == 0 ? std::ldexp(m, 1 - bias() - mant)
                            : std::ldexp(m + (1u << mant), static_cast<int>(e) - bias() - mant);
    return negative ? -v : v;
  }
};

const RefFormat kBF16{DType::kBF16, 8, 7, true, false};
const RefFormat kFP16{DType::kFP16, 5, 10, true, false};
const RefFormat kE4M3{DType::kFP8E4M3, 4, 3, false, true};
const RefFormat kE5M2{DType::kFP8E5M2, 5, 2, true, true};
const RefFormat kNarrow[] = {kBF16, kFP16, kE4M3, kE5M2};

// Rounds `x` (not NaN) to `f`: every magnitude pattern 0..max_finite is a value, in order, so
// the answer is found by binary search; ties go to the even pattern.
struct Rounder {
  explicit Rounder(const RefFormat& format) : f(format) {
    for (uint32_t p = 0; p <= f.max_finite(); ++p) values.push_back(f.Decode(p));
    // One step past max: where rounding would go with an unbounded exponent (pattern max + 1,
    // which is even).
    const uint32_t max = f.max_finite();
    values.push_back(values[max] + (values[max] - values[max - 1]));
  }
  uint32_t operator()(double x) const {
    const uint32_t sign = std::signbit(x) ? f.sign_bit() : 0;
    const double a = std::fabs(x);
    const uint32_t max = f.max_finite();
    const uint32_t overflow = f.saturate ? max : f.inf();
    if (std::isinf(a)) return sign | (f.ieee_specials ? f.inf() : max);
    if (a > values[max] && f.saturate) return sign | max;
    if (a >= values[max + 1]) return sign | overflow;
    const size_t hi = std::upper_bound(values.begin(), values.end(), a) - values.begin();
    const size_t lo = hi - 1;  // values[lo] <= a < values[hi]
    if (a == values[lo]) return sign | static_cast<uint32_t>(lo);
    const double below = a - values[lo];
    const double above = values[hi] - a;
    const size_t pick = below < above ? lo : above < below ? hi : (lo % 2 == 0 ? lo : hi);
    if (pick > max) return sign | overflow;
    return sign | static_cast<uint32_t>(pick);
  }
  const RefFormat& f;
  std::vector<double> values;  // magnitudes of patterns 0..max, then the step past max
};

uint32_t RefRound(const RefFormat& f, double x) { return Rounder(f)(x); }

uint32_t Convert1(uint32_t in, DType from, DType to) {
  uint8_t src[4];
  uint8_t dst[4] = {0, 0, 0, 0};
  std::memcpy(src, &in, 4);
  ConvertRun(src, from, 1, dst, to, 1, 1);
  uint32_t out = 0;
  std::memcpy(&out, dst, DTypeSize(to));
  return out;
}

// Checks one conversion of `in` (decoding to `value`) into `to` against the reference.
void CheckOne(uint32_t in, double value, DType from, const RefFormat& to, const Rounder& round) {
  const uint32_t got = Convert1(in, from, to.dtype);
  INFO(DTypeName(from) << " 0x" << std::hex << in << " -> " << DTypeName(to.dtype) << " got 0x"
                       << got);
  if (std::isnan(value)) {
    REQUIRE(to.IsNaN(got));
    REQUIRE(((got & to.sign_bit()) != 0) == std::signbit(value));
    return;
  }
  REQUIRE(got == round(value));
}

TEST_CASE("reference rounding sanity", "[convert]") {
  CHECK(RefRound(kFP16, 1.0) == 0x3c00);
  CHECK(RefRound(kFP16, 65504.0) == 0x7bff);
  CHECK(RefRound(kFP16, 65519.99) == 0x7bff);
  CHECK(RefRound(kFP16, 65520.0) == 0x7c00);               // tie with the next power: even -> inf
  CHECK(RefRound(kFP16, std::ldexp(1.0, -25)) == 0x0000);  // half the smallest subnormal
  CHECK(RefRound(kFP16, std::ldexp(3.0, -26)) == 0x0001);
  CHECK(RefRound(kE4M3, 448.0) == 0x7e);
  CHECK(RefRound(kE4M3, 1e9) == 0x7e);
  CHECK(RefRound(kE4M3, -1e9) == 0xfe);
  CHECK(RefRound(kE4M3, std::ldexp(1.0, -9)) == 0x01);
  CHECK(RefRound(kE5M2, 57344.0) == 0x7b);
  CHECK(RefRound(kE5M2, 1e9) == 0x7b);
  CHECK(RefRound(kE5M2, INFINITY) == 0x7c);
  CHECK(RefRound(kBF16, 1.0 + std::ldexp(1.0, -8)) == 0x3f80);  // tie -> even
  CHECK(RefRound(kBF16, 1.0 + 3 * std::ldexp(1.0, -8)) == 0x3f82);
}

TEST_CASE("every 16-bit and 8-bit float widens to fp32 exactly", "[convert]") {
  for (const RefFormat& f : kNarrow) {
    for (uint32_t p = 0; p < (uint32_t{1} << f.bits()); ++p) {
      const uint32_t bits = Convert1(p, f.dtype, DType::kFP32);
      float got;
      std::memcpy(&got, &bits, 4);
      const double want = f.Decode(p);
      INFO(DTypeName(f.dtype) << " pattern " << p);
      if (std::isnan(want)) {
        REQUIRE(std::isnan(got));
        REQUIRE(std::signbit(got) == ((p & f.sign_bit()) != 0));
      } else {
        REQUIRE(static_cast<double>(got) == want);
        REQUIRE(std::signbit(got) == std::signbit(want));
      }
    }
  }
}

TEST_CASE("every 16-bit and 8-bit float converts to every other narrow float", "[convert]") {
  for (const RefFormat& to : kNarrow) {
    const Rounder round(to);
    for (const RefFormat& from : kNarrow) {
      if (from.dtype == to.dtype) continue;
      for (uint32_t p = 0; p < (uint32_t{1} << from.bits()); ++p) {
        CheckOne(p, from.Decode(p), from.dtype, to, round);
      }
    }
  }
}

// fp32 inputs that stress rounding for `to`: every tie between neighbours, one f32 ulp either
// side, values around max, subnormals of both formats, and specials.
std::vector<uint32_t> HardFloats(const RefFormat& to) {
  std::vector<uint32_t> out;
  auto add = [&](double v) {
    const float f = static_cast<float>(v);
    if (static_cast<double>(f) != v) return;  // only exact f32 values
    uint32_t b;
    std::memcpy(&b, &f, 4);
    for (uint32_t s : {0u, 0x80000000u}) {
      out.push_back(b | s);
      out.push_back((b + 1) | s);
      if ((b & 0x7fffffff) != 0) out.push_back((b - 1) | s);
    }
  };
  const uint32_t max = to.max_finite();
  for (uint32_t p = 0; p < max; ++p) {
    const double a = to.Decode(p);
    const double b = to.Decode(p + 1);
    add(a);
    add((a + b) / 2);
  }
  const double top = to.Decode(max);
  const double step = top - to.Decode(max - 1);
  for (double k : {0.5, 1.0, 1.5, 2.0, 3.0, 1000.0}) add(top + k * step);
  add(top * 2);
  for (uint32_t b : {0x7f800000u, 0x7f7fffffu, 0x7fc00000u, 0x7fa00001u, 0x00000001u, 0x007fffffu,
                     0x00800000u, 0x00400000u}) {
    out.push_back(b);
    out.push_back(b | 0x80000000u);
  }
  return out;
}

TEST_CASE("fp32 narrows with one round-to-nearest-even step", "[convert]") {
  std::mt19937 rng(7);
  for (const RefFormat& to : kNarrow) {
    const Rounder round(to);
    std::vector<uint32_t> inputs = HardFloats(to);
    for (int i = 0; i < 300000; ++i) inputs.push_back(static_cast<uint32_t>(rng()));
    // Random values in the format's range, where most of the interesting rounding happens.
    for (int i = 0; i < 300000; ++i) {
      const uint32_t r = static_cast<uint32_t>(rng());
      const int exp =
          127 - to.bias() - to.mant - 2 + static_cast<int>(r % (2 * to.bias() + to.mant + 6));
      if (exp <= 0 || exp >= 255) continue;
      inputs.push_back((r & 0x80000000u) | (static_cast<uint32_t>(exp) << 23) |
                       (static_cast<uint32_t>(rng()) & 0x7fffff));
    }
    for (uint32_t in : inputs) {
      float value;
      std::memcpy(&value, &in, 4);
      CheckOne(in, value, DType::kFP32, to, round);
    }
  }
}

TEST_CASE("documented edge cases", "[convert]") {
  // e4m3fn: inf and overflow saturate to 448, NaN is 0x7f / 0xff.
  CHECK(Convert1(0x7f800000u, DType::kFP32, DType::kFP8E4M3) == 0x7e);
  CHECK(Convert1(0xff800000u, DType::kFP32, DType::kFP8E4M3) == 0xfe);
  CHECK(Convert1(0x7fc00000u, DType::kFP32, DType::kFP8E4M3) == 0x7f);
  CHECK(Convert1(0xffc00000u, DType::kFP32, DType::kFP8E4M3) == 0xff);
  // e5m2: inf stays inf, finite overflow saturates.
  CHECK(Convert1(0x7f800000u, DType::kFP32, DType::kFP8E5M2) == 0x7c);
  CHECK(Convert1(0x7c00u, DType::kFP16, DType::kFP8E5M2) == 0x7c);
  CHECK(Convert1(0x7bffu, DType::kFP16, DType::kFP8E5M2) == 0x7b);  // 65504 -> 57344
  // fp16 overflow is inf; bf16 keeps its range.
  CHECK(Convert1(0x7f7fu, DType::kBF16, DType::kFP16) == 0x7c00);
  CHECK(Convert1(0x477fe000u, DType::kFP32, DType::kFP16) == 0x7bff);  // 65504
  CHECK(Convert1(0x477ff000u, DType::kFP32, DType::kFP16) == 0x7c00);  // 65520: tie -> inf
  // Signed zeros survive.
  CHECK(Convert1(0x80000000u, DType::kFP32, DType::kBF16) == 0x8000);
  CHECK(Convert1(0x8000u, DType::kFP16, DType::kFP8E4M3) == 0x80);
}

TEST_CASE("same-dtype runs copy bytes for every dtype, with strides", "[convert]") {
  const DType all[] = {DType::kBF16, DType::kFP16,  DType::kFP32,  DType::kFP8E4M3, DType::kFP8E5M2,
                       DType::kINT8, DType::kUINT8, DType::kINT32, DType::kINT64};
  for (DType dtype : all) {
    const size_t elem = DTypeSize(dtype);
    std::vector<uint8_t> src(64 * elem);
    for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 37 + 11);
    // Includes NaN bit patterns: copies must not touch them.
    std::vector<uint8_t> dst(64 * elem, 0);
    ConvertRun(src.data(), dtype, 1, dst.data(), dtype, 1, 64);
    CHECK(dst == src);
    std::fill(dst.begin(), dst.end(), 0);
    ConvertRun(src.data(), dtype, 3, dst.data(), dtype, 2, 20);
    for (size_t i = 0; i < 20; ++i) {
      CHECK(std::memcmp(&dst[2 * i * elem], &src[3 * i * elem], elem) == 0);
      CHECK(std::all_of(&dst[(2 * i + 1) * elem], &dst[(2 * i + 2) * elem],
                        [](uint8_t b) { return b == 0; }));
    }
  }
}

TEST_CASE("strided conversions place each element", "[convert]") {
  std::vector<uint16_t> src(30);
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint16_t>(0x3f80 + i);  // bf16
  std::vector<float> dst(40, -7.0f);
  ConvertRun(reinterpret_cast<const uint8_t*>(src.data()), DType::kBF16, 3,
             reinterpret_cast<uint8_t*>(dst.data()), DType::kFP32, 4, 10);
  for (size_t i = 0; i < 40; ++i) {
    if (i % 4 == 0) {
      CHECK(dst[i] == static_cast<float>(kBF16.Decode(0x3f80 + 3 * (i / 4))));
    } else {
      CHECK(dst[i] == -7.0f);
    }
  }
}

TEST_CASE("CheckConvertible: same dtype or float to float", "[convert]") {
  const DType floats[] = {DType::kBF16, DType::kFP16, DType::kFP32, DType::kFP8E4M3,
                          DType::kFP8E5M2};
  const DType ints[] = {DType::kINT8, DType::kUINT8, DType::kINT32, DType::kINT64};
  for (DType a : floats) {
    for (DType b : floats) CHECK(CheckConvertible(a, b).ok());
    for (DType b : ints) {
      CHECK(CheckConvertible(a, b).code() == absl::StatusCode::kInvalidArgument);
      CHECK(CheckConvertible(b, a).code() == absl::StatusCode::kInvalidArgument);
    }
  }
  for (DType a : ints) {
    for (DType b : ints) {
      CHECK(CheckConvertible(a, b).code() ==
            (a == b ? absl::StatusCode::kOk : absl::StatusCode::kInvalidArgument));
    }
  }
  CHECK(CheckConvertible(DType::kUnspecified, DType::kUnspecified).code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(CheckConvertible(DType::kFP32, static_cast<DType>(99)).code() ==
        absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace refit::plan
