#include "daemon/peer/peer_manager.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <sys/socket.h>

#include <chrono>
#include <cstdlib>
#include <set>

#include "absl/strings/str_cat.h"
#include "daemon/common/logging.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/test_hooks.h"
#include "daemon/convert/convert.h"
#include "daemon/peer/peer_limits.h"
#include "daemon/plan/plan.h"
#include "daemon/pull/delta_fetch.h"
#include "daemon/pull/puller.h"
#include "daemon/rl/labels.h"
#include "daemon/rl/staleness.h"
#include "daemon/rl/timeline.h"
#include "daemon/version.h"
#include "grpcpp/grpcpp.h"

namespace refit::peer {
namespace {

using std::chrono::milliseconds;

constexpr auto kHelloDeadline = milliseconds(2000);
// Replica reports: on every completion here, and at least this often (a heartbeat: a node
// silent for fleet::kReplicaTtl reads as gone).
constexpr auto kReportEvery = milliseconds(1000);
constexpr auto kReportDeadline = milliseconds(2000);
constexpr auto kMaxBackoff = milliseconds(2000);
// A reader's pin on a source's version lapses after its lease unless renewed; a pull renews its
// pins every quarter lease. 2 minutes; tests shorten it with $REFIT_TEST_PIN_LEASE_MS (the
// source takes at least 1 s).
constexpr uint32_t kPinLeaseMs = 120000;

// A peer's SOURCE layouts, checked as this daemon checks its own clients' (daemons of one
// release send normalized, valid ones; anything else is a bug or not a refitd): every slice
// inside its piece's bytes, no two sharing a byte.
absl::Status PeerLayouts(const v1::PeerEvent& event, std::vector<SourceLayout>* layouts) {
  constexpr uint64_t kMaxPieceBytes = uint64_t{1} << 44;  // 16 TiB: no GPU rank's buffer
  std::set<std::string> ids;
  for (const v1::SourcePiece& source : event.sources()) {
    if (!ids.insert(source.buffer_id()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat("piece ", source.buffer_id(), " is described twice"));
    }
    if (source.bytes() > kMaxPieceBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("piece ", source.buffer_id(), " claims ", source.bytes(), " bytes"));
    }
    ASSIGN_OR_RETURN(std::vector<TensorSlice> slices, convert::FromProto(source.tensors()));
    if (slices.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("piece ", source.buffer_id(), " has no tensors"));
    }
    absl::Status valid = plan::NormalizeAndValidateBuffer(slices, source.bytes());
    if (!valid.ok()) {
      return absl::Status(valid.code(), absl::StrCat("piece ", source.buffer_id(), " of ",
                                                     source.bytes(), " bytes: ", valid.message()));
    }
    layouts->push_back({source.buffer_id(),
                        std::make_shared<std::vector<TensorSlice>>(std::move(slices)),
                        source.bytes()});
  }
  return absl::OkStatus();
}

uint32_t PinLeaseMs() {
  if (const char* test = TestSwitch("REFIT_TEST_PIN_LEASE_MS")) {
    if (const long ms = std::strtol(test, nullptr, 10); ms > 0) return static_cast<uint32_t>(ms);
  }
  return kPinLeaseMs;
}

// A relay channel unused this long is closed; $REFIT_TEST_RELAY_IDLE_MS in test builds.
milliseconds RelayIdle() {
  if (const char* test = TestSwitch("REFIT_TEST_RELAY_IDLE_MS")) {
    if (const long ms = std::strtol(test, nullptr, 10); ms > 0) return milliseconds(ms);
  }
  return milliseconds(60000);
}
// After a relay channel failed to open, it is not tried again for this long.
constexpr auto kRedialAfter = milliseconds(2000);

std::chrono::system_clock::time_point In(milliseconds d) {
  return std::chrono::system_clock::now() + d;
}

}  // namespace

