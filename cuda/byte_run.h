#pragma once

// One run of a change list placed in a destination buffer: what a sparse Apply writes there
// (daemon/store's ChangeList, its runs resharded into the destination's layout, each with its
// new bytes). Used by cpu::ScatterRuns (kernels.h) and gpu::ScatterRuns (gpu_kernels.h); free of
// every include so that nvcc sees it alone.

#include <cstdint>

namespace refit::cuda {

// `bytes` new bytes, read at values + value_offset, written at dst + dst_offset.
struct ByteRun {
  uint64_t dst_offset = 0;
  uint64_t value_offset = 0;
  uint64_t bytes = 0;
};

}  // namespace refit::cuda
