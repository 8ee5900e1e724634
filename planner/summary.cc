#include "planner/summary.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <map>
#include <numeric>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"

namespace pdserve::planner {
namespace {

using nlohmann::json;

absl::Status FieldError(const char* name, const char* what) {
  return absl::InvalidArgumentError(
      absl::StrCat("record field '", name, "' ", what));
}

absl::StatusOr<const json*> Field(const json& object, const char* name) {
  const auto it = object.find(name);
  if (it == object.end()) return FieldError(name, "is missing");
  return &*it;
}

absl::StatusOr<double> DoubleField(const json& object, const char* name) {
  PD_ASSIGN_OR_RETURN(const json* field, Field(object, name));
  if (!field->is_number()) return FieldError(name, "is not a number");
  return field->get<double>();
}

template <typename Int>
absl::StatusOr<Int> IntField(const json& object, const char* name) {
  PD_ASSIGN_OR_RETURN(const json* field, Field(object, name));
  if (!field->is_number_integer()) return FieldError(name, "is not an integer");
  const bool fits =
      field->is_number_unsigned()
          ? field->get<uint64_t>() <=
                static_cast<uint64_t>(std::numeric_limits<Int>::max())
          : field->get<int64_t>() >= std::numeric_limits<Int>::min() &&
                field->get<int64_t>() <= std::numeric_limits<Int>::max();
  if (!fits) return FieldError(name, "is out of range");
  return field->is_number_unsigned() ? static_cast<Int>(field->get<uint64_t>())
                                     : static_cast<Int>(field->get<int64_t>());
}

absl::StatusOr<std::string> StringField(const json& object, const char* name) {
  PD_ASSIGN_OR_RETURN(const json* field, Field(object, name));
  if (!field->is_string()) return FieldError(name, "is not a string");
  return field->get<std::string>();
}

// The per-request figures of one counted record; a figure that does not
// apply is left out (NaN).
struct RequestLatencies {
  double ttft_s = std::nan("");
  double tpot_s = std::nan("");
  double e2e_s = std::nan("");
};

// Output tokens are counted by `output_tokens` (what the server says it
// sent), token times by `token_s`; the two agree for records of pd-bench
// and the simulator.
RequestLatencies Latencies(const RequestRecord& record) {
  RequestLatencies latencies;
  if (record.token_s.empty()) {
    latencies.e2e_s = record.end_s - record.send_s;
    return latencies;
  }
  latencies.ttft_s = record.token_s.front() - record.send_s;
  latencies.e2e_s = record.token_s.back() - record.send_s;
  if (record.output_tokens >= 2) {
    latencies.tpot_s =
        (latencies.e2e_s - latencies.ttft_s) / (record.output_tokens - 1);
  }
  return latencies;
}

bool MeetsSlo(const RequestRecord& record, const RequestLatencies& latencies,
              const SloTargets& slo) {
  if (!record.ok()) return false;
  // No first token: no TTFT to meet a finite target with.
  const double ttft = std::isnan(latencies.ttft_s)
                          ? std::numeric_limits<double>::infinity()
                          : latencies.ttft_s;
  // Fewer than two tokens: no TPOT, so any target is met.
  const double tpot = std::isnan(latencies.tpot_s) ? 0 : latencies.tpot_s;
  return ttft <= slo.ttft_s && tpot <= slo.tpot_s;
}

json ToJson(const Distribution& d) {
  return json{{"count", d.count},
              {"mean", JsonNumber(d.mean)},
              {"p50", JsonNumber(d.p50)},
              {"p90", JsonNumber(d.p90)},
              {"p90_ci", json::array({JsonNumber(d.p90_low), JsonNumber(d.p90_high)})},
              {"p99", JsonNumber(d.p99)}};
}

}  // namespace

json JsonNumber(double value) {
  if (std::isfinite(value)) return value;
  return nullptr;
}

json ToJson(const RequestRecord& record) {
  return json{{"index", record.index},
              {"send_s", record.send_s},
              {"token_s", record.token_s},
              {"end_s", record.end_s},
              {"input_tokens", record.input_tokens},
              {"output_tokens", record.output_tokens},
              {"outcome", record.outcome},
              {"error", record.error}};
}

absl::StatusOr<RequestRecord> RecordFromJson(const json& object) {
  if (!object.is_object())
    return absl::InvalidArgumentError("a record is not a JSON object");
  RequestRecord record;
  PD_ASSIGN_OR_RETURN(record.index, IntField<int64_t>(object, "index"));
  PD_ASSIGN_OR_RETURN(record.send_s, DoubleField(object, "send_s"));
  PD_ASSIGN_OR_RETURN(const json* tokens, Field(object, "token_s"));
  if (!tokens->is_array()) return FieldError("token_s", "is not an array");
  record.token_s.reserve(tokens->size());
  for (const json& t : *tokens) {
    if (!t.is_number())
      return FieldError("token_s", "holds something other than a number");
    record.token_s.push_back(t.get<double>());
  }
  PD_ASSIGN_OR_RETURN(record.end_s, DoubleField(object, "end_s"));
  PD_ASSIGN_OR_RETURN(record.input_tokens,
                      IntField<int32_t>(object, "input_tokens"));
  PD_ASSIGN_OR_RETURN(record.output_tokens,
                      IntField<int32_t>(object, "output_tokens"));
  PD_ASSIGN_OR_RETURN(record.outcome, StringField(object, "outcome"));
  // A successful record may leave out its empty error.
  if (object.contains("error")) {
    PD_ASSIGN_OR_RETURN(record.error, StringField(object, "error"));
  }
  return record;
}

absl::StatusOr<std::vector<RequestRecord>> ReadRecords(
    const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    const int error = errno;
    const std::string why =
        absl::StrCat("cannot read records ", path, ": ", std::strerror(error));
    if (error == ENOENT) return absl::NotFoundError(why);
    return absl::InvalidArgumentError(why);
  }
  std::vector<RequestRecord> records;
  std::string text;
  for (int64_t line = 1; std::getline(in, text); ++line) {
    if (absl::StripAsciiWhitespace(text).empty()) continue;
    const json object = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (object.is_discarded()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ":", line, ": not JSON"));
    }
    absl::StatusOr<RequestRecord> record = RecordFromJson(object);
    if (!record.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ":", line, ": ", record.status().message()));
    }
    records.push_back(*std::move(record));
  }
  if (in.bad())
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read records ", path));
  return records;
}

