// Hostile local callers against the real refitd, through real processes under real uids
// (setpriv), scaled down by lowered limits so that they run in the default suite (issue 37;
// the full-size attacks are tests/faults_hostile_local_test):
//   - long-lived calls (health Watch, Watch, WaitForVersion, WaitForReplicas) are bounded per
//     process, per uid and in all: the excess gets RESOURCE_EXHAUSTED, refitd stays up, and
//     every other caller's ordinary calls are served;
//   - past --max-local-threads new client processes share their uid's server: nothing aborts
//     (the crash this issue found: a new server on an empty shared thread quota);
//   - a refused uid gets PERMISSION_DENIED on everything, health included;
//   - a sparse memfd is not populated by refitd, and a SOURCE past --max-slot-memory is
//     refused before its memory is mapped;
//   - Status shows a caller only its own buffers (refitd's uid and root: all);
//   - connections that stall before their first message is complete are capped per uid and
//     closed after 5 s, and fds sent with a half preface are refused at once (not held).

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/hostile.h"

namespace refit {
namespace {

using testing::DaemonProcess;
using testing::FdsOf;
using testing::Hostile;
using testing::OpenSocketToAll;
using testing::ParseCounts;
using testing::ThreadsOf;

constexpr uid_t kNobody = 65534;    // allowed by the daemons below
constexpr uid_t kStranger = 65533;  // not allowed

}  // namespace

TEST_CASE("long-lived local calls are bounded per process, per uid and in all",
          "[integration][hostile]") {
  auto daemon =
      DaemonProcess::Start({"--allow-uids=" + std::to_string(kNobody), "--max-waiting-calls=12",
                            "--max-waiting-calls-per-uid=8", "--max-waiting-calls-per-process=5",
                            "--health-listen=127.0.0.1:0"});
  REQUIRE(daemon.ok());
  const std::string socket = (*daemon)->socket();
  OpenSocketToAll(socket);
  Hostile hostile;

  // One process of an allowed uid: 5 health Watch streams open, the rest refused at once.
  auto a = hostile.Hold(kNobody, socket, {"hold", "health-watch", "20"});
  auto counts = ParseCounts(a.line);
  CHECK(counts["open"] == 5);
  CHECK(counts["exhausted"] == 15);
  // Another process of that uid: its uid's 8 are reached (Watch counts the same).
  auto b = hostile.Hold(kNobody, socket, {"hold", "watch", "20"});
  counts = ParseCounts(b.line);
  CHECK(counts["open"] == 3);
  CHECK(counts["exhausted"] == 17);
  // The uid has nothing left, for any kind of long-lived call.
  auto c = hostile.Hold(kNobody, socket, {"hold", "wait-for-replicas", "3"});
  CHECK(ParseCounts(c.line)["exhausted"] == 3);
  // refitd's own uid (this test's) is a caller like the others: the total of 12 is reached.
  auto d = hostile.Hold(getuid(), socket, {"hold", "wait-for-version", "20"});
  counts = ParseCounts(d.line);
  CHECK(counts["open"] == 4);
  CHECK(counts["exhausted"] == 16);

  // Everything held: ordinary calls of new processes, of both uids, are all served.
  CHECK(ParseCounts(hostile.Run(kNobody, socket, {"probe", "10"}), "served") == 10);
  CHECK(ParseCounts(hostile.Run(getuid(), socket, {"probe", "10"}), "served") == 10);
  // A refused uid gets nothing but the refusal: its health Watch streams and health checks
  // too (the kubelet's probe is --health-listen).
  auto e = hostile.Hold(kStranger, socket, {"hold", "health-watch", "5"});
  CHECK(ParseCounts(e.line)["denied"] == 5);
  const std::string refused_probe = hostile.Run(kStranger, socket, {"probe", "3"});
  CHECK(ParseCounts(refused_probe, "served") == 0);
  CHECK(refused_probe.find("first_error=7") != std::string::npos);  // PERMISSION_DENIED
  REQUIRE((*daemon)->running());

  // The probe port (--health-listen) bounds its Watch streams too, on its own.
  auto status = (*daemon)->Connect();
  REQUIRE(status.ok());
  auto runtime = (*status)->Status();
  REQUIRE(runtime.ok());
  REQUIRE(runtime->health_port() > 0);
  auto g = hostile.Hold(getuid(), "127.0.0.1:" + std::to_string(runtime->health_port()),
                        {"hold", "health-watch", "40"});
  counts = ParseCounts(g.line);
  CHECK(counts["open"] == 32);
  CHECK(counts["exhausted"] == 8);
  g.child.reset();

  // The first process's streams closed: its budget is back.
  a.child.reset();
  std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  auto f = hostile.Hold(kNobody, socket, {"hold", "health-watch", "20"});
  CHECK(ParseCounts(f.line)["open"] == 5);
  REQUIRE((*daemon)->running());
}

TEST_CASE("past --max-local-threads new client processes share their uid's server",
          "[integration][hostile]") {
  // The crash this issue found, scaled down: client processes holding long-lived calls make
  // refitd run many threads; the next new process used to make gRPC abort refitd (a new server
  // on a shared, empty thread quota). Now each server has a quota of its own, and past the
  // thread ceiling a new process shares its uid's server.
  auto daemon =
      DaemonProcess::Start({"--allow-uids=" + std::to_string(kNobody), "--max-local-threads=96",
                            "--max-waiting-calls-per-uid=160", "--max-waiting-calls=400"});
  REQUIRE(daemon.ok());
  const std::string socket = (*daemon)->socket();
  OpenSocketToAll(socket);
  Hostile hostile;
  const long before = ThreadsOf((*daemon)->pid());
  INFO("refitd threads at start: " << before);
  REQUIRE(before > 0);
  REQUIRE(before < 96);
  // 8 processes × 30 health Watch streams: the uid's 160 are open, the rest refused.
  auto a = hostile.Hold(kNobody, socket, {"hold", "health-watch", "30", "8"});
  auto counts = ParseCounts(a.line);
  CHECK(counts["open"] == 160);
  CHECK(counts["exhausted"] == 80);
  const long held = ThreadsOf((*daemon)->pid());
  INFO("refitd threads with the streams held: " << held);
  CHECK(held >= 96);  // past the ceiling: what follows runs on the uid's shared server
  // New processes of both uids are still served, and can hold calls of their own.
  CHECK(ParseCounts(hostile.Run(kNobody, socket, {"probe", "10"}), "served") == 10);
  CHECK(ParseCounts(hostile.Run(getuid(), socket, {"probe", "10"}), "served") == 10);
  auto b = hostile.Hold(getuid(), socket, {"hold", "health-watch", "10", "4"});
  CHECK(ParseCounts(b.line)["open"] == 40);
  REQUIRE((*daemon)->running());
  // And when the holders go, so do the threads.
  a.child.reset();
  b.child.reset();
  std::this_thread::sleep_for(std::chrono::seconds(3));
  const long after = ThreadsOf((*daemon)->pid());
  INFO("refitd threads after: " << after);
  CHECK(after < held);
  CHECK(ParseCounts(hostile.Run(kNobody, socket, {"probe", "5"}), "served") == 5);
  REQUIRE((*daemon)->running());
}

TEST_CASE("stalled local connections are capped per uid and time out; early fds are not held",
          "[integration][hostile]") {
  auto daemon = DaemonProcess::Start(
      {"--allow-uids=" + std::to_string(kNobody), "--max-unspoken-connections-per-uid=8"});
  REQUIRE(daemon.ok());
  const std::string socket = (*daemon)->socket();
  OpenSocketToAll(socket);
  Hostile hostile;
  const long fds_before = FdsOf((*daemon)->pid());
  REQUIRE(fds_before > 0);
  // 200 connections of an allowed uid and 200 of a refused one, each one byte of the HTTP/2
  // preface and a stall; in the background.
  std::vector<std::unique_ptr<testing::ChildProcess>> stalls;
  for (uid_t uid : {kNobody, kStranger}) {
    stalls.push_back(hostile.hostile_client().Spawn(uid, socket, {"stall", "200", "1"}));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  // refitd holds at most 8 of each uid's (plus what it had).
  const long fds_during = FdsOf((*daemon)->pid());
  INFO("refitd fds before " << fds_before << ", during the stall " << fds_during);
  CHECK(fds_during <= fds_before + 2 * 8 + 4);
  // Other callers are served meanwhile: ordinary calls and fd passing.
  CHECK(ParseCounts(hostile.Run(getuid(), socket, {"probe", "20"}), "served") == 20);
  auto client = (*daemon)->Connect();
  REQUIRE(client.ok());
  auto memory = client::SharedMemory::CreateSealed(1 << 20, "hostile-test");
  REQUIRE(memory.ok());
  CHECK((*client)->PassMemfd(memory->fd()).ok());
  // Every stalled connection was closed by refitd: the held ones after 5 s, the others at once.
  for (auto& stall : stalls) {
    auto line = stall->ReadLine(60);
    REQUIRE(line.ok());
    INFO(*line);
    CHECK(ParseCounts(*line, "connected") > 0);
    CHECK(ParseCounts(*line, "closed") == ParseCounts(*line, "connected"));
    CHECK(ParseCounts(*line, "closed_after_ms") < 8000);
  }

  // refit's fd-passing preface, one byte a message with 4 memfds each (the attack held 28 fds
  // a connection): each is refused at its first message, nothing kept.
  auto spam = hostile.Hold(kNobody, socket, {"fd-preface", "64"});
  INFO(spam.line);
  CHECK(spam.line.find("answered=ERR_INVALID_ARGUMENT") != std::string::npos);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  const long fds_spam = FdsOf((*daemon)->pid());
  INFO("refitd fds with the fd-preface connections open: " << fds_spam);
  CHECK(fds_spam <= fds_before + 4);
  // A refused uid's fd passing is refused at its first byte.
  auto refused = hostile.Hold(kStranger, socket, {"fd-preface", "4"});
  CHECK(refused.line.find("answered=ERR_PERMISSION_DENIED") != std::string::npos);
  REQUIRE((*daemon)->running());
}

TEST_CASE("sparse memory is not populated; Status shows a caller its own buffers",
          "[integration][hostile]") {
  auto daemon =
      DaemonProcess::Start({"--allow-uids=" + std::to_string(kNobody), "--max-slot-memory=64MiB"});
  REQUIRE(daemon.ok());
  const std::string socket = (*daemon)->socket();
  OpenSocketToAll(socket);
  auto c = (*daemon)->Connect();
  REQUIRE(c.ok());
  auto& root = **c;
  // A 1 GiB memfd that is all hole, sealed.
  const uint64_t gib = 1ull << 30;
  auto sparse_memfd = [&]() {
    const int fd = memfd_create("hostile-sparse", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    REQUIRE(fd >= 0);
    REQUIRE(ftruncate(fd, static_cast<off_t>(gib)) == 0);
    REQUIRE(fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) == 0);
    return fd;
  };
  auto register_on = [&](int fd, std::vector<int64_t> shape) {
    auto token = root.PassMemfd(fd);
    REQUIRE(token.ok());
    v1::RegisterBufferRequest request;
    request.set_model("sparse");
    request.set_role(v1::SOURCE);
    request.mutable_memory()->mutable_memfd()->set_token(*token);
    *request.add_tensors() = client::Slice("w", v1::BF16, shape, 0);
    return root.RegisterBuffer(request);
  };
  const long rss_before = testing::RssKiBOf((*daemon)->pid());
  // A SOURCE of 1 GiB of tensors: past --max-slot-memory, refused before anything is mapped.
  const int big = sparse_memfd();
  auto refused = register_on(big, {512, 1 << 20});
  INFO(refused.status().ToString());
  CHECK(refused.status().code() == absl::StatusCode::kResourceExhausted);
  CHECK(refused.status().message().find("--max-slot-memory") != absl::string_view::npos);
  close(big);
  // A small SOURCE over the whole 1 GiB hole: registered, and the hole is not populated.
  const int small = sparse_memfd();
  auto id = register_on(small, {1024, 1024});
  REQUIRE(id.ok());
  const long rss_after = testing::RssKiBOf((*daemon)->pid());
  INFO("refitd RSS " << rss_before << " KiB before, " << rss_after << " KiB after");
  CHECK(rss_after - rss_before < 128 * 1024);
  close(small);

  // Status: root (refitd's uid here) sees every buffer; another uid only its own.
  Hostile hostile;
  std::unique_ptr<testing::ChildProcess> theirs =
      hostile.as_client().Spawn(kNobody, socket, {"hold", "SOURCE", "theirs", "0"});
  auto line = theirs->ReadLine();
  REQUIRE(line.ok());
  REQUIRE(line->rfind("OK ", 0) == 0);
  const std::string their_id = line->substr(3);
  auto all = root.Status();
  REQUIRE(all.ok());
  std::string seen;
  for (const auto& model : all->models()) {
    for (const auto& buffer : model.buffers()) seen += buffer.buffer_id() + ",";
  }
  CHECK(seen.find(*id) != std::string::npos);
  CHECK(seen.find(their_id) != std::string::npos);
  CHECK(hostile.as_client().Run(kNobody, socket, {"buffers"}) ==
        "OK " + their_id + "\n");  // its own, not root's
  REQUIRE((*daemon)->running());
}

}  // namespace refit
