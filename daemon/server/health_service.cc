#include "daemon/server/health_service.h"

#include <chrono>
#include <thread>

#include "absl/strings/str_join.h"
#include "daemon/common/logging.h"

namespace refit::server {

using grpc::health::v1::HealthCheckResponse;

bool HealthService::Faulted() const {
  if (faulted_) return true;
  if (stall_check_) {
    const std::vector<std::string> stuck = stall_check_();
    if (!stuck.empty()) {
      if (!stalled_.exchange(true)) {
        Logger("server")->error("health is NOT_SERVING while stuck: {}",
                                absl::StrJoin(stuck, "; "));
      }
      return true;
    }
    if (stalled_.exchange(false)) Logger("server")->warn("health: nothing is stuck any more");
  }
  if (!fault_check_) return false;
  const absl::Status fault = fault_check_();
  if (fault.ok()) return false;
  if (!faulted_.exchange(true)) {
    Logger("server")->error("health is NOT_SERVING from now on: {}", fault.ToString());
  }
  return true;
}

HealthCheckResponse::ServingStatus HealthService::StatusOf(const std::string& service) const {
  if (!service.empty() && services_.count(service) == 0) {
    return HealthCheckResponse::SERVICE_UNKNOWN;
  }
  return serving_ && !Faulted() ? HealthCheckResponse::SERVING : HealthCheckResponse::NOT_SERVING;
}

grpc::Status HealthService::Check(grpc::ServerContext*,
                                  const grpc::health::v1::HealthCheckRequest* request,
                                  HealthCheckResponse* response) {
  auto status = StatusOf(request->service());
  if (status == HealthCheckResponse::SERVICE_UNKNOWN) {
    return grpc::Status(grpc::StatusCode::NOT_FOUND, "unknown service " + request->service());
  }
  response->set_status(status);
  return grpc::Status::OK;
}

grpc::Status HealthService::Watch(grpc::ServerContext* context,
                                  const grpc::health::v1::HealthCheckRequest* request,
                                  grpc::ServerWriter<HealthCheckResponse>* writer) {
  // Sends the status now and on every change, until the caller goes away or the daemon stops.
  bool first = true;
  HealthCheckResponse::ServingStatus last = HealthCheckResponse::UNKNOWN;
  while (!context->IsCancelled()) {
    auto now = StatusOf(request->service());
    if (first || now != last) {
      HealthCheckResponse response;
      response.set_status(now);
      if (!writer->Write(response)) break;
      last = now;
      first = false;
      if (now == HealthCheckResponse::NOT_SERVING) break;  // stopping, or a CUDA fault
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return grpc::Status::OK;
}

grpc::Status LocalHealthService::Check(grpc::ServerContext* context,
                                       const grpc::health::v1::HealthCheckRequest* request,
                                       HealthCheckResponse* response) {
  return inner_->Check(context, request, response);
}

grpc::Status LocalHealthService::Watch(grpc::ServerContext* context,
                                       const grpc::health::v1::HealthCheckRequest* request,
                                       grpc::ServerWriter<HealthCheckResponse>* writer) {
  auto hold = budget_->Acquire(caller_, "grpc.health.v1.Health/Watch");
  if (!hold.ok()) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED, std::string(hold.status().message()));
  }
  return inner_->Watch(context, request, writer);
}

}  // namespace refit::server
