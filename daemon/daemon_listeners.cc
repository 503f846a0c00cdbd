// Daemon::Impl's listeners, bound by Daemon::Start (daemon.cc) last, in this order: the peer
// port (--listen), the local socket (--socket), then the probes' ports (--health-listen,
// --metrics-listen); and the checks made before anything is made (the socket path).

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>

#include "absl/strings/str_cat.h"
#include "cuda/cuda.h"
#include "daemon/common/logging.h"
#include "daemon/daemon_impl.h"
#include "daemon/server/denied_service.h"
#include "daemon/version.h"

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

const grpc::ResourceQuota& PeerQuota() {
  static const grpc::ResourceQuota* quota = [] {
    auto* q = new grpc::ResourceQuota("refit-peer");
    q->SetMaxThreads(kPeerMaxThreads);
    q->Resize(kPeerMaxMemory);
    return q;
  }();
  return *quota;
}

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

// Who may use the local socket: --allow-uids, --allow-gids (default: refitd's own group).
callers::Policy LocalPolicy(const DaemonOptions& options) {
  callers::Policy policy;
  policy.daemon_uid = geteuid();
  policy.allow_uids.assign(options.allow_uids.begin(), options.allow_uids.end());
  if (options.allow_gids.empty()) {
    policy.allow_gids = {getegid()};  // the socket's group: it is created with refitd's
  } else {
    policy.allow_gids.assign(options.allow_gids.begin(), options.allow_gids.end());
  }
  return policy;
}

}  // namespace

absl::Status CheckDaemonOptions(const DaemonOptions& options) {
  if (options.retain < 1) return absl::InvalidArgumentError("--retain must be >= 1");
  if (options.node.empty()) return absl::InvalidArgumentError("--node is empty");
  if (absl::Status exposed = tls::CheckPeerPlaneExposure(
          options.listen, tls::PeerTlsFiles{options.tls_cert, options.tls_key, options.tls_ca},
          options.allow_plaintext_peers);
      !exposed.ok()) {
    return exposed;
  }
  return PrepareSocketPath(options.socket_path);
}

absl::Status Daemon::Impl::ListenPeers() {
  grpc::EnableDefaultHealthCheckService(false);
  grpc::ServerBuilder builder;
  builder.AddListeningPort(options.listen, tls::ServerCredentials(tls), &listen_port);
  // gRPC sets SO_REUSEPORT by default: a second daemon on this port would then share its
  // connections (and a port-0 bind may even be handed a port another refitd of this uid holds,
  // which split one fleet's peers between two daemons in CI). One port, one daemon.
  builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);
  // Peers ping every second (keepalive, PeerManager) to notice a dead node within ~3 s; by
  // default gRPC's server would answer that with GOAWAY "too_many_pings", closing the channel
  // under a pull's last calls (its pin release, which carries the byte count, got lost).
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MIN_RECV_PING_INTERVAL_WITHOUT_DATA_MS, 500);
  builder.AddChannelArgument(GRPC_ARG_HTTP2_MAX_PING_STRIKES, 0);
  builder.AddChannelArgument(GRPC_ARG_KEEPALIVE_PERMIT_WITHOUT_CALLS, 1);
  // Bounded peers: gRPC's threads and buffers for the peer port have a ceiling of their own
  // (past it, calls are refused with RESOURCE_EXHAUSTED, not served by a starving daemon).
  builder.SetResourceQuota(PeerQuota());
  builder.RegisterService(peer_service.get());
  builder.RegisterService(timeline_service.get());
  builder.RegisterService(health.get());
  peer_server = builder.BuildAndStart();
  if (!peer_server || listen_port == 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ", options.listen));
  }
  const auto colon = options.listen.rfind(':');
  listen = absl::StrCat(options.listen.substr(0, colon == std::string::npos ? 0 : colon), ":",
                        listen_port);
  peer_service->SetIdentity(instance, listen);
  peers->SetListenAddress(listen);
  return absl::OkStatus();
}

absl::Status Daemon::Impl::ListenLocal() {
  // Local callers: each connection is served by the RefitService of its uid, or refused.
  const callers::Policy policy = LocalPolicy(options);
  auto owners = std::make_shared<server::Owners>();
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
  calls = std::make_unique<callers::CallBudget>(call_limits);
  // A client process that exits takes its buffers with it (owner exit)...
  owner_exit = std::make_unique<server::OwnerExit>(store.get(), owners, &metrics);
  // ...and one refitd cannot watch (another pid namespace) holds them on a lease.
  leases = std::make_unique<server::Leases>(store.get(), owners, &metrics, server::kClientLease);
  callers::ServerLimits server_limits;
  server_limits.process_threads =
      static_cast<int>(options.max_waiting_calls_per_process) + kProcessSpareThreads;
  server_limits.uid_threads =
      static_cast<int>(options.max_waiting_calls_per_uid) + kUidSpareThreads;
  server_limits.max_threads = options.max_local_threads;
  auto local = callers::LocalListener::Start(
      options.socket_path, 0660, policy, LocalServices(this, owners, memfds, refused),
      owner_exit.get(), std::move(fd_exchange), server_limits);
  if (!local.ok()) {
    peer_server->Shutdown();
    return local.status();
  }
  local_listener = std::move(local).value();
  return absl::OkStatus();
}

