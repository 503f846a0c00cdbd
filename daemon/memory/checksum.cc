#include "daemon/memory/checksum.h"

#define XXH_STATIC_LINKING_ONLY  // XXH3_state_t on the stack
#include <algorithm>
#include <atomic>
#include <cstring>
#include <functional>
#include <memory>
#include <thread>

#include "daemon/common/parallel.h"
#include "daemon/common/xxh3.h"
#include "daemon/memory/stream_copy.h"

namespace refit {
namespace {

// CopyAndHash hashes and copies in blocks of this size, so the copy reads from L2.
constexpr uint64_t kBlockBytes = kCopyBlockBytes;

// Runs task(i) for i in [0, count) on the threads `total_bytes` of work is worth.
void ParallelFor(size_t count, uint64_t total_bytes, const std::function<void(size_t)>& task) {
  common::ParallelFor(count, common::ThreadsFor(total_bytes, count), task);
}

size_t ChunkCount(uint64_t size, uint64_t chunk_bytes) {
  return static_cast<size_t>((size + chunk_bytes - 1) / chunk_bytes);
}

}  // namespace

std::vector<RangeRun> ToRuns(const std::vector<std::pair<uint64_t, uint64_t>>& ranges) {
  std::vector<RangeRun> runs;
  for (const auto& [begin, end] : ranges) {
    const uint64_t length = end - begin;
    if (!runs.empty()) {
      RangeRun& run = runs.back();
      const uint64_t last = run.offset + (run.count - 1) * run.stride;
      if (run.length == length) {
        if (run.count == 1 && begin > last) {  // the second range sets the stride
          run.stride = begin - last;
          ++run.count;
          continue;
        }
        if (run.count > 1 && begin > last && begin - last == run.stride) {
          ++run.count;
          continue;
        }
      }
    }
    runs.push_back({begin, length, 0, 1});
  }
  return runs;
}

void AppendRanges(const RangeRun& run, std::vector<std::pair<uint64_t, uint64_t>>* out) {
  for (uint64_t i = 0; i < run.count; ++i) {
    const uint64_t begin = run.offset + i * run.stride;
    out->emplace_back(begin, begin + run.length);
  }
}

bool RangeSums::Find(uint64_t b, uint64_t l, uint64_t* out) const {
  auto it = std::lower_bound(begin.begin(), begin.end(), b);
  // Equal begins are possible (two receivers asking for different lengths at one offset).
  for (; it != begin.end() && *it == b; ++it) {
    const size_t i = static_cast<size_t>(it - begin.begin());
    if (length[i] == l) {
      *out = xxh3[i];
      return true;
    }
  }
  return false;
}

uint64_t CopyAndHashRange(uint8_t* dst, const uint8_t* src, uint64_t size) {
  // A bounce buffer that stays in L1: the extra copy then costs next to nothing (its size:
  // docs/benchmarks.md, "Figures behind constants").
  constexpr uint64_t kBounceBytes = 16 << 10;
  thread_local std::unique_ptr<uint8_t[]> block(new uint8_t[kBounceBytes]);
  if (size <= kBounceBytes) {  // the one-shot hash (a short span of a column shard)
    std::memcpy(block.get(), src, size);
    const uint64_t sum = XXH3_64bits(block.get(), size);
    StreamCopy(dst, block.get(), size);
    return sum;
  }
  XXH3_state_t state;
  XXH3_64bits_reset(&state);
  for (uint64_t off = 0; off < size; off += kBounceBytes) {
    const uint64_t n = std::min(kBounceBytes, size - off);
    std::memcpy(block.get(), src + off, n);
    XXH3_64bits_update(&state, block.get(), n);
    StreamCopy(dst + off, block.get(), n);
  }
  return XXH3_64bits_digest(&state);
}

std::vector<uint64_t> CopyAndHash(uint8_t* dst, const uint8_t* src, uint64_t size,
                                  uint64_t chunk_bytes) {
  return CopyAndHash(dst, src, size, {}, nullptr, chunk_bytes);
}

std::vector<uint64_t> CopyAndHash(uint8_t* dst, const uint8_t* src, uint64_t size,
                                  const std::vector<std::pair<uint64_t, uint64_t>>& ranges,
                                  RangeSums* range_sums, uint64_t chunk_bytes) {
  std::vector<uint64_t> sums(ChunkCount(size, chunk_bytes));
  const bool extra = range_sums != nullptr && !ranges.empty();
  std::vector<uint64_t> extra_sums(extra ? ranges.size() : 0);
  std::vector<uint8_t> taken(extra_sums.size(), 0);
  ParallelFor(sums.size(), size, [&](size_t i) {
    const uint64_t begin = i * chunk_bytes;
    const uint64_t end = std::min(size, begin + chunk_bytes);
    // Each block is read from `src` once, into a buffer that stays in L2; the hashes and the
    // streaming store into `dst` all read that buffer, so the sums always describe the copy,
    // even if `src` changes meanwhile. Streaming stores skip reading `dst` into cache: the
    // whole costs about one memcpy.
    thread_local std::unique_ptr<uint8_t[]> block(new uint8_t[kBlockBytes]);
    size_t r = 0;  // the first range that starts in this chunk
    if (extra) {
      r = static_cast<size_t>(
          std::lower_bound(ranges.begin(), ranges.end(), std::make_pair(begin, uint64_t{0})) -
          ranges.begin());
    }
    XXH3_state_t state;
    XXH3_64bits_reset(&state);
    for (uint64_t off = begin; off < end; off += kBlockBytes) {
      const uint64_t n = std::min(kBlockBytes, end - off);
      std::memcpy(block.get(), src + off, n);
      XXH3_64bits_update(&state, block.get(), n);
      for (; extra && r < ranges.size() && ranges[r].first < off + n; ++r) {
        const auto& [b, e] = ranges[r];
        if (b >= off && e <= off + n && b < e) {
          extra_sums[r] = XXH3_64bits(block.get() + (b - off), e - b);
          taken[r] = 1;
        }
      }
      StreamCopy(dst + off, block.get(), n);
    }
    sums[i] = XXH3_64bits_digest(&state);
    StoreFence();
  });
  if (extra) {
    *range_sums = RangeSums();
    for (size_t r = 0; r < ranges.size(); ++r) {
      if (!taken[r]) continue;
      range_sums->begin.push_back(ranges[r].first);
      range_sums->length.push_back(ranges[r].second - ranges[r].first);
      range_sums->xxh3.push_back(extra_sums[r]);
    }
  }
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
