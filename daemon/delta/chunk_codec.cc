#include "daemon/delta/chunk_codec.h"

#include <zstd.h>

// SIMD compare loops: SSE2 (baseline x86-64), and AVX2 or AVX-512 chosen at run time. The
// defines turn them off so that tests cover every path (see BUILD.bazel).
#if defined(__SSE2__) && !defined(REFIT_DELTA_NO_SSE2)
#include <emmintrin.h>
#define REFIT_DELTA_SSE2 1
#endif
#if defined(__x86_64__) && defined(__GNUC__) && !defined(REFIT_DELTA_NO_AVX2)
#include <immintrin.h>
#define REFIT_DELTA_X86_AVX2 1
#if !defined(REFIT_DELTA_NO_AVX512)
#define REFIT_DELTA_X86_AVX512 1
#endif
#endif

#include <algorithm>
#include <chrono>
#include <cstring>
#include <limits>

#include "absl/strings/str_cat.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/xxh3.h"
#include "daemon/delta/rice.h"
#include "daemon/delta/varint.h"

namespace refit::delta::internal {
namespace {

// Gaps are below 2^32 (kMaxChunkElements is 2^22), so larger parameters never help.
constexpr unsigned kMaxGapK = 32;
// The compare loop hashes what it has just compared in blocks of this many bytes, while they
// are still in L2, instead of making another pass over memory.
constexpr uint64_t kScanBlockBytes = 64 << 10;
// zstd is tried on a Rice stream only in chunks with at least one change in kZstdDensity
// elements, when the stream is at least kMinZstdBytes long and its parameter is 0: runs of the
// shortest codes are all it finds to squeeze out of Rice codes. On lr 1e-5 data (3 % changed)
// it saves 4 % of the delta for 3 % of the encode time; on lr 1e-6 data (0.4 %) only 2 % for
// 5 %, so sparser chunks skip it.
constexpr uint64_t kZstdDensity = 50;
constexpr uint64_t kMinZstdBytes = 1024;

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

absl::Status Corrupt(const char* what) {
  return absl::DataLossError(absl::StrCat("delta chunk is corrupt: ", what));
}

void FreeCCtx(ZSTD_CCtx* cctx) { ZSTD_freeCCtx(cctx); }
void FreeDCtx(ZSTD_DCtx* dctx) { ZSTD_freeDCtx(dctx); }
void FreeHash(XXH3_state_t* state) { XXH3_freeState(state); }

// Bit i is set when byte i of the 64 bytes at a and b differs. Free of stores and branches, so
// the loop over (mostly equal) blocks stays a load-compare sequence bounded by memory bandwidth,
// and a block with one change costs one pass rather than a branch per word.
inline uint64_t DiffMask64(const uint8_t* a, const uint8_t* b) {
#if defined(REFIT_DELTA_SSE2)
  uint64_t equal = 0;
  for (int k = 0; k < 4; ++k) {
    const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a + 16 * k));
    const __m128i y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 16 * k));
    equal |= uint64_t{static_cast<uint32_t>(_mm_movemask_epi8(_mm_cmpeq_epi8(x, y)))} << (16 * k);
  }
  return ~equal;
#else
  uint64_t mask = 0;
  for (int k = 0; k < 8; ++k) {
    uint64_t x = LoadFixed<uint64_t>(a + 8 * k) ^ LoadFixed<uint64_t>(b + 8 * k);
    // Fold each byte onto its low bit, then gather the 8 low bits into one byte.
    x |= (x >> 4) & 0x0f0f0f0f0f0f0f0full;
    x |= (x >> 2) & 0x0303030303030303ull;
    x |= (x >> 1) & 0x0101010101010101ull;
    x &= 0x0101010101010101ull;
    mask |= ((x * 0x0102040810204080ull) >> 56) << (8 * k);
  }
  return mask;
#endif
}

