#pragma once

// Delta sync of weight versions: pure functions that encode the difference between two
// versions of a buffer (base -> target) compactly, and apply it back onto a copy of the base.
// No I/O, no protobuf.
//
// Thread-safety: every function is thread-safe and keeps no state between calls. ApplyChunk
// calls for different chunks may run concurrently on the same buffer: each touches only its
// chunk's elements. Encode only reads its inputs, and can use several threads itself
// (EncodeOptions::threads).
//
// Why it pays: in bf16 RL fine-tuning a step changes well under 1 % of elements at lr 1e-6 and
// a few % at 1e-5, mostly by one unit in the last place. Per changed element the delta stores
// the gap since the previous change and the zigzag of the bit-pattern difference as Rice codes,
// about 1.5 bytes per change on real data. delta_bench prints figures; docs/benchmarks.md
// ("Delta codec on the real weight versions") keeps them.
//
// Format (version 1; FORMAT.md has every field, the checks a reader makes, and the
// measurements behind the choices). Little-endian throughout.
//   header:  "RFDL", u16 version, u8 dtype, u8 element size, u64 num_elements,
//            u64 chunk_elements, u32 num_chunks, u32 reserved;
//            per chunk {u64 payload size, u64 changed, u64 XXH3 of payload,
//                       u64 XXH3 of the chunk's target bytes};
//            u64 XXH3 of the header so far.
//   payloads, one per chunk, back to back; first byte: 0 unchanged (nothing follows), 1 raw
//            (target bytes follow), 2 sparse: varint n, u8 gap_k, u8 value_k, then two streams
//            (gaps, zigzag(difference) - 1) of n Rice codes each, each stream optionally one
//            zstd frame (the encoder tries zstd on dense chunks only).
//
// Chunks: elements are split into chunks of `chunk_elements`, encoded independently, so a
// receiver that needs only some element ranges fetches the header, then only the chunks
// ChunksOverlapping() names, and applies each with ApplyChunk().
//
// Safety: the decoder treats the delta as untrusted input. Every length, varint, offset and
// position is validated; corrupt, truncated or forged input yields an error status, never a
// crash or a write outside the chunk's elements. A chunk is applied all or nothing:
//   1. the payload must match its checksum (so random corruption never reaches the decoder);
//   2. the whole payload is decoded and validated into O(changes) scratch before any write;
//   3. the changes are added in place while the chunk is hashed; on a mismatch with the target
//      checksum they are subtracted again.
// Undoing in place was chosen over decoding into a scratch copy of the chunk: it needs no
// O(chunk) buffer and no extra copy of every chunk, and a mismatch is rare (it means a wrong
// base). Since the payload is known good at step 3, a mismatch there is reported as
// FAILED_PRECONDITION (wrong base), not DATA_LOSS.
//
// Status codes: INVALID_ARGUMENT for bad arguments (sizes, dtype, options); DATA_LOSS for a
// corrupt or truncated delta; FAILED_PRECONDITION when the base is not the version the delta was
// encoded against; UNIMPLEMENTED for a newer format version; RESOURCE_EXHAUSTED when Encode
// exceeds EncodeOptions::max_encoded_bytes.

#include <cstddef>
#include <cstdint>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/common/types.h"

namespace refit::delta {

// "RFDL" then a format version; a reader rejects versions it does not know.
inline constexpr uint8_t kMagic[4] = {'R', 'F', 'D', 'L'};
inline constexpr uint16_t kFormatVersion = 1;
// The fixed part of the header; it says how long the whole header is (HeaderSize()).
inline constexpr uint64_t kFixedHeaderBytes = 32;
// Chunks hold at most this many elements (positions within a chunk fit 32 bits). It also bounds
// what decoding one chunk of a peer's delta may allocate (its change streams, positions and
// values: ~150 MiB at most per decoding thread), whatever the delta claims; refitd's own deltas
// use 2^18 (delta_source.h).
inline constexpr uint64_t kMaxChunkElements = uint64_t{1} << 22;

struct EncodeOptions {
  uint64_t chunk_elements = uint64_t{1} << 20;  // 1 .. kMaxChunkElements
  // zstd level for the change streams that get a second stage (FORMAT.md); negative values
  // are zstd's fast levels. Rice codes leave zstd little to find: levels barely matter.
  int zstd_level = 1;
  // When nonzero, Encode gives up with RESOURCE_EXHAUSTED as soon as the delta grows past this
  // many bytes, so "send the full bytes instead" costs at most one chunk more than necessary.
  uint64_t max_encoded_bytes = 0;
  // Chunks are independent, so Encode can spread them over this many threads (0: one per
  // core); the delta is the same byte for byte. Each thread needs about 16 bytes of scratch per
  // changed element of its chunk, and each chunk's payload is copied once more at the end.
  int threads = 1;
};

// Where Encode spent its time (summed over threads) and what it found; optional output.
struct EncodeStats {
  uint64_t changed = 0;           // elements whose bit pattern differs
  uint64_t unchanged_chunks = 0;  // chunks by the form Encode chose
  uint64_t sparse_chunks = 0;
  uint64_t raw_chunks = 0;    // chunks stored as full target bytes: the delta was not smaller
  double scan_seconds = 0;    // compare, target checksums, collecting the changes
  double coding_seconds = 0;  // choosing Rice parameters, writing the streams, zstd
};

// One chunk of a parsed delta. Elements [first_element, first_element + num_elements) of the
// buffer; its payload is bytes [encoded_offset, encoded_offset + encoded_size) of the delta.
struct ChunkInfo {
  uint64_t first_element = 0;
  uint64_t num_elements = 0;
  uint64_t encoded_offset = 0;
  uint64_t encoded_size = 0;
  uint64_t encoded_xxh3 = 0;  // XXH3-64 of the payload bytes
  uint64_t target_xxh3 = 0;   // XXH3-64 of the chunk's bytes in the target
  uint64_t changed = 0;       // elements that differ between base and target
};

// The parsed header of a delta.
struct DeltaIndex {
  DType dtype = DType::kUnspecified;
  uint64_t element_size = 0;
  uint64_t num_elements = 0;
  uint64_t chunk_elements = 0;
  std::vector<ChunkInfo> chunks;
  uint64_t header_size = 0;  // payloads start here
  uint64_t total_size = 0;   // header plus every payload: the size of the whole delta

