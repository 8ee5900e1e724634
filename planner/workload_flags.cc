#include "planner/workload_flags.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/flags/flag.h"
#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"

ABSL_FLAG(std::string, input_len, "256",
          "Prompt tokens: N, uniform:A:B, normal:MEAN:STDDEV or hist:V=W,V=W,...");
ABSL_FLAG(std::string, output_len, "64", "Output tokens, as --input_len");
ABSL_FLAG(int32_t, shared_prefix_len, 0,
          "Leading prompt tokens shared with other prompts (one of --num_prefixes)");
ABSL_FLAG(int32_t, num_prefixes, 1, "Distinct shared prefixes");
ABSL_FLAG(int32_t, num_requests, 200, "Requests of a synthetic workload");
ABSL_FLAG(int32_t, trace_max_requests, 0, "Replay at most this many trace requests (0: all)");
ABSL_FLAG(std::string, trace, "",
          "Replay a trace instead: Mooncake .jsonl or Azure .csv (../shared/traces)");
ABSL_FLAG(double, length_scale, 1.0, "Trace lengths are divided by this");
ABSL_FLAG(double, time_scale, 1.0, "Trace arrival times are multiplied by this");
ABSL_FLAG(double, trace_start_s, 0, "Start of the replayed window, trace seconds");
ABSL_FLAG(double, trace_duration_s, std::numeric_limits<double>::infinity(),
          "Length of the replayed window, trace seconds");
ABSL_FLAG(int32_t, max_input_len, 0, "Clip scaled prompt lengths to this (0: no clip)");
ABSL_FLAG(int32_t, max_output_len, 0, "Clip scaled output lengths to this (0: no clip)");
ABSL_FLAG(int32_t, concurrency, 0, "Closed loop: requests in flight (0: open loop)");
ABSL_FLAG(std::string, request_rate, "",
          "Open loop: requests per second (inf: all at once); a trace is time-scaled to it");
ABSL_FLAG(std::vector<std::string>, request_rates, {},
          "Open-loop sweep: one run per rate, the same workload (e.g. 1,2,4)");
ABSL_FLAG(double, burstiness, 1.0,
          "Gamma shape of the inter-arrival times (1: Poisson; smaller: burstier)");
ABSL_FLAG(uint64_t, seed, 0, "Seed of the workload and its arrivals");
ABSL_FLAG(double, slo_ttft_ms, std::numeric_limits<double>::infinity(), "TTFT target");
ABSL_FLAG(double, slo_tpot_ms, std::numeric_limits<double>::infinity(), "TPOT target");
ABSL_FLAG(double, attainment_target, 0.9,
          "Share of requests that must meet both SLO targets (goodput)");
ABSL_FLAG(double, warmup_s, 0, "Requests sent in the first seconds are not summarised");
ABSL_FLAG(double, cooldown_s, 0, "Requests sent in the last seconds are not summarised");

