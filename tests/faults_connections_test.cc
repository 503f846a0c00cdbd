// Fault suite (issue 18): 10,000 client connections under a memory cap. refitd runs in a memory
// cgroup of its own (cgroup v1 memory.limit_in_bytes, or v2 memory.max; named r18f-...) with a
// file-descriptor limit below 10,000 (prlimit), and the test opens 10,000 connections to its
// Unix socket, each saying HTTP/2's preface as gRPC clients do. Past the cap refitd refuses
// them cleanly (closes them at once), does not crash, and keeps serving the clients it has:
// a Publish and Apply through a client connected before are bit-exact, and once the
// connections close a new client is served again.
// $REFIT_FAULTS_CONNECTIONS (default 10000), $REFIT_FAULTS_MEMORY_MIB (default 512),
// $REFIT_FAULTS_NOFILE (default 4096).

#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "absl/strings/str_cat.h"
#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "tests/testing/daemon_process.h"
#include "tests/testing/faults.h"

namespace refit {
namespace {

using client::SharedMemory;
using client::Slice;
using std::chrono::milliseconds;

int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v && std::atoi(v) > 0 ? std::atoi(v) : fallback;
}

// A memory cgroup for refitd, removed on destruction (after refitd has exited).
struct MemoryCgroup {
  explicit MemoryCgroup(uint64_t bytes) {
    const std::string name = absl::StrCat("r18f-conn-", getpid());
    for (const std::string& root :
         {std::string("/sys/fs/cgroup/memory"), std::string("/sys/fs/cgroup")}) {
      const std::string limit_file =
          root == "/sys/fs/cgroup" ? "memory.max" : "memory.limit_in_bytes";
      std::error_code ec;
      if (!std::filesystem::exists(root + "/cgroup.procs")) continue;
      std::filesystem::create_directory(root + "/" + name, ec);
      if (ec) continue;
      std::ofstream(root + "/" + name + "/" + limit_file) << bytes;
      std::ifstream check(root + "/" + name + "/" + limit_file);
      uint64_t set = 0;
      check >> set;
      if (set == 0 || set > bytes) {
        std::filesystem::remove(root + "/" + name, ec);
        continue;
      }
      dir = root + "/" + name;
      peak_file =
          root == "/sys/fs/cgroup" ? dir + "/memory.peak" : dir + "/memory.max_usage_in_bytes";
      return;
    }
  }
  ~MemoryCgroup() {
    if (!dir.empty()) rmdir(dir.c_str());
  }
  uint64_t Peak() const {
    std::ifstream in(peak_file);
    uint64_t v = 0;
    in >> v;
    return v;
  }
  std::string dir, peak_file;
};

int ConnectRaw(const std::string& path) {
  const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  // HTTP/2's client preface and an empty SETTINGS frame, as a gRPC client opens.
  static const char kPreface[] = "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\0\0\0\4\0\0\0\0\0";
  (void)!send(fd, kPreface, sizeof(kPreface) - 1, MSG_NOSIGNAL);
  return fd;
}

// 1: the server answered (its SETTINGS), 0: refused (closed), -1: nothing yet.
int StateOf(int fd) {
  char buf[256];
  const ssize_t n = recv(fd, buf, sizeof(buf), MSG_DONTWAIT | MSG_PEEK);
  if (n > 0) return 1;
  if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) return 0;
  return -1;
}

}  // namespace

