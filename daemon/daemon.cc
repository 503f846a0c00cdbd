#include "daemon/daemon.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <random>
#include <set>

#include "absl/strings/str_cat.h"
#include "cuda/cuda.h"
#include "daemon/bucket/bucket_sync.h"
#include "daemon/callers/call_budget.h"
#include "daemon/callers/local_listener.h"
#include "daemon/common/liveness.h"
#include "daemon/common/logging.h"
#include "daemon/dataplane/data_plane.h"
#include "daemon/fleet/relay_board.h"
#include "daemon/fleet/replicas.h"
#include "daemon/metrics/metrics.h"
#include "daemon/metrics/prometheus.h"
#include "daemon/peer/delta_source.h"
#include "daemon/peer/peer_manager.h"
#include "daemon/peer/peer_service.h"
#include "daemon/pull/delta_fetch.h"
#include "daemon/rl/labels.h"
#include "daemon/rl/staleness.h"
#include "daemon/rl/store_events.h"
#include "daemon/rl/timeline.h"
#include "daemon/rl/timeline_service.h"
#include "daemon/server/denied_service.h"
#include "daemon/server/health_service.h"
#include "daemon/server/owner_exit.h"
#include "daemon/server/refit_service.h"
#include "daemon/state/labels_file.h"
#include "daemon/state/version_ledger.h"
#include "daemon/store/store.h"
#include "daemon/tls/peer_tls.h"
#include "daemon/transport/ucx/ucx_binding.h"
#include "daemon/transport/ucx/ucx_transport.h"
#include "daemon/version.h"
#include "daemon/wiring.h"
#include "grpcpp/grpcpp.h"

