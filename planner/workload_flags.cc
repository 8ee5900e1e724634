#include "planner/workload_flags.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include "absl/flags/flag.h"
#include "absl/flags/usage_config.h"
#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/match.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"

// Workload.
ABSL_FLAG(std::string, input_len, "256",
          "Prompt tokens: N, uniform:A:B, normal:MEAN:STDDEV or hist:V=W,V=W,...");
ABSL_FLAG(std::string, output_len, "64", "Output tokens, the same forms as --input_len");
ABSL_FLAG(int32_t, shared_prefix_len, 0,
          "Leading prompt tokens shared with other prompts (one of --num_prefixes; 0: none)");
ABSL_FLAG(int32_t, num_prefixes, 1, "Distinct shared prefixes");
// Optional so that a trace run that gives it (pd-bench once took it as the
// trace's limit) is refused rather than silently replaying the whole trace.
ABSL_FLAG(std::optional<int32_t>, num_requests, std::nullopt,
          "Requests of a synthetic workload (unset: 200); with --trace, give "
          "--trace_max_requests");
ABSL_FLAG(uint64_t, seed, 0, "Seed of the lengths, prompts and arrivals");
ABSL_FLAG(std::string, trace, "",
          "Replay a trace instead: Mooncake .jsonl or Azure .csv (../shared/traces)");
ABSL_FLAG(double, length_scale, 1.0, "Trace lengths are divided by this");
ABSL_FLAG(double, time_scale, 1.0, "Trace arrival times are multiplied by this");
ABSL_FLAG(double, trace_start_s, 0, "Start of the replayed trace window, trace seconds");
ABSL_FLAG(double, trace_duration_s, 0,
          "Length of the replayed trace window, trace seconds (0: to the end)");
ABSL_FLAG(int32_t, trace_max_requests, 0, "Replay at most this many trace requests (0: all)");
ABSL_FLAG(int32_t, max_input_len, 0, "Clip scaled trace prompt lengths to this (0: no clip)");
ABSL_FLAG(int32_t, max_output_len, 0, "Clip scaled trace output lengths to this (0: no clip)");

// Load.
ABSL_FLAG(int32_t, concurrency, 0,
          "Closed loop: this many requests in flight, arrival times ignored (0: open loop)");
ABSL_FLAG(std::string, request_rate, "",
          "Open loop: requests per second (inf: all at once); a trace is time-scaled to it");
ABSL_FLAG(std::vector<std::string>, request_rates, {},
          "Open-loop sweep: one run per rate on the same workload, e.g. 1,2,4,inf");
ABSL_FLAG(double, burstiness, 1.0,
          "Gamma shape of the inter-arrival times: 1 Poisson, < 1 burstier, > 1 steadier");

// Summary.
ABSL_FLAG(double, slo_ttft_ms, 0, "TTFT target, ms (0: none)");
ABSL_FLAG(double, slo_tpot_ms, 0, "TPOT target, ms (0: none)");
ABSL_FLAG(double, attainment_target, 0.9,
          "Goodput: the highest rate at which at least this share of requests meets both "
          "SLO targets");
ABSL_FLAG(double, warmup_s, 0, "Requests sent in the first this-many seconds are left out");
ABSL_FLAG(double, cooldown_s, 0,
          "Requests sent in the last this-many seconds of sending are left out");

