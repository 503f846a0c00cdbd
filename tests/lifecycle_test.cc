// The daemon's life: clean shutdown on SIGTERM with calls in flight, one daemon per socket,
// stale sockets, and refitctl's answers with and without a daemon.

#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <thread>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "tests/testing/daemon_process.h"

namespace refit {
namespace {

using client::SharedMemory;
using client::Slice;
using std::chrono::milliseconds;

bool Exists(const std::string& path) {
  struct stat st;
  return stat(path.c_str(), &st) == 0;
}

TEST_CASE("SIGTERM with calls in flight: clean exit, waiters answered, socket removed",
          "[integration][lifecycle]") {
  auto daemon = testing::DaemonProcess::Start();
  REQUIRE(daemon.ok());
  const std::string socket = (*daemon)->socket();
  struct stat st;
  REQUIRE(stat(socket.c_str(), &st) == 0);
  CHECK((st.st_mode & 0777) == 0660);

  auto client = (*daemon)->Connect();
  REQUIRE(client.ok());
  auto healthy = (*client)->Healthy();
  REQUIRE(healthy.ok());
  CHECK(*healthy);

  std::atomic<int> wait_code{-1};
  std::thread waiter([&] {
    auto r = (*client)->WaitForVersion("m", 1, milliseconds(60000));
    wait_code = static_cast<int>(r.status().code());
  });
  // A Watch waits for a restarted refitd up to the restart timeout (tests/restart_test); this
  // one does not come back.
  (*client)->set_restart_timeout(milliseconds(1000));
  auto watcher = (*client)->Watch("m");
  REQUIRE(watcher.ok());
  std::this_thread::sleep_for(milliseconds(200));  // both calls are now blocked in the daemon

  const auto start = std::chrono::steady_clock::now();
  CHECK((*daemon)->Stop(SIGTERM) == 0);
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
  waiter.join();
  CHECK(wait_code.load() == static_cast<int>(absl::StatusCode::kUnavailable));
  v1::VersionEvent event;
  CHECK_FALSE((*watcher)->Next(&event));
  CHECK_FALSE(Exists(socket));
}

TEST_CASE("SIGINT also stops the daemon cleanly", "[integration][lifecycle]") {
  auto daemon = testing::DaemonProcess::Start();
  REQUIRE(daemon.ok());
  const std::string socket = (*daemon)->socket();
  CHECK((*daemon)->Stop(SIGINT) == 0);
  CHECK_FALSE(Exists(socket));
}

TEST_CASE("a second daemon on a served socket is refused; a stale socket is replaced",
          "[integration][lifecycle]") {
  auto first = testing::DaemonProcess::Start();
  REQUIRE(first.ok());
  auto second = testing::RunCommand({testing::RunfilePath("daemon/refitd"),
                                     "--socket=" + (*first)->socket(), "--listen=127.0.0.1:0"});
  CHECK(second.exit_code == 1);
  CHECK(second.err.find("already serves") != std::string::npos);
  auto client = (*first)->Connect();
  REQUIRE(client.ok());
  CHECK((*client)->Status().ok());

  // A daemon killed with SIGKILL leaves its socket file behind; the next one takes it over.
  const std::string socket = (*first)->socket();
  (*first)->Stop(SIGKILL);
  REQUIRE(Exists(socket));
  auto again = testing::DaemonProcess::Start({}, socket);
  REQUIRE(again.ok());
  auto client_again = (*again)->Connect();
  REQUIRE(client_again.ok());
  CHECK((*client_again)->Status().ok());
  CHECK((*again)->Stop(SIGTERM) == 0);
  CHECK_FALSE(Exists(socket));
}

TEST_CASE("a second daemon on a served peer port is refused, not sharing its connections",
          "[integration][lifecycle]") {
  auto first = testing::DaemonProcess::Start();
  REQUIRE(first.ok());
  auto client = (*first)->Connect();
  REQUIRE(client.ok());
  auto status = (*client)->Status();
  REQUIRE(status.ok());
  REQUIRE(status->listen_port() > 0);
  const std::string port = std::to_string(status->listen_port());
  // gRPC's default SO_REUSEPORT would let this one bind too and take half of the first's peers.
  auto second = testing::RunCommand({testing::RunfilePath("daemon/refitd"),
                                     "--socket=" + (*first)->dir() + "/second.sock",
                                     "--listen=127.0.0.1:" + port});
  INFO(second.err);
  CHECK(second.exit_code == 1);
  CHECK(second.err.find("cannot listen on 127.0.0.1:" + port) != std::string::npos);
  // The same for the health port.
  auto health = testing::DaemonProcess::Start({"--health-listen=127.0.0.1:0"});
  REQUIRE(health.ok());
  auto health_client = (*health)->Connect();
  REQUIRE(health_client.ok());
  auto health_status = (*health_client)->Status();
  REQUIRE(health_status.ok());
  REQUIRE(health_status->health_port() > 0);
  const std::string hport = std::to_string(health_status->health_port());
  auto third = testing::RunCommand({testing::RunfilePath("daemon/refitd"),
                                    "--socket=" + (*first)->dir() + "/third.sock",
                                    "--listen=127.0.0.1:0", "--health-listen=127.0.0.1:" + hport});
  INFO(third.err);
  CHECK(third.exit_code == 1);
  CHECK(third.err.find(hport) != std::string::npos);
  CHECK((*client)->Status().ok());
  CHECK((*health_client)->Status().ok());
}

TEST_CASE("refitctl shows status and fails clearly without a daemon", "[integration][lifecycle]") {
  const std::string refitctl = testing::RunfilePath("client/refitctl");
  auto none = testing::RunCommand(
      {refitctl, "--socket=/tmp/refit-no-daemon-here.sock", "--timeout=0.5", "status"});
  CHECK(none.exit_code == 3);
  CHECK(none.err.find("no refitd at /tmp/refit-no-daemon-here.sock: the socket does not exist") !=
        std::string::npos);
  CHECK(std::count(none.err.begin(), none.err.end(), '\n') == 1);

  auto daemon = testing::DaemonProcess::Start(
      {"--node=ctl-node", "--peers=10.9.9.9:7070", "--max-slot-memory=1MiB", "--retain=1"});
  REQUIRE(daemon.ok());
  auto client = (*daemon)->Connect();
  REQUIRE(client.ok());
  auto shm = SharedMemory::Create(testing::UniqueShmName("ctl"), 1024);
  REQUIRE(shm.ok());
  auto id = (*client)->RegisterBuffer("llama", v1::SOURCE, shm->name(),
                                      {Slice("w", v1::BF16, {512})}, "trainer-0");
  REQUIRE(id.ok());
  REQUIRE((*client)->Publish("llama", 4, {*id}).ok());

  const std::string socket_flag = "--socket=" + (*daemon)->socket();
  auto human = testing::RunCommand({refitctl, socket_flag, "status"});
  CHECK(human.exit_code == 0);
  CHECK(human.out.find("node: ctl-node") != std::string::npos);
  CHECK(human.out.find("llama") != std::string::npos);
  CHECK(human.out.find("trainer-0") != std::string::npos);
  CHECK(human.out.find("10.9.9.9:7070") != std::string::npos);
  // Version 4's 1 KiB slot and one spare (retain 1: the pool keeps retain + 1 ready).
  CHECK(human.out.find("slot memory: 2.0 KiB held of 1.0 MiB (--max-slot-memory)") !=
        std::string::npos);

  auto json = testing::RunCommand({refitctl, socket_flag, "status", "--json"});
  CHECK(json.exit_code == 0);
  CHECK(json.out.find("\"latest_version\": 4,") != std::string::npos);  // a JSON number
  CHECK(json.out.find("\"node\": \"ctl-node\"") != std::string::npos);

  auto versions = testing::RunCommand({refitctl, socket_flag, "versions", "llama"});
  CHECK(versions.exit_code == 0);
  CHECK(versions.out.find("latest: 4") != std::string::npos);
  auto unknown = testing::RunCommand({refitctl, socket_flag, "versions", "nope"});
  CHECK(unknown.exit_code == 1);

  auto metrics = testing::RunCommand({refitctl, socket_flag, "metrics"});
  CHECK(metrics.exit_code == 0);
  CHECK(metrics.out.find("refit_versions_completed_total 1") != std::string::npos);

  auto health = testing::RunCommand({refitctl, socket_flag, "health"});
  CHECK(health.exit_code == 0);
  CHECK(health.out == "SERVING\n");
}

}  // namespace
}  // namespace refit

