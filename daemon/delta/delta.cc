#include "daemon/delta/delta.h"

#include <zstd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/xxh3.h"
#include "daemon/delta/chunk_codec.h"
#include "daemon/delta/varint.h"

namespace refit::delta {
namespace {

using internal::ChunkDecoder;
using internal::ChunkEncoder;
using internal::ChunkExpectation;
using internal::LoadFixed;
using internal::StoreFixed;

// Layout of the header (FORMAT.md): the fixed part, one entry per chunk, then the XXH3-64 of
// everything before it.
constexpr uint64_t kEntryBytes = 32;
constexpr uint64_t kTrailerBytes = 8;

uint64_t HeaderBytesFor(uint64_t num_chunks) {
  return kFixedHeaderBytes + kEntryBytes * num_chunks + kTrailerBytes;
}

uint64_t CeilDiv(uint64_t a, uint64_t b) { return a / b + (a % b != 0 ? 1 : 0); }

absl::Status Corrupt(const std::string& what) {
  return absl::DataLossError(absl::StrCat("delta is corrupt: ", what));
}

struct FixedHeader {
  DType dtype;
  uint64_t element_size;
  uint64_t num_elements;
  uint64_t chunk_elements;
  uint64_t num_chunks;
};

absl::StatusOr<FixedHeader> ParseFixedHeader(const uint8_t* data, uint64_t size) {
  if (size < kFixedHeaderBytes) return Corrupt("shorter than the fixed header");
  if (std::memcmp(data, kMagic, sizeof(kMagic)) != 0) return Corrupt("bad magic");
  const uint16_t version = LoadFixed<uint16_t>(data + 4);
  if (version != kFormatVersion) {
    return absl::UnimplementedError(absl::StrCat("delta format version ", version,
                                                 " is not supported (this build reads ",
                                                 kFormatVersion, ")"));
  }
  FixedHeader header;
  header.dtype = static_cast<DType>(data[6]);
  header.element_size = data[7];
  header.num_elements = LoadFixed<uint64_t>(data + 8);
  header.chunk_elements = LoadFixed<uint64_t>(data + 16);
  header.num_chunks = LoadFixed<uint32_t>(data + 24);
  if (header.element_size == 0 || DTypeSize(header.dtype) != header.element_size) {
    return Corrupt("unknown dtype or wrong element size");
  }
  if (LoadFixed<uint32_t>(data + 28) != 0) return Corrupt("reserved field is not zero");
  if (header.chunk_elements == 0 || header.chunk_elements > kMaxChunkElements) {
    return Corrupt("chunk size out of range");
  }
  if (header.num_elements > std::numeric_limits<uint64_t>::max() / header.element_size) {
    return Corrupt("buffer size overflows");
  }
  if (header.num_chunks != CeilDiv(header.num_elements, header.chunk_elements)) {
    return Corrupt("chunk count does not match the element count");
  }
  return header;
}

absl::Status CheckBaseSize(const DeltaIndex& index, uint64_t base_bytes) {
  if (base_bytes != index.buffer_bytes()) {
    return absl::InvalidArgumentError(
        absl::StrCat("base has ", base_bytes, " bytes; the delta is for ", index.buffer_bytes(),
                     " bytes (", index.num_elements, " ", DTypeName(index.dtype), ")"));
  }
  return absl::OkStatus();
}

ChunkExpectation ExpectationFor(const DeltaIndex& index, const ChunkInfo& info) {
  ChunkExpectation expect;
  expect.num_elements = info.num_elements;
  expect.element_size = index.element_size;
  expect.changed = info.changed;
  expect.target_xxh3 = info.target_xxh3;
  return expect;
}

absl::Status CheckPayload(const DeltaIndex& index, size_t chunk, const uint8_t* bytes,
                          uint64_t size) {
  const ChunkInfo& info = index.chunks[chunk];
  if (size != info.encoded_size) {
    return Corrupt(
        absl::StrCat("chunk ", chunk, " has ", size, " bytes, the index says ", info.encoded_size));
  }
  if (XXH3_64bits(bytes, size) != info.encoded_xxh3) {
    return Corrupt(absl::StrCat("chunk ", chunk, " does not match its checksum"));
  }
  return absl::OkStatus();
}

absl::Status WithChunk(absl::Status status, size_t chunk) {
  if (status.ok()) return status;
  return absl::Status(status.code(), absl::StrCat("chunk ", chunk, ": ", status.message()));
}

absl::Status CheckEncodeArguments(const uint8_t* base, const uint8_t* target, uint64_t bytes,
                                  DType dtype, const EncodeOptions& options) {
  const uint64_t element_size = DTypeSize(dtype);
  if (element_size == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot delta-encode dtype ", static_cast<int>(dtype)));
  }
  if (bytes % element_size != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(bytes, " bytes is not a whole number of ", DTypeName(dtype), " elements"));
  }
  if (options.chunk_elements == 0 || options.chunk_elements > kMaxChunkElements) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk_elements must be in [1, 2^22], not ", options.chunk_elements));
  }
  if (options.zstd_level < ZSTD_minCLevel() || options.zstd_level > ZSTD_maxCLevel()) {
    return absl::InvalidArgumentError(
        absl::StrCat("zstd_level ", options.zstd_level, " is out of range"));
  }
  if (options.threads < 0) return absl::InvalidArgumentError("threads must be >= 0");
  if (bytes != 0 && (base == nullptr || target == nullptr)) {
    return absl::InvalidArgumentError("null buffer");
  }
  if (CeilDiv(bytes / element_size, options.chunk_elements) >
      std::numeric_limits<uint32_t>::max()) {
    return absl::InvalidArgumentError("too many chunks; use larger chunk_elements");
  }
  return absl::OkStatus();
}

