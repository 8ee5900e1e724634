// MetricsRegistry: a process's Prometheus metrics — counters, gauges and
// histograms, alone or in label families — and their text exposition
// (format 0.0.4) for GET /metrics (DESIGN.md, "Observability").
//
//   MetricsRegistry registry;
//   Counter* pushed = registry.AddCounterFamily(
//       "pdserve_prefill_kv_pushed_bytes_total", "KV bytes pushed.",
//       {"transport"})->WithLabels({"tcp"});   // Once, at setup.
//   pushed->Increment(bytes);                  // On the hot path.
//   std::string text = registry.Exposition();
//
// Recording is lock-free and allocates nothing: a metric (or a family's
// child, got once by its label values) is a few relaxed atomics. Only
// registering, WithLabels and Exposition take a lock. Gauges that mirror
// state owned elsewhere are callbacks evaluated at scrape time.
//
// Names: a metric name must match [a-zA-Z_:][a-zA-Z0-9_:]*, a label name
// [a-zA-Z_][a-zA-Z0-9_]* without a leading "__"; counter names end in
// "_total" and no other name does; a histogram has no "le" label; a name is
// registered once. Breaking these is a programming error (PD_CHECK aborts).
// Label values and help text may hold any UTF-8; they are escaped.
//
// Thread-safety: every method from any thread. Callbacks run on the
// scraping thread, under the registry's lock: they must not call back into
// the registry, and must stay valid while the registry can be scraped.
// Ownership: the registry owns every metric and family; the pointers it
// returns stay valid for its lifetime.
#ifndef PDSERVE_COMMON_METRICS_H_
#define PDSERVE_COMMON_METRICS_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace pdserve {

// A monotonically increasing count.
class Counter {
 public:
  void Increment(uint64_t n = 1) {
    value_.fetch_add(n, std::memory_order_relaxed);
  }
  uint64_t value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<uint64_t> value_{0};
};

// A value that goes up and down.
class Gauge {
 public:
  void Set(double value) { value_.store(value, std::memory_order_relaxed); }
  void Add(double delta) { value_.fetch_add(delta, std::memory_order_relaxed); }
  double value() const { return value_.load(std::memory_order_relaxed); }

 private:
  std::atomic<double> value_{0};
};

// Observations counted in buckets with fixed upper bounds (le), their sum
// and count. Bounds are strictly increasing and finite; +Inf is implicit.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);

  // Adds one observation: a binary search and two relaxed atomic adds.
  void Observe(double value);
  // Observe(seconds).
  void ObserveDuration(absl::Duration duration) {
    Observe(absl::ToDoubleSeconds(duration));
  }

  const std::vector<double>& bounds() const { return bounds_; }
  // Observations so far, and their sum (a scrape may see a sum a few
  // observations apart from the buckets: each is a separate atomic).
  uint64_t count() const;
  double sum() const { return sum_.load(std::memory_order_relaxed); }
  // Observations in bucket `i` alone (not cumulative); i == bounds().size()
  // is the +Inf bucket.
  uint64_t bucket(size_t i) const {
    return buckets_[i].load(std::memory_order_relaxed);
  }

 private:
  const std::vector<double> bounds_;
  const std::unique_ptr<std::atomic<uint64_t>[]> buckets_;  // bounds + 1.
  std::atomic<double> sum_{0};
};

// Bucket bounds for latencies in seconds: 1 ms to 5 min.
std::vector<double> LatencyBuckets();
// `count` bounds: start, start*factor, start*factor^2, ...
std::vector<double> ExponentialBuckets(double start, double factor, int count);

// Metrics of one name, one per combination of label values. Get a child
// once with WithLabels (a lock and, the first time, an allocation), keep
// the pointer, and record on it lock-free.
template <typename Metric>
class MetricFamily {
 public:
  // The child for `label_values` (one per label name, in order), created
  // on first use. PD_CHECK: the count matches the label names.
  Metric* WithLabels(const std::vector<std::string>& label_values);

  const std::vector<std::string>& label_names() const { return label_names_; }

 private:
  friend class MetricsRegistry;
  MetricFamily(std::vector<std::string> label_names,
               std::function<std::unique_ptr<Metric>()> make)
      : label_names_(std::move(label_names)), make_(std::move(make)) {}

