// The hostile local callers of issue 37 at full size, against refitd with its default limits
// (run by scripts/faults.sh, "hostile"; the scaled-down versions are tests/hostile_local_test):
//   - 2,240 grpc.health.v1 Watch streams from 70 processes of an allowed uid and 500 of a
//     refused one (the crash took ~2,100): the excess gets RESOURCE_EXHAUSTED (the refused
//     PERMISSION_DENIED), refitd stays up, new client processes are served, and refitd's
//     threads come back down;
//   - 2,000 stalled connections of an allowed uid and 2,000 of a refused one: all closed,
//     ordinary callers served meanwhile.
// Prints "FIGURE hostile ..." lines for the suite's summary.

#include <unistd.h>

#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "catch2/catch.hpp"
#include "tests/testing/daemon_process.h"
#include "tests/testing/hostile.h"

namespace refit {
namespace {

using testing::DaemonProcess;
using testing::Hostile;
using testing::ParseCounts;

constexpr uid_t kNobody = 65534;
constexpr uid_t kStranger = 65533;

}  // namespace

TEST_CASE("full-size hostile local callers: refitd survives and serves", "[faults][hostile]") {
  auto daemon = DaemonProcess::Start({"--allow-uids=" + std::to_string(kNobody)});
  REQUIRE(daemon.ok());
  const std::string socket = (*daemon)->socket();
  testing::OpenSocketToAll(socket);
  Hostile hostile;
  const pid_t pid = (*daemon)->pid();
  const long threads_before = testing::ThreadsOf(pid);

  auto watches = hostile.Hold(kNobody, socket, {"hold", "health-watch", "32", "70"});
  auto counts = ParseCounts(watches.line);
  CHECK(counts["open"] == 256);  // --max-waiting-calls-per-uid
  CHECK(counts["exhausted"] == 70 * 32 - 256);
  auto refused = hostile.Hold(kStranger, socket, {"hold", "health-watch", "50", "10"});
  CHECK(ParseCounts(refused.line)["denied"] == 500);
  const long threads_peak = testing::ThreadsOf(pid);
  // New client processes, after the point where refitd used to abort.
  const int served = ParseCounts(hostile.Run(getuid(), socket, {"probe", "40"}), "served");
  CHECK(served == 40);
  auto more = hostile.Hold(getuid(), socket, {"hold", "health-watch", "10", "4"});
  CHECK(ParseCounts(more.line)["open"] == 40);
  REQUIRE((*daemon)->running());
  watches.child.reset();
  refused.child.reset();
  more.child.reset();
  std::this_thread::sleep_for(std::chrono::seconds(5));
  const long threads_after = testing::ThreadsOf(pid);
  CHECK(threads_after < threads_before + 32);
  std::cout << "FIGURE hostile health-watch: " << watches.line << "; threads " << threads_before
            << " / " << threads_peak << " / " << threads_after << "; ordinary calls served "
            << served << "/40" << std::endl;

  std::vector<std::unique_ptr<testing::ChildProcess>> stalls;
  for (uid_t uid : {kNobody, kStranger}) {
    // setpriv ... under a shell that first raises the fd limit (2000 connections).
    std::vector<std::string> argv = {"/bin/sh", "-c", "ulimit -n 8192 && exec \"$0\" \"$@\""};
    for (std::string& arg : hostile.hostile_client().Argv(uid, socket, {"stall", "2000", "1"})) {
      argv.push_back(std::move(arg));
    }
    auto child = testing::ChildProcess::Spawn(argv);
    REQUIRE(child.ok());
    stalls.push_back(std::move(child).value());
  }
  std::this_thread::sleep_for(std::chrono::seconds(1));
  const int stalled_served = ParseCounts(hostile.Run(getuid(), socket, {"probe", "40"}), "served");
  CHECK(stalled_served == 40);
  for (auto& stall : stalls) {
    auto line = stall->ReadLine(60);
    REQUIRE(line.ok());
    INFO(*line);
    CHECK(ParseCounts(*line, "connected") == 2000);
    CHECK(ParseCounts(*line, "closed") == 2000);
    std::cout << "FIGURE hostile stall: " << *line << std::endl;
  }
  std::cout << "FIGURE hostile stall: ordinary calls served during it " << stalled_served << "/40"
            << std::endl;
  REQUIRE((*daemon)->running());
}

}  // namespace refit
