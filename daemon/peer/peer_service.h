#pragma once

// refit.v1.Peer, served on --listen: what this daemon tells other daemons. Hello hands over the
// data-plane address; Subscribe streams this node's SOURCE layouts and each version its local
// sources have all published (with the remote keys of the slots to read); Checksum lets a
// reader verify what it pulled; Pin keeps a version's slots alive while a reader pulls.
//
// Listens to the store (StoreEvents): a new local version or a changed SOURCE layout wakes the
// Subscribe streams, which send what changed.
//
// Thread-safety: gRPC calls the handlers concurrently; NotifyChanged may be called from any
// thread (the store calls it, through its events, with its lock held: it only bumps a counter).

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <tuple>

#include "daemon/common/mutex.h"
#include "daemon/dataplane/data_plane.h"
#include "daemon/fleet/entry_claims.h"
#include "daemon/fleet/relay_board.h"
#include "daemon/fleet/replicas.h"
#include "daemon/peer/delta_source.h"
#include "daemon/peer/peer_limits.h"
#include "daemon/peer/peer_metrics.h"
#include "daemon/rl/parts.h"
#include "daemon/store/peer_store.h"
#include "daemon/store/store_types.h"
#include "proto/refit/v1/peer.grpc.pb.h"

namespace refit::peer {

using dataplane::DataPlane;

// How a PeerService serves, from refitd's flags (set from DaemonOptions,
// daemon/component_options.h, where their defaults live; unset: no relaying, no TLS).
struct PeerServiceOptions {
  bool relay = false;  // --relay: other pullers may read what this node pulled (Relay)
  bool tls = false;    // --tls-*: callers are authenticated by their certificates
  // --max-peer-connections: Relay streams are served to at most this many other nodes at once
  // (incoming relay readers, as outgoing channels); a further node is refused
  // RESOURCE_EXHAUSTED and reads those stripes from the origin. 0: one.
  uint32_t max_relay_readers = 0;
};

class PeerService final : public v1::Peer::Service, public StoreEvents {
 public:
  // `deltas` (may be null: no delta sync) says which versions may be announced and which
  // deltas to offer with them.
  // `board` and `replicas` may be null (no relaying; replica reports refused). Without
  // `options.relay` (or a board), Relay answers FAILED_PRECONDITION.
  PeerService(std::string node, PeerStore* store, DataPlane* data_plane, DeltaSource* deltas,
              Metrics* metrics, fleet::RelayBoard* board = nullptr,
              fleet::ReplicaTable* replicas = nullptr, PeerServiceOptions options = {});

  // This daemon's identity in Hello: its random per-process instance id and its --listen
  // address (HOST:PORT as bound). Call before serving, and again once the port is known.
  void SetIdentity(const std::string& instance, const std::string& listen);
  // This daemon's --site, said in Hello (before serving).
  void SetSite(const std::string& site);

  // A daemon subscribed to this one (it pulls from here), or one whose Hello was refused.
  struct Subscriber {
    std::string node;
    std::string address;  // its --listen address (else where it called from)
    bool connected = false;
    std::string error;  // why its Hello was refused; empty for subscribers
  };
  // Subscribers now, then refused callers (newest 16), each once.
  std::vector<Subscriber> Subscribers() const;

  // Labels and staleness budgets to announce with each version (daemon/rl); before serving.
  void SetRl(rl::Parts rl) { rl_ = rl; }
  // Something a subscriber should hear about changed (a layout or a new local version).
  void NotifyChanged();
  // StoreEvents: both mean NotifyChanged. Subscribers read local versions' snapshots.
  void OnLocalVersionReady(const std::string& model, uint64_t version) override;
  void OnLayoutChanged(const std::string& model) override;
  // A new run or a rollback target here: subscribers hear of it (PeerEvent.trainer_run,
  // .rollback_version).
  void OnRunStarted(const std::string& model, const std::string& run) override;
  void OnHoldChanged(const std::string& model, uint64_t version) override;
  bool WantsLocalSnapshots() const override { return true; }
  // Ends every Subscribe stream (shutdown).
  void Stop();

  grpc::Status Hello(grpc::ServerContext* context, const v1::HelloRequest* request,
                     v1::HelloResponse* response) override;
  grpc::Status Subscribe(grpc::ServerContext* context, const v1::SubscribeRequest* request,
                         grpc::ServerWriter<v1::PeerEvent>* writer) override;
  grpc::Status Checksum(grpc::ServerContext* context, const v1::ChecksumRequest* request,
                        v1::ChecksumResponse* response) override;
  grpc::Status Pin(grpc::ServerContext* context, const v1::PinRequest* request,
                   v1::PinResponse* response) override;
  grpc::Status Relay(grpc::ServerContext* context, const v1::RelayRequest* request,
                     grpc::ServerWriter<v1::RelayProgress>* writer) override;
  grpc::Status Report(grpc::ServerContext* context, const v1::ReplicaReport* request,
                      v1::ReplicaReportResponse* response) override;
  // Rollback / Resume forwarded by another node (peer_service_versions.cc).
  grpc::Status Hold(grpc::ServerContext* context, const v1::HoldRequest* request,
                    v1::HoldResponse* response) override;