absl::Status WriteRecords(const std::string& path,
                          std::span<const RequestRecord> records) {
  std::ofstream out(path, std::ios::trunc);
  if (!out) {
    const int error = errno;
    const std::string why =
        absl::StrCat("cannot write records ", path, ": ", std::strerror(error));
    if (error == ENOENT) return absl::NotFoundError(why);
    if (error == EACCES) return absl::PermissionDeniedError(why);
    return absl::InvalidArgumentError(why);
  }
  for (const RequestRecord& record : records)
    out << ToJson(record).dump() << '\n';
  out.close();
  if (!out)
    return absl::DataLossError(
        absl::StrCat("writing records ", path, " failed"));
  return absl::OkStatus();
}

double Percentile(std::vector<double> values, double q) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const double rank = std::clamp(q, 0.0, 100.0) / 100 * (values.size() - 1);
  const size_t i = static_cast<size_t>(rank);
  if (i + 1 >= values.size()) return values.back();
  return values[i] + (values[i + 1] - values[i]) * (rank - i);
}

std::pair<int64_t, int64_t> QuantileIntervalRanks(int64_t n, double q, double confidence) {
  const double a = (1 - confidence) / 2;
  // P(B = k) for B ~ Binomial(n, q), in logs: n reaches the ITL's counts.
  auto pmf = [&](int64_t k) {
    return std::exp(std::lgamma(n + 1.0) - std::lgamma(k + 1.0) - std::lgamma(n - k + 1.0) +
                    k * std::log(q) + (n - k) * std::log1p(-q));
  };
  int64_t low = n;  // Reached by the loop: P(B <= n) = 1.
  double below = 0;  // P(B <= k)
  for (int64_t k = 0; k <= n; ++k) {
    below += pmf(k);
    if (below >= a) {
      low = k;
      break;
    }
  }
  // The upper tail summed from the top, where its terms are: P(B > k).
  int64_t high = n;
  double above = 0;
  for (int64_t k = n - 1; k >= 0; --k) {
    above += pmf(k + 1);
    if (above > a) break;
    high = k;
  }
  return {low - 1, high};
}

Distribution Describe(std::vector<double> values) {
  Distribution d;
  d.count = static_cast<int64_t>(values.size());
  if (values.empty()) return d;
  // Sorted once here, so that each Percentile's sort finds it in order.
  std::sort(values.begin(), values.end());
  d.mean = std::accumulate(values.begin(), values.end(), 0.0) / values.size();
  d.p50 = Percentile(values, 50);
  d.p90 = Percentile(values, 90);
  d.p99 = Percentile(values, 99);
  const auto [low, high] = QuantileIntervalRanks(d.count, 0.9, 0.9);
  if (low >= 0) d.p90_low = values[low];
  if (high < d.count) d.p90_high = values[high];
  return d;
}

