#pragma once

// fp8 block quantization on host memory (the rule: fp8_block.h, docs/api.md "Engines"): a 2-D
// run of `rows` x `cols` float elements becomes e4m3fn bytes plus one fp32 scale per block.
// The caller (daemon/store/quantized_slots.cc) reduces any tensor rank and block shape to this
// form: blocks span `block_cols` columns, and row r belongs to scale row scale_row_of[r], so a
// block is every row sharing a scale row times one column block ([128, 128] blocks of a matrix
// band: 128 rows mapped to scale row 0; a per-expert block of a fused [E, N, K] tensor: rows of one
// expert mapped to r / 128; a per-tensor scale: every row mapped to 0).
//
// Three versions that write the same bytes (quantize_kernels_test holds them to each other and
// to a reference built on plan::ConvertRun): a scalar one, an AVX2 one and an AVX-512 one (bf16
// sources 32 elements a step; other dtypes as AVX2), the best the CPU has chosen at run time
// (cpuid). The GPU version (gpu_quantize.h) is bit-identical too. Thread-safe; the caller owns
// every buffer.

#include <cstdint>

#include "absl/status/statusor.h"
#include "daemon/common/types.h"

namespace refit::cuda::cpu {

struct Fp8BlockRun {
  const uint8_t* src = nullptr;
  DType src_dtype = DType::kUnspecified;  // bf16, fp16, fp32, fp8 e4m3 or e5m2
  uint64_t rows = 0;
  uint64_t cols = 0;
  int64_t src_row_stride = 0;  // elements of src_dtype between rows; columns are contiguous
  uint64_t block_cols = 0;     // > 0
  const uint32_t* scale_row_of = nullptr;  // `rows` entries, each < scale_rows
  uint64_t scale_rows = 0;
  uint8_t* dst = nullptr;  // e4m3fn
  int64_t dst_row_stride = 0;
  float* scales = nullptr;  // scale_rows x ceil(cols / block_cols) at scale_row_stride
  int64_t scale_row_stride = 0;
};

// INVALID_ARGUMENT for what every version refuses (below), read on the host (the GPU version's
// caller checks its runs with it before they go to the device).
absl::Status CheckFp8BlockRun(const Fp8BlockRun& run);

// Quantizes `run`; returns how many source elements were inf or NaN. INVALID_ARGUMENT for a
// non-float source dtype, a zero block or a scale row out of range.
absl::StatusOr<uint64_t> QuantizeFp8Blocks(const Fp8BlockRun& run);
absl::StatusOr<uint64_t> QuantizeFp8BlocksScalar(const Fp8BlockRun& run);

// True when QuantizeFp8Blocks runs a vectorized version on this CPU.
bool Fp8BlocksVectorized();

// The versions, by instruction set; QuantizeFp8Blocks runs Fp8BestKernel().
enum class Fp8Kernel { kScalar, kAvx2, kAvx512 };
Fp8Kernel Fp8BestKernel();
const char* Fp8KernelName(Fp8Kernel kernel);
// True when this CPU can run `kernel`.
bool Fp8KernelRuns(Fp8Kernel kernel);
// Quantizes `run` with `kernel`; UNIMPLEMENTED where this CPU cannot run it.
absl::StatusOr<uint64_t> QuantizeFp8BlocksWith(Fp8Kernel kernel, const Fp8BlockRun& run);

}  // namespace refit::cuda::cpu
