#pragma once

// Sealed memfds passed to refitd over its own Unix socket (docs/api.md "Sealed memfds").
// gRPC can't carry file descriptors, so a client that lends refitd a memfd first opens a short
// side connection to the same socket and sends, in one sendmsg, the 8 bytes kFdPreface with the
// fd attached (SCM_RIGHTS). refitd answers one line and closes:
//   "OK memfd-<32 hex digits>\n"       the token that names the fd in RegisterBuffer
//   "ERR <STATUS_CODE> <message>\n"    e.g. "ERR PERMISSION_DENIED ..." for a refused caller
// The token belongs to the uid that passed the fd (SO_PEERCRED); FdTokens holds the fd until
// a RegisterBuffer of that uid names it, or it expires.
//
// The LocalListener hands every accepted connection to Divert() first. HTTP/2's preface starts
// with 'P' ("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", 24 bytes), kFdPreface with 'R': a connection
// whose whole HTTP/2 preface is already there (or whose first byte is neither) goes straight on
// to gRPC; the others wait on the sorting thread until their first message is complete, so
// that gRPC only ever holds connections that have finished their preface, and a client that
// connects and says nothing (or one byte) never blocks accepting or holds a gRPC connection.
// Waiting connections are bounded: at most ExchangeLimits::max_waiting_per_uid per uid (by
// SO_PEERCRED at accept; past it that uid's new connections are closed at once, other uids
// unaffected), max_waiting in all, each at most first_bytes_timeout. Every fd a connection
// sends before its preface is complete is counted against FdTokens' caps as it arrives
// (FdTokens::Reserve), a second one is refused at once, and a uid the policy refuses is
// answered "ERR PERMISSION_DENIED" at its first byte, so no connection holds more than one fd
// and no uid more than the token cap.
//
// Thread-safety: Divert from the accept thread; StartSorting/StopSorting from the thread that
// starts and stops the listener; the sorting thread calls `route` and FdTokens.

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/callers/caller.h"
#include "daemon/callers/fd_tokens.h"
#include "daemon/common/mutex.h"

namespace refit::callers {

inline constexpr char kFdPreface[] = "REFITFD1";  // 8 bytes, no terminator on the wire
inline constexpr size_t kFdPrefaceBytes = sizeof(kFdPreface) - 1;

inline constexpr char kHttp2Preface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
inline constexpr size_t kHttp2PrefaceBytes = sizeof(kHttp2Preface) - 1;  // 24

struct ExchangeLimits {
  size_t max_waiting = 1024;        // connections whose first message is not complete, in all
  size_t max_waiting_per_uid = 32;  // ...of one uid
  std::chrono::milliseconds first_bytes_timeout{5000};
};

class FdExchange {
 public:
  // Callers `policy` refuses get "ERR PERMISSION_DENIED" and refitd keeps nothing of theirs.
  FdExchange(Policy policy, std::shared_ptr<FdTokens> tokens, ExchangeLimits limits = {});
  ~FdExchange();  // StopSorting()
  FdExchange(const FdExchange&) = delete;
  FdExchange& operator=(const FdExchange&) = delete;

  // Starts the sorting thread; `route` takes the connections that turn out to be gRPC (and
  // owns them from then on).
  void StartSorting(std::function<void(int fd)> route);
  // Stops the sorting thread and closes the connections still waiting. No `route` call after.
  void StopSorting();

  // Takes the newly accepted connection `fd` (true) unless its first byte is already there and
  // says gRPC (false: the caller routes it at once).
  bool Divert(int fd);

  FdTokens& tokens() { return *tokens_; }
  size_t waiting() const { return waiting_count_.load(); }  // connections waiting now

 private:
  struct Waiting {
    int fd = -1;
    uid_t uid = 0;       // SO_PEERCRED at accept
    bool known = false;  // the uid is known (else counted as uid -1)
    std::chrono::steady_clock::time_point deadline;
    bool ours = false;        // its first byte was kFdPreface's
    bool partial = false;     // some of gRPC's preface is there, not all (polled for errors only)
    std::string preface;      // read so far
    std::vector<int> passed;  // fds that came with it (each Reserved in FdTokens, -1 not)
  };
  void Sort();
  bool Advance(Waiting& w);  // true when done with `w` (routed or answered and closed)
  // What the bytes peeked so far say: route to gRPC (1), wait for more (0), or ours (-1).
  int Classify(int fd, bool* partial);
  void Answer(Waiting& w);
  void Refuse(Waiting& w, const absl::Status& why);  // answers "ERR ..." and drops
  void Drop(Waiting& w);
  void Done(const Waiting& w);  // uncounts a connection no longer waiting

  const Policy policy_;
  const std::shared_ptr<FdTokens> tokens_;
  const ExchangeLimits limits_;
  std::function<void(int)> route_;
  int wake_fd_ = -1;  // eventfd: a connection was diverted, or stop
  std::atomic<bool> stop_{false};
  std::atomic<size_t> waiting_count_{0};
  std::thread thread_;
  common::Mutex mu_;
  std::vector<Waiting> incoming_ ABSL_GUARDED_BY(mu_);
  std::map<uid_t, size_t> waiting_by_uid_ ABSL_GUARDED_BY(mu_);
  std::map<uid_t, bool> logged_refusal_;   // sorting thread only
  bool logged_full_ = false;               // accept thread only
  std::map<uid_t, bool> logged_uid_full_;  // accept thread only
};

}  // namespace refit::callers