  const std::vector<std::string> label_names_;
  const std::function<std::unique_ptr<Metric>()> make_;
  mutable absl::Mutex mu_;
  // Sorted by label values: the exposition lists them in that order.
  std::map<std::vector<std::string>, std::unique_ptr<Metric>> children_
      ABSL_GUARDED_BY(mu_);
};

using CounterFamily = MetricFamily<Counter>;
using GaugeFamily = MetricFamily<Gauge>;
using HistogramFamily = MetricFamily<Histogram>;

// One sample a labelled callback gauge reports at scrape time.
struct LabeledValue {
  std::vector<std::string> label_values;  // One per label name, in order.
  double value = 0;
};

class MetricsRegistry {
 public:
  MetricsRegistry();
  ~MetricsRegistry();
  MetricsRegistry(const MetricsRegistry&) = delete;
  MetricsRegistry& operator=(const MetricsRegistry&) = delete;

  // Metrics without labels.
  Counter* AddCounter(absl::string_view name, absl::string_view help);
  Gauge* AddGauge(absl::string_view name, absl::string_view help);
  Histogram* AddHistogram(absl::string_view name, absl::string_view help,
                          std::vector<double> bounds);

  // Label families.
  CounterFamily* AddCounterFamily(absl::string_view name,
                                  absl::string_view help,
                                  std::vector<std::string> label_names);
  GaugeFamily* AddGaugeFamily(absl::string_view name, absl::string_view help,
                              std::vector<std::string> label_names);
  HistogramFamily* AddHistogramFamily(absl::string_view name,
                                      absl::string_view help,
                                      std::vector<std::string> label_names,
                                      std::vector<double> bounds);

  // A gauge whose value `read` returns at each scrape.
  void AddCallbackGauge(absl::string_view name, absl::string_view help,
                        std::function<double()> read);
  // A labelled gauge whose samples `read` appends at each scrape (none is
  // fine: the family then shows only its HELP and TYPE). Samples with the
  // wrong number of label values are dropped.
  void AddCallbackGaugeFamily(
      absl::string_view name, absl::string_view help,
      std::vector<std::string> label_names,
      std::function<void(std::vector<LabeledValue>*)> read);

  // Counters whose value is read at each scrape from a count kept
  // elsewhere (it must never decrease), alone or labelled as above.
  void AddCallbackCounter(absl::string_view name, absl::string_view help,
                          std::function<double()> read);
  void AddCallbackCounterFamily(
      absl::string_view name, absl::string_view help,
      std::vector<std::string> label_names,
      std::function<void(std::vector<LabeledValue>*)> read);

  // The Prometheus text exposition (format 0.0.4) of every metric, in
  // registration order.
  std::string Exposition() const;

  // The Content-Type of Exposition()'s text.
  static constexpr absl::string_view kContentType =
      "text/plain; version=0.0.4; charset=utf-8";

 private:
  struct Entry;
  Entry& Register(absl::string_view name, absl::string_view help,
                  int type, std::vector<std::string> label_names)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  mutable absl::Mutex mu_;
  std::vector<std::unique_ptr<Entry>> entries_ ABSL_GUARDED_BY(mu_);
};

// Text-format helpers, exposed for tests: a sample value ("+Inf", "NaN",
// integers exactly, others in the shortest form that reads back equal),
// and a label value escaped (backslash, double quote, newline).
std::string FormatMetricValue(double value);
std::string EscapeLabelValue(absl::string_view value);

// The sum of metric `name`'s samples in a Prometheus text exposition (what
// a /metrics page answers): over every label set, or over those whose
// labels hold `label` (e.g. `role="prefill"`) when it is not empty. nullopt
// when the exposition has no such sample; INVALID_ARGUMENT for a sample
// whose value does not read as a number.
absl::StatusOr<std::optional<double>> SumOfSamples(absl::string_view exposition,
                                                   absl::string_view name,
                                                   absl::string_view label = "");

extern template class MetricFamily<Counter>;
extern template class MetricFamily<Gauge>;
extern template class MetricFamily<Histogram>;

}  // namespace pdserve

#endif  // PDSERVE_COMMON_METRICS_H_
