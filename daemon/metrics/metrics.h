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
// Thread-safe; adding to a metric is lock-free once it exists.

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

class Metrics {
 public:
  // Lists the metric from now on (at 0; a histogram with no observations), with its HELP.
  void Declare(const Counter& counter);
  void Declare(const Gauge& gauge);
  void Declare(const Histogram& histogram);
  // Only the HELP of a counter whose series carry labels (none is listed before it moves).
  void DeclareLabelled(const Counter& counter);

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
  // The series `key` of metric `name` (created at 0).
  std::atomic<double>* Find(const std::string& key, const char* name, MetricKind kind,
                            const char* help);
  void AddTo(const std::string& key, const char* name, MetricKind kind, const char* help,
             double delta);

  mutable common::Mutex mu_;
  std::map<std::string, std::unique_ptr<std::atomic<double>>> values_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, HistogramSnapshot> histograms_ ABSL_GUARDED_BY(mu_);
  std::map<std::string, MetricDescription, std::less<>> descriptions_ ABSL_GUARDED_BY(mu_);
};

}  // namespace refit