std::vector<std::string> ResolvePeerAddress(const std::string& address) {
  const auto colon = address.rfind(':');
  if (colon == std::string::npos) return {address};
  std::string host = address.substr(0, colon);
  const std::string port = address.substr(colon + 1);
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* result = nullptr;
  if (getaddrinfo(host.c_str(), port.c_str(), &hints, &result) != 0 || !result) {
    return {address};
  }
  std::set<std::string> out;
  for (addrinfo* a = result; a; a = a->ai_next) {
    char ip[INET6_ADDRSTRLEN] = {};
    if (a->ai_family == AF_INET) {
      inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr, ip, sizeof(ip));
      out.insert(std::string(ip) + ":" + port);
    } else if (a->ai_family == AF_INET6) {
      inet_ntop(AF_INET6, &reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr, ip, sizeof(ip));
      out.insert("[" + std::string(ip) + "]:" + port);
    }
  }
  freeaddrinfo(result);
  if (out.empty()) return {address};
  return {out.begin(), out.end()};
}

struct PeerManager::Peer {
  std::string address;
  std::string node;
  std::string site;        // its Hello's --site; guarded by PeerManager::mu_
  bool connected = false;  // guarded by PeerManager::mu_
  std::string error;       // guarded by PeerManager::mu_
  // Why the last Dial failed when it was a matter of trust (TLS, identity), for Status;
  // guarded by PeerManager::mu_.
  std::string refused;
  // Set by its thread before `node`, under mu_; shared with the replica reporter, which calls
  // through it outside the lock while a reconnect may replace it.
  std::shared_ptr<v1::Peer::Stub> stub;
  std::shared_ptr<grpc::Channel> channel;
  grpc::ClientContext* stream = nullptr;  // the live Subscribe call, for Stop
  std::thread thread;
};

PeerManager::PeerManager(PeerManagerOptions options, std::vector<std::string> addresses,
                         Store* store, DataPlane* data_plane, Metrics* metrics,
                         fleet::RelayBoard* board, fleet::ReplicaTable* replicas)
    : node_(options.node),
      instance_(options.instance),
      relay_(options.relay),
      site_(options.site),
      tls_(options.tls),
      rl_(options.rl),
      store_(store),
      data_plane_(data_plane),
      metrics_(metrics),
      replicas_(replicas),
      configured_(std::move(addresses)),
      reporter_(WorkerLoop::Options{"replica reports", kReportEvery, /*run_at_start=*/false}),
      max_channels_(std::max<uint32_t>(1, options.max_peer_connections)),
      idle_(RelayIdle()) {
  metrics_->Declare(kPeersConnected);
  metrics_->Declare(kTransferSeconds);
  metrics_->Declare(kPeerChannelsOpen);
  pull::PullerOptions pull_options;
  pull_options.node = options.node;
  pull_options.delta_threshold = options.delta_threshold;
  pull_options.pin_lease_ms = PinLeaseMs();
  pull_options.relay = options.relay;
  pull_options.site = options.site;
  pull_options.timeline = options.rl.timeline;
  puller_ = std::make_unique<pull::Puller>(pull_options, store, data_plane, metrics, this, board,
                                           replicas);
}

PeerManager::~PeerManager() { Stop(); }

void PeerManager::AddPeer(const std::string& address) {
  for (const auto& peer : peers_) {
    if (peer->address == address) return;
  }
  auto peer = std::make_unique<Peer>();
  peer->address = address;
  Peer* p = peer.get();
  peers_.push_back(std::move(peer));
  p->thread = std::thread([this, p] { RunPeer(p); });
}

void PeerManager::Start() {
  {
    common::MutexLock lock(mu_);
    started_ = true;
    for (const std::string& configured : configured_) {
      for (const std::string& address : ResolvePeerAddress(configured)) AddPeer(address);
    }
  }
  pull_thread_ = std::thread([this] { RunPulls(); });
  resolver_thread_ = std::thread([this] { RunResolver(); });
  reporter_.Start([this] { Report(); });
}

