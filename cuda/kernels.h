#pragma once

// The element kernels behind GPU weight buffers, as plain C++ on host memory. The GPU versions
// (gpu_kernels.h, --config=cuda only) take the same arguments on device memory and write the
// same bytes; cpu_kernels_test and gpu_kernels_test hold both to that. The CPU versions are the
// reference, and what the daemon runs where a buffer lives in host memory.
//
//   change detection  FindChanges: the sorted positions of the elements whose bit patterns
//                     differ between a base and a target (what delta sync encodes);
//   delta apply       ScatterValues / ScatterAddDiffs, and their inverses GatherValues /
//                     GatherDiffs: a difference is target - base of the element's bit pattern
//                     as an unsigned integer modulo 2^bits, as daemon/delta encodes it;
//   conversion        Convert: one 2-D run of plan::CopyOp between dtypes, with exactly the
//                     semantics of plan::ConvertRun (round to nearest even, fp8 saturating);
//   reshard copies    Copy2D: rows x row_bytes between pitched buffers;
//   sparse apply      ScatterRuns: a change list's runs of new bytes written into a
//                     destination (byte_run.h); GatherRuns, its inverse: the bytes a
//                     destination holds at the runs (the undo record, the verify).
//
// Element sizes for the change and scatter kernels: 1, 2, 4 or 8 bytes; positions are element
// indices. Pointers need no particular alignment. Every function is thread-safe; the caller
// owns every buffer, and the buffers a call writes must not overlap those it reads.

#include <cstdint>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "cuda/byte_run.h"
#include "daemon/common/types.h"

namespace refit::cuda {

// One 2-D run of elements, shaped like plan::CopyOp: `rows` rows of `count` elements. Element i
// of row r is at (r * src_row_stride + i * src_stride) elements of the source dtype from the
// source pointer, and likewise for the destination. Strides may be any non-negative values
// (zero repeats an element); with rows == 1 the row strides are unused.
struct ElementRun {
  uint64_t count = 0;
  uint64_t rows = 1;
  int64_t src_stride = 1;
  int64_t dst_stride = 1;
  int64_t src_row_stride = 0;
  int64_t dst_row_stride = 0;
};

// True for the element sizes FindChanges and the gather/scatter kernels take (1, 2, 4, 8).
bool IsKernelElementSize(uint64_t element_size);

namespace cpu {

// Compares `num_elements` elements of `element_size` bytes of base and target bit for bit and
// writes the ascending positions of those that differ to positions[0 .. min(count, capacity)).
// Returns the total count, which may exceed `capacity` (the caller then knows the change is
// dense without storing every position). INVALID_ARGUMENT for an unsupported element size.
absl::StatusOr<uint64_t> FindChanges(const uint8_t* base, const uint8_t* target,
                                     uint64_t num_elements, uint64_t element_size,
                                     uint64_t* positions, uint64_t capacity);

// values[i] = src[positions[i]], for i < n (packed elements of `element_size` bytes).
absl::Status GatherValues(const uint8_t* src, uint64_t element_size, const uint64_t* positions,
                          uint64_t n, uint8_t* values);

// dst[positions[i]] = values[i], for i < n.
absl::Status ScatterValues(uint8_t* dst, uint64_t element_size, const uint64_t* positions,
                           const uint8_t* values, uint64_t n);

// diffs[i] = target[positions[i]] - base[positions[i]] (bit patterns, modulo 2^bits).
absl::Status GatherDiffs(const uint8_t* base, const uint8_t* target, uint64_t element_size,
                         const uint64_t* positions, uint64_t n, uint8_t* diffs);

// dst[positions[i]] += diffs[i] (bit patterns, modulo 2^bits): applied to the base, the diffs
// of GatherDiffs give the target. Positions must be distinct.
absl::Status ScatterAddDiffs(uint8_t* dst, uint64_t element_size, const uint64_t* positions,
                             const uint8_t* diffs, uint64_t n);

// Converts one run from src_dtype to dst_dtype (the same dtype copies). INVALID_ARGUMENT when
// plan::CheckConvertible refuses the pair.
absl::Status Convert(const uint8_t* src, DType src_dtype, uint8_t* dst, DType dst_dtype,
                     const ElementRun& run);

// Copies `rows` rows of `row_bytes` bytes; row r starts at src + r * src_pitch and
// dst + r * dst_pitch.
void Copy2D(uint8_t* dst, uint64_t dst_pitch, const uint8_t* src, uint64_t src_pitch,
            uint64_t row_bytes, uint64_t rows);

// Writes each of runs[0 .. n): dst[run.dst_offset + k] = values[run.value_offset + k] for
// k < run.bytes. Runs must not overlap in dst (the GPU writes them in no particular order).
void ScatterRuns(uint8_t* dst, const ByteRun* runs, uint64_t n, const uint8_t* values);

// ScatterRuns' inverse: values[run.value_offset + k] = src[run.dst_offset + k] for k < run.bytes,
// for each of runs[0 .. n). Runs must not overlap in values.
void GatherRuns(uint8_t* values, const ByteRun* runs, uint64_t n, const uint8_t* src);

}  // namespace cpu
}  // namespace refit::cuda
