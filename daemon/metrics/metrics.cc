#include "daemon/metrics/metrics.h"

namespace refit {

namespace {

// 100 us .. ~100 s, x ~3 per step: publish/apply of KiB to TiB.
const std::vector<double>& Bounds() {
  static const std::vector<double> bounds = {0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1,
                                             0.3,    1,      3,     10,    30,   100};
  return bounds;
}

}  // namespace

void Metrics::Observe(const std::string& name, double seconds) {
  std::lock_guard<std::mutex> lock(mu_);
  HistogramSnapshot& h = histograms_[name];
  if (h.bounds.empty()) {
    h.bounds = Bounds();
    h.counts.assign(h.bounds.size() + 1, 0);
  }
  for (size_t i = 0; i < h.bounds.size(); ++i) {
    if (seconds <= h.bounds[i]) h.counts[i]++;
  }
  h.counts.back()++;
  h.sum += seconds;
  h.count++;
}

std::map<std::string, HistogramSnapshot> Metrics::Histograms() const {
  std::lock_guard<std::mutex> lock(mu_);
  return histograms_;
}

Metrics::Metrics() {
  for (const char* name :
       {kDataBytesReceived, kDataBytesSent, kVersionsCompleted, kApplyBytes, kPublishBytes,
        kPublishes, kApplies, kVersionsDropped, kVersionsAbandoned, kOwnerExitReleases,
        kApplyVerifyFailures, kPeersConnected, kPeerChannelsOpen, kChecksumBytesHashed,
        kRelayBytesSent, kRelayBytesReceived, kRelayChunksRejected, kQuantizedValues,
        kNonfiniteValues}) {
    Find(name);
  }
}

std::atomic<double>* Metrics::Find(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& slot = values_[name];
  if (!slot) slot = std::make_unique<std::atomic<double>>(0.0);
  return slot.get();
}

void Metrics::Add(const std::string& name, double delta) {
  std::atomic<double>* value = Find(name);
  double current = value->load(std::memory_order_relaxed);
  while (!value->compare_exchange_weak(current, current + delta, std::memory_order_relaxed)) {
  }
}

void Metrics::Set(const std::string& name, double value) {
  Find(name)->store(value, std::memory_order_relaxed);
}

std::map<std::string, double> Metrics::Snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<std::string, double> out;
  for (const auto& [name, value] : values_) out[name] = value->load(std::memory_order_relaxed);
  return out;
}

double Metrics::Get(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = values_.find(name);
  return it == values_.end() ? 0.0 : it->second->load(std::memory_order_relaxed);
}

}  // namespace refit