void PeerManager::RunResolver() {
  // Names may resolve to more daemons later (a DaemonSet scaling up behind a headless Service).
  while (true) {
    {
      common::UniqueLock lock(mu_);
      wake_.WaitFor(lock, std::chrono::seconds(10),
                    [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; });
      if (stop_) return;
    }
    for (const std::string& configured : configured_) {
      auto addresses = ResolvePeerAddress(configured);
      common::MutexLock lock(mu_);
      if (stop_) return;
      for (const std::string& address : addresses) AddPeer(address);
    }
  }
}

void PeerManager::Stop() {
  {
    common::MutexLock lock(mu_);
    if (stop_) return;
    stop_ = true;
    for (auto& peer : peers_) {
      if (peer->stream) peer->stream->TryCancel();
      // Dropping the endpoint cancels a pull in flight, so the pull worker can finish.
      if (!peer->node.empty()) data_plane_->Disconnect(peer->node);
    }
    for (const auto& relay : relays_) data_plane_->Disconnect(relay.first);
  }
  wake_.NotifyAll();
  if (resolver_thread_.joinable()) resolver_thread_.join();
  reporter_.Stop();
  std::vector<Peer*> joining;  // peers_ no longer grows: stop_ is set
  {
    common::MutexLock lock(mu_);
    for (auto& peer : peers_) joining.push_back(peer.get());
  }
  for (Peer* peer : joining) {
    if (peer->thread.joinable()) peer->thread.join();
  }
  if (pull_thread_.joinable()) pull_thread_.join();
}

namespace {

// What a failed Dial says about trust, for the operator ("" when it was not about trust): a
// TLS handshake that failed (a certificate expired, of another CA, refused by the peer), a
// peer whose certificate names another node, or (this node without TLS) a connection the peer
// closed before answering, as a peer with --tls-* does to plaintext.
std::string TrustFailure(const grpc::Status& status, bool tls, const std::string& address) {
  const std::string& message = status.error_message();
  auto has = [&message](const char* text) { return message.find(text) != std::string::npos; };
  if (status.error_code() == grpc::StatusCode::PERMISSION_DENIED) {
    return absl::StrCat("peer at ", address, " refused: ", message);
  }
  if (tls && (has("andshake failed") || has("SSL_ERROR") || has("certificate"))) {
    return absl::StrCat(
        "peer at ", address, ": no mutual TLS session (", message,
        "): each side's certificate must be valid now and issued by the CA the other side "
        "trusts (--tls-ca), and the peer must run with --tls-* too");
  }
  if (!tls && has("Socket closed")) {
    return absl::StrCat("peer at ", address, " closed the connection before answering (", message,
                        "): a peer with mutual TLS (--tls-*) does that to plaintext; if it "
                        "runs with --tls-*, give this node --tls-cert, --tls-key and --tls-ca");
  }
  return "";
}

}  // namespace

std::vector<PeerState> PeerManager::Peers() const {
  common::MutexLock lock(mu_);
  std::vector<PeerState> out;
  for (const auto& peer : peers_) {
    if (peer->node == node_ + " (self)") continue;
    // A refused peer has this node's name (kept out of `node`, which names endpoints).
    out.push_back({peer->address, peer->error.empty() ? peer->node : node_, peer->connected,
                   peer->error.empty() ? peer->refused : peer->error});
  }
  return out;
}

