#pragma once

// Owner exit where refitd cannot watch the process (another pid namespace: SO_PEERCRED says
// pid 0, e.g. a trainer pod beside a refitd pod without hostPID): each buffer such a process
// registers is held on a lease that the client libraries renew (RenewLeases); a buffer whose
// lease runs out is released like a dead owner's (its published versions stay held).
//
// Thread-safety: every method may be called from any thread. One thread of its own sleeps
// until the next lease runs out (no polling).

#include <sys/types.h>

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "daemon/common/mutex.h"
#include "daemon/server/owners.h"
#include "daemon/server/server_metrics.h"
#include "daemon/store/buffer_registry.h"

namespace refit::server {

// How long a lease lasts after its last renewal; the client libraries renew every third of it.
inline constexpr std::chrono::milliseconds kClientLease{10000};

class Leases {
 public:
  // Not owned: `store` and `metrics` outlive this.
  Leases(BufferRegistry* store, std::shared_ptr<Owners> owners, Metrics* metrics,
         std::chrono::milliseconds length);
  ~Leases();  // stops the thread; leases left are not released
  Leases(const Leases&) = delete;
  Leases& operator=(const Leases&) = delete;

  std::chrono::milliseconds length() const { return length_; }
  // `buffer_id`, registered by `uid`, is held on a lease from now on.
  void Grant(const std::string& buffer_id, uid_t uid);
  // Renews the leases `uid` holds among `ids`; returns the others.
  std::vector<std::string> Renew(const std::vector<std::string>& ids, uid_t uid);
  // The buffer was released: no lease any more.
  void Forget(const std::string& buffer_id);

 private:
  struct Lease {
    uid_t uid = 0;
    std::chrono::steady_clock::time_point expires;
  };
  void Run();

  BufferRegistry* const store_;
  const std::shared_ptr<Owners> owners_;
  Metrics* const metrics_;
  const std::chrono::milliseconds length_;
  common::Mutex mu_;
  common::CondVar wake_;
  std::map<std::string, Lease> leases_ ABSL_GUARDED_BY(mu_);
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace refit::server
