// A resumed request (GenerationRequest.resumed_tokens: the router moving a
// request off a failed decode worker) goes on with exactly the tokens the
// uninterrupted run produces, greedy and seeded, with the penalties counting
// the earlier tokens as output; bad resumptions are refused.
#include <vector>

#include "engine/builtin_tiny.h"
#include "engine/generator.h"
#include "gtest/gtest.h"
#include "tests/engine/test_util.h"

namespace pdserve {
namespace {

using testing_util::GeneratedTokens;
using testing_util::RandomPrompt;

constexpr int32_t kMaxTokens = 40;

class GeneratorResumeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto model = MakeTinyModel();
    ASSERT_TRUE(model.ok()) << model.status();
    auto runner = CreateModelRunner(*model, {.num_kv_blocks = 64, .block_size = 16, .num_threads = 2});
    ASSERT_TRUE(runner.ok()) << runner.status();
    runner_ = *std::move(runner);
  }

  // The request `r` cut after `k` tokens of `uninterrupted`: its prompt
  // extended by them, resumed_tokens k, max_tokens what is left.
  static GenerationRequest Resumed(GenerationRequest r, const std::vector<int32_t>& uninterrupted,
                                   int32_t k) {
    r.prompt.insert(r.prompt.end(), uninterrupted.begin(), uninterrupted.begin() + k);
    r.resumed_tokens = k;
    r.sampling.max_tokens -= k;
    return r;
  }

  // Sampling settings whose output depends on the step index (seeded) and
  // on which tokens count as output (the penalties).
  static std::vector<SamplingParams> PenalizedGreedyAndSeeded() {
    const SamplingParams greedy{.temperature = 0.0f,
                                .max_tokens = kMaxTokens,
                                .ignore_eos = true,
                                .presence_penalty = 1.5f,
                                .frequency_penalty = 1.0f,
                                .repetition_penalty = 1.3f};
    SamplingParams seeded = greedy;
    seeded.temperature = 0.9f;
    seeded.top_p = 0.9f;
    seeded.seed = 1234;
    return {greedy, seeded};
  }

  std::unique_ptr<ModelRunner> runner_;
};

TEST_F(GeneratorResumeTest, ResumedRequestGoesOnWithTheUninterruptedTokens) {
  for (const SamplingParams& sp : PenalizedGreedyAndSeeded()) {
    for (int len : {1, 20}) {
      const GenerationRequest r{RequestId(1), RandomPrompt(len, 7 + len), sp};
      const std::vector<int32_t> want = GeneratedTokens(*runner_, r);
      ASSERT_EQ(want.size(), static_cast<size_t>(kMaxTokens));
      for (int32_t k : {1, 5, 17, kMaxTokens - 1}) {
        const std::vector<int32_t> got = GeneratedTokens(*runner_, Resumed(r, want, k));
        EXPECT_EQ(got, std::vector<int32_t>(want.begin() + k, want.end()))
            << "T " << sp.temperature << ", prompt " << len << ", cut after " << k;
      }
    }
  }
}

// Without resumed_tokens the same extended prompt is a new request: the
// earlier tokens count as prompt and the draws start again at step 0, so
// its output differs. Shows the test above depends on the field. (Without
// the repetition penalty, which reads the prompt too, so that greedy
// differs by what presence and frequency count alone.)
TEST_F(GeneratorResumeTest, AnExtendedPromptWithoutResumedTokensDiffers) {
  for (SamplingParams sp : PenalizedGreedyAndSeeded()) {
    sp.repetition_penalty = 1.0f;
    const GenerationRequest r{RequestId(1), RandomPrompt(20, 3), sp};
    const std::vector<int32_t> want = GeneratedTokens(*runner_, r);
    GenerationRequest fresh = Resumed(r, want, 10);
    fresh.resumed_tokens = 0;
    EXPECT_NE(GeneratedTokens(*runner_, fresh), std::vector<int32_t>(want.begin() + 10, want.end()))
        << "T " << sp.temperature;
  }
}

// A prefill worker runs a resumed request with hold_kv and max_tokens 1:
// its one token is the next of the uninterrupted run.
TEST_F(GeneratorResumeTest, ResumedPrefillSamplesTheNextToken) {
  for (const SamplingParams& sp : PenalizedGreedyAndSeeded()) {
    const GenerationRequest r{RequestId(1), RandomPrompt(30, 11), sp};
    const std::vector<int32_t> want = GeneratedTokens(*runner_, r);
    for (int32_t k : {1, 12, 33}) {
      GenerationRequest prefill = Resumed(r, want, k);
      prefill.hold_kv = true;
      prefill.sampling.max_tokens = 1;
      auto g = Generator::Create(runner_.get(), {});
      ASSERT_TRUE(g.ok());
      ASSERT_TRUE((*g)->Add(prefill).ok());
      std::vector<GenerationEvent> events;
      while ((*g)->HasWork()) ASSERT_TRUE((*g)->Step(events).ok());
      ASSERT_EQ(events.size(), 1u);
      EXPECT_EQ(events[0].token.token, want[k]) << "T " << sp.temperature << ", cut after " << k;
      (*g)->ReleaseKv(prefill.id);
    }
  }
}

TEST_F(GeneratorResumeTest, BadResumptionsAreInvalidArgument) {
  auto g = Generator::Create(runner_.get(), {});
  ASSERT_TRUE(g.ok());
  const SamplingParams sp{.temperature = 0.0f, .max_tokens = 4};
  GenerationRequest all_resumed{RequestId(1), RandomPrompt(5, 1), sp};
  all_resumed.resumed_tokens = 5;  // No token of the original prompt left.
  EXPECT_EQ((*g)->Add(all_resumed).code(), absl::StatusCode::kInvalidArgument);
  GenerationRequest negative{RequestId(2), RandomPrompt(5, 1), sp};
  negative.resumed_tokens = -1;
  EXPECT_EQ((*g)->Add(negative).code(), absl::StatusCode::kInvalidArgument);
  GenerationRequest with_prompt_logprobs{RequestId(3), RandomPrompt(5, 1), sp};
  with_prompt_logprobs.resumed_tokens = 2;
  with_prompt_logprobs.sampling.prompt_logprobs = 1;
  EXPECT_EQ((*g)->Add(with_prompt_logprobs).code(), absl::StatusCode::kInvalidArgument);
  GenerationRequest ok{RequestId(4), RandomPrompt(5, 1), sp};
  ok.resumed_tokens = 4;
  EXPECT_TRUE((*g)->Add(ok).ok());
}

}  // namespace
}  // namespace pdserve
