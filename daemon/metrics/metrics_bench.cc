// ns per Add on a counter: through a handle (Metrics::Declare's CounterHandle, an atomic add)
// beside the by-name path (Metrics::Add(kCounter, n): the registry's lock and a lookup), same
// run, with 1 and 2 threads adding to the same counter at once. Also a labelled series
// (a handle from Metrics::Series vs Add(counter, labels, n), which builds the key string) and
// a histogram Observe.
//
//   bazel run //daemon/metrics:metrics_bench [-- OPS_PER_THREAD]   (the build is -O2 already)
//
// Prints the process's CPU ns per operation (the cost, what to judge on a loaded machine) and
// the wall ns per operation per thread (which on a loaded machine includes waiting for a core),
// and the ratio by name / handle of each.

#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "daemon/metrics/metrics.h"

namespace refit {
namespace {

constexpr Counter kBenchBytes{"refit_bench_bytes_total", "Bytes the benchmark counts."};
constexpr Counter kBenchErrors{"refit_bench_errors_total", "Errors by code."};
constexpr Histogram kBenchSeconds{"refit_bench_seconds", "Seconds the benchmark observes."};

double CpuSeconds() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<double>(usage.ru_utime.tv_sec + usage.ru_stime.tv_sec) +
         static_cast<double>(usage.ru_utime.tv_usec + usage.ru_stime.tv_usec) / 1e6;
}

struct Figure {
  double wall_ns;  // wall ns per op, per thread
  double cpu_ns;   // the process's CPU ns per op (all threads' ops together)
};

// `threads` threads each run `op` `n` times at once.
Figure Run(int threads, long n, const std::function<void(long)>& op) {
  const double cpu_before = CpuSeconds();
  const auto began = std::chrono::steady_clock::now();
  std::vector<std::thread> workers;
  for (int t = 0; t < threads; ++t) {
    workers.emplace_back([&] {
      for (long i = 0; i < n; ++i) op(i);
    });
  }
  for (auto& worker : workers) worker.join();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  const double ops = static_cast<double>(n);
  return {seconds * 1e9 / ops, (CpuSeconds() - cpu_before) * 1e9 / (ops * threads)};
}

void Line(const char* what, int threads, const Figure& handle, const Figure& by_name) {
  std::printf(
      "%-21s %d thread%s  handle %6.1f cpu ns/op (wall %6.1f)  by name %6.1f cpu ns/op "
      "(wall %6.1f)  by name / handle: cpu %5.1fx, wall %5.1fx\n",
      what, threads, threads == 1 ? " " : "s", handle.cpu_ns, handle.wall_ns, by_name.cpu_ns,
      by_name.wall_ns, by_name.cpu_ns / handle.cpu_ns, by_name.wall_ns / handle.wall_ns);
}

}  // namespace
}  // namespace refit

int main(int argc, char** argv) {
  using namespace refit;
  const long n = argc > 1 ? std::atol(argv[1]) : 10000000;
  std::printf("metrics_bench: %ld operations per thread, same run (machine load affects both)\n",
              n);
  Metrics metrics;
  CounterHandle bytes = metrics.Declare(kBenchBytes);
  metrics.DeclareLabelled(kBenchErrors);
  CounterHandle not_found = metrics.Series(kBenchErrors, "code=\"NOT_FOUND\"");
  HistogramHandle seconds = metrics.Declare(kBenchSeconds);
  for (int threads : {1, 2}) {
    Line("counter Add", threads, Run(threads, n, [&](long) { bytes.Add(4096); }),
         Run(threads, n, [&](long) { metrics.Add(kBenchBytes, 4096); }));
    Line("labelled counter Add", threads, Run(threads, n, [&](long) { not_found.Add(1); }),
         Run(threads, n, [&](long) { metrics.Add(kBenchErrors, "code=\"NOT_FOUND\"", 1); }));
    Line("histogram Observe", threads,
         Run(threads, n, [&](long i) { seconds.Observe(static_cast<double>(i & 1023) * 1e-4); }),
         Run(threads, n, [&](long i) {
           metrics.Observe(kBenchSeconds, static_cast<double>(i & 1023) * 1e-4);
         }));
  }
  // The totals, so that the work cannot be optimised away and is seen to be exact.
  const double expected = 4096.0 * static_cast<double>(n) * 2 * (1 + 2);
  std::printf("check: %s = %.0f (expected %.0f)\n", kBenchBytes.name, metrics.Get(kBenchBytes),
              expected);
  return metrics.Get(kBenchBytes) == expected ? 0 : 1;
}
