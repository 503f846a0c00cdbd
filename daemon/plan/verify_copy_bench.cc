// Where verified Apply's time goes, on one thread (docs/benchmarks.md, "Verified apply"): a
// copy of SIZE MiB with streaming stores (what ExecuteOnHost does for large ops) beside copies
// with ordinary stores and a compare every N KiB (what ExecuteAndVerifyOnHost does), and the same
// for 512-byte runs (a column shard's rows); then the full Apply with its undo journal's save of
// the destination: as a pass before the streaming copy (plain Apply, the reference of the last
// two), before the checked copy, or folded into it. Variants interleaved round by round; CPU time
// of the thread, median and best round, each against the streaming copy of the same round. Usage:
// verify_copy_bench [SIZE_MIB [ROUNDS]]

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

#include "daemon/memory/stream_copy.h"

namespace refit {
namespace {

// Copies `n` bytes as the variant does; false when a compare found a difference.
class Variant {
 public:
  virtual ~Variant() = default;
  virtual const char* name() const = 0;
  virtual bool Run(uint8_t* to, const uint8_t* from, uint64_t n) const = 0;
};

class Streaming : public Variant {
 public:
  const char* name() const override { return "streaming stores (plain)"; }
  bool Run(uint8_t* to, const uint8_t* from, uint64_t n) const override {
    StreamCopy(to, from, n);
    StoreFence();
    return true;
  }
};

// Ordinary stores in `piece`-byte memcpy calls, each compared after it (`compare`) or not.
class Pieces : public Variant {
 public:
  Pieces(uint64_t piece, bool compare, std::string name)
      : piece_(piece), compare_(compare), name_(std::move(name)) {}
  const char* name() const override { return name_.c_str(); }
  bool Run(uint8_t* to, const uint8_t* from, uint64_t n) const override {
    bool same = true;
    for (uint64_t at = 0; at < n; at += piece_) {
      const uint64_t k = std::min(piece_, n - at);
      std::memcpy(to + at, from + at, k);
      if (compare_) same &= std::memcmp(to + at, from + at, k) == 0;
    }
    return same;
  }

 private:
  uint64_t piece_;
  bool compare_;
  std::string name_;
};

// Runs of `run` bytes copied one call each, compared in batches of `batch` bytes (0: never),
// with streaming or ordinary stores.
class Runs : public Variant {
 public:
  Runs(uint64_t run, uint64_t batch, bool stream, std::string name)
      : run_(run), batch_(batch), stream_(stream), name_(std::move(name)) {}
  const char* name() const override { return name_.c_str(); }
  bool Run(uint8_t* to, const uint8_t* from, uint64_t n) const override {
    bool same = true;
    const uint64_t batch = batch_ == 0 ? n : batch_;
    for (uint64_t at = 0; at < n; at += batch) {
      const uint64_t k = std::min(batch, n - at);
      for (uint64_t i = 0; i < k; i += run_) {
        const uint64_t m = std::min(run_, k - i);
        if (stream_) {
          StreamCopy(to + at + i, from + at + i, m);
        } else {
          std::memcpy(to + at + i, from + at + i, m);
        }
      }
      if (batch_ == 0) continue;
      for (uint64_t i = 0; i < k; i += run_) {
        same &= std::memcmp(to + at + i, from + at + i, std::min(run_, k - i)) == 0;
      }
    }
    if (stream_) StoreFence();
    return same;
  }

 private:
  uint64_t run_;
  uint64_t batch_;
  bool stream_;
  std::string name_;
};

// The full Apply with its undo journal: the destination's old bytes saved to `journal` (streaming
// stores), as a pass before the copy or folded into it piece by piece (what
// plan::ExecuteSaveAndVerifyOnHost does: the save's read brings each destination line into cache
// just before the ordinary stores overwrite it, so the write-allocate no longer reads memory).
class WithSave : public Variant {
 public:
  enum Copy { kStreaming, kChecked32, kFolded32 };
  WithSave(uint8_t* journal, Copy copy, std::string name)
      : journal_(journal), copy_(copy), name_(std::move(name)) {}
  const char* name() const override { return name_.c_str(); }
  bool Run(uint8_t* to, const uint8_t* from, uint64_t n) const override {
    constexpr uint64_t kPiece = 32 << 10;
    bool same = true;
    if (copy_ != kFolded32) StreamCopy(journal_, to, n);
    for (uint64_t at = 0; at < n; at += kPiece) {
      const uint64_t k = std::min(kPiece, n - at);
      if (copy_ == kStreaming) {
        StreamCopy(to + at, from + at, k);
        continue;
      }
      if (copy_ == kFolded32) StreamCopy(journal_ + at, to + at, k);
      std::memcpy(to + at, from + at, k);
      same &= std::memcmp(to + at, from + at, k) == 0;
    }
    StoreFence();
    return same;
  }

