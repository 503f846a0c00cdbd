// Running refitd as infrastructure: systemd notifications and watchdog, the config file, the
// Prometheus endpoint and the health-only probe port — all against the real binary.

#include <arpa/inet.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "grpcpp/grpcpp.h"
#include "proto/grpc/health/v1/health.grpc.pb.h"
#include "tests/testing/daemon_process.h"

namespace refit {
namespace {

using client::SharedMemory;
using client::Slice;
using std::chrono::milliseconds;

// A datagram socket standing in for systemd's NOTIFY_SOCKET.
struct FakeNotifySocket {
  FakeNotifySocket() {
    char dir_template[] = "/tmp/refit-notify-XXXXXX";
    REQUIRE(mkdtemp(dir_template));
    dir = dir_template;
    path = dir + "/notify";
    fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd >= 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
    REQUIRE(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
    timeval tv{0, 200000};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  }
  ~FakeNotifySocket() {
    close(fd);
    unlink(path.c_str());
    rmdir(dir.c_str());
  }
  // Collects datagrams until one contains `needle` or `timeout` passes.
  bool WaitFor(const std::string& needle, milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      char buf[4096];
      ssize_t n = recv(fd, buf, sizeof(buf), 0);
      if (n > 0) {
        received.append(buf, static_cast<size_t>(n)).append("\n");
        if (std::string(buf, static_cast<size_t>(n)).find(needle) != std::string::npos) {
          return true;
        }
      }
    }
    return false;
  }
  std::string dir, path, received;
  int fd = -1;
};

std::string HttpGet(int port, const std::string& path) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return "";
  }
  const std::string request = "GET " + path + " HTTP/1.0\r\n\r\n";
  (void)!write(fd, request.data(), request.size());
  std::string out;
  char buf[4096];
  ssize_t n;
  while ((n = read(fd, buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(n));
  close(fd);
  return out;
}

// The value of one metric line "name value" in Prometheus text.
double MetricValue(const std::string& text, const std::string& name) {
  auto pos = text.find("\n" + name + " ");
  if (pos == std::string::npos) return -1;
  return std::stod(text.substr(pos + name.size() + 2));
}

TEST_CASE("systemd: READY=1 once serving, WATCHDOG=1 pings, STOPPING=1 at shutdown",
          "[integration][operations]") {
  FakeNotifySocket notify;
  auto daemon = testing::DaemonProcess::Start(
      {}, "", {"NOTIFY_SOCKET=" + notify.path, "WATCHDOG_USEC=200000"});
  REQUIRE(daemon.ok());
  CHECK(notify.WaitFor("READY=1", milliseconds(5000)));
  // READY=1 came only once the socket answered: DaemonProcess::Start saw it serve.
  CHECK(notify.WaitFor("WATCHDOG=1", milliseconds(2000)));
  CHECK(notify.WaitFor("WATCHDOG=1", milliseconds(2000)));  // and again
  CHECK((*daemon)->Stop(SIGTERM) == 0);
  CHECK(notify.WaitFor("STOPPING=1", milliseconds(2000)));
  INFO(notify.received);
}

TEST_CASE("the config file sets options; flags override it; bad files stop the start",
          "[integration][operations]") {
  char dir_template[] = "/tmp/refit-config-XXXXXX";
  REQUIRE(mkdtemp(dir_template));
  const std::string good = std::string(dir_template) + "/good.toml";
  const std::string bad = std::string(dir_template) + "/bad.toml";
  std::ofstream(good) << "node = \"from-file\"\nretain = 1\npeers = [\"p1:7070\", \"p2:7070\"]\n";
  std::ofstream(bad) << "node = \"x\"\nretian = 3\n";

  auto daemon = testing::DaemonProcess::Start({"--config=" + good, "--peers=p3:7070"});
  REQUIRE(daemon.ok());
  auto client = (*daemon)->Connect();
  REQUIRE(client.ok());
  auto status = (*client)->Status();
  REQUIRE(status.ok());
  CHECK(status->node() == "from-file");
  REQUIRE(status->peers_size() == 1);  // the flag replaced the file's list
  CHECK(status->peers(0).address() == "p3:7070");
  // retain = 1 from the file: version 1 is gone once 2 completes.
  auto shm = SharedMemory::Create(testing::UniqueShmName("cfg"), 64);
  REQUIRE(shm.ok());
  // (One memory is one buffer: the destination needs memory of its own.)
  auto dst = SharedMemory::Create(testing::UniqueShmName("cfg-dst"), 64);
  REQUIRE(dst.ok());
  auto s = (*client)->RegisterBuffer("m", v1::SOURCE, shm->name(), {Slice("w", v1::UINT8, {64})});
  auto d =
      (*client)->RegisterBuffer("m", v1::DESTINATION, dst->name(), {Slice("w", v1::UINT8, {64})});
  REQUIRE(s.ok());
  REQUIRE(d.ok());
  REQUIRE((*client)->Publish("m", 1, {*s}).ok());
  REQUIRE((*client)->Publish("m", 2, {*s}).ok());
  CHECK((*client)->Apply("m", 1, {*d}).status().code() == absl::StatusCode::kNotFound);

  auto refused = testing::RunCommand({testing::RunfilePath("daemon/refitd"), "--config=" + bad,
                                      "--socket=" + std::string(dir_template) + "/x.sock"});
  CHECK(refused.exit_code == 2);
  CHECK(refused.err.find("'retian' is unknown") != std::string::npos);
  // An empty node name would make this node's pieces look like its peers' own.
  auto nameless = testing::RunCommand({testing::RunfilePath("daemon/refitd"), "--node", "",
                                       "--listen=127.0.0.1:0",
                                       "--socket=" + std::string(dir_template) + "/y.sock"});
  CHECK(nameless.exit_code == 2);
  CHECK(nameless.err.find("--node must be 1 to 255 bytes") != std::string::npos);
  std::filesystem::remove_all(dir_template);
}

TEST_CASE("Prometheus /metrics follows versions as they flow", "[integration][operations]") {
  auto daemon = testing::DaemonProcess::Start({"--metrics-listen=127.0.0.1:0"});
  REQUIRE(daemon.ok());
  auto client = (*daemon)->Connect();
  REQUIRE(client.ok());
  auto status = (*client)->Status();
  REQUIRE(status.ok());
  const int port = status->metrics_port();
  REQUIRE(port > 0);

  std::string before = HttpGet(port, "/metrics");
  CHECK(before.find("200 OK") != std::string::npos);
  CHECK(MetricValue(before, "refit_versions_completed_total") == 0);

  auto src = SharedMemory::Create(testing::UniqueShmName("prom"), 4096);
  auto dst = SharedMemory::Create(testing::UniqueShmName("prom"), 4096);
  REQUIRE(src.ok());
  REQUIRE(dst.ok());
  auto s = (*client)->RegisterBuffer("m", v1::SOURCE, src->name(), {Slice("w", v1::FP32, {1024})});
  auto d =
      (*client)->RegisterBuffer("m", v1::DESTINATION, dst->name(), {Slice("w", v1::FP32, {1024})});
  for (uint64_t v = 1; v <= 3; ++v) {
    REQUIRE((*client)->Publish("m", v, {*s}).ok());
    REQUIRE((*client)->Apply("m", 0, {*d}).ok());
  }
  CHECK((*client)->Apply("m", 9, {*d}).status().code() == absl::StatusCode::kFailedPrecondition);

  std::string after = HttpGet(port, "/metrics");
  CHECK(MetricValue(after, "refit_versions_completed_total") == 3);
  // Versions 2 and 3 change nothing: the destination holds version 1's bytes already, and a
  // sparse Apply writes nothing (refit_apply_bytes_total counts what was written).
  CHECK(MetricValue(after, "refit_apply_bytes_total") == 4096);
  CHECK(MetricValue(after, "refit_apply_sparse_total") == 2);
  CHECK(MetricValue(after, "refit_apply_seconds_count") == 3);
  CHECK(MetricValue(after, "refit_publish_seconds_count") == 3);
  CHECK(after.find("refit_request_errors_total{code=\"FAILED_PRECONDITION\"} 1") !=
        std::string::npos);
  CHECK(after.find("# TYPE refit_apply_seconds histogram") != std::string::npos);
}

TEST_CASE("the health port serves grpc.health.v1 and nothing else", "[integration][operations]") {
  auto daemon = testing::DaemonProcess::Start({"--health-listen=127.0.0.1:0"});
  REQUIRE(daemon.ok());
  auto client = (*daemon)->Connect();
  REQUIRE(client.ok());
  auto status = (*client)->Status();
  REQUIRE(status.ok());
  REQUIRE(status->health_port() > 0);
  CHECK(status->listen_port() > 0);

  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(status->health_port()),
                                     grpc::InsecureChannelCredentials());
  auto health = grpc::health::v1::Health::NewStub(channel);
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::health::v1::HealthCheckRequest request;
    grpc::health::v1::HealthCheckResponse response;
    REQUIRE(health->Check(&context, request, &response).ok());
    CHECK(response.status() == grpc::health::v1::HealthCheckResponse::SERVING);
  }
  {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
    grpc::health::v1::HealthCheckRequest request;
    request.set_service("refit.v1.Refit");
    grpc::health::v1::HealthCheckResponse response;
    REQUIRE(health->Check(&context, request, &response).ok());
    CHECK(response.status() == grpc::health::v1::HealthCheckResponse::SERVING);
  }
  // The refit API is not on this port.
  auto refit_stub = v1::Refit::NewStub(channel);
  grpc::ClientContext context;
  context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
  v1::StatusResponse response;
  CHECK(refit_stub->Status(&context, v1::StatusRequest(), &response).error_code() ==
        grpc::StatusCode::UNIMPLEMENTED);
}

}  // namespace
}  // namespace refit