namespace refit {
namespace {

// Ceilings on what gRPC may spend serving peers: memory counts gRPC's own buffers (requests up
// to 64 MiB are allowed); threads count the synchronous server's workers. Local callers' servers
// each get a quota of their own (daemon/callers/local_listener.h).
constexpr int kPeerMaxThreads = 512;
constexpr size_t kPeerMaxMemory = 1ull << 30;

// Threads a local server keeps beyond the long-lived calls its callers may hold: its poller and
// workers for the short calls.
constexpr int kProcessSpareThreads = 8;
constexpr int kUidSpareThreads = 32;

// Watch streams open at once on --health-listen (probes).
constexpr int kHealthWatches = 32;

// How long a worker may stay busy without progress before it counts as stuck (health).
constexpr std::chrono::milliseconds kStallBound{15000};

const grpc::ResourceQuota& PeerQuota() {
  static const grpc::ResourceQuota* quota = [] {
    auto* q = new grpc::ResourceQuota("refit-peer");
    q->SetMaxThreads(kPeerMaxThreads);
    q->Resize(kPeerMaxMemory);
    return q;
  }();
  return *quota;
}

constexpr int kMaxMessageBytes = 64 << 20;  // registrations of models with many tensors

// True when something accepts connections on the Unix socket at `path`.
bool SocketIsServed(const std::string& path) {
  int fd = socket(AF_UNIX, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strncpy(addr.sun_path, path.c_str(), sizeof(addr.sun_path) - 1);
  bool served = connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return served;
}

absl::Status PrepareSocketPath(const std::string& path) {
  if (path.empty()) return absl::InvalidArgumentError("--socket is empty");
  if (path.size() >= sizeof(sockaddr_un{}.sun_path)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--socket path is too long for a Unix socket: ", path));
  }
  std::error_code ec;
  const auto parent = std::filesystem::path(path).parent_path();
  if (!parent.empty()) {
    std::filesystem::create_directories(parent, ec);
    if (ec) {
      return absl::FailedPreconditionError(
          absl::StrCat("cannot create ", parent.string(), ": ", ec.message()));
    }
  }
  struct stat st;
  if (lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::FailedPreconditionError(
          absl::StrCat(path, " exists and is not a socket; refusing to replace it"));
    }
    if (SocketIsServed(path)) {
      return absl::FailedPreconditionError(absl::StrCat("another refitd already serves ", path));
    }
    unlink(path.c_str());  // stale socket of a daemon that died
  }
  return absl::OkStatus();
}

// A random id for this process, told to peers in Hello and as the run of its versions.
std::string NewInstanceId() {
  std::random_device random;
  std::mt19937_64 rng((uint64_t{random()} << 32) ^ random());
  return absl::StrCat(absl::Hex(rng(), absl::kZeroPad16));
}

}  // namespace

struct Daemon::Impl {
  DaemonOptions options;
  Metrics metrics;
  Liveness liveness;  // the workers the watchdog looks at (StuckWorkers)
  // --state-dir's labels/ (daemon/state): outlives `labels`, which saves into it.
  std::unique_ptr<state::LabelsFile> labels_file;
  // Each version's stages and labels here (daemon/rl): outlive the store, which feeds them.
  rl::Timeline timeline;
  rl::VersionLabels labels;
  rl::TimelineEvents timeline_events{&timeline};
  std::unique_ptr<Store> store;
  std::unique_ptr<LivenessProbe> store_probe;  // the store, for the watchdog (stopped first)
  std::unique_ptr<state::VersionLedger> ledger;
  std::unique_ptr<HoldKeeper> hold_keeper;  // rollback holds into the ledger (--state-dir)
  std::string instance;                     // NewInstanceId()
  std::string listen;                       // --listen's host with the port bound
  // What this node serves to other pullers (slots from the store's pool: it goes first), and
  // which nodes hold which versions.
  fleet::RelayBoard relay_board;
  fleet::ReplicaTable replicas;
  std::unique_ptr<rl::Staleness> staleness;  // reads `replicas`
  std::unique_ptr<rl::TimelineService> timeline_service;
  std::unique_ptr<server::RefitService> service;
  // Destroyed in reverse order: the peer loops first (they use the data plane), then the data
  // plane (it serves other nodes' reads of slots and deltas), then what owns that memory.
  std::unique_ptr<peer::DeltaSource> deltas;
  std::unique_ptr<bucket::BucketExport> bucket_export;
  std::unique_ptr<bucket::BucketImport> bucket_import;
  std::unique_ptr<peer::PeerService> peer_service;
  std::unique_ptr<dataplane::DataPlane> data_plane;
  std::unique_ptr<peer::PeerManager> peers;
  std::unique_ptr<server::HealthService> health;
  // --health-listen: health checks only, with a quota and a bound on Watch streams of its own.
  std::unique_ptr<grpc::ResourceQuota> health_quota;
  std::unique_ptr<callers::CallBudget> health_calls;
  std::unique_ptr<server::LocalHealthService> health_port_service;
  std::unique_ptr<grpc::Server> health_server;
  std::unique_ptr<MetricsHttpServer> metrics_server;
  int health_port = 0;
  std::unique_ptr<server::OwnerExit> owner_exit;           // hears of client processes that exit
  std::unique_ptr<server::Leases> leases;                  // for those it can't watch
  std::unique_ptr<callers::CallBudget> calls;              // local callers' long-lived calls
  std::unique_ptr<callers::LocalListener> local_listener;  // --socket
  tls::PeerTlsFiles tls;                   // --tls-*: the peer plane's mutual TLS (none: plaintext)
  server::ServiceContext service_context;  // what each local caller's RefitService starts from
  std::unique_ptr<grpc::Server> peer_server;
  int listen_port = 0;
  common::Mutex shutdown_mu;
  bool shut_down = false;

  EventWiring Wiring() {
    return {store.get(), deltas.get(), peer_service.get(), peers.get(), bucket_export.get()};
  }

