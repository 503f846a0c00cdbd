// PeerService's Hold: a Rollback or Resume asked on another node and forwarded here, to a node
// with SOURCE buffers of the model. Its Subscribe events then carry the rollback target
// (PeerEvent.rollback_version) to every node pulling the model. peer_service.cc has the rest.

#include "absl/strings/str_cat.h"
#include "daemon/common/logging.h"
#include "daemon/convert/convert.h"
#include "daemon/peer/peer_limits.h"
#include "daemon/peer/peer_service.h"

namespace refit::peer {

grpc::Status PeerService::Hold(grpc::ServerContext* context, const v1::HoldRequest* request,
                               v1::HoldResponse* response) {
  if (absl::Status name = CheckNodeName(request->node()); !name.ok()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(name.message()));
  }
  if (absl::Status who = Authenticate(*context, request->node()); !who.ok()) {
    return grpc::Status(grpc::StatusCode::PERMISSION_DENIED, std::string(who.message()));
  }
  if (absl::Status name = CheckModelName(request->model()); !name.ok()) {
    return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT, std::string(name.message()));
  }
  if (request->version() == 0) {
    absl::Status resumed = store_->Resume(request->model());
    if (resumed.ok()) {
      Logger("peer")->info("model={} resumed, asked by node {}", Printable(request->model()),
                           Printable(request->node()));
    }
    return convert::ToGrpc(resumed);
  }
  auto rolled = store_->Rollback(request->model(), request->version());
  if (!rolled.ok()) return convert::ToGrpc(rolled.status());
  Logger("peer")->info("model={} rolled back to version {}, asked by node {}",
                       Printable(request->model()), *rolled, Printable(request->node()));
  response->set_version(*rolled);
  return grpc::Status::OK;
}

}  // namespace refit::peer
