#include "daemon/transport/inproc/inproc_transport.h"

#include <cstdlib>
#include <cstring>
#include <unordered_map>
#include <utility>

#include "absl/strings/str_cat.h"
#include "daemon/common/logging.h"
#include "daemon/common/mutex.h"
#include "daemon/common/status_macros.h"
#include "daemon/transport/wire.h"

namespace refit::transport {

// One transport's shared face: what its peers may touch, guarded by `mu`.
struct InprocTransport::Node {
  struct Region {
    uint8_t* address;
    uint64_t length;
  };
  common::Mutex mu;
  bool alive ABSL_GUARDED_BY(mu) = true;
  std::unordered_map<uint64_t, Region> regions ABSL_GUARDED_BY(mu);
  // Bytes peers' gets copied out of `regions` (bytes_served): the reader does the copy here,
  // under this lock, so it counts them for the node it reads.
  uint64_t served ABSL_GUARDED_BY(mu) = 0;
};

struct InprocTransport::EpState {
  uint64_t peer_identity = 0;
  std::shared_ptr<Node> peer;  // null when no such peer existed at Connect
  absl::Status failure;        // UNAVAILABLE once failed
  uint64_t epoch = 0;          // bumped by Cancel: ops of older epochs are cancelled
  bool closed = false;         // the Endpoint was destroyed
  uint64_t outstanding = 0;
  std::function<void(const absl::Status&)> handler;
};

namespace {

struct Registry {
  common::Mutex mu;
  std::unordered_map<uint64_t, std::shared_ptr<InprocTransport::Node>> nodes ABSL_GUARDED_BY(mu);
  uint64_t next_region_id ABSL_GUARDED_BY(mu) = 1;
};

Registry& GlobalRegistry() {
  static Registry* registry = new Registry();  // never destroyed: used from static teardown
  return *registry;
}

}  // namespace

class InprocTransport::InprocLocalMemory final : public LocalMemory {
 public:
  // `owned`: AllocateMemory's memory, freed here; it may outlive the transport, so it holds the
  // transport's Node itself and isn't counted among the objects that must go first.
  InprocLocalMemory(InprocTransport* owner, void* address, uint64_t length, MemoryKind kind,
                    uint64_t region_id, bool owned)
      : LocalMemory(address, length, kind),
        owner_(owner),
        node_(owner->node_),
        region_id_(region_id),
        owned_(owned) {
    WireDescriptor d;
    d.backend = WireBackend::kInproc;
    d.issuer = owner->identity_;
    d.address = reinterpret_cast<uint64_t>(address);
    d.length = length;
    d.payload.assign(reinterpret_cast<const char*>(&region_id_), sizeof(region_id_));
    set_descriptor(EncodeDescriptor(d));
    if (!owned_) ++owner_->live_objects_;
  }
  ~InprocLocalMemory() override {
    {
      common::MutexLock lock(node_->mu);
      node_->regions.erase(region_id_);
    }
    if (owned_) {
      std::free(address());
    } else {
      --owner_->live_objects_;
    }
  }
  const InprocTransport* owner() const { return owner_; }

 private:
  InprocTransport* owner_;
  std::shared_ptr<Node> node_;
  uint64_t region_id_;
  bool owned_;
};

class InprocTransport::InprocRemoteMemory final : public RemoteMemory {
 public:
  InprocRemoteMemory(InprocTransport* owner, const EpState* ep, uint64_t address, uint64_t length,
                     uint64_t region_id)
      : RemoteMemory(address, length), owner_(owner), ep_(ep), region_id_(region_id) {
    ++owner_->live_objects_;
  }
  ~InprocRemoteMemory() override { --owner_->live_objects_; }
  const EpState* ep() const { return ep_; }
  uint64_t region_id() const { return region_id_; }

 private:
  InprocTransport* owner_;
  const EpState* ep_;
  uint64_t region_id_;
};

class InprocTransport::InprocEndpoint final : public Endpoint {
 public:
  InprocEndpoint(InprocTransport* owner, std::shared_ptr<EpState> state)
      : owner_(owner), state_(std::move(state)) {
    ++owner_->live_objects_;
  }
  ~InprocEndpoint() override {
    state_->closed = true;
    state_->handler = nullptr;
    --owner_->live_objects_;
  }

  absl::StatusOr<std::unique_ptr<RemoteMemory>> ImportRemote(std::string_view descriptor) override {
    auto d = DecodeDescriptor(descriptor, WireBackend::kInproc);
    if (!d.ok()) return d.status();
    if (d->issuer != state_->peer_identity) {
      return absl::InvalidArgumentError(
          "memory descriptor was issued by another transport than this endpoint's peer");
    }
    if (d->payload.size() != sizeof(uint64_t)) {
      return absl::InvalidArgumentError("memory descriptor payload is not an inproc region id");
    }
    if (!state_->failure.ok()) return state_->failure;
    uint64_t region_id;
    std::memcpy(&region_id, d->payload.data(), sizeof(region_id));
    return std::unique_ptr<RemoteMemory>(
        new InprocRemoteMemory(owner_, state_.get(), d->address, d->length, region_id));
  }

  absl::Status PostGet(const LocalMemory& local, uint64_t local_offset, const RemoteMemory& remote,
                       uint64_t remote_offset, uint64_t length, uint64_t cookie) override {
    return owner_->Post(true, state_, local, local_offset, remote, remote_offset, length, cookie);
  }
  absl::Status PostPut(const LocalMemory& local, uint64_t local_offset, const RemoteMemory& remote,
                       uint64_t remote_offset, uint64_t length, uint64_t cookie) override {
    return owner_->Post(false, state_, local, local_offset, remote, remote_offset, length, cookie);
  }
  absl::Status PostGetSpans(const LocalMemory& local, const RemoteMemory& remote,
                            std::vector<Span> spans, uint64_t cookie) override {
    return owner_->PostSpans(state_, local, remote, std::move(spans), cookie);
  }

  void Cancel() override { ++state_->epoch; }
  absl::Status status() const override { return state_->failure; }
  uint64_t outstanding() const override { return state_->outstanding; }
  void SetFailureHandler(std::function<void(const absl::Status&)> handler) override {
    state_->handler = std::move(handler);
  }

  const std::shared_ptr<EpState>& state() const { return state_; }
  const InprocTransport* owner() const { return owner_; }

 private:
  InprocTransport* owner_;
  std::shared_ptr<EpState> state_;
};

std::unique_ptr<InprocTransport> InprocTransport::Create(const Options& options) {
  return std::unique_ptr<InprocTransport>(new InprocTransport(options));
}

InprocTransport::InprocTransport(const Options& options)
    : identity_(NewTransportIdentity()),
      node_(std::make_shared<Node>()),
      max_ops_per_poll_(options.max_ops_per_poll) {
  capabilities_.name = "inproc";
  capabilities_.rma_get = true;
  capabilities_.rma_put = true;
  capabilities_.cuda_memory = false;
  capabilities_.detail = "memcpy within one process";
  address_ = EncodeAddress({WireBackend::kInproc, identity_, ""});
  Registry& registry = GlobalRegistry();
  common::MutexLock lock(registry.mu);
  registry.nodes[identity_] = node_;
}

InprocTransport::~InprocTransport() {
  if (live_objects_ != 0) {
    Logger("transport")
        ->critical("inproc transport destroyed with {} endpoints/memory handles still alive",
                   live_objects_);
    std::abort();
  }
  {
    Registry& registry = GlobalRegistry();
    common::MutexLock lock(registry.mu);
    registry.nodes.erase(identity_);
  }
  common::MutexLock lock(node_->mu);
  node_->alive = false;
  node_->regions.clear();
}

absl::StatusOr<std::unique_ptr<LocalMemory>> InprocTransport::RegisterMemory(void* address,
                                                                             uint64_t length,
                                                                             MemoryKind kind) {
  if (address == nullptr || length == 0) {
    return absl::InvalidArgumentError("RegisterMemory needs a non-null address and a length");
  }
  if (kind != MemoryKind::kHost) {
    return absl::UnimplementedError(
        absl::StrCat("the inproc transport can't register ", MemoryKindName(kind), " memory"));
  }
  return Register(address, length, kind, /*owned=*/false);
}

absl::StatusOr<std::unique_ptr<LocalMemory>> InprocTransport::AllocateMemory(uint64_t length) {
  if (length == 0) return absl::InvalidArgumentError("AllocateMemory needs a length");
  constexpr uint64_t kPage = 4096;
  void* memory = std::aligned_alloc(kPage, (length + kPage - 1) / kPage * kPage);
  if (memory == nullptr) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot allocate ", length, " bytes"));
  }
  return Register(memory, length, MemoryKind::kHost, /*owned=*/true);
}

