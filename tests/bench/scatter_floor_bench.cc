// scatter_floor_bench: what any sparse Apply into host memory costs at least (issue 32). A
// bf16 model's buffer (--mib, shared memory as an engine's is) and a random RL-like step (each
// element changed with probability --share): the bare scatter of the new values at sorted
// precomputed offsets — per write the old value saved into a record (as an undo journal does),
// the new one stored and read back — on --threads threads with the destination lines 16 writes
// ahead prefetched, beside memcpy of the model in the same run. No walk, no plan, no conversion:
// a lower bound for refitd's sparse Apply on this machine, set by how many cache lines the step
// touches (printed). --huge: the buffer in 2 MiB pages (MFD_HUGETLB; needs vm.nr_hugepages).
//
//   scatter_floor_bench [--mib=1024] [--share=0.004] [--threads=2] [--reps=5] [--huge]

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <iostream>
#include <random>
#include <thread>
#include <vector>

#include "CLI/CLI.hpp"
#include "absl/strings/str_format.h"
#include "tests/bench/bench_util.h"

namespace {

using refit::bench::Clock;
using refit::bench::Median;
using refit::bench::Seconds;

// `bytes` of shared memory (memfd), touched; null on failure.
uint8_t* Map(uint64_t bytes, bool huge) {
  const int fd = memfd_create("refit-scatter-floor", huge ? MFD_HUGETLB : 0);
  if (fd < 0 || ftruncate(fd, static_cast<off_t>(bytes)) != 0) return nullptr;
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) return nullptr;
  std::memset(p, 1, bytes);
  return static_cast<uint8_t*>(p);
}

// One thread's share [begin, end) of the writes: save (a 16-byte record: the offset word and the
// old value), store, read back. The mismatches (none expected).
uint64_t Scatter(uint16_t* dst, const std::vector<uint32_t>& at, const std::vector<uint16_t>& value,
                 uint8_t* records, size_t begin, size_t end) {
  uint64_t bad = 0;
  for (size_t i = begin; i < end; ++i) {
    if (i + 16 < end) __builtin_prefetch(&dst[at[i + 16]], 1);
    uint16_t* p = &dst[at[i]];
    const uint64_t word = at[i] | (uint64_t{2} << 48);
    std::memcpy(records + i * 16, &word, 8);
    std::memcpy(records + i * 16 + 8, p, 2);
    *p = value[i];
    bad += *static_cast<volatile uint16_t*>(p) != value[i];
  }
  return bad;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"the bare scatter of an RL step's writes beside memcpy of the model"};
  uint64_t mib = 1024;
  double share = 0.004;
  unsigned threads = 2;
  int reps = 5;
  bool huge = false;
  app.add_option("--mib", mib);
  app.add_option("--share", share, "each bf16 element changed with this probability");
  app.add_option("--threads", threads);
  app.add_option("--reps", reps);
  app.add_flag("--huge", huge, "2 MiB pages (MFD_HUGETLB)");
  CLI11_PARSE(app, argc, argv);
  const uint64_t bytes = mib << 20, elements = bytes / 2;
  uint8_t* dst = Map(bytes, huge);
  uint8_t* src = Map(bytes, false);
  if (!dst || !src) {
    std::cerr << "scatter_floor_bench: could not map " << mib << " MiB"
              << (huge ? " of huge pages (vm.nr_hugepages?)" : "") << "\n";
    return 1;
  }
  std::mt19937_64 rng(1);
  std::bernoulli_distribution changed(share);
  std::vector<uint32_t> at;
  for (uint64_t e = 0; e < elements; ++e) {
    if (changed(rng)) at.push_back(static_cast<uint32_t>(e));
  }
  const std::vector<uint16_t> value(at.size(), 7);
  std::vector<uint8_t> records(at.size() * 16);
  std::memset(records.data(), 0, records.size());
  uint64_t lines = 0, last = UINT64_MAX;
  for (uint32_t e : at) {
    if (e / 32 != last) ++lines;
    last = e / 32;
  }
  std::cout << absl::StrFormat(
      "scatter floor: %llu MiB bf16, %s pages, %u thread(s): %zu writes (%.3f %% of elements), "
      "%llu cache lines touched (%.1f %% of the model's)\n",
      static_cast<unsigned long long>(mib), huge ? "2 MiB" : "4 KiB", threads, at.size(),
      100.0 * static_cast<double>(at.size()) / static_cast<double>(elements),
      static_cast<unsigned long long>(lines),
      100.0 * static_cast<double>(lines) / static_cast<double>(bytes / 64));
  std::vector<double> copy_s, scatter_s, ratio;
  uint64_t bad = 0;
  for (int r = 0; r < reps; ++r) {
    auto t0 = Clock::now();
    std::memcpy(dst, src, bytes);
    copy_s.push_back(Seconds(t0, Clock::now()));
    std::vector<std::thread> pool;
    std::atomic<uint64_t> mismatches{0};
    t0 = Clock::now();
    for (unsigned t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        mismatches += Scatter(reinterpret_cast<uint16_t*>(dst), at, value, records.data(),
                              at.size() * t / threads, at.size() * (t + 1) / threads);
      });
    }
    for (std::thread& t : pool) t.join();
    scatter_s.push_back(Seconds(t0, Clock::now()));
    ratio.push_back(scatter_s.back() / copy_s.back());
    bad += mismatches;
  }
  std::cout << absl::StrFormat(
      "  memcpy of the model %.4f s (reference, same run); scatter %.4f s = %.3fx memcpy "
      "(medians of %d); %.1f ns per write per thread\n",
      Median(copy_s), Median(scatter_s), Median(ratio), reps,
      Median(scatter_s) * 1e9 * threads / static_cast<double>(std::max<size_t>(1, at.size())));
  std::cout << absl::StrFormat("RESULT scatter_over_memcpy=%.4f lines_touched=%.4f\n",
                               Median(ratio),
                               static_cast<double>(lines) / static_cast<double>(bytes / 64));
  return bad == 0 ? 0 : 1;
}
