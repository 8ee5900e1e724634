// MetricsRegistry: the text exposition's exact form (HELP/TYPE, labels and
// their escaping, cumulative buckets, +Inf, _sum/_count), concurrent
// recording, the /metrics endpoint, and the real `promtool check metrics`
// on an exposition with every kind of metric.
#include "common/metrics.h"

#include <limits>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "common/metrics_http.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/metrics_test_util.h"

namespace pdserve {
namespace {

using ::testing::HasSubstr;
using testing_util::CheckWithPromtool;
using testing_util::HttpGet;
using testing_util::SampleValue;

TEST(MetricsTest, CounterAndGauge) {
  MetricsRegistry registry;
  Counter* requests = registry.AddCounter("test_requests_total", "Requests.");
  Gauge* running = registry.AddGauge("test_running", "Running now.");
  requests->Increment();
  requests->Increment(41);
  running->Set(3);
  running->Add(-1.5);
  EXPECT_EQ(requests->value(), 42);
  EXPECT_EQ(registry.Exposition(),
            "# HELP test_requests_total Requests.\n"
            "# TYPE test_requests_total counter\n"
            "test_requests_total 42\n"
            "# HELP test_running Running now.\n"
            "# TYPE test_running gauge\n"
            "test_running 1.5\n");
}

TEST(MetricsTest, HistogramBucketsAreCumulativeWithInf) {
  MetricsRegistry registry;
  Histogram* h = registry.AddHistogram("test_latency_seconds", "Latency.",
                                       {0.1, 1, 10});
  h->Observe(0.05);
  h->Observe(0.1);  // On a bound: counted in it (le).
  h->Observe(5);
  h->Observe(100);
  h->ObserveDuration(absl::Milliseconds(500));
  EXPECT_EQ(h->count(), 5);
  EXPECT_EQ(registry.Exposition(),
            "# HELP test_latency_seconds Latency.\n"
            "# TYPE test_latency_seconds histogram\n"
            "test_latency_seconds_bucket{le=\"0.1\"} 2\n"
            "test_latency_seconds_bucket{le=\"1\"} 3\n"
            "test_latency_seconds_bucket{le=\"10\"} 4\n"
            "test_latency_seconds_bucket{le=\"+Inf\"} 5\n"
            "test_latency_seconds_sum 105.65\n"
            "test_latency_seconds_count 5\n");
}

TEST(MetricsTest, FamiliesListChildrenSortedWithEscapedLabels) {
  MetricsRegistry registry;
  CounterFamily* family = registry.AddCounterFamily(
      "test_events_total", "Events\\by \"kind\"\nsecond line.", {"kind", "worker"});
  family->WithLabels({"b", "w1"})->Increment(2);
  family->WithLabels({"a\"q\\\n", "w0"})->Increment();
  // The same values give the same child.
  EXPECT_EQ(family->WithLabels({"b", "w1"}), family->WithLabels({"b", "w1"}));
  HistogramFamily* hist = registry.AddHistogramFamily(
      "test_push_seconds", "Push time.", {"transport"}, {1});
  hist->WithLabels({"tcp"})->Observe(2);
  EXPECT_EQ(registry.Exposition(),
            "# HELP test_events_total Events\\\\by \"kind\"\\nsecond line.\n"
            "# TYPE test_events_total counter\n"
            "test_events_total{kind=\"a\\\"q\\\\\\n\",worker=\"w0\"} 1\n"
            "test_events_total{kind=\"b\",worker=\"w1\"} 2\n"
            "# HELP test_push_seconds Push time.\n"
            "# TYPE test_push_seconds histogram\n"
            "test_push_seconds_bucket{transport=\"tcp\",le=\"1\"} 0\n"
            "test_push_seconds_bucket{transport=\"tcp\",le=\"+Inf\"} 1\n"
            "test_push_seconds_sum{transport=\"tcp\"} 2\n"
            "test_push_seconds_count{transport=\"tcp\"} 1\n");
}

TEST(MetricsTest, CallbackGaugesAreReadAtScrape) {
  MetricsRegistry registry;
  int queued = 1;
  registry.AddCallbackGauge("test_queued", "Queued.", [&] { return queued; });
  registry.AddCallbackGaugeFamily(
      "test_blocks", "Blocks.", {"state"}, [&](std::vector<LabeledValue>* out) {
        out->push_back({{"free"}, 7});
        out->push_back({{"used"}, static_cast<double>(queued)});
        out->push_back({{"too", "many"}, 1});  // Dropped.
      });
  int64_t served = 3;
  registry.AddCallbackCounter("test_served_total", "Served.", [&] { return served; });
  queued = 5;
  const std::string text = registry.Exposition();
  EXPECT_EQ(SampleValue(text, "test_queued"), 5);
  EXPECT_THAT(text, HasSubstr("# TYPE test_served_total counter\ntest_served_total 3\n"));
  EXPECT_EQ(SampleValue(text, "test_blocks{state=\"free\"}"), 7);
  EXPECT_EQ(SampleValue(text, "test_blocks{state=\"used\"}"), 5);
  EXPECT_THAT(text, Not(HasSubstr("too")));
}

TEST(MetricsTest, SumsOneMetricsSamplesFromAnExposition) {
  MetricsRegistry registry;
  CounterFamily* routed =
      registry.AddCounterFamily("test_routed_total", "Routed.", {"role", "worker"});
  routed->WithLabels({"prefill", "p0"})->Increment(2);
  routed->WithLabels({"prefill", "p1"})->Increment(3);
  routed->WithLabels({"decode", "d0"})->Increment(7);
  Histogram* steps = registry.AddHistogram("test_step_seconds", "Steps.", {0.1, 1});
  steps->Observe(0.25);
  steps->Observe(0.5);
  const std::string text = registry.Exposition();
  EXPECT_EQ(SumOfSamples(text, "test_routed_total").value(), 12);
  EXPECT_EQ(SumOfSamples(text, "test_routed_total", "role=\"prefill\"").value(), 5);
  EXPECT_EQ(SumOfSamples(text, "test_routed_total", "worker=\"d0\"").value(), 7);
  EXPECT_EQ(SumOfSamples(text, "test_routed_total", "role=\"none\"").value(), std::nullopt);
  // A histogram's _sum, not its buckets or _count (same prefix, other names).
  EXPECT_EQ(SumOfSamples(text, "test_step_seconds_sum").value(), 0.75);
  EXPECT_EQ(SumOfSamples(text, "test_step").value(), std::nullopt);
  EXPECT_EQ(SumOfSamples(text, "test_absent").value(), std::nullopt);
  EXPECT_EQ(SumOfSamples("test_bad{a=\"b\"} x\n", "test_bad").status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(MetricsTest, ValueFormatting) {
  EXPECT_EQ(FormatMetricValue(0), "0");
  EXPECT_EQ(FormatMetricValue(3), "3");
  EXPECT_EQ(FormatMetricValue(0.0025), "0.0025");
  EXPECT_EQ(FormatMetricValue(1e21), "1e+21");
  EXPECT_EQ(FormatMetricValue(std::numeric_limits<double>::infinity()), "+Inf");
  EXPECT_EQ(FormatMetricValue(-std::numeric_limits<double>::infinity()), "-Inf");
  EXPECT_EQ(FormatMetricValue(std::numeric_limits<double>::quiet_NaN()), "NaN");
  EXPECT_EQ(EscapeLabelValue("a\\b\"c\nd"), "a\\\\b\\\"c\\nd");
}

TEST(MetricsTest, ConcurrentRecordingLosesNothing) {
  MetricsRegistry registry;
  Counter* counter = registry.AddCounter("test_ops_total", "Ops.");
  Histogram* hist = registry.AddHistogram("test_op_seconds", "Op time.", LatencyBuckets());
  CounterFamily* family = registry.AddCounterFamily("test_by_thread_total", "By thread.", {"t"});
  constexpr int kThreads = 4, kOps = 20000;
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      Counter* mine = family->WithLabels({std::to_string(t % 2)});
      for (int i = 0; i < kOps; ++i) {
        counter->Increment();
        hist->Observe(0.5);
        mine->Increment();
        if (i % 5000 == 0) (void)registry.Exposition();  // Scrapes meanwhile.
      }
    });
  }
  for (auto& thread : threads) thread.join();
  EXPECT_EQ(counter->value(), kThreads * kOps);
  EXPECT_EQ(hist->count(), kThreads * kOps);
  EXPECT_DOUBLE_EQ(hist->sum(), 0.5 * kThreads * kOps);
  EXPECT_EQ(family->WithLabels({"0"})->value() + family->WithLabels({"1"})->value(),
            kThreads * kOps);
}

TEST(MetricsDeathTest, NamesBreakingTheStyleAbort) {
  MetricsRegistry registry;
  EXPECT_DEATH(registry.AddCounter("test_requests", "No _total."), "_total");
  EXPECT_DEATH(registry.AddGauge("test_running_total", "A gauge."), "_total");
  EXPECT_DEATH(registry.AddGauge("9bad", "Bad name."), "bad metric name");
  EXPECT_DEATH(registry.AddHistogramFamily("test_h_seconds", "h", {"le"}, {1}), "le");
  EXPECT_DEATH(registry.AddHistogram("test_h_seconds", "h", {2, 1}), "increase");
  registry.AddGauge("test_once", "Once.");
  EXPECT_DEATH(registry.AddGauge("test_once", "Twice."), "twice");
}

TEST(MetricsTest, ServesMetricsAndHealthOverHttp) {
  MetricsRegistry registry;
  registry.AddCounter("test_served_total", "Served.")->Increment(7);
  auto server = StartMetricsServer("127.0.0.1:0", &registry);
  ASSERT_TRUE(server.ok()) << server.status();
  absl::StatusOr<std::string> metrics = HttpGet((*server)->port(), "/metrics");
  ASSERT_TRUE(metrics.ok()) << metrics.status();
  EXPECT_EQ(SampleValue(*metrics, "test_served_total"), 7);
  absl::StatusOr<std::string> health = HttpGet((*server)->port(), "/health");
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_EQ(*health, "ok\n");
  EXPECT_THAT(HttpGet((*server)->port(), "/other").status().message(), HasSubstr("404"));
}

// The real promtool lints what the module writes: names, units, HELP,
// histogram layout, escaping.
TEST(MetricsTest, PromtoolAcceptsTheExposition) {
  MetricsRegistry registry;
  registry.AddCounter("pdserve_test_requests_total", "Requests finished.")->Increment(3);
  registry.AddGauge("pdserve_test_running_requests", "Requests running.")->Set(2);
  registry.AddCallbackGauge("pdserve_test_queued_requests", "Requests queued.",
                            [] { return 4.0; });
  CounterFamily* by = registry.AddCounterFamily("pdserve_test_events_total",
                                                "Events \"quoted\"\\ by kind.", {"kind"});
  by->WithLabels({"with \"quotes\" \\ and\nnewline"})->Increment();
  by->WithLabels({"plain"})->Increment(2);
  HistogramFamily* push = registry.AddHistogramFamily(
      "pdserve_test_push_seconds", "Push time.", {"transport"}, LatencyBuckets());
  push->WithLabels({"tcp"})->Observe(0.02);
  push->WithLabels({"ucx"})->Observe(400);
  registry.AddHistogram("pdserve_test_empty_seconds", "Nothing observed.", LatencyBuckets());
  registry.AddCounterFamily("pdserve_test_unused_total", "No child yet.", {"x"});
  registry.AddGauge("pdserve_test_kv_bytes", "Bytes.")->Set(1e12);
  const absl::Status status = CheckWithPromtool(registry.Exposition());
  EXPECT_TRUE(status.ok()) << status << "\n" << registry.Exposition();
}

// The check above is not vacuous: promtool does flag what breaks the style.
TEST(MetricsTest, PromtoolFlagsACounterWithoutTotal) {
  const absl::Status status = CheckWithPromtool(
      "# HELP pdserve_test_seconds x\n# TYPE pdserve_test_seconds counter\n"
      "pdserve_test_seconds 1\n");
  EXPECT_THAT(status.message(), HasSubstr("_total"));
}

}  // namespace
}  // namespace pdserve
