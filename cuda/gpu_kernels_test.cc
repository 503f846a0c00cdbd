// The GPU kernels write exactly what the CPU kernels write (which cpu_kernels_test holds to
// independent references): random buffers of awkward sizes and alignments, every dtype pair
// on every 8/16-bit pattern, and the shared real weight versions. Needs a GPU (tags: gpu).

#include "cuda/gpu_kernels.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <random>
#include <vector>

#include "catch2/catch.hpp"
#include "cuda/gpu_testing.h"
#include "cuda/kernels.h"
#include "cuda/kernels_testing.h"

namespace refit::cuda {
namespace {

using testing::Bytes;
using testing::CheckCuda;
using testing::DeviceBuffer;

#define REQUIRE_GPU() REQUIRE(testing::HaveGpu())

Bytes Sync(const DeviceBuffer& buffer, uint64_t bytes, uint64_t offset = 0) {
  CheckCuda(cudaDeviceSynchronize(), "kernel");
  return buffer.Download(bytes, offset);
}

struct GpuChanges {
  uint64_t count = 0;
  std::vector<uint64_t> positions;  // the first min(count, capacity)
};

// gpu::FindChanges over the buffers' bytes at `offset` (to test alignment).
GpuChanges FindOnGpu(const Bytes& base, const Bytes& target, uint64_t offset, uint64_t n,
                     uint64_t element_size, uint64_t capacity) {
  DeviceBuffer b(base.size()), t(target.size());
  b.Upload(base.data(), base.size());
  t.Upload(target.data(), target.size());
  DeviceBuffer positions((capacity + 1) * 8), count(8);
  DeviceBuffer scratch(gpu::FindChangesScratchBytes(n, element_size));
  CheckCuda(cudaMemset(positions.get(), 0xff, (capacity + 1) * 8), "memset");
  CheckCuda(gpu::FindChanges(b.get() + offset, t.get() + offset, n, element_size,
                             reinterpret_cast<uint64_t*>(positions.get()), capacity,
                             reinterpret_cast<uint64_t*>(count.get()), scratch.get(), nullptr),
            "FindChanges");
  GpuChanges out;
  const Bytes count_bytes = Sync(count, 8);
  std::memcpy(&out.count, count_bytes.data(), 8);
  const Bytes raw = positions.Download((capacity + 1) * 8);
  out.positions.resize(std::min(out.count, capacity) + 1);
  std::memcpy(out.positions.data(), raw.data(), out.positions.size() * 8);
  // The slot after the last stored position must be untouched.
  CHECK(out.positions.back() == ~uint64_t{0});
  out.positions.pop_back();
  return out;
}

void CheckChanges(const Bytes& base, const Bytes& target, uint64_t offset, uint64_t n,
                  uint64_t element_size, uint64_t capacity) {
  std::vector<uint64_t> want(capacity);
  auto want_count = cpu::FindChanges(base.data() + offset, target.data() + offset, n, element_size,
                                     want.data(), capacity);
  REQUIRE(want_count.ok());
  want.resize(std::min(*want_count, capacity));
  const GpuChanges got = FindOnGpu(base, target, offset, n, element_size, capacity);
  CHECK(got.count == *want_count);
  CHECK((got.positions == want));
}

TEST_CASE("GPU FindChanges equals the CPU's", "[gpu][changes]") {
  REQUIRE_GPU();
  for (const uint64_t element_size : {1, 2, 4, 8}) {
    for (const uint64_t n : {0, 1, 7, 8, 9, 1023, 4096, 65537, (1 << 20) + 3, 1 << 23}) {
      for (const double density : {0.0, 0.001, 0.05, 1.0}) {
        if (n > (1 << 20) && density == 1.0) continue;  // dense and large: slow on the CPU side
        const Bytes base = testing::RandomBytes(n * element_size + 16, n ^ element_size);
        const Bytes target = testing::Mutate(base, 1, density, n + 3);
        for (const uint64_t offset : {uint64_t{0}, element_size, uint64_t{16}}) {
          INFO("element size " << element_size << ", n " << n << ", density " << density
                               << ", offset " << offset);
          CheckChanges(base, target, offset, n, element_size, n);
        }
      }
    }
  }
}

TEST_CASE("GPU FindChanges stops storing at capacity but counts everything", "[gpu][changes]") {
  REQUIRE_GPU();
  const uint64_t n = 1 << 20;
  const Bytes base = testing::RandomBytes(2 * n, 1);
  const Bytes target = testing::Mutate(base, 2, 0.02, 2);
  for (const uint64_t capacity : {0, 1, 1000, 20000}) {
    INFO("capacity " << capacity);
    CheckChanges(base, target, 0, n, 2, capacity);
  }
}

TEST_CASE("GPU gathers and scatters equal the CPU's", "[gpu][scatter]") {
  REQUIRE_GPU();
  for (const uint64_t element_size : {1, 2, 4, 8}) {
    const uint64_t n = 300001;
    const Bytes base = testing::RandomBytes(n * element_size, element_size);
    const Bytes target = testing::Mutate(base, element_size, 0.03, element_size + 1);
    std::vector<uint64_t> positions(n);
    const uint64_t k =
        cpu::FindChanges(base.data(), target.data(), n, element_size, positions.data(), n).value();
    positions.resize(k);
    Bytes diffs(k * element_size), values(k * element_size);
    REQUIRE(cpu::GatherDiffs(base.data(), target.data(), element_size, positions.data(), k,
                             diffs.data())
                .ok());
    REQUIRE(
        cpu::GatherValues(target.data(), element_size, positions.data(), k, values.data()).ok());

    // Offsets of one byte make every element access misaligned on the device.
    for (const uint64_t offset : {uint64_t{0}, uint64_t{1}}) {
      INFO("element size " << element_size << ", offset " << offset);
      DeviceBuffer b(base.size() + 1), t(target.size() + 1), p(k * 8 + 8);
      DeviceBuffer d(k * element_size + 1), v(k * element_size + 1);
      b.Upload(base.data(), base.size(), offset);
      t.Upload(target.data(), target.size(), offset);
      p.Upload(positions.data(), k * 8);
      const auto* pos = reinterpret_cast<const uint64_t*>(p.get());
      CheckCuda(gpu::GatherDiffs(b.get() + offset, t.get() + offset, element_size, pos, k,
                                 d.get() + offset, nullptr),
                "GatherDiffs");
      CheckCuda(
          gpu::GatherValues(t.get() + offset, element_size, pos, k, v.get() + offset, nullptr),
          "GatherValues");
      CHECK((Sync(d, k * element_size, offset) == diffs));
      CHECK((Sync(v, k * element_size, offset) == values));

      CheckCuda(
          gpu::ScatterAddDiffs(b.get() + offset, element_size, pos, d.get() + offset, k, nullptr),
          "ScatterAddDiffs");
      CHECK((Sync(b, base.size(), offset) == target));
      b.Upload(base.data(), base.size(), offset);
      CheckCuda(
          gpu::ScatterValues(b.get() + offset, element_size, pos, v.get() + offset, k, nullptr),
          "ScatterValues");
      CHECK((Sync(b, base.size(), offset) == target));
    }
  }
}

// Runs one conversion on both sides over `src` and compares every destination byte.
void CheckConvert(const Bytes& src, DType from, DType to, const ElementRun& run, uint64_t dst_bytes,
                  uint64_t offset) {
  Bytes want(dst_bytes + offset, 0x5a);
  REQUIRE(cpu::Convert(src.data() + offset, from, want.data() + offset, to, run).ok());
  DeviceBuffer s(src.size()), d(dst_bytes + offset);
  s.Upload(src.data(), src.size());
  CheckCuda(cudaMemset(d.get(), 0x5a, dst_bytes + offset), "memset");
  CheckCuda(gpu::Convert(s.get() + offset, static_cast<int>(from), d.get() + offset,
                         static_cast<int>(to), run.count, run.rows, run.src_stride, run.dst_stride,
                         run.src_row_stride, run.dst_row_stride, nullptr),
            "Convert");
  const Bytes got = Sync(d, dst_bytes + offset);
  uint64_t wrong = 0, first = 0;
  for (uint64_t i = 0; i < got.size(); ++i) {
    if (got[i] != want[i] && wrong++ == 0) first = i;
  }
  INFO(DTypeName(from) << " -> " << DTypeName(to) << ": " << wrong << " bytes differ, first at "
                       << first);
  CHECK(wrong == 0);
}

TEST_CASE("GPU conversion equals the CPU's for every dtype pair", "[gpu][convert]") {
  REQUIRE_GPU();
  const DType floats[] = {DType::kBF16, DType::kFP16, DType::kFP32, DType::kFP8E4M3,
                          DType::kFP8E5M2};
  for (const DType from : floats) {
    const uint64_t es = DTypeSize(from);
    // Every pattern of an 8/16-bit dtype; for fp32, random patterns plus every exponent.
    uint64_t n = es == 1 ? 256 : es == 2 ? 65536 : 1 << 22;
    Bytes src = testing::RandomBytes(n * es + 16, es);
    if (es <= 2) {
      for (uint64_t i = 0; i < n; ++i) std::memcpy(&src[i * es], &i, es);
    } else {
      for (uint32_t i = 0; i < 512; ++i) {
        const uint32_t bits = (i << 23) | (i * 2654435761u >> 9);
        std::memcpy(&src[i * 4], &bits, 4);
      }
    }
    for (const DType to : floats) {
      const uint64_t ed = DTypeSize(to);
      CheckConvert(src, from, to, {n, 1, 1, 1, 0, 0}, n * ed, 0);
      // Strided 2-D, and misaligned by one element's worth of bytes off a 16-byte boundary.
      const uint64_t count = n / 64, rows = 16;
      CheckConvert(
          src, from, to,
          {count, rows, 2, 3, static_cast<int64_t>(4 * count), static_cast<int64_t>(3 * count + 5)},
          ((rows - 1) * (3 * count + 5) + 3 * (count - 1) + 1) * ed, 0);
      CheckConvert(src, from, to, {count, 1, 1, 1, 0, 0}, count * ed, 1);
    }
  }
}

TEST_CASE("GPU plain copies: same-dtype runs and Copy2D", "[gpu][copy]") {
  REQUIRE_GPU();
  const Bytes src = testing::RandomBytes(1 << 20, 4);
  for (const DType dtype : {DType::kINT8, DType::kINT32, DType::kINT64, DType::kBF16}) {
    const uint64_t e = DTypeSize(dtype);
    CheckConvert(src, dtype, dtype, {1000, 7, 1, 1, 1100, 1003}, (6 * 1003 + 1000) * e, 0);
    CheckConvert(src, dtype, dtype, {500, 9, 3, 2, 1600, 1001}, (8 * 1001 + 999) * e, 0);
  }
  // Copy2D between host and device and on the device, pitched.
  DeviceBuffer d(1 << 20), e(1 << 20);
  CheckCuda(gpu::Copy2D(d.get(), 4096, src.data(), 3000, 2500, 200, nullptr), "H2D 2D");
  CheckCuda(gpu::Copy2D(e.get(), 2600, d.get(), 4096, 2500, 200, nullptr), "D2D 2D");
  Bytes back(200 * 2500);
  CheckCuda(gpu::Copy2D(back.data(), 2500, e.get(), 2600, 2500, 200, nullptr), "D2H 2D");
  CheckCuda(cudaDeviceSynchronize(), "sync");
  for (uint64_t r = 0; r < 200; ++r) {
    REQUIRE(std::equal(&back[r * 2500], &back[r * 2500] + 2500, &src[r * 3000]));
  }
}

TEST_CASE("GPU kernels on the real weight versions equal the CPU's", "[gpu][real]") {
  REQUIRE_GPU();
  int checked = 0;
  for (const std::string folder : {"tiny-llama-lr1e-6", "tiny-llama-lr1e-5"}) {
    std::vector<Bytes> versions = testing::LoadDeltaVersions(folder);
    if (versions.empty()) return;  // no shared data: skipped, with a WARN (SharedDirOrSkip)
    // The GPU bundle carries what fits its size limit: whole folders, or the first versions of
    // one (v000, v001, ...: a base and at least one step).
    if (!testing::IsDirectory(testing::FindSharedDir() + "/data/deltas/" + folder)) {
      WARN("data/deltas/" << folder << " is not in " << testing::FindSharedDir()
                          << ": SKIPPING its real-data checks");
      continue;
    }
    while (!versions.empty() && versions.back().empty()) versions.pop_back();
    REQUIRE(versions.size() >= 2);
    for (const Bytes& v : versions) REQUIRE(v.size() == 6066688);
    ++checked;
    WARN("real-data checks on data/deltas/" << folder << ": " << versions.size() << " versions, "
                                            << versions.size() - 1 << " steps");
    const uint64_t n = versions[0].size() / 2;
    for (size_t step = 0; step + 1 < versions.size(); ++step) {
      INFO(folder << " step " << step);
      const Bytes& base = versions[step];
      const Bytes& target = versions[step + 1];
      CheckChanges(base, target, 0, n, 2, n);
      const GpuChanges changes = FindOnGpu(base, target, 0, n, 2, n);
      const uint64_t k = changes.count;
      DeviceBuffer b(base.size()), t(target.size()), p(k * 8), d(k * 2);
      b.Upload(base.data(), base.size());
      t.Upload(target.data(), target.size());
      p.Upload(changes.positions.data(), k * 8);
      const auto* pos = reinterpret_cast<const uint64_t*>(p.get());
      CheckCuda(gpu::GatherDiffs(b.get(), t.get(), 2, pos, k, d.get(), nullptr), "GatherDiffs");
      Bytes want_diffs(k * 2);
      REQUIRE(cpu::GatherDiffs(base.data(), target.data(), 2, changes.positions.data(), k,
                               want_diffs.data())
                  .ok());
      CHECK((Sync(d, k * 2) == want_diffs));
      CheckCuda(gpu::ScatterAddDiffs(b.get(), 2, pos, d.get(), k, nullptr), "ScatterAddDiffs");
      CHECK((Sync(b, base.size()) == target));
      // The weights converted to fp8 and fp32 on the GPU, as an engine would receive them.
      for (const DType to : {DType::kFP8E4M3, DType::kFP8E5M2, DType::kFP32, DType::kFP16}) {
        CheckConvert(target, DType::kBF16, to, {n, 1, 1, 1, 0, 0}, n * DTypeSize(to), 0);
      }
    }
  }
  CHECK(checked > 0);
}

TEST_CASE("GPU ScatterRuns equals the CPU's", "[gpu][changes]") {
  REQUIRE_GPU();
  // Destinations at offsets 0 and 3 (aligned and not), runs of awkward lengths whose values are
  // sometimes aligned like their destination and sometimes not.
  for (const uint64_t seed : {11, 12, 13}) {
    for (const uint64_t offset : {0, 3}) {
      INFO("seed " << seed << " offset " << offset);
      const uint64_t n = (5 << 20) + 17;
      const testing::ChangeRunsForTest c = testing::RandomRuns(n, seed);
      REQUIRE(c.runs.size() > 10);
      const Bytes before = testing::RandomBytes(n + offset, seed + 100);
      Bytes want = before;
      cpu::ScatterRuns(want.data() + offset, c.runs.data(), c.runs.size(), c.values.data());
      DeviceBuffer dst(n + offset), runs(c.runs.size() * sizeof(ByteRun) + 1),
          values(c.values.size() + 1);
      dst.Upload(before.data(), before.size());
      runs.Upload(c.runs.data(), c.runs.size() * sizeof(ByteRun));
      values.Upload(c.values.data(), c.values.size());
      CheckCuda(gpu::ScatterRuns(dst.get() + offset, reinterpret_cast<const ByteRun*>(runs.get()),
                                 c.runs.size(), values.get(), nullptr),
                "ScatterRuns");
      CHECK((Sync(dst, n + offset) == want));
      // No runs: nothing written, no error.
      CheckCuda(gpu::ScatterRuns(dst.get(), nullptr, 0, values.get(), nullptr), "ScatterRuns 0");
      CHECK((Sync(dst, n + offset) == want));
    }
  }
}

TEST_CASE("GPU GatherRuns equals the CPU's", "[gpu][changes]") {
  REQUIRE_GPU();
  // The inverse of ScatterRuns: a destination's bytes at the runs, packed at each run's value
  // offset (the bytes between them untouched), from aligned and unaligned destinations; the
  // bytes gathered after a scatter are the scattered values.
  for (const uint64_t seed : {21, 22, 23}) {
    for (const uint64_t offset : {0, 5}) {
      INFO("seed " << seed << " offset " << offset);
      const uint64_t n = (5 << 20) + 29;
      const testing::ChangeRunsForTest c = testing::RandomRuns(n, seed);
      REQUIRE(c.runs.size() > 10);
      const Bytes src = testing::RandomBytes(n + offset, seed + 200);
      const Bytes before = testing::RandomBytes(c.values.size(), seed + 300);
      Bytes want = before;
      cpu::GatherRuns(want.data(), c.runs.data(), c.runs.size(), src.data() + offset);
      REQUIRE(want != before);
      DeviceBuffer d_src(n + offset), runs(c.runs.size() * sizeof(ByteRun) + 1),
          values(c.values.size() + 1);
      d_src.Upload(src.data(), src.size());
      runs.Upload(c.runs.data(), c.runs.size() * sizeof(ByteRun));
      values.Upload(before.data(), before.size());
      const auto* d_runs = reinterpret_cast<const ByteRun*>(runs.get());
      CheckCuda(gpu::GatherRuns(values.get(), d_runs, c.runs.size(), d_src.get() + offset, nullptr),
                "GatherRuns");
      CHECK((Sync(values, c.values.size()) == want));
      CHECK((Sync(d_src, n + offset) == src));  // the source is only read
      // Scatter then gather: the values come back.
      values.Upload(c.values.data(), c.values.size());
      CheckCuda(
          gpu::ScatterRuns(d_src.get() + offset, d_runs, c.runs.size(), values.get(), nullptr),
          "ScatterRuns");
      DeviceBuffer back(c.values.size() + 1);
      back.Upload(c.values.data(), c.values.size());
      CheckCuda(gpu::GatherRuns(back.get(), d_runs, c.runs.size(), d_src.get() + offset, nullptr),
                "GatherRuns back");
      CHECK((Sync(back, c.values.size()) == c.values));
      // No runs: nothing written, no error.
      CheckCuda(gpu::GatherRuns(values.get(), nullptr, 0, d_src.get(), nullptr), "GatherRuns 0");
    }
  }
}

}  // namespace
}  // namespace refit::cuda
