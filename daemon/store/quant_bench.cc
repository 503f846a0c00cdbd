// fp8 block quantization figures, each beside a reference measured in the same run:
//   1. the CPU kernel on one core (vectorized and scalar) beside memcpy of the same bf16 bytes;
//   2. publish -> complete -> Apply of a bf16 model into an fp8 engine ([128, 128] block
//      scales) beside the same into a bf16 engine, through the store on one node;
//   3. the same with the model cut into many tensors beside one tensor of the same bytes;
//   4. RegisterBuffer and plan building for many fp8 tensors with scales beside bf16 ones.
// Usage: quant_bench [model MiB (1024)] [tensors for parts 3, 4 (100000)] [versions (5)]
//                    [parts to run (123; 4 on request)] [part 4 only: bf16 or fp8 (for perf)]

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "cuda/quantize_kernels.h"
#include "daemon/common/logging.h"
#include "daemon/store/store.h"

namespace refit {
namespace {

using Seconds = std::chrono::duration<double>;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

template <typename Fn>
double Time(Fn&& fn) {
  const auto start = Clock::now();
  fn();
  return Seconds(Clock::now() - start).count();
}

double ThreadCpuSeconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

double ProcessCpuSeconds() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
}

// `fn`'s wall time, and the CPU time of this thread during it in `*cpu` (on a shared machine
// the wall time counts the other processes' turns on the core; the CPU time does not).
template <typename Fn>
double Time(Fn&& fn, double* cpu) {
  const double cpu_start = ThreadCpuSeconds();
  const double wall = Time(fn);
  *cpu = ThreadCpuSeconds() - cpu_start;
  return wall;
}

void FillBf16(uint8_t* data, uint64_t bytes, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<uint16_t> pattern(1 << 16);
  for (auto& v : pattern) {
    const float f = normal(rng);
    uint32_t b;
    std::memcpy(&b, &f, 4);
    v = static_cast<uint16_t>(b >> 16);
  }
  for (uint64_t at = 0; at < bytes; at += pattern.size() * 2) {
    std::memcpy(data + at, pattern.data(), std::min<uint64_t>(pattern.size() * 2, bytes - at));
  }
}

void KernelFigures() {
  const uint64_t rows = 4096, cols = 8192, bytes = rows * cols * 2;
  auto src = AllocateHost(bytes);
  auto copy = AllocateHost(bytes);
  auto q = AllocateHost(rows * cols);
  if (!src.ok() || !copy.ok() || !q.ok()) std::abort();
  FillBf16((*src)->data(), bytes, 1);
  std::memset((*copy)->data(), 0, bytes);
  std::memset((*q)->data(), 0, rows * cols);
  std::vector<uint32_t> map(rows);
  for (uint64_t r = 0; r < rows; ++r) map[r] = static_cast<uint32_t>(r / 128);
  std::vector<float> scales((rows / 128) * (cols / 128));
  cuda::cpu::Fp8BlockRun run{(*src)->data(),
                             DType::kBF16,
                             rows,
                             cols,
                             static_cast<int64_t>(cols),
                             128,
                             map.data(),
                             rows / 128,
                             (*q)->data(),
                             static_cast<int64_t>(cols),
                             scales.data(),
                             static_cast<int64_t>(cols / 128)};
  // memcpy and each vectorized kernel this CPU runs, interleaved, medians of 9; the scalar twin
  // three times.
  std::vector<cuda::cpu::Fp8Kernel> kernels;
  for (auto k : {cuda::cpu::Fp8Kernel::kAvx512, cuda::cpu::Fp8Kernel::kAvx2}) {
    if (cuda::cpu::Fp8KernelRuns(k)) kernels.push_back(k);
  }
  std::vector<double> memcpy_s, scalar_s, memcpy_cpu;
  std::vector<std::vector<double>> vec_s(kernels.size()), vec_cpu(kernels.size());
  for (int i = 0; i < 9; ++i) {
    double cpu;
    memcpy_s.push_back(Time([&] { std::memcpy((*copy)->data(), (*src)->data(), bytes); }, &cpu));
    memcpy_cpu.push_back(cpu);
    for (size_t k = 0; k < kernels.size(); ++k) {
      vec_s[k].push_back(
          Time([&] { (void)cuda::cpu::QuantizeFp8BlocksWith(kernels[k], run); }, &cpu));
      vec_cpu[k].push_back(cpu);
    }
    if (i < 3) scalar_s.push_back(Time([&] { (void)cuda::cpu::QuantizeFp8BlocksScalar(run); }));
  }
  const double gb = bytes / 1e9;
  std::printf(
      "1. fp8 block quantization on one core, [%lu, %lu] bf16 (%.0f MiB), [128, 128] "
      "blocks; medians of 9, wall time (CPU time of the thread)\n",
      rows, cols, bytes / 1048576.0);
  std::printf("  memcpy of the bf16 bytes   %7.2f GB/s (%5.2f)  (reference)\n",
              gb / Median(memcpy_s), gb / Median(memcpy_cpu));
  for (size_t k = 0; k < kernels.size(); ++k) {
    std::printf(
        "  quantize, %-8s%s %7.2f GB/s (%5.2f) of bf16 = %.2fx memcpy (%.2fx) (goal >= 0.5x)\n",
        cuda::cpu::Fp8KernelName(kernels[k]),
        kernels[k] == cuda::cpu::Fp8BestKernel() ? " (used)" : "       ", gb / Median(vec_s[k]),
        gb / Median(vec_cpu[k]), Median(memcpy_s) / Median(vec_s[k]),
        Median(memcpy_cpu) / Median(vec_cpu[k]));
  }
  std::printf("  quantize, scalar twin      %7.2f GB/s of bf16 = %.2fx memcpy\n",
              gb / Median(scalar_s), Median(memcpy_s) / Median(scalar_s));
}

struct Run {
  double register_dst_s = 0;  // of register_s: the DESTINATION buffer
  // The same in the process's CPU time (every thread, the kernel's page clearing included): on
  // a shared machine the wall time counts the other processes' turns on the cores.
  double register_cpu_s = 0, register_dst_cpu_s = 0;
  double plan_cpu_s = 0;  // the first Apply (building its plans, then the copy), CPU time
  double register_s = 0, plan_s = 0, publish_s = 0, complete_s = 0, apply_s = 0, total_s = 0;
  double plan_build_s = 0;  // of plan_s: building the plans (refit_plan_seconds)
  double quantize_s = 0;    // per version: quantizing (refit_quantize_seconds, mean)
};

// One store, one model: `tensors` bf16 tensors [rows, cols] in `sources` SOURCE buffers (as
// ranks of a trainer on this node would hold them, each published by its own call, one after
// another), one DESTINATION buffer of bf16 or of fp8 + block scales; medians over `versions`.
Run Measure(uint64_t tensors, uint64_t rows, uint64_t cols, bool fp8, int versions,
            uint64_t sources = 1) {
  Metrics metrics;
  StoreOptions options;
  options.retain = 2;
  options.node = "bench";
  Store store(options, &metrics);
  const uint64_t tensor_bytes = rows * cols * 2;
  const uint64_t q_bytes = rows * cols;
  const uint64_t grid_r = (rows + 127) / 128, grid_c = (cols + 127) / 128;
  const uint64_t dst_tensor = fp8 ? q_bytes : tensor_bytes;
  const uint64_t scale_bytes = fp8 ? grid_r * grid_c * 4 : 0;
  const uint64_t dst_bytes = tensors * (dst_tensor + scale_bytes);
  const uint64_t per_source = (tensors + sources - 1) / sources;  // tensors
  std::vector<std::unique_ptr<Region>> src_regions;
  for (uint64_t k = 0; k < sources; ++k) {
    const uint64_t n = std::min(per_source, tensors - std::min(tensors, k * per_source));
    auto region = AllocateHost(std::max<uint64_t>(1, n) * tensor_bytes);
    if (!region.ok()) std::abort();
    FillBf16((*region)->data(), (*region)->size(), 2 + k);
    src_regions.push_back(std::move(region).value());
  }
  auto dst_region = AllocateHost(dst_bytes);
  if (!dst_region.ok()) std::abort();
  uint8_t* src = src_regions[0]->data();
  const uint64_t first_bytes = src_regions[0]->size();
  std::memset((*dst_region)->data(), 0, dst_bytes);
  std::vector<std::vector<TensorSlice>> src_slices(sources);
  std::vector<TensorSlice> dst_slices;
  for (uint64_t t = 0; t < tensors; ++t) {
    TensorSlice s;
    s.name = "model.layers." + std::to_string(t / 8) + ".w" + std::to_string(t % 8);
    s.dtype = DType::kBF16;
    s.global_shape = {static_cast<int64_t>(rows), static_cast<int64_t>(cols)};
    s.buffer_offset = (t % per_source) * tensor_bytes;
    src_slices[t / per_source].push_back(s);
    TensorSlice d = s;
    d.buffer_offset = t * dst_tensor;
    if (fp8) {
      d.dtype = DType::kFP8E4M3;
      d.scale_tensor = s.name + "_scale_inv";
      d.scale_block = {128, 128};
      TensorSlice scale;
      scale.name = d.scale_tensor;
      scale.dtype = DType::kFP32;
      scale.global_shape = {static_cast<int64_t>(grid_r), static_cast<int64_t>(grid_c)};
      scale.buffer_offset = tensors * dst_tensor + t * scale_bytes;
      dst_slices.push_back(scale);
    }
    dst_slices.push_back(d);
  }
  Run run;
  std::vector<std::string> src_ids;
  std::string dst_id;
  const double register_cpu = ProcessCpuSeconds();
  run.register_s = Time([&] {
    for (uint64_t k = 0; k < sources; ++k) {
      auto a = store.RegisterBuffer("m", Role::kSource, std::move(src_regions[k]),
                                    std::move(src_slices[k]), "t");
      if (!a.ok()) {
        std::fprintf(stderr, "register: %s\n", a.status().ToString().c_str());
        std::abort();
      }
      src_ids.push_back(*a);
    }
    const double dst_cpu = ProcessCpuSeconds();
    run.register_dst_s = Time([&] {
      // Moved in, as the server does with the slices of a request.
      auto b = store.RegisterBuffer("m", Role::kDestination, std::move(*dst_region),
                                    std::move(dst_slices), "e");
      if (!b.ok()) {
        std::fprintf(stderr, "register: %s\n", b.status().ToString().c_str());
        std::abort();
      }
      dst_id = *b;
    });
    run.register_dst_cpu_s = ProcessCpuSeconds() - dst_cpu;
  });
  run.register_cpu_s = ProcessCpuSeconds() - register_cpu;
  std::vector<double> publish, complete, apply, total, plan;
  for (int v = 1; v <= versions + 1; ++v) {
    src[(v * 4099) % first_bytes] ^= 1;
    const double p = Time([&] {
      for (const std::string& id : src_ids) {
        if (!store.Publish("m", v, {id}).ok()) std::abort();
      }
    });
    const double c = Time([&] {
      if (!store.WaitForVersion("m", v, Clock::now() + std::chrono::seconds(120), nullptr).ok())
        std::abort();
    });
    const double apply_cpu = ProcessCpuSeconds();
    const double a = Time([&] {
      auto applied = store.Apply("m", v, {dst_id});
      if (!applied.ok()) {
        std::fprintf(stderr, "apply: %s\n", applied.status().ToString().c_str());
        std::abort();
      }
    });
    if (v == 1) {
      plan.push_back(a);  // the first Apply builds the plan
      run.plan_cpu_s = ProcessCpuSeconds() - apply_cpu;
      continue;
    }
    publish.push_back(p);
    complete.push_back(c);
    apply.push_back(a);
    total.push_back(p + c + a);
  }
  run.plan_s = plan[0];
  const auto histograms = metrics.Histograms();
  auto sum = [&](const Histogram& h, uint64_t* count) {
    auto it = histograms.find(h.name);
    *count = it == histograms.end() ? 0 : it->second.count;
    return it == histograms.end() ? 0.0 : it->second.sum;
  };
  uint64_t count = 0;
  run.plan_build_s = sum(kPlanSeconds, &count);
  run.quantize_s = sum(kQuantizeSeconds, &count) / (versions + 1);
  run.publish_s = Median(publish);
  run.complete_s = Median(complete);
  run.apply_s = Median(apply);
  run.total_s = Median(total);
  return run;
}

void PrintRun(const char* label, const Run& r, const Run* ref) {
  std::printf(
      "  %-26s register %8.4f  first apply (plans) %8.4f  publish %7.4f  complete "
      "%7.4f  apply %7.4f  total %7.4f s",
      label, r.register_s, r.plan_s, r.publish_s, r.complete_s, r.apply_s, r.total_s);
  if (ref) std::printf("  = %.2fx", r.total_s / ref->total_s);
  std::printf("\n  %-26s (of which: building plans %.4f s; quantizing %.4f s a version)\n", "",
              r.plan_build_s, r.quantize_s);
}

}  // namespace
}  // namespace refit

