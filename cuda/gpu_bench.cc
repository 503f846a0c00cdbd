// GPU figures, each next to a reference measured in the same run on the same bytes:
//   snapshot copy  cuda::Copy of an imported (IPC) trainer buffer into a GPU slot, and into a
//                  pinned host slot  ÷  cudaMemcpy of the same bytes (D2D, D2H pinned)
//   change detect  gpu::FindChanges (compare + compaction) of two bf16 versions
//                  ÷  a plain kernel that reads both and writes their XOR
//   conversion     gpu::Convert bf16 -> fp8 e4m3  ÷  the same read/write kernel
//   fp8 blocks     cuda::QuantizeFp8BlocksOnDevice (what GPU slots run: amax, scales, codes in
//                  [128, 128] blocks)  ÷  the same read/write kernel, and ÷ the CPU kernel
//                  (cpu::QuantizeFp8Blocks, one core) on the same bytes
//   IPC import     cuda::OpenIpc per buffer exported by another process (and the close)
// Medians of several runs. Usage: gpu_bench [--bytes=N] [--reps=N]
//   bazel run --config=cuda //cuda:gpu_bench

#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "cuda/cuda.h"
#include "cuda/gpu_kernels.h"
#include "cuda/gpu_testing.h"
#include "cuda/kernels_testing.h"

