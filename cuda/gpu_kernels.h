#pragma once

// GPU versions of the kernels in kernels.h (compiled by nvcc from gpu_kernels.cu; only in
// --config=cuda builds). Same arguments and bit-identical results, on device memory, enqueued on
// `stream` of the current device: each launcher returns once the work is queued (or with the
// launch error), so the caller synchronizes the stream before reading results on the host.
// Pointers need no particular alignment (aligned ones take the faster paths).
//
// Errors: cudaErrorInvalidValue for arguments the CPU version would refuse (element size,
// dtype pair); otherwise whatever the launch reports. Thread-safe: launches on different
// streams may run concurrently.
//
// This header must stay free of workspace includes other than cuda/ ones: the nvcc action sees
// only those.

#include <cuda_runtime_api.h>

#include <cstdint>

#include "cuda/byte_run.h"

namespace refit::cuda::gpu {

// Bytes of device scratch FindChanges needs for `num_elements` elements of `element_size`.
uint64_t FindChangesScratchBytes(uint64_t num_elements, uint64_t element_size);

// cpu::FindChanges on the device. Writes up to `capacity` ascending positions (device memory)
// and the total count of changed elements to *count (one uint64_t in device memory).
// `scratch` (device memory, 256-byte aligned, FindChangesScratchBytes()) is used for masks and
// per-tile counts. Three passes: mark and count per tile, scan the tile counts, write positions;
// the inputs are read once.
cudaError_t FindChanges(const uint8_t* base, const uint8_t* target, uint64_t num_elements,
                        uint64_t element_size, uint64_t* positions, uint64_t capacity,
                        uint64_t* count, void* scratch, cudaStream_t stream);

// cpu::GatherValues / ScatterValues / GatherDiffs / ScatterAddDiffs on the device; `positions`,
// `values` and `diffs` are device memory.
cudaError_t GatherValues(const uint8_t* src, uint64_t element_size, const uint64_t* positions,
                         uint64_t n, uint8_t* values, cudaStream_t stream);
cudaError_t ScatterValues(uint8_t* dst, uint64_t element_size, const uint64_t* positions,
                          const uint8_t* values, uint64_t n, cudaStream_t stream);
cudaError_t GatherDiffs(const uint8_t* base, const uint8_t* target, uint64_t element_size,
                        const uint64_t* positions, uint64_t n, uint8_t* diffs, cudaStream_t stream);
cudaError_t ScatterAddDiffs(uint8_t* dst, uint64_t element_size, const uint64_t* positions,
                            const uint8_t* diffs, uint64_t n, cudaStream_t stream);

// cpu::Convert on the device: `count` x `rows` elements with the given element strides (see
// kernels.h ElementRun; passed flat so that this header needs nothing from daemon/). Dtypes
// are refit::DType values; float dtypes convert to each other, any dtype copies to itself.
cudaError_t Convert(const uint8_t* src, int src_dtype, uint8_t* dst, int dst_dtype, uint64_t count,
                    uint64_t rows, int64_t src_stride, int64_t dst_stride, int64_t src_row_stride,
                    int64_t dst_row_stride, cudaStream_t stream);

// cpu::Copy2D for any pair of host/device pointers (cudaMemcpy2DAsync), falling back to a copy
// kernel for device-to-device pitches cudaMemcpy2DAsync refuses.
cudaError_t Copy2D(uint8_t* dst, uint64_t dst_pitch, const uint8_t* src, uint64_t src_pitch,
                   uint64_t row_bytes, uint64_t rows, cudaStream_t stream);

// cpu::ScatterRuns on the device: `runs` (n of them), `values` and `dst` are device memory.
// Each block takes whole runs (grid-stride over runs) and copies a run with all its threads,
// 8-byte words where the run's destination and values are equally aligned, bytes otherwise.
cudaError_t ScatterRuns(uint8_t* dst, const ByteRun* runs, uint64_t n, const uint8_t* values,
                        cudaStream_t stream);

// cpu::GatherRuns on the device (ScatterRuns' inverse: the bytes `src` holds at the runs, packed
// into `values` at each run's value_offset); the same kernel with the two sides swapped.
cudaError_t GatherRuns(uint8_t* values, const ByteRun* runs, uint64_t n, const uint8_t* src,
                       cudaStream_t stream);

// Benchmark references (gpu_bench): the plain device traffic the kernels above are compared
// with. ReadWriteReference reads `bytes` from each of a and b and writes their XOR to out.
cudaError_t ReadWriteReference(const uint8_t* a, const uint8_t* b, uint8_t* out, uint64_t bytes,
                               cudaStream_t stream);

}  // namespace refit::cuda::gpu
