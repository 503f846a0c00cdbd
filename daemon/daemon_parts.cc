// Daemon::Impl's parts, made by Daemon::Start (daemon.cc) in this order: the state restored,
// the data plane, the store, the delta and bucket exchange, the peer plane, the store's
// listeners, the local services and health. The listeners are in daemon_listeners.cc; what each
// part is given from refitd's options, in component_options.cc.

#include <cstdlib>
#include <set>

#include "cuda/cuda.h"
#include "daemon/common/logging.h"
#include "daemon/daemon_impl.h"
#include "daemon/transport/ucx/ucx_binding.h"
#include "daemon/transport/ucx/ucx_transport.h"

namespace refit {
namespace {

// How long a worker may stay busy without progress before it counts as stuck (health).
constexpr std::chrono::milliseconds kStallBound{15000};

// The UCX data plane's options: bound where --listen is (and in --data-ports), unless UCX's own
// environment says otherwise; UCX RMA only where the operator opts in.
absl::StatusOr<transport::UcxTransport::Options> UcxOptions(const DaemonOptions& options) {
  transport::UcxTransport::Options ucx_options;
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
  // Checked reads unless the operator opts into UCX RMA on an RDMA fabric (REFIT_UCX_RMA=1 with
  // UCX_TLS naming rc/dc transports only; docs/security.md).
  if (const char* rma = std::getenv("REFIT_UCX_RMA"); rma != nullptr && std::string(rma) == "1") {
    ucx_options.rma = true;
  }
  return ucx_options;
}

std::vector<server::PeerInfo> ToPeerInfo(const std::vector<peer::PeerState>& states) {
  std::vector<server::PeerInfo> out;
  for (const auto& s : states) out.push_back({s.node, s.address, s.connected, s.error});
  return out;
}

}  // namespace

absl::Status Daemon::Impl::RestoreState() {
  auto opened = state::VersionLedger::Open(options.state_dir);
  if (!opened.ok()) return opened.status();
  ledger = std::move(opened).value();
  if (options.state_dir.empty()) return absl::OkStatus();
  // The trainer's labels of each model's newest versions, as they were before a restart.
  auto file = state::LabelsFile::Open(options.state_dir);
  if (!file.ok()) return file.status();
  labels_file = std::move(file).value();
  state::LabelsFile::Loaded loaded = labels_file->Load();
  for (const std::string& skipped : loaded.skipped) {
    Logger("daemon")->warn("--state-dir: labels left out: {}", skipped);
  }
  for (auto& [model, versions] : loaded.models) labels.Restore(model, std::move(versions));
  labels.set_store(labels_file.get());
  return absl::OkStatus();
}

absl::Status Daemon::Impl::MakeDataPlane(StoreOptions* store_options) {
  auto ucx_options = UcxOptions(options);
  if (!ucx_options.ok()) return ucx_options.status();
  // UCX chooses the transport (UCX_TLS); without UCX this node can still serve local clients,
  // and pulls from it fail UNAVAILABLE.
  std::unique_ptr<transport::Transport> ucx;
  if (auto created = transport::UcxTransport::Create(*ucx_options); created.ok()) {
    Logger("transport")->info("data plane: {}", (*created)->capabilities().detail);
    ucx = std::move(created).value();
  } else {
    Logger("transport")->error("no data plane: {}", created.status().ToString());
  }
  dataplane::DataPlaneOptions data_plane_options = DataPlaneOptionsFrom(options);
  data_plane_options.liveness = liveness.Register("data plane");
  data_plane = std::make_unique<dataplane::DataPlane>(std::move(ucx), data_plane_options, &metrics);
  // Host slots: pinned where a GPU copies into them; otherwise the transport's own memory, which
  // a peer daemon on this host maps and copies with memcpy (UCX shared memory). The store
  // outlives the data plane (member order), but nothing allocates a slot once the data plane is
  // gone: the servers are stopped and the peer loops, which pull into staging slots, go first.
  if (cuda::DeviceCount() == 0) {
    store_options->host_slot_allocator = DataPlaneSlots(data_plane.get());
  }
  return absl::OkStatus();
}

void Daemon::Impl::MakeStore(const StoreOptions& store_options) {
  store = std::make_unique<Store>(store_options, &metrics);
  wiring.store = store.get();
  // The store has no thread: a probe takes its lock twice a second, so a caller wedged while
  // holding it shows as "store" in StuckWorkers (and stops the watchdog's pings).
  store_probe = std::make_unique<LivenessProbe>(liveness.Register("store"), StoreProbe(store.get()),
                                                std::chrono::milliseconds(500));
}

absl::Status Daemon::Impl::MakeExchange() {
  // Called from DeltaSource's thread, which starts here and is stopped before the peer service
  // and the exporter go (~Impl).
  deltas = std::make_unique<peer::DeltaSource>(store.get(), DeltaSourceOptionsFrom(options),
                                               &metrics, DeltasPrepared(&wiring));
  wiring.deltas = deltas.get();
  if (!options.bucket_export.empty()) {
    bucket_export = std::make_unique<bucket::BucketExport>(
        options.bucket_export, ExporterOptionsFrom(options), store.get(), deltas.get(), &metrics);
    wiring.bucket_export = bucket_export.get();
  }
  if (!options.bucket_import.empty()) {
    auto import = bucket::BucketImport::Start(options.bucket_import, store.get(), &metrics);
    if (!import.ok()) return import.status();
    bucket_import = std::move(import).value();
  }
  return absl::OkStatus();
}

absl::Status Daemon::Impl::CheckPeerTls() {
  tls = tls::PeerTlsFiles{options.tls_cert, options.tls_key, options.tls_ca};
  if (tls.enabled()) {
    if (absl::Status files = tls::CheckFiles(tls); !files.ok()) return files;
    if (absl::Status own = tls::CheckOwnCertificate(tls); !own.ok()) return own;
    if (absl::Status named = tls::CheckCertificateNames(tls, options.node); !named.ok()) {
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
  return absl::OkStatus();
}

void Daemon::Impl::MakePeerPlane() {
  peer_service = std::make_unique<peer::PeerService>(
      options.node, store.get(), data_plane.get(), deltas.get(), &metrics, &relay_board, &replicas,
      PeerServiceOptionsFrom(options, tls.enabled()));
  wiring.peer_service = peer_service.get();
  staleness = std::make_unique<rl::Staleness>(options.node, &replicas, &metrics,
                                              std::chrono::milliseconds(100),
                                              StoreLatestVersion(store.get()));
  const rl::Parts rl_parts{&timeline, &labels, staleness.get()};
  peer_service->SetRl(rl_parts);
  peer::PeerManagerOptions peer_options = PeerManagerOptionsFrom(options);
  peer_options.instance = instance;
  peer_options.tls = tls;
  peer_options.rl = rl_parts;
  peers = std::make_unique<peer::PeerManager>(peer_options, options.peers, store.get(),
                                              data_plane.get(), &metrics, &relay_board, &replicas);
  wiring.peers = peers.get();
  // Not yet bound: "host:?" until ListenPeers knows the port.
  const auto colon = options.listen.rfind(':');
  listen = options.listen.substr(0, colon == std::string::npos ? 0 : colon) + ":?";
  peer_service->SetIdentity(instance, listen);
  peer_service->SetSite(options.site);
}

void Daemon::Impl::ConnectEvents() {
  // Who hears the store's events: daemon/wiring.cc; and the timeline.
  ConnectStoreEvents(wiring);
  store->AddListener(&timeline_events);
  // A rollback outlives a restart: the holds --state-dir kept, then every change to them.
  store->SeedHolds(ledger->Holds());
  hold_keeper = std::make_unique<HoldKeeper>(ledger.get());
  store->AddListener(hold_keeper.get());
}

void Daemon::Impl::MakeLocalServices() {
  server::ServiceContext context;
  context.node = options.node;
  context.store = store.get();
  context.metrics = &metrics;
  context.replicas = &replicas;
  context.ledger = ledger.get();
  context.rl = rl::Parts{&timeline, &labels, staleness.get()};
  context.node_view = &node_view;
  timeline_service =
      std::make_unique<rl::TimelineService>(options.node, &timeline, Neighbors(this));
  service_context = context;
  service = std::make_unique<server::RefitService>(std::move(context));
}

void Daemon::Impl::MakeHealth() {
  health = std::make_unique<server::HealthService>(
      std::set<std::string>{"refit.v1.Refit", "refit.v1.Peer"});
  // A sticky CUDA error poisons every later CUDA call of this process: only a restart helps.
  health->SetFaultCheck(cuda::StickyError);
  // A worker busy without progress (a wedged data plane) makes health NOT_SERVING while it
  // lasts; main.cc stops pinging systemd's watchdog then.
  health->SetStallCheck(StallCheck(&liveness, HealthStallBound(kStallBound)));
}

std::vector<server::PeerInfo> Daemon::Impl::NodeViewAdapter::Peers() const {
  return ToPeerInfo(impl_->peers->Peers());
}

std::vector<server::PeerInfo> Daemon::Impl::NodeViewAdapter::PulledBy() const {
  std::vector<server::PeerInfo> out;
  for (const auto& s : impl_->peer_service->Subscribers()) {
    out.push_back({s.node, s.address, s.connected, s.error});
  }
  return out;
}

absl::Status Daemon::Impl::NodeViewAdapter::ForwardHold(const std::string& model, uint64_t version,
                                                        const std::vector<std::string>& nodes) {
  return impl_->peers->ForwardHold(model, version, nodes);
}

void Daemon::Impl::NodeViewAdapter::AddRuntime(v1::StatusResponse* response) const {
  response->set_listen(impl_->listen);
  response->set_listen_port(impl_->listen_port);
  response->set_health_port(impl_->health_port);
  response->set_metrics_port(impl_->metrics_server ? impl_->metrics_server->port() : 0);
  for (const auto& t : impl_->peers->Transfers()) {
    v1::TransferStatus* ts = response->add_transfers();
    ts->set_model(t.model);
    ts->set_version(t.version);
    ts->set_bytes_total(t.bytes_total);
    ts->set_bytes_done(t.bytes_done);
  }
}

std::vector<v1::NodeTimeline> Daemon::Impl::NodeViewAdapter::GatherTimeline(
    const std::string& model, uint64_t version) const {
  return rl::GatherTimelines(rl::GatherOptions{impl_->options.node, impl_->tls}, model, version,
                             Neighbors(impl_)());
}

std::vector<std::string> Daemon::Impl::Neighbors::operator()() const {
  std::vector<std::string> out;
  for (const auto& p : impl_->peers->Peers()) {
    if (p.connected) out.push_back(p.address);
  }
  for (const auto& s : impl_->peer_service->Subscribers()) {
    if (s.connected) out.push_back(s.address);
  }
  return out;
}

}  // namespace refit
