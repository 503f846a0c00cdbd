#pragma once

// Internal to daemon/delta: encodes and decodes the payload of one chunk (FORMAT.md, "Chunk
// payload"). delta.cc owns the container (header, index, checksums); this file only knows how
// one run of elements turns into bytes and back. Not part of the public API.
//
// Thread-safety: a ChunkEncoder / ChunkDecoder holds a zstd context and scratch buffers and must
// be used by one thread at a time; separate instances are independent.

#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

struct ZSTD_CCtx_s;
struct ZSTD_DCtx_s;
struct XXH3_state_s;  // xxhash.h's XXH3_state_t

namespace refit::delta::internal {

// First byte of every chunk payload.
enum class ChunkMode : uint8_t {
  kUnchanged = 0,  // payload is this byte only; target == base
  kRaw = 1,        // this byte, then the chunk's target bytes verbatim
  kSparse = 2,     // this byte, then Rice-coded gaps and values (FORMAT.md)
};

// What encoding one chunk found out about it.
struct ChunkSummary {
  ChunkMode mode = ChunkMode::kUnchanged;
  uint64_t changed = 0;       // elements whose bit pattern differs
  uint64_t target_xxh3 = 0;   // XXH3-64 of the chunk's target bytes
  double scan_seconds = 0;    // compare, target checksum, collecting the changes
  double coding_seconds = 0;  // choosing Rice parameters, writing the streams, zstd
};

// Encodes chunks one after another, reusing its buffers.
class ChunkEncoder {
 public:
  // `zstd_level` as zstd takes it (negative = the fast levels).
  explicit ChunkEncoder(int zstd_level);
  ~ChunkEncoder();
  ChunkEncoder(const ChunkEncoder&) = delete;
  ChunkEncoder& operator=(const ChunkEncoder&) = delete;

  // Appends the payload for `num_elements` elements of `element_size` (1, 2, 4 or 8) bytes at
  // `base` / `target` to `out`: kUnchanged, kSparse, or kRaw when the sparse form would not be
  // smaller. INTERNAL only if zstd fails.
  absl::StatusOr<ChunkSummary> Encode(const uint8_t* base, const uint8_t* target,
                                      uint64_t num_elements, size_t element_size,
                                      std::vector<uint8_t>& out);

 private:
  template <typename T>
  void Scan(const uint8_t* base, const uint8_t* target, uint64_t num_elements);
  template <typename T>
  void ScanRange(const uint8_t* base, const uint8_t* target, uint64_t first, uint64_t count);
  template <typename T>
  void ScanRangeAvx2(const uint8_t* base, const uint8_t* target, uint64_t first, uint64_t count);
  template <typename T>
  void ScanRangeAvx512(const uint8_t* base, const uint8_t* target, uint64_t first, uint64_t count);
  template <typename T>
  void ScanTail(const uint8_t* base, const uint8_t* target, uint64_t first, uint64_t count,
                uint64_t done_bytes);
  template <typename T>
  void EmitMask(const uint8_t* base, const uint8_t* target, uint64_t block_first, uint64_t mask);
  // Appends the first `stream_bytes` of a Rice stream with parameter `k` to out,
  // zstd-compressed when `try_zstd`, that is worth trying and it comes out smaller.
  absl::Status AppendStream(const std::vector<uint8_t>& stream, uint64_t stream_bytes, unsigned k,
                            bool try_zstd, std::vector<uint8_t>& out);

  int zstd_level_;
  std::unique_ptr<ZSTD_CCtx_s, void (*)(ZSTD_CCtx_s*)> cctx_;
  std::unique_ptr<XXH3_state_s, void (*)(XXH3_state_s*)> target_hash_;
  uint64_t next_element_ = 0;     // element after the last change emitted
  uint64_t changes_ = 0;          // changes found so far; gaps_ and values_ hold more room
  std::vector<uint64_t> gaps_;    // per change: elements skipped since the previous change
  std::vector<uint64_t> values_;  // per change: zigzag of (target - base), minus 1
  std::vector<uint64_t> sample_;  // scratch for choosing Rice parameters
  std::vector<uint8_t> gap_bits_, value_bits_;  // the Rice streams being written
};

// The checksums and counts a payload must match, from the chunk's index entry.
struct ChunkExpectation {
  uint64_t num_elements = 0;
  size_t element_size = 0;
  uint64_t changed = 0;
  uint64_t target_xxh3 = 0;
};

// Decodes payloads and applies them to base memory.
class ChunkDecoder {
 public:
  ChunkDecoder();
  ~ChunkDecoder();
  ChunkDecoder(const ChunkDecoder&) = delete;
  ChunkDecoder& operator=(const ChunkDecoder&) = delete;

