// Summary: the figures of a load test, computed the same way for a real
// run (pd-bench) and a simulated one (pd-plan simulate), from per-request
// records.
//
// Definitions (those of vLLM's `bench serve` and AIPerf):
//   TTFT   first token's arrival - send time.
//   E2E    last token's arrival (or the stream's end) - send time.
//   TPOT   per request with 2+ output tokens: (E2E - TTFT) / (tokens - 1).
//   ITL    every gap between consecutive token arrivals, over all requests.
//   Latencies are of successful requests; tokens = output_tokens. A
//   request with no token has no TTFT (it meets only an infinite TTFT
//   target) and its E2E ends at the stream's end.
//   Percentiles: linear interpolation between closest ranks (numpy's
//   default): p(q) of sorted x[0..n-1] is x[i] + (x[i+1] - x[i]) * f
//   with i + f = q / 100 * (n - 1).
//   P90's confidence interval: how well n requests pin the population's
//   90th percentile. The distribution-free interval of order statistics
//   (SciPy's quantile_test(...).confidence_interval, two-sided, 90%): with
//   B ~ Binomial(n, 0.9) and a = 0.05, from x[l - 1] for the smallest l
//   with P(B <= l) >= a to x[h] for the smallest h with P(B > h) <= a; a
//   bound past either end is NaN (under 29 samples there is no upper
//   one). It treats the requests as independent draws; requests queued
//   behind one another are not, so it is the least the P90 is uncertain
//   by. With 100 requests it runs from x[84] to x[95].
//   Window: only requests sent in [window_begin_s, window_end_s) count
//   (warm-up before, cool-down after); duration = the latest end of a
//   counted request - the earliest send of one; throughputs are counted
//   requests, prompt tokens and output tokens of successful requests over
//   that duration.
//   SLO attainment: the share of counted requests (failed ones included,
//   as misses) that succeeded with TTFT <= ttft target AND TPOT <= tpot
//   target (a one-token request meets any TPOT target).
//   Goodput: from a sweep of offered request rates, the highest rate whose
//   attainment is at least the attainment target, with every lower rate of
//   the sweep meeting it too (0 when the lowest misses). Closed-loop
//   points (rate 0) do not count; an infinite rate that meets it, with
//   every finite one, gives infinity.
//
// Thread-safety: values and pure functions.
#ifndef PDSERVE_PLANNER_SUMMARY_H_
#define PDSERVE_PLANNER_SUMMARY_H_

#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace pdserve::planner {

// One request of a run. Times are seconds from the start of the run.
struct RequestRecord {
  // Index into the workload's requests.
  int64_t index = 0;
  double send_s = 0;
  // Arrival time of each output token, in order; a message carrying k
  // tokens gives k equal times.
  std::vector<double> token_s;
  // When the stream ended (success or not).
  double end_s = 0;
  int32_t input_tokens = 0;
  int32_t output_tokens = 0;
  // "OK" or the status code's name (e.g. "UNAVAILABLE").
  std::string outcome = "OK";
  // The error message when outcome is not OK.
  std::string error;

  bool ok() const { return outcome == "OK"; }
};

// One JSON object per line, the fields above by name.
nlohmann::json ToJson(const RequestRecord& record);
// INVALID_ARGUMENT naming the missing or mistyped field.
absl::StatusOr<RequestRecord> RecordFromJson(const nlohmann::json& json);
// NOT_FOUND / INVALID_ARGUMENT (with the line number).
absl::StatusOr<std::vector<RequestRecord>> ReadRecords(const std::string& path);
absl::Status WriteRecords(const std::string& path, std::span<const RequestRecord> records);

struct SloTargets {
  // Default: no target.
  double ttft_s = std::numeric_limits<double>::infinity();
  double tpot_s = std::numeric_limits<double>::infinity();
};

struct Distribution {
  int64_t count = 0;
  double mean = 0, p50 = 0, p90 = 0, p99 = 0;
  // P90's 90% confidence interval (above); NaN where it has no bound.
  double p90_low = std::numeric_limits<double>::quiet_NaN();
  double p90_high = std::numeric_limits<double>::quiet_NaN();
};

// Linear-interpolation percentile (see above) of unsorted values; q in
// [0, 100]. 0 for no values.
double Percentile(std::vector<double> values, double q);

// The 0-based ranks, among n sorted samples, of the two order statistics
// that bound the two-sided `confidence` interval of the population's
// quantile `q` (in (0, 1)), as above: -1 for no lower bound, n for no
// upper one.
std::pair<int64_t, int64_t> QuantileIntervalRanks(int64_t n, double q, double confidence);
Distribution Describe(std::vector<double> values);

struct SummaryOptions {
  SloTargets slo;
  // Default: every request counts.
  double window_begin_s = 0;
  double window_end_s = std::numeric_limits<double>::infinity();
};

struct Summary {
  // Requests sent in the window; of them, those that succeeded.
  int64_t requests = 0;
  int64_t completed = 0;
  // Failed requests by outcome, in outcome order.
  std::vector<std::pair<std::string, int64_t>> failures;
  double duration_s = 0;
  double request_throughput = 0;  // completed / duration
  double input_token_throughput = 0;
  double output_token_throughput = 0;
  Distribution ttft_s, tpot_s, itl_s, e2e_s;
  // In [0, 1].
  double slo_attainment = 0;
  SloTargets slo;
};

Summary Summarize(std::span<const RequestRecord> records, const SummaryOptions& options);

// Several runs of one load as one, figure by figure: every count,
// throughput, distribution statistic (mean, p50, p90, p99, P90's interval
// bounds) and the attainment is the median of the runs' (with an even count, the mean of
// the middle two), so its figures may come from different runs; the
// failures and SLO are the first run's. One run gives itself; none, an
// empty summary.
Summary MedianSummary(std::span<const Summary> runs);

// The summary of one offered rate of a sweep (rate infinity: all at once;
// closed loop: rate 0 and the concurrency in `concurrency`).
struct SweepPoint {
  double rate = 0;
  int32_t concurrency = 0;
  Summary summary;
};

// See the file comment. `points` in any order.
double Goodput(std::span<const SweepPoint> points, double attainment_target);

// Machines: one object per point plus "goodput"; people: a Markdown table
// with one row per point (rate, throughputs, TTFT/TPOT/ITL/E2E mean p50 p90
// p99 in ms, attainment) and the goodput line. JSON has no infinity: an
// infinite rate, target or goodput is written as null.
nlohmann::json ToJson(const Summary& summary);
// `value`, or null where it is not finite (JSON has neither infinity nor
// NaN, and nlohmann would write null silently).
nlohmann::json JsonNumber(double value);
nlohmann::json SweepToJson(std::span<const SweepPoint> points, double attainment_target);
std::string SweepTable(std::span<const SweepPoint> points, double attainment_target);

}  // namespace pdserve::planner

#endif  // PDSERVE_PLANNER_SUMMARY_H_
