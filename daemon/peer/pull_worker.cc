#include "daemon/peer/pull_worker.h"

#include <algorithm>
#include <chrono>

#include "daemon/common/logging.h"
#include "daemon/dataplane/data_plane.h"
#include "daemon/peer/peer_metrics.h"

namespace refit::peer {

PullWorker::PullWorker(PullRunner* runner, PullFinisher* finisher, PullsInFlight* in_flight,
                       Metrics* metrics)
    : runner_(runner), finisher_(finisher), in_flight_(in_flight), metrics_(metrics) {
  metrics_->Declare(kTransferSeconds);
}

PullWorker::~PullWorker() { Stop(); }

void PullWorker::Start() {
  thread_ = std::thread([this] { Run(); });
}

void PullWorker::Stop() {
  {
    common::MutexLock lock(mu_);
    stop_ = true;
  }
  wake_.NotifyAll();
  if (thread_.joinable()) thread_.join();
}

void PullWorker::Queue(const PullJob& job) {
  {
    common::MutexLock lock(mu_);
    jobs_.push_back(job);
  }
  wake_.NotifyAll();
}

std::vector<Transfer> PullWorker::Transfers() const {
  common::MutexLock lock(mu_);
  if (!current_) return {};
  Transfer t = *current_;
  const double done = metrics_->Get(kDataBytesReceived) - received_at_start_;
  t.bytes_done = std::min<uint64_t>(t.bytes_total, static_cast<uint64_t>(std::max(0.0, done)));
  return {t};
}

void PullWorker::Run() {
  while (true) {
    PullJob job;
    {
      common::UniqueLock lock(mu_);
      wake_.Wait(lock,
                 [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !jobs_.empty(); });
      if (stop_) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    const auto start = std::chrono::steady_clock::now();
    in_flight_->BeginPull();
    {
      common::MutexLock lock(mu_);
      current_ = Transfer{job.model, job.version, job.Bytes(), 0};
      received_at_start_ = metrics_->Get(kDataBytesReceived);
    }
    pull::PullOutcome outcome = runner_->Run(job);
    {
      common::MutexLock lock(mu_);
      current_.reset();  // before the store shows the version: no stale progress after it
    }
    in_flight_->EndPull();
    const absl::Status status = outcome.status;
    finisher_->Finish(job, outcome.status, std::move(outcome.staging));
    metrics_->Observe(
        kTransferSeconds,
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    if (status.ok()) {
      Logger("peer")->info(
          "model={} version={} pulled {} bytes in {:.3f} s", job.model, job.version, job.Bytes(),
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  }
}

}  // namespace refit::peer
