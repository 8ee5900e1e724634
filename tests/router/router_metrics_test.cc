// RouterMetrics: what each recording method adds to the exposition, the
// series created up front (configured workers, retry kinds, migration outcomes, rejection
// reasons), RequestRecord's per-message recording (inter-token latency,
// finish reasons), and the real promtool on the whole exposition.
#include "router/router_metrics.h"

#include <string>

#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/common/metrics_test_util.h"

namespace pdserve {
namespace {

using testing_util::CheckWithPromtool;
using testing_util::SampleValue;

RouterMetrics::Options TwoWorkers() {
  return {.prefill_workers = {"prefill-0"}, .decode_workers = {"decode-0"}};
}

TEST(RouterMetricsTest, ConfiguredSeriesExistBeforeAnyRequest) {
  RouterMetrics metrics(TwoWorkers());
  const std::string text = metrics.Exposition();
  EXPECT_EQ(SampleValue(text, R"(pdserve_router_routed_total{role="prefill",worker="prefill-0"})"), 0);
  EXPECT_EQ(SampleValue(text, R"(pdserve_router_routed_total{role="decode",worker="decode-0"})"), 0);
  for (const char* kind : {"prefill", "decode"}) {
    EXPECT_EQ(SampleValue(text, absl::StrCat(R"(pdserve_router_retries_total{kind=")", kind, "\"}")), 0);
  }
  for (const char* outcome : {"continued", "limit_spent", "no_worker", "abandoned"}) {
    EXPECT_EQ(SampleValue(text, absl::StrCat(R"(pdserve_router_migrations_total{outcome=")",
                                             outcome, "\"}")),
              0);
  }
  for (const char* reason : {"queue_full", "too_large", "stopping"}) {
    EXPECT_EQ(SampleValue(text, absl::StrCat(R"(pdserve_router_rejected_requests_total{reason=")",
                                             reason, "\"}")),
              0);
  }
  EXPECT_EQ(SampleValue(text, "pdserve_router_queue_time_seconds_count"), 0);
  EXPECT_EQ(SampleValue(text, R"(pdserve_router_finished_choices_total{reason="stop"})"), 0);
}

TEST(RouterMetricsTest, OrchestratorRecordingMethods) {
  RouterMetrics metrics(TwoWorkers());
  metrics.Routed("prefill", "prefill-0");
  metrics.Routed("decode", "decode-0");
  metrics.Routed("decode", "decode-0");
  metrics.Routed("decode", "decode-9");  // Not configured: created on first use.
  metrics.PrefixMatched(100, 64);
  metrics.PrefixMatched(50, 0);
  metrics.Retried("prefill");
  metrics.Retried("decode");
  metrics.Migrated("continued");
  metrics.Migrated("continued");
  metrics.Migrated("limit_spent");
  metrics.Rejected("queue_full");
  metrics.Rejected("too_large");
  metrics.Rejected("too_large");
  metrics.QueueTime(absl::Milliseconds(3));
  const std::string text = metrics.Exposition();
  EXPECT_EQ(SampleValue(text, R"(pdserve_router_routed_total{role="prefill",worker="prefill-0"})"), 1);
  EXPECT_EQ(SampleValue(text, R"(pdserve_router_routed_total{role="decode",worker="decode-0"})"), 2);
  EXPECT_EQ(SampleValue(text, R"(pdserve_router_routed_total{role="decode",worker="decode-9"})"), 1);
  EXPECT_EQ(SampleValue(text, "pdserve_router_prefix_match_prompt_tokens_total"), 150);
  EXPECT_EQ(SampleValue(text, "pdserve_router_prefix_match_cached_tokens_total"), 64);
  EXPECT_EQ(SampleValue(text, R"(pdserve_router_retries_total{kind="prefill"})"), 1);
  EXPECT_EQ(SampleValue(text, R"(pdserve_router_retries_total{kind="decode"})"), 1);
  EXPECT_EQ(SampleValue(text, R"(pdserve_router_migrations_total{outcome="continued"})"), 2);
  EXPECT_EQ(SampleValue(text, R"(pdserve_router_migrations_total{outcome="limit_spent"})"), 1);
  EXPECT_EQ(SampleValue(text, R"(pdserve_router_migrations_total{outcome="no_worker"})"), 0);
  EXPECT_EQ(SampleValue(text, R"(pdserve_router_rejected_requests_total{reason="queue_full"})"), 1);
  EXPECT_EQ(SampleValue(text, R"(pdserve_router_rejected_requests_total{reason="too_large"})"), 2);
  EXPECT_EQ(SampleValue(text, "pdserve_router_queue_time_seconds_count"), 1);
  EXPECT_EQ(SampleValue(text, R"(pdserve_router_queue_time_seconds_bucket{le="0.0025"})"), 0);
  EXPECT_EQ(SampleValue(text, R"(pdserve_router_queue_time_seconds_bucket{le="0.005"})"), 1);
  EXPECT_NEAR(SampleValue(text, "pdserve_router_queue_time_seconds_sum"), 0.003, 1e-9);
}

