#pragma once

// The Daemon owns everything a refitd process runs: the store, the metrics, the gRPC server on
// the Unix socket (refit.v1.Refit + grpc.health.v1.Health) and the TCP listener for other
// daemons. main() only parses flags, starts a Daemon and waits for a signal.
//
// Thread-safety: Start and Shutdown may be called from any thread; Shutdown is idempotent.

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "daemon/options.h"

namespace refit {

class Daemon {
 public:
  // Binds the socket and the TCP listener and starts serving. FAILED_PRECONDITION when another
  // daemon already serves the socket; INVALID_ARGUMENT for bad options.
  static absl::StatusOr<std::unique_ptr<Daemon>> Start(const DaemonOptions& options);
  ~Daemon();

  // Health goes NOT_SERVING, blocked waits end, new calls are refused, in-flight calls get up
  // to `grace` seconds to finish and are then cancelled, and the socket file is removed.
  void Shutdown(double grace_seconds = 5.0);

  // The watchdog's question: the workers busy without progress for longer than `stall` (the
  // data plane's loop), and the local gRPC server when a health check through the socket gets
  // no answer within min(stall, 5 s); empty when all is well. Blocks up to that long.
  std::vector<std::string> StuckWorkers(std::chrono::milliseconds stall);

  // The TCP ports actually bound (useful with port 0); 0 when that listener is off.
  int listen_port() const;
  int metrics_port() const;
  int health_port() const;
  const std::string& node() const;

 private:
  struct Impl;
  explicit Daemon(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace refit
