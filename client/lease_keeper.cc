#include "client/lease_keeper.h"

#include <algorithm>

#include "grpcpp/grpcpp.h"

namespace refit::client {

LeaseKeeper::~LeaseKeeper() {
  {
    common::MutexLock lock(mu_);
    stop_ = true;
  }
  wake_.NotifyAll();
  if (thread_.joinable()) thread_.join();
}

void LeaseKeeper::Add(const std::string& buffer_id, uint32_t lease_ms) {
  common::MutexLock lock(mu_);
  ids_.insert(buffer_id);
  period_ = std::min(period_, std::chrono::milliseconds(std::max<uint32_t>(lease_ms / 3, 50)));
  if (!thread_.joinable()) thread_ = std::thread([this] { Run(); });
}

void LeaseKeeper::Remove(const std::string& buffer_id) {
  common::MutexLock lock(mu_);
  ids_.erase(buffer_id);
}

void LeaseKeeper::Run() {
  common::UniqueLock lock(mu_);
  while (!stop_) {
    wake_.WaitFor(lock, period_, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; });
    if (stop_ || ids_.empty()) continue;
    v1::RenewLeasesRequest request;
    for (const std::string& id : ids_) request.add_buffer_ids(id);
    const auto timeout = period_;
    lock.unlock();
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + timeout);
    v1::RenewLeasesResponse response;
    const grpc::Status status = stub_->RenewLeases(&context, request, &response);
    lock.lock();
    if (!status.ok()) continue;  // the daemon is busy or gone: try again next period
    for (const std::string& id : response.unknown_ids()) ids_.erase(id);  // released, expired
  }
}

}  // namespace refit::client
