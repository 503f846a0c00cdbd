// The GPU fp8 block quantization writes the bytes the CPU kernels write (which
// quantize_kernels_test holds to the reference of the rule): random bf16 matrices with the
// block shapes the API names, non-finite blocks, every bf16 pattern, other source dtypes.
// Needs a GPU (tags: gpu).

#include "cuda/gpu_quantize.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <random>
#include <vector>

#include "catch2/catch.hpp"
#include "cuda/gpu_testing.h"
#include "cuda/quantize_kernels.h"

namespace refit::cuda {
namespace {

using testing::CheckCuda;
using testing::DeviceBuffer;

struct Out {
  std::vector<uint8_t> q;
  std::vector<uint32_t> scale_bits;
  uint64_t nonfinite = 0;
};

Out OnCpu(const std::vector<uint8_t>& src, DType dtype, uint64_t rows, uint64_t cols,
          uint64_t block_cols, const std::vector<uint32_t>& map, uint64_t scale_rows) {
  const uint64_t col_blocks = (cols + block_cols - 1) / block_cols;
  Out out;
  out.q.resize(rows * cols);
  std::vector<float> scales(scale_rows * col_blocks);
  cpu::Fp8BlockRun run{src.data(),
                       dtype,
                       rows,
                       cols,
                       static_cast<int64_t>(cols),
                       block_cols,
                       map.data(),
                       scale_rows,
                       out.q.data(),
                       static_cast<int64_t>(cols),
                       scales.data(),
                       static_cast<int64_t>(col_blocks)};
  auto n = cpu::QuantizeFp8Blocks(run);
  REQUIRE(n.ok());
  out.nonfinite = *n;
  out.scale_bits.resize(scales.size());
  std::memcpy(out.scale_bits.data(), scales.data(), scales.size() * 4);
  return out;
}

Out OnGpu(const std::vector<uint8_t>& src, DType dtype, uint64_t rows, uint64_t cols,
          uint64_t block_cols, const std::vector<uint32_t>& map, uint64_t scale_rows) {
  const uint64_t col_blocks = (cols + block_cols - 1) / block_cols;
  DeviceBuffer d_src(src.size() + 1), d_map(map.size() * 4 + 1), d_q(rows * cols + 1),
      d_scales(scale_rows * col_blocks * 4 + 1), d_amax(scale_rows * col_blocks * 4 + 1),
      d_count(8);
  d_src.Upload(src.data(), src.size());
  d_map.Upload(map.data(), map.size() * 4);
  gpu::Fp8BlockRun run{d_src.get(),
                       static_cast<int>(dtype),
                       rows,
                       cols,
                       static_cast<int64_t>(cols),
                       block_cols,
                       reinterpret_cast<const uint32_t*>(d_map.get()),
                       scale_rows,
                       d_q.get(),
                       static_cast<int64_t>(cols),
                       reinterpret_cast<float*>(d_scales.get()),
                       static_cast<int64_t>(col_blocks)};
  CheckCuda(gpu::QuantizeFp8Blocks(run, reinterpret_cast<uint32_t*>(d_amax.get()),
                                   reinterpret_cast<unsigned long long*>(d_count.get()), nullptr),
            "QuantizeFp8Blocks");
  CheckCuda(cudaDeviceSynchronize(), "kernel");
  Out out;
  out.q = d_q.Download(rows * cols);
  const auto scale_bytes = d_scales.Download(scale_rows * col_blocks * 4);
  out.scale_bits.resize(scale_rows * col_blocks);
  std::memcpy(out.scale_bits.data(), scale_bytes.data(), scale_bytes.size());
  const auto count = d_count.Download(8);
  std::memcpy(&out.nonfinite, count.data(), 8);
  return out;
}

void Compare(const std::vector<uint8_t>& src, DType dtype, uint64_t rows, uint64_t cols,
             uint64_t block_rows, uint64_t block_cols) {
  std::vector<uint32_t> map(rows);
  for (uint64_t r = 0; r < rows; ++r) map[r] = static_cast<uint32_t>(r / block_rows);
  const uint64_t scale_rows = (rows + block_rows - 1) / block_rows;
  const Out cpu = OnCpu(src, dtype, rows, cols, block_cols, map, scale_rows);
  const Out gpu = OnGpu(src, dtype, rows, cols, block_cols, map, scale_rows);
  INFO(DTypeName(dtype) << " " << rows << "x" << cols << " blocks " << block_rows << "x"
                        << block_cols);
  REQUIRE(gpu.q == cpu.q);
  REQUIRE(gpu.scale_bits == cpu.scale_bits);
  REQUIRE(gpu.nonfinite == cpu.nonfinite);
}

TEST_CASE("GPU fp8 blocks are the CPU's, bit for bit", "[gpu][fp8]") {
  REQUIRE(testing::HaveGpu());
  std::mt19937_64 rng(7);
  std::normal_distribution<float> normal(0.0f, 0.05f);
  for (auto [rows, cols, br, bc] : std::vector<std::array<uint64_t, 4>>{
           {1024, 2048, 128, 128}, {300, 333, 128, 128}, {17, 1000, 1, 1000}, {64, 77, 64, 77}}) {
    std::vector<uint8_t> src(rows * cols * 2);
    for (uint64_t i = 0; i < rows * cols; ++i) {
      const float f = normal(rng);
      uint32_t b;
      std::memcpy(&b, &f, 4);
      const uint16_t h = static_cast<uint16_t>(b >> 16);
      std::memcpy(&src[2 * i], &h, 2);
    }
    if (rows > 200) {  // a NaN block and an inf block
      const uint16_t nan = 0x7fc3, inf = 0xff80;
      std::memcpy(&src[2 * (3 * cols + 5)], &nan, 2);
      std::memcpy(&src[2 * (150 * cols + 200)], &inf, 2);
    }
    Compare(src, DType::kBF16, rows, cols, br, bc);
  }
  std::vector<uint8_t> every(65536 * 2);
  for (uint32_t i = 0; i < 65536; ++i) std::memcpy(&every[2 * i], &i, 2);
  Compare(every, DType::kBF16, 1, 65536, 1, 128);
  for (DType dtype : {DType::kFP16, DType::kFP32, DType::kFP8E4M3, DType::kFP8E5M2}) {
    std::vector<uint8_t> raw(256 * 384 * DTypeSize(dtype));
    for (auto& b : raw) b = static_cast<uint8_t>(rng());
    Compare(raw, dtype, 256, 384, 128, 128);
  }
}

}  // namespace
}  // namespace refit::cuda
