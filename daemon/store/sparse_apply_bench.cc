// Sparse vs full Apply through the store, RL-like delta steps (docs/benchmarks.md):
//   bazel run -c opt //daemon/store:sparse_apply_bench -- [--mib=1024] [--shares=0.004,0.01]
//       [--reps=3] [--destination=host-runs|host|gpu] [--prepare=1|0]
// host-runs (default): host destinations through the run-list sparse Apply (what GPU
// destinations take) with the host RunWriter, the collection's wall and CPU time printed by the
// store's debug line ("collected ... ms (... ms CPU)"); host: the host sparse Apply; gpu: GPU
// destinations (--config=cuda and a GPU; the GPU bundle's `sparse-bench` step). Each line: the
// sparse Apply of a version that changed `share` of its bf16 words from host slots, beside the
// full Apply of the same version into a second destination of the same layout (the copy it
// replaces), medians of --reps versions. The cost model is off (sparse whenever it applies);
// the line says which it would have chosen. --prepare=1 (default): the writes are collected as
// each version completes (StoreOptions::prepare_sparse), and the bench waits for that before it
// times the Apply, as an engine generating meanwhile would; the line gives the collection's time
// too. --prepare=0: collected inside the Apply.

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "cuda/cuda.h"
#include "cuda/run_writer.h"
#include "daemon/common/logging.h"
#include "daemon/store/store.h"

namespace refit {
namespace {

using std::chrono::milliseconds;

class HostWriters final : public cuda::RunWriters {
 public:
  absl::StatusOr<std::unique_ptr<cuda::RunWriter>> Open(const Region& dst) override {
    return cuda::OpenHostRunWriter(dst);
  }
};

// Another registration of the same memory (the full Apply's destination, registered anew for
// each version so that it holds nothing known).
class Borrowed final : public Region {
 public:
  explicit Borrowed(std::shared_ptr<Region> region)
      : Region(region->kind(), region->device(), region->data(), region->size()),
        region_(std::move(region)) {}
  std::string Describe() const override { return "borrowed " + region_->Describe(); }

 private:
  std::shared_ptr<Region> region_;
};

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

int Run(int argc, char** argv) {
  uint64_t mib = 1024, reps = 3, prepare = 1;
  std::vector<double> shares = {0.004, 0.01};
  std::string destination = "host-runs";
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--mib=", 0) == 0 && absl::SimpleAtoi(arg.substr(6), &mib)) continue;
    if (arg.rfind("--reps=", 0) == 0 && absl::SimpleAtoi(arg.substr(7), &reps)) continue;
    if (arg.rfind("--prepare=", 0) == 0 && absl::SimpleAtoi(arg.substr(10), &prepare)) continue;
    if (arg.rfind("--destination=", 0) == 0) {
      destination = arg.substr(14);
      continue;
    }
    if (arg.rfind("--shares=", 0) == 0) {
      shares.clear();
      for (absl::string_view s : absl::StrSplit(arg.substr(9), ',')) {
        double share = 0;
        if (absl::SimpleAtod(s, &share)) shares.push_back(share);
      }
      continue;
    }
    std::fprintf(stderr, "sparse_apply_bench: unknown argument %s\n", arg.c_str());
    return 2;
  }
  const bool gpu = destination == "gpu";
  if (destination != "gpu" && destination != "host" && destination != "host-runs") {
    std::fprintf(stderr, "sparse_apply_bench: --destination=host-runs|host|gpu\n");
    return 2;
  }
  std::printf("sparse Apply bench: %s; %s\n", destination.c_str(), cuda::Describe().c_str());
  if (gpu && cuda::DeviceCount() == 0) {
    std::printf("  no GPU: nothing measured\n");
    return 1;
  }
  Logger("store")->set_level(spdlog::level::debug);
  HostWriters writers;
  Metrics metrics;
  StoreOptions options;
  options.retain = 2;
  options.node = "bench";
  options.max_spare_slot_bytes = 0;
  options.sparse_bytes_per_run = 0;
  options.gpu_sparse_bytes_per_run = 0;
  options.sparse_prepared_bytes_per_run = 0;
  options.gpu_sparse_prepared_bytes_per_run = 0;
  options.prepare_sparse = prepare != 0;
  if (destination == "host-runs") options.sparse_run_writers = &writers;
  Store store(options, &metrics);
  // 64 bf16 tensors [rows, 4096], `mib` MiB in all; the destinations hold the same layout.
  constexpr int kTensors = 64;
  const uint64_t bytes = mib << 20, rows = bytes / kTensors / 8192;
  std::vector<TensorSlice> layout;
  for (int t = 0; t < kTensors; ++t) {
    TensorSlice s;
    s.name = "w" + std::to_string(t);
    s.dtype = DType::kBF16;
    s.global_shape = {static_cast<int64_t>(rows), 4096};
    s.buffer_offset = static_cast<uint64_t>(t) * rows * 8192;
    layout.push_back(s);
  }
  const uint64_t total = static_cast<uint64_t>(kTensors) * rows * 8192;
  auto src = AllocateHost(total);
  if (!src.ok()) return 1;
  uint8_t* data = (*src)->data();
  std::mt19937_64 rng(1);
  for (uint64_t i = 0; i < total; i += 8) {
    const uint64_t word = rng() & 0x3f3f3f3f3f3f3f3full;  // no NaNs
    std::memcpy(data + i, &word, 8);
  }
  auto dest = [&]() -> absl::StatusOr<std::unique_ptr<Region>> {
    if (gpu) return cuda::AllocateDevice(total, 0);
    return AllocateHost(total);
  };
  auto src_id = store.RegisterBuffer("m", Role::kSource, std::move(src).value(), layout, "t");
  auto d_region = dest();
  auto f_region = dest();
  if (!src_id.ok() || !d_region.ok() || !f_region.ok()) {
    std::printf("  setup failed\n");
    return 1;
  }
  auto d_id =
      store.RegisterBuffer("m", Role::kDestination, std::move(d_region).value(), layout, "e");
  if (!d_id.ok()) return 1;
  uint64_t version = 1;
  auto publish = [&]() {
    return store.Publish("m", version, {*src_id}).ok() &&
           store.WaitForVersion("m", version, Clock::now() + milliseconds(60000), nullptr).ok();
  };
  if (!publish() || !store.Apply("m", version, {*d_id}).ok()) return 1;
  std::shared_ptr<Region> full_region = std::move(f_region).value();
  const uint64_t words = total / 2;
  for (const double share : shares) {
    std::vector<double> sparse_ms, full_ms, prepare_ms;
    uint64_t written = 0;
    for (uint64_t r = 0; r < reps; ++r) {
      ++version;
      const uint64_t flips = static_cast<uint64_t>(share * static_cast<double>(words));
      for (uint64_t k = 0; k < flips; ++k) data[(rng() % words) * 2] ^= 1;
      if (!publish()) return 1;
      auto t_ready = Clock::now();
      auto prepared = store.WaitForSparsePrepared("m", version, t_ready + milliseconds(60000));
      if (!prepared.ok()) return 1;
      if (prepare) {
        prepare_ms.push_back(
            std::chrono::duration<double, std::milli>(Clock::now() - t_ready).count());
      }
      auto t0 = Clock::now();
      auto applied = store.Apply("m", version, {*d_id});
      auto t1 = Clock::now();
      if (!applied.ok() || !applied->sparse || applied->prepared != (prepare != 0)) {
        std::printf("  version %llu: %s\n", static_cast<unsigned long long>(version),
                    !applied.ok()       ? applied.status().ToString().c_str()
                    : !applied->sparse  ? "not sparse"
                    : applied->prepared ? "prepared (not asked)"
                                        : "not prepared");
        return 1;
      }
      written = applied->bytes_written;
      sparse_ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
      // The full Apply it replaces: the same version into a buffer that holds nothing known.
      std::unique_ptr<Region> borrowed(new Borrowed(full_region));
      auto f_id = store.RegisterBuffer("m", Role::kDestination, std::move(borrowed), layout, "f");
      if (!f_id.ok()) return 1;
      t0 = Clock::now();
      auto full = store.Apply("m", version, {*f_id});
      t1 = Clock::now();
      if (!full.ok() || full->sparse || !store.ReleaseBuffer(*f_id).ok()) return 1;
      full_ms.push_back(std::chrono::duration<double, std::milli>(t1 - t0).count());
    }
    std::printf(
        "  %llu MiB bf16, %.1f %% of words changed: sparse Apply %.2f ms (%llu bytes written; %s), "
        "full Apply %.2f ms: sparse / full = %.3f\n",
        static_cast<unsigned long long>(total >> 20), share * 100, Median(sparse_ms),
        static_cast<unsigned long long>(written),
        prepare ? absl::StrCat("prepared as the version completed, waited ",
                               absl::SixDigits(Median(prepare_ms)), " ms for it after")
                      .c_str()
                : "collected inside the Apply",
        Median(full_ms), Median(sparse_ms) / std::max(1e-9, Median(full_ms)));
  }
  return 0;
}

}  // namespace
}  // namespace refit

int main(int argc, char** argv) { return refit::Run(argc, argv); }