namespace refit::cuda {
namespace {

using testing::CheckCuda;
using testing::DeviceBuffer;

void CheckOk(const absl::Status& status, const char* what) {
  if (status.ok()) return;
  std::fprintf(stderr, "gpu_bench: %s: %s\n", what, status.ToString().c_str());
  std::exit(1);
}

double Seconds(const std::function<void()>& fn) {
  const auto start = std::chrono::steady_clock::now();
  fn();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double Median(const std::function<void()>& fn, int reps) {
  fn();  // warm-up
  std::vector<double> times;
  for (int i = 0; i < reps; ++i) times.push_back(Seconds(fn));
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

void Row(const char* what, uint64_t bytes, double seconds, double reference_seconds,
         const char* reference) {
  const double gbps = static_cast<double>(bytes) / seconds / 1e9;
  const double ref_gbps = static_cast<double>(bytes) / reference_seconds / 1e9;
  std::printf("  %-34s %9.1f GB/s   %-30s %9.1f GB/s   = %.2fx\n", what, gbps, reference, ref_gbps,
              reference_seconds / seconds);
}

// Fast fill (splitmix64): the bench's buffers are big, and only their change pattern matters.
void FillRandom(std::vector<uint8_t>& bytes, uint64_t seed) {
  uint64_t state = seed;
  for (size_t i = 0; i + 8 <= bytes.size(); i += 8) {
    uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    std::memcpy(&bytes[i], &z, 8);
  }
}

void BenchSnapshot(uint64_t bytes, int reps, const std::string& exporter_path) {
  std::printf("snapshot copy (Publish), %.2f GiB, device 0\n",
              static_cast<double>(bytes) / (1 << 30));
  testing::Exporter exporter(exporter_path, bytes, 0, 1);
  auto trainer = OpenIpc(exporter.handle(0), 0, 0, 0);
  auto gpu_slot = AllocateDevice(bytes, 0);
  auto host_slot = AllocatePinnedHost(bytes);
  if (!trainer.ok() || !gpu_slot.ok() || !host_slot.ok()) {
    std::printf("  setup failed: %s %s %s\n", trainer.status().ToString().c_str(),
                gpu_slot.status().ToString().c_str(), host_slot.status().ToString().c_str());
    return;
  }
  cudaStream_t stream;
  CheckCuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream");
  auto copy = [&](const Region& dst) {
    return Median([&] { CheckOk(Copy(dst, 0, **trainer, 0, bytes), "cuda::Copy"); }, reps);
  };
  auto memcpy_ref = [&](uint8_t* dst, cudaMemcpyKind kind) {
    return Median(
        [&] {
          CheckCuda(cudaMemcpyAsync(dst, (*trainer)->data(), bytes, kind, stream),
                    "cudaMemcpyAsync");
          CheckCuda(cudaStreamSynchronize(stream), "sync");
        },
        reps);
  };
  const double to_gpu = copy(**gpu_slot);
  const double to_gpu_ref = memcpy_ref((*gpu_slot)->data(), cudaMemcpyDeviceToDevice);
  Row("cuda::Copy ipc -> GPU slot", bytes, to_gpu, to_gpu_ref, "cudaMemcpy D2D");
  const double to_host = copy(**host_slot);
  const double to_host_ref = memcpy_ref((*host_slot)->data(), cudaMemcpyDeviceToHost);
  Row("cuda::Copy ipc -> pinned host slot", bytes, to_host, to_host_ref, "cudaMemcpy D2H pinned");
  auto pageable = AllocateHost(bytes);
  if (pageable.ok()) {
    const double to_pageable = copy(**pageable);
    Row("cuda::Copy ipc -> pageable host", bytes, to_pageable, to_host_ref,
        "cudaMemcpy D2H pinned");
  }
  CheckCuda(cudaStreamDestroy(stream), "stream");
}

void BenchKernels(uint64_t bytes, int reps) {
  const uint64_t n = bytes / 2;  // bf16 elements
  std::printf("change detection + compaction and conversion, %.2f GiB bf16 per version\n",
              static_cast<double>(bytes) / (1 << 30));
  std::vector<uint8_t> base(bytes);
  FillRandom(base, 1);
  DeviceBuffer b(bytes), t(bytes), out(bytes), positions(bytes * 4), count(8);
  DeviceBuffer scratch(gpu::FindChangesScratchBytes(n, 2));
  b.Upload(base.data(), bytes);
  t.Upload(base.data(), bytes);
  const double reference = Median(
      [&] {
        CheckCuda(gpu::ReadWriteReference(b.get(), t.get(), out.get(), bytes, nullptr),
                  "reference");
        CheckCuda(cudaDeviceSynchronize(), "sync");
      },
      reps);
  // Densities of real RL steps (data/deltas/README.md: 0.4 % at lr 1e-6, 3 % at 1e-5).
  for (const double density : {0.0, 0.004, 0.03, 0.3}) {
    std::vector<uint8_t> target = base;
    uint64_t state = 12345;
    const uint64_t changes = static_cast<uint64_t>(density * static_cast<double>(n));
    for (uint64_t c = 0; c < changes; ++c) {
      state = state * 6364136223846793005ull + 1442695040888963407ull;
      target[((state >> 17) % n) * 2] ^= 1;  // one ulp-ish flip, as training makes
    }
    t.Upload(target.data(), bytes);
    uint64_t found = 0;
    const double seconds = Median(
        [&] {
          CheckCuda(
              gpu::FindChanges(b.get(), t.get(), n, 2, reinterpret_cast<uint64_t*>(positions.get()),
                               n, reinterpret_cast<uint64_t*>(count.get()), scratch.get(), nullptr),
              "FindChanges");
          CheckCuda(cudaMemcpy(&found, count.get(), 8, cudaMemcpyDeviceToHost), "count");
        },
        reps);
    char what[64];
    std::snprintf(what, sizeof(what), "FindChanges %.1f%% changed", 100 * density);
    // GB/s of input read (both versions), for the kernel and the reference alike.
    Row(what, 2 * bytes, seconds, reference, "read 2 + write 1 kernel");
    std::printf("    (%llu changes found)\n", static_cast<unsigned long long>(found));
  }
  const double convert = Median(
      [&] {
        CheckCuda(gpu::Convert(b.get(), 1, out.get(), 4, n, 1, 1, 1, 0, 0, nullptr), "Convert");
        CheckCuda(cudaDeviceSynchronize(), "sync");
      },
      reps);
  // The conversion reads 2 bytes and writes 1 per element: half the reference's traffic per
  // input byte, so the reference time is halved to compare like with like.
  Row("Convert bf16 -> fp8 e4m3", bytes, convert, reference / 2, "read 2 + write 1, scaled");

  // fp8 [128, 128] block quantization as a GPU slot runs it: a [rows, 8192] bf16 matrix into
  // e4m3 codes and fp32 scales (one call: map upload, three kernels, the inf/NaN count back).
  const uint64_t cols = 8192, rows = n / cols;
  std::vector<uint32_t> map(rows);
  for (uint64_t r = 0; r < rows; ++r) map[r] = static_cast<uint32_t>(r / 128);
  cpu::Fp8BlockRun run;
  run.src = b.get();
  run.src_dtype = DType::kBF16;
  run.rows = rows;
  run.cols = cols;
  run.src_row_stride = static_cast<int64_t>(cols);
  run.block_cols = 128;
  run.scale_row_of = map.data();
  run.scale_rows = (rows + 127) / 128;
  run.dst = out.get();
  run.dst_row_stride = static_cast<int64_t>(cols);
  run.scales = reinterpret_cast<float*>(out.get() + rows * cols);
  run.scale_row_stride = static_cast<int64_t>(cols / 128);
  const double quantize = Median(
      [&] { CheckOk(QuantizeFp8BlocksOnDevice({run}, 0).status(), "QuantizeFp8BlocksOnDevice"); },
      reps);
  Row("fp8 blocks [128,128] on the GPU", rows * cols * 2, quantize, reference / 2,
      "read 2 + write 1, scaled");
  // The CPU kernel on the same bytes (one core; host copies), the path host slots take.
  std::vector<uint8_t> host_src = base, host_dst(rows * cols + run.scale_rows * (cols / 128) * 4);
  cpu::Fp8BlockRun host = run;
  host.src = host_src.data();
  host.dst = host_dst.data();
  host.scales = reinterpret_cast<float*>(host_dst.data() + rows * cols);
  const double cpu_seconds =
      Median([&] { CheckOk(cpu::QuantizeFp8Blocks(host).status(), "cpu::QuantizeFp8Blocks"); },
             std::min(reps, 3));
  Row("fp8 blocks [128,128] on the GPU", rows * cols * 2, quantize, cpu_seconds,
      "cpu::QuantizeFp8Blocks, 1 core");
  std::vector<uint8_t> from_gpu(host_dst.size());
  CheckCuda(cudaMemcpy(from_gpu.data(), out.get(), from_gpu.size(), cudaMemcpyDeviceToHost),
            "download");
  std::printf("    (GPU codes and scales %s the CPU kernel's)\n",
              from_gpu == host_dst ? "bit for bit equal to" : "DIFFER from");
}

void BenchIpcImport(const std::string& exporter_path) {
  const int count = 64;
  const uint64_t bytes = uint64_t{64} << 20;
  std::printf("IPC import, %d buffers of %llu MiB exported by another process\n", count,
              static_cast<unsigned long long>(bytes >> 20));
  testing::Exporter exporter(exporter_path, bytes, 0, count);
  std::vector<double> open_times, close_times;
  std::vector<std::unique_ptr<Region>> regions;
  for (int k = 0; k < count; ++k) {
    absl::StatusOr<std::unique_ptr<Region>> region;
    open_times.push_back(Seconds([&] { region = OpenIpc(exporter.handle(k), 0, 0, 0); }));
    if (!region.ok()) {
      std::printf("  OpenIpc failed: %s\n", region.status().ToString().c_str());
      return;
    }
    regions.push_back(std::move(*region));
  }
  for (auto& region : regions) close_times.push_back(Seconds([&] { region.reset(); }));
  auto report = [](const char* what, std::vector<double> t) {
    const double first = t.front();
    std::sort(t.begin(), t.end());
    std::printf("  %-10s first %8.1f us   median %8.1f us   max %8.1f us\n", what, first * 1e6,
                t[t.size() / 2] * 1e6, t.back() * 1e6);
  };
  report("OpenIpc", open_times);
  report("close", close_times);
}

}  // namespace
}  // namespace refit::cuda

int main(int argc, char** argv) {
  uint64_t bytes = uint64_t{1} << 30;
  int reps = 10;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg.rfind("--bytes=", 0) == 0) bytes = std::stoull(arg.substr(8));
    if (arg.rfind("--reps=", 0) == 0) reps = std::stoi(arg.substr(7));
  }
  bytes &= ~uint64_t{4095};
  std::printf("gpu_bench: %s\n", refit::cuda::Describe().c_str());
  if (!refit::cuda::testing::HaveGpu()) return 1;
  cudaDeviceProp prop;
  refit::cuda::testing::CheckCuda(cudaGetDeviceProperties(&prop, 0), "properties");
  std::printf("device 0: %s, %.0f GiB\n", prop.name,
              static_cast<double>(prop.totalGlobalMem) / (1 << 30));
  const std::string exporter = refit::cuda::testing::FindExporter(argv[0]);
  if (exporter.empty()) {
    std::fprintf(stderr, "gpu_bench: ipc_exporter not found next to %s\n", argv[0]);
    return 1;
  }
  refit::cuda::BenchSnapshot(bytes, reps, exporter);
  refit::cuda::BenchKernels(bytes, reps);
  refit::cuda::BenchIpcImport(exporter);
  return 0;
}
