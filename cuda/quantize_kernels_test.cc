// fp8 block quantization: the vectorized CPU kernels (AVX2, AVX-512) and the scalar one write
// the same bytes as the reference of the rule (quantize_testing.h), for every block shape the
// API names, odd sizes, non-finite inputs, every fp32 quotient class the e4m3 cast
// distinguishes, and every bf16 dividend against scales of every kind.

#include "cuda/quantize_kernels.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "catch2/catch.hpp"
#include "cuda/quantize_testing.h"

namespace refit::cuda {
namespace {

using testing::ReferenceQuantize;

struct Case {
  uint64_t rows, cols, block_rows, block_cols;
};

std::vector<uint16_t> RandomBf16(uint64_t n, uint64_t seed, double scale) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, static_cast<float>(scale));
  std::vector<uint16_t> out(n);
  for (auto& v : out) {
    const float f = normal(rng);
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    v = static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
  }
  return out;
}

struct Result {
  std::vector<uint8_t> q;
  std::vector<float> scales;
  uint64_t nonfinite = 0;
};

// Every version this CPU runs (scalar, AVX2, AVX-512); each test holds them all to the reference.
std::vector<cpu::Fp8Kernel> Kernels() {
  std::vector<cpu::Fp8Kernel> out;
  for (cpu::Fp8Kernel k :
       {cpu::Fp8Kernel::kScalar, cpu::Fp8Kernel::kAvx2, cpu::Fp8Kernel::kAvx512}) {
    if (cpu::Fp8KernelRuns(k)) out.push_back(k);
  }
  return out;
}

Result Run(cpu::Fp8Kernel kernel, const uint8_t* src, DType dtype, const Case& c,
           const std::vector<uint32_t>& map, uint64_t scale_rows) {
  const uint64_t col_blocks = (c.cols + c.block_cols - 1) / c.block_cols;
  Result out;
  out.q.assign(c.rows * c.cols, 0xAA);
  out.scales.assign(scale_rows * col_blocks, -1.0f);
  cpu::Fp8BlockRun run;
  run.src = src;
  run.src_dtype = dtype;
  run.rows = c.rows;
  run.cols = c.cols;
  run.src_row_stride = static_cast<int64_t>(c.cols);
  run.block_cols = c.block_cols;
  run.scale_row_of = map.data();
  run.scale_rows = scale_rows;
  run.dst = out.q.data();
  run.dst_row_stride = static_cast<int64_t>(c.cols);
  run.scales = out.scales.data();
  run.scale_row_stride = static_cast<int64_t>(col_blocks);
  auto n = cpu::QuantizeFp8BlocksWith(kernel, run);
  REQUIRE(n.ok());
  out.nonfinite = *n;
  return out;
}

void RequireSameBits(const std::vector<float>& a, const std::vector<float>& b) {
  REQUIRE(a.size() == b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    INFO("scale " << i << ": " << a[i] << " vs " << b[i]);
    REQUIRE(testing::FloatBits(a[i]) == testing::FloatBits(b[i]));
  }
}

void CheckBf16(const Case& c, std::vector<uint16_t> x) {
  std::vector<uint32_t> map(c.rows);
  for (uint64_t r = 0; r < c.rows; ++r) map[r] = static_cast<uint32_t>(r / c.block_rows);
  const uint64_t scale_rows = (c.rows + c.block_rows - 1) / c.block_rows;
  std::vector<float> wide(x.size());
  for (size_t i = 0; i < x.size(); ++i) wide[i] = testing::Bf16ToFloat(x[i]);
  const auto ref = ReferenceQuantize(wide, c.rows, c.cols, c.block_cols, map, scale_rows);
  const auto* src = reinterpret_cast<const uint8_t*>(x.data());
  for (cpu::Fp8Kernel kernel : Kernels()) {
    INFO(cpu::Fp8KernelName(kernel) << " rows " << c.rows << " cols " << c.cols << " block ["
                                    << c.block_rows << ", " << c.block_cols << "]");
    const Result got = Run(kernel, src, DType::kBF16, c, map, scale_rows);
    REQUIRE(got.q == ref.q);
    RequireSameBits(got.scales, ref.scales);
    REQUIRE(got.nonfinite == ref.nonfinite);
  }
}

