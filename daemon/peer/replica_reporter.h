#pragma once

// The replica reporter: tells every connected --peers daemon which versions this node's
// DESTINATION buffers' models are complete at (Peer.Report: on every completion, every hold
// change, and every second as a heartbeat), for replica status, WaitForReplicas and the choice
// of relays; learns from each answer the other nodes pulling from that origin (their addresses
// for RelayChannels, their replicas for the ReplicaTable). Each turn first closes idle relay
// channels.
//
// Thread-safety: Notify may be called from any thread, also under the store's lock.

#include <string>

#include "daemon/common/worker_loop.h"
#include "daemon/fleet/replicas.h"
#include "daemon/peer/peer_links.h"
#include "daemon/peer/relay_channels.h"
#include "daemon/store/model_catalog.h"
#include "proto/refit/v1/peer.pb.h"

namespace refit::peer {

// From refitd's flags, through PeerManager (the defaults live in DaemonOptions alone).
struct ReplicaReporterOptions {
  std::string node;    // this node
  bool relay = false;  // --relay: other nodes may read relayed stripes here
  std::string site;    // --site
};

class ReplicaReporter {
 public:
  // Nothing is owned; `replicas` may be null.
  ReplicaReporter(ReplicaReporterOptions options, ModelCatalog* store, PeerLinks* links,
                  RelayChannels* channels, fleet::ReplicaTable* replicas);

  void Start();
  void Stop();
  // A report is due (a version completed here, a hold changed).
  void Notify() { loop_.Notify(); }

  // One turn (the loop's thread; tests).
  void Report();
  // The other nodes an origin named in its answer to this node's report.
  void Learn(const v1::ReplicaReportResponse& response);

 private:
  const ReplicaReporterOptions options_;
  ModelCatalog* const store_;
  PeerLinks* const links_;
  RelayChannels* const channels_;
  fleet::ReplicaTable* const replicas_;
  WorkerLoop loop_;
  bool reported_ = false;  // loop thread only: the last report held a model
};

}  // namespace refit::peer
