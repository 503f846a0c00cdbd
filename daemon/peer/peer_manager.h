#pragma once

// The other daemons, seen from this one: the assembly of the peer plane's client side, one part
// per job —
//   PeerLinks        one connection loop per --peers address (Hello, then a Subscribe stream
//                    whose events PeerEvents applies to the store), reconnecting with backoff;
//   PeerResolver     the --peers names resolved again every 10 s (more daemons behind a name);
//   RelayChannels    the channels a pull uses: --peers connections, else relay channels opened
//                    on demand to nodes an origin named (--relay, --max-peer-connections);
//   PullWorker       runs the store's PullJobs one at a time through a pull::Puller and hands
//                    the outcome to the store;
//   ReplicaReporter  tells every connected daemon which versions this node's DESTINATION
//                    buffers' models are complete at (Peer.Report: on every completion and
//                    every second), for replica status, WaitForReplicas and the choice of relays.
//
// Listens to the store (StoreEvents): OnPullNeeded queues a pull, OnVersionComplete and
// OnHoldChanged make a report due.
//
// Thread-safety: public methods may be called from any thread. The store's events only queue
// work or set a flag (the store calls them with its lock held).

#include <atomic>
#include <memory>
#include <string>
#include <vector>

#include "daemon/dataplane/data_plane.h"
#include "daemon/fleet/relay_board.h"
#include "daemon/fleet/replicas.h"
#include "daemon/peer/peer_dial.h"
#include "daemon/peer/peer_events.h"
#include "daemon/peer/peer_links.h"
#include "daemon/peer/peer_metrics.h"
#include "daemon/peer/peer_resolver.h"
#include "daemon/peer/pull_worker.h"
#include "daemon/peer/relay_channels.h"
#include "daemon/peer/replica_reporter.h"
#include "daemon/pull/puller.h"
#include "daemon/rl/parts.h"
#include "daemon/store/peer_store.h"
#include "daemon/store/store_types.h"
#include "daemon/tls/peer_tls.h"
#include "proto/refit/v1/peer.grpc.pb.h"

namespace refit::peer {

using dataplane::DataPlane;

// The fields named after a refitd flag are set from DaemonOptions (PeerManagerOptionsFrom,
// daemon/component_options.h), where their defaults live (daemon/config's option table prints
// them); here they hold neutral values: deltas, relaying and relay channels off.
struct PeerManagerOptions {
  std::string node;  // --node: this node
  // This daemon's random per-process id (PeerService's too): a Hello answered with this node's
  // name and this id reached this very daemon.
  std::string instance;
  // --delta-threshold: use a source's deltas when they are at most this fraction of the bytes
  // a pull needs (0: always pull full bytes).
  double delta_threshold = 0;
  bool relay = false;     // --relay
  tls::PeerTlsFiles tls;  // mutual TLS on every channel to a peer (none: plaintext)
  // --max-peer-connections: --peers are always connected; relay channels open on demand only
  // while fewer than this many channels are open (0: as 1).
  uint32_t max_peer_connections = 0;
  std::string site;  // --site ("": none)
  // Labels, staleness budgets and the timeline heard from other nodes (daemon/rl); may be
  // null members.
  rl::Parts rl;
};

// What PeerManager gives its parts, from its options (refitd's mapping test checks that
// DaemonOptions' defaults reach them).
pull::PullerOptions PullerOptionsFor(const PeerManagerOptions& options);
RelayChannelsOptions RelayChannelsOptionsFor(const PeerManagerOptions& options);
ReplicaReporterOptions ReplicaReporterOptionsFor(const PeerManagerOptions& options);

class PeerManager final : public pull::PeerChannels, public StoreEvents {
 public:
  // Nothing is owned; `board` and `replicas` may be null (no relaying, no replica reports).
  PeerManager(PeerManagerOptions options, std::vector<std::string> addresses, PeerStore* store,
              DataPlane* data_plane, Metrics* metrics, fleet::RelayBoard* board = nullptr,
              fleet::ReplicaTable* replicas = nullptr);
  ~PeerManager() override;  // Stop()

  // This daemon's --listen address as bound (for messages and subscriptions); before Start.
  void SetListenAddress(const std::string& listen) { dialer_.SetListen(listen); }
  void Start();
  void Stop();

  // StoreEvents. Queues `job` for the pull worker (called by the store, under its lock).
  void OnPullNeeded(const PullJob& job) override;
  // A version became complete here (called by the store, under its lock): report it.
  void OnVersionComplete(const std::string& model, uint64_t version) override;
  // A rollback target changed here (store lock held): report it.
  void OnHoldChanged(const std::string& model, uint64_t version) override;

  // Rollback (version > 0) or Resume (0) of `model` asked on this node: told to each of `nodes`
  // (the nodes with SOURCE buffers of it) with Peer.Hold, whose Subscribe events then carry it
  // to every node pulling the model, this one included. UNAVAILABLE naming a node not
  // connected; a node's refusal (NOT_FOUND naming its oldest retained version, ...) as it came.
  absl::Status ForwardHold(const std::string& model, uint64_t version,
                           const std::vector<std::string>& nodes);

  // pull::PeerChannels (RelayChannels): a connected --peers node's stub; else, with --relay, a
  // relay channel to a node an origin named (its Report answer), opened on demand.
  v1::Peer::Stub* StubFor(const std::string& node) override { return channels_.StubFor(node); }
  bool CanReach(const std::string& node) override { return channels_.CanReach(node); }
  std::string SiteOf(const std::string& node) override { return channels_.SiteOf(node); }
  // Control channels open now: --peers connected plus relay channels (refit_peer_channels_open).
  size_t OpenChannels() const { return channels_.Open(); }

  std::vector<PeerState> Peers() const { return links_.Peers(); }

  using Transfer = peer::Transfer;
  // The pull in flight, if any.
  std::vector<Transfer> Transfers() const { return pulls_.Transfers(); }

 private:
  const std::string node_;
  Dialer dialer_;
  PeerEvents events_;
  PeerLinks links_;
  PeerResolver resolver_;
  RelayChannels channels_;
  pull::Puller puller_;
  PullerRunner runner_;
  StoreFinisher finisher_;
  PullWorker pulls_;
  ReplicaReporter reporter_;
  std::atomic<bool> stopped_{false};
};

}  // namespace refit::peer