std::vector<std::shared_ptr<void>> Daemon::Impl::LocalServices::operator()(
    const callers::Caller* caller, grpc::ServerBuilder* builder) const {
  std::vector<std::shared_ptr<void>> keep;
  if (!caller) {
    // Refused callers get nothing but the refusal, health included (the kubelet's probe is
    // --health-listen); no synchronous method, so this server holds no thread.
    auto denied = std::make_shared<server::DeniedService>(refused_);
    builder->RegisterCallbackGenericService(denied.get());
    keep.push_back(denied);
    return keep;
  }
  auto local_health = std::make_shared<server::LocalHealthService>(impl_->health.get(),
                                                                   impl_->calls.get(), *caller);
  builder->RegisterService(local_health.get());
  keep.push_back(local_health);
  server::ServiceContext context = impl_->service_context;
  context.caller = *caller;
  context.owners = owners_;
  context.leases = impl_->leases.get();
  context.memfds = memfds_;
  context.calls = impl_->calls.get();
  auto service = std::make_shared<server::RefitService>(std::move(context));
  builder->RegisterService(service.get());
  keep.push_back(service);
  return keep;
}

absl::Status Daemon::Impl::ListenProbes() {
  if (!options.health_listen.empty()) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort(options.health_listen, grpc::InsecureServerCredentials(),
                             &health_port);
    builder.AddChannelArgument(GRPC_ARG_ALLOW_REUSEPORT, 0);  // one port, one daemon
    // Probes only: a thread quota of its own, and at most kHealthWatches Watch streams open
    // (RESOURCE_EXHAUSTED past it), so whoever reaches the port can't hold its threads.
    health_quota = std::make_unique<grpc::ResourceQuota>("refit-health");
    health_quota->SetMaxThreads(kHealthWatches + 16);
    builder.SetResourceQuota(*health_quota);
    callers::CallLimits watch_limits;
    watch_limits.per_process = watch_limits.per_uid = watch_limits.total = kHealthWatches;
    health_calls = std::make_unique<callers::CallBudget>(watch_limits);
    callers::Caller anyone;  // the port has no callers to tell apart
    anyone.uid = static_cast<uid_t>(-1);
    health_port_service =
        std::make_unique<server::LocalHealthService>(health.get(), health_calls.get(), anyone);
    builder.RegisterService(health_port_service.get());
    health_server = builder.BuildAndStart();
    if (!health_server || health_port == 0) {
      health_server.reset();
      return absl::UnavailableError(
          absl::StrCat("cannot listen on --health-listen=", options.health_listen));
    }
  }
  if (!options.metrics_listen.empty()) {
    auto started = MetricsHttpServer::Start(options.metrics_listen, &metrics);
    if (!started.ok()) return started.status();
    metrics_server = std::move(started).value();
  }
  return absl::OkStatus();
}

void Daemon::Impl::StopListening() {
  local_listener->Shutdown();
  peer_server->Shutdown();
  if (health_server) health_server->Shutdown();
  unlink(options.socket_path.c_str());
}

void Daemon::Impl::StartServing() {
  health->SetServing(true);
  peers->Start();
  staleness->Start();
}

void Daemon::Impl::LogStarted() const {
  Logger("daemon")->info(
      "refitd {} node={} serving socket={} listen port={} health port={} metrics port={} "
      "retain={} slots={} max slot memory={} state={} {}",
      kRefitVersion, options.node, options.socket_path, listen_port, health_port,
      metrics_server ? metrics_server->port() : 0, options.retain,
      options.slot_memory == "cuda"
          ? absl::StrCat(
                "cuda:", options.slot_device, " (", cuda::DeviceUuid(options.slot_device), ", max ",
                options.max_gpu_slot_memory == 0 ? std::string("unlimited")
                                                 : absl::StrCat(options.max_gpu_slot_memory, " B"),
                ")")
          : std::string("host"),
      options.max_slot_memory == 0 ? std::string("unlimited")
                                   : absl::StrCat(options.max_slot_memory, " B"),
      ledger->path().empty() ? std::string("none (no --state-dir)") : ledger->path(),
      cuda::Describe());
}

}  // namespace refit