grpc::Status PeerManager::Dial(const std::string& address, Dialed* out) const {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_KEEPALIVE_TIME_MS, 1000);
  args.SetInt(GRPC_ARG_KEEPALIVE_TIMEOUT_MS, 2000);
  args.SetInt(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 2000);
  args.SetMaxReceiveMessageSize(64 << 20);
  auto channel = grpc::CreateCustomChannel(address, tls::ChannelCredentials(tls_), args);
  auto stub = v1::Peer::NewStub(channel);
  v1::HelloRequest hello;
  hello.set_node(node_);
  hello.set_version(kRefitVersion);
  hello.set_instance(instance_);
  hello.set_listen(listen_);
  v1::HelloResponse who;
  grpc::ClientContext hello_context;
  hello_context.set_deadline(In(kHelloDeadline));
  grpc::Status status = stub->Hello(&hello_context, hello, &who);
  if (status.ok() && (who.node().empty() || who.node().size() > 255)) {
    // Pieces without a node are this node's own: such a peer's versions would look complete
    // here without a byte pulled.
    status = grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          absl::StrCat("it names itself '", who.node().substr(0, 64),
                                       "' (a node name is 1 to 255 bytes)"));
  }
  if (status.ok() && tls_.enabled()) {
    // Its identity is its certificate: a peer may not call itself another node.
    if (auto auth = hello_context.auth_context(); auth) {
      absl::Status identity = tls::CheckIdentity(*auth, who.node());
      if (!identity.ok()) {
        status = grpc::Status(grpc::StatusCode::PERMISSION_DENIED, std::string(identity.message()));
      }
    }
  }
  out->who = std::move(who);
  out->channel = std::move(channel);
  out->stub = std::move(stub);
  return status;
}

