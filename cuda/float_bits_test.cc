// float_bits.h is what the GPU conversion kernels run; here, on the CPU, it must give exactly
// plan::ConvertRun's bytes: for every 8- and 16-bit input, and for fp32 inputs covering every
// exponent with the mantissas around each target's rounding boundaries plus millions of
// scattered patterns. So a GPU without a GPU test still converts like the CPU.

#include "cuda/float_bits.h"

#include <cstring>
#include <random>
#include <vector>

#include "catch2/catch.hpp"
#include "daemon/plan/dtype_convert.h"

namespace refit::cuda {
namespace {

constexpr DType kFloats[] = {DType::kBF16, DType::kFP16, DType::kFP32, DType::kFP8E4M3,
                             DType::kFP8E5M2};

template <int kFrom>
uint32_t ConvertFrom(DType to, uint32_t raw) {
  switch (to) {
    case DType::kBF16:
      return bits::ConvertBits<kFrom, bits::kBF16>(raw);
    case DType::kFP16:
      return bits::ConvertBits<kFrom, bits::kFP16>(raw);
    case DType::kFP32:
      return bits::ConvertBits<kFrom, bits::kFP32>(raw);
    case DType::kFP8E4M3:
      return bits::ConvertBits<kFrom, bits::kE4M3>(raw);
    default:
      return bits::ConvertBits<kFrom, bits::kE5M2>(raw);
  }
}

uint32_t BitsConvert(DType from, DType to, uint32_t raw) {
  switch (from) {
    case DType::kBF16:
      return ConvertFrom<bits::kBF16>(to, raw);
    case DType::kFP16:
      return ConvertFrom<bits::kFP16>(to, raw);
    case DType::kFP32:
      return ConvertFrom<bits::kFP32>(to, raw);
    case DType::kFP8E4M3:
      return ConvertFrom<bits::kE4M3>(to, raw);
    default:
      return ConvertFrom<bits::kE5M2>(to, raw);
  }
}

// Converts `inputs` (raw patterns of `from`) both ways; returns how many differ, and INFOs the
// first.
uint64_t Mismatches(DType from, DType to, const std::vector<uint32_t>& inputs) {
  const size_t es = DTypeSize(from), ed = DTypeSize(to);
  std::vector<uint8_t> src(inputs.size() * es), dst(inputs.size() * ed);
  for (size_t i = 0; i < inputs.size(); ++i) std::memcpy(&src[i * es], &inputs[i], es);
  plan::ConvertRun(src.data(), from, 1, dst.data(), to, 1, inputs.size());
  uint64_t wrong = 0;
  for (size_t i = 0; i < inputs.size(); ++i) {
    uint32_t want = 0;
    std::memcpy(&want, &dst[i * ed], ed);
    const uint32_t got = BitsConvert(from, to, inputs[i]);
    if (got != want) {
      if (wrong == 0) {
        UNSCOPED_INFO(DTypeName(from) << " 0x" << std::hex << inputs[i] << " -> " << DTypeName(to)
                                      << ": 0x" << got << ", ConvertRun 0x" << want);
      }
      ++wrong;
    }
  }
  return wrong;
}

TEST_CASE("every 8- and 16-bit input converts exactly as plan::ConvertRun", "[float_bits]") {
  for (const DType from : kFloats) {
    if (from == DType::kFP32) continue;
    const uint32_t patterns = DTypeSize(from) == 1 ? 256 : 65536;
    std::vector<uint32_t> inputs(patterns);
    for (uint32_t i = 0; i < patterns; ++i) inputs[i] = i;
    for (const DType to : kFloats) CHECK(Mismatches(from, to, inputs) == 0);
  }
}

TEST_CASE("fp32 inputs convert exactly as plan::ConvertRun", "[float_bits]") {
  std::vector<uint32_t> inputs;
  // Every sign and exponent (zeros, subnormals, normals, inf/NaN) with mantissas at and around
  // the rounding boundaries of each target (ties, one below, one above), at the extremes, and
  // random.
  std::mt19937 rng(11);
  for (uint32_t sign = 0; sign < 2; ++sign) {
    for (uint32_t exponent = 0; exponent < 256; ++exponent) {
      const uint32_t top = (sign << 31) | (exponent << 23);
      for (const int dropped : {13, 16, 20, 21}) {  // fp16, bf16, e4m3, e5m2 fraction bits cut
        const uint32_t half = uint32_t{1} << (dropped - 1);
        for (uint32_t kept = 0; kept < 8; ++kept) {
          const uint32_t base = kept << dropped;
          for (const uint32_t low : {0u, 1u, half - 1, half, half + 1, 2 * half - 1}) {
            inputs.push_back(top | ((base | low) & 0x7fffffu));
            inputs.push_back(top | ((0x7fffffu - base - low) & 0x7fffffu));
          }
        }
      }
      for (int i = 0; i < 256; ++i) inputs.push_back(top | (rng() & 0x7fffffu));
    }
  }
  // And 2^24 patterns spread over the whole 32-bit space.
  for (uint32_t i = 0; i < (1u << 24); ++i) inputs.push_back(i * 0x9e3779b1u + 0x7f4a7c15u);
  for (const DType to : kFloats) CHECK(Mismatches(DType::kFP32, to, inputs) == 0);
}

}  // namespace
}  // namespace refit::cuda
