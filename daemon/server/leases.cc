#include "daemon/server/leases.h"

#include "absl/strings/str_cat.h"
#include "daemon/common/logging.h"

namespace refit::server {

using Clock = std::chrono::steady_clock;

Leases::Leases(BufferRegistry* store, std::shared_ptr<Owners> owners, Metrics* metrics,
               std::chrono::milliseconds length)
    : store_(store), owners_(std::move(owners)), metrics_(metrics), length_(length) {
  metrics_->Declare(kOwnerExitReleases);
  thread_ = std::thread([this] { Run(); });
}

Leases::~Leases() {
  {
    common::MutexLock lock(mu_);
    stop_ = true;
  }
  wake_.NotifyAll();
  thread_.join();
}

void Leases::Grant(const std::string& buffer_id, uid_t uid) {
  {
    common::MutexLock lock(mu_);
    leases_[buffer_id] = Lease{uid, Clock::now() + length_};
  }
  wake_.NotifyAll();
}

std::vector<std::string> Leases::Renew(const std::vector<std::string>& ids, uid_t uid) {
  std::vector<std::string> unknown;
  common::MutexLock lock(mu_);
  const auto expires = Clock::now() + length_;
  for (const std::string& id : ids) {
    auto it = leases_.find(id);
    if (it == leases_.end() || it->second.uid != uid) {
      unknown.push_back(id);
      continue;
    }
    it->second.expires = expires;
  }
  return unknown;
}

void Leases::Forget(const std::string& buffer_id) {
  common::MutexLock lock(mu_);
  leases_.erase(buffer_id);
}

void Leases::Run() {
  common::UniqueLock lock(mu_);
  while (!stop_) {
    if (leases_.empty()) {
      wake_.Wait(lock);
      continue;
    }
    const auto now = Clock::now();
    auto next = Clock::time_point::max();
    std::vector<std::pair<std::string, uid_t>> expired;
    for (auto it = leases_.begin(); it != leases_.end();) {
      if (it->second.expires <= now) {
        expired.emplace_back(it->first, it->second.uid);
        it = leases_.erase(it);
      } else {
        next = std::min(next, it->second.expires);
        ++it;
      }
    }
    if (expired.empty()) {
      wake_.WaitUntil(lock, next);
      continue;
    }
    lock.unlock();
    for (const auto& [id, uid] : expired) {
      owners_->Forget(id);
      const std::string why =
          absl::StrCat("its lease ran out: the process that registered it (uid ", uid,
                       ", in a pid namespace refitd cannot see) stopped renewing it for ",
                       length_.count(), " ms");
      if (store_->ReleaseBuffer(id, why).ok()) metrics_->Add(kOwnerExitReleases, 1);
    }
    lock.lock();
  }
}

}  // namespace refit::server
