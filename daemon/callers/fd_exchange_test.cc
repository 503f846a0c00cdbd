// The token table of passed fds (expiry, bounds, uids) and the connection sorting of
// FdExchange over socketpairs: fd passing answered with a token, gRPC routed on, garbage and
// extra fds refused.

#include "daemon/callers/fd_exchange.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "catch2/catch.hpp"
#include "daemon/callers/fd_tokens.h"

namespace refit::callers {
namespace {

// A pipe whose write end goes into the table: the read end sees EOF once the table closed it.
struct Pipe {
  Pipe() {
    int fds[2];
    REQUIRE(pipe2(fds, O_CLOEXEC | O_NONBLOCK) == 0);
    read_end = fds[0];
    write_end = fds[1];
  }
  ~Pipe() { close(read_end); }
  bool WriteEndClosed() const {
    char c;
    return read(read_end, &c, 1) == 0;
  }
  int read_end, write_end;
};

// Sends `bytes` with `fds` attached in one sendmsg.
void Send(int socket, const std::string& bytes, const std::vector<int>& fds) {
  iovec iov{const_cast<char*>(bytes.data()), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  std::vector<char> control(CMSG_SPACE(sizeof(int) * fds.size()));
  if (!fds.empty()) {
    msg.msg_control = control.data();
    msg.msg_controllen = control.size();
    cmsghdr* c = CMSG_FIRSTHDR(&msg);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
    std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
  }
  REQUIRE(sendmsg(socket, &msg, MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size()));
}

std::string ReadAll(int socket) {
  std::string out;
  char chunk[256];
  pollfd p{socket, POLLIN, 0};
  while (poll(&p, 1, 5000) == 1) {
    const ssize_t n = read(socket, chunk, sizeof(chunk));
    if (n <= 0) break;
    out.append(chunk, static_cast<size_t>(n));
  }
  return out;
}

Policy OnlyMe() {
  Policy policy;
  policy.daemon_uid = geteuid();
  return policy;
}

// A FdExchange with a recording `route`, and connections made with socketpair.
struct Exchange {
  explicit Exchange(ExchangeLimits limits = {}, FdTokens::Limits token_limits = {})
      : tokens(std::make_shared<FdTokens>(token_limits)), exchange(OnlyMe(), tokens, limits) {
    exchange.StartSorting([this](int fd) {
      std::lock_guard<std::mutex> lock(mu);
      routed.push_back(fd);
    });
  }
  ~Exchange() {
    exchange.StopSorting();
    for (int fd : routed) close(fd);
  }
  // Returns the client end; the server end went through Divert (or was routed at once).
  int Connect(const std::string& first_bytes = "", const std::vector<int>& fds = {}) {
    int pair[2];
    REQUIRE(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) == 0);
    REQUIRE(fcntl(pair[1], F_SETFL, O_NONBLOCK) == 0);
    if (!first_bytes.empty()) Send(pair[0], first_bytes, fds);
    if (!exchange.Divert(pair[1])) {
      std::lock_guard<std::mutex> lock(mu);
      routed.push_back(pair[1]);
      routed_at_once++;
    }
    return pair[0];
  }
  size_t Routed() {
    std::lock_guard<std::mutex> lock(mu);
    return routed.size();
  }
  std::shared_ptr<FdTokens> tokens;
  FdExchange exchange;
  std::mutex mu;
  std::vector<int> routed;
  int routed_at_once = 0;
};

}  // namespace

TEST_CASE("FdTokens: one redeem by the uid that passed it", "[callers][memfd]") {
  FdTokens tokens;
  Pipe p;
  auto token = tokens.Deposit(1000, p.write_end);
  REQUIRE(token.ok());
  REQUIRE(token->rfind("memfd-", 0) == 0);
  REQUIRE(token->size() == 6 + 32);
  // Another uid: refused, and the token stays good for its owner.
  REQUIRE(tokens.Redeem(1001, *token).status().code() == absl::StatusCode::kPermissionDenied);
  REQUIRE(tokens.Redeem(1000, "memfd-00000000000000000000000000000000").status().code() ==
          absl::StatusCode::kNotFound);
  auto fd = tokens.Redeem(1000, *token);
  REQUIRE(fd.ok());
  REQUIRE(*fd == p.write_end);
  REQUIRE(tokens.held() == 0);
  REQUIRE(tokens.Redeem(1000, *token).status().code() == absl::StatusCode::kNotFound);
  close(*fd);
}

TEST_CASE("FdTokens: unused tokens expire and their fds are closed", "[callers][memfd]") {
  auto now = FdTokens::Clock::now();
  FdTokens tokens(FdTokens::Limits{}, [&] { return now; });
  Pipe p;
  auto token = tokens.Deposit(1000, p.write_end);
  REQUIRE(token.ok());
  now += std::chrono::seconds(59);
  tokens.Expire();
  REQUIRE(tokens.held() == 1);
  REQUIRE_FALSE(p.WriteEndClosed());
  now += std::chrono::seconds(2);
  tokens.Expire();
  REQUIRE(tokens.held() == 0);
  REQUIRE(p.WriteEndClosed());
  REQUIRE(tokens.Redeem(1000, *token).status().code() == absl::StatusCode::kNotFound);
}

TEST_CASE("FdTokens: bounded per uid and in all", "[callers][memfd]") {
  FdTokens::Limits limits;
  limits.max_per_uid = 3;
  limits.max_total = 5;
  FdTokens tokens(limits);
  std::vector<Pipe> pipes(7);
  for (int i = 0; i < 3; ++i) REQUIRE(tokens.Deposit(1000, pipes[i].write_end).ok());
  auto refused = tokens.Deposit(1000, pipes[3].write_end);
  REQUIRE(refused.status().code() == absl::StatusCode::kResourceExhausted);
  REQUIRE(pipes[3].WriteEndClosed());  // owned also on error
  REQUIRE(tokens.Deposit(1001, pipes[4].write_end).ok());
  REQUIRE(tokens.Deposit(1002, pipes[5].write_end).ok());
  REQUIRE(tokens.Deposit(1003, pipes[6].write_end).status().code() ==
          absl::StatusCode::kResourceExhausted);
  REQUIRE(tokens.held() == 5);
}

TEST_CASE("FdExchange: a passed fd comes back as a token; gRPC goes on", "[callers][memfd]") {
  Exchange x;
  const int memfd = memfd_create("exchange-test", MFD_CLOEXEC | MFD_ALLOW_SEALING);
  REQUIRE(memfd >= 0);
  const int client = x.Connect(std::string(kFdPreface, kFdPrefaceBytes), {memfd});
  const std::string answer = ReadAll(client);
  close(client);
  REQUIRE(answer.rfind("OK memfd-", 0) == 0);
  REQUIRE(answer.back() == '\n');
  auto fd = x.tokens->Redeem(geteuid(), answer.substr(3, answer.size() - 4));
  REQUIRE(fd.ok());
  close(*fd);
  close(memfd);

  // gRPC's preface: routed at once when it is there, or from the sorting thread when it comes
  // after the connection was accepted.
  close(x.Connect("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"));
  REQUIRE(x.routed_at_once == 1);
  int pair[2];
  REQUIRE(socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, pair) == 0);
  REQUIRE(fcntl(pair[1], F_SETFL, O_NONBLOCK) == 0);
  REQUIRE(x.exchange.Divert(pair[1]));  // nothing said yet
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  REQUIRE(x.Routed() == 1);
  Send(pair[0], "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", {});
  for (int i = 0; i < 100 && x.Routed() < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  REQUIRE(x.Routed() == 2);
  close(pair[0]);
}

TEST_CASE("FdExchange: no fd, two fds or a wrong preface are refused", "[callers][memfd]") {
  Exchange x;
  const int a = memfd_create("a", MFD_CLOEXEC), b = memfd_create("b", MFD_CLOEXEC);
  int client = x.Connect(std::string(kFdPreface, kFdPrefaceBytes), {});
  REQUIRE(ReadAll(client).rfind("ERR INVALID_ARGUMENT pass exactly one fd", 0) == 0);
  close(client);
  client = x.Connect(std::string(kFdPreface, kFdPrefaceBytes), {a, b});
  REQUIRE(ReadAll(client).rfind("ERR INVALID_ARGUMENT pass exactly one fd", 0) == 0);
  close(client);
  client = x.Connect("RUBBISH!", {a});
  REQUIRE(ReadAll(client).rfind("ERR INVALID_ARGUMENT", 0) == 0);
  close(client);
  // The preface in two pieces, the fd with the first.
  client = x.Connect("REFI", {a});
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  Send(client, "TFD1", {});
  REQUIRE(ReadAll(client).rfind("OK memfd-", 0) == 0);
  close(client);
  REQUIRE(x.tokens->held() == 1);  // nothing kept of the refused ones
  REQUIRE(x.Routed() == 0);
  close(a);
  close(b);
}

TEST_CASE("FdExchange: gRPC gets a connection only once its preface is complete",
          "[callers][memfd][hostile]") {
  ExchangeLimits limits;
  limits.first_bytes_timeout = std::chrono::milliseconds(400);
  Exchange x(limits);
  const std::string preface(kHttp2Preface, kHttp2PrefaceBytes);
  // Part of it: held by the sorter, routed once the rest arrives.
  const int client = x.Connect(preface.substr(0, 5));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  REQUIRE(x.Routed() == 0);
  REQUIRE(x.exchange.waiting() == 1);
  Send(client, preface.substr(5), {});
  for (int i = 0; i < 100 && x.Routed() < 1; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  REQUIRE(x.Routed() == 1);
  for (int i = 0; i < 100 && x.exchange.waiting() > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));  // uncounted just after
  }
  REQUIRE(x.exchange.waiting() == 0);
  close(client);
  // One byte and a stall: closed after the timeout, never routed.
  const int stalled = x.Connect("P");
  const auto start = std::chrono::steady_clock::now();
  REQUIRE(ReadAll(stalled).empty());  // EOF
  const auto waited = std::chrono::steady_clock::now() - start;
  CHECK(waited >= std::chrono::milliseconds(300));
  CHECK(waited < std::chrono::milliseconds(2000));
  REQUIRE(x.Routed() == 1);
  for (int i = 0; i < 100 && x.exchange.waiting() > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));  // uncounted just after
  }
  REQUIRE(x.exchange.waiting() == 0);
  close(stalled);
}