#if defined(REFIT_DELTA_X86_AVX2)
__attribute__((target("avx2"))) inline uint64_t DiffMask64Avx2(const uint8_t* a, const uint8_t* b) {
  const __m256i a0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
  const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b));
  const __m256i a1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + 32));
  const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 32));
  const uint64_t low = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(a0, b0)));
  const uint64_t high = static_cast<uint32_t>(_mm256_movemask_epi8(_mm256_cmpeq_epi8(a1, b1)));
  return ~(low | (high << 32));
}

constexpr uint64_t kPrefetchBytes = 2048;

enum class Isa { kBaseline, kAvx2, kAvx512 };

Isa BestIsa() {
  static const Isa isa = [] {
#if defined(REFIT_DELTA_X86_AVX512)
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")) {
      return Isa::kAvx512;
    }
#endif
    return __builtin_cpu_supports("avx2") ? Isa::kAvx2 : Isa::kBaseline;
  }();
  return isa;
}
#endif

// Rice coding shifts by variable amounts all the time; with BMI2 (every AVX2 CPU has it) those
// are single instructions, so x86-64 builds carry a BMI2 clone picked at load time.
#if defined(REFIT_DELTA_X86_AVX2)
#define REFIT_DELTA_BMI2_CLONES __attribute__((target_clones("bmi2", "default")))
#else
#define REFIT_DELTA_BMI2_CLONES
#endif

