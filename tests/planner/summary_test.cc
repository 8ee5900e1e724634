// planner/summary.h: every expected figure below is worked out by hand in
// the comments next to it (percentiles also checked with numpy's default
// np.percentile, the definition the header names).
#include "planner/summary.h"

#include <cmath>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pdserve::planner {
namespace {

using ::testing::HasSubstr;

constexpr double kEps = 1e-12;
constexpr double kInf = std::numeric_limits<double>::infinity();

TEST(PercentileTest, LinearInterpolationBetweenClosestRanks) {
  // {1, 2, 3, 4}: rank = q / 100 * 3.
  const std::vector<double> v = {4, 1, 3, 2};  // Unsorted on purpose.
  EXPECT_NEAR(Percentile(v, 0), 1.0, kEps);
  EXPECT_NEAR(Percentile(v, 25), 1.75, kEps);  // rank 0.75: 1 + 0.75 * 1
  EXPECT_NEAR(Percentile(v, 50), 2.5, kEps);   // rank 1.5: 2 + 0.5 * 1
  EXPECT_NEAR(Percentile(v, 90), 3.7, kEps);   // rank 2.7: 3 + 0.7 * 1
  EXPECT_NEAR(Percentile(v, 99), 3.97, kEps);  // rank 2.97: 3 + 0.97 * 1
  EXPECT_NEAR(Percentile(v, 100), 4.0, kEps);
}

TEST(PercentileTest, MatchesNumpyDefault) {
  // np.percentile([10, 20, 30, 40, 50], [33, 99]) == [23.2, 49.6]:
  // rank 0.33 * 4 = 1.32 -> 20 + 0.32 * 10; rank 0.99 * 4 = 3.96 -> 40 + 9.6.
  const std::vector<double> v = {50, 10, 40, 20, 30};
  EXPECT_NEAR(Percentile(v, 33), 23.2, 1e-9);
  EXPECT_NEAR(Percentile(v, 99), 49.6, 1e-9);
  // np.percentile([0.3, 0.4, 0.5], [90, 99]) == [0.48, 0.498].
  EXPECT_NEAR(Percentile({0.5, 0.3, 0.4}, 90), 0.48, 1e-12);
  EXPECT_NEAR(Percentile({0.5, 0.3, 0.4}, 99), 0.498, 1e-12);
}

TEST(PercentileTest, EdgeCases) {
  EXPECT_EQ(Percentile({}, 50), 0.0);
  EXPECT_EQ(Percentile({7}, 0), 7.0);
  EXPECT_EQ(Percentile({7}, 99), 7.0);
  EXPECT_EQ(Percentile({2, 2, 2}, 90), 2.0);
}

TEST(DescribeTest, CountMeanAndPercentiles) {
  const Distribution d = Describe({3, 1, 4, 2});
  EXPECT_EQ(d.count, 4);
  EXPECT_NEAR(d.mean, 2.5, kEps);  // 10 / 4
  EXPECT_NEAR(d.p50, 2.5, kEps);
  EXPECT_NEAR(d.p90, 3.7, kEps);
  EXPECT_NEAR(d.p99, 3.97, kEps);

  const Distribution empty = Describe({});
  EXPECT_EQ(empty.count, 0);
  EXPECT_EQ(empty.mean, 0);
  EXPECT_EQ(empty.p99, 0);
}

// SciPy's order-statistic interval of a quantile, for samples 0..n-1:
// tests/planner/quantile_ci_reference.py prints these ({n, q, confidence,
// lower bound's rank, upper's}; -1 where SciPy has none).
struct IntervalCase {
  int64_t n;
  double q, confidence;
  int64_t low, high;
};
constexpr IntervalCase kScipyIntervals[] = {
    {5, 0.9, 0.9, 2, -1},
    {10, 0.9, 0.9, 6, -1},
    {22, 0.9, 0.9, 16, -1},
    {29, 0.9, 0.9, 22, 28},
    {30, 0.9, 0.9, 23, 29},
    {50, 0.9, 0.9, 40, 48},
    {100, 0.9, 0.9, 84, 95},
    {100, 0.5, 0.95, 39, 60},
    {100, 0.99, 0.9, 96, -1},
    {1000, 0.9, 0.9, 883, 915},
    {5424, 0.9, 0.9, 4844, 4918},
    {7, 0.5, 0.9, 0, 6},
};

TEST(QuantileIntervalTest, MatchesScipyQuantileTest) {
  for (const IntervalCase& c : kScipyIntervals) {
    SCOPED_TRACE(testing::Message() << "n " << c.n << " q " << c.q << " confidence "
                                    << c.confidence);
    const auto [low, high] = QuantileIntervalRanks(c.n, c.q, c.confidence);
    EXPECT_EQ(low, c.low);
    // SciPy's "none" above is rank n here.
    EXPECT_EQ(high, c.high < 0 ? c.n : c.high);
  }
}

TEST(DescribeTest, P90IntervalIsTheOrderStatistics) {
  // 100 values, 1000 down to 10: sorted, rank r holds 10 (r + 1); the
  // interval of 100 samples is ranks 84 to 95.
  std::vector<double> values;
  for (int i = 100; i >= 1; --i) values.push_back(10.0 * i);
  const Distribution d = Describe(values);
  EXPECT_DOUBLE_EQ(d.p90_low, 850);
  EXPECT_DOUBLE_EQ(d.p90_high, 960);
  EXPECT_LE(d.p90_low, d.p90);
  EXPECT_GE(d.p90_high, d.p90);
  // Under 29 samples the upper bound is past the largest: none.
  const Distribution few = Describe({5, 1, 4, 2, 3, 6, 7, 8, 9, 10});
  EXPECT_DOUBLE_EQ(few.p90_low, 7);  // rank 6
  EXPECT_TRUE(std::isnan(few.p90_high));
  EXPECT_TRUE(std::isnan(Describe({}).p90_low));
}

RequestRecord Record(int64_t index, double send_s, std::vector<double> token_s,
                     double end_s, int32_t input_tokens,
                     std::string outcome = "OK") {
  RequestRecord r;
  r.index = index;
  r.send_s = send_s;
  r.output_tokens = static_cast<int32_t>(token_s.size());
  r.token_s = std::move(token_s);
  r.end_s = end_s;
  r.input_tokens = input_tokens;
  r.outcome = std::move(outcome);
  if (!r.ok()) r.error = "peer down";
  return r;
}

// The run all the Summarize tests share:
//   r0 sent 0.0, tokens 0.5 0.7 0.9 1.1:  TTFT 0.5, E2E 1.1,
//      TPOT (1.1 - 0.5) / 3 = 0.2, ITL 0.2 0.2 0.2.
//   r1 sent 1.0, tokens 1.3 1.3 1.8 (a message of two), ends 1.9:
//      TTFT 0.3, E2E 0.8 (last token), TPOT (0.8 - 0.3) / 2 = 0.25,
//      ITL 0 0.5.
//   r2 sent 2.0, one token 2.4: TTFT 0.4, E2E 0.4, no TPOT, no ITL.
//   r3 sent 3.0, one token 3.2, fails (UNAVAILABLE) at 3.5.
std::vector<RequestRecord> SharedRun() {
  return {Record(0, 0.0, {0.5, 0.7, 0.9, 1.1}, 1.1, 100),
          Record(1, 1.0, {1.3, 1.3, 1.8}, 1.9, 200),
          Record(2, 2.0, {2.4}, 2.4, 50),
          Record(3, 3.0, {3.2}, 3.5, 80, "UNAVAILABLE")};
}

TEST(SummarizeTest, LatencyFiguresOfSuccessfulRequests) {
  const std::vector<RequestRecord> records = SharedRun();
  const Summary s = Summarize(records, {});
  EXPECT_EQ(s.requests, 4);
  EXPECT_EQ(s.completed, 3);
  ASSERT_EQ(s.failures.size(), 1u);
  EXPECT_EQ(s.failures[0].first, "UNAVAILABLE");
  EXPECT_EQ(s.failures[0].second, 1);

  // TTFT {0.5, 0.3, 0.4}: mean 0.4; sorted {0.3, 0.4, 0.5}, p90 at rank 1.8
  // = 0.4 + 0.8 * 0.1 = 0.48. r3's TTFT (0.2) is not counted.
  EXPECT_EQ(s.ttft_s.count, 3);
  EXPECT_NEAR(s.ttft_s.mean, 0.4, 1e-12);
  EXPECT_NEAR(s.ttft_s.p50, 0.4, 1e-12);
  EXPECT_NEAR(s.ttft_s.p90, 0.48, 1e-12);
  // TPOT {0.2, 0.25}: mean 0.225; p90 at rank 0.9 = 0.2 + 0.9 * 0.05.
  EXPECT_EQ(s.tpot_s.count, 2);
  EXPECT_NEAR(s.tpot_s.mean, 0.225, 1e-12);
  EXPECT_NEAR(s.tpot_s.p90, 0.245, 1e-12);
  // ITL {0.2, 0.2, 0.2, 0, 0.5}: mean 1.1 / 5 = 0.22; sorted
  // {0, 0.2, 0.2, 0.2, 0.5}: p50 = 0.2, p90 at rank 3.6 = 0.2 + 0.6 * 0.3.
  EXPECT_EQ(s.itl_s.count, 5);
  EXPECT_NEAR(s.itl_s.mean, 0.22, 1e-12);
  EXPECT_NEAR(s.itl_s.p50, 0.2, 1e-12);
  EXPECT_NEAR(s.itl_s.p90, 0.38, 1e-12);
  // E2E {1.1, 0.8, 0.4}: mean 2.3 / 3; p50 0.8.
  EXPECT_EQ(s.e2e_s.count, 3);
  EXPECT_NEAR(s.e2e_s.mean, 2.3 / 3, 1e-12);
  EXPECT_NEAR(s.e2e_s.p50, 0.8, 1e-12);
}

TEST(SummarizeTest, ThroughputOverDuration) {
  const std::vector<RequestRecord> records = SharedRun();
  const Summary s = Summarize(records, {});
  // Duration: the latest end of a counted request (r3, failed, at 3.5), not
  // the last success (2.4), minus the earliest send (0).
  EXPECT_NEAR(s.duration_s, 3.5, 1e-12);
  EXPECT_NEAR(s.request_throughput, 3 / 3.5, 1e-12);
  // Prompt tokens of successful requests: 100 + 200 + 50 = 350.
  EXPECT_NEAR(s.input_token_throughput, 350 / 3.5, 1e-9);
  // Output tokens of successful requests: 4 + 3 + 1 = 8.
  EXPECT_NEAR(s.output_token_throughput, 8 / 3.5, 1e-12);
}

TEST(SummarizeTest, WindowDropsWarmUpAndCoolDown) {
  const std::vector<RequestRecord> records = SharedRun();
  SummaryOptions options;
  options.window_begin_s = 1.0;  // Inclusive: r1, sent at 1.0, counts.
  options.window_end_s = 3.0;    // Exclusive: r3, sent at 3.0, does not.
  const Summary s = Summarize(records, options);
  EXPECT_EQ(s.requests, 2);
  EXPECT_EQ(s.completed, 2);
  EXPECT_TRUE(s.failures.empty());
  // Latest end 2.4 (r2) - earliest send 1.0 (r1).
  EXPECT_NEAR(s.duration_s, 1.4, 1e-12);
  EXPECT_NEAR(s.request_throughput, 2 / 1.4, 1e-12);
  // TTFT {0.3, 0.4}.
  EXPECT_EQ(s.ttft_s.count, 2);
  EXPECT_NEAR(s.ttft_s.mean, 0.35, 1e-12);
  EXPECT_EQ(s.tpot_s.count, 1);
  EXPECT_NEAR(s.tpot_s.mean, 0.25, 1e-12);
}

TEST(SummarizeTest, EmptyWindow) {
  const std::vector<RequestRecord> records = SharedRun();
  SummaryOptions options;
  options.window_begin_s = 10;
  const Summary s = Summarize(records, options);
  EXPECT_EQ(s.requests, 0);
  EXPECT_EQ(s.duration_s, 0);
  EXPECT_EQ(s.request_throughput, 0);
  EXPECT_EQ(s.slo_attainment, 0);
}

double Attainment(double ttft_s, double tpot_s) {
  const std::vector<RequestRecord> records = SharedRun();
  SummaryOptions options;
  options.slo.ttft_s = ttft_s;
  options.slo.tpot_s = tpot_s;
  return Summarize(records, options).slo_attainment;
}

TEST(SummarizeTest, FailedRequestsAreMisses) {
  // No targets: r0..r2 meet; r3 failed, a miss although its TTFT (0.2)
  // would meet anything: 3 / 4.
  EXPECT_NEAR(Attainment(kInf, kInf), 0.75, 1e-12);
  // TTFT <= 0.25: only r3's 0.2 would, and it failed: 0 / 4.
  EXPECT_NEAR(Attainment(0.25, kInf), 0.0, 1e-12);
}

TEST(SummarizeTest, AttainmentNeedsTtftAndTpot) {
  // TTFT <= 0.45 alone: r1 (0.3) and r2 (0.4) meet, r0 (0.5) not: 2 / 4.
  EXPECT_NEAR(Attainment(0.45, kInf), 0.5, 1e-12);
  // TPOT <= 0.22 alone: r0 (0.2) and r2 (one token) meet, r1 (0.25) not.
  EXPECT_NEAR(Attainment(kInf, 0.22), 0.5, 1e-12);
  // Both: only r2 meets both (r0 misses TTFT, r1 misses TPOT): 1 / 4, not
  // the 3 / 4 of "either".
  EXPECT_NEAR(Attainment(0.45, 0.22), 0.25, 1e-12);
}

TEST(SummarizeTest, OneTokenRequestMeetsAnyTpotTarget) {
  // TPOT target 0: r0 and r1 have TPOTs above it; r2 has one token.
  EXPECT_NEAR(Attainment(kInf, 0.0), 0.25, 1e-12);
}

TEST(SummarizeTest, KeepsTargets) {
  const std::vector<RequestRecord> records = SharedRun();
  SummaryOptions options;
  options.slo.ttft_s = 0.5;
  const Summary s = Summarize(records, options);
  EXPECT_EQ(s.slo.ttft_s, 0.5);
  EXPECT_EQ(s.slo.tpot_s, kInf);
}

SweepPoint Point(double rate, double attainment) {
  SweepPoint point;
  point.rate = rate;
  point.summary.slo_attainment = attainment;
  return point;
}

TEST(MedianSummaryTest, EachFigureIsTheMedianOfTheRuns) {
  // Three runs: each figure's median, whichever run it comes from.
  Summary a, b, c;
  a.requests = b.requests = c.requests = 100;
  a.completed = 100, b.completed = 98, c.completed = 99;
  a.ttft_s = {.count = 100, .mean = 0.2, .p50 = 0.10, .p90 = 0.50, .p99 = 0.9};
  b.ttft_s = {.count = 98, .mean = 0.3, .p50 = 0.12, .p90 = 0.40, .p99 = 1.2};
  c.ttft_s = {.count = 99, .mean = 0.1, .p50 = 0.11, .p90 = 0.60, .p99 = 1.0};
  a.tpot_s.p90 = 0.030, b.tpot_s.p90 = 0.010, c.tpot_s.p90 = 0.020;
  a.slo_attainment = 0.9, b.slo_attainment = 0.95, c.slo_attainment = 0.8;
  a.request_throughput = 3, b.request_throughput = 2, c.request_throughput = 4;
  a.slo.ttft_s = 1.5;
  const std::vector<Summary> runs = {a, b, c};
  const Summary m = MedianSummary(runs);
  EXPECT_EQ(m.requests, 100);
  EXPECT_EQ(m.completed, 99);
  EXPECT_EQ(m.ttft_s.count, 99);
  EXPECT_DOUBLE_EQ(m.ttft_s.mean, 0.2);
  EXPECT_DOUBLE_EQ(m.ttft_s.p50, 0.11);
  EXPECT_DOUBLE_EQ(m.ttft_s.p90, 0.50);
  EXPECT_DOUBLE_EQ(m.ttft_s.p99, 1.0);
  EXPECT_DOUBLE_EQ(m.tpot_s.p90, 0.020);
  EXPECT_DOUBLE_EQ(m.slo_attainment, 0.9);
  EXPECT_DOUBLE_EQ(m.request_throughput, 3);
  EXPECT_DOUBLE_EQ(m.slo.ttft_s, 1.5);  // The first run's.
  // Two runs: the mean of the two; one run: itself; none: empty.
  const std::vector<Summary> two = {a, b};
  EXPECT_DOUBLE_EQ(MedianSummary(two).ttft_s.p90, 0.45);
  EXPECT_DOUBLE_EQ(MedianSummary(std::span<const Summary>(&c, 1)).ttft_s.p90, 0.60);
  EXPECT_EQ(MedianSummary({}).requests, 0);
}

TEST(MedianSummaryTest, IntervalBoundsTooAndNoneWhereARunHasNone) {
  Summary a, b, c;
  a.ttft_s.p90_low = 0.3, b.ttft_s.p90_low = 0.1, c.ttft_s.p90_low = 0.2;
  a.ttft_s.p90_high = 0.9, b.ttft_s.p90_high = 0.7, c.ttft_s.p90_high = 0.8;
  const std::vector<Summary> runs = {a, b, c};
  EXPECT_DOUBLE_EQ(MedianSummary(runs).ttft_s.p90_low, 0.2);
  EXPECT_DOUBLE_EQ(MedianSummary(runs).ttft_s.p90_high, 0.8);
  b.ttft_s.p90_high = std::numeric_limits<double>::quiet_NaN();
  const std::vector<Summary> without = {a, b, c};
  EXPECT_TRUE(std::isnan(MedianSummary(without).ttft_s.p90_high));
  EXPECT_DOUBLE_EQ(MedianSummary(without).ttft_s.p90_low, 0.2);
}

TEST(GoodputTest, HighestRateWithEveryLowerRateMeeting) {
  // 16 meets but 8 does not: 4 is the goodput. 4 meets exactly (>=).
  const std::vector<SweepPoint> points = {Point(1, 0.99), Point(2, 0.95),
                                          Point(4, 0.90), Point(8, 0.50),
                                          Point(16, 0.92)};
  EXPECT_EQ(Goodput(points, 0.9), 4);
  EXPECT_EQ(Goodput(points, 0.5), 16);
  EXPECT_EQ(Goodput(points, 0.96), 1);
}

TEST(GoodputTest, ZeroWhenTheLowestRateMisses) {
  const std::vector<SweepPoint> points = {Point(1, 0.80), Point(2, 0.95)};
  EXPECT_EQ(Goodput(points, 0.9), 0);
  EXPECT_EQ(Goodput({}, 0.9), 0);
}

TEST(GoodputTest, PointsInAnyOrder) {
  const std::vector<SweepPoint> points = {Point(16, 0.92), Point(2, 0.95),
                                          Point(8, 0.50), Point(1, 0.99),
                                          Point(4, 0.90)};
  EXPECT_EQ(Goodput(points, 0.9), 4);
  const std::vector<SweepPoint> misses_first = {Point(4, 0.95), Point(2, 0.95),
                                                Point(1, 0.5)};
  EXPECT_EQ(Goodput(misses_first, 0.9), 0);
}

TEST(GoodputTest, ClosedLoopPointsDoNotCount) {
  SweepPoint closed = Point(0, 0.1);
  closed.concurrency = 8;
  const std::vector<SweepPoint> points = {closed, Point(1, 0.99),
                                          Point(2, 0.95)};
  EXPECT_EQ(Goodput(points, 0.9), 2);
}

TEST(RecordsTest, JsonlRoundTrip) {
  std::vector<RequestRecord> records = SharedRun();
  records[0].token_s[1] =
      0.1 + 0.2;  // Not a short decimal: needs all 17 digits.
  records[2].index = int64_t{1} << 40;
  const std::string path = testing::TempDir() + "/records_round_trip.jsonl";
  ASSERT_TRUE(WriteRecords(path, records).ok());
  absl::StatusOr<std::vector<RequestRecord>> read = ReadRecords(path);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->size(), records.size());
  for (size_t i = 0; i < records.size(); ++i) {
    const RequestRecord& a = records[i];
    const RequestRecord& b = (*read)[i];
    EXPECT_EQ(a.index, b.index);
    EXPECT_EQ(a.send_s, b.send_s);
    EXPECT_EQ(a.token_s, b.token_s);
    EXPECT_EQ(a.end_s, b.end_s);
    EXPECT_EQ(a.input_tokens, b.input_tokens);
    EXPECT_EQ(a.output_tokens, b.output_tokens);
    EXPECT_EQ(a.outcome, b.outcome);
    EXPECT_EQ(a.error, b.error);
  }
  EXPECT_EQ((*read)[3].outcome, "UNAVAILABLE");
  EXPECT_EQ((*read)[3].error, "peer down");
  EXPECT_FALSE((*read)[3].ok());
}