Summary Summarize(std::span<const RequestRecord> records,
                  const SummaryOptions& options) {
  Summary summary;
  summary.slo = options.slo;
  std::vector<double> ttft, tpot, itl, e2e;
  std::map<std::string, int64_t> failures;
  double first_send = std::numeric_limits<double>::infinity();
  double last_end = -std::numeric_limits<double>::infinity();
  int64_t met = 0, input_tokens = 0, output_tokens = 0;
  for (const RequestRecord& record : records) {
    if (record.send_s < options.window_begin_s ||
        record.send_s >= options.window_end_s)
      continue;
    ++summary.requests;
    first_send = std::min(first_send, record.send_s);
    last_end = std::max(last_end, record.end_s);
    const RequestLatencies latencies = Latencies(record);
    if (MeetsSlo(record, latencies, options.slo)) ++met;
    if (!record.ok()) {
      ++failures[record.outcome];
      continue;
    }
    ++summary.completed;
    input_tokens += record.input_tokens;
    output_tokens += record.output_tokens;
    if (!std::isnan(latencies.ttft_s)) ttft.push_back(latencies.ttft_s);
    if (!std::isnan(latencies.tpot_s)) tpot.push_back(latencies.tpot_s);
    e2e.push_back(latencies.e2e_s);
    for (size_t i = 1; i < record.token_s.size(); ++i) {
      itl.push_back(record.token_s[i] - record.token_s[i - 1]);
    }
  }
  summary.failures.assign(failures.begin(), failures.end());
  if (summary.requests > 0) {
    summary.duration_s = last_end - first_send;
    summary.slo_attainment = static_cast<double>(met) / summary.requests;
  }
  if (summary.duration_s > 0) {
    summary.request_throughput = summary.completed / summary.duration_s;
    summary.input_token_throughput = input_tokens / summary.duration_s;
    summary.output_token_throughput = output_tokens / summary.duration_s;
  }
  summary.ttft_s = Describe(std::move(ttft));
  summary.tpot_s = Describe(std::move(tpot));
  summary.itl_s = Describe(std::move(itl));
  summary.e2e_s = Describe(std::move(e2e));
  return summary;
}

Summary MedianSummary(std::span<const Summary> runs) {
  if (runs.empty()) return {};
  auto median = [&](auto figure) {
    std::vector<double> values;
    for (const Summary& run : runs) values.push_back(static_cast<double>(figure(run)));
    // An interval bound a run does not have, none of the median either.
    if (std::ranges::any_of(values, [](double v) { return std::isnan(v); }))
      return std::numeric_limits<double>::quiet_NaN();
    return Percentile(std::move(values), 50);
  };
  auto distribution = [&](Distribution Summary::*field) {
    Distribution d;
    d.count = std::llround(median([&](const Summary& s) { return (s.*field).count; }));
    d.mean = median([&](const Summary& s) { return (s.*field).mean; });
    d.p50 = median([&](const Summary& s) { return (s.*field).p50; });
    d.p90 = median([&](const Summary& s) { return (s.*field).p90; });
    d.p90_low = median([&](const Summary& s) { return (s.*field).p90_low; });
    d.p90_high = median([&](const Summary& s) { return (s.*field).p90_high; });
    d.p99 = median([&](const Summary& s) { return (s.*field).p99; });
    return d;
  };
  Summary out = runs.front();
  out.requests = std::llround(median([](const Summary& s) { return s.requests; }));
  out.completed = std::llround(median([](const Summary& s) { return s.completed; }));
  out.duration_s = median([](const Summary& s) { return s.duration_s; });
  out.request_throughput = median([](const Summary& s) { return s.request_throughput; });
  out.input_token_throughput = median([](const Summary& s) { return s.input_token_throughput; });
  out.output_token_throughput = median([](const Summary& s) { return s.output_token_throughput; });
  out.ttft_s = distribution(&Summary::ttft_s);
  out.tpot_s = distribution(&Summary::tpot_s);
  out.itl_s = distribution(&Summary::itl_s);
  out.e2e_s = distribution(&Summary::e2e_s);
  out.slo_attainment = median([](const Summary& s) { return s.slo_attainment; });
  return out;
}