void PeerManager::RunPeer(Peer* peer) {
  auto backoff = milliseconds(100);
  bool reported_down = false;
  while (true) {
    {
      common::MutexLock lock(mu_);
      if (stop_) return;
    }
    Dialed dialed;
    grpc::Status status = Dial(peer->address, &dialed);
    const v1::HelloResponse& who = dialed.who;
    auto& channel = dialed.channel;
    auto& stub = dialed.stub;
    if (status.ok() && who.node() == node_ &&
        (who.instance() == instance_ || who.instance().empty())) {
      // A name that resolves to every daemon (a headless Service) includes this one.
      Logger("peer")->info("peer at {} is this node; not connecting to it", peer->address);
      common::MutexLock lock(mu_);
      peer->node = node_ + " (self)";
      return;
    }
    if (status.ok() && who.node() == node_) {
      // Another daemon with this node's name: its pieces would pass for this node's own.
      status = grpc::Status(
          grpc::StatusCode::FAILED_PRECONDITION,
          absl::StrCat(
              "two daemons have --node=", node_, ": the one at ", peer->address,
              who.listen().empty() ? "" : absl::StrCat(" (listening on ", who.listen(), ")"),
              " and this one at ", listen_,
              "; node names must be unique: give each refitd its own --node"));
    }
    if (status.error_code() == grpc::StatusCode::FAILED_PRECONDITION &&
        status.error_message().rfind("two daemons have --node=", 0) == 0) {
      bool first = false;
      {
        common::MutexLock lock(mu_);
        first = peer->error != status.error_message();
        peer->error = status.error_message();
        peer->node.clear();
      }
      if (first) Logger("peer")->warn("peer at {} refused: {}", peer->address, peer->error);
      common::UniqueLock lock(mu_);
      wake_.WaitFor(lock, kMaxBackoff,
                    [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; });
      continue;  // the operator may restart it under another name
    }
    if (status.ok()) {
      backoff = milliseconds(100);
      reported_down = false;
      const std::string node = who.node();
      if (!who.transport_address().empty()) data_plane_->Connect(node, who.transport_address());
      grpc::ClientContext context;
      context.set_deadline(In(milliseconds(24ll * 3600 * 1000)));
      {
        common::MutexLock lock(mu_);
        if (stop_) return;
        peer->node = node;
        peer->site = who.site().size() <= kMaxNodeName ? who.site() : "";
        peer->connected = true;
        peer->error.clear();
        peer->refused.clear();
        peer->channel = channel;
        if (peer->stub) retired_stubs_.push_back(std::move(peer->stub));
        peer->stub = std::move(stub);
        peer->stream = &context;
      }
      metrics_->Add(kPeersConnected, 1);
      metrics_->Add(kPeerChannelsOpen, 1);
      Logger("peer")->info("peer={} connected at {} (refitd {}, data plane {})", Printable(node),
                           peer->address, Printable(who.version()), Printable(who.transport()));
      v1::SubscribeRequest request;
      request.set_node(node_);
      request.set_listen(listen_);
      auto reader = peer->stub->Subscribe(&context, request);
      v1::PeerEvent event;
      while (reader->Read(&event)) {
        if (absl::Status name = CheckModelName(event.model()); !name.ok()) {
          // No model here can have that name: the event is about nothing this node knows.
          Logger("peer")->debug("peer={} model={}: event ignored: {}", Printable(node),
                                Printable(event.model()), name.ToString());
          continue;
        }
        // Layouts come when they change; an event without them keeps the last ones.
        if (!event.sources_unchanged()) {
          std::vector<SourceLayout> layouts;
          absl::Status valid = PeerLayouts(event, &layouts);
          if (!valid.ok()) {
            // Planned from, it could have this node copy outside a slot; taken as "no sources
            // there", it could let a version complete without that node's shards. The peer is
            // dropped as if it had failed (its layout so far stays, and its versions are
            // forgotten), and reconnected with backoff.
            Logger("peer")->error("peer={} model={}: layout refused, disconnecting: {}",
                                  Printable(node), Printable(event.model()),
                                  Printable(valid.ToString(), 512));
            context.TryCancel();
            break;
          }
          store_->SetRemoteSources(node, event.model(), std::move(layouts));
          store_->ReserveStaging(event.model());
        }
        if (event.version() > 0) {
          std::vector<RemotePieceRef> pieces;
          for (const auto& p : event.pieces()) {
            pieces.push_back({p.buffer_id(), p.remote_key(), p.bytes()});
          }
          std::vector<RemoteDeltaRef> deltas;
          for (const auto& d : event.deltas()) {
            deltas.push_back(
                {d.buffer_id(), d.base_version(), d.version(), d.remote_key(), d.bytes()});
          }
          NoteAnnounced(node, event);
          store_->AnnounceRemoteVersion(node, event.model(), event.version(), std::move(pieces),
                                        std::move(deltas), event.run(), event.trainer_run());
        }
        // Rollback / Resume asked there (or forwarded to it): followed here on each change.
        store_->FollowHold(node, event.model(), event.rollback_version());
      }
      status = reader->Finish();
      {
        common::MutexLock lock(mu_);
        peer->connected = false;
        peer->stream = nullptr;
      }
      metrics_->Add(kPeersConnected, -1);
      metrics_->Add(kPeerChannelsOpen, -1);
      store_->ForgetRemoteVersions(node);
      if (replicas_) replicas_->Forget(node);
      data_plane_->Disconnect(node);
      Logger("peer")->warn(
          "peer={} at {} disconnected: {}", node, peer->address,
          status.error_message().empty() ? "stream ended" : status.error_message());
    } else if (std::string why = TrustFailure(status, tls_.enabled(), peer->address);
               !why.empty()) {
      // Refused for trust (certificates, identity): said in Status, logged once per reason.
      bool first = false;
      {
        common::MutexLock lock(mu_);
        first = peer->refused != why;
        peer->refused = why;
      }
      if (first) Logger("peer")->error("{}; retrying", why);
      reported_down = true;
    } else if (!reported_down) {
      if (status.error_code() == grpc::StatusCode::INVALID_ARGUMENT) {
        Logger("peer")->error("peer at {} refused: {}; retrying", peer->address,
                              status.error_message());
      } else {
        Logger("peer")->warn("peer at {} not answering ({}); retrying", peer->address,
                             status.error_message());
      }
      reported_down = true;
    }
    common::UniqueLock lock(mu_);
    wake_.WaitFor(lock, backoff, [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_; });
    backoff = std::min(backoff * 2, kMaxBackoff);
  }
}

std::vector<PeerManager::Transfer> PeerManager::Transfers() const {
  common::MutexLock lock(mu_);
  if (!current_) return {};
  Transfer t = *current_;
  const double done = metrics_->Get(kDataBytesReceived) - received_at_start_;
  t.bytes_done = std::min<uint64_t>(t.bytes_total, static_cast<uint64_t>(std::max(0.0, done)));
  return {t};
}

