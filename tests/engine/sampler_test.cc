// The sampler: greedy, seeded reproducibility, the distribution it draws
// from, the filters and their order, logprobs against an independent double
// computation, non-finite logits, the no-allocation contract, validation.
#include "engine/sampler.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <new>
#include <numeric>
#include <random>
#include <set>

#include "gtest/gtest.h"

// Counts heap allocations so a test can check that Sample() makes none once
// warm. Only the counter is added; the memory comes from malloc as usual.
// Every scalar form is replaced so that what one allocates the other frees
// (the array and aligned forms keep their defaults, which pair up among
// themselves). noipa: when GCC sees through these it reports the malloc/free
// inside as mismatched with new/delete.
namespace {
std::atomic<int64_t> g_allocations{0};
}  // namespace

__attribute__((noipa)) void* operator new(std::size_t size, const std::nothrow_t&) noexcept {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  return std::malloc(size == 0 ? 1 : size);
}
__attribute__((noipa)) void* operator new(std::size_t size) {
  if (void* p = operator new(size, std::nothrow)) return p;
  throw std::bad_alloc();
}
__attribute__((noipa)) void operator delete(void* p) noexcept { std::free(p); }
__attribute__((noipa)) void operator delete(void* p, std::size_t) noexcept { std::free(p); }
__attribute__((noipa)) void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }

namespace pdserve {
namespace {

// softmax(logits / temperature), in double.
std::vector<double> Softmax(const std::vector<float>& logits, double temperature) {
  double mx = -1e300;
  for (float l : logits) mx = std::max(mx, l / temperature);
  std::vector<double> p(logits.size());
  double sum = 0;
  for (size_t i = 0; i < logits.size(); ++i) sum += (p[i] = std::exp(logits[i] / temperature - mx));
  for (double& x : p) x /= sum;
  return p;
}

// `p` restricted to the ids in `keep` and renormalized; zero elsewhere.
std::vector<double> Restrict(const std::vector<double>& p, const std::set<int32_t>& keep) {
  std::vector<double> out(p.size(), 0.0);
  double mass = 0;
  for (int32_t id : keep) mass += p[id];
  for (int32_t id : keep) out[id] = p[id] / mass;
  return out;
}

// Draws `n` samples and checks every token's frequency against `want`:
// exactly zero where `want` is zero, else within 5 standard deviations (plus
// a floor of 3), which a correct sampler fails with probability < 1e-6 per
// token while a wrong distribution at these sample sizes fails for sure.
void ExpectDistribution(Sampler& s, const std::vector<float>& logits, const std::vector<double>& want,
                        int n, std::span<const int32_t> prompt = {},
                        std::span<const int32_t> generated = {}) {
  std::vector<int> counts(logits.size(), 0);
  for (int i = 0; i < n; ++i) {
    const int32_t t = s.Sample(logits, prompt, generated).token;
    ASSERT_GE(t, 0);
    ASSERT_LT(t, static_cast<int32_t>(logits.size()));
    ++counts[t];
  }
  for (size_t t = 0; t < logits.size(); ++t) {
    const double p = want[t];
    if (p == 0.0) {
      EXPECT_EQ(counts[t], 0) << "token " << t << " should have been filtered out";
      continue;
    }
    const double sigma = std::sqrt(n * p * (1 - p));
    EXPECT_NEAR(counts[t], n * p, 5 * sigma + 3) << "token " << t;
  }
}

// Distinct logits in a shuffled order, `n` of them, spaced `step` apart.
std::vector<float> ShuffledRamp(int n, float step, uint64_t seed) {
  std::vector<float> logits(n);
  for (int i = 0; i < n; ++i) logits[i] = -step * i;
  std::mt19937_64 rng(seed);
  std::shuffle(logits.begin(), logits.end(), rng);
  return logits;
}

// Ids ordered by decreasing logit.
std::vector<int32_t> RankedIds(const std::vector<float>& logits) {
  std::vector<int32_t> ids(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  std::stable_sort(ids.begin(), ids.end(), [&](int32_t a, int32_t b) { return logits[a] > logits[b]; });
  return ids;
}

const std::vector<float> kLogits = {1.0f, 2.5f, -0.5f, 0.0f, 2.0f, -3.0f, 1.5f, 0.7f};

// Probabilities 0.15, 0.5, 0.05, 0.3 (the logits are their logs).
const std::vector<float> kFour = {std::log(0.15f), std::log(0.5f), std::log(0.05f), std::log(0.3f)};

TEST(SamplerTest, GreedyIsArgmaxWithLowestIdOnTies) {
  Sampler s(SamplingParams{.temperature = 0.0f});
  EXPECT_EQ(s.Sample(kLogits).token, 1);
  EXPECT_EQ(s.Sample(std::vector<float>{0.0f, 3.0f, 1.0f, 3.0f}).token, 1);
  EXPECT_EQ(s.Sample(std::vector<float>{-5.0f, -5.0f}).token, 0);
  EXPECT_EQ(s.Sample(std::vector<float>{7.0f}).token, 0);
}

TEST(SamplerTest, TinyTemperaturesActGreedyWithoutNaN) {
  for (float t : {1e-6f, 1e-30f, 1e-45f}) {
    Sampler s(SamplingParams{.temperature = t, .seed = 1});
    for (int i = 0; i < 100; ++i) EXPECT_EQ(s.Sample(kLogits).token, 1) << "T=" << t;
  }
}

TEST(SamplerTest, SameSeedSameTokensDifferentSeedDifferentTokens) {
  auto run = [](std::optional<uint64_t> seed, SamplingParams p) {
    p.seed = seed;
    Sampler s(p);
    std::vector<int32_t> out;
    for (int i = 0; i < 64; ++i) out.push_back(s.Sample(kLogits).token);
    return out;
  };
  for (const SamplingParams& p :
       {SamplingParams{.temperature = 1.0f}, SamplingParams{.temperature = 1.3f, .top_k = 5, .top_p = 0.95f}}) {
    EXPECT_EQ(run(7, p), run(7, p));
    EXPECT_NE(run(7, p), run(8, p));
    // Unseeded requests draw their own seeds.
    EXPECT_NE(run(std::nullopt, p), run(std::nullopt, p));
  }
}

// A decode worker continues a request whose first token a prefill worker
// sampled: a sampler started at step n draws what a fresh one draws at n.
TEST(SamplerTest, StartingAtAStepContinuesTheSameStream) {
  const SamplingParams p{.temperature = 1.2f, .top_p = 0.9f, .seed = 11};
  Sampler fresh(p);
  fresh.Sample(kLogits);
  fresh.Sample(kLogits);
  Sampler resumed(p, /*first_step=*/2);
  for (int i = 0; i < 64; ++i) EXPECT_EQ(fresh.Sample(kLogits).token, resumed.Sample(kLogits).token);
}

TEST(SamplerTest, TemperatureSamplingFollowsTheSoftmax) {
  for (float t : {0.7f, 1.0f, 1.5f}) {
    SCOPED_TRACE(t);
    Sampler s(SamplingParams{.temperature = t, .seed = 42});
    ExpectDistribution(s, kLogits, Softmax(kLogits, t), 200000);
  }
}

TEST(SamplerTest, TopKKeepsTheKBestRenormalized) {
  for (float t : {1.0f, 0.6f}) {
    SCOPED_TRACE(t);
    Sampler s(SamplingParams{.temperature = t, .top_k = 3, .seed = 1});
    // The three best: ids 1 (2.5), 4 (2.0), 6 (1.5).
    ExpectDistribution(s, kLogits, Restrict(Softmax(kLogits, t), {1, 4, 6}), 100000);
  }
  // k >= vocab size is no filter.
  Sampler all(SamplingParams{.temperature = 1.0f, .top_k = 100, .seed = 2});
  ExpectDistribution(all, kLogits, Softmax(kLogits, 1.0), 100000);
}

TEST(SamplerTest, TopKNeverLeavesTheKBestOfALargeVocabulary) {
  const std::vector<float> logits = ShuffledRamp(20000, 1e-4f, 11);
  const std::vector<int32_t> ranked = RankedIds(logits);
  const std::set<int32_t> best(ranked.begin(), ranked.begin() + 40);
  Sampler s(SamplingParams{.temperature = 1.0f, .top_k = 40, .seed = 4});
  for (int i = 0; i < 1000; ++i) {
    const int32_t t = s.Sample(logits).token;
    ASSERT_TRUE(best.count(t)) << "token " << t << " is not among the 40 best";
  }
}

TEST(SamplerTest, TopPKeepsTheSmallestSetReachingP) {
  // 0.5 < 0.75 <= 0.5 + 0.3: tokens 1 and 3 survive, renormalized.
  Sampler s(SamplingParams{.temperature = 1.0f, .top_p = 0.75f, .seed = 3});
  ExpectDistribution(s, kFour, {0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8}, 50000);
  // 0.8 < 0.9 <= 0.95: three tokens.
  Sampler three(SamplingParams{.temperature = 1.0f, .top_p = 0.9f, .seed = 3});
  ExpectDistribution(three, kFour, {0.15 / 0.95, 0.5 / 0.95, 0.0, 0.3 / 0.95}, 50000);
  Sampler tiny(SamplingParams{.temperature = 1.0f, .top_p = 0.01f, .seed = 3});
  for (int i = 0; i < 100; ++i) EXPECT_EQ(tiny.Sample(kFour).token, 1);  // Always at least one.
}

TEST(SamplerTest, TopPOnALargeVocabularyKeepsExactlyTheNucleus) {
  // A nucleus of several hundred tokens: more than any first guess at its
  // size, so the sampler has to widen its search.
  const std::vector<float> logits = ShuffledRamp(1000, 0.008f, 12);
  const std::vector<double> p = Softmax(logits, 1.0);
  const std::vector<int32_t> ranked = RankedIds(logits);
  for (int size : {1, 300, 600}) {
    SCOPED_TRACE(size);
    // Halfway between the mass of the best size-1 and the best size tokens,
    // far from either in float terms, so the smallest set reaching it is
    // exactly the best `size`.
    double below = 0;
    for (int i = 0; i < size - 1; ++i) below += p[ranked[i]];
    const float top_p = static_cast<float>(below + p[ranked[size - 1]] / 2);
    Sampler s(SamplingParams{.temperature = 1.0f, .top_p = top_p, .seed = 5});
    const std::set<int32_t> nucleus(ranked.begin(), ranked.begin() + size);
    ExpectDistribution(s, logits, Restrict(p, nucleus), 20000);
  }
}

TEST(SamplerTest, FiltersApplyAfterTemperatureAndInOrder) {
  // At T=2 the probabilities are proportional to sqrt(0.15, 0.5, 0.05, 0.3):
  // 0.208, 0.379, 0.120, 0.294 (rounded). top_p 0.75 then needs three tokens
  // (0.379 + 0.294 = 0.673), where at T=1 it needs two.
  const std::vector<double> p2 = Softmax(kFour, 2.0);
  Sampler hot(SamplingParams{.temperature = 2.0f, .top_p = 0.75f, .seed = 6});
  ExpectDistribution(hot, kFour, Restrict(p2, {0, 1, 3}), 50000);
  // min_p relative to the best at T=2: ratios 0.548, 1, 0.316, 0.775.
  // min_p 0.4 keeps three tokens; at T=1 (ratios 0.3, 1, 0.1, 0.6) only two.
  Sampler hot_min(SamplingParams{.temperature = 2.0f, .min_p = 0.4f, .seed = 7});
  ExpectDistribution(hot_min, kFour, Restrict(p2, {0, 1, 3}), 50000);
  Sampler cold_min(SamplingParams{.temperature = 1.0f, .min_p = 0.4f, .seed = 7});
  ExpectDistribution(cold_min, kFour, {0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8}, 50000);
  // top-p measures mass after top-k renormalized: among the best two
  // (0.5 / 0.8 = 0.625), top_p 0.6 keeps one token; without top-k it would
  // keep two (0.5 < 0.6).
  Sampler kp(SamplingParams{.temperature = 1.0f, .top_k = 2, .top_p = 0.6f, .seed = 8});
  for (int i = 0; i < 1000; ++i) EXPECT_EQ(kp.Sample(kFour).token, 1);
  // min-p after top-k: top_k 3 then min_p 0.5 keeps 0.5 and 0.3.
  Sampler km(SamplingParams{.temperature = 1.0f, .top_k = 3, .min_p = 0.5f, .seed = 9});
  ExpectDistribution(km, kFour, {0.0, 0.5 / 0.8, 0.0, 0.3 / 0.8}, 50000);
}

TEST(SamplerTest, MinPDropsTokensBelowAFractionOfTheBest) {
  // min_p 0.25: threshold 0.125 keeps 0.5, 0.3, 0.15.
  Sampler s(SamplingParams{.temperature = 1.0f, .min_p = 0.25f, .seed = 5});
  ExpectDistribution(s, kFour, {0.15 / 0.95, 0.5 / 0.95, 0.0, 0.3 / 0.95}, 50000);
  // min_p 1 keeps only the best.
  Sampler one(SamplingParams{.temperature = 1.0f, .min_p = 1.0f, .seed = 5});
  for (int i = 0; i < 100; ++i) EXPECT_EQ(one.Sample(kFour).token, 1);
}

TEST(SamplerTest, LogprobsAreLogSoftmaxOfTheRawLogits) {
  // Sampling temperature and filters do not change what is reported.
  for (const SamplingParams& params :
       {SamplingParams{.temperature = 0.5f, .seed = 9, .logprobs = 3},
        SamplingParams{.temperature = 0.0f, .logprobs = 3},
        SamplingParams{.temperature = 1.0f, .seed = 9, .logprobs = 3},
        SamplingParams{.temperature = 1.2f, .top_k = 2, .top_p = 0.9f, .min_p = 0.1f, .seed = 9, .logprobs = 3}}) {
    Sampler s(params);
    for (float offset : {0.0f, 1000.0f, -1000.0f}) {
      std::vector<float> logits = kLogits;
      for (float& l : logits) l += offset;
      const std::vector<double> p = Softmax(logits, 1.0);
      for (int i = 0; i < 20; ++i) {
        const SampledToken t = s.Sample(logits);
        EXPECT_NEAR(t.logprob, std::log(p[t.token]), 1e-4) << "offset " << offset;
        ASSERT_EQ(t.top_logprobs.size(), 3u);
        EXPECT_EQ(t.top_logprobs[0].token, 1);
        EXPECT_EQ(t.top_logprobs[1].token, 4);
        EXPECT_EQ(t.top_logprobs[2].token, 6);
        for (const TokenLogprob& lp : t.top_logprobs) {
          EXPECT_NEAR(lp.logprob, std::log(p[lp.token]), 1e-4) << "offset " << offset;
        }
      }
    }
  }
}

TEST(SamplerTest, TopLogprobsOnALargeVocabularyAreTheBestInOrder) {
  const std::vector<float> logits = ShuffledRamp(30000, 1e-3f, 13);
  const std::vector<double> p = Softmax(logits, 1.0);
  const std::vector<int32_t> ranked = RankedIds(logits);
  Sampler s(SamplingParams{.temperature = 1.0f, .seed = 3, .logprobs = 20});
  const SampledToken t = s.Sample(logits);
  EXPECT_NEAR(t.logprob, std::log(p[t.token]), 1e-4);
  ASSERT_EQ(t.top_logprobs.size(), 20u);
  for (int i = 0; i < 20; ++i) {
    EXPECT_EQ(t.top_logprobs[i].token, ranked[i]) << i;
    EXPECT_NEAR(t.top_logprobs[i].logprob, std::log(p[ranked[i]]), 1e-4) << i;
  }
  // More alternatives asked for than the vocabulary has: all of them.
  Sampler few(SamplingParams{.temperature = 1.0f, .seed = 3, .logprobs = 20});
  EXPECT_EQ(few.Sample(kFour).top_logprobs.size(), 4u);
  Sampler none(SamplingParams{.temperature = 1.0f, .seed = 3});
  EXPECT_TRUE(none.Sample(kFour).top_logprobs.empty());
}

TEST(SamplerTest, NonFiniteLogitsNeverWinOrCrash) {
  const float nan = std::nanf(""), inf = INFINITY;
  const std::vector<float> logits = {nan, 1.0f, inf, -inf, 2.0f, nan};
  Sampler greedy(SamplingParams{.temperature = 0.0f});
  EXPECT_EQ(greedy.Sample(logits).token, 4);
  for (const SamplingParams& params :
       {SamplingParams{.temperature = 1.0f, .top_k = 4, .top_p = 0.9f, .seed = 1, .logprobs = 2},
        SamplingParams{.temperature = 0.3f, .seed = 1}, SamplingParams{.temperature = 3.0f, .min_p = 0.1f, .seed = 1}}) {
    Sampler s(params);
    for (int i = 0; i < 1000; ++i) {
      const SampledToken t = s.Sample(logits);
      ASSERT_TRUE(t.token == 1 || t.token == 4) << t.token;
      EXPECT_FALSE(std::isnan(t.logprob));
    }
  }
  // Nothing usable at all: still an id in range, for every path.
  for (const std::vector<float>& junk :
       {std::vector<float>(5, nan), std::vector<float>(5, inf), std::vector<float>(5, -inf),
        std::vector<float>{nan, inf, -inf, nan, inf}}) {
    for (const SamplingParams& params :
         {SamplingParams{.temperature = 0.0f, .logprobs = 3}, SamplingParams{.temperature = 0.5f, .seed = 2},
          SamplingParams{.temperature = 1.0f, .top_k = 2, .top_p = 0.5f, .min_p = 0.5f, .seed = 2, .logprobs = 5}}) {
      Sampler s(params);
      for (int i = 0; i < 50; ++i) {
        const SampledToken t = s.Sample(junk);
        ASSERT_GE(t.token, 0);
        ASSERT_LT(t.token, 5);
      }
    }
  }
}

TEST(SamplerTest, SampleDoesNotAllocateOnceWarm) {
  const std::vector<float> logits = ShuffledRamp(32000, 1e-3f, 14);
  for (const SamplingParams& params :
       {SamplingParams{.temperature = 0.0f}, SamplingParams{.temperature = 0.8f, .seed = 1},
        SamplingParams{.temperature = 0.8f, .top_k = 50, .top_p = 0.9f, .min_p = 0.05f, .seed = 1},
        SamplingParams{.temperature = 1.0f, .top_p = 0.95f, .seed = 1}}) {
    Sampler s(params);
    s.Sample(logits);
    const int64_t before = g_allocations.load();
    for (int i = 0; i < 20; ++i) s.Sample(logits);
    EXPECT_EQ(g_allocations.load() - before, 0) << "temperature " << params.temperature;
  }
  // With logprobs, only the returned vector itself is allocated.
  Sampler s(SamplingParams{.temperature = 0.8f, .seed = 1, .logprobs = 5});
  s.Sample(logits);
  const int64_t before = g_allocations.load();
  for (int i = 0; i < 20; ++i) s.Sample(logits);
  EXPECT_EQ(g_allocations.load() - before, 20);
}

TEST(SamplerTest, ValidationNamesTheBadFieldAndValue) {
  struct Case {
    SamplingParams p;
    const char* field;  // Both must appear in the message.
    const char* value;
  };
  const std::vector<Case> cases = {
      {{.temperature = -0.1f}, "temperature", "-0.1"},
      {{.temperature = NAN}, "temperature", "nan"},
      {{.temperature = INFINITY}, "temperature", "inf"},
      {{.top_k = -1}, "top_k", "-1"},
      {{.top_p = 0.0f}, "top_p", "got 0"},
      {{.top_p = 1.5f}, "top_p", "1.5"},
      {{.top_p = NAN}, "top_p", "nan"},
      {{.min_p = -0.1f}, "min_p", "-0.1"},
      {{.min_p = 2.0f}, "min_p", "2"},
      {{.min_p = NAN}, "min_p", "nan"},
      {{.max_tokens = 0}, "max_tokens", "0"},
      {{.max_tokens = -5}, "max_tokens", "-5"},
      {{.logprobs = 21}, "logprobs", "21"},
      {{.logprobs = -1}, "logprobs", "-1"},
      {{.stop_token_ids = {5, 100}}, "stop_token_ids", "100"},
      {{.stop_token_ids = {-3}}, "stop_token_ids", "-3"},
      {{.presence_penalty = 2.5f}, "presence_penalty", "2.5"},
      {{.presence_penalty = NAN}, "presence_penalty", "nan"},
      {{.frequency_penalty = -2.01f}, "frequency_penalty", "-2.01"},
      {{.repetition_penalty = 0.0f}, "repetition_penalty", "got 0"},
      {{.repetition_penalty = 10.5f}, "repetition_penalty", "10.5"},
      {{.repetition_penalty = NAN}, "repetition_penalty", "nan"},
      {{.logit_bias = {{100, 1.0f}}}, "logit_bias", "100"},
      {{.logit_bias = {{-1, 1.0f}}}, "logit_bias", "-1"},
      {{.logit_bias = {{3, 101.0f}}}, "logit_bias", "101"},
      {{.logit_bias = {{3, NAN}}}, "logit_bias", "nan"},
      {{.logit_bias = std::vector<std::pair<int32_t, float>>(301, {1, 0.0f})}, "logit_bias",
       "301"},
      {{.prompt_logprobs = 21}, "prompt_logprobs", "21"},
      {{.prompt_logprobs = -1}, "prompt_logprobs", "-1"},
  };
  for (const Case& c : cases) {
    const absl::Status s = ValidateSamplingParams(c.p, 100);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << c.field;
    EXPECT_NE(s.message().find(c.field), std::string::npos) << s;
    EXPECT_NE(s.message().find(c.value), std::string::npos) << s;
  }
  // Every boundary that is allowed.
  for (const SamplingParams& ok :
       {SamplingParams{}, SamplingParams{.temperature = 0.0f}, SamplingParams{.top_k = 0},
        SamplingParams{.top_k = 1000000}, SamplingParams{.top_p = 1.0f}, SamplingParams{.top_p = 1e-6f},
        SamplingParams{.min_p = 0.0f}, SamplingParams{.min_p = 1.0f}, SamplingParams{.max_tokens = 1},
        SamplingParams{.stop_token_ids = {0, 99}}, SamplingParams{.logprobs = 20},
        SamplingParams{.presence_penalty = -2.0f, .frequency_penalty = 2.0f},
        SamplingParams{.repetition_penalty = 10.0f}, SamplingParams{.repetition_penalty = 1e-3f},
        SamplingParams{.logit_bias = {{0, -100.0f}, {99, 100.0f}}},
        SamplingParams{.logit_bias = std::vector<std::pair<int32_t, float>>(300, {1, 0.0f})},
        SamplingParams{.prompt_logprobs = 0}, SamplingParams{.prompt_logprobs = 20}}) {
    EXPECT_TRUE(ValidateSamplingParams(ok, 100).ok()) << ValidateSamplingParams(ok, 100);
  }
}

// The logit processing, checked against logits processed by hand from the
// definitions. History: prompt {1, 2}, generated {4, 4, 5}; logit_bias
// {1: -1, 5: +4}; repetition 2, frequency 0.5, presence 0.25. By the
// definitions, in the documented order (bias, repetition, then
// frequency/presence):
//   id 1:  2.5 - 1 = 1.5, in the prompt: / 2            =  0.75
//   id 2: -0.5, in the prompt: * 2                      = -1.0
//   id 4:  2.0, generated: / 2 = 1, - 2 * 0.5 - 0.25    = -0.25
//   id 5: -3 + 4 = 1, generated: / 2, - 1 * 0.5 - 0.25  = -0.25
// and the others unchanged. Another order gives other values (id 5 with the
// penalty before the bias: -3 * 2 + 4 = -2; id 4 with frequency first: 0.375).
const std::vector<int32_t> kPrompt = {1, 2};
const std::vector<int32_t> kGenerated = {4, 4, 5};
const std::vector<float> kProcessed = {1.0f, 0.75f, -1.0f, 0.0f, -0.25f, -0.25f, 1.5f, 0.7f};
SamplingParams AllProcessors(float temperature) {
  return {.temperature = temperature,
          .seed = 21,
          .logprobs = 3,
          .presence_penalty = 0.25f,
          .frequency_penalty = 0.5f,
          .repetition_penalty = 2.0f,
          .logit_bias = {{1, -1.0f}, {5, 4.0f}}};
}

TEST(SamplerTest, LogitProcessingFollowsTheDefinitionsInOrder) {
  Sampler greedy(AllProcessors(0.0f));
  // Raw argmax is 1 (2.5); processed it is 6 (1.5).
  EXPECT_EQ(greedy.Sample(kLogits, kPrompt, kGenerated).token, 6);
  for (float t : {1.0f, 0.8f}) {
    SCOPED_TRACE(t);
    Sampler s(AllProcessors(t));
    ExpectDistribution(s, kLogits, Softmax(kProcessed, t), 100000, kPrompt, kGenerated);
  }
}

TEST(SamplerTest, LogitBiasShiftsTheRawLogits) {
  const SamplingParams p{.temperature = 1.0f, .seed = 5, .logit_bias = {{2, 3.0f}, {1, -100.0f}}};
  std::vector<float> biased = kLogits;
  biased[2] += 3.0f;
  biased[1] -= 100.0f;
  Sampler s(p);
  ExpectDistribution(s, kLogits, Softmax(biased, 1.0), 100000);
  // -100 bans a token in practice; +100 forces one.
  Sampler forced(SamplingParams{.temperature = 1.0f, .seed = 5, .logit_bias = {{5, 100.0f}}});
  for (int i = 0; i < 100; ++i) EXPECT_EQ(forced.Sample(kLogits).token, 5);
}

TEST(SamplerTest, RepetitionPenaltyCountsPromptAndOutputOnce) {
  // Tokens 1 (2.5) and 3 (0.0) seen, 1 twice: 2.5 / 4 = 0.625 once, 0 stays 0.
  // A penalty below 1 favours repeats: -0.5 * 0.5 = -0.25.
  const std::vector<int32_t> prompt = {1, 3, 1};
  const std::vector<int32_t> generated = {1};
  std::vector<float> want = kLogits;
  want[1] = 0.625f;
  Sampler s(SamplingParams{.temperature = 1.0f, .seed = 8, .repetition_penalty = 4.0f});
  ExpectDistribution(s, kLogits, Softmax(want, 1.0), 100000, prompt, generated);
  std::vector<float> favoured = kLogits;
  favoured[2] = -0.25f;
  Sampler f(SamplingParams{.temperature = 1.0f, .seed = 8, .repetition_penalty = 0.5f});
  ExpectDistribution(f, kLogits, Softmax(favoured, 1.0), 100000, std::vector<int32_t>{2}, {});
}

TEST(SamplerTest, FrequencyAndPresencePenaltiesCountOnlyGeneratedTokens) {
  // Token 1 is in the prompt only: untouched. Token 4 generated 3 times:
  // 2.0 - 3 * 0.4 - 0.5 = 0.3. Token 0 once: 1.0 - 0.4 - 0.5 = 0.1.
  const std::vector<int32_t> prompt = {1, 1, 1};
  const std::vector<int32_t> generated = {4, 0, 4, 4};
  std::vector<float> want = kLogits;
  want[4] = 0.3f;
  want[0] = 0.1f;
  const SamplingParams p{.temperature = 1.0f, .seed = 9, .presence_penalty = 0.5f,
                         .frequency_penalty = 0.4f};
  Sampler s(p);
  ExpectDistribution(s, kLogits, Softmax(want, 1.0), 100000, prompt, generated);
  // Greedy: token 1 (2.5) stays the best; with token 1 generated instead it
  // drops to 2.5 - 0.4 - 0.5 = 1.6 and token 4 (2.0) wins.
  Sampler g(SamplingParams{.temperature = 0.0f, .presence_penalty = 0.5f, .frequency_penalty = 0.4f});
  EXPECT_EQ(g.Sample(kLogits, prompt, {}).token, 1);
  EXPECT_EQ(g.Sample(kLogits, {}, std::vector<int32_t>{1}).token, 4);
}

TEST(SamplerTest, LogprobsStayThoseOfTheRawLogitsUnderProcessing) {
  Sampler s(AllProcessors(0.0f));
  const SampledToken t = s.Sample(kLogits, kPrompt, kGenerated);
  double z = 0;
  for (float l : kLogits) z += std::exp(static_cast<double>(l));
  EXPECT_NEAR(t.logprob, kLogits[6] - std::log(z), 1e-5);
  ASSERT_EQ(t.top_logprobs.size(), 3u);
  // Raw ranking: 1 (2.5), 4 (2.0), 6 (1.5).
  EXPECT_EQ(t.top_logprobs[0].token, 1);
  EXPECT_EQ(t.top_logprobs[1].token, 4);
  EXPECT_EQ(t.top_logprobs[2].token, 6);
  EXPECT_NEAR(t.top_logprobs[0].logprob, 2.5 - std::log(z), 1e-5);
}

// What a decode worker relies on: the penalties are a function of the
// history passed in, so a sampler that starts at step 1 with the first token
// (sampled on a prefill worker) as history continues exactly as one sampler.
TEST(SamplerTest, PenalizedStreamContinuesAcrossSamplers) {
  const std::vector<float> logits = ShuffledRamp(64, 0.05f, 3);
  SamplingParams p = AllProcessors(0.9f);
  p.logit_bias = {{7, 1.0f}};
  const std::vector<int32_t> prompt = {3, 9, 27, 3};
  std::vector<int32_t> one;
  Sampler single(p);
  for (int i = 0; i < 40; ++i) one.push_back(single.Sample(logits, prompt, one).token);
  std::vector<int32_t> two;
  Sampler first(p);
  two.push_back(first.Sample(logits, prompt, two).token);
  Sampler rest(p, /*first_step=*/1);
  for (int i = 1; i < 40; ++i) two.push_back(rest.Sample(logits, prompt, two).token);
  EXPECT_EQ(one, two);
  // And the penalties do bite: without them the stream differs.
  std::vector<int32_t> plain;
  Sampler unpenalized(SamplingParams{.temperature = 0.9f, .seed = 21});
  for (int i = 0; i < 40; ++i) plain.push_back(unpenalized.Sample(logits, prompt, plain).token);
  EXPECT_NE(one, plain);
}

TEST(SamplerTest, PenalizedSampleDoesNotAllocateOnceWarm) {
  const std::vector<float> logits = ShuffledRamp(32000, 1e-3f, 15);
  std::vector<int32_t> prompt(300), generated(200);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>(i * 7 % 32000);
  for (size_t i = 0; i < generated.size(); ++i) generated[i] = static_cast<int32_t>(i * 13 % 500);
  SamplingParams p = AllProcessors(0.8f);
  p.logprobs = 0;
  Sampler s(p);
  s.Sample(logits, prompt, generated);
  const int64_t before = g_allocations.load();
  for (int i = 0; i < 20; ++i) s.Sample(logits, prompt, generated);
  EXPECT_EQ(g_allocations.load() - before, 0);
}

TEST(SamplerTest, ChoiceSeedKeepsChoiceZeroAndSeparatesTheOthers) {
  EXPECT_EQ(ChoiceSeed(1234, 0), 1234u);
  std::set<uint64_t> seeds;
  for (uint32_t i = 0; i < 16; ++i) seeds.insert(ChoiceSeed(1234, i));
  for (uint32_t i = 1; i < 16; ++i) seeds.insert(ChoiceSeed(1235, i));
  EXPECT_EQ(seeds.size(), 31u);
  EXPECT_EQ(ChoiceSeed(99, 3), ChoiceSeed(99, 3));
}

TEST(SamplerTest, FillLogprobsIsTheLogSoftmaxWithTheBestAlternatives) {
  std::vector<std::pair<float, int32_t>> scratch;
  SampledToken out;
  FillLogprobs(kLogits, 2, 2, scratch, out);
  double z = 0;
  for (float l : kLogits) z += std::exp(static_cast<double>(l));
  EXPECT_EQ(out.token, 2);
  EXPECT_NEAR(out.logprob, -0.5 - std::log(z), 1e-5);
  ASSERT_EQ(out.top_logprobs.size(), 2u);
  EXPECT_EQ(out.top_logprobs[0].token, 1);
  EXPECT_EQ(out.top_logprobs[1].token, 4);
  EXPECT_NEAR(out.top_logprobs[1].logprob, 2.0 - std::log(z), 1e-5);
}

}  // namespace
}  // namespace pdserve