v1::GenerateResponse Tokens(int n, uint32_t index = 0) {
  v1::GenerateResponse message;
  for (int i = 0; i < n; ++i) message.add_token_ids(i);
  message.set_index(index);
  return message;
}

TEST(RouterMetricsTest, RequestRecordRecordsLatenciesReasonsAndTokens) {
  RouterMetrics metrics;
  RequestRecord record(absl::Now() - absl::Milliseconds(20), metrics);
  record.Sent(Tokens(1));           // First token: TTFT, no ITL.
  record.Sent(Tokens(2));           // ITL observation 1.
  record.Sent(Tokens(0));           // No tokens: no observation.
  record.Sent(Tokens(1, /*index=*/1));  // Choice 1's first: none.
  v1::GenerateResponse last = Tokens(1);
  last.set_finish_reason(v1::FINISH_REASON_LENGTH);
  last.mutable_usage()->set_prompt_tokens(7);
  last.mutable_usage()->set_completion_tokens(4);
  record.Sent(last);                // ITL observation 2.
  v1::GenerateResponse last1 = Tokens(0, 1);
  last1.set_finish_reason(v1::FINISH_REASON_STOP);
  last1.mutable_usage()->set_prompt_tokens(7);
  last1.mutable_usage()->set_completion_tokens(1);
  record.Sent(last1);
  record.Finish("grpc", absl::OkStatus());
  record.Finish("http", absl::CancelledError());
  const std::string text = metrics.Exposition();
  EXPECT_EQ(SampleValue(text, "pdserve_router_inter_token_latency_seconds_count"), 2);
  EXPECT_EQ(SampleValue(text, R"(pdserve_router_finished_choices_total{reason="length"})"), 1);
  EXPECT_EQ(SampleValue(text, R"(pdserve_router_finished_choices_total{reason="stop"})"), 1);
  EXPECT_EQ(SampleValue(text, R"(pdserve_router_requests_total{api="grpc",outcome="ok"})"), 1);
  EXPECT_EQ(SampleValue(text, R"(pdserve_router_requests_total{api="http",outcome="cancelled"})"), 1);
  EXPECT_EQ(SampleValue(text, "pdserve_router_prompt_tokens_total"), 14);  // Two Finish calls.
  EXPECT_EQ(SampleValue(text, "pdserve_router_generation_tokens_total"), 10);
  EXPECT_EQ(SampleValue(text, "pdserve_router_time_to_first_token_seconds_count"), 2);
  EXPECT_GE(SampleValue(text, "pdserve_router_time_to_first_token_seconds_sum"), 0.04);
  EXPECT_EQ(SampleValue(text, "pdserve_router_time_per_output_token_seconds_count"), 2);
  EXPECT_EQ(SampleValue(text, "pdserve_router_request_duration_seconds_count"), 2);
}

TEST(RouterMetricsTest, PromtoolAcceptsTheExposition) {
  RouterMetrics metrics(TwoWorkers());
  metrics.registry().AddCallbackGauge("pdserve_router_requests_running", "Running.",
                                      [] { return 1.0; });
  metrics.Routed("decode", "decode \"odd\" id");
  RequestRecord record(absl::Now(), metrics);
  record.Sent(Tokens(1));
  record.Sent(Tokens(1));
  record.Finish("grpc", absl::ResourceExhaustedError("full"));
  const absl::Status status = CheckWithPromtool(metrics.Exposition());
  EXPECT_TRUE(status.ok()) << status << "\n" << metrics.Exposition();
}

}  // namespace
}  // namespace pdserve