std::unique_ptr<LocalMemory> InprocTransport::Register(void* address, uint64_t length,
                                                       MemoryKind kind, bool owned) {
  uint64_t region_id;
  {
    Registry& registry = GlobalRegistry();
    common::MutexLock lock(registry.mu);
    region_id = registry.next_region_id++;
  }
  {
    common::MutexLock lock(node_->mu);
    node_->regions[region_id] = {static_cast<uint8_t*>(address), length};
  }
  return std::unique_ptr<LocalMemory>(
      new InprocLocalMemory(this, address, length, kind, region_id, owned));
}

absl::StatusOr<std::unique_ptr<Endpoint>> InprocTransport::Connect(std::string_view peer_address) {
  auto address = DecodeAddress(peer_address, WireBackend::kInproc);
  if (!address.ok()) return address.status();
  auto state = std::make_shared<EpState>();
  state->peer_identity = address->issuer;
  {
    Registry& registry = GlobalRegistry();
    common::MutexLock lock(registry.mu);
    auto it = registry.nodes.find(address->issuer);
    if (it != registry.nodes.end()) state->peer = it->second;
  }
  endpoints_.push_back(state);
  return std::unique_ptr<Endpoint>(new InprocEndpoint(this, std::move(state)));
}

absl::Status InprocTransport::CheckHandles(const std::shared_ptr<EpState>& state,
                                           const LocalMemory& local,
                                           const RemoteMemory& remote) const {
  auto* local_memory = dynamic_cast<const InprocLocalMemory*>(&local);
  if (local_memory == nullptr || local_memory->owner() != this) {
    return absl::InvalidArgumentError("local memory was registered with another transport");
  }
  auto* remote_memory = dynamic_cast<const InprocRemoteMemory*>(&remote);
  if (remote_memory == nullptr || remote_memory->ep() != state.get()) {
    return absl::InvalidArgumentError("remote memory was imported on another endpoint");
  }
  return absl::OkStatus();
}

absl::Status InprocTransport::PostSpans(const std::shared_ptr<EpState>& state,
                                        const LocalMemory& local, const RemoteMemory& remote,
                                        std::vector<Span> spans, uint64_t cookie) {
  RETURN_IF_ERROR(CheckHandles(state, local, remote));
  ASSIGN_OR_RETURN(const uint64_t total, CheckSpans(spans, local.length(), remote.length()));
  if (!state->failure.ok()) return state->failure;
  const auto& remote_memory = static_cast<const InprocRemoteMemory&>(remote);
  Op op{state,
        /*get=*/true,
        static_cast<uint8_t*>(local.address()),
        remote_memory.region_id(),
        remote.remote_address(),
        /*remote_offset=*/0,
        total,
        cookie,
        state->epoch,
        std::make_shared<const std::vector<Span>>(std::move(spans))};
  ++state->outstanding;
  queue_.push_back(std::move(op));
  return absl::OkStatus();
}

absl::Status InprocTransport::Post(bool get, const std::shared_ptr<EpState>& state,
                                   const LocalMemory& local, uint64_t local_offset,
                                   const RemoteMemory& remote, uint64_t remote_offset,
                                   uint64_t length, uint64_t cookie) {
  RETURN_IF_ERROR(CheckHandles(state, local, remote));
  const auto* remote_memory = static_cast<const InprocRemoteMemory*>(&remote);
  absl::Status range =
      CheckRanges(local_offset, local.length(), remote_offset, remote.length(), length);
  if (!range.ok()) return range;
  if (!state->failure.ok()) return state->failure;

  Op op{state,
        get,
        static_cast<uint8_t*>(local.address()) + local_offset,
        remote_memory->region_id(),
        remote.remote_address(),
        remote_offset,
        length,
        cookie,
        state->epoch,
        nullptr};
  ++state->outstanding;
  queue_.push_back(std::move(op));
  return absl::OkStatus();
}

