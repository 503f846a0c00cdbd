// fp8 block quantization on the CPU: a scalar version and an AVX2 one (quantize_kernels.h).
#include "cuda/quantize_kernels.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda/float_bits.h"
#include "cuda/fp8_block.h"

#if defined(__x86_64__)
#include <immintrin.h>
// GCC 12's AVX-512 intrinsics start from _mm512_undefined_*() values, which -O2 reports as
// maybe-uninitialized where they are inlined (a known false positive, fixed in GCC 13).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

namespace refit::cuda::cpu {
namespace {

uint64_t CeilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

}  // namespace

absl::Status CheckFp8BlockRun(const Fp8BlockRun& run) {
  switch (run.src_dtype) {
    case DType::kBF16:
    case DType::kFP16:
    case DType::kFP32:
    case DType::kFP8E4M3:
    case DType::kFP8E5M2:
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "fp8 block quantization needs a float source, not ", DTypeName(run.src_dtype)));
  }
  if (run.block_cols == 0) return absl::InvalidArgumentError("block of zero columns");
  for (uint64_t r = 0; r < run.rows; ++r) {
    if (run.scale_row_of[r] >= run.scale_rows) {
      return absl::InvalidArgumentError(absl::StrCat("row ", r, " maps to scale row ",
                                                     run.scale_row_of[r], " of ", run.scale_rows));
    }
  }
  return absl::OkStatus();
}

namespace {

absl::Status CheckRun(const Fp8BlockRun& run) { return CheckFp8BlockRun(run); }

// fp32 bits of element i of a row of dtype `dtype`.
uint32_t LoadBits(const uint8_t* row, DType dtype, uint64_t i) {
  switch (dtype) {
    case DType::kBF16: {
      uint16_t v;
      std::memcpy(&v, row + 2 * i, 2);
      return bits::ToFloatBits<bits::kBF16>(v);
    }
    case DType::kFP16: {
      uint16_t v;
      std::memcpy(&v, row + 2 * i, 2);
      return bits::ToFloatBits<bits::kFP16>(v);
    }
    case DType::kFP32: {
      uint32_t v;
      std::memcpy(&v, row + 4 * i, 4);
      return v;
    }
    case DType::kFP8E4M3:
      return bits::ToFloatBits<bits::kE4M3>(row[i]);
    default:
      return bits::ToFloatBits<bits::kE5M2>(row[i]);
  }
}

const uint8_t* SrcRow(const Fp8BlockRun& run, uint64_t r) {
  return run.src + static_cast<int64_t>(r) * run.src_row_stride *
                       static_cast<int64_t>(DTypeSize(run.src_dtype));
}

// Scales from the amax grid (scale_rows x col_blocks bit patterns).
void WriteScales(const Fp8BlockRun& run, const std::vector<uint32_t>& amax, uint64_t col_blocks) {
  for (uint64_t sr = 0; sr < run.scale_rows; ++sr) {
    for (uint64_t j = 0; j < col_blocks; ++j) {
      run.scales[sr * run.scale_row_stride + j] = fp8::ScaleFromAmaxBits(amax[sr * col_blocks + j]);
    }
  }
}

// True for a scale that is a normal float: its quotients are finite and below 464
// (NormalAbsCodes); inf, NaN, zero and subnormal scales take the general path.
bool NormalScale(float s) {
  const uint32_t exponent = fp8::BitsOf(s) & fp8::kInfBits;
  return exponent != 0 && exponent != fp8::kInfBits;
}

#if defined(__x86_64__)

// Eight fp32 values from the row at column c (bf16 and fp32 loaded directly; other dtypes
// widened one by one).
#define REFIT_AVX2 inline __attribute__((always_inline, target("avx2")))

template <DType kDtype>
REFIT_AVX2 __m256 Load8(const uint8_t* row, uint64_t c) {
  if constexpr (kDtype == DType::kBF16) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * c));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16));
  }
  if constexpr (kDtype == DType::kFP32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(row + 4 * c));
  }
  alignas(32) uint32_t lanes[8];
  for (int k = 0; k < 8; ++k) lanes[k] = LoadBits(row, kDtype, c + k);
  return _mm256_load_ps(reinterpret_cast<const float*>(lanes));
}

