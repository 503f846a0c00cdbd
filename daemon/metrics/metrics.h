#pragma once

// Process-wide counters, gauges and histograms. Each metric is declared where it is counted,
// as a typed constant with its public name (docs/api.md) and its HELP text, e.g.
//
//   inline constexpr Counter kApplyBytes{"refit_apply_bytes_total",
//                                        "Bytes written into DESTINATION buffers by Apply."};
//
// and the component that counts it declares it when it starts (Metrics::Declare), so Status and
// /metrics list it from the start, at 0, with its HELP. A counter only goes up (Add), a gauge
// is set or moved (Set, Add), a histogram observes seconds (Observe): the type says which.
//
// Declaring resolves the metric once and returns a handle to its value (CounterHandle,
// GaugeHandle, HistogramHandle), e.g.
//
//   CounterHandle apply_bytes = metrics->Declare(kApplyBytes);
//   apply_bytes.Add(n);  // an atomic add on a stable address: no lock, no string, no lookup
//
// A labelled series whose labels are known up front (one per status code) is resolved once the
// same way (Metrics::Series); it is listed only once it has moved, as before. The by-name
// entry points (Metrics::Add(kApplyBytes, n), Set, Observe) still work, through the same
// registry: they take the registry's lock and look the series up on each call, so they are for
// cold paths (and code not yet converted); metrics_bench compares the two.
//
// Thread-safe. A handle stays valid as long as its Metrics; copying one is cheap. Handle
// operations are lock-free (relaxed atomics); Snapshot/Histograms read each value atomically,
// but a histogram observed concurrently may be read between its bucket and its count updates.

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "daemon/common/mutex.h"

namespace refit {

enum class MetricKind { kCounter, kGauge, kHistogram };

// The typed declarations. `name` follows Prometheus's conventions (a counter ends in _total,
// the unit is in the name: _bytes, _seconds); `help` is one sentence for # HELP.
struct Counter {
  const char* name;
  const char* help;
  operator std::string() const { return name; }  // a Status / Snapshot key
};
struct Gauge {
  const char* name;
  const char* help;
  operator std::string() const { return name; }
};
struct Histogram {  // of seconds
  const char* name;
  const char* help;
  operator std::string() const { return name; }
};

// A cumulative histogram with fixed bucket bounds, Prometheus style.
struct HistogramSnapshot {
  std::vector<double> bounds;    // upper bounds, ascending; +Inf implied
  std::vector<uint64_t> counts;  // cumulative count per bound, then +Inf
  double sum = 0;
  uint64_t count = 0;
};

struct MetricDescription {
  MetricKind kind;
  std::string help;
};

namespace metrics_internal {

// One series' value. `listed` is false for a labelled series resolved up front that has not
// moved yet (Snapshot leaves it out, as it would a series never counted).
struct Cell {
  std::atomic<double> value{0.0};
  std::atomic<bool> listed{true};

  void Add(double delta) {
    double current = value.load(std::memory_order_relaxed);
    while (!value.compare_exchange_weak(current, current + delta, std::memory_order_relaxed)) {
    }
    if (!listed.load(std::memory_order_relaxed)) listed.store(true, std::memory_order_relaxed);
  }
};

// The fixed bucket bounds of every histogram (100 us .. 100 s).
inline constexpr int kHistogramBounds = 13;
extern const double kBounds[kHistogramBounds];

// One histogram: a non-cumulative count per bucket (then +Inf), its sum and its count.
struct HistogramCell {
  std::atomic<uint64_t> buckets[kHistogramBounds + 1] = {};
  std::atomic<double> sum{0.0};
  std::atomic<uint64_t> count{0};

  void Observe(double seconds);
  HistogramSnapshot Read() const;
};

}  // namespace metrics_internal

// A counter (or one labelled series of it), resolved: Add is one atomic add. A default handle
// (no Metrics) counts nothing.
class CounterHandle {
 public:
  CounterHandle() = default;
  void Add(double delta) const {
    if (cell_) cell_->Add(delta);
  }

 private:
  friend class Metrics;
  explicit CounterHandle(metrics_internal::Cell* cell) : cell_(cell) {}
  metrics_internal::Cell* cell_ = nullptr;
};

// A gauge, resolved: Set is one atomic store, Add one atomic add.
class GaugeHandle {
 public:
  GaugeHandle() = default;
  void Set(double value) const {
    if (cell_) cell_->value.store(value, std::memory_order_relaxed);
  }
  void Add(double delta) const {
    if (cell_) cell_->Add(delta);
  }

 private:
  friend class Metrics;
  explicit GaugeHandle(metrics_internal::Cell* cell) : cell_(cell) {}
  metrics_internal::Cell* cell_ = nullptr;
};

// A histogram of seconds, resolved: Observe is a few atomic adds.
class HistogramHandle {
 public:
  HistogramHandle() = default;
  void Observe(double seconds) const {
    if (cell_) cell_->Observe(seconds);
  }

 private:
  friend class Metrics;
  explicit HistogramHandle(metrics_internal::HistogramCell* cell) : cell_(cell) {}
  metrics_internal::HistogramCell* cell_ = nullptr;
};

class Metrics {
 public:
  // Lists the metric from now on (at 0; a histogram with no observations), with its HELP, and
  // returns its handle (declaring again returns the same one).
  CounterHandle Declare(const Counter& counter);
  GaugeHandle Declare(const Gauge& gauge);
  HistogramHandle Declare(const Histogram& histogram);
  // Only the HELP of a counter whose series carry labels (none is listed before it moves).
  void DeclareLabelled(const Counter& counter);
  // The series of `counter` with `labels` (e.g. code="NOT_FOUND"), resolved once: listed from
  // its first Add, like a series counted by name.
  CounterHandle Series(const Counter& counter, const std::string& labels);

  // By name: the registry's lock and a lookup on each call (see the comment at the top).
  void Add(const Counter& counter, double delta);
  // The series of `counter` with `labels`, e.g. code="NOT_FOUND".
  void Add(const Counter& counter, const std::string& labels, double delta);
  void Add(const Gauge& gauge, double delta);
  void Set(const Gauge& gauge, double value);
  void Observe(const Histogram& histogram, double seconds);

  // Every series ("name" or "name{labels}") and its value.
  std::map<std::string, double> Snapshot() const;
  double Get(const std::string& key) const;
  std::map<std::string, HistogramSnapshot> Histograms() const;
  // Kind and HELP by metric name, of everything declared or counted.
  std::map<std::string, MetricDescription> Descriptions() const;

 private:
  // Under mu_: records `name`'s kind and HELP the first time it is seen.
  void DescribeLocked(const char* name, MetricKind kind, const char* help)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The series `key` of metric `name` (created at 0; unlisted until it moves if `listed` is
  // false and it is new).
  metrics_internal::Cell* Find(std::string_view key, const char* name, MetricKind kind,
                               const char* help, bool listed = true);
  metrics_internal::HistogramCell* FindHistogram(const Histogram& histogram);

  mutable common::Mutex mu_;
  // Cells never move or go before the Metrics does: handles point at them.
  std::map<std::string, std::unique_ptr<metrics_internal::Cell>, std::less<>> values_
      ABSL_GUARDED_BY(mu_);
  std::map<std::string, std::unique_ptr<metrics_internal::HistogramCell>, std::less<>> histograms_
      ABSL_GUARDED_BY(mu_);
  std::map<std::string, MetricDescription, std::less<>> descriptions_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit
