#pragma once

// The refit.v1.Refit gRPC service, served on the daemon's Unix socket. Each handler validates
// the request's shape, converts protobuf to domain types, calls the store and converts back. No
// logic lives here.
//
// Thread-safety: gRPC calls the handlers from its own threads, concurrently.

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "daemon/callers/call_budget.h"
#include "daemon/callers/caller.h"
#include "daemon/callers/fd_tokens.h"
#include "daemon/fleet/replicas.h"
#include "daemon/rl/parts.h"
#include "daemon/server/leases.h"
#include "daemon/server/owners.h"
#include "daemon/server/server_metrics.h"
#include "daemon/state/version_ledger.h"
#include "daemon/store/client_store.h"
#include "proto/refit/v1/refit.grpc.pb.h"

namespace refit::server {

struct PeerInfo {
  std::string node;
  std::string address;
  bool connected = false;
  std::string error;  // why this daemon does not connect to it; empty otherwise
};

// What the local API asks of the rest of the daemon (Daemon::Impl::NodeViewAdapter,
// daemon/daemon_impl.h).
class NodeView {
 public:
  virtual ~NodeView() = default;
  virtual std::vector<PeerInfo> Peers() const = 0;     // the daemons this one pulls from
  virtual std::vector<PeerInfo> PulledBy() const = 0;  // daemons subscribed here
  // Rollback (version > 0) or Resume (0) told to the nodes with SOURCE buffers of a model
  // (PeerManager::ForwardHold).
  virtual absl::Status ForwardHold(const std::string& model, uint64_t version,
                                   const std::vector<std::string>& nodes) = 0;
  // Bound ports and transfers in flight.
  virtual void AddRuntime(v1::StatusResponse* response) const = 0;
  // Every other node's timeline of a model (rl::GatherTimelines).
  virtual std::vector<v1::NodeTimeline> GatherTimeline(const std::string& model,
                                                       uint64_t version) const = 0;
};

struct ServiceContext {
  std::string node;
  ClientStore* store = nullptr;  // not owned
  Metrics* metrics = nullptr;    // not owned
  // The local caller this instance serves (daemon/callers routes each connection to the
  // instance of its uid); empty: no checks (in-process use).
  std::optional<callers::Caller> caller;
  std::shared_ptr<Owners> owners;  // shared by every instance; null: no ownership checks
  // Leases for buffers of processes refitd cannot watch (caller pid 0); null: none.
  Leases* leases = nullptr;  // not owned
  // memfds callers passed over the socket, by token (MemoryHandle.memfd); null: refused.
  std::shared_ptr<callers::FdTokens> memfds;
  // Long-lived calls (WaitForVersion, Watch, WaitForReplicas) of `caller` are counted here
  // (RESOURCE_EXHAUSTED past its bounds); null: not bounded (in-process use).
  callers::CallBudget* calls = nullptr;     // not owned
  fleet::ReplicaTable* replicas = nullptr;  // not owned; null: WaitForReplicas UNIMPLEMENTED
  // Each model's newest published version (--state-dir); null: Publish checks only the store.
  state::VersionLedger* ledger = nullptr;  // not owned
  // What only the Daemon knows (its peers, bound ports, the other nodes' timelines); null:
  // this node alone, nothing added to Status.
  NodeView* node_view = nullptr;  // not owned
  // Labels, staleness budgets and timelines (daemon/rl); null members: not kept.
  rl::Parts rl;
};

// When a waiting RPC answers so that its reason reaches the caller before the caller's own
// deadline fires (refit_service.cc).
Clock::time_point AnswerBy(const grpc::ServerContext& context);

class RefitService final : public v1::Refit::Service {
 public:
  explicit RefitService(ServiceContext context)
      : context_(std::move(context)), request_errors_(context_.metrics) {}

  grpc::Status RegisterBuffer(grpc::ServerContext* context,
                              const v1::RegisterBufferRequest* request,
                              v1::RegisterBufferResponse* response) override;
  grpc::Status ReleaseBuffer(grpc::ServerContext* context, const v1::ReleaseBufferRequest* request,
                             v1::ReleaseBufferResponse* response) override;
  grpc::Status Publish(grpc::ServerContext* context, const v1::PublishRequest* request,
                       v1::PublishResponse* response) override;
  grpc::Status WaitForVersion(grpc::ServerContext* context,
                              const v1::WaitForVersionRequest* request,
                              v1::WaitForVersionResponse* response) override;
  grpc::Status Apply(grpc::ServerContext* context, const v1::ApplyRequest* request,
                     v1::ApplyResponse* response) override;
  grpc::Status Watch(grpc::ServerContext* context, const v1::WatchRequest* request,
                     grpc::ServerWriter<v1::VersionEvent>* writer) override;
  grpc::Status Status(grpc::ServerContext* context, const v1::StatusRequest* request,
                      v1::StatusResponse* response) override;
  grpc::Status WaitForReplicas(grpc::ServerContext* context,
                               const v1::WaitForReplicasRequest* request,
                               v1::WaitForReplicasResponse* response) override;
  grpc::Status DropModel(grpc::ServerContext* context, const v1::DropModelRequest* request,
                         v1::DropModelResponse* response) override;
  grpc::Status RenewLeases(grpc::ServerContext* context, const v1::RenewLeasesRequest* request,
                           v1::RenewLeasesResponse* response) override;
  grpc::Status Verify(grpc::ServerContext* context, const v1::VerifyRequest* request,
                      v1::VerifyResponse* response) override;
  // refit_service_rl.cc
  grpc::Status Timeline(grpc::ServerContext* context, const v1::TimelineRequest* request,
                        v1::TimelineResponse* response) override;
  // refit_service_versions.cc
  grpc::Status Rollback(grpc::ServerContext* context, const v1::RollbackRequest* request,
                        v1::RollbackResponse* response) override;
  grpc::Status Resume(grpc::ServerContext* context, const v1::ResumeRequest* request,
                      v1::ResumeResponse* response) override;

 private:
  // PERMISSION_DENIED unless the caller registered every one of `ids` (what: "publish", ...).
  absl::Status CheckOwner(const google::protobuf::RepeatedPtrField<std::string>& ids,
                          const char* what) const;
  // Counts a long-lived call `rpc` against the caller's budget (an empty hold when unbounded).
  absl::StatusOr<callers::CallBudget::Hold> HoldCall(const char* rpc) const;
  // ---- RL semantics (refit_service_rl.cc) ----
  // Publish's checks before anything is published: the labels' size, a staleness budget on a
  // model with replicas. The labels are set for the version (first publisher's win).
  absl::Status BeforePublish(const v1::PublishRequest& request, bool* labels_set);
  // After the snapshot: the timeline, the model's budget, and (max_staleness > 0) the wait
  // until every replica holds version - max_staleness, answered before `context`'s deadline.
  absl::Status AfterPublish(grpc::ServerContext* context, const v1::PublishRequest& request,
                            uint64_t version, std::chrono::steady_clock::time_point started);
  // What Status shows of labels and staleness for `model`.
  void AddRlStatus(v1::ModelStatus* model) const;
  // A VersionEvent's labels and staleness fields for `version` of `model`.
  void FillEvent(v1::VersionEvent* event) const;
  // Converts, counts errors by code, and logs client errors at debug level.
  grpc::Status Finish(const char* rpc, const absl::Status& status);

  ServiceContext context_;
  const RequestErrors request_errors_;  // refit_request_errors_total, by code
};

}  // namespace refit::server
