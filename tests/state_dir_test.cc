// A --state-dir on a full or read-only file system (issue 33, bad input): refused at start,
// naming the directory and why; one that fills up while refitd runs: Publish still answers (the
// version is published, "not remembered" logged), the daemon keeps serving, and the next
// Publish after space came back is remembered. Each file system is a tmpfs mounted in a
// private mount namespace of refitd's own (unshare -m, as root).

#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "tests/testing/daemon_process.h"

namespace refit {
namespace {

using client::SharedMemory;
using client::Slice;
using testing::DaemonProcess;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

struct TempDir {
  TempDir() {
    char name[] = "/tmp/refit-state-dir-XXXXXX";
    REQUIRE(mkdtemp(name) != nullptr);
    path = name;
    std::filesystem::create_directories(path + "/state");
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  std::string path;
};

// refitd's command line run by a shell in a mount namespace of its own after `mount` there
// (the shell execs refitd: the same pid).
std::vector<std::string> InMountNamespace(const std::string& mount) {
  return {"/usr/bin/unshare", "-m", "--propagation",           "private",
          "/bin/sh",          "-c", mount + " && exec \"$@\"", "sh"};
}

}  // namespace

TEST_CASE("a state dir on a full or read-only file system is refused at start, named",
          "[integration][state]") {
  REQUIRE(geteuid() == 0);  // mounts in a namespace of its own: root (CI runs as root)
  TempDir dir;
  const std::string state = dir.path + "/state";
  struct Case {
    std::string mount, says;
  };
  for (const Case& c : std::vector<Case>{
           // A tmpfs of one page, filled first: full.
           {"mount -t tmpfs -o size=4k tmpfs " + state + " && head -c 4096 /dev/zero > " + state +
                "/fill",
            "No space left on device"},
           {"mount -t tmpfs -o ro,size=64k tmpfs " + state, "Read-only file system"},
       }) {
    std::vector<std::string> argv = InMountNamespace(c.mount);
    argv.insert(argv.end(), {testing::RunfilePath("daemon/refitd"), "--node=x",
                             "--socket=" + dir.path + "/x.sock", "--listen=127.0.0.1:0",
                             "--state-dir=" + state});
    auto run = testing::RunCommand(argv);
    INFO(c.mount << ": " << run.err);
    CHECK(run.exit_code == 1);
    CHECK(run.err.find("--state-dir=" + state + ": cannot write there (" + c.says + ")") !=
          std::string::npos);
    CHECK_FALSE(std::filesystem::exists(dir.path + "/x.sock"));
  }
}

TEST_CASE("a state dir that fills up: Publish answers, the daemon serves, memory catches up",
          "[integration][state]") {
  REQUIRE(geteuid() == 0);
  TempDir dir;
  const std::string state = dir.path + "/state";
  const std::string log = dir.path + "/refitd.log";
  std::vector<std::string> wrapper =
      InMountNamespace("mount -t tmpfs -o size=16k tmpfs " + state + " && exec 2>>" + log);
  auto daemon = DaemonProcess::Start({"--state-dir=" + state}, "", {}, wrapper);
  REQUIRE(daemon.ok());
  auto c = (*daemon)->Connect();
  REQUIRE(c.ok());
  client::Client& trainer = **c;
  // In refitd's mount namespace (the test's own sees the empty directory under it).
  auto in_ns = [&](const std::string& command) {
    return testing::RunCommand({"/usr/bin/nsenter", "-t", std::to_string((*daemon)->pid()), "-m",
                                "/bin/sh", "-c", command});
  };
  constexpr uint64_t kBytes = 1 << 20;
  auto src = SharedMemory::Create(testing::UniqueShmName("state-src"), kBytes);
  REQUIRE(src.ok());
  auto id = trainer.RegisterBuffer("m", v1::SOURCE, src->name(),
                                   {Slice("w", v1::BF16, {512, 1024}, 0)}, "trainer");
  REQUIRE(id.ok());
  REQUIRE(trainer.Publish("m", 1, {*id}).ok());
  REQUIRE(in_ns("grep -q '\"newest_published\": *1' " + state + "/state.json").exit_code == 0);

  // The disk fills up: version 2 is published all the same, and said not remembered.
  in_ns("head -c 1048576 /dev/zero > " + state + "/fill");
  REQUIRE(in_ns("test $(df --output=avail " + state + " | tail -1) -eq 0").exit_code == 0);
  auto published = trainer.Publish("m", 2, {*id});
  INFO(published.status().ToString());
  REQUIRE(published.ok());
  CHECK(ReadFile(log).find("model=m version=2 published, but not remembered") != std::string::npos);
  // The daemon serves its local clients: Status, and the version held.
  auto status = trainer.Status();
  REQUIRE(status.ok());
  REQUIRE(status->models_size() == 1);
  CHECK(status->models(0).latest_version() == 2);
  // The file still says 1 (the old file, whole: written through a temporary and a rename).
  CHECK(in_ns("grep -q '\"newest_published\": *1' " + state + "/state.json").exit_code == 0);

  // Space comes back: the next version is remembered.
  in_ns("rm " + state + "/fill");
  REQUIRE(trainer.Publish("m", 3, {*id}).ok());
  CHECK(in_ns("grep -q '\"newest_published\": *3' " + state + "/state.json").exit_code == 0);
  CHECK((*daemon)->running());
}

}  // namespace refit
