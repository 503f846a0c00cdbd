#include "daemon/common/worker_loop.h"

#include <pthread.h>

#include "daemon/common/logging.h"

namespace refit {

WorkerLoop::WorkerLoop(Options options) : options_(std::move(options)) {
  pending_ = options_.run_at_start;
}

WorkerLoop::~WorkerLoop() { Stop(); }

void WorkerLoop::Start(std::function<void()> step) {
  {
    common::MutexLock lock(mu_);
    if (stop_ || thread_.joinable()) return;
  }
  step_ = std::move(step);
  thread_ = std::thread([this] { Run(); });
  // Linux limits thread names to 15 characters; a longer name is cut.
  pthread_setname_np(thread_.native_handle(), options_.name.substr(0, 15).c_str());
}

void WorkerLoop::Notify() {
  {
    common::MutexLock lock(mu_);
    pending_ = true;
  }
  wake_.NotifyAll();
}

void WorkerLoop::Stop() {
  {
    common::MutexLock lock(mu_);
    stop_ = true;
  }
  wake_.NotifyAll();
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

void WorkerLoop::Run() {
  while (true) {
    {
      common::UniqueLock lock(mu_);
      auto ready = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || pending_; };
      if (options_.period.count() > 0) {
        wake_.WaitFor(lock, options_.period, ready);
      } else {
        wake_.Wait(lock, ready);
      }
      if (stop_) break;
      pending_ = false;
    }
    step_();
  }
  Logger("worker")->debug("{} stopped", options_.name);
}

}  // namespace refit
