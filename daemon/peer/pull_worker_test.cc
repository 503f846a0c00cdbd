// PullWorker alone: fake runner, finisher and in-flight listener (pull_worker.h's interfaces).

#include "daemon/peer/pull_worker.h"

#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "catch2/catch.hpp"
#include "daemon/common/mutex.h"
#include "daemon/dataplane/data_plane.h"
#include "daemon/metrics/metrics.h"

namespace refit::peer {
namespace {

using std::chrono::seconds;

// Records every step, in order, as "begin", "run m/1", "end", "finish m/1 OK"; a pull blocks
// until Release lets it go.
class Recorder final : public PullRunner, public PullFinisher, public PullsInFlight {
 public:
  pull::PullOutcome Run(const PullJob& job) override {
    common::UniqueLock lock(mu_);
    steps_.push_back("run " + Name(job));
    running_ = true;
    changed_.NotifyAll();
    changed_.Wait(lock, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return released_ > 0; });
    --released_;
    running_ = false;
    pull::PullOutcome outcome;
    if (job.version == 2) {
      outcome.status = absl::UnavailableError("origin went away");
    } else {
      outcome.staging.resize(job.fetches.size());
    }
    return outcome;
  }
  void Finish(const PullJob& job, absl::Status status,
              std::vector<std::shared_ptr<Region>> staging) override {
    common::MutexLock lock(mu_);
    steps_.push_back("finish " + Name(job) + " " +
                     std::string(absl::StatusCodeToString(status.code())) + " " +
                     std::to_string(staging.size()));
    changed_.NotifyAll();
  }
  void BeginPull() override { Add("begin"); }
  void EndPull() override { Add("end"); }

  void Release() {
    common::MutexLock lock(mu_);
    ++released_;
    changed_.NotifyAll();
  }
  // Waits (up to 10 s) until a pull is running.
  bool WaitRunning() {
    common::UniqueLock lock(mu_);
    return changed_.WaitFor(lock, seconds(10),
                            [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return running_; });
  }
  // Waits (up to 10 s) until `n` steps are recorded.
  bool WaitSteps(size_t n) {
    common::UniqueLock lock(mu_);
    return changed_.WaitFor(lock, seconds(10), [this, n]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
      return steps_.size() >= n;
    });
  }
  std::vector<std::string> steps() {
    common::MutexLock lock(mu_);
    return steps_;
  }

 private:
  static std::string Name(const PullJob& job) {
    return job.model + "/" + std::to_string(job.version);
  }
  void Add(const std::string& step) {
    common::MutexLock lock(mu_);
    steps_.push_back(step);
    changed_.NotifyAll();
  }
  common::Mutex mu_;
  common::CondVar changed_;
  std::vector<std::string> steps_ ABSL_GUARDED_BY(mu_);
  int released_ ABSL_GUARDED_BY(mu_) = 0;
  bool running_ ABSL_GUARDED_BY(mu_) = false;
};

PullJob Job(const std::string& model, uint64_t version, uint64_t bytes) {
  PullJob job;
  job.model = model;
  job.version = version;
  PullJob::Fetch fetch;
  fetch.node = "origin";
  fetch.bytes = bytes;
  fetch.ranges = {{0, bytes}};
  job.fetches = {fetch, fetch};
  return job;
}

TEST_CASE("pulls run one at a time, in order, each bracketed and handed to the store") {
  Metrics metrics;
  Recorder recorder;
  PullWorker worker(&recorder, &recorder, &recorder, &metrics);
  worker.Queue(Job("m", 1, 100));
  worker.Queue(Job("m", 2, 100));
  worker.Queue(Job("n", 7, 100));
  worker.Start();
  REQUIRE(recorder.WaitRunning());
  // One at a time: nothing else starts while the first runs.
  CHECK(recorder.steps() == std::vector<std::string>{"begin", "run m/1"});
  for (int i = 0; i < 3; ++i) recorder.Release();
  REQUIRE(recorder.WaitSteps(12));
  CHECK(recorder.steps() ==
        std::vector<std::string>{"begin", "run m/1", "end", "finish m/1 OK 2",           //
                                 "begin", "run m/2", "end", "finish m/2 UNAVAILABLE 0",  //
                                 "begin", "run n/7", "end", "finish n/7 OK 2"});
  worker.Stop();
  CHECK(metrics.Histograms().at("refit_transfer_seconds").count == 3);
}

TEST_CASE("Transfers tells the pull in flight and the bytes received since it started") {
  Metrics metrics;
  metrics.Add(kDataBytesReceived, 1000);  // before the pull: not its bytes
  Recorder recorder;
  PullWorker worker(&recorder, &recorder, &recorder, &metrics);
  CHECK(worker.Transfers().empty());
  worker.Start();
  worker.Queue(Job("m", 3, 300));
  REQUIRE(recorder.WaitRunning());
  metrics.Add(kDataBytesReceived, 250);
  std::vector<Transfer> transfers = worker.Transfers();
  REQUIRE(transfers.size() == 1);
  CHECK(transfers[0].model == "m");
  CHECK(transfers[0].version == 3);
  CHECK(transfers[0].bytes_total == 600);
  CHECK(transfers[0].bytes_done == 250);
  metrics.Add(kDataBytesReceived, 10000);  // refetches count again: capped at the total
  CHECK(worker.Transfers().at(0).bytes_done == 600);
  recorder.Release();
  REQUIRE(recorder.WaitSteps(4));
  CHECK(worker.Transfers().empty());
}

TEST_CASE("Stop waits for the pull in flight; nothing runs after it") {
  Metrics metrics;
  Recorder recorder;
  PullWorker worker(&recorder, &recorder, &recorder, &metrics);
  worker.Start();
  worker.Queue(Job("m", 1, 10));
  REQUIRE(recorder.WaitRunning());
  std::thread stopper([&worker] { worker.Stop(); });
  recorder.Release();  // the caller of Stop makes the pull end (it drops the endpoints)
  stopper.join();
  const std::vector<std::string> done{"begin", "run m/1", "end", "finish m/1 OK 2"};
  CHECK(recorder.steps() == done);
  worker.Queue(Job("m", 4, 10));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  CHECK(recorder.steps() == done);
  CHECK(worker.Transfers().empty());
}

}  // namespace
}  // namespace refit::peer