TEST_CASE("fp8 blocks: both CPU kernels match the reference for every block shape",
          "[kernels][fp8]") {
  INFO("best kernel on this CPU: " << cpu::Fp8KernelName(cpu::Fp8BestKernel()));
  const std::vector<Case> cases = {
      {256, 256, 128, 128},  // DeepSeek-V3 blocks
      {300, 333, 128, 128},  // partial blocks at both ends
      {17, 1000, 1, 1000},   // per row
      {64, 77, 64, 77},      // per tensor
      {1, 5, 1, 5},          // shorter than one vector
      {130, 8, 128, 8},     {9, 129, 3, 16},
  };
  uint64_t seed = 1;
  for (const Case& c : cases) CheckBf16(c, RandomBf16(c.rows * c.cols, seed++, 0.02));
}

TEST_CASE("fp8 blocks: zeros, subnormals, huge values, inf and NaN", "[kernels][fp8]") {
  const Case c{128, 256, 64, 64};
  std::vector<uint16_t> x = RandomBf16(c.rows * c.cols, 99, 3.0);
  // Block (0, 0): all zero (scale 1); block (0, 1): one inf; block (1, 0): one NaN;
  // block (1, 1): -inf and NaN; block (0, 2): bf16 subnormals only; block (1, 2): huge.
  for (uint64_t r = 0; r < 64; ++r) {
    for (uint64_t col = 0; col < 64; ++col) x[r * c.cols + col] = (r + col) % 2 ? 0x8000 : 0;
    for (uint64_t col = 128; col < 192; ++col) x[r * c.cols + col] = 0x0001 + (r * col) % 0x7f;
  }
  for (uint64_t r = 64; r < 128; ++r) {
    for (uint64_t col = 128; col < 192; ++col) x[r * c.cols + col] = 0x7f00 + (col % 0x7f);
  }
  x[5 * c.cols + 70] = 0x7f80;     // +inf
  x[70 * c.cols + 3] = 0x7fc1;     // NaN with a payload
  x[100 * c.cols + 100] = 0xff80;  // -inf
  x[101 * c.cols + 101] = 0xffc0;  // -NaN
  CheckBf16(c, x);
}

TEST_CASE("fp8 blocks: every bf16 pattern in one row of per-row blocks", "[kernels][fp8]") {
  std::vector<uint16_t> x(65536);
  for (uint32_t i = 0; i < 65536; ++i) x[i] = static_cast<uint16_t>(i);
  CheckBf16({1, 65536, 1, 65536}, x);
  // The same patterns as 512 blocks of 128: most blocks are finite, a few hold inf or NaN.
  CheckBf16({1, 65536, 1, 128}, x);
}

TEST_CASE("fp8 blocks: fp32 quotients of every class round like plan::ConvertRun",
          "[kernels][fp8]") {
  // With 448 in a block its scale is exactly 1, so the quotients are the inputs: sample every
  // 97th fp32 pattern of magnitude up to 448 and a few past it, both signs.
  const uint64_t cols = 4096;
  std::vector<float> values;
  for (uint64_t bits = 0; bits <= 0x43e00000u; bits += 97) {
    float f;
    const uint32_t b = static_cast<uint32_t>(bits);
    std::memcpy(&f, &b, 4);
    values.push_back(f);
    values.push_back(-f);
  }
  for (uint32_t b : {0x43e00001u, 0x43e7ffffu, 0x43e80000u, 0x43f00000u}) {  // round to 448
    float f;
    std::memcpy(&f, &b, 4);
    values.push_back(f);
  }
  const uint64_t rows = (values.size() + cols - 2) / (cols - 1);
  std::vector<float> x(rows * cols, 0.0f);
  for (uint64_t r = 0, i = 0; r < rows; ++r) {
    x[r * cols] = 448.0f;
    for (uint64_t col = 1; col < cols && i < values.size(); ++col) x[r * cols + col] = values[i++];
  }
  // Values past 448 raise their row's scale: keep them out of the comparison of quotients by
  // checking the whole output against the reference anyway (it applies the same rule).
  std::vector<uint32_t> map(rows);
  for (uint64_t r = 0; r < rows; ++r) map[r] = static_cast<uint32_t>(r);
  const auto ref = ReferenceQuantize(x, rows, cols, cols, map, rows);
  const Case c{rows, cols, 1, cols};
  for (cpu::Fp8Kernel kernel : Kernels()) {
    const Result got =
        Run(kernel, reinterpret_cast<const uint8_t*>(x.data()), DType::kFP32, c, map, rows);
    REQUIRE(got.q == ref.q);
    RequireSameBits(got.scales, ref.scales);
  }
}

