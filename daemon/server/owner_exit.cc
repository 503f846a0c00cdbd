#include "daemon/server/owner_exit.h"

#include "absl/strings/str_cat.h"
#include "daemon/common/logging.h"

namespace refit::server {

void OwnerExit::OnClientExit(const callers::Caller& caller) {
  const std::vector<std::string> ids = owners_->TakeProcess(caller.uid, caller.pid);
  if (ids.empty()) return;
  const std::string why = absl::StrCat("the process that registered it exited (pid ", caller.pid,
                                       ", uid ", caller.uid, ")");
  size_t released = 0;
  for (const std::string& id : ids) {
    // NOT_FOUND: the process released it itself just before it went.
    if (store_->ReleaseBuffer(id, why).ok()) ++released;
  }
  if (released == 0) return;
  metrics_->Add(kOwnerExitReleases, static_cast<double>(released));
  Logger("server")->info("client pid={} uid={} exited: {} of its buffers released", caller.pid,
                         caller.uid, released);
}

}  // namespace refit::server