// e4m3fn codes of eight quotients, in the low byte of each 32-bit lane; the same function as
// fp8::QuantizeOne after its division: normal results round the fp32 pattern to three fraction
// bits, subnormal ones round by adding 2^14 (whose ulp is e4m3's subnormal step, 2^-9).
REFIT_AVX2 __m256i E4M3Codes(__m256 y) {
  const __m256i bits = _mm256_castps_si256(y);
  const __m256i abs = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80));
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(abs, 20), _mm256_set1_epi32(1));
  const __m256i normal = _mm256_sub_epi32(
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(abs, _mm256_set1_epi32(0x7ffff)), lsb),
                        20),
      _mm256_set1_epi32(960));  // (127 - 7) << 3: fp32's exponent bias less e4m3's
  const __m256 shifted = _mm256_add_ps(_mm256_castsi256_ps(abs), _mm256_set1_ps(16384.0f));
  const __m256i subnormal =
      _mm256_sub_epi32(_mm256_castps_si256(shifted), _mm256_set1_epi32(0x46800000));
  const __m256i is_subnormal = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x3c800000), abs);  // < 2^-6
  __m256i code = _mm256_blendv_epi8(normal, subnormal, is_subnormal);
  const __m256i saturates = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x43dfffff));  // >= 448
  code = _mm256_blendv_epi8(code, _mm256_set1_epi32(0x7e), saturates);
  code = _mm256_or_si256(code, sign);
  const __m256i nan = _mm256_cmpgt_epi32(abs, _mm256_set1_epi32(0x7f800000));
  return _mm256_blendv_epi8(code, _mm256_set1_epi32(fp8::kE4M3NaN), nan);
}

// The low bytes of the eight lanes, stored as eight consecutive bytes.
REFIT_AVX2 void Store8(uint8_t* out, __m256i codes) {
  const __m256i pick =
      _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, 0, 4, 8, 12, -1,
                       -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i packed = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(codes, pick),
                                                     _mm256_setr_epi32(0, 4, 1, 1, 1, 1, 1, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
}

REFIT_AVX2 uint32_t HorizontalMax(__m256i v) {
  __m128i m = _mm_max_epu32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(2, 3, 0, 1)));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(m));
}

// NormalAbsCodes: E4M3Codes of quotients |y| where the block's scale is a normal float (every
// finite block but one whose amax is below 448 * 2^-126): the quotients are then finite and
// below 464 (448 and a few ulps at most), so nothing saturates past rounding and there is no
// NaN. One float addition rounds |y| onto e4m3's grid: C = 2^(e + 20) for |y| in [2^e, 2^(e+1))
// (e clamped up to -6, e4m3's smallest normal exponent, which makes the subnormals' step 2^-9
// the same way) gives |y| + C the ulp 2^(e - 3), e4m3's there, rounded to nearest even like
// the cast; its mantissa field is then round(|y| / 2^(e-3)), in [8, 16] (or [0, 8] below 2^-6),
// and the code is that plus 8 (e + 6) (a mantissa of 16 carries into the next exponent, as it
// should). 8 integer/float operations per vector, none of them a blend.
inline constexpr uint32_t kSmallestNormalExp = 0x3c800000u;  // 2^-6, e4m3's smallest normal
inline constexpr uint32_t kGridShift = 20u << 23;            // C = 2^(e + 20)

REFIT_AVX2 __m256i NormalAbsCodes(__m256i abs) {
  const __m256i m = _mm256_max_epu32(_mm256_and_si256(abs, _mm256_set1_epi32(0x7f800000)),
                                     _mm256_set1_epi32(kSmallestNormalExp));
  const __m256i c = _mm256_add_epi32(m, _mm256_set1_epi32(kGridShift));
  const __m256i sum =
      _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(abs), _mm256_castsi256_ps(c)));
  return _mm256_add_epi32(
      _mm256_sub_epi32(sum, c),
      _mm256_srli_epi32(_mm256_sub_epi32(m, _mm256_set1_epi32(kSmallestNormalExp)), 20));
}

