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
// with 'P' ("PRI * HTTP/2.0"), kFdPreface with 'R': a connection whose first byte is already
// there and is not 'R' goes straight on to gRPC; the others wait on the sorting thread (at
// most kMaxWaiting of them, each at most kFirstBytesTimeout) until their first bytes say
// which they are, so a client that connects and says nothing never blocks accepting.
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

class FdExchange {
 public:
  static constexpr size_t kMaxWaiting = 256;
  static constexpr std::chrono::seconds kFirstBytesTimeout{5};

  // Callers `policy` refuses get "ERR PERMISSION_DENIED" and refitd keeps nothing of theirs.
  FdExchange(Policy policy, std::shared_ptr<FdTokens> tokens);
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

 private:
  struct Waiting {
    int fd = -1;
    std::chrono::steady_clock::time_point deadline;
    bool ours = false;        // its first byte was kFdPreface's
    std::string preface;      // read so far
    std::vector<int> passed;  // fds that came with it
  };
  void Sort();
  bool Advance(Waiting& w);  // true when done with `w` (routed or answered and closed)
  void Answer(Waiting& w);
  void Drop(Waiting& w);

  const Policy policy_;
  const std::shared_ptr<FdTokens> tokens_;
  std::function<void(int)> route_;
  int wake_fd_ = -1;  // eventfd: a connection was diverted, or stop
  std::atomic<bool> stop_{false};
  std::atomic<size_t> waiting_count_{0};
  std::thread thread_;
  common::Mutex mu_;
  std::vector<Waiting> incoming_ ABSL_GUARDED_BY(mu_);
  std::map<uid_t, bool> logged_refusal_;  // sorting thread only
  bool logged_full_ = false;              // accept thread only
};

}  // namespace refit::callers