int main(int argc, char** argv) {
  using namespace refit;
  const uint64_t mib = argc > 1 ? std::strtoull(argv[1], nullptr, 10) : 1024;
  const uint64_t many = argc > 2 ? std::strtoull(argv[2], nullptr, 10) : 100000;
  const int versions = argc > 3 ? std::atoi(argv[3]) : 5;
  const std::string parts = argc > 4 ? argv[4] : "123";  // which parts to run
  // Part 4 with one side only (a profile of that side's registration: perf record -g).
  const std::string only = argc > 5 ? argv[5] : "";
  SetLogLevel("warn");
  double load[3] = {0, 0, 0};
  if (getloadavg(load, 3) == 3) {
    std::printf("load average at start: %.2f %.2f %.2f on %u cores\n\n", load[0], load[1], load[2],
                std::thread::hardware_concurrency());
  }
  if (parts.find('1') != std::string::npos) KernelFigures();
  const uint64_t tensors = std::max<uint64_t>(1, mib / 32);
  if (parts.find('2') != std::string::npos) {
    // 2. 1 GiB as 32 tensors of [4096, 4096] bf16 (for 1024 MiB).
    std::printf(
        "\n2. publish -> complete -> Apply, %lu MiB bf16 (%lu tensors [4096, 4096]), one "
        "node, medians of %d versions\n",
        tensors * 32, tensors, versions);
    const Run bf16 = Measure(tensors, 4096, 4096, false, versions);
    PrintRun("into bf16 (reference)", bf16, nullptr);
    const Run fp8 = Measure(tensors, 4096, 4096, true, versions);
    PrintRun("into fp8 + [128,128] scales", fp8, &bf16);
    std::printf("  goal: fp8 <= 1.3x bf16\n");
    // The same from 8 SOURCE buffers published one after another (a trainer's 8 ranks on this
    // node): the pieces published first are quantized while the others are published.
    std::printf("  the same from 8 SOURCE buffers, published one after another:\n");
    const Run bf16_8 = Measure(tensors, 4096, 4096, false, versions, 8);
    PrintRun("into bf16 (reference)", bf16_8, nullptr);
    const Run fp8_8 = Measure(tensors, 4096, 4096, true, versions, 8);
    PrintRun("into fp8 + [128,128] scales", fp8_8, &bf16_8);
  }
  if (parts.find('3') != std::string::npos) {
    // 3. The same bytes as `many` tensors of [128, cols] beside one tensor.
    const uint64_t bytes = tensors * 32 * 1048576;
    const uint64_t cols = std::max<uint64_t>(1, bytes / 2 / many / 128);
    const uint64_t rows_one = many * 128;
    std::printf("\n3. %lu tensors of [128, %lu] beside one tensor [%lu, %lu] (the same bytes)\n",
                many, cols, rows_one, cols);
    for (bool q : {false, true}) {
      const Run one = Measure(1, rows_one, cols, q, versions);
      const Run lots = Measure(many, 128, cols, q, versions);
      PrintRun(q ? "fp8, 1 tensor" : "bf16, 1 tensor", one, nullptr);
      PrintRun(q ? "fp8, many tensors" : "bf16, many tensors", lots, &one);
    }
    std::printf("  goal: many tensors <= 1.2x one tensor\n");
  }
  if (parts.find('4') != std::string::npos) {
    // 4. Registration and plans of `many` tensors, fp8 + scales beside bf16, alternating, medians
    // of `versions` runs (each registers a fresh store).
    const uint64_t bytes = tensors * 32 * 1048576;
    const uint64_t cols = std::max<uint64_t>(1, bytes / 2 / many / 128);
    std::vector<double> reg[2], reg_dst[2], plans[2], reg_cpu[2], reg_dst_cpu[2], apply_cpu[2];
    for (int i = 0; i < versions; ++i) {
      for (int q = 0; q < 2; ++q) {
        if ((only == "bf16" && q == 1) || (only == "fp8" && q == 0)) continue;
        const Run r = Measure(many, 128, cols, q == 1, 1);
        reg[q].push_back(r.register_s);
        reg_dst[q].push_back(r.register_dst_s);
        plans[q].push_back(r.plan_build_s);
        reg_cpu[q].push_back(r.register_cpu_s);
        reg_dst_cpu[q].push_back(r.register_dst_cpu_s);
        apply_cpu[q].push_back(r.plan_cpu_s);
      }
    }
    std::printf(
        "\n4. %lu tensors of [128, %lu]: RegisterBuffer (SOURCE + DESTINATION; of it the "
        "DESTINATION) and the first Apply (building its plans), medians of %d; CPU time of the "
        "process, wall time in ()\n",
        many, cols, versions);
    auto row = [&](const char* label, int q) {
      std::printf(
          "  %-22s register %7.4f s (%7.4f)  dst %7.4f s (%7.4f)  first Apply %7.4f s  "
          "plans (wall) %7.4f s\n",
          label, Median(reg_cpu[q]), Median(reg[q]), Median(reg_dst_cpu[q]), Median(reg_dst[q]),
          Median(apply_cpu[q]), Median(plans[q]));
    };
    if (!only.empty()) {
      row(only.c_str(), only == "fp8" ? 1 : 0);
      return 0;
    }
    row("bf16 (reference)", 0);
    row("fp8 + [128,128] scales", 1);
    std::printf(
        "  fp8 / bf16             register %.2fx (wall %.2fx)  dst %.2fx (wall %.2fx)  first Apply "
        "%.2fx  plans (wall) %.2fx  (goal <= 1.2x)\n",
        Median(reg_cpu[1]) / Median(reg_cpu[0]), Median(reg[1]) / Median(reg[0]),
        Median(reg_dst_cpu[1]) / Median(reg_dst_cpu[0]), Median(reg_dst[1]) / Median(reg_dst[0]),
        Median(apply_cpu[1]) / Median(apply_cpu[0]), Median(plans[1]) / Median(plans[0]));
  }
  return 0;
}