REFIT_AVX2 __m256i NormalCodes(__m256 y) {
  const __m256i bits = _mm256_castps_si256(y);
  const __m256i abs = _mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff));
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(bits, 24), _mm256_set1_epi32(0x80));
  return _mm256_or_si256(NormalAbsCodes(abs), sign);
}

// NormalAbsCodes of |x| / scale for eight fp32 bit patterns |x| (the sign is added apart: with
// a normal scale, which is positive, a quotient has the sign of its dividend).
REFIT_AVX2 __m256i WideAbsCodes(__m256i wide_abs, __m256 scale) {
  return NormalAbsCodes(_mm256_castps_si256(_mm256_div_ps(_mm256_castsi256_ps(wide_abs), scale)));
}

// Elements [begin, end) of `row` quantized with scale `s` into `out`. bf16 rows with a normal
// scale go 32 elements at a time: widened by interleaving with zeros, and the codes packed
// back with two saturating packs (each works within 128-bit halves, so the interleave's order
// and the packs' cancel out up to one final 64-bit permute).
template <DType kDtype>
REFIT_AVX2 void QuantizeSpan(const uint8_t* row, uint8_t* out, uint64_t begin, uint64_t end,
                             float s) {
  const __m256 scale = _mm256_set1_ps(s);
  uint64_t c = begin;
  if (!NormalScale(s)) {
    for (; c + 8 <= end; c += 8) {
      Store8(out + c, E4M3Codes(_mm256_div_ps(Load8<kDtype>(row, c), scale)));
    }
  } else {
    if constexpr (kDtype == DType::kBF16) {
      const __m256i zero = _mm256_setzero_si256();
      for (; c + 32 <= end; c += 32) {
        const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * c));
        const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * c + 32));
        const __m256i abs16 = _mm256_set1_epi16(0x7fff);
        const __m256i a_abs = _mm256_and_si256(a, abs16);
        const __m256i b_abs = _mm256_and_si256(b, abs16);
        const __m256i low =
            _mm256_packs_epi32(WideAbsCodes(_mm256_unpacklo_epi16(zero, a_abs), scale),
                               WideAbsCodes(_mm256_unpackhi_epi16(zero, a_abs), scale));
        const __m256i high =
            _mm256_packs_epi32(WideAbsCodes(_mm256_unpacklo_epi16(zero, b_abs), scale),
                               WideAbsCodes(_mm256_unpackhi_epi16(zero, b_abs), scale));
        // The signs, as 0x80 in each element's 16 bits, in the same order as the packed codes.
        const __m256i sign_mask = _mm256_set1_epi16(0x80);
        const __m256i low_signed =
            _mm256_or_si256(low, _mm256_and_si256(_mm256_srli_epi16(a, 8), sign_mask));
        const __m256i high_signed =
            _mm256_or_si256(high, _mm256_and_si256(_mm256_srli_epi16(b, 8), sign_mask));
        const __m256i packed =
            _mm256_permute4x64_epi64(_mm256_packus_epi16(low_signed, high_signed), 0xD8);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c), packed);
      }
    }
    for (; c + 8 <= end; c += 8) {
      Store8(out + c, NormalCodes(_mm256_div_ps(Load8<kDtype>(row, c), scale)));
    }
  }
  for (; c < end; ++c) out[c] = fp8::QuantizeOne(fp8::FloatOf(LoadBits(row, kDtype, c)), s);
}

