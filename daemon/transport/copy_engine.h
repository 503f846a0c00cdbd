#pragma once

// A few threads that copy between two host mappings and report when each copy is done. The UCX
// backend uses it for peer memory that ucp_rkey_ptr mapped into this process (a peer on the same
// host whose memory UCX allocated as shared memory): such a get or put is a plain memcpy, and
// running it here, on several cores, beats UCX's own protocol, which copies on the thread that
// calls ucp_worker_progress.
//
// Submit never blocks. Threads start with the first job. Safe from any thread.

#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <thread>
#include <vector>

#include "daemon/common/mutex.h"
#include "daemon/transport/transport.h"

namespace refit::transport {

class CopyEngine {
 public:
  struct Job {
    uint8_t* dst = nullptr;
    const uint8_t* src = nullptr;
    uint64_t length = 0;
    void* tag = nullptr;  // handed back by Drain
    // Set (by the owner of dst) when the copy is no longer wanted: a job not yet started is
    // then skipped, though still handed back.
    const std::atomic<bool>* abandon = nullptr;
    // Decremented once the job will never touch dst again; the owner waits for it to reach
    // zero before it frees dst.
    std::atomic<uint64_t>* running = nullptr;
    // Also compute XXH3-64 of the copied bytes (block by block, each right after its copy), or
    // with `spans`, of each span.
    bool hash = false;
    // When set: copy each span instead (dst and src are then the bases).
    std::shared_ptr<const std::vector<Span>> spans;
  };
  struct Finished {
    void* tag;
    bool hashed = false;  // copied (not skipped) with Job::hash: xxh3 is the copy's digest,
    uint64_t xxh3 = 0;    // or span_xxh3 holds each span's
    std::vector<uint64_t> span_xxh3{};
  };

  explicit CopyEngine(int threads);
  ~CopyEngine();  // Stop()
  // Joins the threads; jobs still queued are dropped (not handed back). Drain still works.
  void Stop();
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  void Submit(const Job& job);
  // Appends finished (or skipped) jobs; returns how many.
  size_t Drain(std::vector<Finished>* out);

  // min(hardware threads, 4): a memcpy is bound by memory bandwidth beyond a few cores.
  static int DefaultThreads();

 private:
  void Run();

  const int threads_wanted_;
  common::Mutex mu_;
  common::CondVar wake_;
  std::deque<Job> queue_ ABSL_GUARDED_BY(mu_);
  std::vector<Finished> done_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> threads_;
  int idle_ ABSL_GUARDED_BY(mu_) = 0;  // threads waiting for a job
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
};

}  // namespace refit::transport
