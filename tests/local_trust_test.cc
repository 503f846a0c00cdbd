// Local callers by SO_PEERCRED, through real processes under other uids (setpriv): a uid the
// policy doesn't list gets PERMISSION_DENIED on every RPC, health included; an allowed uid may not
// register shm objects it couldn't open itself, nor publish or release another uid's buffers
// (issue 17).

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include "catch2/catch.hpp"
#include "client/refit_client.h"
#include "tests/testing/as_uid.h"
#include "tests/testing/daemon_process.h"

namespace refit {
namespace {

using client::SharedMemory;
using client::Slice;
using testing::DaemonProcess;

constexpr uid_t kNobody = 65534;    // allowed by the daemon below
constexpr uid_t kStranger = 65533;  // not allowed

bool Starts(const std::string& line, const std::string& prefix) {
  return line.rfind(prefix, 0) == 0;
}

}  // namespace

TEST_CASE("local callers: allow lists, memory the caller can open, buffer ownership",
          "[integration][trust]") {
  auto daemon = DaemonProcess::Start({"--allow-uids=" + std::to_string(kNobody)});
  REQUIRE(daemon.ok());
  // The filesystem must let the other uids reach the socket; refitd's own policy decides.
  const std::string socket = (*daemon)->socket();
  testing::OpenSocketToAll(socket);
  const testing::AsUid as("tests/testing/as_client");
  auto c = (*daemon)->Connect();
  REQUIRE(c.ok());
  auto& root = **c;

  // A uid nobody listed: everything is PERMISSION_DENIED.
  const std::string refused = as.Run(kStranger, socket, {"status"});
  REQUIRE(Starts(refused, "PERMISSION_DENIED"));
  REQUIRE(refused.find("--allow-uids") != std::string::npos);
  REQUIRE(Starts(as.Run(kStranger, socket, {"register-own", "SOURCE", "m2"}), "PERMISSION_DENIED"));
  // Health too: a refused uid gets nothing but the refusal (probes use --health-listen).
  REQUIRE(Starts(as.Run(kStranger, socket, {"health"}), "PERMISSION_DENIED"));

  // An allowed uid may use the API...
  REQUIRE(Starts(as.Run(kNobody, socket, {"status"}), "OK"));
  // ...but not lend refitd root's 0600 shm object,
  auto shm = SharedMemory::Create(testing::UniqueShmName("trust"), 256 * 1024 * 2);
  REQUIRE(shm.ok());
  REQUIRE(chmod(("/dev/shm" + shm->name()).c_str(), 0600) == 0);
  const std::string lent = as.Run(kNobody, socket, {"register", "SOURCE", "m", shm->name()});
  REQUIRE(Starts(lent, "PERMISSION_DENIED"));
  REQUIRE(lent.find("0600") != std::string::npos);
  // ...nor publish or release root's buffer.
  auto root_id = root.RegisterBuffer("m", v1::SOURCE, shm->name(),
                                     {Slice("w", v1::BF16, {256, 1024}, 0)}, "root-trainer");
  REQUIRE(root_id.ok());
  REQUIRE(Starts(as.Run(kNobody, socket, {"publish", "m", "1", *root_id}), "PERMISSION_DENIED"));
  REQUIRE(Starts(as.Run(kNobody, socket, {"release", *root_id}), "PERMISSION_DENIED"));
  REQUIRE(root.Publish("m", 1, {*root_id}).ok());  // untouched by all that
  // Its own buffer is its own: root (refitd's uid) may not publish it either, but may release
  // it (an operator cleaning up).
  // (It lives as long as the process that registered it: that one stays until released.)
  auto holder = as.Spawn(kNobody, socket, {"hold", "SOURCE", "theirs", "0"});
  auto own = holder->ReadLine();
  REQUIRE(own.ok());
  REQUIRE(Starts(*own, "OK "));
  const std::string their_id = own->substr(3);
  // Another process of the same uid may publish it.
  REQUIRE(Starts(as.Run(kNobody, socket, {"publish", "theirs", "1", their_id}), "OK"));
  auto stolen = root.Publish("theirs", 2, {their_id});
  REQUIRE(stolen.status().code() == absl::StatusCode::kPermissionDenied);
  REQUIRE(root.ReleaseBuffer(their_id).ok());
  // Buffer ids end in 64 random bits: nothing to guess from the last one.
  const std::string suffix = root_id->substr(root_id->rfind('-') + 1);
  REQUIRE(suffix.size() == 16);
  REQUIRE(suffix.find_first_not_of("0123456789abcdef") == std::string::npos);
  REQUIRE((*daemon)->running());
}

TEST_CASE("the socket is created 0660", "[integration][trust]") {
  auto daemon = DaemonProcess::Start();
  REQUIRE(daemon.ok());
  struct stat st {};
  REQUIRE(stat((*daemon)->socket().c_str(), &st) == 0);
  REQUIRE((st.st_mode & 0777) == 0660);
}

}  // namespace refit