unsigned ThreadsFor(const EncodeOptions& options, uint64_t num_chunks) {
  uint64_t threads = options.threads > 0 ? static_cast<uint64_t>(options.threads)
                                         : std::max(1u, std::thread::hardware_concurrency());
  return static_cast<unsigned>(std::min(threads, num_chunks));
}

// Fills a chunk's index entry and adds it to the stats.
void RecordChunk(const internal::ChunkSummary& summary, uint64_t payload_size,
                 uint64_t payload_xxh3, uint8_t* entry, EncodeStats& stats) {
  StoreFixed<uint64_t>(entry + 0, payload_size);
  StoreFixed<uint64_t>(entry + 8, summary.changed);
  StoreFixed<uint64_t>(entry + 16, payload_xxh3);
  StoreFixed<uint64_t>(entry + 24, summary.target_xxh3);
  stats.changed += summary.changed;
  stats.scan_seconds += summary.scan_seconds;
  stats.coding_seconds += summary.coding_seconds;
  switch (summary.mode) {
    case internal::ChunkMode::kUnchanged:
      ++stats.unchanged_chunks;
      break;
    case internal::ChunkMode::kSparse:
      ++stats.sparse_chunks;
      break;
    case internal::ChunkMode::kRaw:
      ++stats.raw_chunks;
      break;
  }
}

}  // namespace

uint64_t DeltaIndex::changed() const {
  uint64_t total = 0;
  for (const ChunkInfo& info : chunks) total += info.changed;
  return total;
}

