#pragma once

// Memory-bound work split over the cores: copies, checksums, diffs of version slots.

#include <cstddef>
#include <cstdint>
#include <functional>

namespace refit::common {

// Below this much work the calling thread does it alone: starting threads would cost more.
inline constexpr uint64_t kParallelBytes = 32ull << 20;

// The threads worth using for `bytes` of memory-bound work in `count` independent parts: 1
// under kParallelBytes, else up to the cores, at most 8 (more only contend for memory) and at
// most `count`.
unsigned ThreadsFor(uint64_t bytes, size_t count);

// Runs task(i) for every i in [0, count) on `threads` threads, the caller's among them, each
// taking the next i as it finishes one; returns when every task has returned.
void ParallelFor(size_t count, unsigned threads, const std::function<void(size_t)>& task);

}  // namespace refit::common