  // The worker threads call into the peer service and the store: stop them before any member
  // goes (this also covers a Start that fails half-way).
  ~Impl() {
    if (store_probe) store_probe->Stop();
    if (bucket_import) bucket_import->Stop();
    if (deltas) deltas->Stop();
    if (bucket_export) bucket_export->Stop();
  }
};

Daemon::Daemon(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Daemon::~Daemon() { Shutdown(); }

absl::StatusOr<std::unique_ptr<Daemon>> Daemon::Start(const DaemonOptions& options) {
  if (options.retain < 1) return absl::InvalidArgumentError("--retain must be >= 1");
  if (options.node.empty()) return absl::InvalidArgumentError("--node is empty");
  if (absl::Status exposed = tls::CheckPeerPlaneExposure(
          options.listen, tls::PeerTlsFiles{options.tls_cert, options.tls_key, options.tls_ca},
          options.allow_plaintext_peers);
      !exposed.ok()) {
    return exposed;
  }
  auto status = PrepareSocketPath(options.socket_path);
  if (!status.ok()) return status;

  StoreOptions store_options;
  store_options.retain = options.retain;
  store_options.node = options.node;
  store_options.max_slot_bytes = options.max_slot_memory;
  store_options.max_gpu_slot_bytes = options.max_gpu_slot_memory;
  store_options.journal_dir = options.state_dir;  // Apply's undo journal outlives a kill
  if (absl::Status parsed = ParseDeltaBase(options.delta_base, &store_options.delta_base,
                                           &store_options.delta_base_models);
      !parsed.ok()) {
    return parsed;
  }
  if (options.slot_memory == "cuda") {
    if (options.slot_device < 0 || options.slot_device >= cuda::DeviceCount()) {
      return absl::FailedPreconditionError(absl::StrCat("--slot-memory=cuda needs CUDA device ",
                                                        options.slot_device, "; this refitd has ",
                                                        cuda::Describe()));
    }
    store_options.slot_memory = MemoryKind::kCuda;
    store_options.slot_device = options.slot_device;
  } else if (options.slot_memory != "host") {
    return absl::InvalidArgumentError("--slot-memory must be host or cuda");
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->instance = NewInstanceId();
  {
    auto ledger = state::VersionLedger::Open(options.state_dir);
    if (!ledger.ok()) return ledger.status();
    impl->ledger = std::move(ledger).value();
  }
  if (!options.state_dir.empty()) {
    // The trainer's labels of each model's newest versions, as they were before a restart.
    auto labels_file = state::LabelsFile::Open(options.state_dir);
    if (!labels_file.ok()) return labels_file.status();
    impl->labels_file = std::move(labels_file).value();
    state::LabelsFile::Loaded loaded = impl->labels_file->Load();
    for (const std::string& skipped : loaded.skipped) {
      Logger("daemon")->warn("--state-dir: labels left out: {}", skipped);
    }
    for (auto& [model, versions] : loaded.models) {
      impl->labels.Restore(model, std::move(versions));
    }
    impl->labels.set_store(impl->labels_file.get());
  }
  // The data plane binds where --listen does (and in --data-ports), unless UCX's own
  // environment says otherwise.
  transport::UcxTransport::Options ucx_options;
  {
    auto binding = transport::UcxBindingConfig(options.listen, options.data_ports);
    if (!binding.ok()) return binding.status();
    for (const transport::UcxSetting& setting : *binding) {
      if (std::getenv(setting.env.c_str()) != nullptr) {
        Logger("transport")->info("{} is set: the data plane follows it", setting.env);
        continue;
      }
      Logger("transport")->info("data plane bound by {}={}", setting.env, setting.value);
      ucx_options.config.emplace_back(setting.name, setting.value);
    }
    if (binding->empty()) {
      Logger("transport")
          ->warn(
              "--listen={} names no single interface: UCX's tcp data plane listens on every "
              "interface",
              options.listen);
    }
  }
  // Checked reads unless the operator opts into UCX RMA on an RDMA fabric (REFIT_UCX_RMA=1 with
  // UCX_TLS naming rc/dc transports only; docs/security.md).
  if (const char* rma = std::getenv("REFIT_UCX_RMA"); rma != nullptr && std::string(rma) == "1") {
    ucx_options.rma = true;
  }
  // The data plane: UCX chooses the transport (UCX_TLS); without UCX this node can still serve
  // local clients, and pulls from it fail UNAVAILABLE.
  std::unique_ptr<transport::Transport> ucx;
  if (auto created = transport::UcxTransport::Create(ucx_options); created.ok()) {
    Logger("transport")->info("data plane: {}", (*created)->capabilities().detail);
    ucx = std::move(created).value();
  } else {
    Logger("transport")->error("no data plane: {}", created.status().ToString());
  }
  impl->data_plane = std::make_unique<dataplane::DataPlane>(
      std::move(ucx),
      dataplane::DataPlaneOptions{options.chunk_bytes, static_cast<int>(options.inflight),
                                  impl->liveness.Register("data plane")},
      &impl->metrics);
  // Host slots: pinned where a GPU copies into them; otherwise the transport's own memory, which
  // a peer daemon on this host maps and copies with memcpy (UCX shared memory).
  if (cuda::DeviceCount() == 0) {
    // The store outlives the data plane (Impl's member order), but nothing allocates a slot
    // once the data plane is gone: the servers are stopped and the peer loops, which pull into
    // staging slots, go before it.
    dataplane::DataPlane* data_plane = impl->data_plane.get();
    store_options.host_slot_allocator = [data_plane](uint64_t size) {
      return data_plane->AllocateSlot(size);
    };
  }
  impl->store = std::make_unique<Store>(store_options, &impl->metrics);
  {
    // The store has no thread: a probe takes its lock twice a second, so a caller wedged while
    // holding it shows as "store" in StuckWorkers (and stops the watchdog's pings).
    Store* store = impl->store.get();
    impl->store_probe = std::make_unique<LivenessProbe>(
        impl->liveness.Register("store"), [store] { store->Probe(); },
        std::chrono::milliseconds(500));
  }
  {
    Impl* raw = impl.get();
    peer::DeltaSourceOptions delta_options;
    delta_options.threshold = options.delta_threshold;
    delta_options.chain = options.delta_chain;
    // Called from DeltaSource's thread, which starts here and is stopped before the peer
    // service and the exporter go (~Impl).
    impl->deltas =
        std::make_unique<peer::DeltaSource>(impl->store.get(), delta_options, &impl->metrics,
                                            [raw] { OnDeltasPrepared(raw->Wiring()); });
  }
  if (!options.bucket_export.empty()) {
    impl->bucket_export = std::make_unique<bucket::BucketExport>(
        options.bucket_export, options.bucket_full_every, options.retain, impl->store.get(),
        impl->deltas.get(), &impl->metrics);
  }
  if (!options.bucket_import.empty()) {
    auto import =
        bucket::BucketImport::Start(options.bucket_import, impl->store.get(), &impl->metrics);
    if (!import.ok()) return import.status();
    impl->bucket_import = std::move(import).value();
  }
  impl->tls = tls::PeerTlsFiles{options.tls_cert, options.tls_key, options.tls_ca};
  if (impl->tls.enabled()) {
    if (absl::Status files = tls::CheckFiles(impl->tls); !files.ok()) return files;
    if (absl::Status own = tls::CheckOwnCertificate(impl->tls); !own.ok()) return own;
    if (absl::Status named = tls::CheckCertificateNames(impl->tls, options.node); !named.ok()) {
      // Its local clients are served all the same (one node needs no peers).
      Logger("daemon")->error("{}", std::string(named.message()));
    }
    Logger("daemon")->info("peer plane: mutual TLS (certificate {}, key {}, CA {})",
                           options.tls_cert, options.tls_key, options.tls_ca);
  } else if (tls::IsLoopbackHost(options.listen.substr(0, options.listen.rfind(':')))) {
    Logger("daemon")->info("peer plane: plaintext on --listen={}, reachable from this host only",
                           options.listen);
  } else {
    Logger("daemon")->warn(
        "the peer plane is unauthenticated (--allow-plaintext-peers): any host that reaches "
        "--listen={} can read every weight held here and announce versions (give --tls-cert, "
        "--tls-key and --tls-ca)",
        options.listen);
  }
  impl->peer_service = std::make_unique<peer::PeerService>(
      options.node, impl->store.get(), impl->data_plane.get(), impl->deltas.get(), &impl->metrics,
      &impl->relay_board, &impl->replicas, options.relay, impl->tls.enabled());
  {
    Store* store = impl->store.get();
    impl->staleness = std::make_unique<rl::Staleness>(
        options.node, &impl->replicas, &impl->metrics, std::chrono::milliseconds(100),
        [store](const std::string& model) { return store->LatestVersion(model); });
  }
  const rl::Parts rl_parts{&impl->timeline, &impl->labels, impl->staleness.get()};
  impl->peer_service->SetRl(rl_parts);
  peer::PeerManagerOptions peer_options;
  peer_options.node = options.node;
  peer_options.instance = impl->instance;
  peer_options.delta_threshold = options.delta_threshold;
  peer_options.relay = options.relay;
  peer_options.tls = impl->tls;
  peer_options.max_peer_connections = options.max_peer_connections;
  peer_options.site = options.site;
  peer_options.rl = rl_parts;
  impl->peers = std::make_unique<peer::PeerManager>(peer_options, options.peers, impl->store.get(),
                                                    impl->data_plane.get(), &impl->metrics,
                                                    &impl->relay_board, &impl->replicas);
  // Who hears the store's events: daemon/wiring.cc; and the timeline.
  ConnectStoreEvents(impl->Wiring());
  impl->store->AddListener(&impl->timeline_events);
  // A rollback outlives a restart: the holds --state-dir kept, then every change to them.
  impl->store->SeedHolds(impl->ledger->Holds());
  impl->hold_keeper = std::make_unique<HoldKeeper>(impl->ledger.get());
  impl->store->AddListener(impl->hold_keeper.get());

  Impl* raw = impl.get();
  server::ServiceContext context;
  context.node = options.node;
  context.store = impl->store.get();
  context.metrics = &impl->metrics;
  context.replicas = &impl->replicas;
  context.ledger = impl->ledger.get();
  context.rl = rl_parts;
  // The addresses of the daemons this one knows: where a timeline is gathered from.
  auto neighbors = [raw] {
    std::vector<std::string> out;
    for (const auto& p : raw->peers->Peers()) {
      if (p.connected) out.push_back(p.address);
    }
    for (const auto& s : raw->peer_service->Subscribers()) {
      if (s.connected) out.push_back(s.address);
    }
    return out;
  };
  context.gather_timeline = [raw, neighbors](const std::string& model, uint64_t version) {
    return rl::GatherTimelines(rl::GatherOptions{raw->options.node, raw->tls}, model, version,
                               neighbors());
  };
  impl->timeline_service =
      std::make_unique<rl::TimelineService>(options.node, &impl->timeline, neighbors);
  context.peers = [raw] {
    std::vector<server::PeerInfo> out;
    for (const auto& p : raw->peers->Peers()) {
      out.push_back({p.node, p.address, p.connected, p.error});
    }
    return out;
  };
  context.forward_hold = [raw](const std::string& model, uint64_t version,
                               const std::vector<std::string>& nodes) {
    return raw->peers->ForwardHold(model, version, nodes);
  };
  context.pulled_by = [raw] {
    std::vector<server::PeerInfo> out;
    for (const auto& s : raw->peer_service->Subscribers()) {
      out.push_back({s.node, s.address, s.connected, s.error});
    }
    return out;
  };
  context.add_runtime = [raw](v1::StatusResponse* response) {
    response->set_listen(raw->listen);
    response->set_listen_port(raw->listen_port);
    response->set_health_port(raw->health_port);
    response->set_metrics_port(raw->metrics_server ? raw->metrics_server->port() : 0);
    for (const auto& t : raw->peers->Transfers()) {
      v1::TransferStatus* ts = response->add_transfers();
      ts->set_model(t.model);
      ts->set_version(t.version);
      ts->set_bytes_total(t.bytes_total);
      ts->set_bytes_done(t.bytes_done);
    }
  };
  impl->service_context = context;
  impl->service = std::make_unique<server::RefitService>(std::move(context));

  {
    const auto colon = options.listen.rfind(':');
    impl->listen = options.listen.substr(0, colon == std::string::npos ? 0 : colon) + ":?";
    impl->peer_service->SetIdentity(impl->instance, impl->listen);
    impl->peer_service->SetSite(options.site);
    impl->peer_service->SetMaxRelayReaders(options.max_peer_connections);
  }
  impl->health = std::make_unique<server::HealthService>(
      std::set<std::string>{"refit.v1.Refit", "refit.v1.Peer"});
  // A sticky CUDA error poisons every later CUDA call of this process: only a restart helps.
  impl->health->SetFaultCheck(cuda::StickyError);
  // A worker busy without progress (a wedged data plane) makes health NOT_SERVING while it
  // lasts; main.cc stops pinging systemd's watchdog then.
  {
    Liveness* liveness = &impl->liveness;
    // Under systemd's watchdog, the bound main.cc uses: half its interval, at least 2 s.
    std::chrono::milliseconds stall = kStallBound;
    if (const char* usec = std::getenv("WATCHDOG_USEC"); usec && std::atoll(usec) > 0) {
      stall = std::max<std::chrono::milliseconds>(
          std::chrono::milliseconds(std::atoll(usec) / 2000), std::chrono::seconds(2));
    }
    impl->health->SetStallCheck([liveness, stall] { return liveness->Stuck(stall); });
  }

  grpc::EnableDefaultHealthCheckService(false);
  {
    grpc::ServerBuilder builder;
    builder.AddListeningPort(options.listen, tls::ServerCredentials(impl->tls), &impl->listen_port);
    // Peers ping every second (keepalive, PeerManager) to notice a dead node within ~3 s; by
    // default gRPC's server would answer that with GOAWAY "too_many_pings", closing the channel
    // under a pull's last calls (its pin release, which carries the byte count, got lost).
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 500);
    builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
    builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
    // Bounded peers: gRPC's threads and buffers for the peer port have a ceiling of their own
    // (past it, calls are refused with RESOURCE_EXHAUSTED, not served by a starving daemon).
    builder.SetResourceQuota(PeerQuota());
    builder.RegisterService(impl->peer_service.get());
    builder.RegisterService(impl->timeline_service.get());
    builder.RegisterService(impl->health.get());
    impl->peer_server = builder.BuildAndStart();
    if (!impl->peer_server || impl->listen_port == 0) {
      return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen));
    }
  }
  {
    const auto colon = options.listen.rfind(':');
    impl->listen = absl::StrCat(options.listen.substr(0, colon == std::string::npos ? 0 : colon),
                                ":", impl->listen_port);
    impl->peer_service->SetIdentity(impl->instance, impl->listen);
    impl->peers->SetListenAddress(impl->listen);
  }
  {
    // Local callers: each connection is served by the RefitService of its uid, or refused.
    callers::Policy policy;
    policy.daemon_uid = geteuid();
    policy.allow_uids.assign(options.allow_uids.begin(), options.allow_uids.end());
    if (options.allow_gids.empty()) {
      policy.allow_gids = {getegid()};  // the socket's group: it is created with refitd's
    } else {
      policy.allow_gids.assign(options.allow_gids.begin(), options.allow_gids.end());
    }
    auto owners = std::make_shared<server::Owners>();
    server::HealthService* health = impl->health.get();
    const std::string refused =
        absl::StrCat("this local caller is not allowed to use refitd on node ", options.node,
                     " (allowed: ", policy.Describe(), "; see --allow-uids and --allow-gids)");
    // Sealed memfds passed over the same socket (fd_exchange.h), named by token.
    auto memfds = std::make_shared<callers::FdTokens>();
    callers::ExchangeLimits exchange_limits;
    exchange_limits.max_waiting_per_uid = options.max_unspoken_connections_per_uid;
    auto fd_exchange = std::make_shared<callers::FdExchange>(policy, memfds, exchange_limits);
    // Long-lived calls (Watch, WaitForVersion, WaitForReplicas, health Watch), bounded.
    callers::CallLimits call_limits;
    call_limits.per_process = options.max_waiting_calls_per_process;
    call_limits.per_uid = options.max_waiting_calls_per_uid;
    call_limits.total = options.max_waiting_calls;
    impl->calls = std::make_unique<callers::CallBudget>(call_limits);
    callers::CallBudget* calls = impl->calls.get();
    auto factory = [raw, owners, memfds, health, refused, calls](const callers::Caller* caller,
                                                                 grpc::ServerBuilder* builder) {
      std::vector<std::shared_ptr<void>> keep;
      if (!caller) {
        // Refused callers get nothing but the refusal, health included (the kubelet's probe
        // is --health-listen); no synchronous method, so this server holds no thread.
        auto denied = std::make_shared<server::DeniedService>(refused);
        builder->RegisterCallbackGenericService(denied.get());
        keep.push_back(denied);
        return keep;
      }
      auto local_health = std::make_shared<server::LocalHealthService>(health, calls, *caller);
      builder->RegisterService(local_health.get());
      keep.push_back(local_health);
      server::ServiceContext context = raw->service_context;
      context.caller = *caller;
      context.owners = owners;
      context.leases = raw->leases.get();
      context.memfds = memfds;
      context.calls = calls;
      auto service = std::make_shared<server::RefitService>(std::move(context));
      builder->RegisterService(service.get());
      keep.push_back(service);
      return keep;
    };
    // A client process that exits takes its buffers with it (owner exit).
    impl->owner_exit =
        std::make_unique<server::OwnerExit>(impl->store.get(), owners, &impl->metrics);
    // ...and one refitd cannot watch (another pid namespace) holds them on a lease.
    impl->leases = std::make_unique<server::Leases>(impl->store.get(), owners, &impl->metrics,
                                                    server::kClientLease);
    callers::ServerLimits server_limits;
    server_limits.process_threads =
        static_cast<int>(options.max_waiting_calls_per_process) + kProcessSpareThreads;
    server_limits.uid_threads =
        static_cast<int>(options.max_waiting_calls_per_uid) + kUidSpareThreads;
    server_limits.max_threads = options.max_local_threads;
    auto local = callers::LocalListener::Start(options.socket_path, 0660, policy, factory,
                                               impl->owner_exit.get(), std::move(fd_exchange),
                                               server_limits);
    if (!local.ok()) {
      impl->peer_server->Shutdown();
      return local.status();
    }
    impl->local_listener = std::move(local).value();
  }
  auto fail = [&](absl::Status status) {
    impl->local_listener->Shutdown();
    impl->peer_server->Shutdown();
    if (impl->health_server) impl->health_server->Shutdown();
    unlink(options.socket_path.c_str());
    return status;
  };
  if (!options.health_listen.empty()) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort(options.health_listen, grpc::InsecureServerCredentials(),
                             &impl->health_port);
    // Probes only: a thread quota of its own, and at most kHealthWatches Watch streams open
    // (RESOURCE_EXHAUSTED past it), so whoever reaches the port can't hold its threads.
    impl->health_quota = std::make_unique<grpc::ResourceQuota>("refit-health");
    impl->health_quota->SetMaxThreads(kHealthWatches + 16);
    builder.SetResourceQuota(*impl->health_quota);
    callers::CallLimits watch_limits;
    watch_limits.per_process = watch_limits.per_uid = watch_limits.total = kHealthWatches;
    impl->health_calls = std::make_unique<callers::CallBudget>(watch_limits);
    callers::Caller anyone;  // the port has no callers to tell apart
    anyone.uid = static_cast<uid_t>(-1);
    impl->health_port_service = std::make_unique<server::LocalHealthService>(
        impl->health.get(), impl->health_calls.get(), anyone);
    builder.RegisterService(impl->health_port_service.get());
    impl->health_server = builder.BuildAndStart();
    if (!impl->health_server || impl->health_port == 0) {
      impl->health_server.reset();
      return fail(absl::UnavailableError(
          absl::StrCat("cannot listen on --health-listen=", options.health_listen)));
    }
  }
  if (!options.metrics_listen.empty()) {
    auto metrics = MetricsHttpServer::Start(options.metrics_listen, &impl->metrics);
    if (!metrics.ok()) return fail(metrics.status());
    impl->metrics_server = std::move(metrics).value();
  }
  impl->health->SetServing(true);
  impl->peers->Start();
  impl->staleness->Start();
  Logger("daemon")->info(
      "refitd {} node={} serving socket={} listen port={} health port={} metrics port={} "
      "retain={} slots={} max slot memory={} state={} {}",
      kRefitVersion, options.node, options.socket_path, impl->listen_port, impl->health_port,
      impl->metrics_server ? impl->metrics_server->port() : 0, options.retain,
      options.slot_memory == "cuda"
          ? absl::StrCat(
                "cuda:", options.slot_device, " (", cuda::DeviceUuid(options.slot_device), ", max ",
                options.max_gpu_slot_memory == 0 ? std::string("unlimited")
                                                 : absl::StrCat(options.max_gpu_slot_memory, " B"),
                ")")
          : std::string("host"),
      options.max_slot_memory == 0 ? std::string("unlimited")
                                   : absl::StrCat(options.max_slot_memory, " B"),
      impl->ledger->path().empty() ? std::string("none (no --state-dir)") : impl->ledger->path(),
      cuda::Describe());
  return std::unique_ptr<Daemon>(new Daemon(std::move(impl)));
}