REFIT_DELTA_BMI2_CLONES void WriteStreams(const uint64_t* gaps, unsigned gap_k,
                                          std::vector<uint8_t>& gap_out, const uint64_t* values,
                                          unsigned value_k, std::vector<uint8_t>& value_out,
                                          uint64_t n, uint64_t& gap_bytes, uint64_t& value_bytes) {
  WriteRiceStreams(gaps, gap_k, gap_out, values, value_k, value_out, n, gap_bytes, value_bytes);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// ChunkEncoder

ChunkEncoder::ChunkEncoder(int zstd_level)
    : zstd_level_(zstd_level),
      cctx_(ZSTD_createCCtx(), &FreeCCtx),
      target_hash_(XXH3_createState(), &FreeHash) {}

ChunkEncoder::~ChunkEncoder() = default;

// Records the elements whose bytes are set in `mask` (a DiffMask64 of the 64 bytes at element
// block_first). Works on locals: this-> members could alias the byte loads and be reloaded.
template <typename T>
inline void ChunkEncoder::EmitMask(const uint8_t* base, const uint8_t* target, uint64_t block_first,
                                   uint64_t mask) {
  constexpr uint64_t kElementMask = (uint64_t{1} << sizeof(T)) - 1;  // its bits in a byte mask
  constexpr uint64_t kMaxPerBlock = 64 / sizeof(T);
  if (changes_ + kMaxPerBlock > gaps_.size()) {
    const size_t size = std::max<size_t>(2 * gaps_.size(), 4096);
    gaps_.resize(size);
    values_.resize(size);
  }
  uint64_t* gaps = gaps_.data() + changes_;
  uint64_t* values = values_.data() + changes_;
  uint64_t next = next_element_;
  uint64_t emitted = 0;
  do {
    const unsigned lane = static_cast<unsigned>(__builtin_ctzll(mask)) / sizeof(T);
    mask &= ~(kElementMask << (lane * sizeof(T)));
    const uint64_t element = block_first + lane;
    gaps[emitted] = element - next;
    // A change has a nonzero difference, so its zigzag is >= 1.
    values[emitted] = ZigZagDiff<T>(LoadFixed<T>(base + element * sizeof(T)),
                                    LoadFixed<T>(target + element * sizeof(T))) -
                      1;
    ++emitted;
    next = element + 1;
  } while (mask != 0);
  next_element_ = next;
  changes_ += emitted;
}

// The elements of [first, first + count) from byte done_bytes (a multiple of 64) on.
template <typename T>
void ChunkEncoder::ScanTail(const uint8_t* base, const uint8_t* target, uint64_t first,
                            uint64_t count, uint64_t done_bytes) {
  for (uint64_t i = done_bytes / sizeof(T); i < count; ++i) {
    const uint64_t element = first + i;
    if (std::memcmp(base + element * sizeof(T), target + element * sizeof(T), sizeof(T)) != 0) {
      EmitMask<T>(base, target, element, (uint64_t{1} << sizeof(T)) - 1);
    }
  }
}

// Emits the changed elements among [first, first + count) of the chunk at base / target.
template <typename T>
void ChunkEncoder::ScanRange(const uint8_t* base, const uint8_t* target, uint64_t first,
                             uint64_t count) {
  const uint8_t* a = base + first * sizeof(T);
  const uint8_t* b = target + first * sizeof(T);
  const uint64_t bytes = count * sizeof(T);
  uint64_t i = 0;
  for (; i + 64 <= bytes; i += 64) {
    const uint64_t mask = DiffMask64(a + i, b + i);
    if (mask != 0) EmitMask<T>(base, target, first + i / sizeof(T), mask);
  }
  ScanTail<T>(base, target, first, count, i);
}

#if defined(REFIT_DELTA_X86_AVX2)
// ScanRange with 32-byte compares (docs/benchmarks.md, "Figures behind constants").
template <typename T>
__attribute__((target("avx2"))) void ChunkEncoder::ScanRangeAvx2(const uint8_t* base,
                                                                 const uint8_t* target,
                                                                 uint64_t first, uint64_t count) {
  const uint8_t* a = base + first * sizeof(T);
  const uint8_t* b = target + first * sizeof(T);
  const uint64_t bytes = count * sizeof(T);
  uint64_t i = 0;
  for (; i + 64 <= bytes; i += 64) {
    if (i + kPrefetchBytes < bytes) {  // beats the hardware prefetcher alone (docs/benchmarks.md)
      _mm_prefetch(reinterpret_cast<const char*>(a + i + kPrefetchBytes), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(b + i + kPrefetchBytes), _MM_HINT_T0);
    }
    const uint64_t mask = DiffMask64Avx2(a + i, b + i);
    if (mask != 0) EmitMask<T>(base, target, first + i / sizeof(T), mask);
  }
  ScanTail<T>(base, target, first, count, i);
}
#endif

#if defined(REFIT_DELTA_X86_AVX512)
// One 64-byte compare per block, straight into a mask (docs/benchmarks.md, "Figures behind
// constants").
template <typename T>
__attribute__((target("avx512f,avx512bw"))) void ChunkEncoder::ScanRangeAvx512(
    const uint8_t* base, const uint8_t* target, uint64_t first, uint64_t count) {
  const uint8_t* a = base + first * sizeof(T);
  const uint8_t* b = target + first * sizeof(T);
  const uint64_t bytes = count * sizeof(T);
  uint64_t i = 0;
  for (; i + 64 <= bytes; i += 64) {
    if (i + kPrefetchBytes < bytes) {
      _mm_prefetch(reinterpret_cast<const char*>(a + i + kPrefetchBytes), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(b + i + kPrefetchBytes), _MM_HINT_T0);
    }
    const uint64_t mask =
        _mm512_cmpneq_epi8_mask(_mm512_loadu_si512(a + i), _mm512_loadu_si512(b + i));
    if (mask != 0) EmitMask<T>(base, target, first + i / sizeof(T), mask);
  }
  ScanTail<T>(base, target, first, count, i);
}
#endif

template <typename T>
void ChunkEncoder::Scan(const uint8_t* base, const uint8_t* target, uint64_t num_elements) {
  const uint64_t bytes = num_elements * sizeof(T);
  for (uint64_t offset = 0; offset < bytes; offset += kScanBlockBytes) {
    const uint64_t len = std::min(kScanBlockBytes, bytes - offset);
    const uint64_t first = offset / sizeof(T), count = len / sizeof(T);
#if defined(REFIT_DELTA_X86_AVX2)
    switch (BestIsa()) {
#if defined(REFIT_DELTA_X86_AVX512)
      case Isa::kAvx512:
        ScanRangeAvx512<T>(base, target, first, count);
        break;
#endif
      case Isa::kAvx2:
        ScanRangeAvx2<T>(base, target, first, count);
        break;
      default:
        ScanRange<T>(base, target, first, count);
        break;
    }
#else
    ScanRange<T>(base, target, first, count);
#endif
    XXH3_64bits_update(target_hash_.get(), target + offset, len);
  }
}

absl::Status ChunkEncoder::AppendStream(const std::vector<uint8_t>& stream, uint64_t stream_bytes,
                                        unsigned k, bool try_zstd, std::vector<uint8_t>& out) {
  PutVarint(out, stream_bytes);
  if (try_zstd && k == 0 && stream_bytes >= kMinZstdBytes) {
    const size_t bound = ZSTD_compressBound(stream_bytes);
    const size_t start = out.size();
    out.resize(start + kMaxVarintBytes + bound);
    uint8_t* frame = out.data() + start + kMaxVarintBytes;
    const size_t compressed =
        ZSTD_compressCCtx(cctx_.get(), frame, bound, stream.data(), stream_bytes, zstd_level_);
    if (ZSTD_isError(compressed)) {
      return absl::InternalError(absl::StrCat("zstd: ", ZSTD_getErrorName(compressed)));
    }
    if (compressed < stream_bytes) {
      uint8_t header[kMaxVarintBytes];
      const size_t header_size = EncodeVarint(header, (uint64_t{compressed} << 1) | 1);
      // The frame sits past the header's end, so moving it down is a forward memmove.
      std::memmove(out.data() + start + header_size, frame, compressed);
      std::memcpy(out.data() + start, header, header_size);
      out.resize(start + header_size + compressed);
      return absl::OkStatus();
    }
    out.resize(start);
  }
  PutVarint(out, stream_bytes << 1);
  out.insert(out.end(), stream.begin(), stream.begin() + static_cast<ptrdiff_t>(stream_bytes));
  return absl::OkStatus();
}

absl::StatusOr<ChunkSummary> ChunkEncoder::Encode(const uint8_t* base, const uint8_t* target,
                                                  uint64_t num_elements, size_t element_size,
                                                  std::vector<uint8_t>& out) {
  const auto scan_start = std::chrono::steady_clock::now();
  next_element_ = 0;
  changes_ = 0;
  XXH3_64bits_reset(target_hash_.get());
  switch (element_size) {
    case 1:
      Scan<uint8_t>(base, target, num_elements);
      break;
    case 2:
      Scan<uint16_t>(base, target, num_elements);
      break;
    case 4:
      Scan<uint32_t>(base, target, num_elements);
      break;
    case 8:
      Scan<uint64_t>(base, target, num_elements);
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat("unsupported element size ", element_size));
  }
  ChunkSummary summary;
  summary.changed = changes_;
  summary.target_xxh3 = XXH3_64bits_digest(target_hash_.get());
  summary.scan_seconds = SecondsSince(scan_start);
  if (summary.changed == 0) {
    summary.mode = ChunkMode::kUnchanged;
    out.push_back(static_cast<uint8_t>(ChunkMode::kUnchanged));
    return summary;
  }

  const auto coding_start = std::chrono::steady_clock::now();
  uint64_t gap_bits = 0, value_bits = 0;  // estimates
  const unsigned gap_k = ChooseRiceKSampled(gaps_.data(), changes_, kMaxGapK, sample_, gap_bits);
  const unsigned value_k =
      ChooseRiceKSampled(values_.data(), changes_, kRiceMaxK, sample_, value_bits);
  const uint64_t raw_payload = 1 + num_elements * element_size;
  const uint64_t rice_bytes = (gap_bits + value_bits) / 8;
  summary.mode = ChunkMode::kRaw;
  if (rice_bytes < raw_payload + raw_payload / 8) {  // else it will not win: skip writing it
    const size_t start = out.size();
    out.push_back(static_cast<uint8_t>(ChunkMode::kSparse));
    PutVarint(out, summary.changed);
    out.push_back(static_cast<uint8_t>(gap_k));
    out.push_back(static_cast<uint8_t>(value_k));
    uint64_t gap_bytes = 0, value_bytes = 0;
    WriteStreams(gaps_.data(), gap_k, gap_bits_, values_.data(), value_k, value_bits_, changes_,
                 gap_bytes, value_bytes);
    const bool dense = changes_ * kZstdDensity >= num_elements;
    RETURN_IF_ERROR(AppendStream(gap_bits_, gap_bytes, gap_k, dense, out));
    RETURN_IF_ERROR(AppendStream(value_bits_, value_bytes, value_k, dense, out));
    if (out.size() - start < raw_payload) {
      summary.mode = ChunkMode::kSparse;
    } else {
      out.resize(start);
    }
  }
  if (summary.mode == ChunkMode::kRaw) {
    out.push_back(static_cast<uint8_t>(ChunkMode::kRaw));
    out.insert(out.end(), target, target + num_elements * element_size);
  }
  summary.coding_seconds = SecondsSince(coding_start);
  return summary;
}

