#include "daemon/delta/delta.h"

#include <algorithm>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "catch2/catch.hpp"
#include "daemon/delta/delta_testing.h"

namespace refit::delta {
namespace {

using testing::Bytes;
using testing::Change;
using testing::CountChanged;
using testing::Mutate;
using testing::RandomBytes;

Bytes MustEncode(const Bytes& base, const Bytes& target, DType dtype,
                 const EncodeOptions& options = {}, EncodeStats* stats = nullptr) {
  auto encoded = Encode(base.data(), target.data(), base.size(), dtype, options, stats);
  INFO(encoded.status().ToString());
  REQUIRE(encoded.ok());
  return std::move(encoded).value();
}

// A bf16 base, a target with 2 % of it changed, and their delta in chunks of 4096 elements.
struct Chunked {
  Bytes base, target, delta;
  DeltaIndex index;
};
Chunked MakeChunked(uint64_t elements, uint32_t seed) {
  Chunked c;
  c.base = RandomBytes(elements * 2, seed);
  c.target = Mutate(c.base, 2, 0.02, Change::kMixed, seed + 1);
  EncodeOptions options;
  options.chunk_elements = 4096;
  c.delta = MustEncode(c.base, c.target, DType::kBF16, options);
  auto index = ParseIndex(c.delta.data(), c.delta.size());
  REQUIRE(index.ok());
  c.index = std::move(index).value();
  return c;
}

// Encodes, checks the index, applies to a copy of base and checks the result.
void CheckRoundTrip(const Bytes& base, const Bytes& target, DType dtype,
                    const EncodeOptions& options = {}) {
  const size_t element_size = DTypeSize(dtype);
  const Bytes delta = MustEncode(base, target, dtype, options);
  auto index = ParseIndex(delta.data(), delta.size());
  REQUIRE(index.ok());
  CHECK(index->dtype == dtype);
  CHECK(index->num_elements == base.size() / element_size);
  CHECK(index->total_size == delta.size());
  CHECK(index->changed() == CountChanged(base, target, element_size));
  Bytes work = base;
  const absl::Status status = Apply(delta.data(), delta.size(), work.data(), work.size());
  INFO(status.ToString());
  REQUIRE(status.ok());
  CHECK((work == target));
}

TEST_CASE("round trip is bit-exact across densities, dtypes and change sizes", "[delta]") {
  const DType dtype = GENERATE(DType::kBF16, DType::kFP16, DType::kFP32);
  const double density = GENERATE(0.0, 0.0001, 0.01, 0.1, 0.6, 1.0);
  const Change change = GENERATE(Change::kUlp, Change::kLarge, Change::kMixed);
  const size_t element_size = DTypeSize(dtype);
  // Not a multiple of the chunk, nor of 8 or 64 bytes.
  const uint64_t elements = 3 * 16384 + 1001;
  const Bytes base = RandomBytes(elements * element_size, 7);
  const Bytes target = Mutate(base, element_size, density, change, 11);
  INFO("dtype " << DTypeName(dtype) << " density " << density << " change "
                << static_cast<int>(change));
  EncodeOptions options;
  options.chunk_elements = 16384;
  CheckRoundTrip(base, target, dtype, options);
}

TEST_CASE("every element size round-trips, including tails shorter than a word", "[delta]") {
  const DType dtype =
      GENERATE(DType::kUINT8, DType::kFP8E4M3, DType::kBF16, DType::kINT32, DType::kINT64);
  const uint64_t elements = GENERATE(1, 3, 7, 31, 33, 65, 1000);
  const size_t element_size = DTypeSize(dtype);
  const Bytes base = RandomBytes(elements * element_size, elements);
  const Bytes target = Mutate(base, element_size, 0.3, Change::kMixed, elements + 1);
  INFO("dtype " << DTypeName(dtype) << " elements " << elements);
  EncodeOptions options;
  options.chunk_elements = 16;
  CheckRoundTrip(base, target, dtype, options);
  options.chunk_elements = uint64_t{1} << 20;
  CheckRoundTrip(base, target, dtype, options);
}

TEST_CASE("NaN, infinity and signed-zero bit patterns are preserved exactly", "[delta]") {
  std::vector<float> base(1000), target(1000);
  for (size_t i = 0; i < base.size(); ++i) base[i] = static_cast<float>(i) * 0.25f;
  target = base;
  const uint32_t patterns[] = {0x7fc00000u, 0x7fc00001u, 0xffc00000u, 0x7f800001u,
                               0x7f800000u, 0xff800000u, 0x80000000u, 0x00000000u};
  for (size_t i = 0; i < 8; ++i) {
    std::memcpy(&base[100 * i], &patterns[i], 4);
    std::memcpy(&target[100 * i], &patterns[(i + 1) % 8], 4);
  }
  Bytes b(base.size() * 4), t(target.size() * 4);
  std::memcpy(b.data(), base.data(), b.size());
  std::memcpy(t.data(), target.data(), t.size());
  CheckRoundTrip(b, t, DType::kFP32);
  // bf16 NaN payloads differing by one ulp of payload.
  Bytes b16 = {0xc0, 0x7f, 0xc1, 0x7f, 0x80, 0xff, 0x00, 0x80};
  Bytes t16 = {0xc1, 0x7f, 0xc0, 0x7f, 0x81, 0xff, 0x00, 0x00};
  CheckRoundTrip(b16, t16, DType::kBF16);
}

TEST_CASE("extreme differences use the escape and still round-trip", "[delta]") {
  for (const DType dtype : {DType::kUINT8, DType::kBF16, DType::kFP32, DType::kINT64}) {
    const size_t element_size = DTypeSize(dtype);
    Bytes base(64 * element_size, 0), target(64 * element_size, 0);
    for (size_t i = 0; i + 1 < 64; i += 3) {
      std::memset(&target[i * element_size], 0xff, element_size);      // base 0 -> all ones
      std::memset(&base[(i + 1) * element_size], 0x80, element_size);  // half-range jumps
    }
    INFO(DTypeName(dtype));
    CheckRoundTrip(base, target, dtype);
  }
}

TEST_CASE("wide but regular differences get a wide Rice parameter, not escapes", "[delta]") {
  // fp32 weights moving by hundreds to thousands of ulps: each change should cost about
  // log2(gap) + log2(difference) bits, far below the 4-byte value alone.
  const uint64_t elements = 100000;
  const Bytes base = RandomBytes(elements * 4, 51);
  Bytes target = base;
  std::mt19937_64 rng(52);
  uint64_t changed = 0;
  for (uint64_t i = 0; i < elements; i += 1 + rng() % 200) {
    uint32_t v;
    std::memcpy(&v, &target[4 * i], 4);
    v += (rng() & 1) ? 1000 + rng() % 2000 : -(1000 + static_cast<uint32_t>(rng() % 2000));
    std::memcpy(&target[4 * i], &v, 4);
    ++changed;
  }
  const Bytes delta = MustEncode(base, target, DType::kFP32);
  INFO(delta.size() << " bytes for " << changed << " changes");
  CHECK(delta.size() < 3 * changed);
  CheckRoundTrip(base, target, DType::kFP32);
}

TEST_CASE("an empty buffer encodes to a header that applies to an empty base", "[delta]") {
  const Bytes empty;
  const Bytes delta = MustEncode(empty, empty, DType::kBF16);
  auto index = ParseIndex(delta.data(), delta.size());
  REQUIRE(index.ok());
  CHECK(index->chunks.empty());
  CHECK(index->num_elements == 0);
  CHECK(Apply(delta.data(), delta.size(), nullptr, 0).ok());
}

TEST_CASE("unchanged and incompressible chunks take their cheap forms", "[delta]") {
  const uint64_t elements = 4 * 1024;
  Bytes base = RandomBytes(elements * 2, 3);
  Bytes target = base;
  // Chunk 1 gets random new bytes everywhere, chunk 2 sparse ulp changes, 0 and 3 nothing.
  const Bytes noise = RandomBytes(1024 * 2, 4);
  std::copy(noise.begin(), noise.end(), target.begin() + 1024 * 2);
  for (uint64_t i = 2048; i < 3072; i += 97) target[2 * i] ^= 1;
  EncodeOptions options;
  options.chunk_elements = 1024;
  EncodeStats stats;
  const Bytes delta = MustEncode(base, target, DType::kBF16, options, &stats);
  CHECK(stats.unchanged_chunks == 2);
  CHECK(stats.raw_chunks == 1);
  CHECK(stats.sparse_chunks == 1);
  CHECK(stats.changed == CountChanged(base, target, 2));
  auto index = ParseIndex(delta.data(), delta.size());
  REQUIRE(index.ok());
  CHECK(index->chunks[0].encoded_size == 1);
  CHECK(index->chunks[1].encoded_size == 1 + 1024 * 2);
  CHECK(index->chunks[2].encoded_size < 100);
  CheckRoundTrip(base, target, DType::kBF16, options);
}

TEST_CASE("bad arguments to Encode are INVALID_ARGUMENT", "[delta]") {
  const Bytes a(10, 0), b(10, 1);
  auto code = [](const absl::StatusOr<std::vector<uint8_t>>& result) {
    return result.status().code();
  };
  CHECK(code(Encode(a.data(), b.data(), 10, DType::kFP32)) == absl::StatusCode::kInvalidArgument);
  CHECK(code(Encode(a.data(), b.data(), 10, DType::kUnspecified)) ==
        absl::StatusCode::kInvalidArgument);
  CHECK(code(Encode(a.data(), b.data(), 10, static_cast<DType>(99))) ==
        absl::StatusCode::kInvalidArgument);
  EncodeOptions options;
  options.chunk_elements = 0;
  CHECK(code(Encode(a.data(), b.data(), 10, DType::kBF16, options)) ==
        absl::StatusCode::kInvalidArgument);
  options.chunk_elements = kMaxChunkElements + 1;
  CHECK(code(Encode(a.data(), b.data(), 10, DType::kBF16, options)) ==
        absl::StatusCode::kInvalidArgument);
  options = {};
  options.zstd_level = 1000;
  CHECK(code(Encode(a.data(), b.data(), 10, DType::kBF16, options)) ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("max_encoded_bytes stops an oversized delta", "[delta]") {
  const Bytes base = RandomBytes(1 << 16, 1);
  const Bytes target = RandomBytes(1 << 16, 2);
  EncodeOptions options;
  options.chunk_elements = 1024;
  options.max_encoded_bytes = 4096;
  auto encoded = Encode(base.data(), target.data(), base.size(), DType::kBF16, options);
  CHECK(encoded.status().code() == absl::StatusCode::kResourceExhausted);
  options.max_encoded_bytes = 1 << 20;
  CHECK(Encode(base.data(), target.data(), base.size(), DType::kBF16, options).ok());
}

TEST_CASE("encoding on several threads gives the same bytes", "[delta]") {
  const Bytes base = RandomBytes(100000 * 2, 71);
  const Bytes target = Mutate(base, 2, 0.01, Change::kMixed, 72);
  EncodeOptions options;
  options.chunk_elements = 7000;
  const Bytes one = MustEncode(base, target, DType::kBF16, options);
  for (const int threads : {0, 2, 3, 16, 100}) {
    options.threads = threads;
    EncodeStats stats;
    CHECK((MustEncode(base, target, DType::kBF16, options, &stats) == one));
    CHECK(stats.sparse_chunks == 15);
  }
  options.threads = 4;
  options.max_encoded_bytes = 2000;
  CHECK(Encode(base.data(), target.data(), base.size(), DType::kBF16, options).status().code() ==
        absl::StatusCode::kResourceExhausted);
  options.threads = -1;
  CHECK(Encode(base.data(), target.data(), base.size(), DType::kBF16, options).status().code() ==
        absl::StatusCode::kInvalidArgument);
}

TEST_CASE("the header parses from a prefix and locates every payload", "[delta]") {
  const Bytes base = RandomBytes(10000 * 4, 5);
  const Bytes target = Mutate(base, 4, 0.05, Change::kMixed, 6);
  EncodeOptions options;
  options.chunk_elements = 3000;
  const Bytes delta = MustEncode(base, target, DType::kFP32, options);
  auto header_size = HeaderSize(delta.data(), kFixedHeaderBytes);
  REQUIRE(header_size.ok());
  CHECK(HeaderSize(delta.data(), kFixedHeaderBytes - 1).status().code() ==
        absl::StatusCode::kDataLoss);
  // The header alone parses; one byte less does not.
  auto index = ParseIndex(delta.data(), *header_size);
  REQUIRE(index.ok());
  CHECK(index->header_size == *header_size);
  CHECK_FALSE(ParseIndex(delta.data(), *header_size - 1).ok());
  REQUIRE(index->chunks.size() == 4);
  uint64_t offset = *header_size;
  for (size_t c = 0; c < index->chunks.size(); ++c) {
    const ChunkInfo& info = index->chunks[c];
    CHECK(info.first_element == 3000 * c);
    CHECK(info.num_elements == (c < 3 ? 3000 : 1000));
    CHECK(info.encoded_offset == offset);
    offset += info.encoded_size;
  }
  CHECK(index->total_size == delta.size());
  CHECK(index->buffer_bytes() == base.size());
}

TEST_CASE("ChunksOverlapping names exactly the chunks a range touches", "[delta]") {
  DeltaIndex index;
  index.num_elements = 1000;
  index.chunk_elements = 300;
  index.chunks.resize(4);  // 0-299, 300-599, 600-899, 900-999
  using V = std::vector<size_t>;
  CHECK(ChunksOverlapping(index, 0, 1000) == V{0, 1, 2, 3});
  CHECK(ChunksOverlapping(index, 0, 300) == V{0});
  CHECK(ChunksOverlapping(index, 299, 2) == V{0, 1});
  CHECK(ChunksOverlapping(index, 300, 300) == V{1});
  CHECK(ChunksOverlapping(index, 950, 1000) == V{3});
  CHECK(ChunksOverlapping(index, 999, std::numeric_limits<uint64_t>::max()) == V{3});
  CHECK(ChunksOverlapping(index, 1000, 5).empty());
  CHECK(ChunksOverlapping(index, 10, 0).empty());
}

TEST_CASE("applying only the chunks a range needs updates just those elements", "[delta]") {
  const uint64_t elements = 50000;
  const Chunked chunked = MakeChunked(elements, 21);
  const Bytes& base = chunked.base;
  const Bytes& target = chunked.target;
  const Bytes& delta = chunked.delta;
  const DeltaIndex* index = &chunked.index;
  const uint64_t first = 10000, count = 9000;
  const std::vector<size_t> chunks = ChunksOverlapping(*index, first, count);
  REQUIRE(chunks == std::vector<size_t>{2, 3, 4});
  Bytes work = base;
  for (const size_t c : chunks) {
    const ChunkInfo& info = index->chunks[c];
    // A receiver holds only this payload, copied out of whatever it fetched.
    const Bytes payload(
        delta.begin() + static_cast<ptrdiff_t>(info.encoded_offset),
        delta.begin() + static_cast<ptrdiff_t>(info.encoded_offset + info.encoded_size));
    const absl::Status status =
        ApplyChunk(*index, c, payload.data(), payload.size(), work.data(), work.size());
    INFO(status.ToString());
    REQUIRE(status.ok());
  }
  const uint64_t applied_begin = 2 * 4096, applied_end = 5 * 4096;
  for (uint64_t i = 0; i < elements; ++i) {
    const Bytes& expected = (i >= applied_begin && i < applied_end) ? target : base;
    if (std::memcmp(&work[2 * i], &expected[2 * i], 2) != 0) {
      FAIL("element " << i << " is wrong");
    }
  }
  // The rest of the chunks complete the update.
  for (size_t c = 0; c < index->chunks.size(); ++c) {
    if (c >= 2 && c <= 4) continue;
    const ChunkInfo& info = index->chunks[c];
    REQUIRE(ApplyChunk(*index, c, delta.data() + info.encoded_offset, info.encoded_size,
                       work.data(), work.size())
                .ok());
  }
  CHECK((work == target));
}

TEST_CASE("applying a chunk reports the elements it changed, exactly", "[delta]") {
  // 2 % of 50,000 bf16 elements changed, chunks of 4096: every chunk's reported ranges are
  // the changed elements, whole, in order; their union is exactly the bytes that differ,
  // through ApplyChunk and ApplyChunkTo alike.
  const Chunked chunked = MakeChunked(50000, 47);
  const DeltaIndex& index = chunked.index;
  Bytes work = chunked.base;
  std::vector<std::pair<uint64_t, uint64_t>> changed, changed_to;
  for (size_t c = 0; c < index.chunks.size(); ++c) {
    const ChunkInfo& info = index.chunks[c];
    const uint8_t* payload = chunked.delta.data() + info.encoded_offset;
    Bytes copy(work.begin() + static_cast<ptrdiff_t>(info.first_element * 2),
               work.begin() + static_cast<ptrdiff_t>((info.first_element + info.num_elements) * 2));
    REQUIRE(
        ApplyChunkTo(index, c, payload, info.encoded_size, copy.data(), copy.size(), &changed_to)
            .ok());
    REQUIRE(
        ApplyChunk(index, c, payload, info.encoded_size, work.data(), work.size(), &changed).ok());
  }
  CHECK((work == chunked.target));
  CHECK(changed == changed_to);
  std::vector<std::pair<uint64_t, uint64_t>> differing;
  for (uint64_t i = 0; i < work.size(); i += 2) {
    if (std::memcmp(&chunked.base[i], &chunked.target[i], 2) == 0) continue;
    if (!differing.empty() && differing.back().second == i) {
      differing.back().second = i + 2;
    } else {
      differing.emplace_back(i, i + 2);
    }
  }
  REQUIRE_FALSE(differing.empty());
  CHECK(changed == differing);
}

TEST_CASE("ApplyChunkTo updates a copy of one chunk like ApplyChunk updates the buffer",
          "[delta]") {
  // 50,000 elements: 12 chunks of 4096 and a short last one.
  const Chunked chunked = MakeChunked(50000, 31);
  const Bytes& base = chunked.base;
  const Bytes& target = chunked.target;
  const Bytes& delta = chunked.delta;
  const DeltaIndex* index = &chunked.index;
  for (size_t c = 0; c < index->chunks.size(); ++c) {
    const ChunkInfo& info = index->chunks[c];
    const uint64_t lo = info.first_element * 2, n = info.num_elements * 2;
    Bytes copy(base.begin() + static_cast<ptrdiff_t>(lo),
               base.begin() + static_cast<ptrdiff_t>(lo + n));
    const uint8_t* payload = delta.data() + info.encoded_offset;
    INFO("chunk " << c);
    REQUIRE(ApplyChunkTo(*index, c, payload, info.encoded_size, copy.data(), copy.size()).ok());
    CHECK(std::memcmp(copy.data(), target.data() + lo, n) == 0);
    // A buffer of another size, or the wrong base (already the target): refused, unchanged.
    Bytes longer(n + 2, 0);
    CHECK(
        ApplyChunkTo(*index, c, payload, info.encoded_size, longer.data(), longer.size()).code() ==
        absl::StatusCode::kInvalidArgument);
    const Bytes before = copy;
    if (std::memcmp(base.data() + lo, target.data() + lo, n) != 0) {
      CHECK(ApplyChunkTo(*index, c, payload, info.encoded_size, copy.data(), copy.size()).code() ==
            absl::StatusCode::kFailedPrecondition);
      CHECK((copy == before));
    }
  }
}

TEST_CASE("a receiver holding only some ranges of the base applies just those", "[delta]") {
  const uint64_t elements = 40000;
  for (const DType dtype : {DType::kBF16, DType::kFP32}) {
    const size_t es = DTypeSize(dtype);
    const Bytes base = RandomBytes(elements * es, 31);
    // Dense enough that some chunks are stored raw, sparse elsewhere.
    Bytes target = Mutate(base, es, 0.01, Change::kMixed, 32);
    const Bytes dense = Mutate(base, es, 0.9, Change::kLarge, 33);
    std::memcpy(target.data(), dense.data(), 4096 * es);
    EncodeOptions options;
    options.chunk_elements = 4096;
    const Bytes delta = MustEncode(base, target, dtype, options);
    auto index = ParseIndex(delta.data(), delta.size());
    REQUIRE(index.ok());
    // Element-aligned ranges inside the first (raw) chunk, across a chunk edge, and alone.
    const std::vector<std::pair<uint64_t, uint64_t>> ranges = {
        {100 * es, 900 * es}, {8000 * es, 8300 * es}, {30001 * es, 30002 * es}};
    // The receiver's copy: garbage outside the ranges, the base inside.
    Bytes work = RandomBytes(base.size(), 34);
    for (const auto& [b, e] : ranges) std::memcpy(&work[b], &base[b], e - b);
    const Bytes before = work;
    std::vector<size_t> chunks;
    for (const auto& [b, e] : ranges) {
      for (size_t c : ChunksOverlapping(*index, b / es, (e - b) / es)) chunks.push_back(c);
    }
    std::sort(chunks.begin(), chunks.end());
    chunks.erase(std::unique(chunks.begin(), chunks.end()), chunks.end());
    for (const size_t c : chunks) {
      const ChunkInfo& info = index->chunks[c];
      const absl::Status status =
          ApplyChunkWithin(*index, c, delta.data() + info.encoded_offset, info.encoded_size, ranges,
                           work.data(), work.size());
      INFO(status.ToString());
      REQUIRE(status.ok());
    }
    uint64_t r = 0;
    for (uint64_t byte = 0; byte < work.size(); ++byte) {
      while (r < ranges.size() && ranges[r].second <= byte) ++r;
      const bool inside = r < ranges.size() && ranges[r].first <= byte;
      if (work[byte] != (inside ? target[byte] : before[byte])) {
        FAIL("byte " << byte << (inside ? " (inside)" : " (outside)") << " is wrong");
      }
    }
    // A corrupted payload is refused before any write.
    const ChunkInfo& info = index->chunks[chunks.back()];
    Bytes bad(delta.begin() + static_cast<ptrdiff_t>(info.encoded_offset),
              delta.begin() + static_cast<ptrdiff_t>(info.encoded_offset + info.encoded_size));
    bad.back() ^= 1;
    const Bytes snapshot = work;
    CHECK(ApplyChunkWithin(*index, chunks.back(), bad.data(), bad.size(), ranges, work.data(),
                           work.size())
              .code() == absl::StatusCode::kDataLoss);
    CHECK((work == snapshot));
    // Unsorted ranges are a caller error.
    CHECK(ApplyChunkWithin(*index, 0, delta.data() + index->chunks[0].encoded_offset,
                           index->chunks[0].encoded_size, {{200, 300}, {0, 100}}, work.data(),
                           work.size())
              .code() == absl::StatusCode::kInvalidArgument);
  }
}

TEST_CASE("different chunks apply concurrently to one buffer", "[delta]") {
  const uint64_t elements = 64 * 1024 + 17;
  const Bytes base = RandomBytes(elements * 2, 61);
  const Bytes target = Mutate(base, 2, 0.01, Change::kMixed, 62);
  EncodeOptions options;
  options.chunk_elements = 8192;
  const Bytes delta = MustEncode(base, target, DType::kBF16, options);
  auto index = ParseIndex(delta.data(), delta.size());
  REQUIRE(index.ok());
  Bytes work = base;
  std::vector<absl::Status> results(index->chunks.size());
  std::vector<std::thread> threads;
  for (size_t c = 0; c < index->chunks.size(); ++c) {
    threads.emplace_back([&, c] {
      const ChunkInfo& info = index->chunks[c];
      results[c] = ApplyChunk(*index, c, delta.data() + info.encoded_offset, info.encoded_size,
                              work.data(), work.size());
    });
  }
  for (auto& thread : threads) thread.join();
  for (const absl::Status& status : results) CHECK(status.ok());
  CHECK((work == target));
}

// A delta with one chunk of each form (unchanged, sparse, raw, sparse tail), small enough to
// corrupt at every position.
struct SmallDelta {
  Bytes base, target, delta;
  SmallDelta() {
    base = RandomBytes(4 * 64 * 2 + 40, 31);
    target = base;
    for (size_t i = 64; i < 128; i += 5) target[2 * i] += 1;  // chunk 1: sparse
    const Bytes noise = RandomBytes(64 * 2, 32);              // chunk 2: raw
    std::copy(noise.begin(), noise.end(), target.begin() + 128 * 2);
    for (size_t i = 256; i < 276; i += 3) target[2 * i + 1] ^= 0x40;  // chunk 4: sparse
    EncodeOptions options;
    options.chunk_elements = 64;
    delta = MustEncode(base, target, DType::kBF16, options);
  }
};

TEST_CASE("a flipped bit anywhere in a delta is rejected and the base is untouched",
          "[delta][corrupt]") {
  const SmallDelta small;
  auto index = ParseIndex(small.delta.data(), small.delta.size());
  REQUIRE(index.ok());
  REQUIRE(index->chunks.size() == 5);
  for (size_t pos = 0; pos < small.delta.size(); ++pos) {
    for (const uint8_t bit : {0x01, 0x10, 0x80}) {
      Bytes corrupt = small.delta;
      corrupt[pos] ^= bit;
      Bytes work = small.base;
      const absl::Status status = Apply(corrupt.data(), corrupt.size(), work.data(), work.size());
      if (status.ok()) FAIL("flip at byte " << pos << " was accepted");
      if (work != small.base) FAIL("flip at byte " << pos << " changed the base");
    }
  }
}

TEST_CASE("a delta truncated at any length is rejected", "[delta][corrupt]") {
  const SmallDelta small;
  for (size_t length = 0; length < small.delta.size(); ++length) {
    Bytes work = small.base;
    const absl::Status status = Apply(small.delta.data(), length, work.data(), work.size());
    if (status.ok()) FAIL("truncation to " << length << " bytes was accepted");
    if (status.code() != absl::StatusCode::kDataLoss) FAIL(status.ToString());
    if (work != small.base) FAIL("truncation to " << length << " changed the base");
  }
  // A chunk payload handed over short or long is rejected too.
  auto index = ParseIndex(small.delta.data(), small.delta.size());
  REQUIRE(index.ok());
  const ChunkInfo& info = index->chunks[1];
  Bytes work = small.base;
  CHECK(ApplyChunk(*index, 1, small.delta.data() + info.encoded_offset, info.encoded_size - 1,
                   work.data(), work.size())
            .code() == absl::StatusCode::kDataLoss);
  CHECK(ApplyChunk(*index, 9, small.delta.data(), 1, work.data(), work.size()).code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK((work == small.base));
}

TEST_CASE("a base of the wrong size or content is refused without writing", "[delta]") {
  const SmallDelta small;
  Bytes shorter(small.base.begin(), small.base.end() - 2);
  CHECK(Apply(small.delta.data(), small.delta.size(), shorter.data(), shorter.size()).code() ==
        absl::StatusCode::kInvalidArgument);
  // Only the last chunk's base differs: earlier sparse chunks apply, then must be undone.
  Bytes wrong = small.base;
  wrong[2 * 270] ^= 0x01;
  const Bytes before = wrong;
  const absl::Status status =
      Apply(small.delta.data(), small.delta.size(), wrong.data(), wrong.size());
  CHECK(status.code() == absl::StatusCode::kFailedPrecondition);
  CHECK((wrong == before));
  // An unchanged chunk over a wrong base is caught before anything is written.
  wrong = small.base;
  wrong[10] ^= 0x01;
  CHECK(Apply(small.delta.data(), small.delta.size(), wrong.data(), wrong.size()).code() ==
        absl::StatusCode::kFailedPrecondition);
  // The same chunk-by-chunk: the sparse chunk over a wrong base is rolled back.
  auto index = ParseIndex(small.delta.data(), small.delta.size());
  REQUIRE(index.ok());
  wrong = small.base;
  wrong[2 * 70] ^= 0x01;
  const Bytes before_chunk = wrong;
  const ChunkInfo& info = index->chunks[1];
  CHECK(ApplyChunk(*index, 1, small.delta.data() + info.encoded_offset, info.encoded_size,
                   wrong.data(), wrong.size())
            .code() == absl::StatusCode::kFailedPrecondition);
  CHECK((wrong == before_chunk));
}

TEST_CASE("forged payloads with valid checksums never crash or write out of bounds",
          "[delta][corrupt]") {
  // Payloads are edited and the checksums recomputed, as an attacker could. Every outcome must
  // be an error with the base untouched, or success with the base equal to the target (an
  // edit the decoder cannot tell apart, e.g. in the zstd frame, but the result checksum can).
  const uint64_t elements = 2000;
  const Bytes base = RandomBytes(elements * 2, 41);
  Bytes target = Mutate(base, 2, 0.05, Change::kMixed, 42);
  for (uint64_t i = 1500; i < 2000; ++i) target[2 * i] = base[2 * i] ^ 1;  // dense: zstd'd gaps
  EncodeOptions options;
  options.chunk_elements = 1000;
  const Bytes delta = MustEncode(base, target, DType::kBF16, options);
  auto index = ParseIndex(delta.data(), delta.size());
  REQUIRE(index.ok());
  std::mt19937_64 rng(43);
  int rejected = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    Bytes forged = delta;
    const ChunkInfo& info = index->chunks[rng() % index->chunks.size()];
    const int edits = 1 + static_cast<int>(rng() % 4);
    for (int e = 0; e < edits; ++e) {
      const uint64_t pos = info.encoded_offset + rng() % info.encoded_size;
      const uint64_t flip = uint64_t{1} << (rng() % 8);
      forged[pos] = static_cast<uint8_t>(rng() % 3 == 0 ? rng() : forged[pos] ^ flip);
    }
    testing::Reseal(forged);
    Bytes work = base;
    const absl::Status status = Apply(forged.data(), forged.size(), work.data(), work.size());
    if (status.ok()) {
      if (work != target) FAIL("trial " << trial << ": accepted with a wrong result");
    } else {
      ++rejected;
      if (work != base) FAIL("trial " << trial << ": " << status << " but the base changed");
    }
  }
  CHECK(rejected > 2700);
}

TEST_CASE("forged headers are rejected", "[delta][corrupt]") {
  const SmallDelta small;
  auto forge = [&](auto edit) {
    Bytes forged = small.delta;
    edit(forged);
    testing::Reseal(forged);
    Bytes work = small.base;
    const absl::Status status = Apply(forged.data(), forged.size(), work.data(), work.size());
    CHECK((work == small.base));
    return status.code();
  };
  using absl::StatusCode;
  CHECK(forge([](Bytes& d) { d[4] = 2; }) == StatusCode::kUnimplemented);  // version
  CHECK(forge([](Bytes& d) { d[6] = 3; }) == StatusCode::kDataLoss);       // fp32 with size 2
  CHECK(forge([](Bytes& d) { d[7] = 4; }) == StatusCode::kDataLoss);       // size disagrees
  CHECK(forge([](Bytes& d) { d[24] = 4; }) == StatusCode::kDataLoss);      // chunk count
  CHECK(forge([](Bytes& d) { d[28] = 1; }) == StatusCode::kDataLoss);      // reserved
  CHECK(forge([](Bytes& d) { testing::StoreU64(&d[16], 0); }) == StatusCode::kDataLoss);
  CHECK(forge([](Bytes& d) { testing::StoreU64(&d[8], ~uint64_t{0}); }) == StatusCode::kDataLoss);
  // A chunk claiming more changes than elements, or a payload bigger than the raw form.
  CHECK(forge([](Bytes& d) { testing::StoreU64(&d[32 + 32 + 8], 65); }) == StatusCode::kDataLoss);
  CHECK(forge([](Bytes& d) { testing::StoreU64(&d[32], 1 + 64 * 2 + 1); }) ==
        StatusCode::kDataLoss);
  // Sizes that overflow when added up.
  CHECK(forge([](Bytes& d) { testing::StoreU64(&d[32], ~uint64_t{0} - 10); }) ==
        StatusCode::kDataLoss);
}

// LEB128, as FORMAT.md writes the stream headers (read here without the library's reader).
uint64_t ReadLeb(const uint8_t*& at, int* length) {
  uint64_t value = 0;
  *length = 0;
  for (int shift = 0;; shift += 7) {
    const uint8_t byte = *at++;
    ++*length;
    value |= uint64_t{byte & 0x7fu} << shift;
    if ((byte & 0x80) == 0) return value;
  }
}

TEST_CASE("a zstd change stream that claims another size is refused before it is allocated",
          "[delta][corrupt]") {
  // A peer's delta may claim a stream of up to the chunk's bound with a frame of a few bytes:
  // the frame's own content size is checked first, so nothing of the claimed size is allocated.
  // A run of changed elements (each +1) and the rest unchanged: gaps of 0 (Rice k = 0), a
  // stream zstd shrinks.
  const uint64_t elements = 32768;  // the gap stream past kMinZstdBytes (chunk_codec.cc)
  Bytes base = RandomBytes(elements * 2, 51);
  for (uint64_t i = 0; i < elements / 2; ++i) base[2 * i] &= 0xfe;
  Bytes target = base;
  for (uint64_t i = 0; i < elements / 2; ++i) target[2 * i] |= 1;
  EncodeOptions options;
  options.chunk_elements = elements;
  const Bytes delta = MustEncode(base, target, DType::kBF16, options);
  auto index = ParseIndex(delta.data(), delta.size());
  REQUIRE(index.ok());
  bool forged_one = false;
  for (const ChunkInfo& info : index->chunks) {
    const uint8_t* at = delta.data() + info.encoded_offset;
    if (info.encoded_size < 4 || *at != 2) continue;  // kSparse
    ++at;
    int length = 0;
    ReadLeb(at, &length);  // changes
    at += 2;               // the Rice parameters
    const uint64_t stream_at = at - delta.data();
    int stream_length = 0;
    const uint64_t stream_bytes = ReadLeb(at, &stream_length);
    int header_length = 0;
    const uint64_t header = ReadLeb(at, &header_length);
    if ((header & 1) == 0 || stream_length != 2 || stream_bytes < 130) continue;
    Bytes forged = delta;
    const uint64_t claim = stream_bytes - 1;  // two LEB128 bytes still
    forged[stream_at] = static_cast<uint8_t>(0x80 | (claim & 0x7f));
    forged[stream_at + 1] = static_cast<uint8_t>(claim >> 7);
    testing::Reseal(forged);
    Bytes work = base;
    const absl::Status status = Apply(forged.data(), forged.size(), work.data(), work.size());
    INFO(status);
    CHECK(status.code() == absl::StatusCode::kDataLoss);
    CHECK(status.message().find("another size") != absl::string_view::npos);
    CHECK((work == base));
    forged_one = true;
  }
  REQUIRE(forged_one);
}

TEST_CASE("chunks of more than 2^22 elements are refused", "[delta][corrupt]") {
  EncodeOptions options;
  options.chunk_elements = kMaxChunkElements + 1;
  const Bytes base(64, 0);
  CHECK(Encode(base.data(), base.data(), base.size(), DType::kBF16, options).status().code() ==
        absl::StatusCode::kInvalidArgument);
  CHECK(kMaxChunkElements == uint64_t{1} << 22);
  const SmallDelta small;
  Bytes forged = small.delta;
  testing::StoreU64(&forged[16], kMaxChunkElements + 1);
  testing::Reseal(forged);
  Bytes work = small.base;
  CHECK(Apply(forged.data(), forged.size(), work.data(), work.size()).code() ==
        absl::StatusCode::kDataLoss);
  CHECK((work == small.base));
}

}  // namespace
}  // namespace refit::delta
