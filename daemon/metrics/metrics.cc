#include "daemon/metrics/metrics.h"

namespace refit {

namespace metrics_internal {

// 100 us .. ~100 s, x ~3 per step: publish/apply of KiB to TiB.
const double kBounds[kHistogramBounds] = {0.0001, 0.0003, 0.001, 0.003, 0.01, 0.03, 0.1,
                                          0.3,    1,      3,     10,    30,   100};

void HistogramCell::Observe(double seconds) {
  int bucket = 0;
  while (bucket < kHistogramBounds && !(seconds <= kBounds[bucket])) ++bucket;
  buckets[bucket].fetch_add(1, std::memory_order_relaxed);
  double current = sum.load(std::memory_order_relaxed);
  while (!sum.compare_exchange_weak(current, current + seconds, std::memory_order_relaxed)) {
  }
  count.fetch_add(1, std::memory_order_relaxed);
}

HistogramSnapshot HistogramCell::Read() const {
  HistogramSnapshot h;
  h.bounds.assign(kBounds, kBounds + kHistogramBounds);
  h.counts.resize(kHistogramBounds + 1);
  uint64_t cumulative = 0;
  for (int i = 0; i <= kHistogramBounds; ++i) {
    cumulative += buckets[i].load(std::memory_order_relaxed);
    h.counts[i] = cumulative;
  }
  h.sum = sum.load(std::memory_order_relaxed);
  h.count = count.load(std::memory_order_relaxed);
  return h;
}

}  // namespace metrics_internal

using metrics_internal::Cell;
using metrics_internal::HistogramCell;

void Metrics::DescribeLocked(const char* name, MetricKind kind, const char* help) {
  if (descriptions_.find(std::string_view(name)) == descriptions_.end()) {
    descriptions_.emplace(name, MetricDescription{kind, help});
  }
}

Cell* Metrics::Find(std::string_view key, const char* name, MetricKind kind, const char* help,
                    bool listed) {
  common::MutexLock lock(mu_);
  DescribeLocked(name, kind, help);
  auto it = values_.find(key);
  if (it == values_.end()) {
    auto cell = std::make_unique<Cell>();
    cell->listed.store(listed, std::memory_order_relaxed);
    it = values_.emplace(std::string(key), std::move(cell)).first;
  }
  return it->second.get();
}

HistogramCell* Metrics::FindHistogram(const Histogram& histogram) {
  common::MutexLock lock(mu_);
  DescribeLocked(histogram.name, MetricKind::kHistogram, histogram.help);
  auto it = histograms_.find(std::string_view(histogram.name));
  if (it == histograms_.end()) {
    it = histograms_.emplace(histogram.name, std::make_unique<HistogramCell>()).first;
  }
  return it->second.get();
}

CounterHandle Metrics::Declare(const Counter& c) {
  return CounterHandle(Find(c.name, c.name, MetricKind::kCounter, c.help));
}

GaugeHandle Metrics::Declare(const Gauge& g) {
  return GaugeHandle(Find(g.name, g.name, MetricKind::kGauge, g.help));
}

HistogramHandle Metrics::Declare(const Histogram& h) { return HistogramHandle(FindHistogram(h)); }

void Metrics::DeclareLabelled(const Counter& c) {
  common::MutexLock lock(mu_);
  DescribeLocked(c.name, MetricKind::kCounter, c.help);
}

CounterHandle Metrics::Series(const Counter& c, const std::string& labels) {
  return CounterHandle(Find(std::string(c.name) + "{" + labels + "}", c.name, MetricKind::kCounter,
                            c.help, /*listed=*/false));
}

void Metrics::Add(const Counter& c, double delta) {
  Find(c.name, c.name, MetricKind::kCounter, c.help)->Add(delta);
}

void Metrics::Add(const Counter& c, const std::string& labels, double delta) {
  Find(std::string(c.name) + "{" + labels + "}", c.name, MetricKind::kCounter, c.help)->Add(delta);
}

void Metrics::Add(const Gauge& g, double delta) {
  Find(g.name, g.name, MetricKind::kGauge, g.help)->Add(delta);
}

void Metrics::Set(const Gauge& g, double value) {
  Find(g.name, g.name, MetricKind::kGauge, g.help)->value.store(value, std::memory_order_relaxed);
}

void Metrics::Observe(const Histogram& histogram, double seconds) {
  FindHistogram(histogram)->Observe(seconds);
}

std::map<std::string, HistogramSnapshot> Metrics::Histograms() const {
  common::MutexLock lock(mu_);
  std::map<std::string, HistogramSnapshot> out;
  for (const auto& [name, cell] : histograms_) out.emplace(name, cell->Read());
  return out;
}

std::map<std::string, MetricDescription> Metrics::Descriptions() const {
  common::MutexLock lock(mu_);
  return {descriptions_.begin(), descriptions_.end()};
}

std::map<std::string, double> Metrics::Snapshot() const {
  common::MutexLock lock(mu_);
  std::map<std::string, double> out;
  for (const auto& [key, cell] : values_) {
    if (cell->listed.load(std::memory_order_relaxed)) {
      out[key] = cell->value.load(std::memory_order_relaxed);
    }
  }
  return out;
}

double Metrics::Get(const std::string& key) const {
  common::MutexLock lock(mu_);
  auto it = values_.find(key);
  return it == values_.end() ? 0.0 : it->second->value.load(std::memory_order_relaxed);
}

}  // namespace refit
