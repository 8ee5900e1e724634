// planner/workload.h: length distributions, synthetic workloads, prompts,
// arrivals and the real traces in ../shared/traces (skipped without them).
// Statistical checks use a fixed seed and tolerances of at least five
// standard errors; the golden values and trace figures were computed
// independently in Python (tests/planner/golden_values.py).
#include "planner/workload.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace pdserve::planner {
namespace {

using ::testing::HasSubstr;

constexpr double kInf = std::numeric_limits<double>::infinity();

LengthDistribution Dist(std::string_view spec) {
  absl::StatusOr<LengthDistribution> d = LengthDistribution::Parse(spec);
  EXPECT_TRUE(d.ok()) << d.status();
  return d.ok() ? *d : LengthDistribution();
}

struct Moments {
  double mean = 0, stddev = 0;
  int32_t min = 0, max = 0;
};

Moments SampleMoments(const LengthDistribution& d, int n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  double sum = 0, sum_sq = 0;
  Moments m{0, 0, std::numeric_limits<int32_t>::max(), 0};
  for (int i = 0; i < n; ++i) {
    const int32_t x = d.Sample(rng);
    sum += x;
    sum_sq += static_cast<double>(x) * x;
    m.min = std::min(m.min, x);
    m.max = std::max(m.max, x);
  }
  m.mean = sum / n;
  m.stddev = std::sqrt(sum_sq / n - m.mean * m.mean);
  return m;
}

TEST(LengthDistributionTest, ParsesEveryForm) {
  const LengthDistribution fixed = Dist("512");
  EXPECT_EQ(fixed.spec(), "512");
  EXPECT_EQ(fixed.Mean(), 512);

  const LengthDistribution uniform = Dist(" uniform:128:1024 ");
  EXPECT_EQ(uniform.spec(), "uniform:128:1024");
  EXPECT_EQ(uniform.Mean(), 576);  // (128 + 1024) / 2

  const LengthDistribution normal = Dist("normal:512:64");
  EXPECT_EQ(normal.spec(), "normal:512:64");
  EXPECT_EQ(normal.Mean(), 512);

  const LengthDistribution hist = Dist("hist:128=0.5,512=0.3,2048=0.2");
  EXPECT_EQ(hist.spec(), "hist:128=0.5,512=0.3,2048=0.2");
  EXPECT_NEAR(hist.Mean(), 627.2, 1e-9);  // 64 + 153.6 + 409.6

  // Weights need not sum to 1: 5:3:2 is 0.5:0.3:0.2.
  EXPECT_NEAR(Dist("hist:128=5,512=3,2048=2").Mean(), 627.2, 1e-9);

  // The default is the fixed length 1.
  EXPECT_EQ(LengthDistribution().spec(), "1");
  EXPECT_EQ(LengthDistribution().Mean(), 1);
}

TEST(LengthDistributionTest, BadSpecsSayWhatIsWrong) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"", "is not an integer"},
      {"abc", "is not an integer"},
      {"512.5", "is not an integer"},
      {"0", "is not positive"},
      {"-5", "is not positive"},
      {"uniform:10", "uniform takes LO:HI"},
      {"uniform:1:2:3", "uniform takes LO:HI"},
      {"uniform:20:10", "LO is greater than HI"},
      {"uniform:0:10", "uniform LO 0 is not positive"},
      {"uniform:1:x", "uniform HI 'x' is not an integer"},
      {"normal:512", "normal takes MEAN:STDDEV"},
      {"normal:-1:5", "MEAN is not positive"},
      {"normal:512:-1", "STDDEV is negative"},
      {"normal:512:inf", "is not a finite number"},
      {"normal:2e9:1e9", "does not fit"},
      {"hist:", "hist takes V=W"},
      {"hist:128", "'128' is not V=W"},
      {"hist:128=0", "hist weight of 128 is not positive"},
      {"hist:128=x", "hist weight 'x' is not a finite number"},
      {"hist:0=1", "hist value 0 is not positive"},
      {"gauss:1:2", "unknown kind 'gauss'"},
  };
  for (const auto& [spec, why] : cases) {
    absl::StatusOr<LengthDistribution> d = LengthDistribution::Parse(spec);
    ASSERT_FALSE(d.ok()) << spec;
    EXPECT_EQ(d.status().code(), absl::StatusCode::kInvalidArgument) << spec;
    EXPECT_THAT(d.status().message(), HasSubstr("'" + spec + "'")) << spec;
    EXPECT_THAT(d.status().message(), HasSubstr(why)) << spec;
  }
}

TEST(LengthDistributionTest, FixedAlwaysGivesItsValue) {
  const Moments m = SampleMoments(Dist("512"), 1000, 1);
  EXPECT_EQ(m.min, 512);
  EXPECT_EQ(m.max, 512);
}