void InprocTransport::Fail(const std::shared_ptr<EpState>& state, absl::Status status) {
  if (!state->failure.ok()) return;
  state->failure = std::move(status);
  newly_failed_.push_back(state);
}

void InprocTransport::FailEndpoint(Endpoint& endpoint) {
  auto* ep = dynamic_cast<InprocEndpoint*>(&endpoint);
  if (ep == nullptr || ep->owner() != this) {
    Logger("transport")->critical("FailEndpoint called with an endpoint of another transport");
    std::abort();
  }
  Fail(ep->state(), absl::UnavailableError("inproc: injected endpoint failure"));
}

void InprocTransport::SimulateCrash() {
  common::MutexLock lock(node_->mu);
  node_->alive = false;
  node_->regions.clear();
}

absl::Status InprocTransport::Execute(const Op& op) {
  if (op.ep->peer == nullptr) return absl::UnavailableError("inproc: no such peer");
  Node& peer = *op.ep->peer;
  common::MutexLock lock(peer.mu);
  if (!peer.alive) return absl::UnavailableError("inproc: peer transport is gone");
  auto it = peer.regions.find(op.region_id);
  if (it == peer.regions.end() ||
      reinterpret_cast<uint64_t>(it->second.address) != op.remote_address) {
    return absl::FailedPreconditionError("inproc: remote memory was deregistered");
  }
  uint8_t* remote = it->second.address + op.remote_offset;
  if (op.spans) {
    for (const Span& s : *op.spans) {
      std::memcpy(op.local + s.local_offset, remote + s.remote_offset, s.length);
      peer.served += s.length;
    }
  } else if (op.length != 0) {
    if (op.get) {
      std::memcpy(op.local, remote, op.length);
      peer.served += op.length;
    } else {
      std::memcpy(remote, op.local, op.length);
    }
  }
  return absl::OkStatus();
}

uint64_t InprocTransport::bytes_served() const {
  common::MutexLock lock(node_->mu);
  return node_->served;
}

size_t InprocTransport::Poll(std::vector<Completion>* out) {
  bool self_alive;
  {
    common::MutexLock lock(node_->mu);
    self_alive = node_->alive;
  }
  // Liveness of idle endpoints, as UCX keepalive would notice it.
  size_t kept = 0;
  for (auto& weak : endpoints_) {
    auto state = weak.lock();
    if (state == nullptr || state->closed) continue;
    endpoints_[kept++] = weak;
    if (!state->failure.ok()) continue;
    bool peer_alive = false;
    if (state->peer != nullptr) {
      common::MutexLock lock(state->peer->mu);
      peer_alive = state->peer->alive;
    }
    if (!self_alive) {
      Fail(state, absl::UnavailableError("inproc: this transport crashed"));
    } else if (!peer_alive) {
      Fail(state, absl::UnavailableError("inproc: peer transport is gone"));
    }
  }
  endpoints_.resize(kept);

  size_t appended = 0;
  size_t executed = 0;
  std::deque<Op> waiting;
  while (!queue_.empty()) {
    Op op = std::move(queue_.front());
    queue_.pop_front();
    absl::Status status;
    if (op.ep->closed || op.epoch != op.ep->epoch) {
      status = absl::CancelledError("inproc: op cancelled");
    } else if (!op.ep->failure.ok()) {
      status = op.ep->failure;
    } else if (max_ops_per_poll_ != 0 && executed >= max_ops_per_poll_) {
      waiting.push_back(std::move(op));
      continue;
    } else {
      ++executed;
      status = Execute(op);
      if (absl::IsUnavailable(status)) Fail(op.ep, status);
    }
    --op.ep->outstanding;
    out->push_back({op.cookie, std::move(status)});
    ++appended;
  }
  queue_ = std::move(waiting);

  std::vector<std::shared_ptr<EpState>> failed;
  failed.swap(newly_failed_);
  for (auto& state : failed) {
    Logger("transport")->warn("inproc endpoint failed: {}", std::string(state->failure.message()));
    if (state->closed || state->handler == nullptr) continue;
    auto handler = state->handler;  // the handler may destroy the endpoint
    handler(state->failure);
  }
  return appended;
}

}  // namespace refit::transport