namespace pdserve::planner {
namespace {

constexpr int32_t kDefaultNumRequests = 200;
constexpr double kInf = std::numeric_limits<double>::infinity();

absl::StatusOr<double> ParseRate(std::string text, const char* flag) {
  absl::StripAsciiWhitespace(&text);
  if (absl::AsciiStrToLower(text) == "inf") return kInf;
  double rate = 0;
  if (!absl::SimpleAtod(text, &rate) || !(rate > 0)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--", flag, ": '", text, "' is not a positive number of requests per second (or inf)"));
  }
  return rate;
}

// Requests per second between the first arrival and the last; infinity
// when they all arrive at once.
double MeanRate(const Workload& workload) {
  const std::vector<WorkloadRequest>& r = workload.requests;
  const double span = r.empty() ? 0 : r.back().arrival_s - r.front().arrival_s;
  return span > 0 ? (r.size() - 1) / span : kInf;
}

absl::StatusOr<Workload> TraceFromFlags(const std::string& path) {
  if (absl::GetFlag(FLAGS_num_requests).has_value()) {
    return absl::InvalidArgumentError(
        "--num_requests sets the size of a synthetic workload; to replay at most N requests "
        "of --trace, give --trace_max_requests=N");
  }
  TraceOptions t;
  t.path = path;
  t.length_scale = absl::GetFlag(FLAGS_length_scale);
  t.time_scale = absl::GetFlag(FLAGS_time_scale);
  t.start_s = absl::GetFlag(FLAGS_trace_start_s);
  const double duration = absl::GetFlag(FLAGS_trace_duration_s);
  t.duration_s = duration == 0 ? kInf : duration;
  t.max_requests = absl::GetFlag(FLAGS_trace_max_requests);
  t.max_input_tokens = absl::GetFlag(FLAGS_max_input_len);
  t.max_output_tokens = absl::GetFlag(FLAGS_max_output_len);
  PD_ASSIGN_OR_RETURN(Workload workload, LoadTraceWorkload(t));
  if (workload.requests.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the trace window replays no request of ", path,
        " (check --trace_start_s and --trace_duration_s)"));
  }
  return workload;
}

}  // namespace

absl::StatusOr<Workload> WorkloadFromFlags() {
  const std::string trace = absl::GetFlag(FLAGS_trace);
  if (!trace.empty()) return TraceFromFlags(trace);
  SyntheticOptions s;
  auto length = [](const absl::Flag<std::string>& flag,
                   const char* name) -> absl::StatusOr<LengthDistribution> {
    auto parsed = LengthDistribution::Parse(absl::GetFlag(flag));
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, ": ", parsed.status().message()));
    }
    return parsed;
  };
  PD_ASSIGN_OR_RETURN(s.input, length(FLAGS_input_len, "input_len"));
  PD_ASSIGN_OR_RETURN(s.output, length(FLAGS_output_len, "output_len"));
  s.num_requests = absl::GetFlag(FLAGS_num_requests).value_or(kDefaultNumRequests);
  s.shared_prefix_tokens = absl::GetFlag(FLAGS_shared_prefix_len);
  s.num_prefixes = absl::GetFlag(FLAGS_num_prefixes);
  s.seed = absl::GetFlag(FLAGS_seed);
  if (s.num_requests <= 0) return absl::InvalidArgumentError("--num_requests must be positive");
  if (s.shared_prefix_tokens < 0 || s.num_prefixes <= 0) {
    return absl::InvalidArgumentError(
        "--shared_prefix_len must be 0 or more and --num_prefixes positive");
  }
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
  const double burstiness = absl::GetFlag(FLAGS_burstiness);
  if (concurrency < 0) {
    return absl::InvalidArgumentError("--concurrency must not be negative (0: open loop)");
  }
  if (!rate.empty() && !rates.empty()) {
    return absl::InvalidArgumentError(
        "give --request_rate (one run) or --request_rates (a sweep), not both");
  }
  if (concurrency > 0 && (!rate.empty() || !rates.empty())) {
    return absl::InvalidArgumentError(
        "--concurrency (closed loop) and --request_rate(s) (open loop) exclude each other: "
        "give one");
  }
  if (!(burstiness > 0) || std::isinf(burstiness)) {
    return absl::InvalidArgumentError("--burstiness must be a positive number (1: Poisson)");
  }
  if (concurrency > 0) return std::vector<LoadLevel>{{.concurrency = concurrency}};
  std::vector<LoadLevel> levels;
  if (!rate.empty()) {
    PD_ASSIGN_OR_RETURN(double r, ParseRate(rate, "request_rate"));
    levels.push_back({.rate = r});
  }
  for (const std::string& r : rates) {
    PD_ASSIGN_OR_RETURN(double value, ParseRate(r, "request_rates"));
    levels.push_back({.rate = value, .index = static_cast<int32_t>(levels.size())});
  }
  if (levels.empty()) {
    if (absl::GetFlag(FLAGS_trace).empty()) {
      return absl::InvalidArgumentError(
          "give a load: --concurrency=N (closed loop), --request_rate=R or "
          "--request_rates=R1,R2,... (open loop; inf: all at once)");
    }
    levels.push_back({});  // The trace's own times.
  }
  return levels;
}

