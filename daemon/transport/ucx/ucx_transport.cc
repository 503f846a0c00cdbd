#include "daemon/transport/ucx/ucx_transport.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"
#include "daemon/transport/ucx/ucx_handles.h"
#include "daemon/transport/ucx/ucx_internal.h"
#include "daemon/transport/wire.h"

namespace refit::transport {

namespace {

void OpCallback(void* request, ucs_status_t status, void* user_data) {
  auto* op = static_cast<UcxTransport::Op*>(user_data);
  op->ep->owner->OnOpDone(op, status);
  ucp_request_free(request);
}

void EpErrorCallback(void* arg, ucp_ep_h /*ep*/, ucs_status_t status) {
  auto* ep = static_cast<UcxTransport::EpState*>(arg);
  ep->owner->OnEpError(ep, status);
}

std::string MemoryTypesString(uint64_t types) {
  std::string out;
  for (int t = 0; t < UCS_MEMORY_TYPE_LAST; ++t) {
    if (types & UCS_BIT(t)) absl::StrAppend(&out, out.empty() ? "" : ",", ucs_memory_type_names[t]);
  }
  return out.empty() ? "none" : out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<UcxTransport>> UcxTransport::Create(const Options& options) {
  std::unique_ptr<UcxTransport> transport(new UcxTransport());
  RETURN_IF_ERROR(transport->Init(options));
  return transport;
}

absl::Status UcxTransport::Init(const Options& options) {
  identity_ = NewTransportIdentity();
  close_timeout_ = options.close_timeout;
  peer_failure_handling_ = options.peer_failure_handling;
  serve_gathers_ = options.serve_gathers;
  rma_ = options.rma;
  if (rma_ && !options.rma_any_transport && !HardwareRmaOnly(std::getenv("UCX_TLS"))) {
    return absl::FailedPreconditionError(
        "UCX RMA is only for RDMA fabrics: set UCX_TLS to rc/dc transports only (tcp and shared "
        "memory carry raw addresses in software RMA)");
  }
  registry_ = std::make_shared<Registry>();

  ucp_config_t* raw_config = nullptr;
  ucs_status_t s = ucp_config_read(nullptr, nullptr, &raw_config);
  if (s != UCS_OK) return ucx::ToStatus(s, "ucp_config_read");
  ucx::ConfigPtr config(raw_config);
  for (const auto& [name, value] : options.config) {
    if (std::getenv(("UCX_" + name).c_str()) != nullptr) continue;
    s = ucp_config_modify(config.get(), name.c_str(), value.c_str());
    if (s != UCS_OK) {
      // A UCX without one of our defaults (another version) still works without it.
      const auto defaults = Options::DefaultConfig();
      if (std::find(defaults.begin(), defaults.end(), std::make_pair(name, value)) !=
          defaults.end()) {
        Logger("transport")->debug("UCX has no setting {}; going on without it", name);
        continue;
      }
      return ucx::ToStatus(s, absl::StrCat("UCX setting ", name, "=", value));
    }
  }

  ucp_params_t params;
  std::memset(&params, 0, sizeof(params));
  params.field_mask =
      UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME | UCP_PARAM_FIELD_MT_WORKERS_SHARED;
  // AM: gathers (ucx_gather.cc). RMA only on request (see ucx_transport.h, "Checked reads").
  // WAKEUP: the worker's event fd, so that an idle daemon sleeps (PrepareToSleep).
  params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP | (rma_ ? UCP_FEATURE_RMA : 0);
  params.name = "refit";
  // AllocateMemory and freeing its memory happen on any thread: the context's own lock.
  params.mt_workers_shared = 1;
  ucp_context_h context = nullptr;
  s = ucp_init(&params, config.get(), &context);
  if (s != UCS_OK) return ucx::ToStatus(s, "ucp_init");
  context_ = std::shared_ptr<ucp_context>(context, ucx::ContextDeleter());
  copier_ = std::make_unique<CopyEngine>(options.copy_threads > 0 ? options.copy_threads
                                                                  : CopyEngine::DefaultThreads());

  ucp_worker_params_t worker_params;
  std::memset(&worker_params, 0, sizeof(worker_params));
  worker_params.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
  worker_params.thread_mode = UCS_THREAD_MODE_SERIALIZED;
  ucp_worker_h worker = nullptr;
  s = ucp_worker_create(context_.get(), &worker_params, &worker);
  // UCX reports "no usable transport" (e.g. UCX_TLS=cma alone) as a worker creation failure.
  if (s != UCS_OK) {
    return absl::FailedPreconditionError(
        absl::StrCat("ucp_worker_create: ", ucs_status_string(s), " (check UCX_TLS)"));
  }
  worker_.reset(worker);
  // UCX 1.13 aborts when a peer dies mid wire-up over tcp; ucx_tcp_purge.cc keeps it from that.
  Logger("transport")
      ->debug("tcp wire-up purge workaround: {}",
              TcpPurgeWorkaroundActive() ? "active" : "not in place");
  RETURN_IF_ERROR(InitGathers());
  // The fd belongs to the worker (closed with it). Without it the caller keeps polling.
  if (ucp_worker_get_efd(worker_.get(), &wake_fd_) != UCS_OK) wake_fd_ = -1;

  ucp_address_t* raw_address = nullptr;
  size_t address_length = 0;
  s = ucp_worker_get_address(worker_.get(), &raw_address, &address_length);
  if (s != UCS_OK) return ucx::ToStatus(s, "ucp_worker_get_address");
  ucx::WorkerAddressPtr worker_address(raw_address, ucx::WorkerAddressDeleter{worker_.get()});
  address_ = EncodeAddress(
      {WireBackend::kUcx, identity_,
       std::string(reinterpret_cast<const char*>(worker_address.get()), address_length)});

  ucp_context_attr_t attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES;
  s = ucp_context_query(context_.get(), &attr);
  if (s != UCS_OK) return ucx::ToStatus(s, "ucp_context_query");
  unsigned major = 0, minor = 0, release = 0;
  ucp_get_version(&major, &minor, &release);
  capabilities_.name = "ucx";
  capabilities_.rma_get = true;
  capabilities_.rma_put = false;  // no peer writes here, and we write into no peer
  capabilities_.gathers_spans = true;
  capabilities_.cuda_memory = (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA)) != 0;
  capabilities_.detail = absl::StrCat("UCX ", major, ".", minor, ".", release,
                                      ", memory types: ", MemoryTypesString(attr.memory_types),
                                      rma_ ? ", RMA (remote-read only)" : ", checked reads");
  Logger("transport")->info("ucx transport ready: {}", capabilities_.detail);
  return absl::OkStatus();
}

UcxTransport::~UcxTransport() {
  if (live_objects_ != 0) {
    Logger("transport")
        ->critical("ucx transport destroyed with {} endpoints/memory handles still alive",
                   live_objects_);
    std::abort();
  }
  if (worker_ == nullptr) return;  // Init failed early
  for (auto& parked : parked_) CloseEp(parked, /*park=*/false);
  parked_.clear();
  // Let endpoint closes, ops and UCX's own queued messages (wireup replies to peers) finish:
  // UCX 1.13 asserts when a worker is destroyed with a wireup message still queued
  // (openucx/ucx#8175). Bounded, because a peer that went away may never answer.
  ucp_request_param_t param;
  std::memset(&param, 0, sizeof(param));
  ucs_status_ptr_t flush = ucp_worker_flush_nbx(worker_.get(), &param);
  auto flushing = [&flush] {
    return UCS_PTR_IS_PTR(flush) && ucp_request_check_status(flush) == UCS_INPROGRESS;
  };
  auto deadline = std::chrono::steady_clock::now() + close_timeout_;
  while ((!pending_closes_.empty() || in_ucx_ != 0 || flushing()) &&
         std::chrono::steady_clock::now() < deadline) {
    ucp_worker_progress(worker_.get());
    ReapCloses();
  }
  if (!pending_closes_.empty() || in_ucx_ != 0 || flushing()) {
    Logger("transport")
        ->warn("ucx transport destroyed with {} endpoint closes and {} ops unfinished after {} ms",
               pending_closes_.size(), in_ucx_, close_timeout_.count());
  }
  // Every endpoint is gone, so no copy touches memory any more; finished ones are dropped.
  copier_->Stop();
  if (in_copier_ != 0) DrainCopier();
  // Requests still running are released to UCX, which frees them as the worker goes.
  if (UCS_PTR_IS_PTR(flush)) ucp_request_free(flush);
  for (auto& pending : pending_closes_) ucp_request_free(pending.request);
  pending_closes_.clear();
  done_.clear();
  newly_failed_.clear();
  worker_.reset();
  // Replies and requests UCX never finished sending (a peer gone quiet): their UCX requests
  // went with the worker. Every endpoint was closed, which ended every gather.
  for (Serve* serve : serves_) delete serve;
  serves_.clear();
  for (Outgoing* outgoing : outgoings_) DeleteOutgoing(outgoing);
  outgoings_.clear();
  if (!gathers_.empty()) {
    Logger("transport")->error("{} gathers outlived their endpoints", gathers_.size());
  }
  context_.reset();
}

absl::StatusOr<std::unique_ptr<LocalMemory>> UcxTransport::RegisterMemory(void* address,
                                                                          uint64_t length,
                                                                          MemoryKind kind) {
  if (address == nullptr || length == 0) {
    return absl::InvalidArgumentError("RegisterMemory needs a non-null address and a length");
  }
  if (kind == MemoryKind::kCuda && !capabilities_.cuda_memory) {
    return absl::UnimplementedError(absl::StrCat("this UCX can't register CUDA memory (",
                                                 capabilities_.detail,
                                                 "); stage through host memory"));
  }
  ucp_mem_map_params_t params;
  std::memset(&params, 0, sizeof(params));
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
  params.address = address;
  params.length = length;
  params.memory_type = kind == MemoryKind::kCuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
  if (rma_) {  // a peer's rkey may read it, never write it
    params.field_mask |= UCP_MEM_MAP_PARAM_FIELD_PROT;
    params.prot =
        UCP_MEM_MAP_PROT_LOCAL_READ | UCP_MEM_MAP_PROT_LOCAL_WRITE | UCP_MEM_MAP_PROT_REMOTE_READ;
  }
  ucp_mem_h memh = nullptr;
  ucs_status_t s = ucp_mem_map(context_.get(), &params, &memh);
  if (s != UCS_OK) return ucx::ToStatus(s, "ucp_mem_map");
  return MakeLocalMemory(address, length, kind, memh, /*owned=*/false);
}

absl::StatusOr<std::unique_ptr<LocalMemory>> UcxTransport::AllocateMemory(uint64_t length) {
  if (length == 0) return absl::InvalidArgumentError("AllocateMemory needs a length");
  ucp_mem_map_params_t params;
  std::memset(&params, 0, sizeof(params));
  params.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                      UCP_MEM_MAP_PARAM_FIELD_FLAGS;
  params.address = nullptr;
  params.length = length;
  params.flags = UCP_MEM_MAP_ALLOCATE;
  if (rma_) {
    params.field_mask |= UCP_MEM_MAP_PARAM_FIELD_PROT;
    params.prot =
        UCP_MEM_MAP_PROT_LOCAL_READ | UCP_MEM_MAP_PROT_LOCAL_WRITE | UCP_MEM_MAP_PROT_REMOTE_READ;
  }
  ucp_mem_h memh = nullptr;
  ucs_status_t s = ucp_mem_map(context_.get(), &params, &memh);
  if (s != UCS_OK) return ucx::ToStatus(s, "ucp_mem_map(ALLOCATE)");
  ucp_mem_attr_t attr;
  std::memset(&attr, 0, sizeof(attr));
  attr.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH;
  s = ucp_mem_query(memh, &attr);
  if (s != UCS_OK || attr.address == nullptr || attr.length < length) {
    ucp_mem_unmap(context_.get(), memh);
    return ucx::ToStatus(s == UCS_OK ? UCS_ERR_NO_MEMORY : s, "ucp_mem_query");
  }
  return MakeLocalMemory(attr.address, length, MemoryKind::kHost, memh, /*owned=*/true);
}

absl::StatusOr<std::unique_ptr<LocalMemory>> UcxTransport::MakeLocalMemory(
    void* address, uint64_t length, MemoryKind kind, ucp_mem_h memh, bool owned) {
  auto mem = std::make_shared<MemHolder>();
  mem->context = context_;
  mem->memh = ucx::MemPtr(memh, ucx::MemDeleter{context_.get()});

  void* packed = nullptr;
  size_t packed_size = 0;
  ucs_status_t s = ucp_rkey_pack(context_.get(), memh, &packed, &packed_size);
  if (s != UCS_OK) return ucx::ToStatus(s, "ucp_rkey_pack");
  ucx::RkeyBufferPtr packed_owner(packed);
  return std::unique_ptr<LocalMemory>(new UcxLocalMemory(
      this, address, length, kind, std::move(mem), RandomBytes(kTokenBytes),
      std::string(static_cast<const char*>(packed), packed_size), /*counted=*/!owned, registry_));
}

namespace {
// A grant of [base, base + length) to `token`, until destroyed (any thread, any time).
struct GrantHold {
  std::shared_ptr<UcxTransport::Registry> registry;
  std::string token;
  uint64_t base = 0;
  uint64_t length = 0;
  ~GrantHold() {
    common::MutexLock lock(registry->mu);
    registry->RemoveGrant(token, base, length);
  }
};
}  // namespace

absl::StatusOr<Transport::Grant> UcxTransport::GrantRead(const LocalMemory& memory,
                                                         std::string_view token) {
  if (token.size() != kTokenBytes) return absl::InvalidArgumentError("a token is 16 bytes");
  const auto* local = dynamic_cast<const UcxLocalMemory*>(&memory);
  if (local == nullptr || local->registry() != registry_) {
    return absl::InvalidArgumentError("memory was registered with another transport");
  }
  auto hold = std::make_shared<GrantHold>();
  hold->registry = registry_;
  hold->token = std::string(token);
  hold->base = reinterpret_cast<uint64_t>(memory.address());
  hold->length = memory.length();
  {
    common::MutexLock lock(registry_->mu);
    registry_->AddGrant(hold->token, hold->base, hold->length);
  }
  return Grant{local->DescriptorFor(hold->token), std::move(hold)};
}

absl::StatusOr<std::unique_ptr<Endpoint>> UcxTransport::Connect(std::string_view peer_address) {
  ASSIGN_OR_RETURN(WireAddress address, DecodeAddress(peer_address, WireBackend::kUcx));
  auto state = std::make_shared<EpState>();
  state->owner = this;
  state->peer_identity = address.issuer;
  state->self = state;

  ucp_ep_params_t params;
  std::memset(&params, 0, sizeof(params));
  params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE;
  params.address = reinterpret_cast<const ucp_address_t*>(address.payload.data());
  params.err_mode = UCP_ERR_HANDLING_MODE_NONE;
  if (peer_failure_handling_) {
    params.field_mask |= UCP_EP_PARAM_FIELD_ERR_HANDLER;
    params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    params.err_handler.cb = EpErrorCallback;
    params.err_handler.arg = state.get();
  }
  ucp_ep_h ep = nullptr;
  ucs_status_t s = ucp_ep_create(worker_.get(), &params, &ep);
  if (s != UCS_OK) {
    // The worker address passed wire.h's checksum, so this is UCX's verdict on reaching it.
    absl::Status status = ucx::ToStatus(s, "ucp_ep_create");
    if (absl::IsUnavailable(status)) return status;
    return absl::InvalidArgumentError(absl::StrCat("peer address rejected: ", status.message()));
  }
  state->ep = ep;
  return std::unique_ptr<Endpoint>(new UcxEndpoint(this, std::move(state)));
}

void UcxTransport::CloseEp(const std::shared_ptr<EpState>& state, bool park) {
  if (state->ep == nullptr) return;
  const bool healthy_idle = state->failure.ok() && state->in_ucx == 0;
  if (park && healthy_idle) {
    // UCX pairs our endpoint to a peer with the peer's endpoint to us (both made from worker
    // addresses), and the peer's gathers carry our endpoint's id for the reply: once it is
    // closed, UCX drops them before any handler runs, and the peer waits forever. An idle,
    // healthy endpoint is therefore parked, still open, until the transport goes (or, past
    // kMaxParked, the oldest is closed).
    parked_.push_back(state);
    if (parked_.size() <= kMaxParked) return;
    std::shared_ptr<EpState> oldest = parked_.front();
    parked_.erase(parked_.begin());
    CloseEp(oldest, /*park=*/false);
    return;
  }
  ucp_request_param_t param;
  std::memset(&param, 0, sizeof(param));
  param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
  // UCX requires FORCE after a failure, and only FORCE aborts ops (which may be stuck on an
  // unresponsive peer); it is defined only with peer-failure handling. On a healthy ep it also
  // resets the peer's endpoints to us, so an idle endpoint is closed with a flush instead.
  bool force = !state->failure.ok() || state->in_ucx != 0;
  param.flags = force && peer_failure_handling_ ? UCP_EP_CLOSE_FLAG_FORCE : 0;
  ucs_status_ptr_t request = ucp_ep_close_nbx(state->ep, &param);
  state->ep = nullptr;
  if (UCS_PTR_IS_PTR(request)) {
    pending_closes_.push_back({request, state});
  } else if (UCS_PTR_IS_ERR(request) && UCS_PTR_STATUS(request) != UCS_ERR_CANCELED &&
             !ucx::IsPeerFailure(UCS_PTR_STATUS(request))) {
    Logger("transport")->warn("ucp_ep_close_nbx: {}", ucs_status_string(UCS_PTR_STATUS(request)));
  }
}

void UcxTransport::ReapCloses() {
  size_t kept = 0;
  for (auto& pending : pending_closes_) {
    if (ucp_request_check_status(pending.request) == UCS_INPROGRESS) {
      pending_closes_[kept++] = std::move(pending);
    } else {
      ucp_request_free(pending.request);
    }
  }
  pending_closes_.resize(kept);
}

absl::Status UcxTransport::CheckHandles(const UcxEndpoint& endpoint, const LocalMemory& local,
                                        const RemoteMemory& remote,
                                        const UcxLocalMemory** local_memory,
                                        const UcxRemoteMemory** remote_memory) const {
  *local_memory = dynamic_cast<const UcxLocalMemory*>(&local);
  if (*local_memory == nullptr || (*local_memory)->owner() != this) {
    return absl::InvalidArgumentError("local memory was registered with another transport");
  }
  *remote_memory = dynamic_cast<const UcxRemoteMemory*>(&remote);
  if (*remote_memory == nullptr || (*remote_memory)->ep() != endpoint.state().get()) {
    return absl::InvalidArgumentError("remote memory was imported on another endpoint");
  }
  return absl::OkStatus();
}

absl::Status UcxTransport::Post(bool get, UcxEndpoint* endpoint, const LocalMemory& local,
                                uint64_t local_offset, const RemoteMemory& remote,
                                uint64_t remote_offset, uint64_t length, uint64_t cookie) {
  const UcxLocalMemory* local_memory = nullptr;
  const UcxRemoteMemory* remote_memory = nullptr;
  RETURN_IF_ERROR(CheckHandles(*endpoint, local, remote, &local_memory, &remote_memory));
  if (!get) {
    return absl::UnimplementedError(
        "puts are off: refit never writes into a peer's memory (capabilities().rma_put)");
  }
  const std::shared_ptr<EpState>& ep = endpoint->state();
  RETURN_IF_ERROR(
      CheckRanges(local_offset, local.length(), remote_offset, remote.length(), length));
  if (!ep->failure.ok()) return ep->failure;

  if (length == 0) {  // nothing to move; still reported by Poll like any op
    done_.push_back({ep, cookie, ep->epoch, UCS_OK});
  } else if (remote_memory->mapped() && local.kind() == MemoryKind::kHost) {
    uint8_t* here = static_cast<uint8_t*>(local.address()) + local_offset;
    uint8_t* there = remote_memory->mapping() + remote_offset;
    auto* op = new Op{ep, local_memory->mem(), remote_memory->rkey(), cookie, ep->epoch, nullptr};
    ep->copying.fetch_add(1, std::memory_order_acq_rel);
    ++in_copier_;
    CopyEngine::Job job;
    job.dst = here;
    job.src = there;
    job.length = length;
    job.tag = op;
    job.abandon = &ep->abandon;
    job.running = &ep->copying;
    job.hash = true;
    copier_->Submit(job);
  } else if (!rma_) {
    // Checked reads: a gather of one span, which the target checks against our token's grants.
    if (local.kind() != MemoryKind::kHost) {
      return absl::UnimplementedError(
          "checked reads land in host memory only: stage through a host slot");
    }
    return PostGathers(ep, local_memory->mem(), remote_memory->rkey(),
                       static_cast<uint8_t*>(local.address()), remote.remote_address(),
                       {Span{local_offset, remote_offset, length}}, cookie, /*single=*/true);
  } else {
    ucp_request_param_t param;
    std::memset(&param, 0, sizeof(param));
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_MEMH |
                         UCP_OP_ATTR_FIELD_MEMORY_TYPE | UCP_OP_ATTR_FIELD_USER_DATA;
    param.memh = local_memory->mem()->memh.get();
    param.memory_type =
        local.kind() == MemoryKind::kCuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
    uint8_t* buffer = static_cast<uint8_t*>(local.address()) + local_offset;
    uint64_t remote_address = remote.remote_address() + remote_offset;
    ucp_rkey_h rkey = remote_memory->rkey()->rkey.get();
    auto* op = new Op{ep, local_memory->mem(), remote_memory->rkey(), cookie, ep->epoch, nullptr};
    // A get's callback means the bytes are here.
    param.cb.send = OpCallback;
    param.user_data = op;
    ucs_status_ptr_t request = ucp_get_nbx(ep->ep, buffer, length, remote_address, rkey, &param);
    if (UCS_PTR_IS_ERR(request)) {
      delete op;
      ucs_status_t s = UCS_PTR_STATUS(request);
      if (ucx::IsPeerFailure(s)) OnEpError(ep.get(), s);
      return ucx::ToStatus(s, "ucp_get_nbx");
    }
    if (request != nullptr) {
      ++in_ucx_;
      ++ep->in_ucx;
    } else {  // finished inside the call
      done_.push_back({ep, cookie, op->epoch, UCS_OK});
      delete op;
    }
  }
  ++outstanding_;
  ++ep->outstanding;
  return absl::OkStatus();
}

void UcxTransport::OnOpDone(Op* op, ucs_status_t status) {
  --in_ucx_;
  --op->ep->in_ucx;
  FinishOp(op, status);
}

void UcxTransport::FinishOp(Op* op, ucs_status_t status) {
  if (op->group) {
    Group& group = *op->group;
    if (status != UCS_OK && group.status == UCS_OK) group.status = status;
    if (--group.remaining == 0) {
      const bool hashed = group.hashed && group.status == UCS_OK;
      if (group.single) {  // a PostGet's one span: its digest is the op's
        done_.push_back({std::move(op->ep), op->cookie, op->epoch, group.status, hashed,
                         hashed ? group.span_xxh3[0] : 0});
      } else {
        done_.push_back({std::move(op->ep), op->cookie, op->epoch, group.status, hashed, 0,
                         hashed ? std::move(group.span_xxh3) : std::vector<uint64_t>()});
      }
    }
  } else {
    done_.push_back({std::move(op->ep), op->cookie, op->epoch, status});
  }
  delete op;
}

absl::Status UcxTransport::PostSpans(UcxEndpoint* endpoint, const LocalMemory& local,
                                     const RemoteMemory& remote, std::vector<Span> spans,
                                     uint64_t cookie) {
  const UcxLocalMemory* local_memory = nullptr;
  const UcxRemoteMemory* remote_memory = nullptr;
  RETURN_IF_ERROR(CheckHandles(*endpoint, local, remote, &local_memory, &remote_memory));
  const std::shared_ptr<EpState>& ep = endpoint->state();
  ASSIGN_OR_RETURN(const uint64_t total, CheckSpans(spans, local.length(), remote.length()));
  if (!ep->failure.ok()) return ep->failure;

  auto* base = static_cast<uint8_t*>(local.address());
  if (remote_memory->mapped() && local.kind() == MemoryKind::kHost) {
    auto* op = new Op{ep, local_memory->mem(), remote_memory->rkey(), cookie, ep->epoch, nullptr};
    ep->copying.fetch_add(1, std::memory_order_acq_rel);
    ++in_copier_;
    CopyEngine::Job job;
    job.dst = base;
    job.src = remote_memory->mapping();
    job.length = total;
    job.tag = op;
    job.abandon = &ep->abandon;
    job.running = &ep->copying;
    job.spans = std::make_shared<const std::vector<Span>>(std::move(spans));
    job.hash = true;
    copier_->Submit(job);
  } else if (local.kind() == MemoryKind::kHost && !remote_memory->rkey()->no_gather) {
    RETURN_IF_ERROR(PostGathers(ep, local_memory->mem(), remote_memory->rkey(), base,
                                remote.remote_address(), std::move(spans), cookie,
                                /*single=*/false));
    return absl::OkStatus();  // counted by PostGathers
  } else if (!rma_) {
    return absl::UnimplementedError(
        local.kind() == MemoryKind::kHost
            ? "the peer can't serve checked reads of this memory (it is on its GPU)"
            : "checked reads land in host memory only: stage through a host slot");
  } else {
    auto group = std::make_shared<Group>();
    group->remaining = spans.size();
    ucs_status_t failure = UCS_OK;
    const size_t posted =
        PostSpanGets(ep, local_memory->mem(), local.kind(), remote_memory->rkey(), base,
                     remote.remote_address(), spans, 0, spans.size(), cookie, ep->epoch, group,
                     /*refuse_first=*/true, &failure);
    if (posted == 0 && failure != UCS_OK) return ucx::ToStatus(failure, "ucp_get_nbx");
  }
  ++outstanding_;
  ++ep->outstanding;
  return absl::OkStatus();
}

size_t UcxTransport::PostSpanGets(const std::shared_ptr<EpState>& ep,
                                  const std::shared_ptr<MemHolder>& mem, MemoryKind kind,
                                  const std::shared_ptr<RkeyHolder>& rkey, uint8_t* base,
                                  uint64_t remote_address, const std::vector<Span>& spans,
                                  size_t first, size_t last, uint64_t cookie, uint64_t epoch,
                                  const std::shared_ptr<Group>& group, bool refuse_first,
                                  ucs_status_t* failure) {
  for (size_t i = first; i < last; ++i) {
    const Span& s = spans[i];
    auto* op = new Op{ep, mem, rkey, cookie, epoch, group};
    ucp_request_param_t param;
    std::memset(&param, 0, sizeof(param));
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_MEMH |
                         UCP_OP_ATTR_FIELD_MEMORY_TYPE | UCP_OP_ATTR_FIELD_USER_DATA;
    param.memh = mem->memh.get();
    param.memory_type = kind == MemoryKind::kCuda ? UCS_MEMORY_TYPE_CUDA : UCS_MEMORY_TYPE_HOST;
    param.cb.send = OpCallback;
    param.user_data = op;
    ucs_status_ptr_t request =
        ep->failure.ok() ? ucp_get_nbx(ep->ep, base + s.local_offset, s.length,
                                       remote_address + s.remote_offset, rkey->rkey.get(), &param)
                         : UCS_STATUS_PTR(UCS_ERR_CONNECTION_RESET);
    if (UCS_PTR_IS_ERR(request)) {
      *failure = UCS_PTR_STATUS(request);
      if (ucx::IsPeerFailure(*failure)) OnEpError(ep.get(), *failure);
      if (i == first && refuse_first) {  // nothing posted: the caller reports it, no completion
        delete op;
        return 0;
      }
      // The spans not posted count as failed; the op completes with the error once the
      // posted ones are done.
      group->remaining -= last - i - 1;
      FinishOp(op, *failure);
      return i - first;
    }
    if (request != nullptr) {
      ++in_ucx_;
      ++ep->in_ucx;
    } else {
      FinishOp(op, UCS_OK);
    }
  }
  return last - first;
}

void UcxTransport::OnEpError(EpState* ep, ucs_status_t status) {
  if (!ep->failure.ok()) return;
  absl::Status s = ucx::ToStatus(status, "peer failed");
  ep->failure = absl::IsUnavailable(s) ? s : absl::UnavailableError(std::string(s.message()));
  if (auto self = ep->self.lock()) newly_failed_.push_back(std::move(self));
  // Gathers awaiting a reply from it have no UCX request that would report the failure.
  AbortGathers(ep, status);
}

absl::Status UcxTransport::Resolve(const Done& done) {
  EpState& ep = *done.ep;
  bool cancelled = ep.closed || done.epoch != ep.epoch;
  if (done.status == UCS_OK) {
    return cancelled ? absl::CancelledError("op cancelled") : absl::OkStatus();
  }
  if (ep.failure.ok() && ucx::IsPeerFailure(done.status)) OnEpError(&ep, done.status);
  if (!ep.failure.ok()) return ep.failure;
  if (cancelled) return absl::CancelledError("op cancelled");
  return ucx::ToStatus(done.status, "transfer");
}

void UcxTransport::DrainCopier() {
  copied_.clear();
  copier_->Drain(&copied_);
  for (CopyEngine::Finished& finished : copied_) {
    auto* op = static_cast<Op*>(finished.tag);
    --in_copier_;
    // The copy itself can't fail, but once the peer is known dead its ops report UNAVAILABLE,
    // as every outstanding op of a failed endpoint must (transport.h).
    const bool failed = !op->ep->failure.ok();
    done_.push_back({std::move(op->ep), op->cookie, op->epoch,
                     failed ? UCS_ERR_CONNECTION_RESET : UCS_OK, finished.hashed && !failed,
                     finished.xxh3, std::move(finished.span_xxh3)});
    delete op;
  }
}

bool UcxTransport::PrepareToSleep() {
  if (wake_fd_ < 0) return false;
  // Work in flight completes through progress, not always with an event on the fd (a copy on
  // the CopyEngine's threads, a reply or request UCX is still sending, a closing endpoint), and
  // results not yet handed out must go first: the caller keeps polling meanwhile.
  if (outstanding_ != 0 || in_copier_ != 0 || !done_.empty() || !newly_failed_.empty() ||
      !pending_closes_.empty() || !serves_.empty() || !outgoings_.empty()) {
    return false;
  }
  // UCS_ERR_BUSY: events arrived since the last progress; Poll again. Any other error (a
  // transport without events): never sleep.
  return ucp_worker_arm(worker_.get()) == UCS_OK;
}

Transport::Armed UcxTransport::ArmWhileBusy() {
  // Copies on the CopyEngine's threads end with no event on the fd.
  if (wake_fd_ < 0 || in_copier_ != 0) return Armed::kCannot;
  // Results not yet handed out go first.
  if (!done_.empty() || !newly_failed_.empty()) return Armed::kPending;
  const ucs_status_t s = ucp_worker_arm(worker_.get());
  if (s == UCS_OK) return Armed::kArmed;
  return s == UCS_ERR_BUSY ? Armed::kPending : Armed::kCannot;
}

size_t UcxTransport::Poll(std::vector<Completion>* out) {
  // Bounded so one busy Poll can't starve the caller's loop.
  for (int i = 0; i < 64; ++i) {
    const unsigned events = ucp_worker_progress(worker_.get());
    if (events == 0) break;
    activity_ += events;
  }
  if (in_copier_ != 0) DrainCopier();
  if (!pending_closes_.empty()) ReapCloses();

  std::vector<Done> done;
  done.swap(done_);
  for (Done& d : done) {
    absl::Status status = Resolve(d);
    const bool hashed = d.hashed && status.ok();
    out->push_back({d.cookie, std::move(status), hashed && d.span_xxh3.empty(), d.xxh3,
                    hashed ? std::move(d.span_xxh3) : std::vector<uint64_t>()});
    --outstanding_;
    --d.ep->outstanding;
  }

  std::vector<std::shared_ptr<EpState>> failed;
  failed.swap(newly_failed_);
  for (const auto& ep : failed) {
    Logger("transport")->warn("ucx endpoint failed: {}", std::string(ep->failure.message()));
    if (ep->closed || !ep->handler) continue;
    auto handler = ep->handler;  // the handler may destroy the endpoint
    handler(ep->failure);
  }
  return done.size();
}

}  // namespace refit::transport
