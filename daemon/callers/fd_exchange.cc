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

void CloseAll(std::vector<int>& fds) {
  for (int fd : fds) close(fd);
  fds.clear();
}

}  // namespace

FdExchange::FdExchange(Policy policy, std::shared_ptr<FdTokens> tokens)
    : policy_(std::move(policy)), tokens_(std::move(tokens)) {}

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

bool FdExchange::Divert(int fd) {
  char first = 0;
  const ssize_t n = recv(fd, &first, 1, MSG_PEEK | MSG_DONTWAIT);
  const bool unknown = n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
  if (!thread_.joinable() || stop_.load() || !(unknown || (n == 1 && first == kFdPreface[0]))) {
    return false;  // gRPC's (or a closed connection, which gRPC handles)
  }
  if (waiting_count_.load() >= kMaxWaiting) {
    if (!logged_full_) {
      logged_full_ = true;
      Logger("server")->warn(
          "{} local connections have said nothing yet; closing new ones "
          "until they do (or time out after {} s)",
          kMaxWaiting, kFirstBytesTimeout.count());
    }
    close(fd);
    return true;
  }
  Waiting w;
  w.fd = fd;
  w.deadline = std::chrono::steady_clock::now() + kFirstBytesTimeout;
  ++waiting_count_;
  {
    common::MutexLock lock(mu_);
    incoming_.push_back(std::move(w));
  }
  const uint64_t one = 1;
  (void)!write(wake_fd_, &one, sizeof(one));
  return true;
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
    polled.assign(1, pollfd{wake_fd_, POLLIN, 0});
    for (const Waiting& w : waiting) polled.push_back(pollfd{w.fd, POLLIN, 0});
    if (poll(polled.data(), polled.size(), 200) < 0 && errno != EINTR) break;
    if (polled[0].revents) {
      uint64_t count;
      (void)!read(wake_fd_, &count, sizeof(count));
    }
    const auto now = std::chrono::steady_clock::now();
    size_t kept = 0;
    for (size_t i = 0; i < waiting.size(); ++i) {
      Waiting& w = waiting[i];
      bool done;
      if (polled[i + 1].revents) {
        done = Advance(w);
      } else if (now >= w.deadline) {
        Logger("server")->debug("a local connection said nothing for {} s; closed",
                                kFirstBytesTimeout.count());
        Drop(w);
        done = true;
      } else {
        done = false;
      }
      if (done) {
        --waiting_count_;
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
}

void FdExchange::Drop(Waiting& w) {
  CloseAll(w.passed);
  close(w.fd);
  w.fd = -1;
}

bool FdExchange::Advance(Waiting& w) {
  if (!w.ours) {
    char first = 0;
    const ssize_t n = recv(w.fd, &first, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return false;
    if (n <= 0) {
      Drop(w);
      return true;
    }
    if (first != kFdPreface[0]) {
      route_(w.fd);  // gRPC's: its server owns the fd now
      w.fd = -1;
      return true;
    }
    w.ours = true;
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
  for (cmsghdr* c = CMSG_FIRSTHDR(&msg); n >= 0 && c; c = CMSG_NXTHDR(&msg, c)) {
    if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
    const size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t i = 0; i < count; ++i) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(int));
      w.passed.push_back(fd);
    }
  }
  if (n <= 0) {
    Drop(w);
    return true;
  }
  if (msg.msg_flags & MSG_CTRUNC) w.passed.push_back(-1);  // more than we take: refused below
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
  } else if (!policy_.Allows(*caller)) {
    if (!logged_refusal_[caller->uid]) {
      logged_refusal_[caller->uid] = true;  // once per uid: no log floods
      Logger("server")->warn("local caller {} may not pass memfds (allowed: {})",
                             caller->Describe(), policy_.Describe());
    }
    token = absl::PermissionDeniedError(absl::StrCat(
        "this local caller (", caller->Describe(), ") is not allowed to use refitd (allowed: ",
        policy_.Describe(), "; see --allow-uids and --allow-gids)"));
  } else if (w.passed.size() != 1 || w.passed[0] < 0) {
    token = absl::InvalidArgumentError(absl::StrCat(
        "pass exactly one fd (SCM_RIGHTS) with the preface, not ",
        std::count_if(w.passed.begin(), w.passed.end(), [](int fd) { return fd >= 0; }),
        w.passed.size() > 1 ? " or more" : ""));
  } else {
    struct stat st {};
    if (fstat(w.passed[0], &st) != 0 || !S_ISREG(st.st_mode)) {
      token = absl::InvalidArgumentError(
          "the passed fd is not a memory file (make it with memfd_create and seal it)");
    } else {
      token = tokens_->Deposit(caller->uid, w.passed[0]);  // owns the fd, also on error
      w.passed.clear();
      if (token.ok()) {
        Logger("server")->debug("memfd of {} bytes passed by {}", st.st_size, caller->Describe());
      }
    }
  }
  std::string line =
      token.ok() ? absl::StrCat("OK ", *token)
                 : absl::StrCat("ERR ", absl::StatusCodeToString(token.status().code()), " ",
                                absl::StrReplaceAll(token.status().message(), {{"\n", " "}}));
  line += "\n";
  // Tiny, into an empty socket buffer: it fits, or the client is gone.
  (void)!send(w.fd, line.data(), line.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
  Drop(w);
}

}  // namespace refit::callers