void PeerManager::OnPullNeeded(const PullJob& job) {
  {
    common::MutexLock lock(mu_);
    jobs_.push_back(job);
  }
  wake_.NotifyAll();
}

void PeerManager::OnVersionComplete(const std::string& /*model*/, uint64_t /*version*/) {
  reporter_.Notify();
}

void PeerManager::NoteAnnounced(const std::string& node, const v1::PeerEvent& event) {
  if (rl_.labels && !event.labels().empty()) {
    rl::Labels labels(event.labels().begin(), event.labels().end());
    // The sender checked them at Publish; a peer's oversized labels are not kept.
    if (rl::CheckLabels(labels).ok()) {
      rl_.labels->Set(event.model(), event.version(), std::move(labels));
    }
  }
  if (rl_.staleness) {
    rl_.staleness->NotePublished(event.model(), event.version(), event.max_staleness());
  }
  if (rl_.timeline) {
    rl_.timeline->Mark(event.model(), event.version(), rl::kStageAnnounced,
                       absl::StrCat("by ", node));
  }
}

void PeerManager::Report() {
  CloseIdle();
  v1::ReplicaReport report;
  report.set_node(node_);
  report.set_relay(relay_);
  report.set_site(site_);
  std::vector<fleet::ReplicaEntry> entries;
  for (const ModelInfo& model : store_->Models()) {
    if (model.destination_buffers == 0) continue;
    // Rollback: whether every destination here holds the version the model is held back to.
    const bool rolled_back =
        model.rollback_version != 0 &&
        std::all_of(model.buffers.begin(), model.buffers.end(), [&](const BufferInfo& b) {
          return b.role != Role::kDestination || b.applied_version == model.rollback_version;
        });
    entries.push_back({model.name, model.latest_version, model.rollback_version, rolled_back});
    v1::ReplicaReport::Model* m = report.add_models();
    m->set_model(model.name);
    m->set_latest_version(model.latest_version);
    m->set_rollback_version(model.rollback_version);
    m->set_rolled_back(rolled_back);
  }
  if (entries.empty() && !reported_) return;  // a trainer's node has nothing to say
  reported_ = !entries.empty();
  if (replicas_) {
    if (entries.empty()) {
      replicas_->Forget(node_);
    } else {
      (void)replicas_->Report(node_, relay_, entries, site_);
    }
  }
  // Shared, not borrowed: the peer's thread replaces its stub when it reconnects.
  std::vector<std::pair<std::string, std::shared_ptr<v1::Peer::Stub>>> stubs;
  {
    common::MutexLock lock(mu_);
    for (const auto& peer : peers_) {
      if (peer->connected && peer->stub) stubs.emplace_back(peer->node, peer->stub);
    }
  }
  for (const auto& [node, stub] : stubs) {
    grpc::ClientContext context;
    context.set_deadline(In(kReportDeadline));
    v1::ReplicaReportResponse response;
    grpc::Status status = stub->Report(&context, report, &response);
    if (status.ok()) Learn(response);
    if (!status.ok() && status.error_code() != grpc::StatusCode::UNAVAILABLE) {
      Logger("peer")->debug("peer={} refused this node's replica report: {}", node,
                            status.error_message());
    }
  }
}

v1::Peer::Stub* PeerManager::ConnectedLocked(const std::string& node) const {
  for (const auto& peer : peers_) {
    if (peer->node == node && peer->connected) return peer->stub.get();
  }
  return nullptr;
}

size_t PeerManager::OpenLocked() const {
  size_t open = relays_.size();
  for (const auto& peer : peers_) open += peer->connected ? 1 : 0;
  return open;
}

size_t PeerManager::OpenChannels() const {
  common::MutexLock lock(mu_);
  return OpenLocked();
}