// The largest |x| bit pattern of elements [begin, end) of `row`; adds its infs and NaNs to
// `nonfinite`. bf16 is compared as 16-bit patterns (their order is that of the fp32 ones),
// sixteen at a time, and counted only where the span holds an inf or NaN.
template <DType kDtype>
REFIT_AVX2 uint32_t SpanAmax(const uint8_t* row, uint64_t begin, uint64_t end,
                             uint64_t* nonfinite) {
  uint64_t c = begin;
  uint32_t m = 0;
  if constexpr (kDtype == DType::kBF16) {
    __m256i best16 = _mm256_setzero_si256();
    const __m256i abs16 = _mm256_set1_epi16(0x7fff);
    for (; c + 16 <= end; c += 16) {
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 2 * c));
      best16 = _mm256_max_epu16(best16, _mm256_and_si256(raw, abs16));
    }
    __m128i m16 =
        _mm_max_epu16(_mm256_castsi256_si128(best16), _mm256_extracti128_si256(best16, 1));
    m16 = _mm_max_epu16(m16, _mm_srli_si128(m16, 8));
    m16 = _mm_max_epu16(m16, _mm_srli_si128(m16, 4));
    m16 = _mm_max_epu16(m16, _mm_srli_si128(m16, 2));
    m = static_cast<uint32_t>(_mm_extract_epi16(m16, 0)) << 16;
    if (m >= fp8::kInfBits) {
      for (uint64_t k = begin; k < c; ++k) {
        *nonfinite += (LoadBits(row, kDtype, k) & fp8::kAbsMask) >= fp8::kInfBits ? 1 : 0;
      }
    }
  } else {
    const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff);
    const __m256i finite_max = _mm256_set1_epi32(0x7f7fffff);
    __m256i best = _mm256_setzero_si256();
    __m256i bad = _mm256_setzero_si256();  // lanes count down by one per inf or NaN
    for (; c + 8 <= end; c += 8) {
      const __m256i abs = _mm256_and_si256(_mm256_castps_si256(Load8<kDtype>(row, c)), abs_mask);
      best = _mm256_max_epu32(best, abs);
      bad = _mm256_add_epi32(bad, _mm256_cmpgt_epi32(abs, finite_max));
    }
    m = HorizontalMax(best);
    alignas(32) int32_t counts[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(counts), bad);
    for (int k = 0; k < 8; ++k) {
      *nonfinite += static_cast<uint64_t>(-static_cast<int64_t>(counts[k]));
    }
  }
  for (; c < end; ++c) {
    const uint32_t abs = LoadBits(row, kDtype, c) & fp8::kAbsMask;
    m = std::max(m, abs);
    *nonfinite += abs >= fp8::kInfBits ? 1 : 0;
  }
  return m;
}

// Two passes over the run: the amax grid first, then every row (row after row, so the reads
// stream; a band of 128 rows mostly stays in cache between the passes).
template <DType kDtype>
__attribute__((target("avx2"))) uint64_t QuantizeAvx2(const Fp8BlockRun& run) {
  const uint64_t col_blocks = CeilDiv(run.cols, run.block_cols);
  uint64_t nonfinite = 0;
  std::vector<uint32_t> amax(run.scale_rows * col_blocks, 0);
  for (uint64_t r = 0; r < run.rows; ++r) {
    const uint8_t* row = SrcRow(run, r);
    uint32_t* grid = amax.data() + run.scale_row_of[r] * col_blocks;
    for (uint64_t j = 0; j < col_blocks; ++j) {
      const uint64_t begin = j * run.block_cols;
      const uint64_t end = std::min(run.cols, begin + run.block_cols);
      grid[j] = std::max(grid[j], SpanAmax<kDtype>(row, begin, end, &nonfinite));
    }
  }
  WriteScales(run, amax, col_blocks);
  for (uint64_t r = 0; r < run.rows; ++r) {
    const uint8_t* row = SrcRow(run, r);
    uint8_t* out = run.dst + static_cast<int64_t>(r) * run.dst_row_stride;
    const float* scale_row = run.scales + run.scale_row_of[r] * run.scale_row_stride;
    for (uint64_t j = 0; j < col_blocks; ++j) {
      const uint64_t begin = j * run.block_cols;
      QuantizeSpan<kDtype>(row, out, begin, std::min(run.cols, begin + run.block_cols),
                           scale_row[j]);
    }
  }
  return nonfinite;
}

// AVX-512 (F, BW, VL), bf16 sources: 32 elements a step, tails by masked loads and stores.
#define REFIT_AVX512 inline __attribute__((always_inline, target("avx512f,avx512bw,avx512vl")))

