#include "daemon/metrics/metrics.h"

#include <arpa/inet.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "catch2/catch.hpp"
#include "daemon/metrics/prometheus.h"

namespace refit {
namespace {

constexpr Counter kBytes{"test_bytes_total", "Bytes counted by the test."};
constexpr Counter kErrors{"test_errors_total", "Errors by code.\nSecond line \\ backslash."};
constexpr Gauge kLevel{"test_level_bytes", "A level the test sets."};
constexpr Histogram kSeconds{"test_seconds", "Time something took, in seconds."};

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

TEST_CASE("counters add up, gauges move, histograms are cumulative", "[metrics]") {
  Metrics m;
  m.Declare(kBytes);
  CHECK(m.Snapshot().count(kBytes) == 1);  // listed at 0 once declared
  CHECK(m.Get(kBytes) == 0);
  m.Add(kBytes, 1);
  m.Add(kBytes, 2);
  CHECK(m.Get(kBytes) == 3);
  m.Set(kLevel, 10);
  m.Add(kLevel, -4);
  CHECK(m.Get(kLevel) == 6);
  m.Observe(kSeconds, 0.002);
  m.Observe(kSeconds, 5);
  auto h = m.Histograms().at(kSeconds);
  CHECK(h.count == 2);
  CHECK(h.sum == Approx(5.002));
  CHECK(h.counts.back() == 2);
  CHECK(h.counts.front() == 0);  // 0.0001 s bucket
  CHECK(m.Descriptions().at(kSeconds).kind == MetricKind::kHistogram);
  CHECK(m.Descriptions().at(kLevel).kind == MetricKind::kGauge);
}

TEST_CASE("the Prometheus text has HELP and TYPE for every metric", "[metrics]") {
  Metrics m;
  m.Declare(kBytes);
  m.Declare(kSeconds);
  m.DeclareLabelled(kErrors);
  m.Add(kErrors, "code=\"NOT_FOUND\"", 1);
  m.Add(kErrors, "code=\"INTERNAL\"", 2);
  m.Set(kLevel, 4096);
  m.Observe(kSeconds, 0.05);
  const std::string text = RenderPrometheus(m);
  CHECK(text.find("# HELP test_bytes_total Bytes counted by the test.\n"
                  "# TYPE test_bytes_total counter\ntest_bytes_total 0\n") != std::string::npos);
  CHECK(text.find("# HELP test_errors_total Errors by code.\\nSecond line \\\\ backslash.\n") !=
        std::string::npos);
  CHECK(text.find("test_errors_total{code=\"NOT_FOUND\"} 1\n") != std::string::npos);
  CHECK(text.find("# TYPE test_level_bytes gauge\ntest_level_bytes 4096\n") != std::string::npos);
  CHECK(text.find("# TYPE test_seconds histogram\n") != std::string::npos);
  CHECK(text.find("test_seconds_bucket{le=\"0.10000000000000001\"} 1\n") != std::string::npos);
  CHECK(text.find("test_seconds_count 1\n") != std::string::npos);
  // Each metric's header once, however many series it has.
  CHECK(text.find("# TYPE test_errors_total") == text.rfind("# TYPE test_errors_total"));
}

// promtool (Debian's prometheus package, installed by scripts/install/install-deps.sh) lints the
// text.
TEST_CASE("promtool check metrics accepts the text", "[metrics]") {
  Metrics m;
  m.Declare(kBytes);
  m.Declare(kSeconds);
  m.Add(kErrors, "code=\"NOT_FOUND\"", 1);
  m.Set(kLevel, 1);
  m.Observe(kSeconds, 0.5);
  const std::string text = RenderPrometheus(m);
  INFO("promtool is /usr/bin/promtool (apt install prometheus; scripts/install/install-deps.sh)");
  REQUIRE(access("/usr/bin/promtool", X_OK) == 0);
  FILE* lint = popen("/usr/bin/promtool check metrics > promtool.out 2>&1", "w");
  REQUIRE(lint != nullptr);
  fwrite(text.data(), 1, text.size(), lint);
  const int status = pclose(lint);
  std::string out;
  if (FILE* f = fopen("promtool.out", "r")) {
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof(buf), f)) > 0) out.append(buf, n);
    fclose(f);
  }
  INFO(text);
  INFO(out);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(out.empty());
}