absl::StatusOr<std::vector<uint8_t>> Encode(const uint8_t* base, const uint8_t* target,
                                            uint64_t bytes, DType dtype,
                                            const EncodeOptions& options, EncodeStats* stats) {
  const uint64_t element_size = DTypeSize(dtype);
  RETURN_IF_ERROR(CheckEncodeArguments(base, target, bytes, dtype, options));
  const uint64_t num_elements = bytes / element_size;
  const uint64_t num_chunks = CeilDiv(num_elements, options.chunk_elements);
  const uint64_t header_size = HeaderBytesFor(num_chunks);
  std::vector<uint8_t> out(header_size, 0);
  std::memcpy(out.data(), kMagic, sizeof(kMagic));
  StoreFixed<uint16_t>(out.data() + 4, kFormatVersion);
  out[6] = static_cast<uint8_t>(dtype);
  out[7] = static_cast<uint8_t>(element_size);
  StoreFixed<uint64_t>(out.data() + 8, num_elements);
  StoreFixed<uint64_t>(out.data() + 16, options.chunk_elements);
  StoreFixed<uint32_t>(out.data() + 24, static_cast<uint32_t>(num_chunks));

  auto exhausted = [&](uint64_t chunks_done) {
    return absl::ResourceExhaustedError(absl::StrCat("delta exceeds ", options.max_encoded_bytes,
                                                     " bytes after ", chunks_done, " of ",
                                                     num_chunks, " chunks"));
  };
  auto chunk_input = [&](uint64_t chunk, const uint8_t* buffer) {
    return buffer + chunk * options.chunk_elements * element_size;
  };
  auto chunk_elements = [&](uint64_t chunk) {
    return std::min(options.chunk_elements, num_elements - chunk * options.chunk_elements);
  };
  EncodeStats local_stats;
  const unsigned threads = ThreadsFor(options, num_chunks);
  if (threads <= 1) {
    // Straight into `out`: no copies.
    ChunkEncoder encoder(options.zstd_level);
    for (uint64_t chunk = 0; chunk < num_chunks; ++chunk) {
      const uint64_t payload_start = out.size();
      ASSIGN_OR_RETURN(internal::ChunkSummary summary,
                       encoder.Encode(chunk_input(chunk, base), chunk_input(chunk, target),
                                      chunk_elements(chunk), element_size, out));
      if (options.max_encoded_bytes != 0 && out.size() > options.max_encoded_bytes) {
        return exhausted(chunk + 1);
      }
      const uint64_t payload_size = out.size() - payload_start;
      RecordChunk(summary, payload_size, XXH3_64bits(out.data() + payload_start, payload_size),
                  out.data() + kFixedHeaderBytes + kEntryBytes * chunk, local_stats);
    }
  } else {
    // Chunks are independent: workers take the next one, each into its own buffer.
    struct Result {
      std::vector<uint8_t> payload;
      internal::ChunkSummary summary;
      uint64_t payload_xxh3 = 0;
      absl::Status status;
    };
    std::vector<Result> results(num_chunks);
    std::atomic<uint64_t> next_chunk{0};
    std::atomic<uint64_t> total_size{header_size};
    std::atomic<bool> stop{false};
    auto work = [&] {
      ChunkEncoder encoder(options.zstd_level);
      for (uint64_t chunk = next_chunk++; chunk < num_chunks && !stop; chunk = next_chunk++) {
        Result& result = results[chunk];
        auto summary = encoder.Encode(chunk_input(chunk, base), chunk_input(chunk, target),
                                      chunk_elements(chunk), element_size, result.payload);
        if (!summary.ok()) {
          result.status = summary.status();
          stop = true;
          return;
        }
        result.summary = *summary;
        result.payload_xxh3 = XXH3_64bits(result.payload.data(), result.payload.size());
        const uint64_t total = total_size += result.payload.size();
        if (options.max_encoded_bytes != 0 && total > options.max_encoded_bytes) stop = true;
      }
    };
    std::vector<std::thread> workers;
    for (unsigned t = 0; t < threads; ++t) workers.emplace_back(work);
    for (std::thread& worker : workers) worker.join();
    for (const Result& result : results) RETURN_IF_ERROR(result.status);
    if (stop) return exhausted(std::min<uint64_t>(next_chunk, num_chunks));
    out.reserve(total_size);
    for (uint64_t chunk = 0; chunk < num_chunks; ++chunk) {
      const Result& result = results[chunk];
      out.insert(out.end(), result.payload.begin(), result.payload.end());
      RecordChunk(result.summary, result.payload.size(), result.payload_xxh3,
                  out.data() + kFixedHeaderBytes + kEntryBytes * chunk, local_stats);
    }
  }
  StoreFixed<uint64_t>(out.data() + header_size - kTrailerBytes,
                       XXH3_64bits(out.data(), header_size - kTrailerBytes));
  if (stats != nullptr) *stats = local_stats;
  return out;
}

