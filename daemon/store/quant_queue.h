#pragma once

// The quantizer's queue and thread (issue 38: the store split along its seams): versions of
// models with fp8 destinations waiting to be quantized before they complete, and pending
// versions whose published pieces are quantized early. An object with its own lock; what a job
// does is the store's (QuantQueue::Worker, implemented by Store; `V` is its version record).
//
// Lock order (docs/architecture.md, "The store's parts and their locks"): Store::mu_, then
// QuantQueue::mu_ (the store pushes under its lock). The thread calls the worker with no lock
// of the queue held, and the worker takes the store's.

#include <deque>
#include <memory>
#include <string>
#include <thread>
#include <utility>

#include "daemon/common/mutex.h"

namespace refit {

template <typename V>
class QuantQueue {
 public:
  // A job: `version` of `model`; `early`: a pending version's published pieces only.
  struct Job {
    std::string model;
    std::shared_ptr<const V> version;
    bool early = false;
  };
  // Runs each job on the queue's thread, one at a time: every whole version queued before any
  // early one, each kind in order.
  class Worker {
   public:
    virtual ~Worker() = default;
    virtual void Quantize(Job job) = 0;
  };

  explicit QuantQueue(Worker* worker) : worker_(worker) {}
  ~QuantQueue() { Stop(); }
  QuantQueue(const QuantQueue&) = delete;
  QuantQueue& operator=(const QuantQueue&) = delete;

  // Queues `job`; the thread starts with the first one.
  void Push(Job job) {
    common::MutexLock lock(mu_);
    (job.early ? early_ : whole_).push_back(std::move(job));
    if (!thread_.joinable()) thread_ = std::thread([this] { Run(); });
    wake_.NotifyOne();
  }
  // The thread ends after the job it runs (if any); jobs left are dropped.
  void Shutdown() {
    common::MutexLock lock(mu_);
    shutdown_ = true;
    wake_.NotifyAll();
  }
  // Shutdown, then waits for the thread. Not under any lock the worker takes.
  void Stop() {
    std::thread thread;
    {
      common::MutexLock lock(mu_);
      shutdown_ = true;
      wake_.NotifyAll();
      thread = std::move(thread_);
    }
    if (thread.joinable()) thread.join();
  }

 private:
  void Run() {
    while (true) {
      Job job;
      {
        common::UniqueLock lock(mu_);
        wake_.Wait(lock, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return shutdown_ || !whole_.empty() || !early_.empty();
        });
        if (shutdown_) return;
        std::deque<Job>& from = whole_.empty() ? early_ : whole_;
        job = std::move(from.front());
        from.pop_front();
      }
      worker_->Quantize(std::move(job));
    }
  }

  Worker* const worker_;
  common::Mutex mu_;
  common::CondVar wake_;
  bool shutdown_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<Job> whole_ ABSL_GUARDED_BY(mu_);  // versions to finish before they complete
  std::deque<Job> early_ ABSL_GUARDED_BY(mu_);  // pending versions' pieces so far
  std::thread thread_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit
