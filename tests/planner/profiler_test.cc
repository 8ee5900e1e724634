// planner/profiler.h: the step-cost fit recovers known coefficients, the
// engine profile measures every kind of step on the real engine, the drift
// check sees a profile that is off, and the transfer fit sees a real
// transport.
#include "planner/profiler.h"

#include <random>
#include <set>

#include "gtest/gtest.h"

namespace pdserve::planner {
namespace {

TEST(FitStepCostTest, RecoversTheCoefficientsOfExactSamples) {
  // seconds = 100 us + 2 us * tokens + 5 us * sequences
  //           + 0.001 us * attention + 0.003 us * decode attention.
  const StepCost truth{.base_s = 100e-6, .per_token_s = 2e-6, .per_sequence_s = 5e-6,
                       .per_attention_s = 1e-9, .per_decode_attention_s = 3e-9};
  std::vector<StepSample> samples;
  for (int tokens : {1, 8, 64, 512}) {
    for (int sequences : {1, 4, 16}) {
      if (sequences > tokens) continue;
      for (double attention : {10.0, 1e4, 3e5}) {
        for (double decode : {0.0, 2e3, 5e4}) {
          samples.push_back({.tokens = tokens, .sequences = sequences, .attention = attention,
                             .decode_attention = decode,
                             .seconds = truth.Seconds(tokens, sequences, attention, decode),
                             .kind = "prefill"});
        }
      }
    }
  }
  auto fit = FitStepCost(samples);
  ASSERT_TRUE(fit.ok()) << fit.status();
  EXPECT_NEAR(fit->cost.base_s, 100e-6, 1e-9);
  EXPECT_NEAR(fit->cost.per_token_s, 2e-6, 1e-11);
  EXPECT_NEAR(fit->cost.per_sequence_s, 5e-6, 1e-10);
  EXPECT_NEAR(fit->cost.per_attention_s, 1e-9, 1e-14);
  EXPECT_NEAR(fit->cost.per_decode_attention_s, 3e-9, 1e-14);
  ASSERT_EQ(fit->relative_error.size(), 1u);
  EXPECT_LT(fit->relative_error[0].second.second, 1e-6);
}

TEST(FitStepCostTest, NoCoefficientComesOutNegative) {
  // Steps that get cheaper with more sequences: the fit drops that term
  // rather than predict negative costs.
  std::vector<StepSample> samples;
  std::mt19937_64 rng(1);
  for (int i = 0; i < 40; ++i) {
    const int tokens = 1 + static_cast<int>(rng() % 256);
    const int sequences = 1 + static_cast<int>(rng() % 8);
    samples.push_back({.tokens = tokens, .sequences = sequences, .attention = 0,
                       .seconds = 1e-4 + 1e-6 * tokens - 1e-6 * sequences, .kind = "mixed"});
  }
  auto fit = FitStepCost(samples);
  ASSERT_TRUE(fit.ok()) << fit.status();
  EXPECT_GE(fit->cost.base_s, 0);
  EXPECT_GE(fit->cost.per_token_s, 0);
  EXPECT_GE(fit->cost.per_sequence_s, 0);
  EXPECT_GE(fit->cost.per_attention_s, 0);
  EXPECT_GE(fit->cost.per_decode_attention_s, 0);
}

TEST(FitStepCostTest, TooFewSamplesIsAnError) {
  EXPECT_EQ(FitStepCost({{.tokens = 1, .sequences = 1, .seconds = 1}}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(MeasureEngineStepsTest, MeasuresEveryKindOfStepOnTheRealEngine) {
  auto samples = MeasureEngineSteps({.model = "builtin:tiny", .max_batch_tokens = 64,
                                     .max_running = 8, .max_context = 128, .reps = 1});
  ASSERT_TRUE(samples.ok()) << samples.status();
  int prefill = 0, decode = 0, mixed = 0;
  for (const StepSample& s : *samples) {
    EXPECT_GT(s.seconds, 0);
    EXPECT_GE(s.tokens, s.sequences);
    prefill += s.kind == "prefill";
    decode += s.kind == "decode";
    mixed += s.kind == "mixed";
  }
  EXPECT_GT(prefill, 0);
  EXPECT_GT(decode, 0);
  EXPECT_GT(mixed, 0);
  // A 64-token chunk costs more than a 16-token one (the engine's work
  // grows with the tokens).
  double t16 = 0, t64 = 0;
  for (const StepSample& s : *samples) {
    if (s.kind != "prefill" || s.attention != AttentionPairs(0, s.tokens)) continue;
    (s.tokens == 16 ? t16 : t64) += s.tokens == 16 || s.tokens == 64 ? s.seconds : 0;
  }
  EXPECT_GT(t64, t16);
  auto fit = FitStepCost(*samples);
  ASSERT_TRUE(fit.ok()) << fit.status();
  EXPECT_GT(fit->cost.Seconds(64, 1, 64 * 64), 0);
}

TEST(MeasureEngineStepsTest, BadOptionsAreRefused) {
  EXPECT_EQ(MeasureEngineSteps({.max_batch_tokens = 8}).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(MeasureEngineStepsTest, TheProbeIsAShortPrefillAndDecodeDesign) {
  const EngineProfileOptions full = {.model = "builtin:tiny", .max_batch_tokens = 128,
                                     .max_running = 16, .max_context = 256, .reps = 2};
  EngineProfileOptions probe = full;
  probe.probe = true;
  auto full_samples = MeasureEngineSteps(full);
  auto probe_samples = MeasureEngineSteps(probe);
  ASSERT_TRUE(full_samples.ok()) << full_samples.status();
  ASSERT_TRUE(probe_samples.ok()) << probe_samples.status();
  std::set<std::pair<std::string, int64_t>> points;
  for (const StepSample& s : *probe_samples) {
    EXPECT_NE(s.kind, "mixed");
    points.insert({s.kind, s.tokens});
  }
  // Chunks of 64 and 128 tokens; decode batches of 1 and 8.
  const std::set<std::pair<std::string, int64_t>> expected = {
      {"prefill", 64}, {"prefill", 128}, {"decode", 1}, {"decode", 8}};
  EXPECT_EQ(points, expected);
  EXPECT_LT(probe_samples->size() * 2, full_samples->size());
}

TEST(ProbeRatioTest, IsTheMedianOfMeasuredOverPredicted) {
  Profile profile;
  profile.step = {.base_s = 1e-3, .per_token_s = 1e-5};
  // Predicted: 2 ms (100 tokens), 11 ms (1000 tokens), 1.01 ms (1 token).
  const std::vector<StepSample> samples = {
      {.tokens = 100, .sequences = 1, .seconds = 4e-3},
      {.tokens = 1000, .sequences = 1, .seconds = 5.5e-3},
      {.tokens = 1, .sequences = 1, .seconds = 1.515e-3}};
  auto drift = ProbeRatio(profile, samples);
  ASSERT_TRUE(drift.ok()) << drift.status();
  EXPECT_NEAR(*drift, 1.5, 1e-9);  // Ratios 2, 0.5 and 1.5.
  EXPECT_EQ(ProbeRatio(profile, {}).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(ProbeRatioTest, SeesAProfileTwiceAsSlowAsTheEngine) {
  Profile profile;
  profile.model = "builtin:tiny";
  profile.max_batch_tokens = 128;
  profile.max_running = 16;
  profile.max_context = 512;
  auto first = MeasureEngineSteps(DriftProbeOptions(profile));
  ASSERT_TRUE(first.ok()) << first.status();
  auto fit = FitStepCost(*first);
  ASSERT_TRUE(fit.ok()) << fit.status();
  profile.step = fit->cost;
  const Profile slow = WithDrift(profile, 2.0);
  auto again = MeasureEngineSteps(DriftProbeOptions(profile));
  ASSERT_TRUE(again.ok()) << again.status();
  auto drift = ProbeRatio(slow, *again);
  ASSERT_TRUE(drift.ok()) << drift.status();
  // Measured against a profile that says twice the time: about half, with
  // room for the noise of two short measurements on a shared machine.
  EXPECT_GT(*drift, 0.3);
  EXPECT_LT(*drift, 0.8);
}

TEST(WithDriftTest, ScalesTheCpuCostsOnly) {
  Profile p;
  p.step = {.base_s = 1, .per_token_s = 2, .per_sequence_s = 3, .per_attention_s = 4,
            .per_decode_attention_s = 5};
  p.decode_step_overhead_s = 6;
  p.decode_sequence_overhead_s = 7;
  p.prefill_cpu_per_request_s = 12;
  p.prefill_cpu_per_kv_byte_s = 13;
  p.colocated_first_token_s = 8;
  p.token_delivery_s = 9;
  p.transfers = {{.transport = "tcp", .latency_s = 10, .bytes_per_s = 11}};
  const Profile q = WithDrift(p, 1.5);
  EXPECT_DOUBLE_EQ(q.step.base_s, 1.5);
  EXPECT_DOUBLE_EQ(q.step.per_token_s, 3);
  EXPECT_DOUBLE_EQ(q.step.per_sequence_s, 4.5);
  EXPECT_DOUBLE_EQ(q.step.per_attention_s, 6);
  EXPECT_DOUBLE_EQ(q.step.per_decode_attention_s, 7.5);
  EXPECT_DOUBLE_EQ(q.decode_step_overhead_s, 9);
  EXPECT_DOUBLE_EQ(q.decode_sequence_overhead_s, 10.5);
  EXPECT_DOUBLE_EQ(q.prefill_cpu_per_request_s, 18);
  EXPECT_DOUBLE_EQ(q.prefill_cpu_per_kv_byte_s, 19.5);
  EXPECT_DOUBLE_EQ(q.colocated_first_token_s, 8);
  EXPECT_DOUBLE_EQ(q.token_delivery_s, 9);
  EXPECT_DOUBLE_EQ(q.transfers[0].latency_s, 10);
  EXPECT_DOUBLE_EQ(q.transfers[0].bytes_per_s, 11);
}

TEST(KvBytesPerTokenTest, TinyModel) {
  // builtin:tiny: 4 layers, 2 KV heads of 32 dims, fp32 cache: K and V.
  auto bytes = KvBytesPerToken("builtin:tiny");
  ASSERT_TRUE(bytes.ok()) << bytes.status();
  EXPECT_EQ(*bytes, 2.0 * 4 * 2 * 32 * 4);
}

TEST(MeasureTransfersTest, TcpHasALatencyAndABandwidth) {
  auto t = MeasureTransfers({"tcp"}, 2);
  ASSERT_TRUE(t.ok()) << t.status();
  ASSERT_EQ(t->size(), 1u);
  EXPECT_EQ((*t)[0].transport, "tcp");
  EXPECT_GT((*t)[0].bytes_per_s, 1e7);  // Loopback moves more than 10 MB/s.
}

}  // namespace
}  // namespace pdserve::planner