absl::StatusOr<Workload> WorkloadAtLoad(const Workload& workload, const LoadLevel& level) {
  Workload out = workload;
  if (level.index > 0 || level.repeat > 0) {
    // Fresh content for every later level of a sweep and every later run of
    // a level, the same prefix structure within it: a bijection of the
    // block ids (xor with a salt drawn from the index and the run).
    uint64_t salt =
        (static_cast<uint64_t>(level.index) + (static_cast<uint64_t>(level.repeat) << 32)) *
        0x9E3779B97F4A7C15ull;
    salt ^= salt >> 31;
    salt *= 0xBF58476D1CE4E5B9ull;
    salt ^= salt >> 29;
    for (WorkloadRequest& r : out.requests) {
      for (uint64_t& id : r.block_ids) id ^= salt;
    }
  }
  if (level.concurrency > 0 || level.rate == 0) return out;
  if (absl::GetFlag(FLAGS_trace).empty() || std::isinf(level.rate)) {
    PD_RETURN_IF_ERROR(AssignArrivals({.rate = level.rate,
                                       .burstiness = absl::GetFlag(FLAGS_burstiness),
                                       .seed = absl::GetFlag(FLAGS_seed)},
                                      out));
    return out;
  }
  // A trace keeps its arrival pattern, stretched to the rate.
  const double own_rate = MeanRate(out);
  if (out.requests.size() < 2 || std::isinf(own_rate)) {
    return absl::InvalidArgumentError(
        "a trace whose requests all arrive at once has no rate to scale to --request_rate(s)");
  }
  const double stretch = own_rate / level.rate;
  for (WorkloadRequest& r : out.requests) r.arrival_s *= stretch;
  out.description += absl::StrFormat(", time x %.3g for %g req/s", stretch, level.rate);
  return out;
}

double OfferedRate(const Workload& at, const LoadLevel& level) {
  if (level.concurrency > 0) return 0;
  return level.rate != 0 ? level.rate : MeanRate(at);
}

SummaryOptions SummarySpec::OptionsFor(std::span<const RequestRecord> records) const {
  SummaryOptions o;
  o.slo = slo;
  o.window_begin_s = warmup_s;
  if (cooldown_s > 0) {
    double last_send = 0;
    for (const RequestRecord& r : records) last_send = std::max(last_send, r.send_s);
    o.window_end_s = last_send - cooldown_s;
  }
  return o;
}

absl::StatusOr<SummarySpec> SummarySpecFromFlags() {
  const double ttft_ms = absl::GetFlag(FLAGS_slo_ttft_ms);
  const double tpot_ms = absl::GetFlag(FLAGS_slo_tpot_ms);
  if (!(ttft_ms >= 0) || !(tpot_ms >= 0)) {
    return absl::InvalidArgumentError(
        "--slo_ttft_ms and --slo_tpot_ms must be 0 (no target) or more");
  }
  SummarySpec spec;
  spec.slo.ttft_s = ttft_ms > 0 ? ttft_ms / 1e3 : kInf;
  spec.slo.tpot_s = tpot_ms > 0 ? tpot_ms / 1e3 : kInf;
  spec.attainment_target = absl::GetFlag(FLAGS_attainment_target);
  if (!(spec.attainment_target > 0 && spec.attainment_target <= 1)) {
    return absl::InvalidArgumentError("--attainment_target must be in (0, 1]");
  }
  spec.warmup_s = absl::GetFlag(FLAGS_warmup_s);
  spec.cooldown_s = absl::GetFlag(FLAGS_cooldown_s);
  if (!(spec.warmup_s >= 0) || !(spec.cooldown_s >= 0)) {
    return absl::InvalidArgumentError("--warmup_s and --cooldown_s must be 0 or more");
  }
  return spec;
}

void ListPlannerFlagsInHelp() {
  absl::FlagsUsageConfig config;
  config.contains_help_flags = [](absl::string_view file) {
    return absl::StrContains(file, "planner/");
  };
  config.contains_helpshort_flags = config.contains_help_flags;
  absl::SetFlagsUsageConfig(config);
}

}  // namespace pdserve::planner
