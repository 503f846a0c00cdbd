#pragma once

// grpc.health.v1.Health, served on the Unix socket, the peer listener and --health-listen.
// refit implements it itself (rather than gRPC's default service) so that a server carrying
// nothing but health checks — the Kubernetes probe port — is possible.
//
// Thread-safety: SetServing may be called from any thread; gRPC calls the handlers concurrently.

#include <atomic>
#include <functional>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "daemon/callers/call_budget.h"
#include "daemon/callers/caller.h"
#include "proto/grpc/health/v1/health.grpc.pb.h"

namespace refit::server {

class HealthService final : public grpc::health::v1::Health::Service {
 public:
  // `services` are the names answered besides "" (the whole daemon), e.g. "refit.v1.Refit".
  explicit HealthService(std::set<std::string> services) : services_(std::move(services)) {}

  void SetServing(bool serving) { serving_ = serving; }

  // Asked on every check: a non-OK answer (a sticky CUDA error: cuda::StickyError) means the
  // process can no longer do its work, so health is NOT_SERVING from then on, whatever
  // SetServing says; the first such answer is logged. Set before serving starts.
  void SetFaultCheck(std::function<absl::Status()> check) { fault_check_ = std::move(check); }

  // Asked on every check too, but not latched: what is stuck now (Liveness::Stuck), empty when
  // nothing is. NOT_SERVING while it says something; the change is logged. Set before serving.
  void SetStallCheck(std::function<std::vector<std::string>()> check) {
    stall_check_ = std::move(check);
  }

  grpc::Status Check(grpc::ServerContext* context,
                     const grpc::health::v1::HealthCheckRequest* request,
                     grpc::health::v1::HealthCheckResponse* response) override;
  grpc::Status Watch(grpc::ServerContext* context,
                     const grpc::health::v1::HealthCheckRequest* request,
                     grpc::ServerWriter<grpc::health::v1::HealthCheckResponse>* writer) override;

 private:
  grpc::health::v1::HealthCheckResponse::ServingStatus StatusOf(const std::string& service) const;

  bool Faulted() const;

  const std::set<std::string> services_;
  std::atomic<bool> serving_{false};
  std::function<absl::Status()> fault_check_;
  std::function<std::vector<std::string>()> stall_check_;
  mutable std::atomic<bool> stalled_{false};
  mutable std::atomic<bool> faulted_{false};  // latched
};

// Health as one local caller sees it (a server of daemon/callers): the daemon's HealthService,
// with each Watch stream counted against the callers' CallBudget, so that open Watch streams
// can't hold every server thread (RESOURCE_EXHAUSTED past the budget). Check is not bounded:
// it returns at once.
class LocalHealthService final : public grpc::health::v1::Health::Service {
 public:
  // `inner` and `budget` are not owned and must outlive this.
  LocalHealthService(HealthService* inner, callers::CallBudget* budget, callers::Caller caller)
      : inner_(inner), budget_(budget), caller_(std::move(caller)) {}

  grpc::Status Check(grpc::ServerContext* context,
                     const grpc::health::v1::HealthCheckRequest* request,
                     grpc::health::v1::HealthCheckResponse* response) override;
  grpc::Status Watch(grpc::ServerContext* context,
                     const grpc::health::v1::HealthCheckRequest* request,
                     grpc::ServerWriter<grpc::health::v1::HealthCheckResponse>* writer) override;

 private:
  HealthService* const inner_;
  callers::CallBudget* const budget_;
  const callers::Caller caller_;
};

}  // namespace refit::server
