#pragma once

// The API as local callers that --allow-uids / --allow-gids refuse see it: every method of
// every service, health included, answers PERMISSION_DENIED, saying who the
// caller is and who is allowed. A generic service, so methods added later are covered too.
//
// Thread-safety: stateless after construction.

#include <string>

#include "grpcpp/generic/async_generic_service.h"
#include "grpcpp/grpcpp.h"

namespace refit::server {

class DeniedService final : public grpc::CallbackGenericService {
 public:
  explicit DeniedService(std::string why) : why_(std::move(why)) {}

  grpc::ServerGenericBidiReactor* CreateReactor(grpc::GenericCallbackServerContext*) override {
    class Refusal final : public grpc::ServerGenericBidiReactor {
     public:
      explicit Refusal(const std::string& why) {
        Finish(grpc::Status(grpc::StatusCode::PERMISSION_DENIED, why));
      }
      void OnDone() override { delete this; }
    };
    return new Refusal(why_);
  }

 private:
  const std::string why_;
};

}  // namespace refit::server
