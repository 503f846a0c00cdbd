// grpc.health.v1 answers: SERVING only while the daemon serves and no fault (a sticky CUDA
// error) was reported; after a fault, NOT_SERVING for good, and a Watch says so and ends.

#include "daemon/server/health_service.h"

#include <atomic>

#include "catch2/catch.hpp"

namespace refit::server {
namespace {

using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

HealthCheckResponse::ServingStatus Check(HealthService& health, const std::string& service) {
  HealthCheckRequest request;
  request.set_service(service);
  HealthCheckResponse response;
  grpc::ServerContext context;
  REQUIRE(health.Check(&context, &request, &response).ok());
  return response.status();
}

TEST_CASE("health turns NOT_SERVING after a fault and stays there", "[server][health]") {
  HealthService health({"refit.v1.Refit"});
  std::atomic<int> checks{0};
  absl::Status fault = absl::OkStatus();
  health.SetFaultCheck([&] {
    ++checks;
    return fault;
  });
  CHECK(Check(health, "") == HealthCheckResponse::NOT_SERVING);  // not started yet
  health.SetServing(true);
  CHECK(Check(health, "") == HealthCheckResponse::SERVING);
  CHECK(Check(health, "refit.v1.Refit") == HealthCheckResponse::SERVING);
  CHECK(checks > 0);

  fault = absl::InternalError("sticky CUDA error: cudaErrorIllegalAddress");
  CHECK(Check(health, "") == HealthCheckResponse::NOT_SERVING);
  CHECK(Check(health, "refit.v1.Refit") == HealthCheckResponse::NOT_SERVING);
  health.SetServing(true);  // neither serving again nor the check turning OK clears it
  fault = absl::OkStatus();
  CHECK(Check(health, "") == HealthCheckResponse::NOT_SERVING);

  HealthCheckRequest unknown;
  unknown.set_service("no.such.Service");
  HealthCheckResponse response;
  grpc::ServerContext context;
  CHECK(health.Check(&context, &unknown, &response).error_code() == grpc::StatusCode::NOT_FOUND);
}

TEST_CASE("without a fault check, health follows SetServing", "[server][health]") {
  HealthService health({});
  health.SetServing(true);
  CHECK(Check(health, "") == HealthCheckResponse::SERVING);
  health.SetServing(false);
  CHECK(Check(health, "") == HealthCheckResponse::NOT_SERVING);
}

}  // namespace
}  // namespace refit::server
