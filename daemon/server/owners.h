#pragma once

// Which uid registered each buffer: only that uid may publish, apply or release it (the
// daemon's own uid may release any, for operators cleaning up). Shared by the per-uid
// RefitService instances (daemon/callers routes each connection to the one of its uid).
//
// Thread-safety: every method may be called from any thread.

#include <sys/types.h>

#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace refit::server {

class Owners {
 public:
  void Set(const std::string& buffer_id, uid_t uid) {
    std::lock_guard<std::mutex> lock(mu_);
    owners_[buffer_id] = uid;
  }
  void Forget(const std::string& buffer_id) {
    std::lock_guard<std::mutex> lock(mu_);
    owners_.erase(buffer_id);
  }
  // PERMISSION_DENIED naming the first id `uid` does not own. Ids nobody registered here pass:
  // the store answers NOT_FOUND for them.
  absl::Status Check(const std::vector<std::string>& ids, uid_t uid, const char* what) const {
    std::lock_guard<std::mutex> lock(mu_);
    for (const std::string& id : ids) {
      auto it = owners_.find(id);
      if (it != owners_.end() && it->second != uid) {
        return absl::PermissionDeniedError(absl::StrCat(
            "buffer ", id, " was registered by uid ", it->second, "; uid ", uid, " may not ",
            what, " it"));
      }
    }
    return absl::OkStatus();
  }

 private:
  mutable std::mutex mu_;
  std::map<std::string, uid_t> owners_;
};

}  // namespace refit::server
