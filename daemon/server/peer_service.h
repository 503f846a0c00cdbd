#pragma once

// refit.v1.Peer: what this daemon answers to other daemons on its --listen address.
//
// Thread-safety: gRPC calls the handlers from its own threads, concurrently.

#include <string>

#include "proto/refit/v1/peer.grpc.pb.h"

namespace refit::server {

class PeerService final : public v1::Peer::Service {
 public:
  explicit PeerService(std::string node) : node_(std::move(node)) {}

  grpc::Status Hello(grpc::ServerContext* context, const v1::HelloRequest* request,
                     v1::HelloResponse* response) override;

 private:
  const std::string node_;
};

}  // namespace refit::server
