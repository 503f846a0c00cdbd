#include "daemon/common/liveness.h"

#include "absl/strings/str_format.h"

namespace refit {

std::vector<std::string> Liveness::Stuck(std::chrono::milliseconds stall) const {
  std::vector<std::string> stuck;
  const int64_t bound_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(stall).count();
  common::MutexLock lock(mu_);
  for (const Worker& worker : workers_) {
    if (!worker.busy()) continue;
    const int64_t since = worker.SinceProgressNs();
    if (since > bound_ns) {
      stuck.push_back(absl::StrFormat("%s (busy %.1f s without progress)", worker.name(),
                                      static_cast<double>(since) / 1e9));
    }
  }
  return stuck;
}

LivenessProbe::LivenessProbe(Liveness::Worker* worker, std::function<void()> probe,
                             std::chrono::milliseconds interval)
    : worker_(worker),
      probe_(std::move(probe)),
      loop_(WorkerLoop::Options{"probe " + worker->name(), interval, /*run_at_start=*/true}) {
  loop_.Start([this] { Probe(); });
}

LivenessProbe::~LivenessProbe() { Stop(); }

void LivenessProbe::Stop() { loop_.Stop(); }

void LivenessProbe::Probe() {
  worker_->Busy();
  probe_();
  worker_->Idle();
}

}  // namespace refit
