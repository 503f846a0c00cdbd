// Delta sync over real successive bf16 weight versions (shared/data/deltas, see its README):
// exact round trips along the version chain, partial application, and the compactness the
// daemon counts on. Needs the shared directory; tests/testing/shared_data.h says how it is found.

#include <cstdio>
#include <string>
#include <vector>

#include "catch2/catch.hpp"
#include "daemon/delta/delta.h"
#include "daemon/delta/delta_testing.h"

namespace refit::delta {
namespace {

using testing::Bytes;

struct Versions {
  std::string folder;
  std::vector<Bytes> v;  // v000 .. v003
};

// Loads one folder's versions; fails the test when the shared directory exists but the data is
// missing or damaged, or REFIT_SHARED_DIR names a directory without it (only a missing shared
// directory without REFIT_SHARED_DIR is skipped, loudly).
bool LoadVersions(const std::string& folder, Versions& out) {
  const std::string shared = testing::SharedDirOrSkip("the real-data delta tests");
  if (shared.empty()) return false;
  out.folder = folder;
  for (int i = 0; i < 4; ++i) {
    const std::string path =
        shared + "/data/deltas/" + folder + "/v00" + std::to_string(i) + ".bin";
    auto bytes = testing::ReadFile(path);
    INFO(path);
    REQUIRE(bytes.has_value());
    REQUIRE(bytes->size() == 6066688);
    out.v.push_back(std::move(*bytes));
  }
  return true;
}

TEST_CASE("real versions round-trip exactly along the chain v000 -> v003", "[delta][real]") {
  for (const std::string folder : {"tiny-llama-lr1e-6", "tiny-llama-lr1e-5"}) {
    Versions versions;
    if (!LoadVersions(folder, versions)) return;
    Bytes work = versions.v[0];
    for (int step = 0; step < 3; ++step) {
      const Bytes& base = versions.v[step];
      const Bytes& target = versions.v[step + 1];
      auto delta = Encode(base.data(), target.data(), base.size(), DType::kBF16);
      REQUIRE(delta.ok());
      auto index = ParseIndex(delta->data(), delta->size());
      REQUIRE(index.ok());
      CHECK(index->changed() == testing::CountChanged(base, target, 2));
      INFO(folder << " step " << step);
      const absl::Status status = Apply(delta->data(), delta->size(), work.data(), work.size());
      INFO(status.ToString());
      REQUIRE(status.ok());
      REQUIRE((work == target));
      // The delta of one step does not apply to another version.
      if (step > 0) {
        Bytes other = versions.v[step - 1];
        CHECK(Apply(delta->data(), delta->size(), other.data(), other.size()).code() ==
              absl::StatusCode::kFailedPrecondition);
        CHECK((other == versions.v[step - 1]));
      }
    }
  }
}

TEST_CASE("real lr 1e-6 deltas are >= 250x smaller than full and >= 3x than 6 B/change",
          "[delta][real]") {
  Versions versions;
  if (!LoadVersions("tiny-llama-lr1e-6", versions)) return;
  for (int step = 0; step < 3; ++step) {
    const Bytes& base = versions.v[step];
    const Bytes& target = versions.v[step + 1];
    auto delta = Encode(base.data(), target.data(), base.size(), DType::kBF16);
    REQUIRE(delta.ok());
    const double changed = static_cast<double>(testing::CountChanged(base, target, 2));
    const double size = static_cast<double>(delta->size());
    INFO("step " << step << ": " << delta->size() << " bytes for " << changed << " changes");
    CHECK(static_cast<double>(base.size()) / size >= 250.0);
    CHECK(6.0 * changed / size >= 3.0);
  }
}

TEST_CASE("real data: chunks for a tensor range apply on their own", "[delta][real]") {
  Versions versions;
  if (!LoadVersions("tiny-llama-lr1e-5", versions)) return;
  const Bytes& base = versions.v[1];
  const Bytes& target = versions.v[2];
  EncodeOptions options;
  options.chunk_elements = 1 << 16;
  auto delta = Encode(base.data(), target.data(), base.size(), DType::kBF16, options);
  REQUIRE(delta.ok());
  auto index = ParseIndex(delta->data(), delta->size());
  REQUIRE(index.ok());
  // model.layers.1.* lies somewhere in the middle; any element range works the same way.
  const uint64_t first = 1000000, count = 300000;
  Bytes work = base;
  uint64_t fetched = index->header_size;
  for (const size_t c : ChunksOverlapping(*index, first, count)) {
    const ChunkInfo& info = index->chunks[c];
    fetched += info.encoded_size;
    REQUIRE(ApplyChunk(*index, c, delta->data() + info.encoded_offset, info.encoded_size,
                       work.data(), work.size())
                .ok());
  }
  for (uint64_t i = first; i < first + count; ++i) {
    if (work[2 * i] != target[2 * i] || work[2 * i + 1] != target[2 * i + 1]) {
      FAIL("element " << i << " was not updated");
    }
  }
  CHECK(fetched < delta->size() / 2);
}

}  // namespace
}  // namespace refit::delta
