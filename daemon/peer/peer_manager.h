#pragma once

// The other daemons, seen from this one: one connection loop per --peers address (Hello, then a
// Subscribe stream whose events feed the store), reconnecting with backoff; the pull worker,
// which runs the store's PullJobs one at a time through a pull::Puller and hands the outcome to
// the store; and the reporter, which tells every connected daemon which versions this node's
// DESTINATION buffers' models are complete at (Peer.Report: on every completion and every
// second), for replica status, WaitForReplicas and the choice of relays.
//
// Listens to the store (StoreEvents): OnPullNeeded queues a pull, OnVersionComplete makes a
// report due.
//
// Thread-safety: public methods may be called from any thread. The store's events only queue
// work or set a flag (the store calls them with its lock held).

#include <atomic>
#include <deque>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "daemon/common/mutex.h"
#include "daemon/common/worker_loop.h"
#include "daemon/dataplane/data_plane.h"
#include "daemon/fleet/relay_board.h"
#include "daemon/fleet/replicas.h"
#include "daemon/peer/peer_metrics.h"
#include "daemon/pull/puller.h"
#include "daemon/rl/parts.h"
#include "daemon/store/store.h"
#include "daemon/tls/peer_tls.h"
#include "proto/refit/v1/peer.grpc.pb.h"

namespace refit::peer {

using dataplane::DataPlane;

struct PeerState {
  std::string address;
  std::string node;  // empty until the first Hello
  bool connected = false;
  std::string error;  // why this daemon does not connect to it (e.g. it has this node's name)
};

// "host:port" -> every "ip:port" the name resolves to now (one entry, unchanged, when it
// doesn't resolve). A headless Kubernetes Service resolves to every daemon.
std::vector<std::string> ResolvePeerAddress(const std::string& address);

struct PeerManagerOptions {
  std::string node;  // this node
  // This daemon's random per-process id (PeerService's too): a Hello answered with this node's
  // name and this id reached this very daemon.
  std::string instance;
  // Use a source's deltas when they are at most this fraction of the bytes a pull needs (0:
  // always pull full bytes). Its default, and --relay's and --max-peer-connections', are in
  // daemon/config's option table (DaemonOptions) only: refitd sets each of them here.
  double delta_threshold = 0;
  bool relay = false;     // --relay
  tls::PeerTlsFiles tls;  // mutual TLS on every channel to a peer (none: plaintext)
  // --max-peer-connections: --peers are always connected; relay channels open on demand only
  // while fewer than this many channels are open.
  uint32_t max_peer_connections = 0;
  std::string site;  // --site ("": none)
  // Labels, staleness budgets and the timeline heard from other nodes (daemon/rl); may be
  // null members.
  rl::Parts rl;
};

class PeerManager final : public pull::PeerChannels, public StoreEvents {
 public:
  // Nothing is owned; `board` and `replicas` may be null (no relaying, no replica reports).
  PeerManager(PeerManagerOptions options, std::vector<std::string> addresses, Store* store,
              DataPlane* data_plane, Metrics* metrics, fleet::RelayBoard* board = nullptr,
              fleet::ReplicaTable* replicas = nullptr);
  ~PeerManager() override;  // Stop()

  // This daemon's --listen address as bound (for messages and subscriptions); before Start.
  void SetListenAddress(const std::string& listen) { listen_ = listen; }
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

  // A connected --peers node's stub; else, with --relay, a relay channel to a node an origin
  // named (its Report answer), opened on demand (Hello, data-plane endpoint) while fewer than
  // --max-peer-connections channels are open, and closed after a while unused.
  v1::Peer::Stub* StubFor(const std::string& node) override;
  bool CanReach(const std::string& node) override;
  std::string SiteOf(const std::string& node) override;
  // Control channels open now: --peers connected plus relay channels (refit_peer_channels_open).
  size_t OpenChannels() const;

  std::vector<PeerState> Peers() const;

  struct Transfer {
    std::string model;
    uint64_t version = 0;
    uint64_t bytes_total = 0;
    uint64_t bytes_done = 0;
  };
  // The pull in flight, if any.
  std::vector<Transfer> Transfers() const;

 private:
  struct Peer;
  struct Dialed {
    std::shared_ptr<grpc::Channel> channel;
    std::shared_ptr<v1::Peer::Stub> stub;
    v1::HelloResponse who;
  };
  // A channel to `address` and its Hello, checked (a node name; with TLS, its certificate's).
  grpc::Status Dial(const std::string& address, Dialed* out) const;
  // A relay channel opened on demand: used by pulls, closed when idle (CloseIdle).
  struct Relay {
    std::string site;  // its Hello's
    std::shared_ptr<grpc::Channel> channel;
    std::shared_ptr<v1::Peer::Stub> stub;
    std::chrono::steady_clock::time_point used;
  };
  v1::Peer::Stub* OpenRelay(const std::string& node);
  void CloseIdle();
  // The other nodes an origin named in its answer to this node's report.
  void Learn(const v1::ReplicaReportResponse& response);
  size_t OpenLocked() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  v1::Peer::Stub* ConnectedLocked(const std::string& node) const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RunPeer(Peer* peer);
  void RunResolver();
  void AddPeer(const std::string& address) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void RunPulls();
  void Report();  // one turn of reporter_
  // An event from `node` announcing a version: its labels, budget and timeline (daemon/rl).
  void NoteAnnounced(const std::string& node, const v1::PeerEvent& event);
  const std::string node_;
  const std::string instance_;
  std::string listen_;  // set before Start
  const bool relay_;
  const std::string site_;
  const tls::PeerTlsFiles tls_;
  const rl::Parts rl_;
  Store* const store_;
  DataPlane* const data_plane_;
  Metrics* const metrics_;
  fleet::ReplicaTable* const replicas_;
  const std::vector<std::string> configured_;  // --peers as given
  std::unique_ptr<pull::Puller> puller_;
  std::vector<std::unique_ptr<Peer>> peers_ ABSL_GUARDED_BY(mu_);  // grows only
  std::thread resolver_thread_;
  bool started_ = false;

  mutable common::Mutex mu_;
  common::CondVar wake_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::deque<PullJob> jobs_ ABSL_GUARDED_BY(mu_);
  // The pull in flight: bytes_done = received counter now - at its start.
  std::optional<Transfer> current_ ABSL_GUARDED_BY(mu_);
  double received_at_start_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread pull_thread_;
  // The replica reporter: Report every second and on each completion (OnVersionComplete).
  WorkerLoop reporter_;
  bool reported_ = false;  // reporter thread only: the last report held a model
  const uint32_t max_channels_;
  const std::chrono::milliseconds idle_;  // a relay channel unused this long closes
  common::Mutex open_mu_;                 // serializes opening and closing relay channels
  std::map<std::string, Relay> relays_ ABSL_GUARDED_BY(mu_);       // node -> relay channel
  std::map<std::string, std::string> known_ ABSL_GUARDED_BY(mu_);  // node -> address, learned
  std::map<std::string, std::chrono::steady_clock::time_point> dial_failed_ ABSL_GUARDED_BY(mu_);
  bool pulling_ ABSL_GUARDED_BY(mu_) = false;  // a pull is using channels
  // Stubs of --peers connections that were replaced by a reconnect while a pull may still hold
  // them (StubFor hands out plain pointers): kept until no pull is running (CloseIdle).
  std::vector<std::shared_ptr<v1::Peer::Stub>> retired_stubs_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::peer
