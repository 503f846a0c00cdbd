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
//     call but health.
// Servers are built on first use through the Daemon's ServiceFactory. A process's server is
// watched with a pidfd: when the process exits, the ClientExitListener hears of it (the Daemon
// releases the buffers it registered) and the server is shut down. The socket is created with
// its final mode (no window in which anyone may connect), and removed at Shutdown.
//
// Thread-safety: Start and Shutdown from one thread; the accept loop and the exit watcher run on
// threads of their own.

#include <sys/types.h>

#include <atomic>
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
      ClientExitListener* exits = nullptr, std::shared_ptr<FdExchange> fd_exchange = nullptr);

  // Most client processes served by a server of their own; more share their uid's server and
  // are not watched for exit.
  static constexpr size_t kMaxProcessServers = 512;

  // Client processes served by a server of their own now.
  size_t ProcessServers() const;
  ~LocalListener();  // Shutdown()

  // Stops accepting, then shuts every server down (in-flight calls get `grace`), and removes
  // the socket file.
  void Shutdown(std::chrono::milliseconds grace = std::chrono::milliseconds(5000));

  const Policy& policy() const { return policy_; }

 private:
  struct Served {
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
                ClientExitListener* exits);
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
  std::atomic<bool> stop_{false};
  std::thread accept_thread_;
  std::thread exit_thread_;
  mutable common::Mutex mu_;
  std::map<Key, std::unique_ptr<Served>> servers_ ABSL_GUARDED_BY(mu_);
  std::unique_ptr<Served> refused_ ABSL_GUARDED_BY(mu_);
  std::map<uid_t, bool> logged_refusal_ ABSL_GUARDED_BY(mu_);
  bool logged_full_ ABSL_GUARDED_BY(mu_) = false;
  bool shut_down_ ABSL_GUARDED_BY(mu_) = false;
  std::shared_ptr<FdExchange> fd_exchange_;  // may be null; set before accepting starts
};

}  // namespace refit::callers
