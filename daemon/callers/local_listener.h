#pragma once

// The Unix socket local clients call refitd on. refitd binds and accepts it itself, so that it
// knows each connection's caller (SO_PEERCRED) — gRPC's C++ API doesn't say — and hands each
// accepted connection to a gRPC server of its own class of caller:
//   - one server per allowed client process (uid and pid by SO_PEERCRED), whose services know
//     that process (buffer ownership, access checks on the memory it registers, and which
//     buffers to release when it exits);
//   - one server per allowed uid for processes whose pid refitd cannot see (another pid
//     namespace: SO_PEERCRED says pid 0) or past kMaxProcessServers;
//   - one server for callers the policy refuses, whose API answers PERMISSION_DENIED to every
//     call, health included. It has no synchronous methods, so it holds no threads.
// Servers are built on first use through the Daemon's ServiceFactory. Each synchronous server
// gets a gRPC ResourceQuota of its own (ServerLimits): one caller's calls can't take another's
// threads, and building a server never finds a quota already spent — with one quota shared by
// every server, gRPC aborts the process when a new server can't get its first thread ("No thread
// quota available ... Unable to start the thread manager"). Threads in all are bounded by
// refusing to build a new process's server while refitd runs ServerLimits::max_threads threads
// (the process then shares its uid's server); long-lived calls by CallBudget. A process's server is
// watched with a pidfd: when the process exits, the ClientExitListener hears of it (the Daemon
// releases the buffers it registered) and the server is shut down. The socket is created with
// its final mode (no window in which anyone may connect), and removed at Shutdown.
//
// Thread-safety: Start and Shutdown from one thread; the accept loop and the exit watcher run on
// threads of their own.

#include <sys/types.h>

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
#include "daemon/callers/fd_exchange.h"
#include "daemon/common/mutex.h"
#include "grpcpp/grpcpp.h"

namespace refit::callers {

// Registers the services for a class of caller on `builder` (the listener adds the connection
// acceptor and starts it), returning what must live as long as the server. `caller` is null for
// the refused class.
using ServiceFactory = std::function<std::vector<std::shared_ptr<void>>(
    const Caller* caller, grpc::ServerBuilder* builder)>;

// gRPC's resources for local callers' servers.
struct ServerLimits {
  int process_threads = 40;              // each client process's own server
  int uid_threads = 288;                 // each uid's shared server (and the daemon's own)
  size_t process_memory = 256ull << 20;  // gRPC buffers of a process's server
  size_t uid_memory = 1ull << 30;        // ...and of a uid's
  long max_threads = 4096;           // no new process server while refitd runs this many threads
  int handshake_timeout_ms = 10000;  // a connection's HTTP/2 settings within this
};

// Threads this process runs now (/proc/self/status), -1 if unknown.
long ThreadsNow();

// Hears of local client processes that exited (owner exit).
class ClientExitListener {
 public:
  virtual ~ClientExitListener() = default;
  // The process `caller` (pid != 0) that called refitd has exited. Called on the listener's
  // exit-watcher thread, before that process's server is shut down; may block briefly.
  virtual void OnClientExit(const Caller& caller) = 0;
};

class LocalListener {
 public:
  // Binds `path` (mode `mode`), listens, and starts accepting.
  // `exits` (may be null; not owned, must outlive the listener) hears of client processes
  // that exited. With `fd_exchange`, clients may pass memfds on the same socket
  // (fd_exchange.h); those connections never reach gRPC.
  static absl::StatusOr<std::unique_ptr<LocalListener>> Start(
      const std::string& path, mode_t mode, Policy policy, ServiceFactory factory,
      ClientExitListener* exits = nullptr, std::shared_ptr<FdExchange> fd_exchange = nullptr,
      ServerLimits limits = {});

  // Most client processes served by a server of their own; more share their uid's server and
  // are not watched for exit.
  static constexpr size_t kMaxProcessServers = 512;

  // A refused uid's connections: admitted at most kRefusedPerSecond a second (bursts of
  // kRefusedBurst), each closed kRefusedConnectionAge after it was accepted (plus 1 s grace).
  static constexpr double kRefusedPerSecond = 4;
  static constexpr double kRefusedBurst = 16;
  static constexpr std::chrono::milliseconds kRefusedConnectionAge{10000};

  // Client processes served by a server of their own now.
  size_t ProcessServers() const;
  ~LocalListener();  // Shutdown()

  // Stops accepting, then shuts every server down (in-flight calls get `grace`), and removes
  // the socket file.
  void Shutdown(std::chrono::milliseconds grace = std::chrono::milliseconds(5000));

  const Policy& policy() const { return policy_; }

 private:
  struct Served {
    std::unique_ptr<grpc::ResourceQuota> quota;  // null: no synchronous methods (refused)
    std::vector<std::shared_ptr<void>> keep;
    std::unique_ptr<grpc::experimental::ExternalConnectionAcceptor> acceptor;
    std::unique_ptr<grpc::Server> server;
    Caller caller;   // pid 0: a uid's shared server
    int pidfd = -1;  // the process's pidfd (a process's own server), else -1
    ~Served();
  };
  // (uid, pid): pid 0 for a uid's shared server.
  using Key = std::pair<uid_t, pid_t>;
  LocalListener(std::string path, int fd, int wake_fd, Policy policy, ServiceFactory factory,
                ClientExitListener* exits, ServerLimits limits);
  void Accept();
  void Route(int fd);
  Served* ServerFor(const Caller* caller) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Built for `caller` (null: the refused class) with `pidfd` (-1: none); null on failure.
  std::unique_ptr<Served> Build(const Caller* caller, int pidfd) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void WatchExits();
  void Retire(const Key& key);  // the process of a server of its own exited

  const std::string path_;
  const int fd_;
  const int wake_fd_;  // an eventfd: the exit watcher's set of pidfds changed, or Shutdown
  const Policy policy_;
  const ServiceFactory factory_;
  ClientExitListener* const exits_;
  const ServerLimits limits_;
  std::atomic<bool> stop_{false};
  std::thread accept_thread_;
  std::thread exit_thread_;
  mutable common::Mutex mu_;
  std::map<Key, std::unique_ptr<Served>> servers_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<Served> refused_ ABSL_GUARDED_BY(mu_);
  std::map<uid_t, bool> logged_refusal_ ABSL_GUARDED_BY(mu_);
  struct RefusedBucket {
    double tokens = kRefusedBurst;
    std::chrono::steady_clock::time_point at = std::chrono::steady_clock::now();
  };
  std::map<uid_t, RefusedBucket> refused_buckets_ ABSL_GUARDED_BY(mu_);
  bool logged_full_ ABSL_GUARDED_BY(mu_) = false;
  std::chrono::steady_clock::time_point logged_threads_ ABSL_GUARDED_BY(mu_);
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  std::shared_ptr<FdExchange> fd_exchange_;  // may be null; set before accepting starts
};

}  // namespace refit::callers
