#include "common/metrics.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/check.h"

namespace pdserve {
namespace {

enum Type { kCounter, kGauge, kHistogram };

constexpr absl::string_view kTypeNames[] = {"counter", "gauge", "histogram"};

bool IsMetricName(absl::string_view name) {
  if (name.empty()) return false;
  for (size_t i = 0; i < name.size(); ++i) {
    const char c = name[i];
    const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') ||
                       c == '_' || c == ':';
    if (!alpha && !(i > 0 && c >= '0' && c <= '9')) return false;
  }
  return true;
}

bool IsLabelName(absl::string_view name) {
  return IsMetricName(name) && name.find(':') == absl::string_view::npos &&
         !absl::StartsWith(name, "__");
}

std::string EscapeHelp(absl::string_view help) {
  std::string out;
  out.reserve(help.size());
  for (const char c : help) {
    if (c == '\\') {
      out += "\\\\";
    } else if (c == '\n') {
      out += "\\n";
    } else {
      out += c;
    }
  }
  return out;
}

// `{a="x",b="y"` (no closing brace: the caller may add `le`), or empty.
std::string LabelPairs(const std::vector<std::string>& names,
                       const std::vector<std::string>& values) {
  std::string out;
  for (size_t i = 0; i < names.size(); ++i) {
    absl::StrAppend(&out, i == 0 ? "{" : ",", names[i], "=\"",
                    EscapeLabelValue(values[i]), "\"");
  }
  return out;
}

std::string Close(const std::string& pairs) {
  return pairs.empty() ? "" : absl::StrCat(pairs, "}");
}

}  // namespace

Histogram::Histogram(std::vector<double> bounds)
    : bounds_(std::move(bounds)),
      buckets_(new std::atomic<uint64_t>[bounds_.size() + 1]) {
  for (size_t i = 0; i < bounds_.size(); ++i) {
    PD_CHECK(std::isfinite(bounds_[i])) << "histogram bound " << bounds_[i];
    PD_CHECK(i == 0 || bounds_[i - 1] < bounds_[i])
        << "histogram bounds must increase";
  }
  for (size_t i = 0; i <= bounds_.size(); ++i) {
    buckets_[i].store(0, std::memory_order_relaxed);
  }
}

void Histogram::Observe(double value) {
  // The first bound >= value: Prometheus buckets are "less or equal".
  const size_t bucket =
      std::lower_bound(bounds_.begin(), bounds_.end(), value) - bounds_.begin();
  buckets_[bucket].fetch_add(1, std::memory_order_relaxed);
  sum_.fetch_add(value, std::memory_order_relaxed);
}

uint64_t Histogram::count() const {
  uint64_t total = 0;
  for (size_t i = 0; i <= bounds_.size(); ++i) total += bucket(i);
  return total;
}

std::vector<double> LatencyBuckets() {
  return {0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
          0.5,   1,      2.5,   5,    10,    30,   60,  300};
}

std::vector<double> ExponentialBuckets(double start, double factor,
                                       int count) {
  PD_CHECK(start > 0 && factor > 1 && count >= 1) << "bad exponential buckets";
  std::vector<double> bounds;
  bounds.reserve(count);
  double bound = start;
  for (int i = 0; i < count; ++i, bound *= factor) bounds.push_back(bound);
  return bounds;
}

template <typename Metric>
Metric* MetricFamily<Metric>::WithLabels(
    const std::vector<std::string>& label_values) {
  PD_CHECK(label_values.size() == label_names_.size())
      << label_values.size() << " label values for " << label_names_.size()
      << " labels";
  absl::MutexLock lock(&mu_);
  std::unique_ptr<Metric>& child = children_[label_values];
  if (child == nullptr) child = make_();
  return child.get();
}

template class MetricFamily<Counter>;
template class MetricFamily<Gauge>;
template class MetricFamily<Histogram>;

struct MetricsRegistry::Entry {
  std::string name;
  std::string help;
  Type type;
  std::vector<std::string> label_names;
  // Exactly one of these is set.
  std::unique_ptr<CounterFamily> counters;
  std::unique_ptr<GaugeFamily> gauges;
  std::unique_ptr<HistogramFamily> histograms;
  std::function<void(std::vector<LabeledValue>*)> read;
};

MetricsRegistry::MetricsRegistry() = default;
MetricsRegistry::~MetricsRegistry() = default;

MetricsRegistry::Entry& MetricsRegistry::Register(
    absl::string_view name, absl::string_view help, int type,
    std::vector<std::string> label_names) {
  PD_CHECK(IsMetricName(name)) << "bad metric name '" << name << "'";
  PD_CHECK((type == kCounter) == absl::EndsWith(name, "_total"))
      << "'" << name << "': counter names, and only they, end in _total";
  for (const std::string& label : label_names) {
    PD_CHECK(IsLabelName(label)) << "bad label name '" << label << "'";
    PD_CHECK(!(type == kHistogram && label == "le"))
        << "'" << name << "': a histogram has no 'le' label";
    PD_CHECK(std::count(label_names.begin(), label_names.end(), label) == 1)
        << "'" << name << "': label '" << label << "' twice";
  }
  for (const auto& entry : entries_) {
    PD_CHECK(entry->name != name) << "metric '" << name << "' registered twice";
  }
  auto entry = std::make_unique<Entry>();
  entry->name = std::string(name);
  entry->help = EscapeHelp(help);
  entry->type = static_cast<Type>(type);
  entry->label_names = std::move(label_names);
  entries_.push_back(std::move(entry));
  return *entries_.back();
}

CounterFamily* MetricsRegistry::AddCounterFamily(
    absl::string_view name, absl::string_view help,
    std::vector<std::string> label_names) {
  absl::MutexLock lock(&mu_);
  Entry& entry = Register(name, help, kCounter, label_names);
  entry.counters.reset(new CounterFamily(
      std::move(label_names), [] { return std::make_unique<Counter>(); }));
  return entry.counters.get();
}

GaugeFamily* MetricsRegistry::AddGaugeFamily(
    absl::string_view name, absl::string_view help,
    std::vector<std::string> label_names) {
  absl::MutexLock lock(&mu_);
  Entry& entry = Register(name, help, kGauge, label_names);
  entry.gauges.reset(new GaugeFamily(
      std::move(label_names), [] { return std::make_unique<Gauge>(); }));
  return entry.gauges.get();
}

HistogramFamily* MetricsRegistry::AddHistogramFamily(
    absl::string_view name, absl::string_view help,
    std::vector<std::string> label_names, std::vector<double> bounds) {
  // Checked here, where the caller can see it, not at the first child.
  Histogram check(bounds);
  absl::MutexLock lock(&mu_);
  Entry& entry = Register(name, help, kHistogram, label_names);
  entry.histograms.reset(new HistogramFamily(
      std::move(label_names), [bounds = std::move(bounds)] {
        return std::make_unique<Histogram>(bounds);
      }));
  return entry.histograms.get();
}

Counter* MetricsRegistry::AddCounter(absl::string_view name,
                                     absl::string_view help) {
  return AddCounterFamily(name, help, {})->WithLabels({});
}

Gauge* MetricsRegistry::AddGauge(absl::string_view name,
                                 absl::string_view help) {
  return AddGaugeFamily(name, help, {})->WithLabels({});
}

Histogram* MetricsRegistry::AddHistogram(absl::string_view name,
                                         absl::string_view help,
                                         std::vector<double> bounds) {
  return AddHistogramFamily(name, help, {}, std::move(bounds))->WithLabels({});
}

void MetricsRegistry::AddCallbackGauge(absl::string_view name,
                                       absl::string_view help,
                                       std::function<double()> read) {
  AddCallbackGaugeFamily(
      name, help, {},
      [read = std::move(read)](std::vector<LabeledValue>* out) {
        out->push_back({.label_values = {}, .value = read()});
      });
}

void MetricsRegistry::AddCallbackGaugeFamily(
    absl::string_view name, absl::string_view help,
    std::vector<std::string> label_names,
    std::function<void(std::vector<LabeledValue>*)> read) {
  absl::MutexLock lock(&mu_);
  Register(name, help, kGauge, std::move(label_names)).read = std::move(read);
}

void MetricsRegistry::AddCallbackCounter(absl::string_view name,
                                         absl::string_view help,
                                         std::function<double()> read) {
  AddCallbackCounterFamily(
      name, help, {},
      [read = std::move(read)](std::vector<LabeledValue>* out) {
        out->push_back({.label_values = {}, .value = read()});
      });
}

void MetricsRegistry::AddCallbackCounterFamily(
    absl::string_view name, absl::string_view help,
    std::vector<std::string> label_names,
    std::function<void(std::vector<LabeledValue>*)> read) {
  absl::MutexLock lock(&mu_);
  Register(name, help, kCounter, std::move(label_names)).read = std::move(read);
}

std::string MetricsRegistry::Exposition() const {
  std::string out;
  absl::MutexLock lock(&mu_);
  for (const auto& entry : entries_) {
    const std::string& name = entry->name;
    absl::StrAppend(&out, "# HELP ", name, " ", entry->help, "\n# TYPE ", name,
                    " ", kTypeNames[entry->type], "\n");
    if (entry->read) {
      std::vector<LabeledValue> samples;
      entry->read(&samples);
      for (const LabeledValue& sample : samples) {
        if (sample.label_values.size() != entry->label_names.size()) continue;
        absl::StrAppend(
            &out, name,
            Close(LabelPairs(entry->label_names, sample.label_values)), " ",
            FormatMetricValue(sample.value), "\n");
      }
    } else if (entry->counters) {
      absl::MutexLock family_lock(&entry->counters->mu_);
      for (const auto& [values, counter] : entry->counters->children_) {
        absl::StrAppend(&out, name,
                        Close(LabelPairs(entry->label_names, values)), " ",
                        counter->value(), "\n");
      }
    } else if (entry->gauges) {
      absl::MutexLock family_lock(&entry->gauges->mu_);
      for (const auto& [values, gauge] : entry->gauges->children_) {
        absl::StrAppend(&out, name,
                        Close(LabelPairs(entry->label_names, values)), " ",
                        FormatMetricValue(gauge->value()), "\n");
      }
    } else if (entry->histograms) {
      absl::MutexLock family_lock(&entry->histograms->mu_);
      for (const auto& [values, histogram] : entry->histograms->children_) {
        const std::string pairs = LabelPairs(entry->label_names, values);
        const std::string le_prefix = pairs.empty() ? "{le=\"" : pairs + ",le=\"";
        const std::vector<double>& bounds = histogram->bounds();
        uint64_t cumulative = 0;
        for (size_t i = 0; i <= bounds.size(); ++i) {
          cumulative += histogram->bucket(i);
          absl::StrAppend(
              &out, name, "_bucket", le_prefix,
              i < bounds.size() ? FormatMetricValue(bounds[i]) : "+Inf",
              "\"} ", cumulative, "\n");
        }
        absl::StrAppend(&out, name, "_sum", Close(pairs), " ",
                        FormatMetricValue(histogram->sum()), "\n", name,
                        "_count", Close(pairs), " ", cumulative, "\n");
      }
    }
  }
  return out;
}

std::string FormatMetricValue(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "+Inf" : "-Inf";
  char buffer[64];
  const auto [end, ec] = std::to_chars(buffer, buffer + sizeof(buffer), value);
  PD_CHECK(ec == std::errc()) << "to_chars failed";
  return std::string(buffer, end);
}

std::string EscapeLabelValue(absl::string_view value) {
  std::string out;
  out.reserve(value.size());
  for (const char c : value) {
    switch (c) {
      case '\\':
        out += "\\\\";
        break;
      case '"':
        out += "\\\"";
        break;
      case '\n':
        out += "\\n";
        break;
      default:
        out += c;
    }
  }
  return out;
}

absl::StatusOr<std::optional<double>> SumOfSamples(absl::string_view exposition,
                                                   absl::string_view name,
                                                   absl::string_view label) {
  std::optional<double> sum;
  for (absl::string_view line : absl::StrSplit(exposition, '\n')) {
    // "name value" or "name{labels} value"; comments start with '#'.
    if (!absl::StartsWith(line, name) || line.size() <= name.size()) continue;
    const char next = line[name.size()];
    if (next != ' ' && next != '{') continue;
    if (!label.empty()) {
      const size_t close = line.find('}');
      if (next != '{' || close == absl::string_view::npos ||
          !absl::StrContains(line.substr(name.size(), close - name.size()), label)) {
        continue;
      }
    }
    double value = 0;
    if (!absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &value)) {
      return absl::InvalidArgumentError(absl::StrCat("an unreadable sample: ", line));
    }
    sum = sum.value_or(0) + value;
  }
  return sum;
}

}  // namespace pdserve
