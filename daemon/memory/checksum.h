#pragma once

// XXH3-64 checksums of byte ranges, the way refit verifies a version between nodes: the source
// hashes each kChecksumChunkBytes chunk of a piece as it snapshots it (CopyAndHash, while the
// bytes are still in cache), and the receiver hashes the ranges it pulled (HashRanges). Both run
// on up to 8 threads when there is enough work (>= 32 MiB), one otherwise.

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace refit {

// The checksum grid: chunk i of a piece is [i * kChecksumChunkBytes, +kChecksumChunkBytes),
// the last one shorter.
inline constexpr uint64_t kChecksumChunkBytes = 4ull << 20;

// Equal-length ranges at a fixed stride: [offset + i * stride, + length) for i < count (the
// short ranges of a resharded pull, one per row of a tensor, make few runs).
struct RangeRun {
  uint64_t offset = 0;
  uint64_t length = 0;
  uint64_t stride = 0;
  uint64_t count = 0;
};
// `ranges` ([begin, end), in order) as runs that expand to the same list, in the same order.
std::vector<RangeRun> ToRuns(const std::vector<std::pair<uint64_t, uint64_t>>& ranges);
// Appends the ranges of `run` to *out.
void AppendRanges(const RangeRun& run, std::vector<std::pair<uint64_t, uint64_t>>* out);

// XXH3-64 digests of byte ranges off the grid, taken at Publish because receivers asked for
// those ranges before (a resharded pull reads one short range per row of a tensor).
struct RangeSums {
  // Sorted by begin; the digest of [begin[i], begin[i] + length[i]) is xxh3[i].
  std::vector<uint64_t> begin, length, xxh3;

  // The digest of [begin, begin + length) if it was taken.
  bool Find(uint64_t begin, uint64_t length, uint64_t* xxh3) const;
  size_t size() const { return begin.size(); }
};

// Copies `size` bytes (host memory, non-overlapping) and returns the XXH3-64 of each chunk of
// `chunk_bytes` of the copy, in order (each block is read from `src` once, so the sums match the
// copy even if `src` changes during the call).
std::vector<uint64_t> CopyAndHash(uint8_t* dst, const uint8_t* src, uint64_t size,
                                  uint64_t chunk_bytes = kChecksumChunkBytes);

// CopyAndHash works in blocks of this size (aligned to the start of the copy).
inline constexpr uint64_t kCopyBlockBytes = 256ull << 10;

// CopyAndHash on the calling thread, for one range: returns the XXH3-64 of the bytes written.
// Each 16 KiB is read from `src` once into an L1 buffer, hashed there and streamed into `dst`,
// so the digest describes what landed even if `src` changes meanwhile. Streaming stores: call
// StoreFence (stream_copy.h) before reporting the copy done to another thread.
uint64_t CopyAndHashRange(uint8_t* dst, const uint8_t* src, uint64_t size);

// The same, and also the digest of each of `ranges` ([begin, end), sorted by begin, within
// `size`) that lies inside one of the blocks the copy goes through (kCopyBlockBytes), hashed from
// that block while it is in cache: about 1/30 of the copy's time per byte, where hashing afterwards
// reads the bytes from memory again. Ranges across a block boundary are left out of *range_sums; a
// caller hashes those itself if it needs them.
std::vector<uint64_t> CopyAndHash(uint8_t* dst, const uint8_t* src, uint64_t size,
                                  const std::vector<std::pair<uint64_t, uint64_t>>& ranges,
                                  RangeSums* range_sums,
                                  uint64_t chunk_bytes = kChecksumChunkBytes);

// XXH3-64 of each chunk of `chunk_bytes` of [data, data + size).
std::vector<uint64_t> HashChunks(const uint8_t* data, uint64_t size,
                                 uint64_t chunk_bytes = kChecksumChunkBytes);

// XXH3-64 of each [begin, end) of `ranges` within `base`, in order.
std::vector<uint64_t> HashRanges(const uint8_t* base,
                                 const std::vector<std::pair<uint64_t, uint64_t>>& ranges);

}  // namespace refit