REFIT_AVX512 __m512i NormalAbsCodes512(__m512i abs) {
  const __m512i m = _mm512_max_epu32(_mm512_and_si512(abs, _mm512_set1_epi32(0x7f800000)),
                                     _mm512_set1_epi32(kSmallestNormalExp));
  const __m512i c = _mm512_add_epi32(m, _mm512_set1_epi32(kGridShift));
  const __m512i sum =
      _mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(abs), _mm512_castsi512_ps(c)));
  return _mm512_add_epi32(
      _mm512_sub_epi32(sum, c),
      _mm512_srli_epi32(_mm512_sub_epi32(m, _mm512_set1_epi32(kSmallestNormalExp)), 20));
}

// The e4m3 bytes of 32 bf16 elements `a` with a normal scale: |x| widened by interleaving with
// zeros (within 128-bit lanes), divided, coded, packed back to 16 bits (the pack undoes the
// interleave's order), the signs added from the source, and narrowed to bytes.
REFIT_AVX512 __m256i Bf16Codes32(__m512i a, __m512 scale) {
  const __m512i zero = _mm512_setzero_si512();
  const __m512i abs = _mm512_and_si512(a, _mm512_set1_epi16(0x7fff));
  const __m512i low = NormalAbsCodes512(_mm512_castps_si512(
      _mm512_div_ps(_mm512_castsi512_ps(_mm512_unpacklo_epi16(zero, abs)), scale)));
  const __m512i high = NormalAbsCodes512(_mm512_castps_si512(
      _mm512_div_ps(_mm512_castsi512_ps(_mm512_unpackhi_epi16(zero, abs)), scale)));
  const __m512i codes = _mm512_packus_epi32(low, high);
  // codes | (a >> 8 & 0x80): the sign bit of each bf16 lands on bit 7 of its code.
  const __m512i signed_codes =
      _mm512_ternarylogic_epi32(codes, _mm512_srli_epi16(a, 8), _mm512_set1_epi16(0x80), 0xF8);
  return _mm512_cvtepi16_epi8(signed_codes);
}

REFIT_AVX512 uint32_t HorizontalMax16(__m512i v) {
  const __m256i m256 = _mm256_max_epu16(_mm512_castsi512_si256(v), _mm512_extracti64x4_epi64(v, 1));
  __m128i m = _mm_max_epu16(_mm256_castsi256_si128(m256), _mm256_extracti128_si256(m256, 1));
  m = _mm_max_epu16(m, _mm_srli_si128(m, 8));
  m = _mm_max_epu16(m, _mm_srli_si128(m, 4));
  m = _mm_max_epu16(m, _mm_srli_si128(m, 2));
  return static_cast<uint32_t>(_mm_extract_epi16(m, 0));
}

// Mask of the first n (< 32) lanes.
REFIT_AVX512 __mmask32 FirstLanes(uint64_t n) { return static_cast<__mmask32>((1u << n) - 1); }

// The bf16 amax grid of a run with blocks of at least 32 columns: |x| as 16-bit patterns, a
// vector of running maxima per column block, reduced across lanes only when the scale row
// changes (once per band of a [128, 128]-blocked matrix, not once per row and block).
__attribute__((target("avx512f,avx512bw,avx512vl"))) void Bf16AmaxGrid512(const Fp8BlockRun& run,
                                                                          uint64_t col_blocks,
                                                                          uint32_t* amax) {
  struct alignas(64) Lanes {
    uint16_t v[32];
  };
  std::vector<Lanes> acc(col_blocks, Lanes{});
  const __m512i abs16 = _mm512_set1_epi16(0x7fff);
  uint64_t current = ~uint64_t{0};
  for (uint64_t r = 0; r <= run.rows; ++r) {
    if (r == run.rows || run.scale_row_of[r] != current) {
      if (current != ~uint64_t{0}) {  // the rows of scale row `current` end here
        uint32_t* grid = amax + current * col_blocks;
        for (uint64_t j = 0; j < col_blocks; ++j) {
          grid[j] = std::max(grid[j], HorizontalMax16(_mm512_load_si512(acc[j].v)) << 16);
          _mm512_store_si512(acc[j].v, _mm512_setzero_si512());
        }
      }
      if (r == run.rows) break;
      current = run.scale_row_of[r];
    }
    const uint8_t* row = SrcRow(run, r);
    for (uint64_t j = 0; j < col_blocks; ++j) {
      uint64_t c = j * run.block_cols;
      const uint64_t end = std::min(run.cols, c + run.block_cols);
      __m512i best = _mm512_load_si512(acc[j].v);
      for (; c + 32 <= end; c += 32) {
        best = _mm512_max_epu16(best, _mm512_and_si512(_mm512_loadu_si512(row + 2 * c), abs16));
      }
      if (c < end) {
        best = _mm512_max_epu16(
            best,
            _mm512_and_si512(_mm512_maskz_loadu_epi16(FirstLanes(end - c), row + 2 * c), abs16));
      }
      _mm512_store_si512(acc[j].v, best);
    }
  }
}

