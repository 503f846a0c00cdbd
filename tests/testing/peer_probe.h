#pragma once

// A fake peer on a real refitd's peer port (issue 37): it asks what a daemon tells a node
// (Subscribe: each piece's remote key for that node), pins versions, and asks for checksums
// inside that grant, as a puller does. Tests of the peer plane build attacks and legitimate
// calls from it.

#include <chrono>
#include <map>
#include <memory>
#include <string>

#include "grpcpp/grpcpp.h"
#include "proto/refit/v1/peer.grpc.pb.h"

namespace refit::testing {

class PeerProbe {
 public:
  explicit PeerProbe(int port)
      : stub_(v1::Peer::NewStub(grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                                    grpc::InsecureChannelCredentials()))) {}

  v1::Peer::Stub* stub() { return stub_.get(); }

  // buffer id -> the remote key of each piece of `model` at version `version`, as the daemon
  // announces it to `node` (empty when it didn't within 10 s).
  std::map<std::string, std::string> KeysFor(const std::string& node, const std::string& model,
                                             uint64_t version) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::SubscribeRequest request;
    request.set_node(node);
    auto reader = stub_->Subscribe(&context, request);
    v1::PeerEvent event;
    std::map<std::string, std::string> keys;
    while (reader->Read(&event)) {
      if (event.model() != model || event.version() != version) continue;
      for (const auto& piece : event.pieces()) keys[piece.buffer_id()] = piece.remote_key();
      break;
    }
    context.TryCancel();
    (void)reader->Finish();
    return keys;
  }

  grpc::Status Pin(const std::string& node, const std::string& model, uint64_t version,
                   bool release = false, uint32_t lease_ms = 60000) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::PinRequest request;
    request.set_model(model);
    request.set_version(version);
    request.set_node(node);
    request.set_release(release);
    request.set_lease_ms(lease_ms);
    v1::PinResponse response;
    return stub_->Pin(&context, request, &response);
  }

  grpc::Status Checksum(const v1::ChecksumRequest& request, v1::ChecksumResponse* response) {
    grpc::ClientContext context;
    context.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    return stub_->Checksum(&context, request, response);
  }

 private:
  std::unique_ptr<v1::Peer::Stub> stub_;
};

}  // namespace refit::testing
