#include "daemon/server/refit_service.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <set>

#include "absl/strings/str_cat.h"
#include "cuda/cuda.h"
#include "daemon/common/logging.h"
#include "daemon/convert/convert.h"
#include "daemon/memory/region.h"
#include "daemon/plan/plan.h"
#include "daemon/rl/labels.h"
#include "daemon/rl/staleness.h"
#include "daemon/rl/timeline.h"
#include "daemon/version.h"

namespace refit::server {

using convert::FromProto;
using convert::SteadyDeadline;
using convert::ToGrpc;
using convert::ToProto;

namespace {

std::vector<std::string> Ids(const google::protobuf::RepeatedPtrField<std::string>& ids) {
  return {ids.begin(), ids.end()};
}

CancelledFn CancelledOf(grpc::ServerContext* context) {
  return [context] { return context->IsCancelled(); };
}

absl::StatusOr<std::unique_ptr<Region>> OpenRegion(const v1::MemoryHandle& memory,
                                                   const std::optional<callers::Caller>& caller,
                                                   bool write, callers::FdTokens* memfds) {
  switch (memory.kind_case()) {
    case v1::MemoryHandle::kHostShm: {
      std::function<absl::Status(const struct stat&)> allow;
      if (caller) {
        // refitd may open what its caller can't: lend it only what the caller could open.
        allow = [&](const struct stat& st) {
          return callers::CheckAccess(*caller, st, write,
                                      absl::StrCat("shm object ", memory.host_shm().name()));
        };
      }
      return MapHostShm(memory.host_shm().name(), memory.offset(), memory.size(), allow);
    }
    case v1::MemoryHandle::kCudaIpc: {
      const v1::CudaIpc& ipc = memory.cuda_ipc();
      int device = ipc.device();
      if (!ipc.device_uuid().empty()) {
        // The client's ordinal is its own; the UUID names the same GPU in every process.
        auto mapped = cuda::DeviceByUuid(ipc.device_uuid());
        if (!mapped.ok()) return mapped.status();
        device = *mapped;
      }
      return cuda::OpenIpc(ipc.handle(), device, memory.offset(), memory.size());
    }
    case v1::MemoryHandle::kMemfd: {
      // The token is the uid's own (fd_tokens.h); the seals make the memory safe to map.
      if (!memfds) return absl::UnimplementedError("this refitd takes no memfds");
      auto fd = memfds->Redeem(caller ? caller->uid : geteuid(), memory.memfd().token());
      if (!fd.ok()) return fd.status();
      auto region = MapSealedMemfd(*fd, memory.offset(), memory.size());
      close(*fd);
      return region;
    }
    case v1::MemoryHandle::KIND_NOT_SET:
      break;
  }
  return absl::InvalidArgumentError("memory names neither host_shm, memfd nor cuda_ipc");
}

// Names end up in buffer ids, Status, logs and metrics labels: a bound keeps them all sane.
constexpr size_t kMaxNameBytes = 1024;

absl::Status CheckNameLengths(const v1::RegisterBufferRequest& request) {
  auto too_long = [](const char* what, const std::string& name) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " of ", name.size(), " bytes is longer than ", kMaxNameBytes));
  };
  if (request.model().size() > kMaxNameBytes) return too_long("model name", request.model());
  if (request.client().size() > kMaxNameBytes) return too_long("client name", request.client());
  for (const v1::TensorSlice& slice : request.tensors()) {
    if (slice.name().size() > kMaxNameBytes) return too_long("tensor name", slice.name());
  }
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<callers::CallBudget::Hold> RefitService::HoldCall(const char* rpc) const {
  if (!context_.calls || !context_.caller) return callers::CallBudget::Hold();
  return context_.calls->Acquire(*context_.caller, rpc);
}

grpc::Status RefitService::Finish(const char* rpc, const absl::Status& status) {
  if (!status.ok()) {
    request_errors_.Add(status.code());
    Logger("server")->debug("rpc={} error {}", rpc, status.ToString());
  }
  return ToGrpc(status);
}

grpc::Status RefitService::RegisterBuffer(grpc::ServerContext*,
                                          const v1::RegisterBufferRequest* request,
                                          v1::RegisterBufferResponse* response) {
  auto slices = FromProto(request->tensors());
  if (!slices.ok()) return Finish("RegisterBuffer", slices.status());
  if (request->model().empty()) {
    return Finish("RegisterBuffer", absl::InvalidArgumentError("model name is empty"));
  }
  if (absl::Status names = CheckNameLengths(*request); !names.ok()) {
    return Finish("RegisterBuffer", names);
  }
  if (request->role() != v1::SOURCE && request->role() != v1::DESTINATION) {
    return Finish("RegisterBuffer",
                  absl::InvalidArgumentError("role must be SOURCE or DESTINATION"));
  }
  // What can be checked without the memory first, so a malformed request is INVALID_ARGUMENT
  // whatever its memory handle says (the region's size is checked once it is open).
  if (slices->empty()) {
    return Finish("RegisterBuffer",
                  absl::InvalidArgumentError("a buffer needs at least one tensor"));
  }
  // Normalized in place (no copy of the request's slices): the store checks them against the
  // region's size; normalizing them again there allocates nothing.
  if (absl::Status valid = plan::NormalizeAndValidateBuffer(*slices, UINT64_MAX); !valid.ok()) {
    return Finish("RegisterBuffer", valid);
  }
  // A SOURCE whose tensors alone pass --max-slot-memory can never be published: refused before
  // its memory is mapped (and populated), not after (issue 37).
  if (const uint64_t max = context_.store->max_slot_bytes();
      max != 0 && request->role() == v1::SOURCE) {
    uint64_t bytes = 0;
    for (const TensorSlice& slice : *slices) {
      uint64_t n = DTypeSize(slice.dtype);
      for (int64_t size : slice.sizes) {
        if (__builtin_mul_overflow(n, static_cast<uint64_t>(size), &n)) n = UINT64_MAX;
      }
      if (__builtin_add_overflow(bytes, n, &bytes)) bytes = UINT64_MAX;
    }
    if (bytes > max) {
      return Finish("RegisterBuffer",
                    absl::ResourceExhaustedError(absl::StrCat(
                        "model ", request->model(), ": RegisterBuffer refused: its tensors take ",
                        bytes, " bytes, more than --max-slot-memory=", max,
                        " allows one version on this node; nothing was mapped")));
    }
  }
  auto region = OpenRegion(request->memory(), context_.caller, request->role() == v1::DESTINATION,
                           context_.memfds.get());
  if (!region.ok()) return Finish("RegisterBuffer", region.status());
  // Who registers: the same caller registering the same memory again gets the same buffer.
  std::string owner;
  if (context_.caller) {
    owner = absl::StrCat("uid ", context_.caller->uid, " pid ", context_.caller->pid);
  }
  auto id = context_.store->RegisterBuffer(request->model(), static_cast<Role>(request->role()),
                                           std::move(region).value(), std::move(slices).value(),
                                           request->client(), owner);
  if (!id.ok()) return Finish("RegisterBuffer", id.status());
  if (context_.owners && context_.caller) {
    context_.owners->Set(*id, context_.caller->uid, context_.caller->pid);
  }
  if (context_.leases && context_.caller && context_.caller->pid == 0) {
    // refitd cannot see this process exit: the client renews a lease instead.
    context_.leases->Grant(*id, context_.caller->uid);
    response->set_lease_ms(static_cast<uint32_t>(context_.leases->length().count()));
  }
  response->set_buffer_id(*id);
  return grpc::Status::OK;
}

absl::Status RefitService::CheckOwner(const google::protobuf::RepeatedPtrField<std::string>& ids,
                                      const char* what) const {
  if (!context_.owners || !context_.caller) return absl::OkStatus();
  return context_.owners->Check({ids.begin(), ids.end()}, context_.caller->uid, what);
}

grpc::Status RefitService::ReleaseBuffer(grpc::ServerContext*,
                                         const v1::ReleaseBufferRequest* request,
                                         v1::ReleaseBufferResponse*) {
  // The daemon's own uid and root (an operator cleaning up: refitctl release) may release any
  // buffer.
  if (context_.caller && context_.caller->uid != geteuid() && context_.caller->uid != 0) {
    google::protobuf::RepeatedPtrField<std::string> ids;
    ids.Add()->assign(request->buffer_id());
    if (absl::Status owned = CheckOwner(ids, "release"); !owned.ok()) {
      return Finish("ReleaseBuffer", owned);
    }
  }
  std::string why;
  if (context_.caller) {
    why = absl::StrCat("released by ", context_.caller->pid != 0 ? "pid " : "uid ",
                       context_.caller->pid != 0 ? context_.caller->pid : context_.caller->uid);
  }
  absl::Status released = context_.store->ReleaseBuffer(request->buffer_id(), why);
  if (released.ok() && context_.owners) context_.owners->Forget(request->buffer_id());
  if (released.ok() && context_.leases) context_.leases->Forget(request->buffer_id());
  return Finish("ReleaseBuffer", released);
}

grpc::Status RefitService::Publish(grpc::ServerContext* context, const v1::PublishRequest* request,
                                   v1::PublishResponse* response) {
  if (absl::Status owned = CheckOwner(request->buffer_ids(), "publish"); !owned.ok()) {
    return Finish("Publish", owned);
  }
  if (request->run().size() > kMaxNameBytes) {
    return Finish("Publish",
                  absl::InvalidArgumentError(absl::StrCat(
                      "run of ", request->run().size(), " bytes is longer than ", kMaxNameBytes)));
  }
  // A number the model used before (in this process or, with --state-dir, an earlier one) is
  // refused: engines' nodes would take it for the version they hold. Unless the Publish names
  // a new run (a resume from a checkpoint): its numbers may restart.
  if (context_.ledger && request->version() > 0) {
    absl::Status fresh =
        context_.ledger->Check(request->model(), request->version(), request->run());
    if (!fresh.ok()) return Finish("Publish", fresh);
    // After a restart the store learns the model's run from --state-dir.
    context_.store->SeedRun(request->model(), context_.ledger->Run(request->model()),
                            context_.ledger->PastRuns(request->model()));
  }
  const Clock::time_point started = Clock::now();
  bool labels_set = false;
  if (absl::Status checked = BeforePublish(*request, &labels_set); !checked.ok()) {
    return Finish("Publish", checked);
  }
  auto result = context_.store->Publish(request->model(), request->version(),
                                        Ids(request->buffer_ids()), request->run());
  if (!result.ok()) {
    if (labels_set) context_.rl.labels->Erase(request->model(), request->version());
    return Finish("Publish", result.status());
  }
  if (context_.ledger) {
    absl::Status saved = context_.ledger->Record(request->model(), result->version, request->run());
    if (!saved.ok()) {
      // The version is published; only a restart could now reuse its number.
      Logger("server")->error("model={} version={} published, but not remembered: {}",
                              request->model(), result->version, saved.ToString());
    }
  }
  response->set_version(result->version);
  response->set_bytes(result->bytes);
  return Finish("Publish", AfterPublish(context, *request, result->version, started));
}

// When a waiting RPC must answer so that its reason reaches the caller before the caller's own
// deadline fires. gRPC sends the deadline as a grpc-timeout header rounded UP to a coarser unit
// the longer it is (1 ms under 1 s, 10 ms under 10 s, 100 ms under 100 s, 1 s under 1000 s,
// ...: at most 1 % of it), so the deadline seen here lies up to that much after the caller's:
// a fixed 50 ms margin let every deadline of 10 s or more fire first at the caller. Early by
// 1 % and 50 ms (and never more than 5 %): deadlines are honoured within ±10 %
// (tests/faults_deadline_test, client/python/tests/test_long_deadline.py).
Clock::time_point AnswerBy(const grpc::ServerContext& context) {
  const Clock::time_point deadline = SteadyDeadline(context);
  const Clock::duration left = std::max(deadline - Clock::now(), Clock::duration::zero());
  const Clock::duration margin =
      std::min<Clock::duration>(left / 20, left / 100 + std::chrono::milliseconds(50));
  return deadline - margin;
}

grpc::Status RefitService::WaitForVersion(grpc::ServerContext* context,
                                          const v1::WaitForVersionRequest* request,
                                          v1::WaitForVersionResponse* response) {
  // Answer a little before the caller's deadline, so that it reads this daemon's reason
  // (e.g. "no node has SOURCE buffers") rather than its own bare DEADLINE_EXCEEDED.
  auto hold = HoldCall("WaitForVersion");
  if (!hold.ok()) return Finish("WaitForVersion", hold.status());
  auto target = context_.store->WaitForTarget(request->model(), request->min_version(),
                                              request->run(), AnswerBy(*context),
                                              CancelledOf(context), request->applied_version());
  if (!target.ok()) return Finish("WaitForVersion", target.status());
  response->set_version(target->version);
  response->set_run(target->run);
  response->set_rollback(target->rollback);
  return grpc::Status::OK;
}

grpc::Status RefitService::Apply(grpc::ServerContext*, const v1::ApplyRequest* request,
                                 v1::ApplyResponse* response) {
  if (absl::Status owned = CheckOwner(request->buffer_ids(), "apply into"); !owned.ok()) {
    return Finish("Apply", owned);
  }
  const int64_t started_us = rl::WallMicros();
  auto result =
      context_.store->Apply(request->model(), request->version(), Ids(request->buffer_ids()));
  if (!result.ok()) return Finish("Apply", result.status());
  if (context_.rl.timeline) {
    context_.rl.timeline->Record(
        request->model(), result->version, rl::kStageApplied, started_us, rl::WallMicros(),
        absl::StrCat(context_.caller ? absl::StrCat("by pid ", context_.caller->pid, " ") : "",
                     request->buffer_ids_size(), " buffer(s), ", result->bytes_written, " bytes",
                     result->sparse ? ", sparse" : ""));
  }
  response->set_version(result->version);
  response->set_bytes_written(result->bytes_written);
  return grpc::Status::OK;
}

grpc::Status RefitService::Watch(grpc::ServerContext* context, const v1::WatchRequest* request,
                                 grpc::ServerWriter<v1::VersionEvent>* writer) {
  if (request->model().empty()) {
    return Finish("Watch", absl::InvalidArgumentError("model name is empty"));
  }
  auto hold = HoldCall("Watch");
  if (!hold.ok()) return Finish("Watch", hold.status());
  // Events (store_versions.cc): each version that becomes the target, a rollback, a resume.
  uint64_t cursor = context_.store->WatchCursor(request->model(), request->after_version());
  // Initial metadata tells the client the watch is in place: nothing completing from now on
  // can be missed.
  writer->SendInitialMetadata();
  // With a staleness budget the loop wakes every kStaleCheck to tell the engine when this node
  // becomes stale or stops being so (VersionEvent.stale_notice).
  constexpr auto kStaleCheck = std::chrono::milliseconds(100);
  bool told_stale = false;
  while (true) {
    const Clock::time_point deadline = SteadyDeadline(*context);
    auto targets = context_.store->WaitForEvents(
        request->model(), &cursor,
        context_.rl.staleness ? std::min(deadline, Clock::now() + kStaleCheck) : deadline,
        CancelledOf(context));
    if (!targets.ok() && targets.status().code() == absl::StatusCode::kDeadlineExceeded &&
        Clock::now() < deadline) {
      targets = std::vector<VersionTarget>();  // a staleness check's wake-up
    }
    if (!targets.ok()) {
      if (targets.status().code() == absl::StatusCode::kCancelled) return grpc::Status::OK;
      return Finish("Watch", targets.status());
    }
    for (const VersionTarget& t : *targets) {
      v1::VersionEvent event;
      event.set_model(request->model());
      event.set_version(t.version);
      event.set_rollback(t.rollback);
      event.set_run(t.run);
      FillEvent(&event);
      told_stale = event.stale();
      if (!writer->Write(event)) return grpc::Status::OK;  // the client went away
    }
    if (context_.rl.staleness && context_.rl.staleness->NodeStale(request->model()) != told_stale) {
      v1::VersionEvent event;
      event.set_model(request->model());
      event.set_version(context_.store->LatestVersion(request->model()));
      FillEvent(&event);
      event.set_stale_notice(true);
      told_stale = event.stale();
      if (!writer->Write(event)) return grpc::Status::OK;
    }
  }
}

grpc::Status RefitService::Status(grpc::ServerContext*, const v1::StatusRequest*,
                                  v1::StatusResponse* response) {
  response->set_node(context_.node);
  // A caller sees only its own buffers, unless it is refitd's uid or root (operators): another
  // uid's buffer ids are not its business (issue 37).
  const bool sees_all = !context_.caller || !context_.owners || context_.caller->uid == geteuid() ||
                        context_.caller->uid == 0;
  std::set<std::string> listed;
  for (const ModelInfo& info : context_.store->Models()) {
    listed.insert(info.name);
    v1::ModelStatus* model = response->add_models();
    ToProto(info, model);
    if (!sees_all) {
      auto* buffers = model->mutable_buffers();
      for (int i = buffers->size(); i-- > 0;) {
        if (!context_.owners->Owns(buffers->Get(i).buffer_id(), context_.caller->uid)) {
          buffers->DeleteSubrange(i, 1);
        }
      }
    }
    AddRlStatus(model);
    if (!context_.replicas) continue;
    // With staleness budgets kept, each replica's stale flag too (rl::Staleness).
    std::vector<rl::Staleness::ReplicaState> replicas;
    if (context_.rl.staleness) {
      replicas = context_.rl.staleness->Replicas(info.name);
    } else {
      for (const fleet::Replica& r : context_.replicas->ReplicasOf(info.name)) {
        replicas.push_back({r, false});
      }
    }
    for (const rl::Staleness::ReplicaState& r : replicas) {
      v1::ReplicaStatus* replica = model->add_replicas();
      replica->set_node(r.replica.node);
      replica->set_latest_version(r.replica.latest_version);
      replica->set_relay(r.replica.relay);
      replica->set_stale(r.stale);
      replica->set_rollback_version(r.replica.rollback_version);
      replica->set_rolled_back(r.replica.rolled_back);
    }
  }
  // Models only their labels remember (kept in --state-dir across a restart, before any
  // buffer of them registers again): their labels, nothing else.
  if (context_.rl.labels) {
    for (const std::string& name : context_.rl.labels->RestoredModels()) {
      if (listed.count(name) > 0) continue;
      v1::ModelStatus* model = response->add_models();
      model->set_model(name);
      AddRlStatus(model);
    }
  }
  auto add_peers = [](const std::vector<PeerInfo>& peers,
                      google::protobuf::RepeatedPtrField<v1::PeerStatus>* out) {
    for (const PeerInfo& peer : peers) {
      v1::PeerStatus* ps = out->Add();
      ps->set_node(peer.node);
      ps->set_address(peer.address);
      ps->set_connected(peer.connected);
      ps->set_error(peer.error);
    }
  };
  if (context_.node_view) {
    add_peers(context_.node_view->Peers(), response->mutable_peers());
    add_peers(context_.node_view->PulledBy(), response->mutable_pulled_by());
  }
  for (const auto& [name, value] : context_.metrics->Snapshot()) {
    (*response->mutable_metrics())[name] = value;
  }
  response->set_version(kRefitVersion);
  response->set_cuda_enabled(cuda::CompiledIn());
  response->set_cuda_devices(cuda::DeviceCount());
  if (context_.node_view) context_.node_view->AddRuntime(response);
  return grpc::Status::OK;
}

grpc::Status RefitService::WaitForReplicas(grpc::ServerContext* context,
                                           const v1::WaitForReplicasRequest* request,
                                           v1::WaitForReplicasResponse* response) {
  if (request->model().empty() || request->model().size() > 1024) {
    return Finish("WaitForReplicas", absl::InvalidArgumentError("model name is 1 to 1024 bytes"));
  }
  if (!context_.replicas) {
    return Finish("WaitForReplicas", absl::UnimplementedError("this refitd keeps no replicas"));
  }
  auto hold = HoldCall("WaitForReplicas");
  if (!hold.ok()) return Finish("WaitForReplicas", hold.status());
  auto reached =
      context_.replicas->WaitFor(request->model(), request->version(), request->min_nodes(),
                                 AnswerBy(*context), CancelledOf(context));
  if (!reached.ok()) return Finish("WaitForReplicas", reached.status());
  response->set_version(reached->version);
  for (const std::string& node : reached->nodes) response->add_nodes(node);
  return grpc::Status::OK;
}

grpc::Status RefitService::DropModel(grpc::ServerContext*, const v1::DropModelRequest* request,
                                     v1::DropModelResponse* response) {
  if (request->model().empty() || request->model().size() > kMaxNameBytes) {
    return Finish("DropModel", absl::InvalidArgumentError("model name is 1 to 1024 bytes"));
  }
  auto dropped = context_.store->DropModel(request->model());
  if (!dropped.ok()) {
    // A model only the ledger remembers (its versions dropped by a restart) is forgotten too.
    // So is one only its labels remember (--state-dir keeps them across restarts).
    const uint64_t remembered = context_.ledger ? context_.ledger->Newest(request->model()) : 0;
    const bool labelled =
        context_.rl.labels && !context_.rl.labels->Recent(request->model()).empty();
    if (dropped.status().code() != absl::StatusCode::kNotFound || (remembered == 0 && !labelled)) {
      return Finish("DropModel", dropped.status());
    }
    dropped = DropResult{};
  }
  for (uint64_t v : dropped->released_versions) response->add_released_versions(v);
  if (context_.ledger) {
    auto forgotten = context_.ledger->Forget(request->model());
    if (!forgotten.ok()) return Finish("DropModel", forgotten.status());
    response->set_forgotten_version(*forgotten);
  }
  // Its numbers start over: labels of the old versions would name the new ones.
  if (context_.rl.labels) context_.rl.labels->Forget(request->model());
  Logger("server")->info("model={} dropped: {} versions released, newest published {} forgotten",
                         request->model(), dropped->released_versions.size(),
                         response->forgotten_version());
  return grpc::Status::OK;
}

grpc::Status RefitService::RenewLeases(grpc::ServerContext*, const v1::RenewLeasesRequest* request,
                                       v1::RenewLeasesResponse* response) {
  if (request->buffer_ids_size() > 65536) {
    return Finish("RenewLeases", absl::InvalidArgumentError("more than 65536 buffer ids"));
  }
  std::vector<std::string> unknown = Ids(request->buffer_ids());
  if (context_.leases && context_.caller) {
    unknown = context_.leases->Renew(unknown, context_.caller->uid);
  }
  for (std::string& id : unknown) response->add_unknown_ids(std::move(id));
  return grpc::Status::OK;
}

grpc::Status RefitService::Verify(grpc::ServerContext*, const v1::VerifyRequest* request,
                                  v1::VerifyResponse* response) {
  if (request->model().empty() || request->model().size() > kMaxNameBytes) {
    return Finish("Verify", absl::InvalidArgumentError("model name is 1 to 1024 bytes"));
  }
  auto results = context_.store->Verify(request->model());
  if (!results.ok()) return Finish("Verify", results.status());
  for (const VerifyResult& r : *results) {
    v1::BufferVerification* b = response->add_buffers();
    b->set_buffer_id(r.buffer_id);
    b->set_version(r.version);
    b->set_checked(r.checked);
    for (const std::string& t : r.stale_tensors) b->add_stale_tensors(t);
    b->set_note(r.note);
  }
  return grpc::Status::OK;
}

}  // namespace refit::server
