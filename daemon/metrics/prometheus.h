#pragma once

// Renders Metrics in the Prometheus text exposition format (version 0.0.4), and serves it over
// HTTP at /metrics (civetweb) on --metrics-listen.
//
// Thread-safety: RenderPrometheus is thread-safe; a MetricsHttpServer serves from civetweb's
// threads and is started and stopped by its owner.

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/metrics/metrics.h"

struct mg_context;
struct mg_connection;

namespace refit {

std::string RenderPrometheus(const Metrics& metrics);

class MetricsHttpServer {
 public:
  // Serves `metrics` (not owned; must outlive the server) at http://HOST:PORT/metrics. Port 0
  // picks a free port.
  static absl::StatusOr<std::unique_ptr<MetricsHttpServer>> Start(const std::string& listen,
                                                                  const Metrics* metrics);
  ~MetricsHttpServer();
  int port() const { return port_; }

 private:
  MetricsHttpServer() = default;
  mg_context* context_ = nullptr;
  const Metrics* metrics_ = nullptr;
  int port_ = 0;
  static int HandleMetrics(::mg_connection* conn, void* data);
};

}  // namespace refit