void Daemon::Shutdown(double grace_seconds) {
  common::MutexLock lock(impl_->shutdown_mu);
  if (impl_->shut_down) return;
  impl_->shut_down = true;
  Logger("daemon")->info("node={} shutting down", impl_->options.node);
  impl_->health->SetServing(false);
  if (impl_->store_probe) impl_->store_probe->Stop();
  impl_->store->Shutdown();    // blocked WaitForVersion/Watch calls return now
  impl_->replicas.Shutdown();  // and WaitForReplicas
  impl_->staleness->Stop();
  impl_->peers->Stop();
  if (impl_->bucket_import) impl_->bucket_import->Stop();
  impl_->deltas->Stop();
  if (impl_->bucket_export) impl_->bucket_export->Stop();
  impl_->peer_service->Stop();
  const auto deadline = std::chrono::system_clock::now() +
                        std::chrono::milliseconds(static_cast<int64_t>(grace_seconds * 1000));
  // Each step's time in the debug log: a drain that takes the whole grace period says which
  // server still had a call open (tests/faults_sigterm_test).
  const auto began = std::chrono::steady_clock::now();
  auto since = [&began] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  };
  impl_->local_listener->Shutdown(
      std::chrono::milliseconds(static_cast<int64_t>(grace_seconds * 1000)));
  Logger("daemon")->debug("shutdown: local servers stopped after {:.3f} s", since());
  impl_->peer_server->Shutdown(deadline);
  Logger("daemon")->debug("shutdown: peer server stopped after {:.3f} s", since());
  if (impl_->health_server) impl_->health_server->Shutdown(deadline);
  impl_->peer_server->Wait();
  Logger("daemon")->debug("shutdown: servers done after {:.3f} s", since());
  impl_->metrics_server.reset();
  unlink(impl_->options.socket_path.c_str());
  Logger("daemon")->info("node={} stopped", impl_->options.node);
}