  uint64_t buffer_bytes() const { return num_elements * element_size; }
  uint64_t changed() const;
};

// Encodes target relative to base: two buffers of `bytes` bytes holding elements of `dtype`
// (any dtype with a known size; elements are compared as bit patterns, so NaNs and -0 are
// exact). INVALID_ARGUMENT when `bytes` is not a multiple of the element size or an option is
// out of range. The delta's size is the returned vector's size.
absl::StatusOr<std::vector<uint8_t>> Encode(const uint8_t* base, const uint8_t* target,
                                            uint64_t bytes, DType dtype,
                                            const EncodeOptions& options = {},
                                            EncodeStats* stats = nullptr);

// The size of the whole header, from its first kFixedHeaderBytes (or more) bytes: fetch that
// many, then the rest of the header, then ParseIndex. DATA_LOSS / UNIMPLEMENTED as ParseIndex.
absl::StatusOr<uint64_t> HeaderSize(const uint8_t* data, uint64_t size);

// Parses and verifies the header at the start of `data`; `size` may stop right after the
// header (payloads need not be present). DATA_LOSS when it is corrupt or truncated.
absl::StatusOr<DeltaIndex> ParseIndex(const uint8_t* data, uint64_t size);

// Indices of the chunks holding any element of [first_element, first_element + num_elements),
// in order; elements past the end are ignored.
std::vector<size_t> ChunksOverlapping(const DeltaIndex& index, uint64_t first_element,
                                      uint64_t num_elements);

// Applies chunk `chunk` of `index` (from ParseIndex), whose payload is `chunk_bytes`
// (`chunk_size` bytes, e.g. fetched on its own), to the whole base buffer `base_inout` of
// `base_bytes` bytes (index.buffer_bytes()). Writes only that chunk's elements; on any error
// they hold what they held before. Nothing is retained: the caller owns every buffer.
// `changed` (optional): on success, the bytes of the buffer the chunk changed are appended as
// sorted ranges (ChunkDecoder::AppendChanged: a superset of the bytes that differ from the
// base; what a receiver's sparse Apply then compares instead of the whole version). The same
// for ApplyChunkTo and ApplyChunkWithin (the buffer's offsets, not the chunk's).
absl::Status ApplyChunk(const DeltaIndex& index, size_t chunk, const uint8_t* chunk_bytes,
                        uint64_t chunk_size, uint8_t* base_inout, uint64_t base_bytes,
                        std::vector<std::pair<uint64_t, uint64_t>>* changed = nullptr);

// ApplyChunk on a buffer holding only that chunk's elements: `chunk_inout` is
// index.chunks[chunk].num_elements * index.element_size bytes (`chunk_inout_bytes`), e.g. a
// copy in cache that the caller streams into place afterwards. Same checks and guarantees.
absl::Status ApplyChunkTo(const DeltaIndex& index, size_t chunk, const uint8_t* chunk_bytes,
                          uint64_t chunk_size, uint8_t* chunk_inout, uint64_t chunk_inout_bytes,
                          std::vector<std::pair<uint64_t, uint64_t>>* changed = nullptr);

// Like ApplyChunk for a receiver that holds only some bytes of the base (a resharded
// destination needs only part of each source buffer): applies the chunk's changes to the
// elements overlapping `ranges` (byte ranges of the buffer: sorted, disjoint, [begin, end))
// and leaves all other bytes alone. The payload's checksum is checked (DATA_LOSS), but the
// chunk's target checksum covers the whole chunk and cannot be: the caller must verify the
// ranges afterwards against checksums of the target's same ranges.
absl::Status ApplyChunkWithin(const DeltaIndex& index, size_t chunk, const uint8_t* chunk_bytes,
                              uint64_t chunk_size,
                              const std::vector<std::pair<uint64_t, uint64_t>>& ranges,
                              uint8_t* base_inout, uint64_t base_bytes,
                              std::vector<std::pair<uint64_t, uint64_t>>* changed = nullptr);

// Applies a whole delta, all or nothing: payload checksums and everything else that needs no
// writes are checked first, and if a chunk's result then fails its checksum (wrong base) the
// chunks already applied are undone. On any error the buffer holds what it held before.
absl::Status Apply(const uint8_t* delta, uint64_t size, uint8_t* base_inout, uint64_t base_bytes);

}  // namespace refit::delta
