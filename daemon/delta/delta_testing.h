#pragma once

// Helpers for the delta tests: random buffers with controlled changes, a writer for forged
// deltas (recomputes the checksums after a test edits bytes, following FORMAT.md), and the
// shared real-data directory (tests/testing/shared_data.h). Test-only; not thread-safe
// (shared RNG state is per call).

#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <xxhash.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "tests/testing/shared_data.h"

namespace refit::delta::testing {

using Bytes = std::vector<uint8_t>;

enum class Change {
  kUlp,    // +-1 in the element's bit pattern
  kLarge,  // a random new bit pattern
  kMixed,  // mostly +-1, some small, a few large
};

inline Bytes RandomBytes(uint64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Bytes bytes(n);
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  return bytes;
}

// A copy of `base` (elements of `element_size` bytes) with each element changed with
// probability `density` (exactly every element when density >= 1), the change never a no-op.
inline Bytes Mutate(const Bytes& base, size_t element_size, double density, Change change,
                    uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  Bytes target = base;
  const uint64_t n = base.size() / element_size;
  const uint64_t lane_mask =
      element_size == 8 ? ~uint64_t{0} : (uint64_t{1} << (8 * element_size)) - 1;
  for (uint64_t i = 0; i < n; ++i) {
    if (density < 1.0 && unit(rng) >= density) continue;
    uint64_t value = 0;
    std::memcpy(&value, &target[i * element_size], element_size);
    uint64_t next = value;
    Change kind = change;
    if (kind == Change::kMixed) {
      const double r = unit(rng);
      kind = r < 0.9 ? Change::kUlp : Change::kLarge;
      if (r >= 0.9 && r < 0.97) next = value + 2 + (rng() % 30);  // small, above one ulp
    }
    if (next == value) {
      if (kind == Change::kUlp) {
        next = (rng() & 1) ? value + 1 : value - 1;
      } else {
        next = rng();
      }
    }
    next &= lane_mask;
    if (next == value) next = (value ^ 1) & lane_mask;
    std::memcpy(&target[i * element_size], &next, element_size);
  }
  return target;
}

inline uint64_t CountChanged(const Bytes& a, const Bytes& b, size_t element_size) {
  uint64_t changed = 0;
  for (uint64_t i = 0; i < a.size(); i += element_size) {
    changed += std::memcmp(&a[i], &b[i], element_size) != 0 ? 1 : 0;
  }
  return changed;
}

// Layout constants from FORMAT.md, so tests can edit a delta as a forger would.
inline constexpr uint64_t kTestFixedHeader = 32;
inline constexpr uint64_t kTestEntryBytes = 32;

inline uint64_t LoadU64(const uint8_t* at) {
  uint64_t v;
  std::memcpy(&v, at, 8);
  return v;
}
inline void StoreU64(uint8_t* at, uint64_t v) { std::memcpy(at, &v, 8); }

// Recomputes every payload checksum and the header checksum of `delta` after a test edited it.
inline void Reseal(Bytes& delta) {
  uint32_t num_chunks;
  std::memcpy(&num_chunks, &delta[24], 4);
  const uint64_t header = kTestFixedHeader + kTestEntryBytes * num_chunks + 8;
  if (header > delta.size()) return;
  uint64_t offset = header;
  for (uint32_t c = 0; c < num_chunks; ++c) {
    uint8_t* entry = &delta[kTestFixedHeader + kTestEntryBytes * c];
    const uint64_t size = LoadU64(entry);
    if (offset > delta.size() || size > delta.size() - offset) break;  // a forged size
    StoreU64(entry + 16, XXH3_64bits(&delta[offset], size));
    offset += size;
  }
  StoreU64(&delta[header - 8], XXH3_64bits(delta.data(), header - 8));
}

inline bool IsDirectory(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

inline std::optional<Bytes> ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  return Bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

using ::refit::testing::FindSharedDir;
using ::refit::testing::SharedDirOrSkip;

}  // namespace refit::delta::testing
