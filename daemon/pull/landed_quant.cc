// LandedQuantizer: what a pull has landed, handed to the store's quantizer as it lands.
#include "daemon/pull/landed_quant.h"

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>

namespace refit::pull {
namespace {

constexpr auto kTick = std::chrono::milliseconds(5);
constexpr int kNice = 19;  // the quantizer thread's nice value (the lowest priority)

// `ranges` sorted and merged.
void Merge(LandedQuantizer::Ranges& ranges) {
  std::sort(ranges.begin(), ranges.end());
  size_t kept = 0;
  for (const auto& r : ranges) {
    if (kept > 0 && r.first <= ranges[kept - 1].second) {
      ranges[kept - 1].second = std::max(ranges[kept - 1].second, r.second);
    } else {
      ranges[kept++] = r;
    }
  }
  ranges.resize(kept);
}

}  // namespace

LandedQuantizer::LandedQuantizer(PullLanding* store, const PullJob& job)
    : store_(store), job_(job), active_(store->QuantizesWhilePulling(job.model)) {
  if (!active_) return;
  {
    common::MutexLock lock(mu_);
    staging_.resize(job_.fetches.size());
    landed_.resize(job_.fetches.size());
  }
  thread_ = std::thread([this] { Run(); });
}

LandedQuantizer::~LandedQuantizer() { Stop(); }

void LandedQuantizer::Staged(size_t f, std::shared_ptr<Region> slot) {
  if (!active_) return;
  common::MutexLock lock(mu_);
  if (f < staging_.size()) staging_[f] = std::move(slot);
}

void LandedQuantizer::Landed(size_t f, uint64_t offset, uint64_t length) {
  if (!active_ || length == 0) return;
  common::MutexLock lock(mu_);
  if (f >= landed_.size()) return;
  landed_[f].emplace_back(offset, offset + length);
  changed_ = true;
  wake_.NotifyOne();
}

void LandedQuantizer::Whole(size_t f) {
  if (!active_) return;
  common::MutexLock lock(mu_);
  if (f >= landed_.size()) return;
  landed_[f] = job_.fetches[f].ranges;
  changed_ = true;
  wake_.NotifyOne();
}

void LandedQuantizer::Stop() {
  if (!thread_.joinable()) return;
  {
    common::MutexLock lock(mu_);
    stop_ = true;
    wake_.NotifyOne();
  }
  thread_.join();
}

void LandedQuantizer::Finish(const std::vector<Ranges>& refetched) {
  if (!active_) return;
  Stop();
  Quantize(refetched);
}

void LandedQuantizer::Run() {
  // The lowest priority: this thread takes the cores the pull leaves idle (a pull over loopback
  // or shared memory is itself CPU-bound: quantizing beside it at the same priority slowed it
  // more than the overlap saved, docs/benchmarks.md). Linux keeps a nice value per thread; a
  // failure leaves the thread as it was.
  (void)setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), kNice);
  common::UniqueLock lock(mu_);
  bool more = false;  // the last call left runnable tasks
  while (true) {
    wake_.Wait(lock,
               [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || changed_ || more; });
    if (stop_) return;
    lock.unlock();
    // A task (~4 MiB of source) per call, so that Stop never waits on more than one.
    more = Quantize({});
    if (!more) std::this_thread::sleep_for(kTick);  // let a few more chunks land first
    lock.lock();
  }
}

bool LandedQuantizer::Quantize(const std::vector<Ranges>& refetched) {
  std::vector<std::shared_ptr<Region>> staging;
  std::vector<Ranges> landed;
  {
    common::MutexLock lock(mu_);
    for (Ranges& r : landed_) Merge(r);
    staging = staging_;
    landed = landed_;
    changed_ = false;
  }
  return store_->QuantizeLanded(job_, staging, landed, refetched);
}

}  // namespace refit::pull
