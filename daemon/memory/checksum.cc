#include "daemon/memory/checksum.h"

#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t on the stack
#include "daemon/common/xxh3.h"
#include "daemon/memory/stream_copy.h"

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <thread>

namespace refit {
namespace {

// Below this much work the calling thread does it alone: starting threads would cost more.
constexpr uint64_t kParallelBytes = 32ull << 20;
// CopyAndHash hashes and copies in blocks of this size, so the copy reads from L2.
constexpr uint64_t kBlockBytes = 256ull << 10;

// Runs task(i) for i in [0, count) on up to 8 threads.
template <typename Task>
void ParallelFor(size_t count, uint64_t total_bytes, const Task& task) {
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const unsigned threads =
      total_bytes < kParallelBytes
          ? 1u
          : static_cast<unsigned>(std::min<uint64_t>({cores, 8u, std::max<size_t>(1, count)}));
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i = next++; i < count; i = next++) task(i);
  };
  std::vector<std::thread> pool;
  for (unsigned t = 1; t < threads; ++t) pool.emplace_back(work);
  work();
  for (std::thread& t : pool) t.join();
}

size_t ChunkCount(uint64_t size, uint64_t chunk_bytes) {
  return static_cast<size_t>((size + chunk_bytes - 1) / chunk_bytes);
}

}  // namespace

std::vector<uint64_t> CopyAndHash(uint8_t* dst, const uint8_t* src, uint64_t size,
                                  uint64_t chunk_bytes) {
  std::vector<uint64_t> sums(ChunkCount(size, chunk_bytes));
  ParallelFor(sums.size(), size, [&](size_t i) {
    const uint64_t begin = i * chunk_bytes;
    const uint64_t end = std::min(size, begin + chunk_bytes);
    // Each block is read from `src` once, into a buffer that stays in L2; the hash and the
    // streaming store into `dst` both read that buffer, so the sums always describe the copy,
    // even if `src` changes meanwhile. Streaming stores skip reading `dst` into cache: the
    // whole costs about one memcpy.
    thread_local std::unique_ptr<uint8_t[]> block(new uint8_t[kBlockBytes]);
    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    for (uint64_t off = begin; off < end; off += kBlockBytes) {
      const uint64_t n = std::min(kBlockBytes, end - off);
      std::memcpy(block.get(), src + off, n);
      XXH3_64bits_update(&state, block.get(), n);
      StreamCopy(dst + off, block.get(), n);
    }
    sums[i] = XXH3_64bits_digest(&state);
    StoreFence();
  });
  return sums;
}

std::vector<uint64_t> HashChunks(const uint8_t* data, uint64_t size, uint64_t chunk_bytes) {
  std::vector<uint64_t> sums(ChunkCount(size, chunk_bytes));
  ParallelFor(sums.size(), size, [&](size_t i) {
    const uint64_t begin = i * chunk_bytes;
    sums[i] = XXH3_64bits(data + begin, std::min(size, begin + chunk_bytes) - begin);
  });
  return sums;
}

std::vector<uint64_t> HashRanges(const uint8_t* base,
                                 const std::vector<std::pair<uint64_t, uint64_t>>& ranges) {
  std::vector<uint64_t> sums(ranges.size());
  uint64_t total = 0;
  for (const auto& [b, e] : ranges) total += e - b;
  ParallelFor(sums.size(), total, [&](size_t i) {
    sums[i] = XXH3_64bits(base + ranges[i].first, ranges[i].second - ranges[i].first);
  });
  return sums;
}

}  // namespace refit
