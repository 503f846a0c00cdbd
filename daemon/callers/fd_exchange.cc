#include "daemon/callers/fd_exchange.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "daemon/common/logging.h"

namespace refit::callers {
namespace {

constexpr int kMaxFdsPerMessage = 4;  // more than one is refused; the rest are closed

}  // namespace

FdExchange::FdExchange(Policy policy, std::shared_ptr<FdTokens> tokens, ExchangeLimits limits)
    : policy_(std::move(policy)), tokens_(std::move(tokens)), limits_(limits) {}

FdExchange::~FdExchange() { StopSorting(); }

void FdExchange::StartSorting(std::function<void(int)> route) {
  route_ = std::move(route);
  wake_fd_ = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  thread_ = std::thread([this] { Sort(); });
}

void FdExchange::StopSorting() {
  if (!thread_.joinable()) return;
  stop_.store(true);
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
  thread_.join();
  close(wake_fd_);
  wake_fd_ = -1;
}

int FdExchange::Classify(int fd, bool* partial) {
  char bytes[kHttp2PrefaceBytes];
  const ssize_t n = recv(fd, bytes, sizeof(bytes), MSG_PEEK | MSG_DONTWAIT);
  *partial = false;
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return 0;
  if (n <= 0) return 1;  // closed, or an error: gRPC (or the caller) cleans up
  if (bytes[0] == kFdPreface[0]) return -1;
  // gRPC's, complete; or not a preface at all (gRPC refuses it): gRPC's from here.
  if (std::memcmp(bytes, kHttp2Preface, static_cast<size_t>(n)) != 0) return 1;
  if (static_cast<size_t>(n) == kHttp2PrefaceBytes) return 1;
  *partial = true;  // a start of gRPC's preface: wait for the rest
  return 0;
}

bool FdExchange::Divert(int fd) {
  if (!thread_.joinable() || stop_.load()) return false;
  bool partial = false;
  if (Classify(fd, &partial) == 1) return false;  // gRPC's, preface complete
  Waiting w;
  w.fd = fd;
  ucred cred{};
  socklen_t len = sizeof(cred);
  w.known = getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0;
  w.uid = w.known ? cred.uid : static_cast<uid_t>(-1);
  w.partial = partial;
  w.deadline = std::chrono::steady_clock::now() + limits_.first_bytes_timeout;
  const uid_t uid = w.uid;
  bool full = false, uid_full = false;
  {
    common::MutexLock lock(mu_);
    size_t& mine = waiting_by_uid_[uid];
    if (waiting_count_.load() >= limits_.max_waiting) {
      full = true;
    } else if (mine >= limits_.max_waiting_per_uid) {
      uid_full = true;
    } else {
      ++mine;
      ++waiting_count_;
      incoming_.push_back(std::move(w));
    }
    if (mine == 0) waiting_by_uid_.erase(uid);
  }
  if (full || uid_full) {
    bool& logged = full ? logged_full_ : logged_uid_full_[uid];
    if (!logged) {
      logged = true;
      Logger("server")->warn(
          "{} local connections{} have not finished their first message yet; closing new "
          "ones{} until they do (or time out after {} ms)",
          full ? limits_.max_waiting : limits_.max_waiting_per_uid,
          full ? "" : absl::StrCat(" of uid ", uid), full ? "" : " of that uid",
          limits_.first_bytes_timeout.count());
    }
    close(fd);
    return true;
  }
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
  return true;
}

void FdExchange::Done(const Waiting& w) {
  common::MutexLock lock(mu_);
  auto it = waiting_by_uid_.find(w.uid);
  if (it != waiting_by_uid_.end() && --it->second == 0) waiting_by_uid_.erase(it);
  --waiting_count_;
}

void FdExchange::Sort() {
  std::vector<Waiting> waiting;
  std::vector<pollfd> polled;
  while (!stop_.load()) {
    {
      common::MutexLock lock(mu_);
      for (Waiting& w : incoming_) waiting.push_back(std::move(w));
      incoming_.clear();
    }
    // A connection with part of gRPC's preface stays readable (the bytes are only peeked): it
    // is polled for errors only, and looked at again every 20 ms.
    bool any_partial = false;
    polled.assign(1, pollfd{wake_fd_, POLLIN, 0});
    for (const Waiting& w : waiting) {
      polled.push_back(pollfd{w.fd, static_cast<short>(w.partial ? 0 : POLLIN), 0});
      any_partial = any_partial || w.partial;
    }
    if (poll(polled.data(), polled.size(), any_partial ? 20 : 200) < 0 && errno != EINTR) break;
    if (polled[0].revents) {
      uint64_t count;
      (void)!read(wake_fd_, &count, sizeof(count));
    }
    const auto now = std::chrono::steady_clock::now();
    size_t kept = 0;
    for (size_t i = 0; i < waiting.size(); ++i) {
      Waiting& w = waiting[i];
      bool done;
      if (w.partial && (polled[i + 1].revents & (POLLHUP | POLLERR))) {
        Drop(w);  // gone before its preface was complete: it never will be
        done = true;
      } else if (polled[i + 1].revents || w.partial) {
        done = Advance(w);
      } else {
        done = false;
      }
      if (!done && now >= w.deadline) {
        Logger("server")->debug(
            "a local connection (uid {}) did not finish its first message in {} ms; closed", w.uid,
            limits_.first_bytes_timeout.count());
        Drop(w);
        done = true;
      }
      if (done) {
        Done(w);
      } else {
        if (kept != i) waiting[kept] = std::move(w);
        ++kept;
      }
    }
    waiting.resize(kept);
    tokens_->Expire();
  }
  common::MutexLock lock(mu_);
  for (Waiting& w : incoming_) waiting.push_back(std::move(w));
  incoming_.clear();
  for (Waiting& w : waiting) Drop(w);
  waiting_count_ = 0;
  waiting_by_uid_.clear();
}

void FdExchange::Drop(Waiting& w) {
  for (int fd : w.passed) {
    if (fd < 0) continue;
    close(fd);
    tokens_->Unreserve(w.uid);
  }
  w.passed.clear();
  if (w.fd >= 0) close(w.fd);
  w.fd = -1;
}

void FdExchange::Refuse(Waiting& w, const absl::Status& why) {
  std::string line = absl::StrCat("ERR ", absl::StatusCodeToString(why.code()), " ",
                                  absl::StrReplaceAll(why.message(), {{"\n", " "}}), "\n");
  // Tiny, into an empty socket buffer: it fits, or the client is gone.
  (void)!send(w.fd, line.data(), line.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
  Drop(w);
}

bool FdExchange::Advance(Waiting& w) {
  if (!w.ours) {
    const int kind = Classify(w.fd, &w.partial);
    if (kind == 0) return false;
    if (kind == 1) {
      route_(w.fd);  // gRPC's: its server owns the fd now
      w.fd = -1;
      return true;
    }
    w.ours = true;
    w.partial = false;
    // The policy at the first byte: a refused uid's connection holds nothing.
    auto caller = PeerOf(w.fd);
    if (!caller.ok() || !policy_.Allows(*caller)) {
      if (caller.ok() && !logged_refusal_[caller->uid]) {
        logged_refusal_[caller->uid] = true;  // once per uid: no log floods
        Logger("server")->warn("local caller {} may not pass memfds (allowed: {})",
                               caller->Describe(), policy_.Describe());
      }
      Refuse(w, caller.ok() ? absl::PermissionDeniedError(absl::StrCat(
                                  "this local caller (", caller->Describe(),
                                  ") is not allowed to use refitd (allowed: ", policy_.Describe(),
                                  "; see --allow-uids and --allow-gids)"))
                            : caller.status());
      return true;
    }
  }
  char bytes[kFdPrefaceBytes];
  iovec iov{bytes, kFdPrefaceBytes - w.preface.size()};
  alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * kMaxFdsPerMessage)];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = control;
  msg.msg_controllen = sizeof(control);
  const ssize_t n = recvmsg(w.fd, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return false;
  // Every fd that arrives is counted against the token caps at once; a second one, or one past
  // the caps, ends the connection (no connection holds more than one).
  absl::Status refused;
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); n >= 0 && c; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      if (!refused.ok()) {
        close(fd);
      } else if (!w.passed.empty()) {
        close(fd);
        refused = absl::InvalidArgumentError(
            "pass exactly one fd (SCM_RIGHTS) with the preface, not 2 or more");
      } else if (absl::Status room = tokens_->Reserve(w.uid); !room.ok()) {
        close(fd);
        refused = room;
      } else {
        w.passed.push_back(fd);
      }
    }
  }
  if (n <= 0) {
    Drop(w);
    return true;
  }
  if (refused.ok() && (msg.msg_flags & MSG_CTRUNC)) {
    refused = absl::InvalidArgumentError(
        "pass exactly one fd (SCM_RIGHTS) with the preface, not 2 or more");
  }
  if (!refused.ok()) {
    Refuse(w, refused);
    return true;
  }
  w.preface.append(bytes, static_cast<size_t>(n));
  if (w.preface.size() < kFdPrefaceBytes) return false;
  Answer(w);
  return true;
}