// ---------------------------------------------------------------------------------------------
// ChunkDecoder

ChunkDecoder::ChunkDecoder()
    : dctx_(ZSTD_createDCtx(), &FreeDCtx), hash_(XXH3_createState(), &FreeHash) {}

ChunkDecoder::~ChunkDecoder() = default;

absl::Status ChunkDecoder::ReadStream(const uint8_t*& cursor, const uint8_t* end,
                                      uint64_t max_bytes, std::vector<uint8_t>& stream,
                                      uint64_t& stream_bytes) {
  uint64_t header = 0;
  if (!GetVarint(cursor, end, stream_bytes) || !GetVarint(cursor, end, header)) {
    return Corrupt("bad stream header");
  }
  if (stream_bytes > max_bytes) return Corrupt("stream longer than its changes can be");
  const uint64_t stored = header >> 1;
  if (stored > static_cast<uint64_t>(end - cursor)) return Corrupt("stream past end");
  // Sizes checked against the bytes that are there before anything is allocated: a zstd frame
  // says how long it decompresses to (the encoder's frames always do).
  if ((header & 1) == 0) {
    if (stored != stream_bytes) return Corrupt("stored stream has the wrong size");
  } else if (ZSTD_getFrameContentSize(cursor, stored) != stream_bytes) {
    return Corrupt("zstd frame of another size than its stream");
  }
  stream.assign(stream_bytes + kRicePadding, 0);
  if ((header & 1) == 0) {
    if (stored != 0) std::memcpy(stream.data(), cursor, stored);
  } else {
    const size_t got =
        ZSTD_decompressDCtx(dctx_.get(), stream.data(), stream_bytes, cursor, stored);
    if (ZSTD_isError(got) || got != stream_bytes) return Corrupt("bad zstd stream");
  }
  cursor += stored;
  return absl::OkStatus();
}

