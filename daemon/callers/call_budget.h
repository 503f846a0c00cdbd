#pragma once

// How many long-lived calls local callers may hold open at once: the calls that wait
// (WaitForVersion, WaitForReplicas) or stream until something happens (Watch, grpc.health.v1
// Watch). Each holds one of gRPC's synchronous-server threads for as long as it is open, so
// without a bound any local process could hold every thread refitd has. A call past a bound is
// answered RESOURCE_EXHAUSTED at once, saying which bound; the caller's other calls, and every
// other caller, are untouched.
//
// Three bounds: per client process (uid and pid), per uid (all its processes together, and
// processes refitd cannot see), and in all.
//
// Thread-safety: every method may be called from any thread.

#include <sys/types.h>

#include <cstddef>
#include <map>
#include <string>
#include <utility>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "daemon/callers/caller.h"
#include "daemon/common/mutex.h"

namespace refit::callers {

struct CallLimits {
  size_t per_process = 32;
  size_t per_uid = 256;
  size_t total = 1024;
};

class CallBudget {
 public:
  explicit CallBudget(CallLimits limits = {}) : limits_(limits) {}
  CallBudget(const CallBudget&) = delete;
  CallBudget& operator=(const CallBudget&) = delete;

  // One long-lived call, counted while it lives (move-only; releases on destruction).
  class Hold {
   public:
    Hold() = default;
    Hold(Hold&& other) noexcept { *this = std::move(other); }
    Hold& operator=(Hold&& other) noexcept;
    ~Hold() { Release(); }
    void Release();

   private:
    friend class CallBudget;
    CallBudget* budget_ = nullptr;
    uid_t uid_ = 0;
    pid_t pid_ = 0;
  };

  // Counts a call of `caller` (pid 0: a process refitd cannot see, counted per uid only), or
  // RESOURCE_EXHAUSTED naming the bound it would pass and the call (`what`).
  absl::StatusOr<Hold> Acquire(const Caller& caller, const char* what);

  size_t held() const;  // calls held now, in all
  size_t held_by_uid(uid_t uid) const;
  const CallLimits& limits() const { return limits_; }

 private:
  void Return(uid_t uid, pid_t pid);
  // True when the memory of many ended calls should be given back (malloc_trim).
  bool ReturnLocked(uid_t uid, pid_t pid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  static constexpr size_t kTrimAfter = 16;  // calls held at once since the last trim

  const CallLimits limits_;
  mutable common::Mutex mu_;
  size_t total_ ABSL_GUARDED_BY(mu_) = 0;
  size_t peak_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uid_t, size_t> by_uid_ ABSL_GUARDED_BY(mu_);
  std::map<std::pair<uid_t, pid_t>, size_t> by_process_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::callers