absl::StatusOr<uint64_t> HeaderSize(const uint8_t* data, uint64_t size) {
  ASSIGN_OR_RETURN(FixedHeader header, ParseFixedHeader(data, size));
  return HeaderBytesFor(header.num_chunks);
}

absl::StatusOr<DeltaIndex> ParseIndex(const uint8_t* data, uint64_t size) {
  ASSIGN_OR_RETURN(FixedHeader header, ParseFixedHeader(data, size));
  DeltaIndex index;
  index.dtype = header.dtype;
  index.element_size = header.element_size;
  index.num_elements = header.num_elements;
  index.chunk_elements = header.chunk_elements;
  index.header_size = HeaderBytesFor(header.num_chunks);
  if (size < index.header_size) return Corrupt("truncated header");
  if (XXH3_64bits(data, index.header_size - kTrailerBytes) !=
      LoadFixed<uint64_t>(data + index.header_size - kTrailerBytes)) {
    return Corrupt("header does not match its checksum");
  }
  index.chunks.resize(header.num_chunks);
  uint64_t offset = index.header_size;
  for (uint64_t chunk = 0; chunk < header.num_chunks; ++chunk) {
    const uint8_t* entry = data + kFixedHeaderBytes + kEntryBytes * chunk;
    ChunkInfo& info = index.chunks[chunk];
    info.first_element = chunk * index.chunk_elements;
    info.num_elements = std::min(index.chunk_elements, index.num_elements - info.first_element);
    info.encoded_offset = offset;
    info.encoded_size = LoadFixed<uint64_t>(entry + 0);
    info.changed = LoadFixed<uint64_t>(entry + 8);
    info.encoded_xxh3 = LoadFixed<uint64_t>(entry + 16);
    info.target_xxh3 = LoadFixed<uint64_t>(entry + 24);
    // A payload is never larger than the raw form: its mode byte plus the chunk's bytes.
    if (info.encoded_size == 0 || info.encoded_size > 1 + info.num_elements * index.element_size) {
      return Corrupt(absl::StrCat("chunk ", chunk, " has an impossible size"));
    }
    if (info.changed > info.num_elements) {
      return Corrupt(absl::StrCat("chunk ", chunk, " has an impossible change count"));
    }
    if (offset > std::numeric_limits<uint64_t>::max() - info.encoded_size) {
      return Corrupt("payload offsets overflow");
    }
    offset += info.encoded_size;
  }
  index.total_size = offset;
  return index;
}

std::vector<size_t> ChunksOverlapping(const DeltaIndex& index, uint64_t first_element,
                                      uint64_t num_elements) {
  std::vector<size_t> chunks;
  if (num_elements == 0 || first_element >= index.num_elements || index.chunk_elements == 0) {
    return chunks;
  }
  const uint64_t end = first_element + std::min(num_elements, index.num_elements - first_element);
  const uint64_t end_chunk =
      std::min<uint64_t>(CeilDiv(end, index.chunk_elements), index.chunks.size());
  for (uint64_t chunk = first_element / index.chunk_elements; chunk < end_chunk; ++chunk) {
    chunks.push_back(static_cast<size_t>(chunk));
  }
  return chunks;
}