template <typename T>
absl::Status ChunkDecoder::DecodeChanges(const ChunkExpectation& expect, unsigned gap_k,
                                         unsigned value_k, uint64_t gap_bytes,
                                         uint64_t value_bytes) {
  const uint64_t n = expect.changed;
  const uint64_t num = expect.num_elements;
  // The largest zigzag of a T difference, minus the 1 the encoder subtracts.
  constexpr uint64_t kMaxValue = uint64_t{std::numeric_limits<T>::max()} - 1;
  positions_.resize(n);
  deltas_.resize(n);
  uint32_t* const positions = positions_.data();
  uint64_t* const deltas = deltas_.data();
  RiceReader gaps(gap_stream_.data(), gap_bytes);
  RiceReader values(value_stream_.data(), value_bytes);
  uint64_t position = 0;  // the first element the next change may touch
  for (uint64_t c = 0; c < n; ++c) {
    uint64_t gap = 0, value = 0;
    if (!gaps.GetRice(gap_k, gap) || gaps.Overrun()) return Corrupt("bad gap code");
    if (gap >= num - position) return Corrupt("change position past the chunk's end");
    position += gap;
    positions[c] = static_cast<uint32_t>(position);
    if (!values.GetRice(value_k, value) || values.Overrun()) return Corrupt("bad value code");
    if (value > kMaxValue) return Corrupt("value wider than the element");
    deltas[c] = UnZigZag<T>(value + 1);
    ++position;
  }
  if (!gaps.AtCleanEnd() || !values.AtCleanEnd()) return Corrupt("unused stream bytes");
  return absl::OkStatus();
}