TEST_CASE("fp8 blocks: quotients next to the cast's rounding points, scales not powers of two",
          "[kernels][fp8]") {
  // Every row is one block whose first element fixes amax (s = amax / 448, rarely a power of
  // two), and the others are the fp32 values whose quotients land on, and a few patterns either
  // side of, the midpoints between neighbouring e4m3 values (normal and subnormal ones), the
  // subnormal boundary 2^-6 and 448 (where the vectorized kernels' rounding by addition changes
  // binade).
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> amaxes(1e-3f, 10.0f);
  std::uniform_int_distribution<int> exponent(-6, 8), mantissa(0, 7), delta(-8, 8);
  const uint64_t cols = 1024, rows = 96;
  std::vector<float> x(rows * cols, 0.0f);
  for (uint64_t r = 0; r < rows; ++r) {
    const float amax = r == 0 ? 448.0f * 3.0f : amaxes(rng);
    const float s = amax / 448.0f;
    x[r * cols] = amax;
    for (uint64_t col = 1; col < cols; ++col) {
      float target;
      switch (col % 4) {
        case 0:  // between two subnormals: (k + 1/2) 2^-9
          target = std::ldexp(static_cast<float>(mantissa(rng)) + 0.5f, -9);
          break;
        case 1:  // the subnormal boundary, and 448
          target = col % 8 == 1 ? std::ldexp(1.0f, -6) : 448.0f;
          break;
        default: {  // between two normals: (1 + (2m + 1) / 16) 2^e
          const int e = exponent(rng);
          target = std::ldexp(1.0f + static_cast<float>(2 * mantissa(rng) + 1) / 16.0f, e);
          if (target > 448.0f) target = 416.0f;
        }
      }
      uint32_t bits = testing::FloatBits(target * s);
      bits = static_cast<uint32_t>(static_cast<int64_t>(bits) + delta(rng));
      float value;
      std::memcpy(&value, &bits, 4);
      if (std::fabs(value) > amax) value = amax;
      x[r * cols + col] = (col / 4) % 2 ? -value : value;
    }
  }
  std::vector<uint32_t> map(rows);
  for (uint64_t r = 0; r < rows; ++r) map[r] = static_cast<uint32_t>(r);
  const auto ref = ReferenceQuantize(x, rows, cols, cols, map, rows);
  for (cpu::Fp8Kernel kernel : Kernels()) {
    INFO(cpu::Fp8KernelName(kernel));
    const Result got = Run(kernel, reinterpret_cast<const uint8_t*>(x.data()), DType::kFP32,
                           {rows, cols, 1, cols}, map, rows);
    REQUIRE(got.q == ref.q);
    RequireSameBits(got.scales, ref.scales);
  }
}

TEST_CASE("fp8 blocks: fp16 and fp8 sources, rows mapped to shared scale rows", "[kernels][fp8]") {
  // A fused [E=3, N=40, K=50] tensor with [1, 16, 16] blocks: rows of one expert map to r / 16,
  // offset by the expert's scale rows.
  const uint64_t experts = 3, n = 40, k = 50;
  const uint64_t rows = experts * n;
  std::vector<uint32_t> map(rows);
  const uint64_t per_expert = (n + 15) / 16;
  for (uint64_t e = 0; e < experts; ++e) {
    for (uint64_t r = 0; r < n; ++r)
      map[e * n + r] = static_cast<uint32_t>(e * per_expert + r / 16);
  }
  for (DType dtype : {DType::kFP16, DType::kFP8E4M3, DType::kFP8E5M2, DType::kFP32}) {
    const uint64_t size = DTypeSize(dtype);
    std::vector<uint8_t> raw(rows * k * size);
    std::mt19937_64 rng(static_cast<uint64_t>(dtype));
    for (auto& b : raw) b = static_cast<uint8_t>(rng());
    std::vector<float> wide(rows * k);
    plan::ConvertRun(raw.data(), dtype, 1, reinterpret_cast<uint8_t*>(wide.data()), DType::kFP32, 1,
                     rows * k);
    const auto ref = ReferenceQuantize(wide, rows, k, 16, map, experts * per_expert);
    for (cpu::Fp8Kernel kernel : Kernels()) {
      INFO(DTypeName(dtype) << " " << cpu::Fp8KernelName(kernel));
      const Result got =
          Run(kernel, raw.data(), dtype, {rows, k, 16, 16}, map, experts * per_expert);
      REQUIRE(got.q == ref.q);
      RequireSameBits(got.scales, ref.scales);
      REQUIRE(got.nonfinite == ref.nonfinite);
    }
  }
}

