// planner/profiler.h: the step-cost fit recovers known coefficients, the
// engine profile measures every kind of step on the real engine, the drift
// probe sees a profile that is off, and the transfer fit sees a real
// transport.
#include "planner/profiler.h"

#include <fstream>
#include <random>
#include <set>

#include "absl/strings/str_cat.h"
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

TEST(FitStepCostTest, FitsTheKvBeyondTheCacheOnStepsRightAfterTheirPrefill) {
  // Steps whose decode KV fits 1000 tokens follow `in_cache`. Of those
  // beyond it, the first after its prefill also pays 0.004 us per KV token
  // beyond 1000; later ones (the KV warm in a larger cache) do not, and are
  // left out of the fit.
  const StepCost in_cache{.base_s = 100e-6, .per_token_s = 2e-6, .per_sequence_s = 5e-6,
                          .per_attention_s = 1e-9, .per_decode_attention_s = 3e-9};
  StepCost truth = in_cache;
  truth.decode_cache_tokens = 1000;
  truth.per_decode_kv_beyond_cache_s = 4e-9;
  std::vector<StepSample> samples;
  for (int tokens : {16, 64, 512}) {
    for (double attention : {10.0, 1e4, 3e5}) {
      samples.push_back({.tokens = tokens, .sequences = 1, .attention = attention,
                         .seconds = truth.Seconds(tokens, 1, attention), .kind = "prefill"});
    }
  }
  for (int b : {1, 2, 4, 8, 16}) {
    for (int context : {64, 256, 1024}) {
      for (bool first : {true, false}) {
        const double decode = static_cast<double>(b) * context;
        const StepCost& cost = first ? truth : in_cache;
        samples.push_back({.tokens = b, .sequences = b, .decode_attention = decode,
                           .seconds = cost.Seconds(b, b, 0, decode), .kind = "decode",
                           .after_prefill = first});
      }
    }
  }
  auto fit = FitStepCost(samples, 1000);
  ASSERT_TRUE(fit.ok()) << fit.status();
  EXPECT_NEAR(fit->cost.base_s, 100e-6, 1e-9);
  EXPECT_NEAR(fit->cost.per_token_s, 2e-6, 1e-10);
  EXPECT_NEAR(fit->cost.per_sequence_s, 5e-6, 1e-10);
  EXPECT_NEAR(fit->cost.per_attention_s, 1e-9, 1e-14);
  EXPECT_NEAR(fit->cost.per_decode_attention_s, 3e-9, 1e-13);
  EXPECT_EQ(fit->cost.decode_cache_tokens, 1000);
  EXPECT_NEAR(fit->cost.per_decode_kv_beyond_cache_s, 4e-9, 1e-13);
  // 16 sequences at 1024: 16384 KV tokens, 15384 beyond the cache.
  EXPECT_NEAR(fit->cost.Seconds(16, 16, 0, 16384) - in_cache.Seconds(16, 16, 0, 16384),
              15384 * 4e-9, 1e-9);
  std::set<std::string> kinds;
  for (const auto& [kind, error] : fit->relative_error) {
    kinds.insert(kind);
    EXPECT_LT(error.second, 1e-6) << kind;
  }
  EXPECT_EQ(kinds, (std::set<std::string>{"prefill", "decode", "decode beyond cache"}));

  // Without a cache size: one fit of every sample, no term beyond it.
  auto plain = FitStepCost(samples);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_EQ(plain->cost.per_decode_kv_beyond_cache_s, 0);
  EXPECT_EQ(plain->cost.Seconds(16, 16, 0, 16384),
            plain->cost.base_s + 16 * (plain->cost.per_token_s + plain->cost.per_sequence_s) +
                16384 * plain->cost.per_decode_attention_s);
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
  // Each decode batch's first step and every mixed step come right after
  // their prefill; the other decode steps do not.
  int first_decode = 0;
  for (const StepSample& s : *samples) {
    if (s.kind == "mixed") {
      EXPECT_TRUE(s.after_prefill);
    }
    if (s.kind == "prefill") {
      EXPECT_FALSE(s.after_prefill);
    }
    first_decode += s.kind == "decode" && s.after_prefill;
  }
  EXPECT_GT(first_decode, 0);
  EXPECT_EQ(first_decode * 8, decode);  // 8 timed steps a batch.
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
  Profile slow = profile;
  for (double* c : {&slow.step.base_s, &slow.step.per_token_s, &slow.step.per_sequence_s,
                    &slow.step.per_attention_s, &slow.step.per_decode_attention_s,
                    &slow.step.per_decode_kv_beyond_cache_s}) {
    *c *= 2;
  }
  auto again = MeasureEngineSteps(DriftProbeOptions(profile));
  ASSERT_TRUE(again.ok()) << again.status();
  auto drift = ProbeRatio(slow, *again);
  ASSERT_TRUE(drift.ok()) << drift.status();
  // Measured against a profile that says twice the time: about half, with
  // room for the noise of two short measurements on a shared machine.
  EXPECT_GT(*drift, 0.3);
  EXPECT_LT(*drift, 0.8);
}

