#include "daemon/callers/fd_tokens.h"

#include <sys/random.h>
#include <unistd.h>

#include <cstdint>
#include <random>

#include "absl/strings/escaping.h"
#include "absl/strings/str_cat.h"

namespace refit::callers {
namespace {

// 128 random bits: nobody guesses another caller's token (and a guess is refused by uid too).
std::string NewToken() {
  uint8_t bytes[16];
  if (getrandom(bytes, sizeof(bytes), 0) != static_cast<ssize_t>(sizeof(bytes))) {
    std::random_device device;
    for (uint8_t& b : bytes) b = static_cast<uint8_t>(device());
  }
  return absl::StrCat("memfd-", absl::BytesToHexString(absl::string_view(
                                    reinterpret_cast<const char*>(bytes), sizeof(bytes))));
}

}  // namespace

FdTokens::FdTokens(Limits limits, std::function<Clock::time_point()> now)
    : limits_(limits), now_(std::move(now)) {}

FdTokens::~FdTokens() {
  common::MutexLock lock(mu_);
  for (auto& [token, entry] : by_token_) close(entry.fd);
}

absl::Status FdTokens::CheckRoomLocked(uid_t uid) {
  auto it = count_.find(uid);
  const size_t count = it == count_.end() ? 0 : it->second;
  if (count < limits_.max_per_uid && by_token_.size() + reserved_ < limits_.max_total) {
    return absl::OkStatus();
  }
  const bool mine = count >= limits_.max_per_uid;
  return absl::ResourceExhaustedError(
      absl::StrCat(mine ? absl::StrCat("uid ", uid, " holds ", limits_.max_per_uid)
                        : absl::StrCat("callers hold ", limits_.max_total),
                   " passed memfds not yet named in a RegisterBuffer; register them (or wait ",
                   std::chrono::duration_cast<std::chrono::seconds>(limits_.ttl).count(),
                   " s for them to expire) before passing more"));
}

absl::StatusOr<std::string> FdTokens::Deposit(uid_t uid, int fd, bool reserved) {
  common::MutexLock lock(mu_);
  const Clock::time_point now = now_();
  ExpireLocked(now);
  if (reserved) {
    --reserved_;  // the reservation becomes the token: count_ already holds it
  } else if (absl::Status room = CheckRoomLocked(uid); !room.ok()) {
    close(fd);
    return room;
  } else {
    ++count_[uid];
  }
  std::string token = NewToken();
  by_token_[token] = Entry{uid, fd, now + limits_.ttl};
  return token;
}

absl::Status FdTokens::Reserve(uid_t uid) {
  common::MutexLock lock(mu_);
  ExpireLocked(now_());
  if (absl::Status room = CheckRoomLocked(uid); !room.ok()) return room;
  ++count_[uid];
  ++reserved_;
  return absl::OkStatus();
}

void FdTokens::Unreserve(uid_t uid) {
  common::MutexLock lock(mu_);
  auto it = count_.find(uid);
  if (it == count_.end() || reserved_ == 0) return;
  --reserved_;
  if (--it->second == 0) count_.erase(it);
}

absl::StatusOr<int> FdTokens::Redeem(uid_t uid, const std::string& token) {
  common::MutexLock lock(mu_);
  ExpireLocked(now_());
  auto it = by_token_.find(token);
  if (it == by_token_.end()) {
    return absl::NotFoundError(
        absl::StrCat("memfd token '", token.substr(0, 64),
                     "' is unknown or expired (a token is good for one RegisterBuffer within ",
                     std::chrono::duration_cast<std::chrono::seconds>(limits_.ttl).count(),
                     " s of passing the fd)"));
  }
  if (it->second.uid != uid) {
    return absl::PermissionDeniedError(absl::StrCat("memfd token ", token, " was passed by uid ",
                                                    it->second.uid, "; uid ", uid,
                                                    " may not register it"));
  }
  const int fd = it->second.fd;
  if (--count_[uid] == 0) count_.erase(uid);
  by_token_.erase(it);
  return fd;
}

void FdTokens::Expire() {
  common::MutexLock lock(mu_);
  ExpireLocked(now_());
}

void FdTokens::ExpireLocked(Clock::time_point now) {
  for (auto it = by_token_.begin(); it != by_token_.end();) {
    if (it->second.expires > now) {
      ++it;
      continue;
    }
    close(it->second.fd);
    if (--count_[it->second.uid] == 0) count_.erase(it->second.uid);
    it = by_token_.erase(it);
  }
}

size_t FdTokens::reserved() const {
  common::MutexLock lock(mu_);
  return reserved_;
}

size_t FdTokens::held() const {
  common::MutexLock lock(mu_);
  return by_token_.size();
}

}  // namespace refit::callers