std::vector<std::string> Daemon::StuckWorkers(std::chrono::milliseconds stall) {
  std::vector<std::string> stuck = impl_->liveness.Stuck(stall);
  // The local gRPC server: a health check through the socket, as a client makes it.
  auto channel =
      grpc::CreateChannel("unix:" + impl_->options.socket_path, grpc::InsecureChannelCredentials());
  auto stub = grpc::health::v1::Health::NewStub(channel);
  grpc::ClientContext context;
  const auto bound = std::min<std::chrono::milliseconds>(stall, std::chrono::seconds(5));
  context.set_deadline(std::chrono::system_clock::now() + bound);
  grpc::health::v1::HealthCheckRequest request;
  grpc::health::v1::HealthCheckResponse response;
  const grpc::Status answered = stub->Check(&context, request, &response);
  if (!answered.ok()) {
    stuck.push_back(absl::StrCat("local gRPC server (no health answer on ",
                                 impl_->options.socket_path, " within ", bound.count(),
                                 " ms: ", answered.error_message(), ")"));
  }
  return stuck;
}

int Daemon::listen_port() const { return impl_->listen_port; }

int Daemon::metrics_port() const {
  return impl_->metrics_server ? impl_->metrics_server->port() : 0;
}

int Daemon::health_port() const { return impl_->health_port; }

const std::string& Daemon::node() const { return impl_->options.node; }

}  // namespace refit