TEST(LengthDistributionTest, UniformMeanAndBounds) {
  // 101 equally likely values: mean 150, stddev sqrt((101^2 - 1) / 12)
  // = 29.15; the mean of 200,000 has a standard error of 0.065.
  const Moments m = SampleMoments(Dist("uniform:100:200"), 200000, 3);
  EXPECT_EQ(m.min, 100);
  EXPECT_EQ(m.max, 200);
  EXPECT_NEAR(m.mean, 150, 0.4);
  EXPECT_NEAR(m.stddev, 29.15, 0.3);
}

TEST(LengthDistributionTest, UniformIsTheSameOnEveryMachine) {
  // std::mt19937_64 seeded 42; draws below 2^64 mod 1000 rejected, then
  // 1 + x mod 1000 (golden_values.py).
  std::mt19937_64 rng(42);
  const LengthDistribution d = Dist("uniform:1:1000");
  std::vector<int32_t> samples;
  for (int i = 0; i < 8; ++i) samples.push_back(d.Sample(rng));
  EXPECT_EQ(samples,
            (std::vector<int32_t>{407, 825, 451, 663, 382, 429, 537, 145}));
}

TEST(LengthDistributionTest, NormalMeanAndStddev) {
  // Far from the clip bounds, so these are the parameters; standard error
  // of the mean 64 / sqrt(200,000) = 0.14.
  const Moments m = SampleMoments(Dist("normal:512:64"), 200000, 5);
  EXPECT_NEAR(m.mean, 512, 1.0);
  EXPECT_NEAR(m.stddev, 64, 1.0);
  EXPECT_GE(m.min, 1);
  EXPECT_LE(m.max, 512 + 6 * 64);
}

TEST(LengthDistributionTest, NormalIsClipped) {
  // Mean 10, stddev 5: clipped to [1, 40]; P(x < 1.5) = P(z < -1.7) = 4.5%,
  // so 1 is hit often.
  const LengthDistribution d = Dist("normal:10:5");
  std::mt19937_64 rng(9);
  int ones = 0;
  for (int i = 0; i < 100000; ++i) {
    const int32_t x = d.Sample(rng);
    ASSERT_GE(x, 1);
    ASSERT_LE(x, 40);
    ones += x == 1;
  }
  EXPECT_NEAR(ones / 100000.0, 0.045, 0.005);
  // No spread: always the (rounded) mean.
  EXPECT_EQ(SampleMoments(Dist("normal:7.4:0"), 100, 1).max, 7);
  EXPECT_EQ(SampleMoments(Dist("normal:7.4:0"), 100, 1).min, 7);
}

