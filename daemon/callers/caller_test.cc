#include "daemon/callers/caller.h"

#include <sys/socket.h>
#include <unistd.h>

#include <catch2/catch.hpp>

namespace refit::callers {

TEST_CASE("the kernel names the other end of a Unix socket", "[callers]") {
  int fds[2];
  REQUIRE(socketpair(AF_UNIX, SOCK_STREAM, 0, fds) == 0);
  auto peer = PeerOf(fds[0]);
  close(fds[0]);
  close(fds[1]);
  REQUIRE(peer.ok());
  REQUIRE(peer->uid == geteuid());
  REQUIRE(peer->pid == getpid());
  REQUIRE(!peer->groups.empty());
}

TEST_CASE("policy: the daemon's uid, listed uids, listed groups", "[callers]") {
  Policy policy;
  policy.daemon_uid = 100;
  policy.allow_uids = {1000};
  policy.allow_gids = {50};
  Caller c;
  c.uid = 100;
  REQUIRE(policy.Allows(c));
  c.uid = 1000;
  REQUIRE(policy.Allows(c));
  c.uid = 2000;
  c.groups = {2000};
  REQUIRE_FALSE(policy.Allows(c));
  c.uid = 0;
  c.groups = {0};
  REQUIRE(policy.Allows(c));  // root
  c.uid = 2000;
  c.groups = {2000, 50};
  REQUIRE(policy.Allows(c));
}

TEST_CASE("access: owner, group and other bits; root opens anything", "[callers]") {
  struct stat st {};
  st.st_uid = 1000;
  st.st_gid = 1000;
  st.st_mode = 0640;
  Caller owner;
  owner.uid = 1000;
  owner.groups = {1000};
  REQUIRE(CheckAccess(owner, st, true, "shm /x").ok());
  Caller group;
  group.uid = 1001;
  group.groups = {1000};
  REQUIRE(CheckAccess(group, st, false, "shm /x").ok());
  auto denied = CheckAccess(group, st, true, "shm /x");
  REQUIRE(denied.code() == absl::StatusCode::kPermissionDenied);
  REQUIRE(std::string(denied.message()).find("0640") != std::string::npos);
  Caller other;
  other.uid = 2000;
  other.groups = {2000};
  REQUIRE(CheckAccess(other, st, false, "shm /x").code() == absl::StatusCode::kPermissionDenied);
  Caller root;
  root.uid = 0;
  REQUIRE(CheckAccess(root, st, true, "shm /x").ok());
}

}  // namespace refit::callers