namespace refit {
namespace {

TEST_CASE("GPU version slots on a machine without a usable GPU: a clear refusal to start",
          "[integration][lifecycle]") {
  auto version = testing::RunCommand({testing::RunfilePath("daemon/refitd"), "--version"});
  REQUIRE(version.exit_code == 0);
  if (version.out.find("not compiled in") == std::string::npos &&
      version.out.find(" 0 device(s)") == std::string::npos) {
    WARN("this refitd sees a GPU (" << version.out << "); the refusal can't be tested here");
    return;
  }
  const std::string dir = testing::UniqueShmName("slots");  // a name, used as a path suffix
  auto result = testing::RunCommand({testing::RunfilePath("daemon/refitd"),
                                     "--socket=/tmp/refit-" + dir.substr(1) + ".sock",
                                     "--listen=127.0.0.1:0", "--slot-memory=cuda"});
  CHECK(result.exit_code == 1);
  CHECK(result.err.find("--slot-memory=cuda needs CUDA device 0") != std::string::npos);
  // A bad value is a usage error.
  auto bad = testing::RunCommand(
      {testing::RunfilePath("daemon/refitd"), "--listen=127.0.0.1:0", "--slot-memory=disk"});
  CHECK(bad.exit_code != 0);
  CHECK(bad.exit_code != 1);
}

}  // namespace
}  // namespace refit