bool PeerManager::CanReach(const std::string& node) {
  common::MutexLock lock(mu_);
  if (ConnectedLocked(node)) return true;
  return relay_ && (relays_.count(node) > 0 || known_.count(node) > 0);
}

std::string PeerManager::SiteOf(const std::string& node) {
  common::MutexLock lock(mu_);
  for (const auto& peer : peers_) {
    if (peer->node == node) return peer->site;
  }
  if (auto relay = relays_.find(node); relay != relays_.end()) return relay->second.site;
  return "";
}

v1::Peer::Stub* PeerManager::StubFor(const std::string& node) {
  {
    common::MutexLock lock(mu_);
    if (v1::Peer::Stub* stub = ConnectedLocked(node)) return stub;
    if (!relay_) return nullptr;
    if (auto relay = relays_.find(node); relay != relays_.end()) {
      relay->second.used = std::chrono::steady_clock::now();
      return relay->second.stub.get();
    }
    if (known_.count(node) == 0) return nullptr;
  }
  return OpenRelay(node);
}

v1::Peer::Stub* PeerManager::OpenRelay(const std::string& node) {
  common::MutexLock opening(open_mu_);
  std::string address;
  {
    common::MutexLock lock(mu_);
    if (stop_) return nullptr;
    if (v1::Peer::Stub* stub = ConnectedLocked(node)) return stub;  // its --peers entry came up
    if (auto relay = relays_.find(node); relay != relays_.end()) {  // opened meanwhile
      relay->second.used = std::chrono::steady_clock::now();
      return relay->second.stub.get();
    }
    auto known = known_.find(node);
    if (known == known_.end()) return nullptr;
    if (OpenLocked() >= max_channels_) {
      Logger("peer")->debug(
          "not opening a relay channel to node {}: {} channels open "
          "(--max-peer-connections)",
          node, max_channels_);
      return nullptr;
    }
    if (auto failed = dial_failed_.find(node);
        failed != dial_failed_.end() &&
        std::chrono::steady_clock::now() - failed->second < kRedialAfter) {
      return nullptr;
    }
    address = known->second;
  }
  Dialed dialed;
  grpc::Status status = Dial(address, &dialed);
  if (status.ok() && dialed.who.node() != node) {
    status =
        grpc::Status(grpc::StatusCode::FAILED_PRECONDITION,
                     absl::StrCat("it answers as node '", dialed.who.node().substr(0, 64), "'"));
  }
  common::MutexLock lock(mu_);
  if (!status.ok() || stop_) {
    if (!status.ok()) {
      dial_failed_[node] = std::chrono::steady_clock::now();
      Logger("peer")->warn("relay channel to node {} at {} not opened: {}", node, address,
                           status.error_message());
    }
    return nullptr;
  }
  dial_failed_.erase(node);
  if (!dialed.who.transport_address().empty()) {
    data_plane_->Connect(node, dialed.who.transport_address());
  }
  Relay& relay = relays_[node];
  relay.site = dialed.who.site().size() <= kMaxNodeName ? dialed.who.site() : "";
  relay.channel = std::move(dialed.channel);
  relay.stub = std::move(dialed.stub);
  relay.used = std::chrono::steady_clock::now();
  metrics_->Add(kPeerChannelsOpen, 1);
  Logger("peer")->info("relay channel to node {} at {} open ({} channels)", node, address,
                       OpenLocked());
  return relay.stub.get();
}

void PeerManager::CloseIdle() {
  common::MutexLock opening(open_mu_);
  common::MutexLock lock(mu_);
  if (pulling_) return;  // its stubs may be in use
  retired_stubs_.clear();
  const auto now = std::chrono::steady_clock::now();
  for (auto it = relays_.begin(); it != relays_.end();) {
    if (now - it->second.used < idle_ && !stop_) {
      ++it;
      continue;
    }
    // A --peers connection to the same node (it came up meanwhile) owns the endpoint now.
    if (!ConnectedLocked(it->first)) data_plane_->Disconnect(it->first);
    metrics_->Add(kPeerChannelsOpen, -1);
    Logger("peer")->info("relay channel to node {} closed (idle)", it->first);
    it = relays_.erase(it);
  }
}