TEST(RecordsTest, OneObjectPerLineWithNamedFields) {
  const nlohmann::json json = ToJson(SharedRun()[1]);
  EXPECT_EQ(json["index"], 1);
  EXPECT_EQ(json["send_s"], 1.0);
  EXPECT_EQ(json["token_s"].size(), 3u);
  EXPECT_EQ(json["end_s"], 1.9);
  EXPECT_EQ(json["input_tokens"], 200);
  EXPECT_EQ(json["output_tokens"], 3);
  EXPECT_EQ(json["outcome"], "OK");
}

std::string WriteFile(const std::string& name, const std::string& text) {
  const std::string path = testing::TempDir() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

const char kGoodLine[] =
    R"({"index":0,"send_s":0,"token_s":[0.5],"end_s":0.5,"input_tokens":4,)"
    R"("output_tokens":1,"outcome":"OK","error":""})";

TEST(RecordsTest, BadLinesNameTheLine) {
  struct Case {
    std::string line;
    std::string field;  // What the message must name.
  };
  const std::vector<Case> cases = {
      {"not json", "not JSON"},
      {R"({"index":0,"token_s":[],"end_s":0,"input_tokens":4,"output_tokens":1,"outcome":"OK"})",
       "send_s"},
      {R"({"index":0,"send_s":0,"token_s":[],"end_s":0,"input_tokens":4,"output_tokens":"x","outcome":"OK"})",
       "output_tokens"},
      {R"({"index":0,"send_s":0,"token_s":["a"],"end_s":0,"input_tokens":4,"output_tokens":1,"outcome":"OK"})",
       "token_s"},
      {R"({"index":0,"send_s":0,"token_s":[],"end_s":0,"input_tokens":4,"output_tokens":1,"outcome":7})",
       "outcome"},
      {"[1, 2]", "not a JSON object"},
  };
  for (const Case& c : cases) {
    // Line 3: a good line, a blank one, then the bad one.
    const std::string path = WriteFile(
        "bad_records.jsonl", std::string(kGoodLine) + "\n\n" + c.line + "\n");
    absl::StatusOr<std::vector<RequestRecord>> read = ReadRecords(path);
    ASSERT_FALSE(read.ok()) << c.line;
    EXPECT_EQ(read.status().code(), absl::StatusCode::kInvalidArgument)
        << c.line;
    EXPECT_THAT(read.status().message(), HasSubstr(path + ":3:")) << c.line;
    EXPECT_THAT(read.status().message(), HasSubstr(c.field)) << c.line;
  }
}

TEST(RecordsTest, ErrorFieldMayBeLeftOut) {
  const std::string path = WriteFile(
      "no_error.jsonl",
      R"({"index":2,"send_s":1,"token_s":[],"end_s":2,"input_tokens":4,"output_tokens":0,"outcome":"OK"})");
  absl::StatusOr<std::vector<RequestRecord>> read = ReadRecords(path);
  ASSERT_TRUE(read.ok()) << read.status();
  ASSERT_EQ(read->size(), 1u);
  EXPECT_EQ((*read)[0].index, 2);
  EXPECT_EQ((*read)[0].error, "");
}

TEST(RecordsTest, MissingFileIsNotFound) {
  EXPECT_EQ(ReadRecords(testing::TempDir() + "/no_such_records.jsonl")
                .status()
                .code(),
            absl::StatusCode::kNotFound);
}

std::vector<SweepPoint> Sweep() {
  const std::vector<RequestRecord> records = SharedRun();
  SummaryOptions options;
  options.slo.ttft_s = 0.45;
  options.slo.tpot_s = 0.22;
  SweepPoint low;  // Every request meets its target.
  low.rate = 2;
  low.summary = Summarize(std::vector<RequestRecord>{records[2]}, options);
  SweepPoint high;  // 1 of 4 meets.
  high.rate = 4;
  high.summary = Summarize(records, options);
  return {high, low};
}

TEST(SweepTest, TableHoldsTheFigures) {
  const std::string table = SweepTable(Sweep(), 0.9);
  // Rate 4: TTFT mean 400.0 ms, p90 480.0 ms; TPOT mean 225.0 ms; ITL mean
  // 220.0 ms; E2E p50 800.0 ms; 3 / 3.5 = 0.86 req/s; 350 / 3.5 = 100.0
  // input tok/s; attainment 25.0 %.
  EXPECT_THAT(
      table,
      HasSubstr(
          "| 4.00 | 4 | 3 | 0.86 | 100.0 | 2.3 | 400.0 | 400.0 | 480.0 |"));
  EXPECT_THAT(table, HasSubstr("| 225.0 |"));
  EXPECT_THAT(table, HasSubstr("| 220.0 |"));
  EXPECT_THAT(table, HasSubstr("| 800.0 |"));
  EXPECT_THAT(table, HasSubstr("| 25.0% |"));
  // Rate 2 (r2 alone): 100.0%.
  EXPECT_THAT(table, HasSubstr("| 2.00 | 1 | 1 |"));
  EXPECT_THAT(table, HasSubstr("| 100.0% |"));
  // 2 meets 0.9, 4 does not.
  EXPECT_THAT(table, HasSubstr("Goodput: 2.00 req/s"));
  EXPECT_THAT(table, HasSubstr("TTFT 450 ms and TPOT 220 ms"));
}

TEST(SweepTest, JsonHasEveryPointAndGoodput) {
  const nlohmann::json json = SweepToJson(Sweep(), 0.9);
  EXPECT_EQ(json["goodput"], 2.0);
  EXPECT_EQ(json["attainment_target"], 0.9);
  ASSERT_EQ(json["points"].size(), 2u);
  EXPECT_EQ(json["points"][0]["rate"], 4.0);
  EXPECT_EQ(json["points"][0]["requests"], 4);
  EXPECT_EQ(json["points"][0]["failures"]["UNAVAILABLE"], 1);
  EXPECT_NEAR(json["points"][0]["ttft_s"]["p90"].get<double>(), 0.48, 1e-12);
  // Three TTFTs (0.3, 0.4, 0.5): P(B <= 2) = 0.271 is the first >= 0.05,
  // so rank 1; no upper bound, null in JSON.
  const nlohmann::json& ci = json["points"][0]["ttft_s"]["p90_ci"];
  EXPECT_NEAR(ci[0].get<double>(), 0.4, 1e-12);
  EXPECT_TRUE(ci[1].is_null());
  EXPECT_NEAR(json["points"][0]["slo_attainment"].get<double>(), 0.25, 1e-12);
  EXPECT_EQ(json["points"][1]["rate"], 2.0);
}

TEST(SweepTest, InfinitiesAreNullInJson) {
  SweepPoint all_at_once = Point(kInf, 1.0);
  const nlohmann::json json =
      SweepToJson(std::vector<SweepPoint>{all_at_once}, 0.9);
  EXPECT_TRUE(json["points"][0]["rate"].is_null());
  EXPECT_TRUE(json["points"][0]["slo"]["ttft_s"].is_null());
  EXPECT_TRUE(json["goodput"].is_null());
}

}  // namespace
}  // namespace pdserve::planner