double Goodput(std::span<const SweepPoint> points, double attainment_target) {
  std::vector<const SweepPoint*> by_rate;
  for (const SweepPoint& point : points) {
    // A closed-loop point offered no rate.
    if (point.rate > 0) by_rate.push_back(&point);
  }
  std::stable_sort(by_rate.begin(), by_rate.end(),
                   [](const SweepPoint* a, const SweepPoint* b) {
                     return a->rate < b->rate;
                   });
  double goodput = 0;
  for (const SweepPoint* point : by_rate) {
    if (point->summary.slo_attainment < attainment_target) break;
    goodput = point->rate;
  }
  return goodput;
}

json ToJson(const Summary& summary) {
  json failures = json::object();
  for (const auto& [outcome, count] : summary.failures)
    failures[outcome] = count;
  return json{
      {"requests", summary.requests},
      {"completed", summary.completed},
      {"failures", failures},
      {"duration_s", JsonNumber(summary.duration_s)},
      {"request_throughput", JsonNumber(summary.request_throughput)},
      {"input_token_throughput", JsonNumber(summary.input_token_throughput)},
      {"output_token_throughput", JsonNumber(summary.output_token_throughput)},
      {"ttft_s", ToJson(summary.ttft_s)},
      {"tpot_s", ToJson(summary.tpot_s)},
      {"itl_s", ToJson(summary.itl_s)},
      {"e2e_s", ToJson(summary.e2e_s)},
      {"slo_attainment", JsonNumber(summary.slo_attainment)},
      {"slo", json{{"ttft_s", JsonNumber(summary.slo.ttft_s)},
                   {"tpot_s", JsonNumber(summary.slo.tpot_s)}}}};
}

json SweepToJson(std::span<const SweepPoint> points, double attainment_target) {
  json out = json::array();
  for (const SweepPoint& point : points) {
    json object = ToJson(point.summary);
    object["rate"] = JsonNumber(point.rate);
    object["concurrency"] = point.concurrency;
    out.push_back(std::move(object));
  }
  return json{{"points", std::move(out)},
              {"attainment_target", attainment_target},
              {"goodput", JsonNumber(Goodput(points, attainment_target))}};
}

namespace {

std::string RateCell(const SweepPoint& point) {
  if (point.rate == 0)
    return absl::StrFormat("closed, %d in flight", point.concurrency);
  if (std::isinf(point.rate)) return "inf";
  return absl::StrFormat("%.2f", point.rate);
}

std::string MsCells(const Distribution& d) {
  return absl::StrFormat("%.1f | %.1f | %.1f | %.1f", d.mean * 1e3, d.p50 * 1e3,
                         d.p90 * 1e3, d.p99 * 1e3);
}

std::string TargetMs(double target_s) {
  return std::isinf(target_s) ? "none"
                              : absl::StrFormat("%.0f ms", target_s * 1e3);
}

}  // namespace

std::string SweepTable(std::span<const SweepPoint> points,
                       double attainment_target) {
  std::string table =
      "| rate (req/s) | requests | completed | req/s | input tok/s | output "
      "tok/s "
      "| TTFT mean | p50 | p90 | p99 (ms) | TPOT mean | p50 | p90 | p99 (ms) "
      "| ITL mean | p50 | p90 | p99 (ms) | E2E mean | p50 | p90 | p99 (ms) | "
      "attainment |\n"
      "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:"
      "|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const SweepPoint& point : points) {
    const Summary& s = point.summary;
    absl::StrAppendFormat(
        &table,
        "| %s | %d | %d | %.2f | %.1f | %.1f | %s | %s | %s | %s | %.1f%% |\n",
        RateCell(point), s.requests, s.completed, s.request_throughput,
        s.input_token_throughput, s.output_token_throughput, MsCells(s.ttft_s),
        MsCells(s.tpot_s), MsCells(s.itl_s), MsCells(s.e2e_s),
        s.slo_attainment * 100);
  }
  const SloTargets slo =
      points.empty() ? SloTargets{} : points.front().summary.slo;
  absl::StrAppendFormat(
      &table,
      "\nGoodput: %s req/s (the highest rate with at least %.1f%% of requests "
      "within TTFT %s and TPOT %s, every lower rate too)\n",
      absl::StrFormat("%.2f", Goodput(points, attainment_target)),
      attainment_target * 100, TargetMs(slo.ttft_s), TargetMs(slo.tpot_s));
  return table;
}

}  // namespace pdserve::planner