TEST_CASE("10,000 connections under a memory cap: refused past the cap, no crash, serving",
          "[integration][faults][connections]") {
  const int connections = EnvInt("REFIT_FAULTS_CONNECTIONS", 10000);
  const uint64_t memory = static_cast<uint64_t>(EnvInt("REFIT_FAULTS_MEMORY_MIB", 512)) << 20;
  const int nofile = EnvInt("REFIT_FAULTS_NOFILE", 4096);
  rlimit own{};
  getrlimit(RLIMIT_NOFILE, &own);
  own.rlim_cur = own.rlim_max;
  setrlimit(RLIMIT_NOFILE, &own);
  INFO("this test's fd limit " << own.rlim_cur);
  REQUIRE(own.rlim_cur > static_cast<rlim_t>(connections) + 256);
  MemoryCgroup cgroup(memory);
  INFO("a memory cgroup of " << memory << " bytes is needed (root, cgroup v1 or v2)");
  REQUIRE_FALSE(cgroup.dir.empty());
  const std::string script = absl::StrCat("echo $$ > ", cgroup.dir, "/cgroup.procs && ulimit -n ",
                                          nofile, " && exec \"$@\"");
  auto daemon = testing::DaemonProcess::Start({}, "", {}, {"/bin/sh", "-c", script, "sh"});
  REQUIRE(daemon.ok());
  auto c = (*daemon)->Connect();
  REQUIRE(c.ok());
  auto& client = **c;
  constexpr uint64_t kBytes = 8 << 20;
  auto src = SharedMemory::Create(testing::UniqueShmName("conn"), kBytes);
  auto dst = SharedMemory::Create(testing::UniqueShmName("conn"), kBytes);
  REQUIRE(src.ok());
  REQUIRE(dst.ok());
  const std::vector<v1::TensorSlice> layout = {Slice("w", v1::BF16, {kBytes / 2})};
  auto s = client.RegisterBuffer("m", v1::SOURCE, src->name(), layout, "trainer");
  auto d = client.RegisterBuffer("m", v1::DESTINATION, dst->name(), layout, "engine");
  REQUIRE(s.ok());
  REQUIRE(d.ok());
  testing::FillPattern(*src, 1);
  REQUIRE(client.Publish("m", 1, {*s}).ok());

  const double started = testing::Now();
  std::vector<int> fds;
  int failed_connect = 0;
  for (int i = 0; i < connections; ++i) {
    const int fd = ConnectRaw((*daemon)->socket());
    if (fd < 0) {
      ++failed_connect;
      std::this_thread::sleep_for(milliseconds(1));
    } else {
      fds.push_back(fd);
    }
  }
  const double opened = testing::Now() - started;
  // Give refitd time to answer or refuse every one.
  int answered = 0, refused = 0, pending = 0;
  for (int round = 0; round < 100; ++round) {
    answered = refused = pending = 0;
    for (int fd : fds) {
      const int state = StateOf(fd);
      answered += state == 1;
      refused += state == 0;
      pending += state == -1;
    }
    if (pending == 0) break;
    std::this_thread::sleep_for(milliseconds(100));
  }
  testing::PrintFigureText(
      "connections",
      absl::StrCat("opened=", connections, " answered=", answered, " refused=", refused,
                   " pending=", pending, " connect_failed=", failed_connect, " in ", opened, " s"));
  REQUIRE((*daemon)->running());  // no crash
  // The client connected before is still served, bit-exact.
  client.set_call_timeout(milliseconds(20000));
  REQUIRE(client.WaitForVersion("m", 1, milliseconds(20000)).ok());
  auto applied = client.Apply("m", 1, {*d});
  INFO(applied.status().ToString());
  REQUIRE(applied.ok());
  CHECK(testing::HoldsPattern(*dst, 1));
  testing::FillPattern(*src, 2);
  REQUIRE(client.Publish("m", 2, {*s}).ok());
  REQUIRE(client.Apply("m", 2, {*d}).ok());
  CHECK(testing::HoldsPattern(*dst, 2));
  // Past the cap connections are refused cleanly (closed), none left hanging unanswered.
  CHECK(pending == 0);
  CHECK(answered + refused == static_cast<int>(fds.size()));
  for (int fd : fds) close(fd);
  // A new client after they are gone is served.
  std::this_thread::sleep_for(milliseconds(500));
  auto fresh = (*daemon)->Connect();
  REQUIRE(fresh.ok());
  (*fresh)->set_call_timeout(milliseconds(20000));
  auto status = (*fresh)->Status();
  INFO(status.status().ToString());
  REQUIRE(status.ok());
  testing::PrintFigureText(
      "connections_memory_peak",
      absl::StrCat(cgroup.Peak() >> 20, " MiB of a ", memory >> 20, " MiB cap; nofile ", nofile));
  REQUIRE((*daemon)->running());
  CHECK((*daemon)->Stop(SIGTERM) == 0);
}

}  // namespace refit