// The checks ApplyChunk and ApplyChunkWithin share: the chunk exists, the index is
// consistent (a hand-made one may not be; one from ParseIndex always is), the base has the
// buffer's size, and the payload matches its checksum.
static absl::Status CheckChunkArguments(const DeltaIndex& index, size_t chunk,
                                        const uint8_t* chunk_bytes, uint64_t chunk_size,
                                        uint64_t base_bytes) {
  if (chunk >= index.chunks.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("no chunk ", chunk, "; the delta has ", index.chunks.size()));
  }
  const ChunkInfo& info = index.chunks[chunk];
  if (DTypeSize(index.dtype) != index.element_size || info.num_elements > kMaxChunkElements ||
      info.first_element > index.num_elements ||
      info.num_elements > index.num_elements - info.first_element) {
    return absl::InvalidArgumentError("delta index is inconsistent; use ParseIndex");
  }
  RETURN_IF_ERROR(CheckBaseSize(index, base_bytes));
  if (chunk_bytes == nullptr && chunk_size != 0) {
    return absl::InvalidArgumentError("null chunk bytes");
  }
  return CheckPayload(index, chunk, chunk_bytes, chunk_size);
}

// Applies checked chunk `chunk` to its elements at `elements`.
static absl::Status ApplyChecked(const DeltaIndex& index, size_t chunk, const uint8_t* chunk_bytes,
                                 uint64_t chunk_size, uint8_t* elements,
                                 std::vector<std::pair<uint64_t, uint64_t>>* changed) {
  const ChunkInfo& info = index.chunks[chunk];
  const ChunkExpectation expect = ExpectationFor(index, info);
  RETURN_IF_ERROR(
      WithChunk(ChunkDecoder::Verify(chunk_bytes, chunk_size, expect, elements), chunk));
  // One decoder per thread: its zstd context and scratch are reused across chunks.
  thread_local ChunkDecoder decoder;
  RETURN_IF_ERROR(WithChunk(decoder.Apply(chunk_bytes, chunk_size, expect, elements), chunk));
  if (changed) {
    decoder.AppendChanged(chunk_bytes, info.first_element * index.element_size, info.num_elements,
                          index.element_size, changed);
  }
  return absl::OkStatus();
}

absl::Status ApplyChunk(const DeltaIndex& index, size_t chunk, const uint8_t* chunk_bytes,
                        uint64_t chunk_size, uint8_t* base_inout, uint64_t base_bytes,
                        std::vector<std::pair<uint64_t, uint64_t>>* changed) {
  RETURN_IF_ERROR(CheckChunkArguments(index, chunk, chunk_bytes, chunk_size, base_bytes));
  const ChunkInfo& info = index.chunks[chunk];
  return ApplyChecked(index, chunk, chunk_bytes, chunk_size,
                      base_inout + info.first_element * index.element_size, changed);
}

absl::Status ApplyChunkTo(const DeltaIndex& index, size_t chunk, const uint8_t* chunk_bytes,
                          uint64_t chunk_size, uint8_t* chunk_inout, uint64_t chunk_inout_bytes,
                          std::vector<std::pair<uint64_t, uint64_t>>* changed) {
  RETURN_IF_ERROR(CheckChunkArguments(index, chunk, chunk_bytes, chunk_size, index.buffer_bytes()));
  const uint64_t want = index.chunks[chunk].num_elements * index.element_size;
  if (chunk_inout_bytes != want || (chunk_inout == nullptr && want != 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("chunk ", chunk, " has ", want, " bytes; given ", chunk_inout_bytes));
  }
  return ApplyChecked(index, chunk, chunk_bytes, chunk_size, chunk_inout, changed);
}

