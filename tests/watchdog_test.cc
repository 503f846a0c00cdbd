// A watchdog that means something (issue 18): refitd pings systemd's watchdog only while its
// workers make progress. A test build's hook (//daemon:refitd_testing) wedges the data plane's
// loop: the pings stop, the unit's status names the stuck worker, health answers NOT_SERVING;
// once the worker goes on, the pings and SERVING come back. systemd is played by a datagram
// socket in $NOTIFY_SOCKET.

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "tests/testing/daemon_process.h"

namespace refit {
namespace {

using testing::DaemonProcess;
using Clock = std::chrono::steady_clock;

// What refitd tells "systemd" over `seconds`.
struct Notifications {
  int watchdog = 0;
  std::string status;  // the last STATUS=
};

class FakeSystemd {
 public:
  explicit FakeSystemd(const std::string& path) : path_(path) {
    fd_ = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    REQUIRE(fd_ >= 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
    REQUIRE(bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0);
  }
  ~FakeSystemd() {
    close(fd_);
    unlink(path_.c_str());
  }
  Notifications Listen(double seconds) {
    Notifications n;
    const auto end = Clock::now() + std::chrono::milliseconds(int64_t(seconds * 1000));
    while (Clock::now() < end) {
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, 50) <= 0) continue;
      char buffer[4096];
      const ssize_t got = recv(fd_, buffer, sizeof(buffer) - 1, 0);
      if (got <= 0) continue;
      const std::string message(buffer, static_cast<size_t>(got));
      if (message.find("WATCHDOG=1") != std::string::npos) ++n.watchdog;
      const size_t status = message.find("STATUS=");
      if (status != std::string::npos) n.status = message.substr(status + 7);
    }
    return n;
  }

 private:
  std::string path_;
  int fd_ = -1;
};

}  // namespace

// Runs refitd_testing under a fake systemd watchdog, wedges `worker` through the test hook
// ($REFIT_TEST_WEDGE) and checks that the pings stop and health is NOT_SERVING, with the unit's
// status naming `shown`; then that both come back once the worker goes on.
void WedgeAndRecover(const std::string& worker, const std::string& shown) {
  char dir_template[] = "/tmp/refit-watchdog-XXXXXX";
  REQUIRE(mkdtemp(dir_template));
  const std::string dir = dir_template;
  FakeSystemd systemd(dir + "/notify.sock");
  const std::string wedge = dir + "/wedge";
  auto daemon =
      DaemonProcess::Start({}, "",
                           {"NOTIFY_SOCKET=" + dir + "/notify.sock", "WATCHDOG_USEC=1000000",
                            "REFIT_TEST_WEDGE=" + worker, "REFIT_TEST_WEDGE_FILE=" + wedge,
                            "REFIT_TEST_BINARY=" + testing::RunfilePath("daemon/refitd_testing")});
  REQUIRE(daemon.ok());
  auto c = (*daemon)->Connect();
  REQUIRE(c.ok());
  (*c)->set_call_timeout(std::chrono::seconds(3));

  // Healthy: a ping every half second.
  Notifications healthy = systemd.Listen(2);
  CHECK(healthy.watchdog >= 3);
  auto serving = (*c)->Healthy();
  REQUIRE(serving.ok());
  CHECK(*serving);

  // The worker wedges at its next turn: past the stall bound (2 s) no more pings.
  std::ofstream(wedge) << "wedge\n";
  systemd.Listen(3);
  Notifications stuck = systemd.Listen(2);
  CHECK(stuck.watchdog == 0);
  INFO("status: " << stuck.status);
  CHECK(stuck.status.find("stuck") != std::string::npos);
  CHECK(stuck.status.find(shown) != std::string::npos);
  auto not_serving = (*c)->Healthy();
  REQUIRE(not_serving.ok());
  CHECK_FALSE(*not_serving);
  CHECK((*daemon)->running());

  // It goes on: pings and SERVING again.
  std::filesystem::remove(wedge);
  systemd.Listen(1.5);
  Notifications back = systemd.Listen(2);
  CHECK(back.watchdog >= 2);
  auto again = (*c)->Healthy();
  REQUIRE(again.ok());
  CHECK(*again);
  std::filesystem::remove_all(dir);
}

TEST_CASE("a wedged data plane stops the watchdog and health; both come back",
          "[integration][liveness]") {
  WedgeAndRecover("dataplane", "data plane");
}

// The store has no thread: its probe takes the store's lock, and wedges holding it.
TEST_CASE("a wedged store (its lock held) stops the watchdog and health, naming it",
          "[integration][liveness]") {
  WedgeAndRecover("store", "store");
}

TEST_CASE("refitd itself has no test hooks: the same switch wedges nothing",
          "[integration][liveness]") {
  char dir_template[] = "/tmp/refit-watchdog-XXXXXX";
  REQUIRE(mkdtemp(dir_template));
  const std::string dir = dir_template;
  FakeSystemd systemd(dir + "/notify.sock");
  const std::string wedge = dir + "/wedge";
  std::ofstream(wedge) << "wedge\n";
  auto daemon =
      DaemonProcess::Start({}, "",
                           {"NOTIFY_SOCKET=" + dir + "/notify.sock", "WATCHDOG_USEC=1000000",
                            "REFIT_TEST_WEDGE=dataplane", "REFIT_TEST_WEDGE_FILE=" + wedge,
                            "REFIT_TEST_BINARY=" + testing::RunfilePath("daemon/refitd")});
  REQUIRE(daemon.ok());
  systemd.Listen(3);
  Notifications n = systemd.Listen(2);
  CHECK(n.watchdog >= 3);
  CHECK(n.status.find("stuck") == std::string::npos);
  std::filesystem::remove_all(dir);
}

}  // namespace refit
