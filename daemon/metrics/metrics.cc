#include "daemon/metrics/metrics.h"

namespace refit {

namespace {

// 100 us .. ~100 s, x ~3 per step: publish/apply of KiB to TiB.
const std::vector<double>& Bounds() {
  static const std::vector<double> bounds = {0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1,
                                             0.3,    1,      3,     10,    30,   100};
  return bounds;
}

HistogramSnapshot Empty() {
  HistogramSnapshot h;
  h.bounds = Bounds();
  h.counts.assign(h.bounds.size() + 1, 0);
  return h;
}

}  // namespace

void Metrics::DescribeLocked(const char* name, MetricKind kind, const char* help) {
  if (descriptions_.find(std::string_view(name)) == descriptions_.end()) {
    descriptions_.emplace(name, MetricDescription{kind, help});
  }
}

std::atomic<double>* Metrics::Find(const std::string& key, const char* name, MetricKind kind,
                                   const char* help) {
  common::MutexLock lock(mu_);
  DescribeLocked(name, kind, help);
  auto& slot = values_[key];
  if (!slot) slot = std::make_unique<std::atomic<double>>(0.0);
  return slot.get();
}

void Metrics::AddTo(const std::string& key, const char* name, MetricKind kind, const char* help,
                    double delta) {
  std::atomic<double>* value = Find(key, name, kind, help);
  double current = value->load(std::memory_order_relaxed);
  while (!value->compare_exchange_weak(current, current + delta, std::memory_order_relaxed)) {
  }
}

void Metrics::Declare(const Counter& c) { Find(c.name, c.name, MetricKind::kCounter, c.help); }

void Metrics::Declare(const Gauge& g) { Find(g.name, g.name, MetricKind::kGauge, g.help); }

void Metrics::Declare(const Histogram& h) {
  common::MutexLock lock(mu_);
  DescribeLocked(h.name, MetricKind::kHistogram, h.help);
  histograms_.emplace(h.name, Empty());
}

void Metrics::DeclareLabelled(const Counter& c) {
  common::MutexLock lock(mu_);
  DescribeLocked(c.name, MetricKind::kCounter, c.help);
}

void Metrics::Add(const Counter& c, double delta) {
  AddTo(c.name, c.name, MetricKind::kCounter, c.help, delta);
}

void Metrics::Add(const Counter& c, const std::string& labels, double delta) {
  AddTo(std::string(c.name) + "{" + labels + "}", c.name, MetricKind::kCounter, c.help, delta);
}

void Metrics::Add(const Gauge& g, double delta) {
  AddTo(g.name, g.name, MetricKind::kGauge, g.help, delta);
}

void Metrics::Set(const Gauge& g, double value) {
  Find(g.name, g.name, MetricKind::kGauge, g.help)->store(value, std::memory_order_relaxed);
}

void Metrics::Observe(const Histogram& histogram, double seconds) {
  common::MutexLock lock(mu_);
  DescribeLocked(histogram.name, MetricKind::kHistogram, histogram.help);
  auto [it, added] = histograms_.emplace(histogram.name, HistogramSnapshot());
  HistogramSnapshot& h = it->second;
  if (added) h = Empty();
  for (size_t i = 0; i < h.bounds.size(); ++i) {
    if (seconds <= h.bounds[i]) h.counts[i]++;
  }
  h.counts.back()++;
  h.sum += seconds;
  h.count++;
}

std::map<std::string, HistogramSnapshot> Metrics::Histograms() const {
  common::MutexLock lock(mu_);
  return histograms_;
}

std::map<std::string, MetricDescription> Metrics::Descriptions() const {
  common::MutexLock lock(mu_);
  return {descriptions_.begin(), descriptions_.end()};
}

std::map<std::string, double> Metrics::Snapshot() const {
  common::MutexLock lock(mu_);
  std::map<std::string, double> out;
  for (const auto& [name, value] : values_) out[name] = value->load(std::memory_order_relaxed);
  return out;
}

double Metrics::Get(const std::string& key) const {
  common::MutexLock lock(mu_);
  auto it = values_.find(key);
  return it == values_.end() ? 0.0 : it->second->load(std::memory_order_relaxed);
}

}  // namespace refit
