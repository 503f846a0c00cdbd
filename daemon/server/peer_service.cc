#include "daemon/server/peer_service.h"

#include "daemon/common/logging.h"
#include "daemon/version.h"

namespace refit::server {

grpc::Status PeerService::Hello(grpc::ServerContext* context, const v1::HelloRequest* request,
                                v1::HelloResponse* response) {
  Logger("peer")->debug("hello from node={} version={} at {}", request->node(),
                        request->version(), context->peer());
  response->set_node(node_);
  response->set_version(kRefitVersion);
  return grpc::Status::OK;
}

}  // namespace refit::server