__attribute__((target("avx512f,avx512bw,avx512vl"))) uint64_t QuantizeBf16Avx512(
    const Fp8BlockRun& run) {
  const uint64_t col_blocks = CeilDiv(run.cols, run.block_cols);
  std::vector<uint32_t> amax(run.scale_rows * col_blocks, 0);
  Bf16AmaxGrid512(run, col_blocks, amax.data());
  // infs and NaNs, counted where a block's amax says it holds some.
  uint64_t nonfinite = 0;
  if (*std::max_element(amax.begin(), amax.end()) >= fp8::kInfBits) {
    for (uint64_t r = 0; r < run.rows; ++r) {
      const uint32_t* grid = amax.data() + run.scale_row_of[r] * col_blocks;
      for (uint64_t j = 0; j < col_blocks; ++j) {
        if (grid[j] < fp8::kInfBits) continue;
        const uint64_t end = std::min(run.cols, (j + 1) * run.block_cols);
        for (uint64_t c = j * run.block_cols; c < end; ++c) {
          nonfinite += fp8::NonFinite(LoadBits(SrcRow(run, r), DType::kBF16, c)) ? 1 : 0;
        }
      }
    }
  }
  WriteScales(run, amax, col_blocks);
  for (uint64_t r = 0; r < run.rows; ++r) {
    const uint8_t* row = SrcRow(run, r);
    uint8_t* out = run.dst + static_cast<int64_t>(r) * run.dst_row_stride;
    const float* scale_row = run.scales + run.scale_row_of[r] * run.scale_row_stride;
    for (uint64_t j = 0; j < col_blocks; ++j) {
      uint64_t c = j * run.block_cols;
      const uint64_t end = std::min(run.cols, c + run.block_cols);
      const float s = scale_row[j];
      if (!NormalScale(s)) {
        QuantizeSpan<DType::kBF16>(row, out, c, end, s);
        continue;
      }
      const __m512 scale = _mm512_set1_ps(s);
      for (; c + 32 <= end; c += 32) {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + c),
                            Bf16Codes32(_mm512_loadu_si512(row + 2 * c), scale));
      }
      if (c < end) {
        const __mmask32 mask = FirstLanes(end - c);
        _mm256_mask_storeu_epi8(out + c, mask,
                                Bf16Codes32(_mm512_maskz_loadu_epi16(mask, row + 2 * c), scale));
      }
    }
  }
  return nonfinite;
}

bool HaveAvx2() {
  static const bool have = __builtin_cpu_supports("avx2");
  return have;
}

bool HaveAvx512() {
  static const bool have = __builtin_cpu_supports("avx512f") &&
                           __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  return have;
}

