#include "daemon/callers/caller.h"

#include <grp.h>
#include <pwd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"

namespace refit::callers {

std::string Caller::Describe() const {
  return absl::StrCat("uid ", uid, " gid ", gid, " pid ", pid);
}

absl::StatusOr<Caller> PeerOf(int fd) {
  ucred cred{};
  socklen_t length = sizeof(cred);
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &length) != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot read the caller's credentials: ", std::strerror(errno)));
  }
  Caller caller;
  caller.pid = cred.pid;
  caller.uid = cred.uid;
  caller.gid = cred.gid;
  caller.groups.push_back(cred.gid);
  // The uid's supplementary groups, as the system lists them (the process may have dropped
  // some; the kernel doesn't say which it holds).
  std::vector<char> buffer(16384);
  passwd pw{};
  passwd* found = nullptr;
  if (getpwuid_r(cred.uid, &pw, buffer.data(), buffer.size(), &found) == 0 && found) {
    int count = 64;
    std::vector<gid_t> groups(static_cast<size_t>(count));
    if (getgrouplist(pw.pw_name, cred.gid, groups.data(), &count) < 0 && count > 64) {
      groups.resize(static_cast<size_t>(count));
      getgrouplist(pw.pw_name, cred.gid, groups.data(), &count);
    }
    groups.resize(static_cast<size_t>(std::max(0, count)));
    for (gid_t g : groups) {
      if (std::find(caller.groups.begin(), caller.groups.end(), g) == caller.groups.end()) {
        caller.groups.push_back(g);
      }
    }
  }
  return caller;
}

bool Policy::Allows(const Caller& caller) const {
  // Root can read refitd's memory anyway (ptrace, /proc): refusing it protects nothing and
  // would lock out `sudo refitctl`.
  if (caller.uid == daemon_uid || caller.uid == 0) return true;
  if (std::find(allow_uids.begin(), allow_uids.end(), caller.uid) != allow_uids.end()) {
    return true;
  }
  for (gid_t g : caller.groups) {
    if (std::find(allow_gids.begin(), allow_gids.end(), g) != allow_gids.end()) return true;
  }
  return false;
}

std::string Policy::Describe() const {
  return absl::StrCat(
      "root, uid ", daemon_uid,
      allow_uids.empty() ? "" : absl::StrCat(", uids ", absl::StrJoin(allow_uids, ",")),
      allow_gids.empty() ? "" : absl::StrCat(", gids ", absl::StrJoin(allow_gids, ",")));
}

Policy DefaultPolicy(gid_t socket_gid) {
  Policy policy;
  policy.daemon_uid = geteuid();
  policy.allow_gids = {socket_gid};
  return policy;
}

absl::Status CheckAccess(const Caller& caller, const struct stat& st, bool write,
                         const std::string& what) {
  if (caller.uid == 0) return absl::OkStatus();
  mode_t bits;
  if (caller.uid == st.st_uid) {
    bits = (st.st_mode >> 6) & 7;
  } else if (std::find(caller.groups.begin(), caller.groups.end(), st.st_gid) !=
             caller.groups.end()) {
    bits = (st.st_mode >> 3) & 7;
  } else {
    bits = st.st_mode & 7;
  }
  const bool readable = bits & 4, writable = bits & 2;
  if (readable && (!write || writable)) return absl::OkStatus();
  return absl::PermissionDeniedError(
      absl::StrCat(what, " (owner uid ", st.st_uid, ", gid ", st.st_gid, ", mode ",
                   absl::StrFormat("%04o", st.st_mode & 07777), ") is not ",
                   write ? "readable and writable" : "readable", " by the caller (",
                   caller.Describe(), "); a caller lends refitd only memory it can open itself"));
}

}  // namespace refit::callers
