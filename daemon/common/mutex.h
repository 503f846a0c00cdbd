// Mutexes whose locking clang can check (-Wthread-safety, scripts/check/check-thread-safety.sh).
//
// libstdc++'s std::mutex carries no capability attribute, so ABSL_GUARDED_BY(mu_) on a std::mutex
// is a comment the compiler cannot read. These thin wrappers keep std::mutex and
// std::condition_variable underneath (same speed, same semantics) and add the annotations from
// absl/base/thread_annotations.h:
//
//   common::Mutex mu_;
//   int queued_ ABSL_GUARDED_BY(mu_) = 0;
//   void DrainLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
//
//   { common::MutexLock lock(mu_); ++queued_; }        // a std::lock_guard
//   common::UniqueLock lock(mu_);                      // a std::unique_lock: for a CondVar, or to
//   wake_.Wait(lock, [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; });   // unlock early
//
// A lambda passed as a wait predicate is analysed as a function of its own: annotate it with
// ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) as above (the condition variable calls it with the lock held).
// With GCC the annotations expand to nothing.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "absl/base/thread_annotations.h"

namespace refit::common {

class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }
  bool try_lock() ABSL_EXCLUSIVE_TRYLOCK_FUNCTION(true) { return mu_.try_lock(); }

  // Tells the analysis that the caller holds this mutex where it cannot see it (a callback run
  // under the lock by code it does not analyse). Checks nothing at run time.
  void AssertHeld() const ABSL_ASSERT_EXCLUSIVE_LOCK() {}

 private:
  friend class UniqueLock;
  std::mutex mu_;
};

// Holds a Mutex for its scope (std::lock_guard).
class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex& mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_.lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex& mu_;
};

// Holds a Mutex for its scope, may let go of it and take it again, and is what a CondVar waits
// with (std::unique_lock).
class ABSL_SCOPED_LOCKABLE UniqueLock {
 public:
  explicit UniqueLock(Mutex& mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : lock_(mu.mu_) {}
  ~UniqueLock() ABSL_UNLOCK_FUNCTION() = default;
  UniqueLock(const UniqueLock&) = delete;
  UniqueLock& operator=(const UniqueLock&) = delete;

  void lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { lock_.lock(); }
  void unlock() ABSL_UNLOCK_FUNCTION() { lock_.unlock(); }

 private:
  friend class CondVar;
  std::unique_lock<std::mutex> lock_;
};

// std::condition_variable over a UniqueLock.
class CondVar {
 public:
  void NotifyOne() { cv_.notify_one(); }
  void NotifyAll() { cv_.notify_all(); }

  void Wait(UniqueLock& lock) { cv_.wait(lock.lock_); }
  template <typename Predicate>
  void Wait(UniqueLock& lock, Predicate ready) {
    cv_.wait(lock.lock_, std::move(ready));
  }
  // The forms with a predicate return its last value (false: the time ran out first).
  template <typename Rep, typename Period>
  std::cv_status WaitFor(UniqueLock& lock, std::chrono::duration<Rep, Period> timeout) {
    return cv_.wait_for(lock.lock_, timeout);
  }
  template <typename Rep, typename Period, typename Predicate>
  bool WaitFor(UniqueLock& lock, std::chrono::duration<Rep, Period> timeout, Predicate ready) {
    return cv_.wait_for(lock.lock_, timeout, std::move(ready));
  }
  template <typename Clock, typename Duration, typename Predicate>
  bool WaitUntil(UniqueLock& lock, std::chrono::time_point<Clock, Duration> deadline,
                 Predicate ready) {
    return cv_.wait_until(lock.lock_, deadline, std::move(ready));
  }
  template <typename Clock, typename Duration>
  std::cv_status WaitUntil(UniqueLock& lock, std::chrono::time_point<Clock, Duration> deadline) {
    return cv_.wait_until(lock.lock_, deadline);
  }

 private:
  std::condition_variable cv_;
};

}  // namespace refit::common
