#pragma once

// Renews the leases refitd holds this process's buffers on when it cannot watch the process
// (RegisterBufferResponse.lease_ms > 0: refitd in another pid namespace). A thread of its own
// calls RenewLeases every third of the lease for every leased buffer not yet released; it
// starts with the first lease and stops with the keeper. Without it refitd would release those
// buffers lease_ms after registration.
//
// Thread-safety: every method may be called from any thread.

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>

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
  std::mutex mu_;
  std::condition_variable wake_;
  std::set<std::string> ids_;               // guarded by mu_
  std::chrono::milliseconds period_{1000};  // guarded by mu_
  bool stop_ = false;                       // guarded by mu_
  std::thread thread_;                      // started by the first Add
};

}  // namespace refit::client
