// RefitService's RL semantics (issue 35): provenance labels, the staleness budget, and the
// version timeline (daemon/rl holds their state).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "daemon/common/logging.h"
#include "daemon/rl/labels.h"
#include "daemon/rl/staleness.h"
#include "daemon/rl/timeline.h"
#include "daemon/rl/timeline_service.h"
#include "daemon/server/refit_service.h"

namespace refit::server {

absl::Status RefitService::BeforePublish(const v1::PublishRequest& request, bool* labels_set) {
  *labels_set = false;
  const rl::Labels labels = rl::FromProto(request.labels());
  if (absl::Status ok = rl::CheckLabels(labels); !ok.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("model ", request.model(), " version ",
                                                   request.version(), ": ", ok.message(),
                                                   "; nothing was published"));
  }
  if (request.max_staleness() > 0) {
    if (!context_.replicas || context_.replicas->ReplicasOf(request.model()).empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "model ", request.model(), ": max_staleness=", request.max_staleness(),
          " needs replicas to wait for, and no node with DESTINATION buffers for the model has "
          "reported to this daemon (ModelStatus.replicas is empty); nothing was published"));
    }
  }
  if (context_.rl.staleness) {
    // Before the snapshot: the version's announcement carries the budget.
    context_.rl.staleness->SetBudget(request.model(), request.max_staleness());
  }
  if (context_.rl.labels && !labels.empty()) {
    // Set before the snapshot: the version is announced to other nodes as soon as it is whole.
    *labels_set = context_.rl.labels->SetIfAbsent(request.model(), request.version(), labels);
  }
  return absl::OkStatus();
}

absl::Status RefitService::AfterPublish(grpc::ServerContext* context,
                                        const v1::PublishRequest& request, uint64_t version,
                                        Clock::time_point started) {
  if (context_.rl.timeline) {
    context_.rl.timeline->Record(
        request.model(), version, rl::kStagePublished, rl::WallMicros(started), rl::WallMicros(),
        absl::StrCat(context_.caller ? absl::StrCat("by pid ", context_.caller->pid, ", ") : "",
                     request.buffer_ids_size(), " buffer(s)"));
  }
  if (context_.rl.staleness) {
    context_.rl.staleness->NotePublished(request.model(), version, request.max_staleness());
  }
  const uint32_t k = request.max_staleness();
  if (k == 0 || version <= k || !context_.replicas) return absl::OkStatus();
  auto reached = context_.replicas->WaitFor(request.model(), version - k, 0, AnswerBy(*context),
                                            [context] { return context->IsCancelled(); });
  if (reached.ok()) return absl::OkStatus();
  if (reached.status().code() != absl::StatusCode::kDeadlineExceeded) return reached.status();
  return absl::DeadlineExceededError(absl::StrCat(
      "version ", version, " is published, but max_staleness=", k, " asks every replica to hold ",
      version - k, " or newer: ", reached.status().message()));
}

void RefitService::AddRlStatus(v1::ModelStatus* model) const {
  if (context_.rl.labels) {
    for (const auto& [version, labels] : context_.rl.labels->Recent(model->model())) {
      v1::VersionLabels* v = model->add_version_labels();
      v->set_version(version);
      rl::ToProto(labels, v->mutable_labels());
    }
  }
  if (context_.rl.staleness) {
    const rl::Budget budget = context_.rl.staleness->Of(model->model());
    model->set_max_staleness(budget.max_staleness);
    model->set_published_version(budget.published);
    model->set_stale(context_.rl.staleness->NodeStale(model->model()));
  }
}

void RefitService::FillEvent(v1::VersionEvent* event) const {
  if (context_.rl.labels) {
    rl::ToProto(context_.rl.labels->Get(event->model(), event->version()), event->mutable_labels());
  }
  if (context_.rl.staleness) {
    event->set_published_version(context_.rl.staleness->Of(event->model()).published);
    event->set_stale(context_.rl.staleness->NodeStale(event->model()));
  }
}

grpc::Status RefitService::Timeline(grpc::ServerContext*, const v1::TimelineRequest* request,
                                    v1::TimelineResponse* response) {
  if (request->model().empty() || request->model().size() > 1024) {
    return Finish("Timeline", absl::InvalidArgumentError("model name is 1 to 1024 bytes"));
  }
  if (!context_.rl.timeline) {
    return Finish("Timeline", absl::UnimplementedError("this refitd keeps no timeline"));
  }
  auto hold = HoldCall("Timeline");
  if (!hold.ok()) return Finish("Timeline", hold.status());
  response->set_model(request->model());
  *response->add_nodes() =
      rl::ToProto(context_.node, context_.rl.timeline->Get(request->model(), request->version()));
  if (!request->local() && context_.node_view) {
    for (v1::NodeTimeline& node :
         context_.node_view->GatherTimeline(request->model(), request->version())) {
      *response->add_nodes() = std::move(node);
    }
  }
  return grpc::Status::OK;
}

}  // namespace refit::server