 private:
  uint8_t* journal_;
  Copy copy_;
  std::string name_;
};

double ThreadSeconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

int Main(uint64_t mib, int rounds) {
  const uint64_t n = mib << 20;
  std::vector<uint8_t> from(n, 1), to(n, 0), journal(n, 2);
  const Streaming streaming;
  const Pieces ordinary(8 << 10, false, "ordinary stores, no compare");
  const Pieces p8(8 << 10, true, "ordinary, compare every 8 KiB");
  const Pieces p16(16 << 10, true, "ordinary, compare every 16 KiB");
  const Pieces p32(32 << 10, true, "ordinary, compare every 32 KiB");
  const Pieces p256(256 << 10, true, "ordinary, compare every 256 KiB");
  const Runs r_stream(512, 0, true, "512 B runs, streaming (plain)");
  const Runs r_plain(512, 0, false, "512 B runs, ordinary, no compare");
  const Runs r_check(512, 32 << 10, false, "512 B runs, ordinary, compare/32 KiB");
  const WithSave save_streaming(journal.data(), WithSave::kStreaming,
                                "save pass + streaming (plain Apply)");
  const WithSave save_checked(journal.data(), WithSave::kChecked32,
                              "save pass + ordinary, compare/32 KiB");
  const WithSave save_folded(journal.data(), WithSave::kFolded32,
                             "save folded, ordinary, compare/32 KiB");
  const std::vector<const Variant*> variants = {
      &streaming, &ordinary,       &p8,           &p16,        &p32, &p256, &r_stream, &r_plain,
      &r_check,   &save_streaming, &save_checked, &save_folded};
  // The journal variants are also put beside the plain Apply with its save pass.
  const size_t save_reference = 9;
  std::vector<std::vector<double>> seconds(variants.size());
  for (int r = 0; r < rounds; ++r) {
    for (size_t v = 0; v < variants.size(); ++v) {
      const double t0 = ThreadSeconds();
      if (!variants[v]->Run(to.data(), from.data(), n)) std::abort();
      seconds[v].push_back(ThreadSeconds() - t0);
    }
  }
  auto median = [](std::vector<double> s) {
    std::sort(s.begin(), s.end());
    return s[s.size() / 2];
  };
  auto best = [](const std::vector<double>& s) { return *std::min_element(s.begin(), s.end()); };
  std::printf("one thread, %llu MiB, %d rounds, CPU time of the thread (reference: streaming)\n",
              static_cast<unsigned long long>(mib), rounds);
  for (size_t v = 0; v < variants.size(); ++v) {
    std::printf("  %-38s %7.2f GB/s  %.2fx streaming (best rounds %.2fx)", variants[v]->name(),
                static_cast<double>(n) / median(seconds[v]) / 1e9,
                median(seconds[0]) / median(seconds[v]), best(seconds[0]) / best(seconds[v]));
    if (v > save_reference) {
      std::printf("  %.2fx save pass + streaming (best %.2fx)",
                  median(seconds[save_reference]) / median(seconds[v]),
                  best(seconds[save_reference]) / best(seconds[v]));
    }
    std::printf("\n");
  }
  return 0;
}

}  // namespace
}  // namespace refit

int main(int argc, char** argv) {
  const uint64_t mib = argc > 1 ? std::max(1, std::atoi(argv[1])) : 256;
  const int rounds = argc > 2 ? std::max(1, std::atoi(argv[2])) : 11;
  return refit::Main(mib, rounds);
}