TEST(WithDriftTest, ScalesEachRolesCpuCostsOnly) {
  Profile p;
  p.step = {.base_s = 1, .per_token_s = 2};
  p.prefill_engine_scale = 1.1;
  p.decode_engine_scale = 0.9;
  p.decode_step_overhead_s = 6;
  p.decode_sequence_overhead_s = 7;
  p.prefill_cpu_per_request_s = 12;
  p.prefill_cpu_per_kv_byte_s = 13;
  p.colocated_first_token_s = 8;
  p.token_delivery_s = 9;
  p.transfers = {{.transport = "tcp", .latency_s = 10, .bytes_per_s = 11}};
  const Profile q = WithDrift(p, 1.5, 2);
  EXPECT_DOUBLE_EQ(q.prefill_engine_scale, 1.65);
  EXPECT_DOUBLE_EQ(q.prefill_cpu_per_request_s, 18);
  EXPECT_DOUBLE_EQ(q.prefill_cpu_per_kv_byte_s, 19.5);
  EXPECT_DOUBLE_EQ(q.decode_engine_scale, 1.8);
  EXPECT_DOUBLE_EQ(q.decode_step_overhead_s, 12);
  EXPECT_DOUBLE_EQ(q.decode_sequence_overhead_s, 14);
  // The step model is both roles': their scales carry the drift.
  EXPECT_DOUBLE_EQ(q.step.base_s, 1);
  EXPECT_DOUBLE_EQ(q.step.per_token_s, 2);
  EXPECT_DOUBLE_EQ(q.colocated_first_token_s, 8);
  EXPECT_DOUBLE_EQ(q.token_delivery_s, 9);
  EXPECT_DOUBLE_EQ(q.transfers[0].latency_s, 10);
  EXPECT_DOUBLE_EQ(q.transfers[0].bytes_per_s, 11);
}

TEST(CoreCacheBytesTest, IsTheL2ThatSysfsLists) {
  // The kernel's cache topology of CPU 0, an independent source: the
  // entry of level 2, its size in KiB ("2048K").
  int64_t sysfs_bytes = 0;
  for (int i = 0; i < 8; ++i) {
    const std::string dir = absl::StrCat("/sys/devices/system/cpu/cpu0/cache/index", i);
    int level = 0;
    std::string size;
    std::ifstream(dir + "/level") >> level;
    std::ifstream(dir + "/size") >> size;
    if (level == 2 && !size.empty() && size.back() == 'K') {
      sysfs_bytes = std::stoll(size.substr(0, size.size() - 1)) * 1024;
    }
  }
  if (sysfs_bytes == 0) GTEST_SKIP() << "this system lists no L2 in sysfs";
  EXPECT_EQ(CoreCacheBytes(), sysfs_bytes);
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
