// Prints how small and how fast delta encoding is on the shared real weight versions and on a
// synthetic sparsity sweep: per step the changed fraction, full and delta bytes, the ratio to the
// "TRL format" (int32 index + bf16 value = 6 bytes per changed element), single-thread encode
// and decode throughput (median of runs) next to memcpy of the same bytes in the same run, and
// where encode time goes. With --sweep, also compares zstd levels and chunk sizes.
//
//   bazel run -c opt //daemon/delta:delta_bench -- [data/deltas dir] [--sweep] [--runs=N]
//       [--only=<substring of case names>]

#include <time.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "daemon/delta/delta.h"

namespace refit::delta {
namespace {

using Bytes = std::vector<uint8_t>;

// Seconds of CPU time this thread has used: unlike wall time it does not count the time the
// thread waits for a core, so that other work on a busy machine does not skew the figures
// (memory-bandwidth contention still does, for encode and memcpy alike).
double ThreadSeconds() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

int g_runs = 7;
std::string g_only;  // run only the cases whose name contains this

bool ReadFile(const std::string& path, Bytes& out) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return false;
  out.assign(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  return true;
}

bool IsDir(const std::string& path) {
  std::ifstream probe(path + "/tiny-llama-lr1e-6/v000.bin");
  return static_cast<bool>(probe);
}

double Median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

// Median seconds of g_runs calls of fn(), after one warm-up call.
template <typename Fn>
double TimeMedian(Fn&& fn) {
  fn();
  std::vector<double> seconds;
  for (int run = 0; run < g_runs; ++run) {
    const double start = ThreadSeconds();
    fn();
    seconds.push_back(ThreadSeconds() - start);
  }
  return Median(seconds);
}

uint64_t CountChangedBf16(const Bytes& a, const Bytes& b) {
  uint64_t changed = 0;
  for (size_t i = 0; i + 1 < a.size(); i += 2) {
    changed += (a[i] != b[i] || a[i + 1] != b[i + 1]) ? 1 : 0;
  }
  return changed;
}

void PrintTableHeader() {
  std::printf("%-22s %7s %10s %9s %8s %9s %6s %8s %8s %8s %6s %5s %5s\n", "case", "changed",
              "full B", "delta B", "full/dl", "6B-fmt B", "6B/dl", "enc GB/s", "dec GB/s",
              "cpy GB/s", "enc/cp", "scan%", "code%");
}

// Encodes base -> target, checks the round trip and prints one row.
void Measure(const std::string& name, const Bytes& base, const Bytes& target,
             const EncodeOptions& options) {
  if (!g_only.empty() && name.find(g_only) == std::string::npos) return;
  const uint64_t bytes = base.size();
  auto encoded = Encode(base.data(), target.data(), bytes, DType::kBF16, options);
  if (!encoded.ok()) {
    std::printf("%-22s encode failed: %s\n", name.c_str(), encoded.status().ToString().c_str());
    return;
  }
  Bytes work = base;
  if (auto status = Apply(encoded->data(), encoded->size(), work.data(), work.size());
      !status.ok() || work != target) {
    std::printf("%-22s ROUND TRIP FAILED: %s\n", name.c_str(), status.ToString().c_str());
    std::exit(1);
  }
  const uint64_t changed = CountChangedBf16(base, target);
  EncodeStats stats;
  std::vector<double> scan, code;
  const double encode_s = TimeMedian([&] {
    auto again = Encode(base.data(), target.data(), bytes, DType::kBF16, options, &stats);
    scan.push_back(stats.scan_seconds);
    code.push_back(stats.coding_seconds);
  });
  // Decode onto a fresh copy of the base each time; only Apply is timed.
  std::vector<double> decode_runs;
  for (int run = 0; run <= g_runs; ++run) {
    std::memcpy(work.data(), base.data(), bytes);
    const double start = ThreadSeconds();
    const absl::Status status = Apply(encoded->data(), encoded->size(), work.data(), bytes);
    const double s = ThreadSeconds() - start;
    if (!status.ok()) std::exit(1);
    if (run > 0) decode_runs.push_back(s);
  }
  const double decode_s = Median(decode_runs);
  const double memcpy_s = TimeMedian([&] {
    std::memcpy(work.data(), target.data(), bytes);
    asm volatile("" : : "r"(work.data()) : "memory");
  });
  const double delta_bytes = static_cast<double>(encoded->size());
  const double trl_bytes = 6.0 * static_cast<double>(changed);
  const double gb = static_cast<double>(bytes) / 1e9;
  const double scan_s = Median(scan), code_s = Median(code);
  std::printf("%-22s %6.3f%% %10llu %9.0f %8.1f %9.0f %6.2f %8.2f %8.2f %8.2f %6.2f %5.0f %5.0f\n",
              name.c_str(), 100.0 * static_cast<double>(changed) / static_cast<double>(bytes / 2),
              static_cast<unsigned long long>(bytes), delta_bytes, bytes / delta_bytes, trl_bytes,
              trl_bytes / delta_bytes, gb / encode_s, gb / decode_s, gb / memcpy_s,
              memcpy_s / encode_s, 100 * scan_s / (scan_s + code_s),
              100 * code_s / (scan_s + code_s));
}

uint16_t ToBf16(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, 4);
  bits += 0x7fff + ((bits >> 16) & 1);  // round to nearest even
  return static_cast<uint16_t>(bits >> 16);
}

// A random bf16 buffer like trained weights (normal, std 0.02) and a copy with `fraction` of its
// elements moved by one ulp up or down.
void MakeSynthetic(uint64_t elements, double fraction, Bytes& base, Bytes& target) {
  std::mt19937_64 rng(42);
  std::normal_distribution<float> weight(0.0f, 0.02f);
  base.resize(elements * 2);
  for (uint64_t i = 0; i < elements; ++i) {
    const uint16_t v = ToBf16(weight(rng));
    std::memcpy(&base[2 * i], &v, 2);
  }
  target = base;
  std::bernoulli_distribution pick(fraction);
  for (uint64_t i = 0; i < elements; ++i) {
    if (!pick(rng)) continue;
    uint16_t v;
    std::memcpy(&v, &target[2 * i], 2);
    v = static_cast<uint16_t>(v + ((rng() & 1) ? 1 : -1));
    std::memcpy(&target[2 * i], &v, 2);
  }
}

void Sweep(const Bytes& base, const Bytes& target, const char* name) {
  std::printf("\n# sweep on %s: zstd level x chunk elements -> delta bytes (encode GB/s)\n", name);
  const int levels[] = {-5, 1, 9};
  const uint64_t chunks[] = {uint64_t{1} << 14, uint64_t{1} << 16, uint64_t{1} << 18,
                             uint64_t{1} << 20, uint64_t{1} << 22};
  std::printf("%-10s", "level");
  for (uint64_t chunk : chunks) {
    std::printf(" %20s", absl::StrCat("chunk=2^", std::log2(chunk)).c_str());
  }
  std::printf("\n");
  for (int level : levels) {
    std::printf("%-10d", level);
    for (uint64_t chunk : chunks) {
      EncodeOptions options;
      options.zstd_level = level;
      options.chunk_elements = chunk;
      size_t size = 0;
      const double s = TimeMedian([&] {
        size = Encode(base.data(), target.data(), base.size(), DType::kBF16, options)->size();
      });
      std::printf(" %11zu (%5.2f)  ", size, static_cast<double>(base.size()) / 1e9 / s);
    }
    std::printf("\n");
  }
}

int Main(int argc, char** argv) {
  std::string dir;
  bool sweep = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--sweep") {
      sweep = true;
    } else if (absl::StartsWith(arg, "--only=")) {
      g_only = arg.substr(7);
    } else if (absl::StartsWith(arg, "--runs=")) {
      g_runs = std::max(5, std::atoi(arg.c_str() + 7));
    } else {
      dir = arg;
    }
  }
  if (dir.empty()) {
    std::vector<std::string> candidates = {"../shared/data/deltas", "/work/shared/data/deltas"};
    if (const char* ws = std::getenv("BUILD_WORKSPACE_DIRECTORY")) {
      candidates.insert(candidates.begin(), std::string(ws) + "/../shared/data/deltas");
    }
    for (const auto& candidate : candidates) {
      if (IsDir(candidate)) {
        dir = candidate;
        break;
      }
    }
  }
  const EncodeOptions options;
  std::printf(
      "# delta_bench: bf16, chunk_elements=%llu, zstd_level=%d, median of %d runs, "
      "1 thread, thread CPU time\n",
      static_cast<unsigned long long>(options.chunk_elements), options.zstd_level, g_runs);
  std::printf(
      "# full/dl = full bytes / delta bytes; 6B/dl = (6 B x changed) / delta bytes; "
      "enc/cp = encode GB/s / memcpy GB/s;\n# scan%%, code%% = where encode time goes: "
      "comparing + hashing + collecting changes, and Rice coding + zstd\n");
  PrintTableHeader();
  Bytes first_base, first_target;
  if (!dir.empty() && IsDir(dir)) {
    for (const char* folder : {"tiny-llama-lr1e-6", "tiny-llama-lr1e-5"}) {
      std::vector<Bytes> versions(4);
      for (int v = 0; v < 4; ++v) {
        const std::string path = absl::StrCat(dir, "/", folder, "/v00", v, ".bin");
        if (!ReadFile(path, versions[v])) {
          std::printf("cannot read %s\n", path.c_str());
          return 1;
        }
      }
      for (int v = 0; v < 3; ++v) {
        Measure(absl::StrCat(folder + 11, " v", v, "->v", v + 1), versions[v], versions[v + 1],
                options);
      }
      if (first_base.empty()) {
        first_base = versions[0];
        first_target = versions[1];
      }
    }
  } else {
    std::printf("(no real data: pass the shared data/deltas directory)\n");
  }
  const uint64_t elements = 3033344;  // as many as the real model
  for (double percent : {0.01, 0.1, 0.5, 1.0, 3.0, 10.0, 30.0, 100.0}) {
    if (!g_only.empty() && g_only.find("synthetic") == std::string::npos) break;
    Bytes base, target;
    MakeSynthetic(elements, percent / 100, base, target);
    Measure(absl::StrCat("synthetic ", percent, "% +-1ulp"), base, target, options);
  }
  if (sweep && !first_base.empty()) Sweep(first_base, first_target, "lr1e-6 v0->v1");
  return 0;
}

}  // namespace
}  // namespace refit::delta

int main(int argc, char** argv) { return refit::delta::Main(argc, argv); }
