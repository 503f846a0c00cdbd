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

template <int kCode>
__global__ void AmaxKernel(Fp8BlockRun run, uint64_t col_blocks, uint32_t* amax,
                           unsigned long long* nonfinite) {
  const uint64_t total = run.rows * run.cols;
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < total;
       i += uint64_t{gridDim.x} * blockDim.x) {
    const uint64_t r = i / run.cols, c = i % run.cols;
    const uint32_t abs = LoadBits<kCode>(Row<kCode>(run, r), c) & fp8::kAbsMask;
    if (abs >= fp8::kInfBits) atomicAdd(nonfinite, 1ull);
    if (abs != 0) atomicMax(&amax[run.scale_row_of[r] * col_blocks + c / run.block_cols], abs);
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
  const uint64_t total = run.rows * run.cols;
  for (uint64_t i = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x; i < total;
       i += uint64_t{gridDim.x} * blockDim.x) {
    const uint64_t r = i / run.cols, c = i % run.cols;
    const float s =
        LoadScale(run.scales + run.scale_row_of[r] * run.scale_row_stride + c / run.block_cols);
    const float x = fp8::FloatOf(LoadBits<kCode>(Row<kCode>(run, r), c));
    run.dst[static_cast<int64_t>(r) * run.dst_row_stride + c] = fp8::QuantizeOne(x, s);
  }
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
    AmaxKernel<kCode><<<Blocks(elements), kThreads, 0, stream>>>(run, col_blocks, amax, nonfinite);
  }
  ScaleKernel<<<Blocks(run.scale_rows * col_blocks), kThreads, 0, stream>>>(run, col_blocks, amax);
  if (elements > 0) QuantizeKernel<kCode><<<Blocks(elements), kThreads, 0, stream>>>(run);
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