TEST_CASE("fp8 blocks: every bf16 dividend against scales of every kind", "[kernels][fp8]") {
  // One row per amax, one block per row (65,536 columns: the AVX-512 path): the amax first, then
  // every bf16 pattern whose magnitude is at most it (both signs, so every quotient the scale can
  // meet, ties of the cast included), the rest zeros. The amaxes give normal scales (powers of
  // two and not), 448 (a scale of exactly 1), the largest finite bf16, and bf16 subnormals and
  // tiny normals whose scales are fp32 subnormals (the vectorized kernels' general path).
  std::vector<uint16_t> amaxes = {0x3f80, 0x43e0, 0x7f7f, 0x0080, 0x0001, 0x007f,
                                  0x0a00, 0x3c00, 0x3ba3, 0x4111, 0x1234, 0x0000};
  std::mt19937_64 rng(11);
  for (int i = 0; i < 12; ++i) amaxes.push_back(static_cast<uint16_t>(rng() % 0x7f80));
  const uint64_t cols = 65536, rows = amaxes.size();
  std::vector<uint16_t> x(rows * cols, 0);
  for (uint64_t r = 0; r < rows; ++r) {
    x[r * cols] = amaxes[r];
    uint64_t col = 1;
    for (uint32_t p = 0; p < 65536 && col < cols; ++p) {
      if ((p & 0x7fff) <= amaxes[r]) x[r * cols + col++] = static_cast<uint16_t>(p);
    }
  }
  CheckBf16({rows, cols, 1, cols}, x);
}

TEST_CASE("fp8 blocks: fp32 blocks whose scale is zero or subnormal", "[kernels][fp8]") {
  // amax 2^-149 gives a scale of 0 (0 / 0 is NaN: code 0x7f; 2^-149 / 0 is inf: 0x7e), amaxes
  // of a few hundred 2^-149 give subnormal scales whose quotients pass 448.
  const uint64_t cols = 64;
  const std::vector<uint32_t> amax_bits = {1,   2,   3,    100,        224,
                                           225, 448, 1000, 0x00800000, 0x01000000};
  const uint64_t rows = amax_bits.size();
  std::vector<float> x(rows * cols, 0.0f);
  std::mt19937_64 rng(5);
  for (uint64_t r = 0; r < rows; ++r) {
    for (uint64_t c = 0; c < cols; ++c) {
      const uint32_t bits =
          c == 0 ? amax_bits[r] : static_cast<uint32_t>(rng() % (amax_bits[r] + 1));
      float f;
      std::memcpy(&f, &bits, 4);
      x[r * cols + c] = c % 3 == 1 ? -f : f;
    }
  }
  std::vector<uint32_t> map(rows);
  for (uint64_t r = 0; r < rows; ++r) map[r] = static_cast<uint32_t>(r);
  const auto ref = ReferenceQuantize(x, rows, cols, cols, map, rows);
  for (cpu::Fp8Kernel kernel : Kernels()) {
    INFO(cpu::Fp8KernelName(kernel));
    const Result got = Run(kernel, reinterpret_cast<const uint8_t*>(x.data()), DType::kFP32,
                           {rows, cols, 1, cols}, map, rows);
    REQUIRE(got.q == ref.q);
    RequireSameBits(got.scales, ref.scales);
  }
}

