#pragma once

// Everything refitd can be told, from flags (main.cc) and the config file (daemon/config).

#include <cstdint>
#include <string>
#include <vector>

namespace refit {

struct DaemonOptions {
  std::string socket_path = "/run/refit/refitd.sock";
  std::string listen = "127.0.0.1:7070";  // HOST:PORT for other daemons; port 0 picks one
  std::vector<std::string> peers;
  std::string node;
  uint32_t retain = 2;
  std::string log_level = "info";
  std::string metrics_listen;  // HOST:PORT for Prometheus /metrics; empty: off
  std::string health_listen;   // HOST:PORT for grpc.health.v1 alone (probes); empty: off
  uint64_t chunk_bytes = 4ull << 20;  // largest single RMA read of a pull
  uint32_t inflight = 16;             // RMA reads in flight per pull
};

}  // namespace refit