  // The checks that need no decoding and no writes: the mode byte; for an unchanged chunk
  // that `base` (the chunk's num_elements * element_size bytes) already hashes to the target
  // (FAILED_PRECONDITION otherwise); for a raw chunk its size and target checksum (DATA_LOSS).
  // After it passes, Apply cannot fail on an unchanged or raw chunk.
  static absl::Status Verify(const uint8_t* payload, uint64_t size, const ChunkExpectation& expect,
                             const uint8_t* base);

  // Applies a payload that passed Verify() and whose encoded checksum was checked. A sparse
  // payload is validated field by field before the first write (DATA_LOSS when malformed); its
  // result is verified against `expect.target_xxh3` and rolled back on mismatch. Since the
  // payload is known good, a mismatch means the base is not the one the delta was encoded
  // against: FAILED_PRECONDITION. On any error `base` holds what it held before.
  absl::Status Apply(const uint8_t* payload, uint64_t size, const ChunkExpectation& expect,
                     uint8_t* base);

  // Applies the payload's changes only to the elements overlapping `ranges` (byte ranges
  // relative to `base`, sorted and disjoint), for a receiver that holds only those bytes of the
  // base. An element straddling a range's edge is written whole. The target checksum covers the
  // whole chunk, so it cannot be checked here: the caller verifies the ranges it holds.
  absl::Status ApplyWithin(const uint8_t* payload, uint64_t size, const ChunkExpectation& expect,
                           uint8_t* base, const std::vector<std::pair<uint64_t, uint64_t>>& ranges);

  // After a successful Apply or ApplyWithin of `payload`: the bytes it changes, appended to
  // `out` as ranges [first_byte + begin, first_byte + end) (sorted; neighbouring elements
  // merged): a sparse payload's changed elements, a raw chunk's `num_elements * element_size`
  // bytes, nothing for an unchanged one. A superset of the bytes that differ from the base (a
  // change may restore a byte's value). For a sparse payload, valid until the next call.
  void AppendChanged(const uint8_t* payload, uint64_t first_byte, uint64_t num_elements,
                     size_t element_size, std::vector<std::pair<uint64_t, uint64_t>>* out) const;

  // Undoes a successful Apply of the same sparse payload to the same memory (decoding it again
  // rather than keeping the changes around). For an unchanged chunk it does nothing; a raw
  // chunk cannot be undone (INTERNAL), so callers apply raw chunks last.
  absl::Status Revert(const uint8_t* payload, uint64_t size, const ChunkExpectation& expect,
                      uint8_t* base);

 private:
  absl::Status ReadStream(const uint8_t*& cursor, const uint8_t* end, uint64_t max_bytes,
                          std::vector<uint8_t>& stream, uint64_t& stream_bytes);
  absl::Status DecodeSparse(const uint8_t* payload, uint64_t size, const ChunkExpectation& expect);
  template <typename T>
  absl::Status DecodeChanges(const ChunkExpectation& expect, unsigned gap_k, unsigned value_k,
                             uint64_t gap_bytes, uint64_t value_bytes);
  template <typename T>
  uint64_t AddChangesAndHash(uint8_t* base, uint64_t num_elements);
  uint64_t AddChangesAndHash(size_t element_size, uint8_t* base, uint64_t num_elements);
  template <typename T>
  void SubtractChanges(uint8_t* base) const;
  template <typename T>
  void AddChangesWithin(uint8_t* base,
                        const std::vector<std::pair<uint64_t, uint64_t>>& ranges) const;
  void SubtractChanges(size_t element_size, uint8_t* base) const;

  std::unique_ptr<ZSTD_DCtx_s, void (*)(ZSTD_DCtx_s*)> dctx_;
  std::unique_ptr<XXH3_state_s, void (*)(XXH3_state_s*)> hash_;
  std::vector<uint8_t> gap_stream_, value_stream_;  // Rice streams plus zero padding
  std::vector<uint32_t> positions_;                 // decoded change positions within the chunk
  std::vector<uint64_t> deltas_;  // target - base per change, modulo 2^(8 * element_size)
};

}  // namespace refit::delta::internal
