#pragma once

// Process-wide counters and gauges, keyed by their public names (docs/api.md). The store, the
// data plane and the server increment them; Status and the Prometheus exporter read them.
//
// Thread-safe; incrementing is lock-free once a counter exists.

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace refit {

// Public metric names (binding: docs/api.md).
inline constexpr char kDataBytesReceived[] = "refit_data_bytes_received_total";
inline constexpr char kDataBytesSent[] = "refit_data_bytes_sent_total";
inline constexpr char kVersionsCompleted[] = "refit_versions_completed_total";
inline constexpr char kApplyBytes[] = "refit_apply_bytes_total";
// Data-plane bytes this node sent from versions it pulled rather than published (relaying).
inline constexpr char kRelayBytesSent[] = "refit_relay_bytes_sent_total";
// Added by refit.
inline constexpr char kPublishBytes[] = "refit_publish_bytes_total";
inline constexpr char kPublishes[] = "refit_publish_total";
inline constexpr char kApplies[] = "refit_apply_total";
inline constexpr char kVersionsDropped[] = "refit_versions_dropped_total";
inline constexpr char kRequestErrors[] = "refit_request_errors_total";
// Versions given up before they completed here (a source released before publishing one, a
// pull that failed), and buffers released because the process that registered them exited.
inline constexpr char kVersionsAbandoned[] = "refit_versions_abandoned_total";
inline constexpr char kOwnerExitReleases[] = "refit_owner_exit_releases_total";
// Applies whose bytes, checked as they landed, differed from the version's (DATA_LOSS).
inline constexpr char kApplyVerifyFailures[] = "refit_apply_verify_failures_total";
inline constexpr char kPeersConnected[] = "refit_peers_connected";
// Control channels open to other daemons: --peers connected, plus relay channels opened on
// demand (bounded by --max-peer-connections).
inline constexpr char kPeerChannelsOpen[] = "refit_peer_channels_open";
// Data-plane bytes this node read from relays (other pullers) instead of the origin, and
// chunks a relay served that failed the origin's checksum (refetched from the origin).
inline constexpr char kRelayBytesReceived[] = "refit_relay_bytes_received_total";
inline constexpr char kRelayChunksRejected[] = "refit_relay_chunks_rejected_total";
inline constexpr char kChecksumBytesHashed[] = "refit_checksum_bytes_hashed_total";
// Host version slots held (published, pulled, in flight, kept for reuse), and the limit
// (--max-slot-memory; 0: none). Gauges.
inline constexpr char kSlotMemoryBytes[] = "refit_slot_memory_bytes";
inline constexpr char kSlotMemoryLimitBytes[] = "refit_slot_memory_limit_bytes";
// fp8 destinations with block scales: source values quantized (counted once per version and
// destination box) and, of those, the inf and NaN ones (a diverged trainer).
inline constexpr char kQuantizedValues[] = "refit_quantized_values_total";
inline constexpr char kNonfiniteValues[] = "refit_nonfinite_values_total";
// Histograms (seconds).
inline constexpr char kPublishSeconds[] = "refit_publish_seconds";
inline constexpr char kApplySeconds[] = "refit_apply_seconds";
inline constexpr char kPlanSeconds[] = "refit_plan_seconds";
inline constexpr char kTransferSeconds[] = "refit_transfer_seconds";
inline constexpr char kQuantizeSeconds[] = "refit_quantize_seconds";

// A cumulative histogram with fixed bucket bounds, Prometheus style.
struct HistogramSnapshot {
  std::vector<double> bounds;    // upper bounds, ascending; +Inf implied
  std::vector<uint64_t> counts;  // cumulative count per bound, then +Inf
  double sum = 0;
  uint64_t count = 0;
};

class Metrics {
 public:
  Metrics();  // registers the public counters at 0, so Status always shows them

  // Adds `delta` to counter `name`, creating it at 0 first.
  void Add(const std::string& name, double delta);
  // Sets gauge `name`.
  void Set(const std::string& name, double value);
  // A copy of every value.
  std::map<std::string, double> Snapshot() const;
  double Get(const std::string& name) const;

  // Records one observation (seconds) in histogram `name`.
  void Observe(const std::string& name, double seconds);
  std::map<std::string, HistogramSnapshot> Histograms() const;

 private:
  std::atomic<double>* Find(const std::string& name);

  mutable std::mutex mu_;
  std::map<std::string, std::unique_ptr<std::atomic<double>>> values_;
  std::map<std::string, HistogramSnapshot> histograms_;  // guarded by mu_
};

}  // namespace refit
