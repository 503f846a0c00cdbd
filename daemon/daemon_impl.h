#pragma once

// Daemon::Impl: the parts a refitd is assembled from. Daemon::Start (daemon.cc) makes them one
// step at a time, each step a method here: the parts in daemon_parts.cc, the listeners in
// daemon_listeners.cc. Private to //daemon:daemon.

#include <memory>
#include <string>

#include "absl/status/status.h"
#include "daemon/bucket/bucket_sync.h"
#include "daemon/callers/call_budget.h"
#include "daemon/callers/local_listener.h"
#include "daemon/common/liveness.h"
#include "daemon/common/mutex.h"
#include "daemon/component_options.h"
#include "daemon/daemon.h"
#include "daemon/dataplane/data_plane.h"
#include "daemon/fleet/relay_board.h"
#include "daemon/fleet/replicas.h"
#include "daemon/metrics/metrics.h"
#include "daemon/metrics/prometheus.h"
#include "daemon/peer/delta_source.h"
#include "daemon/peer/peer_manager.h"
#include "daemon/peer/peer_service.h"
#include "daemon/rl/labels.h"
#include "daemon/rl/staleness.h"
#include "daemon/rl/store_events.h"
#include "daemon/rl/timeline.h"
#include "daemon/rl/timeline_service.h"
#include "daemon/server/health_service.h"
#include "daemon/server/owner_exit.h"
#include "daemon/server/refit_service.h"
#include "daemon/state/labels_file.h"
#include "daemon/state/version_ledger.h"
#include "daemon/store/store.h"
#include "daemon/tls/peer_tls.h"
#include "daemon/wiring.h"
#include "grpcpp/grpcpp.h"

namespace refit {

// Checks what no part checks itself (--retain, --node, the peer plane's exposure) and that the
// --socket path can be served. The parts' options come from component_options.h.
absl::Status CheckDaemonOptions(const DaemonOptions& options);

struct Daemon::Impl {
  explicit Impl(const DaemonOptions& options);

  // Start's steps, in the order it takes them (daemon.cc).
  absl::Status RestoreState();                              // --state-dir: ledger, labels
  absl::Status MakeDataPlane(StoreOptions* store_options);  // UCX; host slots from it
  void MakeStore(const StoreOptions& store_options);        // and its watchdog probe
  absl::Status MakeExchange();  // DeltaSource, --bucket-export, --bucket-import
  absl::Status CheckPeerTls();  // --tls-*: checked and logged
  void MakePeerPlane();         // PeerService, Staleness, PeerManager
  void ConnectEvents();         // the store's listeners; --state-dir's holds
  void MakeLocalServices();     // what each local caller's RefitService starts from
  void MakeHealth();            // refit.v1.Refit / refit.v1.Peer health, its checks
  absl::Status ListenPeers();   // --listen: Peer, PeerInsight, Health
  absl::Status ListenLocal();   // --socket: each local caller's services
  absl::Status ListenProbes();  // --health-listen, --metrics-listen
  void StopListening();         // undoes the Listen* steps of a Start that fails
  void StartServing();          // health SERVING, the peer loops, staleness
  void LogStarted() const;

  // The Daemon's answers to the local API (server::NodeView): its peers, ports, transfers.
  class NodeViewAdapter final : public server::NodeView {
   public:
    explicit NodeViewAdapter(const Impl* impl) : impl_(impl) {}
    std::vector<server::PeerInfo> Peers() const override;
    std::vector<server::PeerInfo> PulledBy() const override;
    absl::Status ForwardHold(const std::string& model, uint64_t version,
                             const std::vector<std::string>& nodes) override;
    void AddRuntime(v1::StatusResponse* response) const override;
    std::vector<v1::NodeTimeline> GatherTimeline(const std::string& model,
                                                 uint64_t version) const override;

   private:
    const Impl* impl_;
  };
  // The addresses of the daemons this one knows: where a timeline is gathered from
  // (rl::TimelineService's neighbours).
  class Neighbors {
   public:
    explicit Neighbors(const Impl* impl) : impl_(impl) {}
    std::vector<std::string> operator()() const;

   private:
    const Impl* impl_;
  };
  // Builds the services of each local caller's server (callers::ServiceFactory): a
  // RefitService and health for an allowed caller, a refusal for any other.
  class LocalServices {
   public:
    LocalServices(const Impl* impl, std::shared_ptr<server::Owners> owners,
                  std::shared_ptr<callers::FdTokens> memfds, std::string refused)
        : impl_(impl),
          owners_(std::move(owners)),
          memfds_(std::move(memfds)),
          refused_(std::move(refused)) {}
    std::vector<std::shared_ptr<void>> operator()(const callers::Caller* caller,
                                                  grpc::ServerBuilder* builder) const;

   private:
    const Impl* impl_;
    std::shared_ptr<server::Owners> owners_;
    std::shared_ptr<callers::FdTokens> memfds_;
    std::string refused_;
  };

  const DaemonOptions options;
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
  const std::string instance;               // NewInstanceId()
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
  // Who hears what (daemon/wiring.h), filled in as the parts are made.
  EventWiring wiring;
  NodeViewAdapter node_view{this};
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

  // The worker threads call into the peer service and the store: stop them before any member
  // goes (this also covers a Start that fails half-way).
  ~Impl();
};

}  // namespace refit
