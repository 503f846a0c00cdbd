#include "daemon/metrics/metrics.h"

namespace refit {

Metrics::Metrics() {
  for (const char* name : {kDataBytesReceived, kDataBytesSent, kVersionsCompleted, kApplyBytes,
                           kPublishBytes, kPublishes, kApplies, kVersionsDropped}) {
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