absl::Status ChunkDecoder::DecodeSparse(const uint8_t* payload, uint64_t size,
                                        const ChunkExpectation& expect) {
  const uint8_t* cursor = payload + 1;
  const uint8_t* const end = payload + size;
  uint64_t n = 0;
  if (!GetVarint(cursor, end, n) || end - cursor < 2) return Corrupt("bad sparse header");
  if (n == 0 || n != expect.changed || n > expect.num_elements) {
    return Corrupt("change count disagrees with the index");
  }
  const unsigned gap_k = *cursor++;
  const unsigned value_k = *cursor++;
  if (gap_k > kMaxGapK || value_k > kRiceMaxK) return Corrupt("bad Rice parameter");
  // Bounds the scratch memory by what n codes can take.
  const uint64_t max_bytes = (n * uint64_t{kRiceMaxBits} + 7) / 8 + 8;
  uint64_t gap_bytes = 0, value_bytes = 0;
  RETURN_IF_ERROR(ReadStream(cursor, end, max_bytes, gap_stream_, gap_bytes));
  RETURN_IF_ERROR(ReadStream(cursor, end, max_bytes, value_stream_, value_bytes));
  if (cursor != end) return Corrupt("trailing bytes");
  // Every change takes at least one bit of each stream: checked before positions and values
  // for n changes are allocated.
  if (n > gap_bytes * 8 || n > value_bytes * 8) return Corrupt("streams too short for n changes");
  switch (expect.element_size) {
    case 1:
      return DecodeChanges<uint8_t>(expect, gap_k, value_k, gap_bytes, value_bytes);
    case 2:
      return DecodeChanges<uint16_t>(expect, gap_k, value_k, gap_bytes, value_bytes);
    case 4:
      return DecodeChanges<uint32_t>(expect, gap_k, value_k, gap_bytes, value_bytes);
    case 8:
      return DecodeChanges<uint64_t>(expect, gap_k, value_k, gap_bytes, value_bytes);
    default:
      return Corrupt("unsupported element size");
  }
}

// Undoes AddChangesAndHash.
template <typename T>
void ChunkDecoder::SubtractChanges(uint8_t* base) const {
  // Locals, not members: the byte stores below could alias members, which would then be
  // reloaded after every store and serialize the loop.
  const uint32_t* const positions = positions_.data();
  const uint64_t* const deltas = deltas_.data();
  const size_t n = positions_.size();
  for (size_t c = 0; c < n; ++c) {
    uint8_t* at = base + uint64_t{positions[c]} * sizeof(T);
    StoreFixed<T>(at, static_cast<T>(LoadFixed<T>(at) - static_cast<T>(deltas[c])));
  }
}

void ChunkDecoder::SubtractChanges(size_t element_size, uint8_t* base) const {
  switch (element_size) {
    case 1:
      return SubtractChanges<uint8_t>(base);
    case 2:
      return SubtractChanges<uint16_t>(base);
    case 4:
      return SubtractChanges<uint32_t>(base);
    default:
      return SubtractChanges<uint64_t>(base);
  }
}

// Adds the changes block by block and hashes each block right after, while it is in cache:
// one pass over the chunk instead of two. Returns the XXH3-64 of the result.
template <typename T>
uint64_t ChunkDecoder::AddChangesAndHash(uint8_t* base, uint64_t num_elements) {
  const uint32_t* const positions = positions_.data();
  const uint64_t* const deltas = deltas_.data();
  const size_t n = positions_.size();
  constexpr uint64_t kBlockElements = kScanBlockBytes / sizeof(T);
  XXH3_state_t* const state = hash_.get();
  XXH3_64bits_reset(state);
  size_t c = 0;
  for (uint64_t first = 0; first < num_elements; first += kBlockElements) {
    const uint64_t end = std::min(num_elements, first + kBlockElements);
    for (; c < n && positions[c] < end; ++c) {
      uint8_t* at = base + uint64_t{positions[c]} * sizeof(T);
      StoreFixed<T>(at, static_cast<T>(LoadFixed<T>(at) + static_cast<T>(deltas[c])));
    }
    XXH3_64bits_update(state, base + first * sizeof(T), (end - first) * sizeof(T));
  }
  return XXH3_64bits_digest(state);
}

uint64_t ChunkDecoder::AddChangesAndHash(size_t element_size, uint8_t* base,
                                         uint64_t num_elements) {
  switch (element_size) {
    case 1:
      return AddChangesAndHash<uint8_t>(base, num_elements);
    case 2:
      return AddChangesAndHash<uint16_t>(base, num_elements);
    case 4:
      return AddChangesAndHash<uint32_t>(base, num_elements);
    default:
      return AddChangesAndHash<uint64_t>(base, num_elements);
  }
}

absl::Status ChunkDecoder::Verify(const uint8_t* payload, uint64_t size,
                                  const ChunkExpectation& expect, const uint8_t* base) {
  if (size == 0) return Corrupt("empty payload");
  const uint64_t chunk_bytes = expect.num_elements * expect.element_size;
  switch (static_cast<ChunkMode>(payload[0])) {
    case ChunkMode::kUnchanged:
      if (size != 1 || expect.changed != 0) return Corrupt("inconsistent unchanged chunk");
      if (XXH3_64bits(base, chunk_bytes) != expect.target_xxh3) {
        return absl::FailedPreconditionError(
            "base is not the version this delta was encoded against (checksum mismatch)");
      }
      return absl::OkStatus();
    case ChunkMode::kRaw:
      if (size != 1 + chunk_bytes) return Corrupt("raw chunk has the wrong size");
      if (XXH3_64bits(payload + 1, chunk_bytes) != expect.target_xxh3) {
        return Corrupt("raw chunk does not match its target checksum");
      }
      return absl::OkStatus();
    case ChunkMode::kSparse:
      return absl::OkStatus();  // checked while decoding, before any write
  }
  return Corrupt("unknown chunk mode");
}

absl::Status ChunkDecoder::Apply(const uint8_t* payload, uint64_t size,
                                 const ChunkExpectation& expect, uint8_t* base) {
  if (size == 0) return Corrupt("empty payload");
  switch (static_cast<ChunkMode>(payload[0])) {
    case ChunkMode::kUnchanged:
      return absl::OkStatus();
    case ChunkMode::kRaw:
      if (size != 1 + expect.num_elements * expect.element_size) {
        return Corrupt("raw chunk has the wrong size");
      }
      std::memcpy(base, payload + 1, size - 1);
      return absl::OkStatus();
    case ChunkMode::kSparse:
      break;
    default:
      return Corrupt("unknown chunk mode");
  }
  RETURN_IF_ERROR(DecodeSparse(payload, size, expect));
  if (AddChangesAndHash(expect.element_size, base, expect.num_elements) == expect.target_xxh3) {
    return absl::OkStatus();
  }
  SubtractChanges(expect.element_size, base);
  return absl::FailedPreconditionError(
      "base is not the version this delta was encoded against (result checksum mismatch); "
      "chunk not applied");
}