 private:
  // The event describing `model` now (its layouts only `with_sources`); false when there is
  // nothing to say.
  // The remote keys in it are `node`'s (DataPlane::Expose).
  bool BuildEvent(const std::string& model, const std::vector<SourceLayout>& layouts,
                  bool with_sources, const std::string& node, v1::PeerEvent* event);
  struct Pinned;
  // Takes the pins whose lease lapsed out of pins_; the caller lets them go.
  std::vector<Pinned> ExpirePins() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Version `version` of `model` held here: from the store, or the one DeltaSource prepared.
  std::shared_ptr<const LocalSnapshot> Snapshot(const std::string& model, uint64_t version);

  const std::string node_;
  // Fault injection for tests: the first N Checksum replies are wrong
  // ($REFIT_FAULT_CORRUPT_CHECKSUMS, read in //daemon:refitd_testing only; 0 in refitd).
  std::atomic<int64_t> corrupt_checksums_{0};
  // Fault injection (REFIT_FAULT_CHECKSUM_WITHOUT_RUNS): answer Checksum as a release before
  // RangeRun did, reading only plain ranges, so tests can check a newer reader falls back.
  bool checksum_without_runs_ = false;
  PeerStore* const store_;
  DataPlane* const data_plane_;
  DeltaSource* const deltas_;
  Metrics* const metrics_;
  fleet::RelayBoard* const board_;
  fleet::ReplicaTable* const replicas_;
  const bool relay_;
  rl::Parts rl_;    // set before serving
  const bool tls_;  // callers are authenticated: a claimed node name must be the certificate's
  const uint32_t max_relay_readers_;  // PeerServiceOptions::max_relay_readers, at least 1
  // PERMISSION_DENIED when TLS is on and `node` is not the caller's certificate's name.
  absl::Status Authenticate(const grpc::ServerContext& context, const std::string& node) const;
  // Who a call comes from, for the per-peer bounds (peer_limits.h): the authenticated node with
  // TLS, the calling host without.
  std::string SourceOf(const grpc::ServerContext& context, const std::string& node) const;
  // Subscribe and Relay streams, per source and in all.
  StreamLimiter streams_;
  // Fault injection for tests ($REFIT_FAULT_RELAY_FLIP): a relay flips one byte in each of the
  // first N ranges it announces, as a relay serving wrong bytes would (test build only).
  std::atomic<int64_t> relay_flips_{0};

  mutable common::Mutex mu_;
  std::string instance_ ABSL_GUARDED_BY(mu_);
  std::string listen_ ABSL_GUARDED_BY(mu_);
  std::string site_ ABSL_GUARDED_BY(mu_);
  // Node -> its Relay streams open here.
  std::map<std::string, int> relay_readers_ ABSL_GUARDED_BY(mu_);
  // Records which bytes of `key` a reader of another site asked for; warns (once per version
  // and site) when another node of that site asked for some of them too.
  void NoteEntry(const fleet::RelayKey& key, const v1::RelayRequest& request);
  // Which node of each other site asked for which bytes of each relayed piece here.
  fleet::EntryClaims entry_claims_;
  // A reader's place among relay_readers_ while its stream lasts.
  class RelayReaderSlot;
  // (node, address)
  std::multiset<std::pair<std::string, std::string>> subscribers_ ABSL_GUARDED_BY(mu_);
  // Subscriber -> an address other nodes can dial (its --listen, with an unspecified host
  // replaced by the one it called from), for Report's answer.
  std::map<std::string, std::string> dial_ ABSL_GUARDED_BY(mu_);
  // Caller address -> why (at most 16).
  std::map<std::string, std::string> refused_ ABSL_GUARDED_BY(mu_);
  common::CondVar changed_;
  uint64_t generation_ ABSL_GUARDED_BY(mu_) = 0;
  bool stopped_ ABSL_GUARDED_BY(mu_) = false;
  // What a reader's pin keeps alive: the version's slots, the deltas offered with it, and
  // when the pin lapses; and the reader's grants to read them over the data plane, which end
  // with the pin (DataPlane::Expose).
  struct Pinned {
    std::shared_ptr<const LocalSnapshot> snapshot;
    std::vector<EncodedDelta> deltas;
    std::chrono::steady_clock::time_point until;
    std::vector<std::shared_ptr<void>> grants;
    // Each piece's remote key as sent to the reader (with its token): what Checksum asks for.
    std::map<std::string, std::string> keys;
    std::string source;  // who pinned (SourceOf)
  };
  // (model, version, reader)
  std::map<std::tuple<std::string, uint64_t, std::string>, Pinned> pins_ ABSL_GUARDED_BY(mu_);
  // Nodes whose report was refused (logged once; at most 64 remembered).
  std::set<std::string> refused_reports_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit::peer
