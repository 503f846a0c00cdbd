#pragma once

// Test helpers for //cuda: random buffers with sparse changes, the shared real-data versions,
// and regions backed by host memory that can pose as CUDA memory (for the transfer logic's
// tests, which run without a GPU). Test-only; not thread-safe.

#include <limits.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "cuda/byte_run.h"
#include "daemon/memory/region.h"
#include "tests/testing/shared_data.h"

namespace refit::cuda::testing {

using Bytes = std::vector<uint8_t>;

inline Bytes RandomBytes(uint64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  Bytes bytes(n);
  for (auto& b : bytes) b = static_cast<uint8_t>(rng());
  return bytes;
}

// A copy of `base` with each element (of `element_size` bytes) changed with probability
// `density`: one random byte of it gets a random nonzero XOR.
inline Bytes Mutate(const Bytes& base, uint64_t element_size, double density, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::bernoulli_distribution change(density);
  Bytes target = base;
  for (uint64_t i = 0; i + element_size <= base.size(); i += element_size) {
    if (!change(rng)) continue;
    target[i + rng() % element_size] ^= static_cast<uint8_t>(1 + rng() % 255);
  }
  return target;
}

// A change list placed in a destination of `dst_bytes` bytes: runs that don't overlap, of
// awkward lengths (0 to over 1 MiB; what fits), at random gaps, their new bytes packed into
// `values` with 0-7 bytes of padding before each (so that some share the destination's
// alignment and some don't).
struct ChangeRunsForTest {
  std::vector<ByteRun> runs;
  Bytes values;
};
inline ChangeRunsForTest RandomRuns(uint64_t dst_bytes, uint64_t seed) {
  std::mt19937_64 rng(seed);
  const uint64_t lengths[] = {0,  1,  2,  3,  7,  8,   9,    15,
                              16, 17, 63, 64, 65, 255, 4097, (1 << 20) + 5};
  ChangeRunsForTest out;
  uint64_t at = rng() % 13;
  while (at < dst_bytes) {
    uint64_t n = lengths[rng() % (sizeof(lengths) / sizeof(lengths[0]))];
    if (at + n > dst_bytes) n = (dst_bytes - at) / 2;
    const uint64_t pad = rng() % 8;
    out.runs.push_back({at, out.values.size() + pad, n});
    for (uint64_t k = 0; k < pad + n; ++k) out.values.push_back(static_cast<uint8_t>(rng()));
    at += n + rng() % 300;
  }
  return out;
}

// Element i of a little-endian buffer as an integer, assembled byte by byte.
inline uint64_t ElementValue(const uint8_t* data, uint64_t element_size, uint64_t i) {
  uint64_t value = 0;
  for (uint64_t b = 0; b < element_size; ++b) {
    value |= static_cast<uint64_t>(data[i * element_size + b]) << (8 * b);
  }
  return value;
}

inline bool IsDirectory(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

inline Bytes ReadFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return {};
  return Bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

using ::refit::testing::FindSharedDir;

// v000.bin .. v003.bin of a data/deltas folder ("tiny-llama-lr1e-6"); empty (after a WARN)
// when the shared directory is missing and REFIT_SHARED_DIR unset, a test failure when it is set
// (SharedDirOrSkip). A present directory with missing files gives short/empty entries, which
// the caller's size checks catch.
inline std::vector<Bytes> LoadDeltaVersions(const std::string& folder) {
  const std::string shared = ::refit::testing::SharedDirOrSkip("the real-data kernel checks");
  if (shared.empty()) return {};
  std::vector<Bytes> versions;
  for (int i = 0; i < 4; ++i) {
    versions.push_back(ReadFile(absl::StrCat(shared, "/data/deltas/", folder, "/v00", i, ".bin")));
  }
  return versions;
}

// Host memory that says it is `kind` memory on `device`: lets the transfer logic be tested
// with "devices" the CPU can read.
class HostBackedRegion final : public Region {
 public:
  HostBackedRegion(MemoryKind kind, int device, uint64_t size)
      : Region(kind, device, Allocate(size), size) {}
  ~HostBackedRegion() override { std::free(data()); }
  std::string Describe() const override {
    return absl::StrCat("test ", MemoryKindName(kind()), " region of ", size(), " bytes");
  }

 private:
  static uint8_t* Allocate(uint64_t size) {
    return static_cast<uint8_t*>(std::calloc(size == 0 ? 1 : size, 1));
  }
};

}  // namespace refit::cuda::testing