void ChunkDecoder::AppendChanged(const uint8_t* payload, uint64_t first_byte, uint64_t num_elements,
                                 size_t element_size,
                                 std::vector<std::pair<uint64_t, uint64_t>>* out) const {
  switch (static_cast<ChunkMode>(payload[0])) {
    case ChunkMode::kUnchanged:
      return;
    case ChunkMode::kRaw:
      if (num_elements > 0) out->emplace_back(first_byte, first_byte + num_elements * element_size);
      return;
    case ChunkMode::kSparse:
      break;
    default:
      return;
  }
  for (const uint32_t position : positions_) {
    const uint64_t begin = first_byte + uint64_t{position} * element_size;
    if (!out->empty() && out->back().second >= begin) {
      out->back().second = std::max(out->back().second, begin + element_size);
    } else {
      out->emplace_back(begin, begin + element_size);
    }
  }
}

template <typename T>
void ChunkDecoder::AddChangesWithin(
    uint8_t* base, const std::vector<std::pair<uint64_t, uint64_t>>& ranges) const {
  const uint32_t* const positions = positions_.data();
  const uint64_t* const deltas = deltas_.data();
  const size_t n = positions_.size();
  size_t r = 0;
  for (size_t c = 0; c < n && r < ranges.size(); ++c) {
    const uint64_t begin = uint64_t{positions[c]} * sizeof(T);
    while (r < ranges.size() && ranges[r].second <= begin) ++r;  // ranges wholly before it
    if (r == ranges.size()) break;
    if (ranges[r].first >= begin + sizeof(T)) continue;  // the element lies before the range
    uint8_t* at = base + begin;
    StoreFixed<T>(at, static_cast<T>(LoadFixed<T>(at) + static_cast<T>(deltas[c])));
  }
}

absl::Status ChunkDecoder::ApplyWithin(const uint8_t* payload, uint64_t size,
                                       const ChunkExpectation& expect, uint8_t* base,
                                       const std::vector<std::pair<uint64_t, uint64_t>>& ranges) {
  if (size == 0) return Corrupt("empty payload");
  const uint64_t chunk_bytes = expect.num_elements * expect.element_size;
  switch (static_cast<ChunkMode>(payload[0])) {
    case ChunkMode::kUnchanged:
      if (size != 1 || expect.changed != 0) return Corrupt("inconsistent unchanged chunk");
      return absl::OkStatus();
    case ChunkMode::kRaw:
      if (size != 1 + chunk_bytes) return Corrupt("raw chunk has the wrong size");
      for (const auto& [begin, end] : ranges) {
        const uint64_t e = std::min(end, chunk_bytes);
        if (begin < e) std::memcpy(base + begin, payload + 1 + begin, e - begin);
      }
      return absl::OkStatus();
    case ChunkMode::kSparse:
      break;
    default:
      return Corrupt("unknown chunk mode");
  }
  RETURN_IF_ERROR(DecodeSparse(payload, size, expect));
  switch (expect.element_size) {
    case 1:
      AddChangesWithin<uint8_t>(base, ranges);
      break;
    case 2:
      AddChangesWithin<uint16_t>(base, ranges);
      break;
    case 4:
      AddChangesWithin<uint32_t>(base, ranges);
      break;
    default:
      AddChangesWithin<uint64_t>(base, ranges);
      break;
  }
  return absl::OkStatus();
}

absl::Status ChunkDecoder::Revert(const uint8_t* payload, uint64_t size,
                                  const ChunkExpectation& expect, uint8_t* base) {
  if (size == 0) return Corrupt("empty payload");
  switch (static_cast<ChunkMode>(payload[0])) {
    case ChunkMode::kUnchanged:
      return absl::OkStatus();
    case ChunkMode::kSparse:
      RETURN_IF_ERROR(DecodeSparse(payload, size, expect));
      SubtractChanges(expect.element_size, base);
      return absl::OkStatus();
    default:
      return absl::InternalError("only unchanged and sparse chunks can be reverted");
  }
}

}  // namespace refit::delta::internal