void PeerManager::Learn(const v1::ReplicaReportResponse& response) {
  constexpr int kMaxModels = 10000;
  for (const v1::FleetMember& member : response.members()) {
    if (member.node().empty() || member.node().size() > 255 || member.node() == node_ ||
        member.listen().empty() || member.listen().size() > 1024 ||
        member.models_size() > kMaxModels || member.site().size() > kMaxNodeName) {
      continue;
    }
    {
      common::MutexLock lock(mu_);
      // A --peers node speaks for itself (its own reports, its own address).
      bool configured = false;
      for (const auto& peer : peers_) configured = configured || peer->node == member.node();
      if (configured) continue;
      known_[member.node()] = member.listen();
    }
    if (!replicas_) continue;
    std::vector<fleet::ReplicaEntry> entries;
    for (const auto& m : member.models()) {
      if (!m.model().empty()) {
        entries.push_back({m.model(), m.latest_version(), m.rollback_version(), m.rolled_back()});
      }
    }
    // Merged: another origin's answer may name other models of the same node.
    (void)replicas_->Merge(member.node(), member.relay(), std::move(entries), member.site());
  }
}

void PeerManager::RunPulls() {
  while (true) {
    PullJob job;
    {
      common::UniqueLock lock(mu_);
      wake_.Wait(lock,
                 [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return stop_ || !jobs_.empty(); });
      if (stop_) return;
      job = std::move(jobs_.front());
      jobs_.pop_front();
    }
    const auto start = std::chrono::steady_clock::now();
    {
      common::MutexLock lock(mu_);
      current_ = Transfer{job.model, job.version, job.Bytes(), 0};
      pulling_ = true;
      received_at_start_ = metrics_->Get(kDataBytesReceived);
    }
    pull::PullOutcome outcome = puller_->Pull(job);
    {
      common::MutexLock lock(mu_);
      current_.reset();  // before the store shows the version: no stale progress after it
      pulling_ = false;
    }
    store_->FinishPull(job, outcome.status, std::move(outcome.staging));
    const absl::Status& status = outcome.status;
    metrics_->Observe(
        kTransferSeconds,
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    if (status.ok()) {
      Logger("peer")->info(
          "model={} version={} pulled {} bytes in {:.3f} s", job.model, job.version, job.Bytes(),
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  }
}

}  // namespace refit::peer

namespace refit::peer {

void PeerManager::OnHoldChanged(const std::string& /*model*/, uint64_t /*version*/) {
  reporter_.Notify();
}

absl::Status PeerManager::ForwardHold(const std::string& model, uint64_t version,
                                      const std::vector<std::string>& nodes) {
  for (const std::string& node : nodes) {
    std::shared_ptr<v1::Peer::Stub> stub;
    {
      common::MutexLock lock(mu_);
      for (const auto& peer : peers_) {
        if (peer->node == node && peer->connected && peer->stub) stub = peer->stub;
      }
    }
    const char* what = version == 0 ? "resume" : "rollback";
    if (!stub) {
      return absl::UnavailableError(
          absl::StrCat("model ", model, ": node ", node,
                       " (it has SOURCE buffers of the model) is not connected: the ", what,
                       " cannot reach the fleet through it; try again once it is"));
    }
    grpc::ClientContext context;
    context.set_deadline(In(milliseconds(5000)));
    v1::HoldRequest request;
    request.set_model(model);
    request.set_version(version);
    request.set_node(node_);
    v1::HoldResponse response;
    grpc::Status status = stub->Hold(&context, request, &response);
    if (!status.ok()) {
      return absl::Status(static_cast<absl::StatusCode>(status.error_code()),
                          absl::StrCat("node ", node, ": ", status.error_message()));
    }
    Logger("peer")->info("model={} {} to version {} told to node {}", model, what, version, node);
  }
  return absl::OkStatus();
}

}  // namespace refit::peer