absl::StatusOr<uint64_t> QuantizeVectorized(const Fp8BlockRun& run, bool avx512) {
  if (absl::Status status = CheckRun(run); !status.ok()) return status;
  switch (run.src_dtype) {
    case DType::kBF16:
      // Blocks narrower than one vector stay with AVX2's per-span loops.
      if (avx512 && run.block_cols >= 32) return QuantizeBf16Avx512(run);
      return QuantizeAvx2<DType::kBF16>(run);
    case DType::kFP32:
      return QuantizeAvx2<DType::kFP32>(run);
    case DType::kFP16:
      return QuantizeAvx2<DType::kFP16>(run);
    case DType::kFP8E4M3:
      return QuantizeAvx2<DType::kFP8E4M3>(run);
    default:
      return QuantizeAvx2<DType::kFP8E5M2>(run);
  }
}

#else

bool HaveAvx2() { return false; }
bool HaveAvx512() { return false; }

#endif

}  // namespace

absl::StatusOr<uint64_t> QuantizeFp8BlocksScalar(const Fp8BlockRun& run) {
  if (absl::Status status = CheckRun(run); !status.ok()) return status;
  const uint64_t col_blocks = CeilDiv(run.cols, run.block_cols);
  std::vector<uint32_t> amax(run.scale_rows * col_blocks, 0);
  uint64_t nonfinite = 0;
  for (uint64_t r = 0; r < run.rows; ++r) {
    const uint8_t* row = SrcRow(run, r);
    uint32_t* grid = amax.data() + run.scale_row_of[r] * col_blocks;
    for (uint64_t c = 0; c < run.cols; ++c) {
      const uint32_t abs = LoadBits(row, run.src_dtype, c) & fp8::kAbsMask;
      uint32_t& best = grid[c / run.block_cols];
      best = std::max(best, abs);
      nonfinite += abs >= fp8::kInfBits ? 1 : 0;
    }
  }
  WriteScales(run, amax, col_blocks);
  for (uint64_t r = 0; r < run.rows; ++r) {
    const uint8_t* row = SrcRow(run, r);
    uint8_t* out = run.dst + static_cast<int64_t>(r) * run.dst_row_stride;
    const float* scale_row = run.scales + run.scale_row_of[r] * run.scale_row_stride;
    for (uint64_t c = 0; c < run.cols; ++c) {
      out[c] = fp8::QuantizeOne(fp8::FloatOf(LoadBits(row, run.src_dtype, c)),
                                scale_row[c / run.block_cols]);
    }
  }
  return nonfinite;
}

bool Fp8KernelRuns(Fp8Kernel kernel) {
  switch (kernel) {
    case Fp8Kernel::kAvx512:
      return HaveAvx512() && HaveAvx2();
    case Fp8Kernel::kAvx2:
      return HaveAvx2();
    default:
      return true;
  }
}

Fp8Kernel Fp8BestKernel() {
  if (Fp8KernelRuns(Fp8Kernel::kAvx512)) return Fp8Kernel::kAvx512;
  if (Fp8KernelRuns(Fp8Kernel::kAvx2)) return Fp8Kernel::kAvx2;
  return Fp8Kernel::kScalar;
}

const char* Fp8KernelName(Fp8Kernel kernel) {
  switch (kernel) {
    case Fp8Kernel::kAvx512:
      return "AVX-512";
    case Fp8Kernel::kAvx2:
      return "AVX2";
    default:
      return "scalar";
  }
}

absl::StatusOr<uint64_t> QuantizeFp8BlocksWith(Fp8Kernel kernel, const Fp8BlockRun& run) {
  if (!Fp8KernelRuns(kernel)) {
    return absl::UnimplementedError(
        absl::StrCat("this CPU cannot run the ", Fp8KernelName(kernel), " fp8 kernel"));
  }
#if defined(__x86_64__)
  if (kernel != Fp8Kernel::kScalar) return QuantizeVectorized(run, kernel == Fp8Kernel::kAvx512);
#endif
  return QuantizeFp8BlocksScalar(run);
}

absl::StatusOr<uint64_t> QuantizeFp8Blocks(const Fp8BlockRun& run) {
  static const Fp8Kernel best = Fp8BestKernel();
  return QuantizeFp8BlocksWith(best, run);
}

bool Fp8BlocksVectorized() { return Fp8BestKernel() != Fp8Kernel::kScalar; }

}  // namespace refit::cuda::cpu
