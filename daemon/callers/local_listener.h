#pragma once

// The Unix socket local clients call refitd on. refitd binds and accepts it itself, so that it
// knows each connection's caller (SO_PEERCRED) — gRPC's C++ API doesn't say — and hands each
// accepted connection to a gRPC server of its own class of caller:
//   - one server per allowed uid, whose services know that uid (buffer ownership, access checks
//     on the memory it registers);
//   - one server for callers the policy refuses, whose API answers PERMISSION_DENIED to every
//     call but health.
// Servers are built on first use through the Daemon's ServiceFactory. The socket is created
// with its final mode (no window in which anyone may connect), and removed at Shutdown.
//
// Thread-safety: Start and Shutdown from one thread; the accept loop runs on its own.

#include <sys/types.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/callers/caller.h"
#include "daemon/callers/fd_exchange.h"
#include "grpcpp/grpcpp.h"

namespace refit::callers {

// Registers the services for a class of caller on `builder` (the listener adds the connection
// acceptor and starts it), returning what must live as long as the server. `caller` is null for
// the refused class.
using ServiceFactory = std::function<std::vector<std::shared_ptr<void>>(
    const Caller* caller, grpc::ServerBuilder* builder)>;

class LocalListener {
 public:
  // Binds `path` (mode `mode`), listens, and starts accepting. With `fd_exchange`, clients
  // may pass memfds on the same socket (fd_exchange.h); those connections never reach gRPC.
  static absl::StatusOr<std::unique_ptr<LocalListener>> Start(
      const std::string& path, mode_t mode, Policy policy, ServiceFactory factory,
      std::shared_ptr<FdExchange> fd_exchange = nullptr);
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
  };
  LocalListener(std::string path, int fd, Policy policy, ServiceFactory factory);
  void Accept();
  void Route(int fd);
  Served* ServerFor(const Caller* caller);  // mu_ held

  const std::string path_;
  const int fd_;
  const Policy policy_;
  const ServiceFactory factory_;
  std::atomic<bool> stop_{false};
  std::thread accept_thread_;
  std::mutex mu_;
  std::map<uid_t, std::unique_ptr<Served>> by_uid_;  // guarded by mu_
  std::unique_ptr<Served> refused_;                  // guarded by mu_
  std::map<uid_t, bool> logged_refusal_;             // guarded by mu_
  bool shut_down_ = false;
  std::shared_ptr<FdExchange> fd_exchange_;  // may be null; set before accepting starts
};

}  // namespace refit::callers