TEST_CASE("fp8 blocks: random bf16 bits, odd shapes, strided rows", "[kernels][fp8]") {
  // Random patterns (inf and NaN included, about one in 256) in blocks of 32 columns and more
  // (the AVX-512 path, with masked tails) and fewer, rows read at a stride past their width.
  std::mt19937_64 rng(21);
  const std::vector<Case> cases = {{128, 256, 128, 128}, {129, 300, 64, 128},  {33, 95, 32, 32},
                                   {7, 1000, 1, 48},     {200, 129, 100, 129}, {5, 77, 2, 33},
                                   {16, 40, 16, 7},      {3, 31, 3, 31}};
  for (const Case& c : cases) {
    const uint64_t stride = c.cols + 13;
    std::vector<uint16_t> x(c.rows * stride);
    for (auto& v : x) {
      v = static_cast<uint16_t>(rng());
      if ((v & 0x7f80) == 0x7f80 && rng() % 32 != 0) v &= 0xbfff;  // keep inf/NaN rare
    }
    std::vector<uint32_t> map(c.rows);
    for (uint64_t r = 0; r < c.rows; ++r) map[r] = static_cast<uint32_t>(r / c.block_rows);
    const uint64_t scale_rows = (c.rows + c.block_rows - 1) / c.block_rows;
    std::vector<float> wide(c.rows * c.cols);
    for (uint64_t r = 0; r < c.rows; ++r) {
      for (uint64_t col = 0; col < c.cols; ++col) {
        wide[r * c.cols + col] = testing::Bf16ToFloat(x[r * stride + col]);
      }
    }
    const auto ref = ReferenceQuantize(wide, c.rows, c.cols, c.block_cols, map, scale_rows);
    for (cpu::Fp8Kernel kernel : Kernels()) {
      INFO(cpu::Fp8KernelName(kernel) << " rows " << c.rows << " cols " << c.cols << " block ["
                                      << c.block_rows << ", " << c.block_cols << "]");
      const uint64_t col_blocks = (c.cols + c.block_cols - 1) / c.block_cols;
      std::vector<uint8_t> q(c.rows * c.cols, 0xAA);
      std::vector<float> scales(scale_rows * col_blocks, -1.0f);
      cpu::Fp8BlockRun run;
      run.src = reinterpret_cast<const uint8_t*>(x.data());
      run.src_dtype = DType::kBF16;
      run.rows = c.rows;
      run.cols = c.cols;
      run.src_row_stride = static_cast<int64_t>(stride);
      run.block_cols = c.block_cols;
      run.scale_row_of = map.data();
      run.scale_rows = scale_rows;
      run.dst = q.data();
      run.dst_row_stride = static_cast<int64_t>(c.cols);
      run.scales = scales.data();
      run.scale_row_stride = static_cast<int64_t>(col_blocks);
      auto n = cpu::QuantizeFp8BlocksWith(kernel, run);
      REQUIRE(n.ok());
      REQUIRE(*n == ref.nonfinite);
      REQUIRE(q == ref.q);
      RequireSameBits(scales, ref.scales);
    }
  }
}

TEST_CASE("fp8 blocks: the best kernel is the one QuantizeFp8Blocks runs", "[kernels][fp8]") {
  REQUIRE(cpu::Fp8KernelRuns(cpu::Fp8Kernel::kScalar));
  REQUIRE(cpu::Fp8KernelRuns(cpu::Fp8BestKernel()));
  REQUIRE(cpu::Fp8BlocksVectorized() == (cpu::Fp8BestKernel() != cpu::Fp8Kernel::kScalar));
#if defined(__x86_64__)
  REQUIRE(cpu::Fp8KernelRuns(cpu::Fp8Kernel::kAvx512) ==
          (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx2")));
#endif
  for (cpu::Fp8Kernel k : {cpu::Fp8Kernel::kAvx2, cpu::Fp8Kernel::kAvx512}) {
    if (cpu::Fp8KernelRuns(k)) continue;
    cpu::Fp8BlockRun run;
    REQUIRE(cpu::QuantizeFp8BlocksWith(k, run).status().code() == absl::StatusCode::kUnimplemented);
  }
}

TEST_CASE("fp8 blocks: a non-float source is refused", "[kernels][fp8]") {
  std::vector<uint8_t> raw(16), q(16);
  std::vector<float> scales(1);
  std::vector<uint32_t> map(1, 0);
  cpu::Fp8BlockRun run;
  run.src = raw.data();
  run.src_dtype = DType::kINT8;
  run.rows = 1;
  run.cols = 16;
  run.block_cols = 16;
  run.scale_row_of = map.data();
  run.scale_rows = 1;
  run.dst = q.data();
  run.scales = scales.data();
  REQUIRE(cpu::QuantizeFp8Blocks(run).status().code() == absl::StatusCode::kInvalidArgument);
  run.src_dtype = DType::kBF16;
  run.block_cols = 0;
  REQUIRE(cpu::QuantizeFp8BlocksScalar(run).status().code() == absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace refit::cuda
