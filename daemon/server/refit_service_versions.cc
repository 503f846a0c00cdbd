// RefitService's Rollback and Resume: a fleet held back to a retained version, on any node.
// Where other nodes hold the model's SOURCE buffers the request goes to them (the peer plane's
// Hold), whose Subscribe events carry it to every node pulling the model, this one included;
// the call answers once this node follows. Otherwise this node alone holds the model back.
// docs/architecture.md, "Rollback".

#include <chrono>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/common/logging.h"
#include "daemon/convert/convert.h"
#include "daemon/server/refit_service.h"

namespace refit::server {
namespace {

constexpr size_t kMaxModelBytes = 1024;
// How long a forwarded Rollback or Resume waits for the source nodes' events to bring it back
// here (they are sent as soon as the source node changed).
constexpr auto kFollowWait = std::chrono::seconds(10);

absl::Status CheckModel(const std::string& model) {
  if (model.empty() || model.size() > kMaxModelBytes) {
    return absl::InvalidArgumentError("model name is 1 to 1024 bytes");
  }
  return absl::OkStatus();
}

Clock::time_point FollowDeadline(const grpc::ServerContext& context) {
  const auto deadline = convert::SteadyDeadline(context);
  return std::min(deadline - std::chrono::milliseconds(50), Clock::now() + kFollowWait);
}

}  // namespace

grpc::Status RefitService::Rollback(grpc::ServerContext* context,
                                    const v1::RollbackRequest* request,
                                    v1::RollbackResponse* response) {
  if (absl::Status valid = CheckModel(request->model()); !valid.ok()) {
    return Finish("Rollback", valid);
  }
  if (request->version() == 0) {
    return Finish("Rollback", absl::InvalidArgumentError("rollback needs a version >= 1"));
  }
  // Checked here first: a version this node no longer holds is refused before anyone changes.
  if (absl::Status held = context_.store->CheckRollback(request->model(), request->version());
      !held.ok()) {
    return Finish("Rollback", held);
  }
  const std::vector<std::string> sources = context_.store->SourceNodes(request->model());
  if (sources.empty() || !context_.node_view) {
    auto rolled = context_.store->Rollback(request->model(), request->version());
    if (!rolled.ok()) return Finish("Rollback", rolled.status());
    response->set_version(*rolled);
    return grpc::Status::OK;
  }
  if (absl::Status told =
          context_.node_view->ForwardHold(request->model(), request->version(), sources);
      !told.ok()) {
    return Finish("Rollback", told);
  }
  // A node with SOURCE buffers of its own too (a trainer spanning nodes) holds it itself.
  if (context_.store->HoldOf(request->model()) != request->version()) {
    bool local_sources = false;
    for (const ModelInfo& info : context_.store->Models()) {
      if (info.name == request->model()) local_sources = info.source_buffers > 0;
    }
    if (local_sources) {
      auto rolled = context_.store->Rollback(request->model(), request->version());
      if (!rolled.ok()) return Finish("Rollback", rolled.status());
    }
  }
  if (!context_.store->WaitForHold(request->model(), request->version(),
                                   FollowDeadline(*context))) {
    return Finish("Rollback", absl::UnavailableError(absl::StrCat(
                                  "model ", request->model(), ": rollback to version ",
                                  request->version(), " was told to ", absl::StrJoin(sources, ", "),
                                  " but has not come back to this node yet; `refitctl status` "
                                  "shows the model's rollback version once it has")));
  }
  response->set_version(request->version());
  return grpc::Status::OK;
}

grpc::Status RefitService::Resume(grpc::ServerContext* context, const v1::ResumeRequest* request,
                                  v1::ResumeResponse*) {
  if (absl::Status valid = CheckModel(request->model()); !valid.ok()) {
    return Finish("Resume", valid);
  }
  if (context_.store->HoldOf(request->model()) == 0) {
    return Finish("Resume", absl::FailedPreconditionError(absl::StrCat(
                                "model ", request->model(),
                                " is not rolled back on this node: nothing to resume")));
  }
  const std::vector<std::string> sources = context_.store->SourceNodes(request->model());
  if (!sources.empty() && context_.node_view) {
    absl::Status told = context_.node_view->ForwardHold(request->model(), 0, sources);
    // A source node that is not held back (its refitd restarted since) has nothing to resume;
    // this node resumes on its own then.
    if (!told.ok() && told.code() != absl::StatusCode::kFailedPrecondition) {
      return Finish("Resume", told);
    }
    if (context_.store->WaitForHold(request->model(), 0, FollowDeadline(*context))) {
      return grpc::Status::OK;
    }
  }
  absl::Status resumed = context_.store->Resume(request->model());
  // Resumed meanwhile by the source node's event: done all the same.
  if (!resumed.ok() && context_.store->HoldOf(request->model()) == 0) return grpc::Status::OK;
  return Finish("Resume", resumed);
}

}  // namespace refit::server
