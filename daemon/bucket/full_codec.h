#pragma once

// Internal to daemon/bucket: a piece stored in full is one zstd frame of its bytes, with the
// content size in the frame header. Both directions stream through O(MiB) buffers, hashing as
// they go, so a multi-GiB piece needs no second copy in memory and is read once. Thread-safe.

#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace refit::bucket::internal {

struct CompressResult {
  uint64_t file_bytes = 0;
  uint64_t file_xxh3 = 0;  // XXH3-64 of the frame
  uint64_t data_xxh3 = 0;  // XXH3-64 of the input bytes
};

// Writes one zstd frame of data[0, bytes) to `fd` (at its current position).
absl::StatusOr<CompressResult> CompressToFd(int fd, const std::string& path, const uint8_t* data,
                                            uint64_t bytes, int level, int workers);

// Decompresses the frame in `fd` (a file of exactly `file_bytes` bytes whose XXH3 must be
// `file_xxh3`) into out[0, bytes). DATA_LOSS for a truncated, oversized, corrupt or foreign
// file, or one whose frame does not hold exactly `bytes` bytes; out's contents are then
// undefined. `out` may be large: nothing else of that size is allocated.
absl::Status DecompressFromFd(int fd, const std::string& path, uint64_t file_bytes,
                              uint64_t file_xxh3, uint8_t* out, uint64_t bytes);

}  // namespace refit::bucket::internal
