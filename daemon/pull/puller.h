#pragma once

// Runs one PullJob of the store to its end: pins the version on every origin it reads from,
// brings what it can up to date by deltas (delta_fetch.h), reads the rest in full — stripe by
// stripe from relays (other nodes pulling the same version, daemon/fleet) where there are any,
// else from the origin — verifies every byte against the origin's XXH3 (refetching from the
// origin what fails, wherever it came from), and unpins. While it runs, what has landed here
// is on the RelayBoard for other nodes to read.
//
// Thread-safety: Pull may be called from several threads at once (one job each).

#include <cstdint>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "daemon/common/mutex.h"
#include "daemon/dataplane/data_plane.h"
#include "daemon/fleet/relay_board.h"
#include "daemon/fleet/replicas.h"
#include "daemon/fleet/stripes.h"
#include "daemon/pull/landed_quant.h"
#include "daemon/pull/pull_metrics.h"
#include "daemon/pull/stream_watchdog.h"
#include "daemon/rl/timeline.h"
#include "daemon/store/pull_landing.h"
#include "proto/refit/v1/peer.grpc.pb.h"

namespace refit::pull {

// The other daemons' control channels, by node name (daemon/peer keeps them).
class PeerChannels {
 public:
  virtual ~PeerChannels() = default;
  // The stub of the connected node `node`, or null.
  virtual v1::Peer::Stub* StubFor(const std::string& node) = 0;
  // Whether a channel to `node` is open or could be opened (StubFor may open it). Opens
  // nothing.
  virtual bool CanReach(const std::string& node) { return StubFor(node) != nullptr; }
  // The --site of connected node `node`, as its Hello said ("": none, or not known).
  virtual std::string SiteOf(const std::string& node) {
    (void)node;
    return "";
  }
};

struct PullerOptions {
  std::string node;  // this node
  // Use a source's deltas when they are at most this fraction of the bytes a pull needs
  // (--delta-threshold, 0: full bytes only). It and --relay come through PeerManager
  // (PullerOptionsFor); their defaults live in DaemonOptions alone.
  double delta_threshold = 0;
  uint32_t pin_lease_ms = 120000;  // a pull's pins, renewed every quarter of it
  bool relay = false;              // read stripes from other pullers, and let them read here
  int fanout = fleet::kDefaultFanout;
  std::string site;           // --site: this node's site ("": none)
  StreamLimits relay_limits;  // when a silent or stalled relay is given up on
  // Where each pull's stages are recorded ("pulled" from whom, "verified"); null: nowhere.
  rl::Timeline* timeline = nullptr;
};

struct PullOutcome {
  absl::Status status;
  std::vector<std::shared_ptr<Region>> staging;  // one per job fetch, on success
};

class Puller {
 public:
  // Nothing is owned; everything outlives the Puller.
  Puller(PullerOptions options, PullLanding* store, dataplane::DataPlane* data_plane,
         Metrics* metrics, PeerChannels* channels, fleet::RelayBoard* board,
         fleet::ReplicaTable* replicas);

  // Blocks until `job` is pulled and verified, or failed. The caller hands the outcome to
  // Store::FinishPull.
  PullOutcome Pull(const PullJob& job);

 private:
  struct Sources;  // where each full fetch's bytes came from
  absl::Status PinOn(const std::string& node, const PullJob& job, bool release, uint64_t bytes_read,
                     bool relay);
  // The nodes pulling `job`'s model that this one may read from, by site (this node's site's
  // pullers, itself included; the other sites'), and the sites of the job's origins. Just this
  // node when relaying is off or nobody else pulls it.
  fleet::SiteView View(const PullJob& job);
  // Full bytes of `full` (indices into job.fetches) with every stripe read from its parent.
  absl::Status PullStriped(const PullJob& job, const std::vector<size_t>& full,
                           const fleet::SiteView& view,
                           std::vector<std::shared_ptr<Region>>* staging, Sources* sources,
                           dataplane::DataPlane::ReadHashes* hashes, LandedQuantizer* quantizer);
  // The origin's XXH3 of `chunks` of fetch `f`.
  absl::StatusOr<std::vector<uint64_t>> RemoteChecksums(
      const PullJob& job, size_t f, const std::vector<std::pair<uint64_t, uint64_t>>& chunks);
  absl::Status Verify(const PullJob& job, const std::vector<std::shared_ptr<Region>>& staging,
                      const dataplane::DataPlane::ReadHashes& read_hashes,
                      std::vector<absl::StatusOr<std::vector<uint64_t>>> remote,
                      const std::vector<bool>& verified, const Sources& sources,
                      std::vector<std::vector<std::pair<uint64_t, uint64_t>>>* refetched);

  const PullerOptions options_;
  PullLanding* const store_;
  dataplane::DataPlane* const data_plane_;
  Metrics* const metrics_;
  // The counters a pull adds to, resolved once (Metrics::Declare lists them at 0).
  struct Counters {
    explicit Counters(Metrics* metrics);
    CounterHandle delta_versions, full_versions, relay_bytes_received, relay_chunks_rejected,
        chunks_refetched, site_bytes_received, relay_failovers;
  };
  const Counters counters_;
  PeerChannels* const channels_;
  fleet::RelayBoard* const board_;
  fleet::ReplicaTable* const replicas_;
  common::Mutex warned_mu_;
  // Models for which this node warned that it is alone in its site (once each).
  std::set<std::string> warned_alone_ ABSL_GUARDED_BY(warned_mu_);
};

}  // namespace refit::pull