TEST_CASE("FdExchange: connections that have not spoken are capped per uid",
          "[callers][memfd][hostile]") {
  ExchangeLimits limits;
  limits.max_waiting_per_uid = 3;
  Exchange x(limits);
  std::vector<int> clients;
  for (int i = 0; i < 3; ++i) clients.push_back(x.Connect(i == 0 ? "" : "PRI * "));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  REQUIRE(x.exchange.waiting() == 3);
  // The fourth of this uid is closed at once.
  const int fourth = x.Connect();
  pollfd p{fourth, POLLIN, 0};
  REQUIRE(poll(&p, 1, 2000) == 1);
  char byte;
  REQUIRE(read(fourth, &byte, 1) == 0);
  close(fourth);
  REQUIRE(x.exchange.waiting() == 3);
  for (int fd : clients) close(fd);
  for (int i = 0; i < 100 && x.exchange.waiting() > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  REQUIRE(x.exchange.waiting() == 0);  // gone clients are let go of at once
}

TEST_CASE("FdExchange: fds sent before the preface is complete are counted and capped",
          "[callers][memfd][hostile]") {
  FdTokens::Limits token_limits;
  token_limits.max_per_uid = 2;
  Exchange x({}, token_limits);
  auto memfds = [](int n) {
    std::vector<int> fds;
    for (int i = 0; i < n; ++i) fds.push_back(memfd_create("pre", MFD_CLOEXEC));
    return fds;
  };
  // A preface one byte a message, 4 fds with each: refused at the first message, nothing kept.
  auto four = memfds(4);
  int client = x.Connect("R", four);
  REQUIRE(ReadAll(client).rfind("ERR INVALID_ARGUMENT pass exactly one fd", 0) == 0);
  close(client);
  for (int fd : four) close(fd);
  REQUIRE(x.tokens->reserved() == 0);
  REQUIRE(x.tokens->held() == 0);
  // One fd with the first bytes is reserved as it arrives...
  auto one = memfds(3);
  const int a = x.Connect("REFI", {one[0]});
  const int b = x.Connect("REFI", {one[1]});
  for (int i = 0; i < 100 && x.tokens->reserved() < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  REQUIRE(x.tokens->reserved() == 2);
  // ...so a third, past the uid's cap of 2, is refused before its preface is complete.
  client = x.Connect("RE", {one[2]});
  REQUIRE(ReadAll(client).rfind("ERR RESOURCE_EXHAUSTED", 0) == 0);
  close(client);
  // The reservation becomes the token.
  Send(a, "TFD1", {});
  REQUIRE(ReadAll(a).rfind("OK memfd-", 0) == 0);
  REQUIRE(x.tokens->held() == 1);
  REQUIRE(x.tokens->reserved() == 1);
  close(a);
  close(b);  // gone: its reservation is given back
  for (int i = 0; i < 100 && x.tokens->reserved() > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  REQUIRE(x.tokens->reserved() == 0);
  for (int fd : one) close(fd);
}

}  // namespace refit::callers
