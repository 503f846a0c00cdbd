#pragma once

// The file descriptors local callers passed to refitd (fd_exchange.h) and not yet named in a
// RegisterBuffer: each held under an unguessable token that belongs to the uid that passed it.
// A token is good for one Redeem by that uid, within `ttl`; then refitd closes the fd. Each uid
// may hold at most `max_per_uid` fds here, and all uids together `max_total`, so no caller can
// make refitd run out of descriptors.
//
// Owns every fd it holds (closed at Redeem's hand-over, expiry or destruction).
// Thread-safety: every method may be called from any thread.

#include <sys/types.h>

#include <chrono>
#include <cstddef>
#include <functional>
#include <map>
#include <string>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "daemon/common/mutex.h"

namespace refit::callers {

struct FdTokenLimits {
  size_t max_per_uid = 64;
  size_t max_total = 1024;
  std::chrono::steady_clock::duration ttl = std::chrono::seconds(60);
};

class FdTokens {
 public:
  using Clock = std::chrono::steady_clock;
  using Limits = FdTokenLimits;

  explicit FdTokens(Limits limits = {}, std::function<Clock::time_point()> now = Clock::now);
  ~FdTokens();  // closes what is still held
  FdTokens(const FdTokens&) = delete;
  FdTokens& operator=(const FdTokens&) = delete;

  // Holds `fd` (owned from here, also on error: then it is closed) for `uid`; returns its
  // token, "memfd-" and 32 hex digits of getrandom(). RESOURCE_EXHAUSTED when the uid (or
  // everyone) holds too many already.
  // With `reserved`, `fd` takes the place of a Reserve of `uid` (no further check).
  absl::StatusOr<std::string> Deposit(uid_t uid, int fd, bool reserved = false);

  // Counts one fd that `uid` sent before its fd-passing preface was complete (held by the
  // connection, not yet under a token) against the same caps: RESOURCE_EXHAUSTED when they are
  // reached. Give it back with Unreserve, or hand it to Deposit.
  absl::Status Reserve(uid_t uid);
  void Unreserve(uid_t uid);

  // Hands the fd held under `token` to the caller (who closes it) and forgets the token.
  // NOT_FOUND for a token never issued or expired; PERMISSION_DENIED when another uid passed
  // it (the token stays good for its owner).
  absl::StatusOr<int> Redeem(uid_t uid, const std::string& token);

  // Closes the fds whose tokens are past their ttl (Deposit and Redeem do this too).
  void Expire();

  size_t held() const;      // fds held now under tokens, for tests and metrics
  size_t reserved() const;  // fds counted by Reserve now
  const Limits& limits() const { return limits_; }

 private:
  struct Entry {
    uid_t uid;
    int fd;
    Clock::time_point expires;
  };
  void ExpireLocked(Clock::time_point now) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // RESOURCE_EXHAUSTED when `uid` (or everyone) may hold no more.
  absl::Status CheckRoomLocked(uid_t uid) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const Limits limits_;
  const std::function<Clock::time_point()> now_;
  mutable common::Mutex mu_;
  std::map<std::string, Entry> by_token_ ABSL_GUARDED_BY(mu_);
  std::map<uid_t, size_t> count_ ABSL_GUARDED_BY(mu_);  // tokens and reservations
  size_t reserved_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace refit::callers
