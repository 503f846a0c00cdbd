#include <arpa/inet.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>

#include "catch2/catch.hpp"
#include "daemon/metrics/metrics.h"
#include "daemon/metrics/prometheus.h"

namespace refit {
namespace {

// A plain HTTP/1.0 GET over loopback.
std::string HttpGet(int port, const std::string& path) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  REQUIRE(fd >= 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  REQUIRE(connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  const std::string request = "GET " + path + " HTTP/1.0\r\n\r\n";
  REQUIRE(write(fd, request.data(), request.size()) == static_cast<ssize_t>(request.size()));
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
  close(fd);
  return out;
}

TEST_CASE("counters add up and histograms are cumulative", "[metrics]") {
  Metrics m;
  CHECK(m.Get(kVersionsCompleted) == 0);
  m.Add(kVersionsCompleted, 1);
  m.Add(kVersionsCompleted, 2);
  CHECK(m.Get(kVersionsCompleted) == 3);
  m.Observe(kApplySeconds, 0.002);
  m.Observe(kApplySeconds, 5);
  auto h = m.Histograms().at(kApplySeconds);
  CHECK(h.count == 2);
  CHECK(h.sum == Approx(5.002));
  CHECK(h.counts.back() == 2);
  CHECK(h.counts.front() == 0);  // 0.0001 s bucket
}

TEST_CASE("the Prometheus text names every counter and histogram", "[metrics]") {
  Metrics m;
  m.Add(kApplyBytes, 4096);
  m.Add(std::string(kRequestErrors) + "{code=\"NOT_FOUND\"}", 1);
  m.Observe(kPublishSeconds, 0.05);
  const std::string text = RenderPrometheus(m);
  CHECK(text.find("# TYPE refit_apply_bytes_total counter\nrefit_apply_bytes_total 4096\n") !=
        std::string::npos);
  CHECK(text.find("refit_request_errors_total{code=\"NOT_FOUND\"} 1\n") != std::string::npos);
  CHECK(text.find("refit_publish_seconds_bucket{le=\"0.10000000000000001\"} 1\n") !=
        std::string::npos);
  CHECK(text.find("refit_publish_seconds_count 1\n") != std::string::npos);
  CHECK(text.find("refit_data_bytes_received_total 0\n") != std::string::npos);
}

TEST_CASE("/metrics is served over HTTP and follows the counters", "[metrics]") {
  Metrics m;
  auto server = MetricsHttpServer::Start("127.0.0.1:0", &m);
  REQUIRE(server.ok());
  REQUIRE((*server)->port() > 0);
  std::string first = HttpGet((*server)->port(), "/metrics");
  CHECK(first.find("200 OK") != std::string::npos);
  CHECK(first.find("refit_versions_completed_total 0\n") != std::string::npos);
  m.Add(kVersionsCompleted, 7);
  std::string second = HttpGet((*server)->port(), "/metrics");
  CHECK(second.find("refit_versions_completed_total 7\n") != std::string::npos);
}

}  // namespace
}  // namespace refit
