#include "daemon/metrics/prometheus.h"

#include <civetweb.h>

#include <mutex>
#include <set>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_replace.h"

namespace refit {
namespace {

// "name{label=\"x\"}" -> "name"
std::string BaseName(const std::string& key) { return key.substr(0, key.find('{')); }

std::string Number(double v) { return absl::StrFormat("%.17g", v); }

// HELP text escapes only backslash and newline (text format 0.0.4).
std::string EscapeHelp(const std::string& help) {
  return absl::StrReplaceAll(help, {{"\\", "\\\\"}, {"\n", "\\n"}});
}

const char* TypeName(MetricKind kind) {
  switch (kind) {
    case MetricKind::kCounter:
      return "counter";
    case MetricKind::kGauge:
      return "gauge";
    case MetricKind::kHistogram:
      return "histogram";
  }
  return "untyped";
}

}  // namespace

std::string RenderPrometheus(const Metrics& metrics) {
  const std::map<std::string, MetricDescription> descriptions = metrics.Descriptions();
  std::string out;
  // # HELP and # TYPE once per metric, before its first series.
  auto header = [&](const std::string& name, const char* fallback_type) {
    auto it = descriptions.find(name);
    const char* type = fallback_type;
    if (it != descriptions.end()) {
      absl::StrAppend(&out, "# HELP ", name, " ", EscapeHelp(it->second.help), "\n");
      type = TypeName(it->second.kind);
    }
    absl::StrAppend(&out, "# TYPE ", name, " ", type, "\n");
  };
  std::set<std::string> typed;
  for (const auto& [key, value] : metrics.Snapshot()) {
    const std::string base = BaseName(key);
    if (typed.insert(base).second) header(base, "untyped");
    absl::StrAppend(&out, key, " ", Number(value), "\n");
  }
  for (const auto& [name, h] : metrics.Histograms()) {
    header(name, "histogram");
    for (size_t i = 0; i < h.bounds.size(); ++i) {
      absl::StrAppend(&out, name, "_bucket{le=\"", Number(h.bounds[i]), "\"} ", h.counts[i], "\n");
    }
    absl::StrAppend(&out, name, "_bucket{le=\"+Inf\"} ", h.counts.back(), "\n");
    absl::StrAppend(&out, name, "_sum ", Number(h.sum), "\n", name, "_count ", h.count, "\n");
  }
  return out;
}

int MetricsHttpServer::HandleMetrics(::mg_connection* conn, void* data) {
  const auto* server = static_cast<const MetricsHttpServer*>(data);
  const std::string body = RenderPrometheus(*server->metrics_);
  mg_printf(conn,
            "HTTP/1.1 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
            "Content-Length: %zu\r\nConnection: close\r\n\r\n",
            body.size());
  mg_write(conn, body.data(), body.size());
  return 200;
}

absl::StatusOr<std::unique_ptr<MetricsHttpServer>> MetricsHttpServer::Start(
    const std::string& listen, const Metrics* metrics) {
  static std::once_flag init;
  std::call_once(init, [] { mg_init_library(0); });
  // civetweb wants "HOST:PORT" for IPv4; a bare ":PORT" means every address.
  std::string ports = listen;
  if (!ports.empty() && ports[0] == ':') ports = ports.substr(1);
  const char* options[] = {"listening_ports", ports.c_str(), "num_threads", "2", nullptr};
  std::unique_ptr<MetricsHttpServer> server(new MetricsHttpServer());
  server->metrics_ = metrics;
  mg_callbacks callbacks{};
  server->context_ = mg_start(&callbacks, nullptr, options);
  if (!server->context_) {
    return absl::UnavailableError(absl::StrCat("cannot serve metrics on ", listen));
  }
  mg_set_request_handler(server->context_, "/metrics", HandleMetrics, server.get());
  mg_server_port port{};
  if (mg_get_server_ports(server->context_, 1, &port) >= 1) server->port_ = port.port;
  return server;
}

MetricsHttpServer::~MetricsHttpServer() {
  if (context_) mg_stop(context_);
}

}  // namespace refit