void FdExchange::Answer(Waiting& w) {
  absl::StatusOr<std::string> token;
  auto caller = PeerOf(w.fd);
  if (w.preface != std::string(kFdPreface, kFdPrefaceBytes)) {
    token = absl::InvalidArgumentError(
        "neither gRPC nor refit's fd passing (send \"REFITFD1\" with one fd, SCM_RIGHTS)");
  } else if (!caller.ok()) {
    token = caller.status();
  } else if (w.passed.size() != 1) {
    token = absl::InvalidArgumentError("pass exactly one fd (SCM_RIGHTS) with the preface, not 0");
  } else {
    struct stat st {};
    if (fstat(w.passed[0], &st) != 0 || !S_ISREG(st.st_mode)) {
      token = absl::InvalidArgumentError(
          "the passed fd is not a memory file (make it with memfd_create and seal it)");
    } else {
      // Owns the fd, also on error; the reservation made as it arrived becomes the token.
      token = tokens_->Deposit(w.uid, w.passed[0], /*reserved=*/true);
      w.passed.clear();
      if (token.ok()) {
        Logger("server")->debug("memfd of {} bytes passed by {}", st.st_size, caller->Describe());
      }
    }
  }
  if (!token.ok()) {
    Refuse(w, token.status());
    return;
  }
  const std::string line = absl::StrCat("OK ", *token, "\n");
  (void)!send(w.fd, line.data(), line.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
  Drop(w);
}

}  // namespace refit::callers