TEST(LengthDistributionTest, HistogramWeightsHonoured) {
  const LengthDistribution d = Dist("hist:128=5,512=3,2048=2");
  std::mt19937_64 rng(11);
  std::map<int32_t, int> counts;
  const int n = 200000;
  for (int i = 0; i < n; ++i) ++counts[d.Sample(rng)];
  ASSERT_EQ(counts.size(), 3u);
  // Standard error of a share near 0.5 over 200,000: 0.0011.
  EXPECT_NEAR(counts[128] / double(n), 0.5, 0.006);
  EXPECT_NEAR(counts[512] / double(n), 0.3, 0.006);
  EXPECT_NEAR(counts[2048] / double(n), 0.2, 0.006);
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

SyntheticOptions PrefixOptions(std::string_view input, int32_t prefix_tokens) {
  SyntheticOptions options;
  options.input = Dist(input);
  options.output = Dist("10");
  options.num_requests = 300;
  options.shared_prefix_tokens = prefix_tokens;
  options.num_prefixes = 3;
  options.block_tokens = 16;
  options.seed = 7;
  return options;
}

// Requests grouped by their first block id.
std::map<uint64_t, std::vector<const WorkloadRequest*>> ByFirstBlock(
    const Workload& w) {
  std::map<uint64_t, std::vector<const WorkloadRequest*>> groups;
  for (const WorkloadRequest& r : w.requests)
    groups[r.block_ids.at(0)].push_back(&r);
  return groups;
}

TEST(SyntheticWorkloadTest, SharedPrefixesShareLeadingBlocks) {
  // 100 tokens in 16-token blocks: 7 ids; the 64-token prefix is blocks
  // 0..3; blocks 4..6 are each request's own.
  absl::StatusOr<Workload> w = MakeSyntheticWorkload(PrefixOptions("100", 64));
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_EQ(w->block_tokens, 16);
  ASSERT_EQ(w->requests.size(), 300u);
  const auto groups = ByFirstBlock(*w);
  EXPECT_EQ(groups.size(), 3u);  // 300 draws from 3 prefixes hit each.
  std::set<uint64_t> suffix_ids, prefix_ids;
  for (const auto& [first, group] : groups) {
    for (const WorkloadRequest* r : group) {
      ASSERT_EQ(r->block_ids.size(), 7u);
      for (int b = 0; b < 4; ++b) {
        EXPECT_EQ(r->block_ids[b], group[0]->block_ids[b]);
        prefix_ids.insert(r->block_ids[b]);
      }
      for (int b = 4; b < 7; ++b) {
        EXPECT_TRUE(suffix_ids.insert(r->block_ids[b]).second)
            << "suffix id reused";
      }
    }
  }
  EXPECT_EQ(prefix_ids.size(), 12u);  // 3 prefixes x 4 blocks.
  for (uint64_t id : prefix_ids)
    EXPECT_EQ(suffix_ids.count(id), 0u) << "id spaces collide";
}

TEST(SyntheticWorkloadTest, PrefixEndingInsideABlockSharesWholeBlocksOnly) {
  // A 70-token prefix: block 4 (tokens 64..79) holds 6 prefix tokens and
  // 10 of the request's own, so it is not shared.
  absl::StatusOr<Workload> w = MakeSyntheticWorkload(PrefixOptions("100", 70));
  ASSERT_TRUE(w.ok()) << w.status();
  for (const auto& [first, group] : ByFirstBlock(*w)) {
    ASSERT_GE(group.size(), 2u);
    EXPECT_EQ(group[0]->block_ids[3], group[1]->block_ids[3]);
    EXPECT_NE(group[0]->block_ids[4], group[1]->block_ids[4]);
  }
}

TEST(SyntheticWorkloadTest, PromptShorterThanPrefixIsAllPrefix) {
  // 68 tokens: 5 blocks, the last one (tokens 64..67) partial and inside
  // the 70-token prefix although the whole block (64..79) would not be:
  // requests with the same prefix have the same ids.
  absl::StatusOr<Workload> w = MakeSyntheticWorkload(PrefixOptions("68", 70));
  ASSERT_TRUE(w.ok()) << w.status();
  const auto groups = ByFirstBlock(*w);
  EXPECT_EQ(groups.size(), 3u);
  for (const auto& [first, group] : groups) {
    for (const WorkloadRequest* r : group) {
      ASSERT_EQ(r->block_ids.size(), 5u);
      EXPECT_EQ(r->block_ids, group[0]->block_ids);
    }
  }
}

TEST(SyntheticWorkloadTest, BlockCountAndUniqueIdsWithoutPrefix) {
  SyntheticOptions options;
  options.input = Dist("uniform:1:300");
  options.output = Dist("normal:100:20");
  options.num_requests = 2000;
  options.block_tokens = 16;
  absl::StatusOr<Workload> w = MakeSyntheticWorkload(options);
  ASSERT_TRUE(w.ok()) << w.status();
  std::set<uint64_t> ids;
  size_t total = 0;
  for (const WorkloadRequest& r : w->requests) {
    EXPECT_EQ(static_cast<int64_t>(r.block_ids.size()),
              CeilDiv(r.input_tokens, 16));
    EXPECT_GE(r.output_tokens, 1);
    EXPECT_EQ(r.arrival_s, 0);
    ids.insert(r.block_ids.begin(), r.block_ids.end());
    total += r.block_ids.size();
  }
  EXPECT_EQ(ids.size(), total) << "a block id repeats with no shared prefix";
}

TEST(SyntheticWorkloadTest, PureFunctionOfOptionsAndSeed) {
  SyntheticOptions options = PrefixOptions("uniform:1:1000", 64);
  options.seed = 42;
  absl::StatusOr<Workload> a = MakeSyntheticWorkload(options);
  absl::StatusOr<Workload> b = MakeSyntheticWorkload(options);
  ASSERT_TRUE(a.ok() && b.ok());
  ASSERT_EQ(a->requests.size(), b->requests.size());
  for (size_t i = 0; i < a->requests.size(); ++i) {
    EXPECT_EQ(a->requests[i].input_tokens, b->requests[i].input_tokens);
    EXPECT_EQ(a->requests[i].block_ids, b->requests[i].block_ids);
  }
  // The input length is the first draw from the seeded generator: the
  // golden value of LengthDistributionTest.UniformIsTheSameOnEveryMachine.
  EXPECT_EQ(a->requests[0].input_tokens, 407);
  EXPECT_EQ(a->description,
            "synthetic: 300 requests, input uniform:1:1000, output 10, "
            "64-token prefix shared "
            "from 3, seed 42");
  options.seed = 43;
  absl::StatusOr<Workload> c = MakeSyntheticWorkload(options);
  ASSERT_TRUE(c.ok());
  EXPECT_NE(c->requests[0].input_tokens, 407);
}

TEST(SyntheticWorkloadTest, BadOptions) {
  SyntheticOptions options;
  options.num_requests = 0;
  EXPECT_EQ(MakeSyntheticWorkload(options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options = SyntheticOptions();
  options.block_tokens = 0;
  EXPECT_EQ(MakeSyntheticWorkload(options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options = SyntheticOptions();
  options.shared_prefix_tokens = 16;
  options.num_prefixes = 0;
  EXPECT_EQ(MakeSyntheticWorkload(options).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(PromptTokensTest, DeterministicAndEqualForEqualBlocks) {
  absl::StatusOr<Workload> w = MakeSyntheticWorkload(PrefixOptions("100", 64));
  ASSERT_TRUE(w.ok());
  const auto groups = ByFirstBlock(*w);
  const std::vector<const WorkloadRequest*>& group = groups.begin()->second;
  ASSERT_GE(group.size(), 2u);
  const std::vector<int32_t> a = PromptTokens(*w, *group[0]);
  const std::vector<int32_t> b = PromptTokens(*w, *group[1]);
  ASSERT_EQ(a.size(), 100u);
  ASSERT_EQ(b.size(), 100u);
  EXPECT_EQ(a, PromptTokens(*w, *group[0]));
  // The shared 64 tokens are equal; the rest (36 tokens of 26 letters)
  // differ.
  EXPECT_TRUE(std::equal(a.begin(), a.begin() + 64, b.begin()));
  EXPECT_FALSE(std::equal(a.begin() + 64, a.end(), b.begin() + 64));
  for (int32_t t : a) {
    EXPECT_GE(t, 'a');
    EXPECT_LE(t, 'z');
  }
}

TEST(PromptTokensTest, LengthIsInputTokens) {
  SyntheticOptions options;
  options.input = Dist("uniform:1:100");
  options.num_requests = 200;
  options.block_tokens = 7;
  absl::StatusOr<Workload> w = MakeSyntheticWorkload(options);
  ASSERT_TRUE(w.ok());
  for (const WorkloadRequest& r : w->requests) {
    EXPECT_EQ(PromptTokens(*w, r).size(), static_cast<size_t>(r.input_tokens));
  }
}

TEST(PromptTokensTest, BlockContentIsTheSameOnEveryMachine) {
  // Block id 0 seeds std::mt19937_64 with 0; 'a' + the rejection method
  // over 26 values (golden_values.py).
  Workload w;
  w.block_tokens = 16;
  WorkloadRequest r;
  r.input_tokens = 8;
  r.block_ids = {0};
  EXPECT_EQ(PromptTokens(w, r),
            (std::vector<int32_t>{101, 116, 120, 115, 97, 105, 108, 105}));
}

TEST(PromptTokensTest, TokenRange) {
  Workload w;
  w.block_tokens = 64;
  WorkloadRequest r;
  r.input_tokens = 200;
  r.block_ids = {5, 6, 7, 8};
  const std::vector<int32_t> tokens = PromptTokens(w, r, PromptOptions{5, 7});
  ASSERT_EQ(tokens.size(), 200u);
  std::set<int32_t> seen(tokens.begin(), tokens.end());
  EXPECT_EQ(seen, (std::set<int32_t>{5, 6, 7}));
}

Workload Empty(int n) {
  Workload w;
  w.requests.resize(n);
  return w;
}

struct Gaps {
  double mean = 0, cv = 0;
};

Gaps InterArrivals(const Workload& w) {
  double sum = 0, sum_sq = 0;
  const size_t n = w.requests.size() - 1;
  for (size_t i = 1; i < w.requests.size(); ++i) {
    const double gap = w.requests[i].arrival_s - w.requests[i - 1].arrival_s;
    EXPECT_GE(gap, 0);
    sum += gap;
    sum_sq += gap * gap;
  }
  const double mean = sum / n;
  return {mean, std::sqrt(sum_sq / n - mean * mean) / mean};
}

TEST(AssignArrivalsTest, PoissonMeanAndCv) {
  Workload w = Empty(200001);
  ASSERT_TRUE(AssignArrivals({.rate = 4, .burstiness = 1, .seed = 1}, w).ok());
  EXPECT_EQ(w.requests[0].arrival_s, 0);
  const Gaps gaps = InterArrivals(w);
  // Exponential: mean 1 / 4 (standard error 0.25 / sqrt(200,000) = 0.0006),
  // CV 1 (standard error about sqrt(2 / 200,000) = 0.003).
  EXPECT_NEAR(gaps.mean, 0.25, 0.003);
  EXPECT_NEAR(gaps.cv, 1.0, 0.02);
}

TEST(AssignArrivalsTest, GammaBurstinessSetsCv) {
  // CV = 1 / sqrt(shape): shape 0.25 -> 2, shape 4 -> 0.5; mean 1 / rate.
  Workload bursty = Empty(200001);
  ASSERT_TRUE(
      AssignArrivals({.rate = 4, .burstiness = 0.25, .seed = 2}, bursty).ok());
  const Gaps b = InterArrivals(bursty);
  EXPECT_NEAR(b.mean, 0.25, 0.006);  // Standard error 0.5 / 447 = 0.0011.
  EXPECT_NEAR(b.cv, 2.0, 0.08);

  Workload smooth = Empty(200001);
  ASSERT_TRUE(
      AssignArrivals({.rate = 10, .burstiness = 4, .seed = 3}, smooth).ok());
  const Gaps s = InterArrivals(smooth);
  EXPECT_NEAR(s.mean, 0.1, 0.001);
  EXPECT_NEAR(s.cv, 0.5, 0.01);
}

TEST(AssignArrivalsTest, SameSeedSameArrivals) {
  Workload a = Empty(100), b = Empty(100);
  ASSERT_TRUE(
      AssignArrivals({.rate = 3, .burstiness = 0.5, .seed = 9}, a).ok());
  ASSERT_TRUE(
      AssignArrivals({.rate = 3, .burstiness = 0.5, .seed = 9}, b).ok());
  for (int i = 0; i < 100; ++i)
    EXPECT_EQ(a.requests[i].arrival_s, b.requests[i].arrival_s);
}

TEST(AssignArrivalsTest, InfiniteRateIsAllAtZero) {
  Workload w = Empty(10);
  for (int i = 0; i < 10; ++i) w.requests[i].arrival_s = i + 1;
  ASSERT_TRUE(AssignArrivals({.rate = kInf}, w).ok());
  for (const WorkloadRequest& r : w.requests) EXPECT_EQ(r.arrival_s, 0);
}

TEST(AssignArrivalsTest, BadRateOrBurstiness) {
  Workload w = Empty(3);
  for (double rate : {0.0, -1.0, std::nan("")}) {
    EXPECT_EQ(AssignArrivals({.rate = rate}, w).code(),
              absl::StatusCode::kInvalidArgument)
        << rate;
  }
  for (double burstiness : {0.0, -2.0, kInf}) {
    EXPECT_EQ(AssignArrivals({.rate = 1, .burstiness = burstiness}, w).code(),
              absl::StatusCode::kInvalidArgument)
        << burstiness;
  }
}

const std::string kMooncake =
    PDSERVE_SHARED_DIR "/traces/mooncake_conversation_trace.jsonl";
const std::string kAzure =
    PDSERVE_SHARED_DIR "/traces/azure_llm_inference_2023_conv.csv";

#define SKIP_WITHOUT(path) \
  if (!std::filesystem::exists(path)) GTEST_SKIP() << path << " is missing"

Workload LoadOrDie(const TraceOptions& options) {
  absl::StatusOr<Workload> w = LoadTraceWorkload(options);
  EXPECT_TRUE(w.ok()) << w.status();
  return w.ok() ? *std::move(w) : Workload();
}

double MeanInput(const Workload& w) {
  double sum = 0;
  for (const WorkloadRequest& r : w.requests) sum += r.input_tokens;
  return sum / w.requests.size();
}

double MeanOutput(const Workload& w) {
  double sum = 0;
  for (const WorkloadRequest& r : w.requests) sum += r.output_tokens;
  return sum / w.requests.size();
}

// The trace's own lines, to compare ids with.
std::vector<nlohmann::json> MooncakeLines() {
  std::ifstream in(kMooncake);
  std::vector<nlohmann::json> lines;
  std::string text;
  while (std::getline(in, text)) lines.push_back(nlohmann::json::parse(text));
  return lines;
}

TEST(MooncakeTraceTest, WholeTraceUnscaled) {
  SKIP_WITHOUT(kMooncake);
  const Workload w = LoadOrDie({.path = kMooncake});
  // python3 -c "import json; r=[json.loads(l) for l in
  //   open('mooncake_conversation_trace.jsonl')]; print(len(r),
  //   sum(x['input_length'] for x in r)/len(r),
  //   sum(x['output_length'] for x in r)/len(r))"
  // -> 12031 12035.061341534369 342.6189011719724
  ASSERT_EQ(w.requests.size(), 12031u);
  EXPECT_NEAR(MeanInput(w), 12035.061341534369, 1.0);
  EXPECT_NEAR(MeanOutput(w), 342.6189011719724, 1.0);
  // Timestamps 0 ms and 3,536,999 ms.
  EXPECT_EQ(w.requests.front().arrival_s, 0);
  EXPECT_NEAR(w.requests.back().arrival_s, 3536.999, 1e-9);
  EXPECT_EQ(w.block_tokens, 512);
  EXPECT_EQ(w.description,
            "mooncake_conversation_trace.jsonl, lengths / 1, time x 1, 12031 "
            "requests over 3537 s");
  // hash_ids become block_ids as they are (each line has ceil(input / 512)).
  const std::vector<nlohmann::json> lines = MooncakeLines();
  ASSERT_EQ(lines.size(), w.requests.size());
  for (size_t i = 0; i < lines.size(); ++i) {
    ASSERT_EQ(w.requests[i].block_ids,
              lines[i]["hash_ids"].get<std::vector<uint64_t>>())
        << i;
    ASSERT_EQ(w.requests[i].input_tokens,
              lines[i]["input_length"].get<int32_t>())
        << i;
  }
  // The trace's first two prompts share their first block (id 0).
  EXPECT_EQ(w.requests[0].block_ids[0], w.requests[1].block_ids[0]);
}

TEST(MooncakeTraceTest, LengthScaleDividesLengthsAndBlocks) {
  SKIP_WITHOUT(kMooncake);
  const Workload w = LoadOrDie({.path = kMooncake, .length_scale = 16});
  // mean(ceil(input / 16)) = 752.6583825118444,
  // mean(max(1, ceil(output / 16))) = 21.88521319923531 (Python, as above).
  EXPECT_NEAR(MeanInput(w), 752.6583825118444, 1e-6);
  EXPECT_NEAR(MeanOutput(w), 21.88521319923531, 1e-6);
  EXPECT_EQ(w.block_tokens, 32);  // 512 / 16
  // The first line: 6758 tokens -> ceil(6758 / 16) = 423 -> 14 blocks of
  // 32, the trace's 14 ids.
  EXPECT_EQ(w.requests[0].input_tokens, 423);
  EXPECT_EQ(
      w.requests[0].block_ids,
      (std::vector<uint64_t>{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13}));

  // 512 / 3 = 170.67 rounds to 171; ids are the trace's, cut to
  // ceil(input / 171).
  const Workload thirds = LoadOrDie({.path = kMooncake, .length_scale = 3});
  EXPECT_EQ(thirds.block_tokens, 171);
  const std::vector<nlohmann::json> lines = MooncakeLines();
  for (size_t i = 0; i < lines.size(); ++i) {
    const WorkloadRequest& r = thirds.requests[i];
    ASSERT_EQ(r.input_tokens,
              CeilDiv(lines[i]["input_length"].get<int64_t>(), 3));
    ASSERT_EQ(static_cast<int64_t>(r.block_ids.size()),
              CeilDiv(r.input_tokens, 171));
    const auto ids = lines[i]["hash_ids"].get<std::vector<uint64_t>>();
    ASSERT_TRUE(std::equal(r.block_ids.begin(), r.block_ids.end(), ids.begin()))
        << i;
  }
}

TEST(MooncakeTraceTest, TimeScaleMultipliesArrivals) {
  SKIP_WITHOUT(kMooncake);
  const Workload w = LoadOrDie({.path = kMooncake, .time_scale = 2});
  EXPECT_NEAR(w.requests.back().arrival_s, 2 * 3536.999, 1e-9);
  const Workload fast = LoadOrDie({.path = kMooncake, .time_scale = 0.1});
  EXPECT_NEAR(fast.requests.back().arrival_s, 353.6999, 1e-9);
}

TEST(MooncakeTraceTest, WindowShiftsArrivalsToZero) {
  SKIP_WITHOUT(kMooncake);
  // python3: timestamps in [600000, 900000) ms: 978 rows, the first at
  // 600000 ms, the last at 899999 ms.
  const Workload w =
      LoadOrDie({.path = kMooncake, .start_s = 600, .duration_s = 300});
  ASSERT_EQ(w.requests.size(), 978u);
  EXPECT_NEAR(w.requests.front().arrival_s, 0, 1e-9);
  EXPECT_NEAR(w.requests.back().arrival_s, 299.999, 1e-9);
  EXPECT_THAT(w.description, HasSubstr("trace [600 s, 900 s)"));
  // Time scaling applies after the shift.
  const Workload slow = LoadOrDie(
      {.path = kMooncake, .time_scale = 2, .start_s = 600, .duration_s = 300});
  EXPECT_NEAR(slow.requests.back().arrival_s, 599.998, 1e-9);
}

TEST(MooncakeTraceTest, MaxRequestsKeepsTheFirst) {
  SKIP_WITHOUT(kMooncake);
  const Workload all = LoadOrDie({.path = kMooncake});
  const Workload w = LoadOrDie({.path = kMooncake, .max_requests = 100});
  ASSERT_EQ(w.requests.size(), 100u);
  for (int i = 0; i < 100; ++i) {
    EXPECT_EQ(w.requests[i].input_tokens, all.requests[i].input_tokens);
    EXPECT_EQ(w.requests[i].arrival_s, all.requests[i].arrival_s);
  }
}

TEST(MooncakeTraceTest, ClipsScaledLengths) {
  SKIP_WITHOUT(kMooncake);
  // 7,929 prompts are longer than 4,096 tokens; outputs reach 2,000.
  const Workload w = LoadOrDie(
      {.path = kMooncake, .max_input_tokens = 4096, .max_output_tokens = 256});
  int32_t max_input = 0, max_output = 0, clipped = 0;
  for (const WorkloadRequest& r : w.requests) {
    max_input = std::max(max_input, r.input_tokens);
    max_output = std::max(max_output, r.output_tokens);
    clipped += r.input_tokens == 4096;
    ASSERT_EQ(static_cast<int64_t>(r.block_ids.size()),
              CeilDiv(r.input_tokens, 512));
  }
  EXPECT_EQ(max_input, 4096);
  EXPECT_EQ(max_output, 256);
  EXPECT_GE(clipped, 7929);
}

TEST(AzureTraceTest, WholeTrace) {
  SKIP_WITHOUT(kAzure);
  const Workload w = LoadOrDie({.path = kAzure});
  // python3 -c "import csv; r=list(csv.DictReader(open(
  //   'azure_llm_inference_2023_conv.csv'))); print(len(r),
  //   sum(int(x['ContextTokens']) for x in r)/len(r),
  //   sum(int(x['GeneratedTokens']) for x in r)/len(r))"
  // -> 19366 1154.6974078281523 211.12594237323142
  // (traces/README.md says 19,365 rows; the file has 19,366 after its
  // header.)
  ASSERT_EQ(w.requests.size(), 19366u);
  EXPECT_NEAR(MeanInput(w), 1154.6974078281523, 1e-6);
  EXPECT_NEAR(MeanOutput(w), 211.12594237323142, 1e-6);
  // 2023-11-16 18:15:46.6805900 to 19:14:08.4025270: 3501.721937 s.
  EXPECT_EQ(w.requests.front().arrival_s, 0);
  EXPECT_NEAR(w.requests.back().arrival_s, 3501.721937, 1e-6);
  // The second row, 18:15:50.9951690: 4.314579 s.
  EXPECT_NEAR(w.requests[1].arrival_s, 4.314579, 1e-6);
  // No prefix information: every block id is unique.
  std::set<uint64_t> ids;
  size_t total = 0;
  for (const WorkloadRequest& r : w.requests) {
    ASSERT_EQ(static_cast<int64_t>(r.block_ids.size()),
              CeilDiv(r.input_tokens, w.block_tokens));
    ids.insert(r.block_ids.begin(), r.block_ids.end());
    total += r.block_ids.size();
  }
  EXPECT_EQ(ids.size(), total);
}

TEST(AzureTraceTest, Scaled) {
  SKIP_WITHOUT(kAzure);
  const Workload w = LoadOrDie({.path = kAzure,
                                .length_scale = 4,
                                .time_scale = 0.5,
                                .max_requests = 3});
  ASSERT_EQ(w.requests.size(), 3u);
  EXPECT_EQ(w.block_tokens, 128);
  // Rows 374/44, 396/109, 879/55 -> ceil(/ 4): 94/11, 99/28, 220/14.
  EXPECT_EQ(w.requests[0].input_tokens, 94);
  EXPECT_EQ(w.requests[0].output_tokens, 11);
  EXPECT_EQ(w.requests[1].output_tokens, 28);
  EXPECT_EQ(w.requests[2].input_tokens, 220);
  EXPECT_EQ(w.requests[2].block_ids.size(), 2u);  // ceil(220 / 128)
  EXPECT_NEAR(w.requests[1].arrival_s, 4.314579 / 2, 1e-6);
}

std::string WriteTemp(const std::string& name, const std::string& text) {
  const std::string path = testing::TempDir() + "/" + name;
  std::ofstream(path) << text;
  return path;
}

TEST(TraceFileTest, ScaledPromptGetsFreshIdsBeyondItsHashIds) {
  // 512 / 5 = 102.4 rounds to 102: 512 tokens -> 103 -> 2 blocks, one more
  // than the trace's id; 1024 tokens clipped to 100 keep only the first id.
  const std::string path = WriteTemp(
      "fresh.jsonl",
      R"({"timestamp": 0, "input_length": 512, "output_length": 4, "hash_ids": [7]})"
      "\n"
      R"({"timestamp": 5, "input_length": 512, "output_length": 4, "hash_ids": [7]})"
      "\n");
  const Workload w = LoadOrDie({.path = path, .length_scale = 5});
  ASSERT_EQ(w.requests.size(), 2u);
  EXPECT_EQ(w.block_tokens, 102);
  ASSERT_EQ(w.requests[0].block_ids.size(), 2u);
  ASSERT_EQ(w.requests[1].block_ids.size(), 2u);
  EXPECT_EQ(w.requests[0].block_ids[0], 7u);
  EXPECT_EQ(w.requests[1].block_ids[0], 7u);
  EXPECT_NE(w.requests[0].block_ids[1], w.requests[1].block_ids[1]);
  EXPECT_NE(w.requests[0].block_ids[1], 7u);
  EXPECT_NEAR(w.requests[1].arrival_s, 0.005, 1e-12);
  EXPECT_EQ(w.requests[1].output_tokens, 1);  // ceil(4 / 5)

  const std::string long_path = WriteTemp(
      "clip.jsonl",
      R"({"timestamp": 0, "input_length": 1024, "output_length": 4, "hash_ids": [1, 2]})");
  const Workload clipped =
      LoadOrDie({.path = long_path, .max_input_tokens = 100});
  ASSERT_EQ(clipped.requests.size(), 1u);
  EXPECT_EQ(clipped.requests[0].input_tokens, 100);
  EXPECT_EQ(clipped.requests[0].block_ids, (std::vector<uint64_t>{1}));
}

TEST(TraceFileTest, MalformedMooncakeNamesFileAndLine) {
  const std::string good =
      R"({"timestamp": 0, "input_length": 10, "output_length": 4, "hash_ids": [1]})";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"timestamp": 1, "output_length": 4, "hash_ids": [1]})",
       "no field 'input_length'"},
      {R"({"timestamp": 1, "input_length": "ten", "output_length": 4})",
       "'input_length' is not an integer"},
      {R"({"timestamp": 1, "input_length": 10, "output_length": -4})",
       "output_length -4 is negative"},
      {R"({"timestamp": "x", "input_length": 10, "output_length": 4})",
       "'timestamp' is not"},
      {R"({"timestamp": 1, "input_length": 10, "output_length": 4, "hash_ids": [-1]})",
       "'hash_ids' holds -1"},
      {R"({"timestamp": 1, "input_length": 10)", "not a JSON object"},
  };
  for (const auto& [line, why] : cases) {
    const std::string path = WriteTemp("bad.jsonl", good + "\n" + line + "\n");
    absl::StatusOr<Workload> w = LoadTraceWorkload({.path = path});
    ASSERT_FALSE(w.ok()) << line;
    EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument) << line;
    EXPECT_THAT(w.status().message(), HasSubstr(path + ":2:")) << line;
    EXPECT_THAT(w.status().message(), HasSubstr(why)) << line;
  }
}

TEST(TraceFileTest, MalformedAzureNamesFileAndLine) {
  const std::string header = "TIMESTAMP,ContextTokens,GeneratedTokens\n";
  const std::string good = "2023-11-16 18:15:46.6805900,374,44\n";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"2023-11-16 18:15:47.0,abc,44", "ContextTokens 'abc' is not an integer"},
      {"2023-11-16 18:15:47.0,374,-3", "GeneratedTokens -3 is negative"},
      {"2023-11-16 18:15:47.0,374", "2 fields, expected 3"},
      {"yesterday,374,44", "TIMESTAMP 'yesterday' is not a date and time"},
  };
  for (const auto& [line, why] : cases) {
    const std::string path = WriteTemp("bad.csv", header + good + line + "\n");
    absl::StatusOr<Workload> w = LoadTraceWorkload({.path = path});
    ASSERT_FALSE(w.ok()) << line;
    EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument) << line;
    EXPECT_THAT(w.status().message(), HasSubstr(path + ":3:")) << line;
    EXPECT_THAT(w.status().message(), HasSubstr(why)) << line;
  }
  const std::string no_column =
      WriteTemp("no_column.csv", "TIMESTAMP,ContextTokens\n" + good);
  absl::StatusOr<Workload> w = LoadTraceWorkload({.path = no_column});
  EXPECT_EQ(w.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(w.status().message(),
              HasSubstr(no_column + ":1: no column 'GeneratedTokens'"));
}

TEST(TraceFileTest, MissingFileIsNotFound) {
  EXPECT_EQ(LoadTraceWorkload({.path = testing::TempDir() + "/none.jsonl"})
                .status()
                .code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(LoadTraceWorkload({.path = testing::TempDir() + "/none.csv"})
                .status()
                .code(),
            absl::StatusCode::kNotFound);
}

TEST(TraceFileTest, BadOptions) {
  const std::string path = WriteTemp(
      "ok.jsonl",
      R"({"timestamp": 0, "input_length": 10, "output_length": 4, "hash_ids": [1]})");
  const std::vector<TraceOptions> cases = {
      {.path = path, .length_scale = 0},
      {.path = path, .length_scale = -2},
      {.path = path, .time_scale = 0},
      {.path = path, .start_s = -1},
      {.path = path, .duration_s = 0},
      {.path = path, .max_requests = -1},
      {.path = path, .max_input_tokens = -1},
      {.path = WriteTemp("trace.txt", "")},
  };
  for (const TraceOptions& options : cases) {
    EXPECT_EQ(LoadTraceWorkload(options).status().code(),
              absl::StatusCode::kInvalidArgument)
        << options.path;
  }
}

}  // namespace
}  // namespace pdserve::planner
