#pragma once

// Renews the leases refitd holds this process's buffers on when it cannot watch the process
// (RegisterBufferResponse.lease_ms > 0: refitd in another pid namespace). A thread of its own
// calls RenewLeases every third of the lease for every leased buffer not yet released; it
// starts with the first lease and stops with the keeper. Without it refitd would release those
// buffers lease_ms after registration.
//
// Thread-safety: every method may be called from any thread.

#include <chrono>
#include <memory>
#include <set>
#include <string>
#include <thread>

#include "daemon/common/mutex.h"
#include "proto/refit/v1/refit.grpc.pb.h"

namespace refit::client {

class LeaseKeeper {
 public:
  explicit LeaseKeeper(v1::Refit::StubInterface* stub) : stub_(stub) {}  // not owned
  ~LeaseKeeper();

  // `buffer_id` is held on a lease of `lease_ms`.
  void Add(const std::string& buffer_id, uint32_t lease_ms);
  void Remove(const std::string& buffer_id);

 private:
  void Run();

  v1::Refit::StubInterface* const stub_;
  common::Mutex mu_;
  common::CondVar wake_;
  std::set<std::string> ids_ ABSL_GUARDED_BY(mu_);
  std::chrono::milliseconds period_ ABSL_GUARDED_BY(mu_){1000};
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::thread thread_;  // started by the first Add
};

}  // namespace refit::client
