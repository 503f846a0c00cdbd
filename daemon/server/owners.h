#pragma once

// Which uid (and process) registered each buffer: only that uid may publish, apply or release
// it (the daemon's own uid and root may release any, for operators cleaning up); when that
// process exits, its buffers are released (owner exit). Shared by the RefitService instances
// (daemon/callers routes each connection to the one of its process, or of its uid).
//
// Thread-safety: every method may be called from any thread.

#include <sys/types.h>

#include <map>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "daemon/common/mutex.h"

namespace refit::server {

class Owners {
 public:
  // `pid` 0: a process refitd cannot watch (its buffers stay until released).
  void Set(const std::string& buffer_id, uid_t uid, pid_t pid) {
    common::MutexLock lock(mu_);
    owners_[buffer_id] = {uid, pid};
    if (pid != 0) by_process_[{uid, pid}].insert(buffer_id);
  }
  void Forget(const std::string& buffer_id) {
    common::MutexLock lock(mu_);
    auto it = owners_.find(buffer_id);
    if (it == owners_.end()) return;
    auto process = by_process_.find(it->second);
    if (process != by_process_.end()) {
      process->second.erase(buffer_id);
      if (process->second.empty()) by_process_.erase(process);
    }
    owners_.erase(it);
  }
  // The buffers the process (uid, pid) registered and that are still known here, forgotten.
  std::vector<std::string> TakeProcess(uid_t uid, pid_t pid) {
    common::MutexLock lock(mu_);
    auto it = by_process_.find({uid, pid});
    if (it == by_process_.end()) return {};
    std::vector<std::string> ids(it->second.begin(), it->second.end());
    for (const std::string& id : ids) owners_.erase(id);
    by_process_.erase(it);
    return ids;
  }
  // True when `uid` registered `buffer_id` (and it is still known here).
  bool Owns(const std::string& buffer_id, uid_t uid) const {
    common::MutexLock lock(mu_);
    auto it = owners_.find(buffer_id);
    return it != owners_.end() && it->second.first == uid;
  }
  // PERMISSION_DENIED naming the first id `uid` does not own. Ids nobody registered here pass:
  // the store answers NOT_FOUND for them.
  absl::Status Check(const std::vector<std::string>& ids, uid_t uid, const char* what) const {
    common::MutexLock lock(mu_);
    for (const std::string& id : ids) {
      auto it = owners_.find(id);
      if (it != owners_.end() && it->second.first != uid) {
        return absl::PermissionDeniedError(absl::StrCat("buffer ", id, " was registered by uid ",
                                                        it->second.first, "; uid ", uid,
                                                        " may not ", what, " it"));
      }
    }
    return absl::OkStatus();
  }

 private:
  mutable common::Mutex mu_;
  std::map<std::string, std::pair<uid_t, pid_t>> owners_ ABSL_GUARDED_BY(mu_);  // by buffer id
  // The buffers of each watched process (pid != 0).
  std::map<std::pair<uid_t, pid_t>, std::set<std::string>> by_process_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::server