absl::Status ApplyChunkWithin(const DeltaIndex& index, size_t chunk, const uint8_t* chunk_bytes,
                              uint64_t chunk_size,
                              const std::vector<std::pair<uint64_t, uint64_t>>& ranges,
                              uint8_t* base_inout, uint64_t base_bytes,
                              std::vector<std::pair<uint64_t, uint64_t>>* changed) {
  RETURN_IF_ERROR(CheckChunkArguments(index, chunk, chunk_bytes, chunk_size, base_bytes));
  const ChunkInfo& info = index.chunks[chunk];
  // The ranges, clipped to the chunk and made relative to its first byte.
  const uint64_t first = info.first_element * index.element_size;
  const uint64_t last = first + info.num_elements * index.element_size;
  std::vector<std::pair<uint64_t, uint64_t>> within;
  uint64_t previous_end = 0;
  for (const auto& [begin, end] : ranges) {
    if (end <= begin) continue;
    if (begin < previous_end)
      return absl::InvalidArgumentError("ranges must be sorted and disjoint");
    previous_end = end;
    const uint64_t b = std::max(begin, first), e = std::min(end, last);
    if (b < e) within.emplace_back(b - first, e - first);
  }
  if (within.empty()) return absl::OkStatus();
  // One decoder per thread: its zstd context and scratch are reused across chunks.
  thread_local ChunkDecoder decoder;
  RETURN_IF_ERROR(
      WithChunk(decoder.ApplyWithin(chunk_bytes, chunk_size, ExpectationFor(index, info),
                                    base_inout + first, within),
                chunk));
  if (changed) {
    decoder.AppendChanged(chunk_bytes, first, info.num_elements, index.element_size, changed);
  }
  return absl::OkStatus();
}

absl::Status Apply(const uint8_t* delta, uint64_t size, uint8_t* base_inout, uint64_t base_bytes) {
  if (delta == nullptr) return absl::InvalidArgumentError("null delta");
  ASSIGN_OR_RETURN(DeltaIndex index, ParseIndex(delta, size));
  if (size != index.total_size) {
    return Corrupt(absl::StrCat("delta has ", size, " bytes, its header says ", index.total_size));
  }
  RETURN_IF_ERROR(CheckBaseSize(index, base_bytes));
  auto payload = [&](size_t chunk) { return delta + index.chunks[chunk].encoded_offset; };
  auto base = [&](size_t chunk) {
    return base_inout + index.chunks[chunk].first_element * index.element_size;
  };
  // First everything that needs no writes: payload checksums, unchanged chunks against the
  // base, raw chunks against their target checksum.
  std::vector<size_t> sparse, raw;
  for (size_t chunk = 0; chunk < index.chunks.size(); ++chunk) {
    const ChunkInfo& info = index.chunks[chunk];
    RETURN_IF_ERROR(CheckPayload(index, chunk, payload(chunk), info.encoded_size));
    RETURN_IF_ERROR(WithChunk(ChunkDecoder::Verify(payload(chunk), info.encoded_size,
                                                   ExpectationFor(index, info), base(chunk)),
                              chunk));
    const auto mode = static_cast<internal::ChunkMode>(payload(chunk)[0]);
    if (mode == internal::ChunkMode::kSparse) sparse.push_back(chunk);
    if (mode == internal::ChunkMode::kRaw) raw.push_back(chunk);
  }
  // Sparse chunks can still fail (a wrong base shows only in the result): undo the ones
  // already applied when one does. Raw chunks were fully checked above and go last.
  ChunkDecoder decoder;
  for (size_t i = 0; i < sparse.size(); ++i) {
    const size_t chunk = sparse[i];
    const ChunkInfo& info = index.chunks[chunk];
    absl::Status status = WithChunk(
        decoder.Apply(payload(chunk), info.encoded_size, ExpectationFor(index, info), base(chunk)),
        chunk);
    if (status.ok()) continue;
    while (i-- > 0) {
      const ChunkInfo& done = index.chunks[sparse[i]];
      const absl::Status reverted = decoder.Revert(payload(sparse[i]), done.encoded_size,
                                                   ExpectationFor(index, done), base(sparse[i]));
      if (!reverted.ok()) {  // it decoded a moment ago; it cannot fail now
        return absl::InternalError(absl::StrCat("cannot undo chunk ", sparse[i], " after ",
                                                status.ToString(), ": ", reverted.ToString()));
      }
    }
    return status;
  }
  for (const size_t chunk : raw) {
    const ChunkInfo& info = index.chunks[chunk];
    RETURN_IF_ERROR(WithChunk(
        decoder.Apply(payload(chunk), info.encoded_size, ExpectationFor(index, info), base(chunk)),
        chunk));
  }
  return absl::OkStatus();
}

}  // namespace refit::delta
