#pragma once

// Quantizing a pulled version while it lands (fp8 engines with block scales): a pull reports
// each range of each fetch as it lands; a thread of its own, at the lowest priority (nice 19:
// it takes only the CPU the pull leaves idle), hands what landed so far to
// Store::QuantizeLanded, which quantizes a task (~4 MiB of source) of the blocks whose source
// bytes are all there per call, on that one thread; it calls again at once while runnable
// tasks are left, else every few milliseconds. After the pull verified every byte, Finish reports
// the ranges fetched again (their checksums failed), whose blocks are quantized again from the
// bytes that passed. The version still becomes visible only when FinishPull completes it and every
// block is done.
//
// Thread-safety: Staged, Landed and Whole may be called from any thread; Finish from one.

#include <cstdint>
#include <memory>
#include <thread>
#include <utility>
#include <vector>

#include "daemon/common/mutex.h"
#include "daemon/memory/region.h"
#include "daemon/store/pull_landing.h"

namespace refit::pull {

class LandedQuantizer {
 public:
  using Ranges = std::vector<std::pair<uint64_t, uint64_t>>;

  // Does nothing (active() false) unless `store` quantizes job.model while pulling it.
  LandedQuantizer(PullLanding* store, const PullJob& job);
  ~LandedQuantizer();  // stops the thread without a last call
  LandedQuantizer(const LandedQuantizer&) = delete;
  LandedQuantizer& operator=(const LandedQuantizer&) = delete;

  bool active() const { return active_; }
  // Fetch f lands in `slot`.
  void Staged(size_t f, std::shared_ptr<Region> slot);
  // Bytes [offset, offset + length) of fetch f landed.
  void Landed(size_t f, uint64_t offset, uint64_t length);
  // All of fetch f's ranges are there (brought up to date by a delta).
  void Whole(size_t f);
  // The pull verified every byte: stops the thread and quantizes what is left to quantize of
  // what landed, `refetched[f]` (ranges of fetch f fetched again) redone.
  void Finish(const std::vector<Ranges>& refetched);

 private:
  void Run();
  void Stop();
  // Hands what landed so far to the store (no lock held); true when it left runnable tasks.
  bool Quantize(const std::vector<Ranges>& refetched);

  PullLanding* const store_;
  const PullJob job_;
  const bool active_;
  common::Mutex mu_;
  common::CondVar wake_;
  std::vector<std::shared_ptr<Region>> staging_ ABSL_GUARDED_BY(mu_);
  std::vector<Ranges> landed_ ABSL_GUARDED_BY(mu_);  // unsorted until merged
  bool changed_ ABSL_GUARDED_BY(mu_) = false;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace refit::pull
