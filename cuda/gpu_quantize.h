#pragma once

// cpu::QuantizeFp8Blocks (quantize_kernels.h) on the device (--config=cuda only), bit-identical:
// the same rule from the same expressions (fp8_block.h), in three kernels enqueued on `stream` —
// the amax of each block (atomicMax on |x| bit patterns, so NaN wins as on the CPU), the scales,
// then the quantized bytes. Every pointer is device memory: `scale_row_of` (`rows` entries),
// `amax_scratch` (scale_rows x ceil(cols / block_cols) uint32s) and `nonfinite` (one counter,
// incremented by the inf and NaN source elements; zeroed by this call). Returns once the work
// is queued; cudaErrorInvalidValue for a non-float dtype or a zero block. Thread-safe.
//
// Like gpu_kernels.h this header must stay free of workspace includes other than cuda/ ones.

#include <cuda_runtime_api.h>

#include <cstdint>

namespace refit::cuda::gpu {

struct Fp8BlockRun {
  const uint8_t* src = nullptr;
  int src_dtype = 0;  // a refit::DType value: bf16, fp16, fp32, fp8 e4m3 or e5m2
  uint64_t rows = 0;
  uint64_t cols = 0;
  int64_t src_row_stride = 0;  // elements
  uint64_t block_cols = 0;
  const uint32_t* scale_row_of = nullptr;
  uint64_t scale_rows = 0;
  uint8_t* dst = nullptr;
  int64_t dst_row_stride = 0;
  float* scales = nullptr;
  int64_t scale_row_stride = 0;
};

cudaError_t QuantizeFp8Blocks(const Fp8BlockRun& run, uint32_t* amax_scratch,
                              unsigned long long* nonfinite, cudaStream_t stream);

}  // namespace refit::cuda::gpu
