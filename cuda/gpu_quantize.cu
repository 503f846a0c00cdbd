// GPU fp8 block quantization (gpu_quantize.h): one thread per element in grid-stride loops.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "cuda/float_bits.h"
#include "cuda/fp8_block.h"
#include "cuda/gpu_quantize.h"

namespace refit::cuda::gpu {
namespace {

constexpr int kThreads = 256;
constexpr uint64_t kMaxBlocks = 4096;

uint64_t CeilDiv(uint64_t a, uint64_t b) { return (a + b - 1) / b; }

template <int kCode>
__device__ uint32_t LoadBits(const uint8_t* row, uint64_t c) {
  if constexpr (kCode == bits::kFP32) {
    return reinterpret_cast<const uint32_t*>(row)[c];  // rows of fp32 are 4-byte aligned
  } else if constexpr (kCode == bits::kBF16 || kCode == bits::kFP16) {
    const uint32_t raw =
        static_cast<uint32_t>(row[2 * c]) | (static_cast<uint32_t>(row[2 * c + 1]) << 8);
    return bits::ToFloatBits<kCode>(raw);
  } else {
    return bits::ToFloatBits<kCode>(row[c]);
  }
}

template <int kCode>
__device__ const uint8_t* Row(const Fp8BlockRun& run, uint64_t r) {
  constexpr int64_t kSize = kCode == bits::kFP32                             ? 4
                            : (kCode == bits::kBF16 || kCode == bits::kFP16) ? 2
                                                                             : 1;
  return run.src + static_cast<int64_t>(r) * run.src_row_stride * kSize;
}

// A scale tensor may sit at any byte offset of a slot (the destination's layout places it), and
// a misaligned float access on the GPU is a sticky error that loses the process's CUDA context:
// whole floats where aligned, bytes otherwise (the GPU bundle's store-quantize step found it).
__device__ void StoreScale(float* at, float value) {
  if ((reinterpret_cast<uintptr_t>(at) & 3) == 0) {
    *at = value;
    return;
  }
  const uint32_t b = __float_as_uint(value);
  uint8_t* bytes = reinterpret_cast<uint8_t*>(at);
  bytes[0] = static_cast<uint8_t>(b);
  bytes[1] = static_cast<uint8_t>(b >> 8);
  bytes[2] = static_cast<uint8_t>(b >> 16);
  bytes[3] = static_cast<uint8_t>(b >> 24);
}

__device__ float LoadScale(const float* at) {
  if ((reinterpret_cast<uintptr_t>(at) & 3) == 0) return *at;
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(at);
  return __uint_as_float(static_cast<uint32_t>(bytes[0]) | static_cast<uint32_t>(bytes[1]) << 8 |
                         static_cast<uint32_t>(bytes[2]) << 16 |
                         static_cast<uint32_t>(bytes[3]) << 24);
}

// The element kernels walk a 2-D grid: rows over blockIdx.y, columns over the x threads, so that
// no element needs a 64-bit division to find its row and column (a 64-bit division is a long
// instruction sequence on the GPU; with three per element the kernels ran at 200 GB/s on an
// H200). A warp takes 32 neighbouring columns of one row at a time, its loop bound the warp's,
// so its lanes stay together; the lanes on one amax cell (usually all 32: one block's columns)
// take their max together and one of them does the atomic, instead of every element contending
// for the cell's address (70 GB/s with an atomic per element).

// Column c's block: a 32-bit division where the run's columns and blocks fit 32 bits (always,
// but for a row of 4 billion elements), a 64-bit one otherwise.
__device__ uint64_t ColBlock(uint64_t c, const Fp8BlockRun& run, bool narrow) {
  return narrow ? static_cast<uint32_t>(c) / static_cast<uint32_t>(run.block_cols)
                : c / run.block_cols;
}

__device__ bool Narrow(const Fp8BlockRun& run) {
  return run.cols <= 0xffffffffull && run.block_cols <= 0xffffffffull;
}

template <int kCode>
__global__ void AmaxKernel(Fp8BlockRun run, uint64_t col_blocks, uint32_t* amax,
                           unsigned long long* nonfinite) {
  const unsigned lane = threadIdx.x & 31u;
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  const bool narrow = Narrow(run);
  for (uint64_t r = blockIdx.y; r < run.rows; r += gridDim.y) {
    const uint8_t* row = Row<kCode>(run, r);
    const uint64_t cells = run.scale_row_of[r] * col_blocks;
    for (uint64_t warp = blockIdx.x * uint64_t{blockDim.x} + (threadIdx.x - lane); warp < run.cols;
         warp += stride) {
      const uint64_t c = warp + lane;
      const unsigned valid = __ballot_sync(0xffffffffu, c < run.cols);
      if (c >= run.cols) continue;
      const uint32_t abs = LoadBits<kCode>(row, c) & fp8::kAbsMask;
      if (abs >= fp8::kInfBits) atomicAdd(nonfinite, 1ull);
      const unsigned long long cell = cells + ColBlock(c, run, narrow);
      const unsigned same = __match_any_sync(valid, cell);
      const uint32_t most = __reduce_max_sync(same, abs);
      if (lane == static_cast<unsigned>(__ffs(same) - 1) && most != 0) {
        atomicMax(&amax[cell], most);
      }
    }
  }
}

__global__ void ScaleKernel(Fp8BlockRun run, uint64_t col_blocks, const uint32_t* amax) {
  const uint64_t total = run.scale_rows * col_blocks;
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < total;
       i += uint64_t{gridDim.x} * blockDim.x) {
    const uint64_t sr = i / col_blocks, j = i % col_blocks;
    StoreScale(run.scales + sr * run.scale_row_stride + j, fp8::ScaleFromAmaxBits(amax[i]));
  }
}

template <int kCode>
__global__ void QuantizeKernel(Fp8BlockRun run) {
  const uint64_t stride = uint64_t{gridDim.x} * blockDim.x;
  const bool narrow = Narrow(run);
  for (uint64_t r = blockIdx.y; r < run.rows; r += gridDim.y) {
    const uint8_t* row = Row<kCode>(run, r);
    const float* scales = run.scales + run.scale_row_of[r] * run.scale_row_stride;
    uint8_t* out = run.dst + static_cast<int64_t>(r) * run.dst_row_stride;
    for (uint64_t c = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; c < run.cols; c += stride) {
      const float s = LoadScale(scales + ColBlock(c, run, narrow));
      out[c] = fp8::QuantizeOne(fp8::FloatOf(LoadBits<kCode>(row, c)), s);
    }
  }
}

// The element kernels' grid: enough x blocks for a row's columns, rows over y (each capped; the
// kernels loop over what is left).
dim3 ElementGrid(uint64_t rows, uint64_t cols) {
  const uint64_t x = std::max<uint64_t>(1, std::min<uint64_t>(64, CeilDiv(cols, kThreads)));
  const uint64_t y =
      std::max<uint64_t>(1, std::min<uint64_t>({rows, uint64_t{65535}, kMaxBlocks * 4 / x}));
  return dim3(static_cast<unsigned>(x), static_cast<unsigned>(y));
}

unsigned Blocks(uint64_t n) {
  return static_cast<unsigned>(std::max<uint64_t>(1, std::min(kMaxBlocks, CeilDiv(n, kThreads))));
}

template <int kCode>
cudaError_t Launch(const Fp8BlockRun& run, uint32_t* amax, unsigned long long* nonfinite,
                   cudaStream_t stream) {
  const uint64_t col_blocks = CeilDiv(run.cols, run.block_cols);
  cudaError_t error =
      cudaMemsetAsync(amax, 0, run.scale_rows * col_blocks * sizeof(uint32_t), stream);
  if (error == cudaSuccess) error = cudaMemsetAsync(nonfinite, 0, sizeof(*nonfinite), stream);
  if (error != cudaSuccess) return error;
  const uint64_t elements = run.rows * run.cols;
  if (elements > 0) {
    AmaxKernel<kCode><<<ElementGrid(run.rows, run.cols), kThreads, 0, stream>>>(run, col_blocks,
                                                                                amax, nonfinite);
  }
  ScaleKernel<<<Blocks(run.scale_rows * col_blocks), kThreads, 0, stream>>>(run, col_blocks, amax);
  if (elements > 0) {
    QuantizeKernel<kCode><<<ElementGrid(run.rows, run.cols), kThreads, 0, stream>>>(run);
  }
  return cudaGetLastError();
}

}  // namespace

cudaError_t QuantizeFp8Blocks(const Fp8BlockRun& run, uint32_t* amax_scratch,
                              unsigned long long* nonfinite, cudaStream_t stream) {
  if (run.block_cols == 0) return cudaErrorInvalidValue;
  switch (run.src_dtype) {
    case bits::kBF16:
      return Launch<bits::kBF16>(run, amax_scratch, nonfinite, stream);
    case bits::kFP16:
      return Launch<bits::kFP16>(run, amax_scratch, nonfinite, stream);
    case bits::kFP32:
      if (reinterpret_cast<uintptr_t>(run.src) % 4 != 0) return cudaErrorInvalidValue;
      return Launch<bits::kFP32>(run, amax_scratch, nonfinite, stream);
    case bits::kE4M3:
      return Launch<bits::kE4M3>(run, amax_scratch, nonfinite, stream);
    case bits::kE5M2:
      return Launch<bits::kE5M2>(run, amax_scratch, nonfinite, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace refit::cuda::gpu
