// The sampler: greedy, seeded reproducibility, the distribution it draws
// from, the filters, logprobs against an independent double computation,
// and validation.
#include "engine/sampler.h"

#include <cmath>
#include <map>
#include <set>

#include "gtest/gtest.h"

namespace pdserve {
namespace {

std::vector<double> Softmax(const std::vector<float>& logits, double temperature) {
  double mx = -1e300;
  for (float l : logits) mx = std::max(mx, l / temperature);
  std::vector<double> p(logits.size());
  double sum = 0;
  for (size_t i = 0; i < logits.size(); ++i) sum += (p[i] = std::exp(logits[i] / temperature - mx));
  for (double& x : p) x /= sum;
  return p;
}

// Draws `n` samples and checks every token's frequency against `want`
// within 5 standard deviations (plus a floor), so the test cannot fail by
// chance in practice while still catching a wrong distribution.
void ExpectDistribution(Sampler& s, const std::vector<float>& logits, const std::vector<double>& want,
                        int n) {
  std::vector<int> counts(logits.size(), 0);
  for (int i = 0; i < n; ++i) ++counts[s.Sample(logits).token];
  for (size_t t = 0; t < logits.size(); ++t) {
    const double p = want[t];
    const double sigma = std::sqrt(n * p * (1 - p));
    EXPECT_NEAR(counts[t], n * p, 5 * sigma + 3) << "token " << t;
  }
}

const std::vector<float> kLogits = {1.0f, 2.5f, -0.5f, 0.0f, 2.0f, -3.0f, 1.5f, 0.7f};

TEST(SamplerTest, GreedyIsArgmaxWithLowestIdOnTies) {
  Sampler s(SamplingParams{.temperature = 0.0f});
  EXPECT_EQ(s.Sample(kLogits).token, 1);
  const std::vector<float> tie = {0.0f, 3.0f, 1.0f, 3.0f};
  EXPECT_EQ(s.Sample(tie).token, 1);
}

TEST(SamplerTest, SameSeedSameTokensDifferentSeedDifferentTokens) {
  auto run = [](uint64_t seed) {
    Sampler s(SamplingParams{.temperature = 1.0f, .seed = seed});
    std::vector<int32_t> out;
    for (int i = 0; i < 64; ++i) out.push_back(s.Sample(kLogits).token);
    return out;
  };
  EXPECT_EQ(run(7), run(7));
  EXPECT_NE(run(7), run(8));
}

TEST(SamplerTest, TemperatureSamplingFollowsTheSoftmax) {
  for (float t : {0.7f, 1.5f}) {
    Sampler s(SamplingParams{.temperature = t, .seed = 42});
    ExpectDistribution(s, kLogits, Softmax(kLogits, t), 200000);
  }
}

TEST(SamplerTest, TopKKeepsTheKBestRenormalized) {
  Sampler s(SamplingParams{.temperature = 1.0f, .top_k = 3, .seed = 1});
  // The three best: ids 1 (2.5), 4 (2.0), 6 (1.5).
  std::vector<float> kept = {2.5f, 2.0f, 1.5f};
  const std::vector<double> p3 = Softmax(kept, 1.0);
  std::vector<double> want(kLogits.size(), 0.0);
  want[1] = p3[0];
  want[4] = p3[1];
  want[6] = p3[2];
  ExpectDistribution(s, kLogits, want, 100000);
}

TEST(SamplerTest, TopPKeepsTheSmallestSetReachingP) {
  // Probabilities 0.5, 0.3, 0.15, 0.05 (logits are their logs).
  const std::vector<float> logits = {std::log(0.15f), std::log(0.5f), std::log(0.05f), std::log(0.3f)};
  Sampler s(SamplingParams{.temperature = 1.0f, .top_p = 0.75f, .seed = 3});
  // 0.5 < 0.75 <= 0.5 + 0.3: tokens 1 and 3 survive, renormalized.
  ExpectDistribution(s, logits, {0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8}, 50000);
  Sampler tiny(SamplingParams{.temperature = 1.0f, .top_p = 0.01f, .seed = 3});
  for (int i = 0; i < 100; ++i) EXPECT_EQ(tiny.Sample(logits).token, 1);  // Always at least one.
}

TEST(SamplerTest, MinPDropsTokensBelowAFractionOfTheBest) {
  const std::vector<float> logits = {std::log(0.15f), std::log(0.5f), std::log(0.05f), std::log(0.3f)};
  // min_p 0.25: threshold 0.125 keeps 0.5, 0.3, 0.15.
  Sampler s(SamplingParams{.temperature = 1.0f, .min_p = 0.25f, .seed = 5});
  ExpectDistribution(s, logits, {0.15 / 0.95, 0.5 / 0.95, 0.0, 0.3 / 0.95}, 50000);
}

TEST(SamplerTest, LogprobsAreLogSoftmaxOfTheRawLogits) {
  Sampler s(SamplingParams{.temperature = 0.5f, .seed = 9, .logprobs = 3});
  const std::vector<double> p = Softmax(kLogits, 1.0);
  for (int i = 0; i < 20; ++i) {
    const SampledToken t = s.Sample(kLogits);
    EXPECT_NEAR(t.logprob, std::log(p[t.token]), 1e-5);
    ASSERT_EQ(t.top_logprobs.size(), 3u);
    EXPECT_EQ(t.top_logprobs[0].token, 1);
    EXPECT_EQ(t.top_logprobs[1].token, 4);
    EXPECT_EQ(t.top_logprobs[2].token, 6);
    for (const TokenLogprob& lp : t.top_logprobs) EXPECT_NEAR(lp.logprob, std::log(p[lp.token]), 1e-5);
  }
}

TEST(SamplerTest, NonFiniteLogitsNeverWinOrCrash) {
  const float nan = std::nanf(""), inf = INFINITY;
  const std::vector<float> logits = {nan, 1.0f, inf, -inf, 2.0f, nan};
  Sampler greedy(SamplingParams{.temperature = 0.0f});
  EXPECT_EQ(greedy.Sample(logits).token, 4);
  Sampler s(SamplingParams{.temperature = 1.0f, .top_k = 4, .top_p = 0.9f, .seed = 1, .logprobs = 2});
  for (int i = 0; i < 1000; ++i) {
    const int32_t t = s.Sample(logits).token;
    EXPECT_TRUE(t == 1 || t == 4) << t;
  }
  const std::vector<float> all_nan(5, nan);
  const int32_t t = s.Sample(all_nan).token;
  EXPECT_GE(t, 0);
  EXPECT_LT(t, 5);
}

TEST(SamplerTest, ValidationNamesTheBadField) {
  struct Case {
    SamplingParams p;
    const char* field;
  };
  std::vector<Case> cases = {
      {{.temperature = -0.1f}, "temperature"},
      {{.temperature = NAN}, "temperature"},
      {{.top_k = -1}, "top_k"},
      {{.top_p = 0.0f}, "top_p"},
      {{.top_p = 1.5f}, "top_p"},
      {{.min_p = -0.1f}, "min_p"},
      {{.min_p = 2.0f}, "min_p"},
      {{.max_tokens = 0}, "max_tokens"},
      {{.logprobs = 21}, "logprobs"},
      {{.stop_token_ids = {5, 100}}, "stop token id 100"},
  };
  for (const Case& c : cases) {
    const absl::Status s = ValidateSamplingParams(c.p, 100);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_NE(s.message().find(c.field), std::string::npos) << s;
  }
  EXPECT_TRUE(ValidateSamplingParams(SamplingParams{}, 100).ok());
}

}  // namespace
}  // namespace pdserve
