#pragma once

// XXH3-64 checksums of byte ranges, the way refit verifies a version between nodes: the source
// hashes each kChecksumChunkBytes chunk of a piece as it snapshots it (CopyAndHash, while the
// bytes are still in cache), and the receiver hashes the ranges it pulled (HashRanges). Both run
// on up to 8 threads when there is enough work (>= 32 MiB), one otherwise.

#include <cstdint>
#include <utility>
#include <vector>

namespace refit {

// The checksum grid: chunk i of a piece is [i * kChecksumChunkBytes, +kChecksumChunkBytes),
// the last one shorter.
inline constexpr uint64_t kChecksumChunkBytes = 4ull << 20;

// Copies `size` bytes (host memory, non-overlapping) and returns the XXH3-64 of each chunk of
// `chunk_bytes` of the copy, in order (each block is read from `src` once, so the sums match the
// copy even if `src` changes during the call).
std::vector<uint64_t> CopyAndHash(uint8_t* dst, const uint8_t* src, uint64_t size,
                                  uint64_t chunk_bytes = kChecksumChunkBytes);

// XXH3-64 of each chunk of `chunk_bytes` of [data, data + size).
std::vector<uint64_t> HashChunks(const uint8_t* data, uint64_t size,
                                 uint64_t chunk_bytes = kChecksumChunkBytes);

// XXH3-64 of each [begin, end) of `ranges` within `base`, in order.
std::vector<uint64_t> HashRanges(const uint8_t* base,
                                 const std::vector<std::pair<uint64_t, uint64_t>>& ranges);

}  // namespace refit