TEST_CASE("/metrics is served over HTTP and follows the counters", "[metrics]") {
  Metrics m;
  m.Declare(kBytes);
  auto server = MetricsHttpServer::Start("127.0.0.1:0", &m);
  REQUIRE(server.ok());
  REQUIRE((*server)->port() > 0);
  std::string first = HttpGet((*server)->port(), "/metrics");
  CHECK(first.find("200 OK") != std::string::npos);
  CHECK(first.find("test_bytes_total 0\n") != std::string::npos);
  m.Add(kBytes, 7);
  std::string second = HttpGet((*server)->port(), "/metrics");
  CHECK(second.find("test_bytes_total 7\n") != std::string::npos);
}

TEST_CASE("a handle counts into the same series as the by-name path", "[metrics]") {
  Metrics m;
  CounterHandle bytes = m.Declare(kBytes);
  CHECK(m.Snapshot().count(kBytes) == 1);
  bytes.Add(5);
  m.Add(kBytes, 2);
  m.Declare(kBytes).Add(1);  // declaring again: the same series
  CHECK(m.Get(kBytes) == 8);
  GaugeHandle level = m.Declare(kLevel);
  level.Set(10);
  level.Add(-3);
  m.Add(kLevel, 1);
  CHECK(m.Get(kLevel) == 8);
  HistogramHandle seconds = m.Declare(kSeconds);
  seconds.Observe(0.002);
  m.Observe(kSeconds, 5);
  seconds.Observe(1000);  // past the last bound: +Inf only
  auto h = m.Histograms().at(kSeconds);
  CHECK(h.bounds.size() == 13);
  CHECK(h.counts.size() == 14);
  CHECK(h.count == 3);
  CHECK(h.sum == Approx(1005.002));
  CHECK(h.counts.front() == 0);  // 0.0001 s
  CHECK(h.counts[3] == 1);       // 0.003 s
  CHECK(h.counts[9] == 1);       // 3 s
  CHECK(h.counts[10] == 2);      // 10 s: cumulative
  CHECK(h.counts[12] == 2);      // 100 s
  CHECK(h.counts.back() == 3);   // +Inf
  CounterHandle none;            // no Metrics: counts nothing, harmlessly
  none.Add(1);
}

TEST_CASE("a labelled series resolved up front is listed only once it moves", "[metrics]") {
  Metrics m;
  m.DeclareLabelled(kErrors);
  CounterHandle not_found = m.Series(kErrors, "code=\"NOT_FOUND\"");
  CounterHandle internal = m.Series(kErrors, "code=\"INTERNAL\"");
  CHECK(m.Snapshot().empty());
  CHECK(RenderPrometheus(m).find("test_errors_total{") == std::string::npos);
  not_found.Add(1);
  m.Add(kErrors, "code=\"NOT_FOUND\"", 1);  // the by-name path finds the same series
  const auto snapshot = m.Snapshot();
  CHECK(snapshot.size() == 1);
  CHECK(snapshot.at("test_errors_total{code=\"NOT_FOUND\"}") == 2);
  CHECK(m.Get("test_errors_total{code=\"INTERNAL\"}") == 0);
  internal.Add(3);
  CHECK(RenderPrometheus(m).find("test_errors_total{code=\"INTERNAL\"} 3\n") != std::string::npos);
}

TEST_CASE("handles count exactly from several threads at once", "[metrics]") {
  Metrics m;
  CounterHandle bytes = m.Declare(kBytes);
  HistogramHandle seconds = m.Declare(kSeconds);
  constexpr int kThreads = 4;
  constexpr int kAdds = 50000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&] {
      for (int i = 0; i < kAdds; ++i) {
        bytes.Add(2);
        m.Add(kBytes, 1);
        seconds.Observe(0.5);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  CHECK(m.Get(kBytes) == 3.0 * kThreads * kAdds);
  auto h = m.Histograms().at(kSeconds);
  CHECK(h.count == uint64_t{kThreads} * kAdds);
  CHECK(h.counts.back() == uint64_t{kThreads} * kAdds);
  CHECK(h.counts[7] == 0);                           // 0.3 s
  CHECK(h.counts[8] == uint64_t{kThreads} * kAdds);  // 1 s
}

}  // namespace
}  // namespace refit
