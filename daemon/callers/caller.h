#pragma once

// Who is calling on the Unix socket, as the kernel says (SO_PEERCRED), and what the operator
// lets them do (--allow-uids, --allow-gids): the local half of refit's trust boundary.
//
// Thread-safety: plain values; the functions may be called from any thread.

#include <sys/stat.h>
#include <sys/types.h>

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace refit::callers {

struct Caller {
  pid_t pid = 0;
  uid_t uid = 0;
  gid_t gid = 0;
  std::vector<gid_t> groups;     // supplementary groups of uid (with gid), as the system lists them
  std::string Describe() const;  // "uid 1000 gid 1000 pid 4242"
};

// The kernel's view of the process at the other end of the connected Unix socket `fd`, with
// the groups of its uid.
absl::StatusOr<Caller> PeerOf(int fd);

// Which local callers may use the API at all.
struct Policy {
  std::vector<uid_t> allow_uids;  // empty: none besides the daemon's own uid
  std::vector<gid_t> allow_gids;  // a caller in any of these groups (primary or supplementary)
  uid_t daemon_uid = 0;  // always allowed, as is root: both can read refitd's memory anyway
  bool Allows(const Caller& caller) const;
  std::string Describe() const;
};

// The default policy: the daemon's own uid and the socket's group (`socket_gid`).
Policy DefaultPolicy(gid_t socket_gid);

// PERMISSION_DENIED unless `caller` could open an object with `st`'s owner, group and mode for
// reading (and writing, with `write`) itself: a caller may lend refitd only memory it could
// use. Root may open anything.
absl::Status CheckAccess(const Caller& caller, const struct stat& st, bool write,
                         const std::string& what);

}  // namespace refit::callers
