// The CPU kernels against references written independently here (byte-by-byte loops), on
// random buffers and on the shared real weight versions; there, change detection must also
// agree with the delta codec's count, and diffs scattered onto the base must give the target.

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "catch2/catch.hpp"
#include "cuda/kernels.h"
#include "cuda/kernels_testing.h"
#include "daemon/delta/delta.h"
#include "daemon/plan/dtype_convert.h"

namespace refit::cuda {
namespace {

using testing::Bytes;
using testing::ElementValue;

std::vector<uint64_t> ReferenceChanges(const uint8_t* base, const uint8_t* target, uint64_t n,
                                       uint64_t element_size) {
  std::vector<uint64_t> positions;
  for (uint64_t i = 0; i < n; ++i) {
    if (ElementValue(base, element_size, i) != ElementValue(target, element_size, i)) {
      positions.push_back(i);
    }
  }
  return positions;
}

// The changes between two buffers, found by the kernel with room for every position.
std::vector<uint64_t> Changes(const uint8_t* base, const uint8_t* target, uint64_t n,
                              uint64_t element_size) {
  std::vector<uint64_t> positions(n);
  auto count = cpu::FindChanges(base, target, n, element_size, positions.data(), n);
  REQUIRE(count.ok());
  positions.resize(*count);
  return positions;
}

TEST_CASE("FindChanges finds exactly the changed elements, in order", "[kernels][changes]") {
  for (const uint64_t element_size : {1, 2, 4, 8}) {
    for (const uint64_t n : {0, 1, 7, 31, 32, 33, 1000, 100003}) {
      for (const double density : {0.0, 0.002, 0.3, 1.0}) {
        // One byte past an aligned start, so no alignment is assumed.
        const Bytes base_storage = testing::RandomBytes(n * element_size + 1, n + element_size);
        const Bytes target_storage =
            testing::Mutate(base_storage, 1, density, 7 * n + element_size);
        const uint8_t* base = base_storage.data() + 1;
        const uint8_t* target = target_storage.data() + 1;
        INFO("element size " << element_size << ", " << n << " elements, density " << density);
        CHECK((Changes(base, target, n, element_size) ==
               ReferenceChanges(base, target, n, element_size)));
      }
    }
  }
}

TEST_CASE("FindChanges counts past its capacity and stores only what fits", "[kernels][changes]") {
  const Bytes base = testing::RandomBytes(4 * 5000, 1);
  const Bytes target = testing::Mutate(base, 4, 0.1, 2);
  const std::vector<uint64_t> all = ReferenceChanges(base.data(), target.data(), 5000, 4);
  REQUIRE(all.size() > 100);
  std::vector<uint64_t> positions(100 + 1, ~uint64_t{0});
  auto count = cpu::FindChanges(base.data(), target.data(), 5000, 4, positions.data(), 100);
  REQUIRE(count.ok());
  CHECK(*count == all.size());
  CHECK(std::equal(positions.begin(), positions.begin() + 100, all.begin()));
  CHECK(positions[100] == ~uint64_t{0});  // nothing written past the capacity
  CHECK(cpu::FindChanges(base.data(), target.data(), 5000, 4, nullptr, 0).value() == all.size());
}

TEST_CASE("kernels refuse element sizes other than 1, 2, 4, 8", "[kernels]") {
  uint8_t a[12] = {}, b[12] = {};
  uint64_t positions[4];
  for (const uint64_t size : {0, 3, 6, 16}) {
    CHECK_FALSE(IsKernelElementSize(size));
    CHECK(cpu::FindChanges(a, b, 1, size, positions, 4).status().code() ==
          absl::StatusCode::kInvalidArgument);
    CHECK(cpu::ScatterValues(a, size, positions, b, 0).code() ==
          absl::StatusCode::kInvalidArgument);
  }
}

TEST_CASE("gather and scatter of values and diffs invert each other", "[kernels][scatter]") {
  for (const uint64_t element_size : {1, 2, 4, 8}) {
    const uint64_t n = 20000;
    const Bytes base = testing::RandomBytes(n * element_size, element_size);
    const Bytes target = testing::Mutate(base, element_size, 0.05, 3 * element_size);
    const std::vector<uint64_t> positions = Changes(base.data(), target.data(), n, element_size);
    const uint64_t k = positions.size();
    REQUIRE(k > 0);
    const uint64_t mask =
        element_size == 8 ? ~uint64_t{0} : (uint64_t{1} << (8 * element_size)) - 1;
    INFO("element size " << element_size);

    Bytes diffs(k * element_size), values(k * element_size);
    REQUIRE(cpu::GatherDiffs(base.data(), target.data(), element_size, positions.data(), k,
                             diffs.data())
                .ok());
    REQUIRE(
        cpu::GatherValues(target.data(), element_size, positions.data(), k, values.data()).ok());
    for (uint64_t i = 0; i < k; ++i) {
      const uint64_t p = positions[i];
      const uint64_t expected_diff = (ElementValue(target.data(), element_size, p) -
                                      ElementValue(base.data(), element_size, p)) &
                                     mask;
      REQUIRE(ElementValue(diffs.data(), element_size, i) == expected_diff);
      REQUIRE(ElementValue(values.data(), element_size, i) ==
              ElementValue(target.data(), element_size, p));
    }

    Bytes patched = base;
    REQUIRE(
        cpu::ScatterAddDiffs(patched.data(), element_size, positions.data(), diffs.data(), k).ok());
    CHECK((patched == target));
    Bytes written = base;
    REQUIRE(
        cpu::ScatterValues(written.data(), element_size, positions.data(), values.data(), k).ok());
    CHECK((written == target));
  }
}

// The reference conversion: plan::ConvertRun one element at a time, at addresses computed here.
void ReferenceConvert(const uint8_t* src, DType from, uint8_t* dst, DType to,
                      const ElementRun& run) {
  const int64_t es = static_cast<int64_t>(DTypeSize(from)),
                ed = static_cast<int64_t>(DTypeSize(to));
  for (uint64_t r = 0; r < run.rows; ++r) {
    for (uint64_t c = 0; c < run.count; ++c) {
      const int64_t ri = static_cast<int64_t>(r), ci = static_cast<int64_t>(c);
      plan::ConvertRun(src + (ri * run.src_row_stride + ci * run.src_stride) * es, from, 1,
                       dst + (ri * run.dst_row_stride + ci * run.dst_stride) * ed, to, 1, 1);
    }
  }
}

TEST_CASE("Convert matches element-wise plan::ConvertRun on 2-D strided runs",
          "[kernels][convert]") {
  const DType floats[] = {DType::kBF16, DType::kFP16, DType::kFP32, DType::kFP8E4M3,
                          DType::kFP8E5M2};
  const ElementRun runs[] = {
      {1000, 1, 1, 1, 0, 0},   // contiguous
      {37, 11, 1, 1, 40, 37},  // rows with a source pitch
      {25, 9, 3, 2, 80, 55},   // strided on both sides
      {16, 8, 1, 8, 16, 1},    // a transpose-like scatter
  };
  for (const DType from : floats) {
    for (const DType to : floats) {
      for (const ElementRun& run : runs) {
        const uint64_t src_bytes = 8 * 4 * 2000, dst_bytes = 8 * 4 * 2000;
        const Bytes src = testing::RandomBytes(
            src_bytes, static_cast<uint64_t>(from) * 10 + static_cast<uint64_t>(to));
        Bytes got(dst_bytes, 0xa5), want(dst_bytes, 0xa5);
        REQUIRE(cpu::Convert(src.data(), from, got.data(), to, run).ok());
        ReferenceConvert(src.data(), from, want.data(), to, run);
        INFO(DTypeName(from) << " -> " << DTypeName(to) << ", " << run.count << " x " << run.rows);
        CHECK((got == want));
      }
    }
  }
}

TEST_CASE("Convert copies any dtype to itself and refuses other pairs", "[kernels][convert]") {
  const Bytes src = testing::RandomBytes(64 * 8, 5);
  Bytes dst(64 * 8, 0);
  REQUIRE(
      cpu::Convert(src.data(), DType::kINT64, dst.data(), DType::kINT64, {64, 1, 1, 1, 0, 0}).ok());
  CHECK((dst == src));
  CHECK(
      cpu::Convert(src.data(), DType::kINT8, dst.data(), DType::kFP32, {4, 1, 1, 1, 0, 0}).code() ==
      absl::StatusCode::kInvalidArgument);
}

TEST_CASE("Copy2D copies pitched rows and nothing between them", "[kernels][copy]") {
  const Bytes src = testing::RandomBytes(10 * 100, 9);
  Bytes dst(10 * 128, 0);
  cpu::Copy2D(dst.data(), 128, src.data(), 100, 60, 10);
  for (uint64_t r = 0; r < 10; ++r) {
    for (uint64_t b = 0; b < 128; ++b) {
      REQUIRE(dst[r * 128 + b] == (b < 60 ? src[r * 100 + b] : 0));
    }
  }
}

TEST_CASE("real weight versions: changes agree with the delta codec and diffs apply",
          "[kernels][real]") {
  for (const std::string folder : {"tiny-llama-lr1e-6", "tiny-llama-lr1e-5"}) {
    const std::vector<Bytes> versions = testing::LoadDeltaVersions(folder);
    if (versions.empty()) return;  // no shared data: skipped, with a WARN (SharedDirOrSkip)
    for (const Bytes& v : versions) REQUIRE(v.size() == 6066688);
    const uint64_t n = versions[0].size() / 2;
    for (int step = 0; step < 3; ++step) {
      const Bytes& base = versions[step];
      const Bytes& target = versions[step + 1];
      INFO(folder << " step " << step);
      const std::vector<uint64_t> positions = Changes(base.data(), target.data(), n, 2);
      CHECK((positions == ReferenceChanges(base.data(), target.data(), n, 2)));
      // 0.4 % - 3 % of the elements change per step (data/deltas/README.md).
      CHECK(positions.size() > n / 1000);
      CHECK(positions.size() < n / 10);

      auto delta = delta::Encode(base.data(), target.data(), base.size(), DType::kBF16);
      REQUIRE(delta.ok());
      auto index = delta::ParseIndex(delta->data(), delta->size());
      REQUIRE(index.ok());
      CHECK(index->changed() == positions.size());

      Bytes diffs(positions.size() * 2);
      REQUIRE(cpu::GatherDiffs(base.data(), target.data(), 2, positions.data(), positions.size(),
                               diffs.data())
                  .ok());
      Bytes patched = base;
      REQUIRE(
          cpu::ScatterAddDiffs(patched.data(), 2, positions.data(), diffs.data(), positions.size())
              .ok());
      CHECK((patched == target));
      Bytes applied = base;
      REQUIRE(delta::Apply(delta->data(), delta->size(), applied.data(), applied.size()).ok());
      CHECK((applied == patched));
    }
  }
}

TEST_CASE("ScatterRuns writes each run's new bytes and nothing else", "[changes]") {
  // Random runs against a byte-by-byte reference.
  for (const uint64_t seed : {1, 2, 3}) {
    const uint64_t n = (3 << 20) + 11;
    const testing::ChangeRunsForTest c = testing::RandomRuns(n, seed);
    REQUIRE(c.runs.size() > 10);
    const Bytes before = testing::RandomBytes(n, seed + 100);
    Bytes want = before;
    for (const ByteRun& r : c.runs) {
      for (uint64_t k = 0; k < r.bytes; ++k) want[r.dst_offset + k] = c.values[r.value_offset + k];
    }
    Bytes got = before;
    cpu::ScatterRuns(got.data(), c.runs.data(), c.runs.size(), c.values.data());
    CHECK((got == want));
  }
  // A change list from a diff (the runs of bytes that differ, their new bytes packed) takes the
  // base to the target.
  const Bytes base = testing::RandomBytes(1 << 20, 7);
  const Bytes target = testing::Mutate(base, 2, 0.004, 8);
  std::vector<ByteRun> runs;
  Bytes values;
  for (uint64_t i = 0; i < base.size();) {
    if (base[i] == target[i]) {
      ++i;
      continue;
    }
    ByteRun r{i, values.size(), 0};
    for (; i < base.size() && base[i] != target[i]; ++i, ++r.bytes) values.push_back(target[i]);
    runs.push_back(r);
  }
  REQUIRE(runs.size() > 1000);
  Bytes patched = base;
  cpu::ScatterRuns(patched.data(), runs.data(), runs.size(), values.data());
  CHECK((patched == target));
  cpu::ScatterRuns(patched.data(), runs.data(), 0, values.data());  // no runs: nothing
  CHECK((patched == target));
}

TEST_CASE("GatherRuns reads each run's bytes into its place and nothing else", "[changes]") {
  for (const uint64_t seed : {4, 5}) {
    const uint64_t n = (3 << 20) + 7;
    const testing::ChangeRunsForTest c = testing::RandomRuns(n, seed);
    REQUIRE(c.runs.size() > 10);
    const Bytes src = testing::RandomBytes(n, seed + 10);
    const Bytes before = testing::RandomBytes(c.values.size(), seed + 20);
    Bytes want = before;
    for (const ByteRun& r : c.runs) {
      for (uint64_t k = 0; k < r.bytes; ++k) want[r.value_offset + k] = src[r.dst_offset + k];
    }
    Bytes got = before;
    cpu::GatherRuns(got.data(), c.runs.data(), c.runs.size(), src.data());
    CHECK((got == want));
    // Gathered from where they were scattered, the values come back.
    Bytes dst = src;
    cpu::ScatterRuns(dst.data(), c.runs.data(), c.runs.size(), c.values.data());
    Bytes back = c.values;
    std::fill(back.begin(), back.end(), 0);
    cpu::GatherRuns(back.data(), c.runs.data(), c.runs.size(), dst.data());
    bool same = true;
    for (const ByteRun& r : c.runs) {
      same =
          same && std::equal(back.begin() + r.value_offset, back.begin() + r.value_offset + r.bytes,
                             c.values.begin() + r.value_offset);
    }
    CHECK(same);
  }
}

}  // namespace
}  // namespace refit::cuda