namespace pdserve::planner {
namespace {

absl::StatusOr<double> ParseRate(const std::string& text, const char* flag) {
  if (text == "inf") return std::numeric_limits<double>::infinity();
  double rate = 0;
  if (!absl::SimpleAtod(text, &rate) || !(rate > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--", flag, ": '", text, "' is not a positive number of requests per second (or inf)"));
  }
  return rate;
}

}  // namespace

absl::StatusOr<Workload> WorkloadFromFlags() {
  const std::string trace = absl::GetFlag(FLAGS_trace);
  if (!trace.empty()) {
    TraceOptions t;
    t.path = trace;
    t.length_scale = absl::GetFlag(FLAGS_length_scale);
    t.time_scale = absl::GetFlag(FLAGS_time_scale);
    t.start_s = absl::GetFlag(FLAGS_trace_start_s);
    t.duration_s = absl::GetFlag(FLAGS_trace_duration_s);
    t.max_requests = absl::GetFlag(FLAGS_trace_max_requests);
    t.max_input_tokens = absl::GetFlag(FLAGS_max_input_len);
    t.max_output_tokens = absl::GetFlag(FLAGS_max_output_len);
    return LoadTraceWorkload(t);
  }
  SyntheticOptions s;
  PD_ASSIGN_OR_RETURN(s.input, LengthDistribution::Parse(absl::GetFlag(FLAGS_input_len)));
  PD_ASSIGN_OR_RETURN(s.output, LengthDistribution::Parse(absl::GetFlag(FLAGS_output_len)));
  s.num_requests = absl::GetFlag(FLAGS_num_requests);
  s.shared_prefix_tokens = absl::GetFlag(FLAGS_shared_prefix_len);
  s.num_prefixes = absl::GetFlag(FLAGS_num_prefixes);
  s.seed = absl::GetFlag(FLAGS_seed);
  return MakeSyntheticWorkload(s);
}

std::string LoadLevel::Name() const {
  if (concurrency > 0) return absl::StrCat("concurrency ", concurrency);
  if (rate == 0) return "trace times";
  if (std::isinf(rate)) return "inf req/s";
  return absl::StrFormat("%g req/s", rate);
}

absl::StatusOr<std::vector<LoadLevel>> LoadLevelsFromFlags() {
  const int32_t concurrency = absl::GetFlag(FLAGS_concurrency);
  const std::string rate = absl::GetFlag(FLAGS_request_rate);
  const std::vector<std::string> rates = absl::GetFlag(FLAGS_request_rates);
  if (concurrency < 0) return absl::InvalidArgumentError("--concurrency must not be negative");
  if ((concurrency > 0) + !rate.empty() + !rates.empty() > 1) {
    return absl::InvalidArgumentError(
        "give one of --concurrency, --request_rate and --request_rates");
  }
  if (concurrency > 0) return std::vector<LoadLevel>{{.concurrency = concurrency}};
  std::vector<LoadLevel> levels;
  if (!rate.empty()) {
    PD_ASSIGN_OR_RETURN(double r, ParseRate(rate, "request_rate"));
    levels.push_back({.rate = r});
  }
  for (const std::string& r : rates) {
    PD_ASSIGN_OR_RETURN(double value, ParseRate(r, "request_rates"));
    levels.push_back({.rate = value});
  }
  if (levels.empty()) {
    if (absl::GetFlag(FLAGS_trace).empty()) {
      return absl::InvalidArgumentError(
          "a synthetic workload needs --concurrency, --request_rate or --request_rates");
    }
    levels.push_back({});  // The trace's own times.
  }
  return levels;
}

absl::StatusOr<Workload> WorkloadAtLoad(const Workload& workload, const LoadLevel& level) {
  Workload out = workload;
  if (level.concurrency > 0 || level.rate == 0) return out;
  if (absl::GetFlag(FLAGS_trace).empty() || std::isinf(level.rate)) {
    PD_RETURN_IF_ERROR(AssignArrivals({.rate = level.rate,
                                       .burstiness = absl::GetFlag(FLAGS_burstiness),
                                       .seed = absl::GetFlag(FLAGS_seed)},
                                      out));
    return out;
  }
  // A trace keeps its arrival pattern, stretched to the rate.
  if (out.requests.size() < 2 || out.requests.back().arrival_s <= 0) {
    return absl::InvalidArgumentError("a trace of fewer than 2 distinct arrival times has no rate");
  }
  const double own_rate = (out.requests.size() - 1) / out.requests.back().arrival_s;
  const double stretch = own_rate / level.rate;
  for (WorkloadRequest& r : out.requests) r.arrival_s *= stretch;
  out.description += absl::StrFormat(", time x %.3g for %g req/s", stretch, level.rate);
  return out;
}

SummaryOptions SummaryOptionsFromFlags(std::span<const RequestRecord> records) {
  SummaryOptions o;
  o.slo.ttft_s = absl::GetFlag(FLAGS_slo_ttft_ms) / 1e3;
  o.slo.tpot_s = absl::GetFlag(FLAGS_slo_tpot_ms) / 1e3;
  o.window_begin_s = absl::GetFlag(FLAGS_warmup_s);
  const double cooldown = absl::GetFlag(FLAGS_cooldown_s);
  if (cooldown > 0) {
    double last_send = 0;
    for (const RequestRecord& r : records) last_send = std::max(last_send, r.send_s);
    o.window_end_s = last_send - cooldown;
  }
  return o;
}

double AttainmentTargetFromFlags() { return absl::GetFlag(FLAGS_attainment_target); }

}  // namespace pdserve::planner
