// Our logits and greedy tokens against Hugging Face transformers on small
// random models saved with save_pretrained (tests/fixtures/hf, made by
// tests/fixtures/make_hf_fixtures.py): Llama with GQA and llama3 rope
// scaling, Qwen2 with QKV bias and tied embeddings, Mistral in bf16, Qwen3
// with its per-head q/k norm and head_dim != hidden / heads.
#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <sstream>

#include "engine/cpu/cpu_kernels.h"
#include "engine/generator.h"
#include "engine/model.h"
#include "engine/model_runner.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/engine/test_util.h"

namespace pdserve {
namespace {

const std::string kFixtures = std::string(PDSERVE_FIXTURES_DIR) + "/hf/";

// The largest |want - got| over one row of logits, relative to the row's
// largest |want|.
float RelativeRowError(const std::vector<float>& want, const float* got) {
  float max_abs = 0.0f, max_diff = 0.0f;
  for (size_t v = 0; v < want.size(); ++v) {
    max_abs = std::max(max_abs, std::abs(want[v]));
    max_diff = std::max(max_diff, std::abs(want[v] - got[v]));
  }
  return max_diff / max_abs;
}

// Forwards one fixture case (`c`) asking for every row's logits; returns
// the largest RelativeRowError over its logits positions, expecting each
// within `bound`.
float CaseLogitError(ModelRunner& runner, const nlohmann::json& c, int vocab,
                     const std::vector<BlockId>& table, float bound) {
  const std::vector<int32_t> ids = c["input_ids"].get<std::vector<int32_t>>();
  ForwardBatch b;
  b.sequences.push_back({.tokens = ids, .start_pos = 0, .block_table = table, .all_logits = true});
  std::vector<float> logits(ids.size() * vocab);
  EXPECT_TRUE(runner.Forward(b, logits).ok());
  const auto positions = c["logits_positions"].get<std::vector<int>>();
  float worst = 0.0f;
  for (size_t p = 0; p < positions.size(); ++p) {
    const std::vector<float> want = c["logits"][p].get<std::vector<float>>();
    const float error = RelativeRowError(want, &logits[positions[p] * vocab]);
    EXPECT_LE(error, bound) << "position " << positions[p];
    worst = std::max(worst, error);
  }
  return worst;
}

class HfReferenceTest : public ::testing::TestWithParam<std::string> {};

TEST_P(HfReferenceTest, LogitsAndGreedyTokensMatchTransformers) {
  const std::string dir = kFixtures + GetParam();
  const std::string text = testing_util::ReadFileOrEmpty(dir + "/reference.json");
  ASSERT_FALSE(text.empty()) << "missing " << dir << "/reference.json";
  const nlohmann::json ref = nlohmann::json::parse(text);
  auto model = Model::Load(dir);
  ASSERT_TRUE(model.ok()) << model.status();
  const int vocab = (*model)->config().vocab_size;
  auto runner = CreateModelRunner(*model, {.num_kv_blocks = 64, .block_size = 16, .num_threads = 2});
  ASSERT_TRUE(runner.ok()) << runner.status();
  std::vector<BlockId> table;
  for (int i = 0; i < 64; ++i) table.push_back(BlockId(i));

  ASSERT_GE(ref["cases"].size(), 3u);
  float worst = 0.0f;
  for (const auto& c : ref["cases"]) {
    const std::vector<int32_t> ids = c["input_ids"].get<std::vector<int32_t>>();
    SCOPED_TRACE(testing::Message() << GetParam() << ", prompt of " << ids.size() << " tokens");
    ForwardBatch b;
    b.sequences.push_back({.tokens = ids, .start_pos = 0, .block_table = table, .all_logits = true});
    std::vector<float> logits(ids.size() * vocab);
    ASSERT_TRUE((*runner)->Forward(b, logits).ok());
    const auto positions = c["logits_positions"].get<std::vector<int>>();
    ASSERT_EQ(positions.size(), c["logits"].size());
    for (size_t p = 0; p < positions.size(); ++p) {
      const std::vector<float> want = c["logits"][p].get<std::vector<float>>();
      ASSERT_EQ(static_cast<int>(want.size()), vocab);
      const float error = RelativeRowError(want, &logits[positions[p] * vocab]);
      // 1e-4 relative to the row's largest logit.
      EXPECT_LE(error, 1e-4f) << "position " << positions[p];
      worst = std::max(worst, error);
    }

    const std::vector<int32_t> want_tokens = c["greedy_new_tokens"].get<std::vector<int32_t>>();
    EXPECT_EQ(testing_util::GreedyTokens(**runner, ids, static_cast<int32_t>(want_tokens.size())),
              want_tokens);
  }
  std::cout << GetParam() << ": largest logit difference " << worst
            << " of the row's largest logit\n";
}

// Prompt logprobs (GenerateRequest.prompt_logprobs) against log_softmax of
// transformers' logits: entry i - 1 is prompt token i's logprob given the
// tokens before it, i.e. log_softmax(logits at position i - 1)[prompt[i]].
// Computed by the Generator in 5-token prefill chunks, so positions cross
// chunk boundaries, next to another request in the same batches. Tolerance:
// twice the logit check's (a logprob is a logit minus log Z, each within
// 1e-4 of the row's largest logit).
TEST_P(HfReferenceTest, PromptLogprobsMatchTransformers) {
  const std::string dir = kFixtures + GetParam();
  const nlohmann::json ref = nlohmann::json::parse(testing_util::ReadFileOrEmpty(dir + "/reference.json"));
  auto model = Model::Load(dir);
  ASSERT_TRUE(model.ok()) << model.status();
  const int vocab = (*model)->config().vocab_size;
  auto runner = CreateModelRunner(*model, {.num_kv_blocks = 64, .block_size = 16, .num_threads = 2});
  ASSERT_TRUE(runner.ok()) << runner.status();
  constexpr int kTop = 4;
  int checked = 0;
  for (const auto& c : ref["cases"]) {
    const std::vector<int32_t> ids = c["input_ids"].get<std::vector<int32_t>>();
    const auto positions = c["logits_positions"].get<std::vector<int>>();
    if (positions.size() != ids.size()) continue;  // Only prompts with every position's logits.
    SCOPED_TRACE(testing::Message() << GetParam() << ", prompt of " << ids.size() << " tokens");
    auto g = Generator::Create(runner->get(), {.max_batch_tokens = 5, .max_running = 2});
    ASSERT_TRUE(g.ok());
    const SamplingParams sp{.temperature = 0.0f, .max_tokens = 1, .prompt_logprobs = kTop};
    ASSERT_TRUE((*g)->Add({RequestId(1), ids, sp}).ok());
    ASSERT_TRUE((*g)->Add({RequestId(2), ids, {.temperature = 0.0f, .max_tokens = 1}}).ok());
    std::vector<SampledToken> got;
    std::vector<GenerationEvent> events;
    while ((*g)->HasWork()) {
      events.clear();
      ASSERT_TRUE((*g)->Step(events).ok());
      for (GenerationEvent& e : events) {
        if (e.id == RequestId(1)) got = std::move(e.prompt_logprobs);
        if (e.id == RequestId(2)) EXPECT_TRUE(e.prompt_logprobs.empty());
      }
    }
    ASSERT_EQ(got.size(), ids.size() - 1);
    for (size_t i = 1; i < ids.size(); ++i) {
      const std::vector<float> row = c["logits"][i - 1].get<std::vector<float>>();
      ASSERT_EQ(static_cast<int>(row.size()), vocab);
      double max = -1e300, max_abs = 0;
      for (float x : row) max = std::max<double>(max, x), max_abs = std::max<double>(max_abs, std::abs(x));
      double z = 0;
      for (float x : row) z += std::exp(x - max);
      std::vector<double> want(vocab);
      for (int v = 0; v < vocab; ++v) want[v] = row[v] - max - std::log(z);
      const double tol = 2e-4 * max_abs;
      const SampledToken& t = got[i - 1];
      EXPECT_EQ(t.token, ids[i]);
      EXPECT_NEAR(t.logprob, want[ids[i]], tol) << "position " << i;
      std::vector<double> sorted = want;
      std::sort(sorted.begin(), sorted.end(), std::greater<>());
      ASSERT_EQ(t.top_logprobs.size(), static_cast<size_t>(kTop));
      for (int k = 0; k < kTop; ++k) {
        EXPECT_NEAR(t.top_logprobs[k].logprob, want[t.top_logprobs[k].token], tol);
        EXPECT_NEAR(t.top_logprobs[k].logprob, sorted[k], tol) << "position " << i << " rank " << k;
      }
      ++checked;
    }
  }
  EXPECT_GE(checked, 24);  // The 7- and 19-token prompts.
}

// bf16 activations (ModelRunnerOptions::bf16_activations) on the bf16
// fixture, with every kernel set this CPU runs: within 5% of the row's
// largest logit of transformers' fp32 run (3.1% measured), the price of
// rounding x. The sets do not agree more closely with each other: where
// an activation lies near a bf16 rounding boundary, the order of an
// earlier sum decides which way it rounds, and the 2^-9 step spreads.
// cpu_kernels_test checks each set's products exactly.
TEST(HfReferenceBf16Test, Bf16ActivationsStayNearTransformersOnEveryKernelSet) {
  const std::string dir = kFixtures + "mistral";
  const nlohmann::json ref = nlohmann::json::parse(testing_util::ReadFileOrEmpty(dir + "/reference.json"));
  auto model = Model::Load(dir);
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_EQ((*model)->weights().layers[0].wq.dtype, DType::kBF16);
  const int vocab = (*model)->config().vocab_size;
  std::vector<BlockId> table;
  for (int i = 0; i < 64; ++i) table.push_back(BlockId(i));
  testing_util::ScopedEnv env("PDSERVE_CPU_ISA", std::nullopt);
  double worst_vs_hf[std::size(cpu::kAllCpuIsas)] = {};
  for (const auto& c : ref["cases"]) {
    const std::vector<int32_t> ids = c["input_ids"].get<std::vector<int32_t>>();
    SCOPED_TRACE(testing::Message() << "prompt of " << ids.size() << " tokens");
    for (cpu::CpuIsa isa : cpu::kAllCpuIsas) {
      if (!cpu::CpuRuns(isa)) continue;
      SCOPED_TRACE(cpu::CpuIsaName(isa));
      env.Set(std::string(cpu::CpuIsaName(isa)));
      auto runner = CreateModelRunner(
          *model, {.num_kv_blocks = 64, .block_size = 16, .num_threads = 2, .bf16_activations = true});
      ASSERT_TRUE(runner.ok()) << runner.status();
      double& worst = worst_vs_hf[static_cast<int>(isa)];
      worst = std::max<double>(worst, CaseLogitError(**runner, c, vocab, table, 5e-2f));
    }
  }
  for (cpu::CpuIsa isa : cpu::kAllCpuIsas) {
    if (!cpu::CpuRuns(isa)) {
      std::cout << "mistral, bf16 activations: this CPU has no " << cpu::CpuIsaName(isa) << "\n";
      continue;
    }
    std::cout << "mistral, bf16 activations, " << cpu::CpuIsaName(isa)
              << " kernels: largest logit difference " << worst_vs_hf[static_cast<int>(isa)]
              << " of the row's largest logit\n";
  }
}

// Int8 weights (ModelRunnerOptions::int8_weights) on every fixture, with
// every kernel set this CPU runs: logits within 15% of the row's largest
// logit of transformers' fp32 run (5-12% measured), and how many greedy
// tokens agree, printed. These random models magnify small errors: one
// matrix product with int8 weights and activations is ~1% of its row's
// largest value off (cpu_kernels_test), and rounding x to bf16 (0.4%)
// moves the mistral fixture by 3.1% (HfReferenceBf16Test). Int8 of
// q_proj alone moves llama_gqa_rope3 by 7%, of lm_head alone by 1.1%.
// Their logits nearly tie, so greedy tokens part early (26-51 of 128
// before the first difference); the greedy check of a trained model is
// stories260k_test's published text.
class HfReferenceInt8Test : public ::testing::TestWithParam<std::string> {};

TEST_P(HfReferenceInt8Test, Int8WeightsStayNearTransformersOnEveryKernelSet) {
  const std::string dir = kFixtures + GetParam();
  const nlohmann::json ref =
      nlohmann::json::parse(testing_util::ReadFileOrEmpty(dir + "/reference.json"));
  auto model = Model::Load(dir);
  ASSERT_TRUE(model.ok()) << model.status();
  const int vocab = (*model)->config().vocab_size;
  std::vector<BlockId> table;
  for (int i = 0; i < 64; ++i) table.push_back(BlockId(i));
  testing_util::ScopedEnv env("PDSERVE_CPU_ISA", std::nullopt);
  for (cpu::CpuIsa isa : cpu::kAllCpuIsas) {
    if (!cpu::CpuRuns(isa)) {
      std::cout << GetParam() << ", int8 weights: this CPU has no " << cpu::CpuIsaName(isa) << "\n";
      continue;
    }
    SCOPED_TRACE(cpu::CpuIsaName(isa));
    env.Set(std::string(cpu::CpuIsaName(isa)));
    auto runner = CreateModelRunner(
        *model, {.num_kv_blocks = 64, .block_size = 16, .num_threads = 2, .int8_weights = true});
    ASSERT_TRUE(runner.ok()) << runner.status();
    double worst = 0.0;
    int same_tokens = 0, tokens = 0;
    for (const auto& c : ref["cases"]) {
      const std::vector<int32_t> ids = c["input_ids"].get<std::vector<int32_t>>();
      SCOPED_TRACE(testing::Message() << "prompt of " << ids.size() << " tokens");
      worst = std::max<double>(worst, CaseLogitError(**runner, c, vocab, table, 0.15f));
      const auto want_tokens = c["greedy_new_tokens"].get<std::vector<int32_t>>();
      const std::vector<int32_t> got = testing_util::GreedyTokens(
          **runner, ids, static_cast<int32_t>(want_tokens.size()));
      // Tokens up to the first difference: after it the contexts differ.
      size_t same = 0;
      while (same < got.size() && same < want_tokens.size() && got[same] == want_tokens[same]) {
        ++same;
      }
      same_tokens += static_cast<int>(same);
      tokens += static_cast<int>(want_tokens.size());
    }
    std::cout << GetParam() << ", int8 weights, " << cpu::CpuIsaName(isa)
              << " kernels: largest logit difference " << worst
              << " of the row's largest logit; greedy tokens as transformers' before the first "
                 "difference: " << same_tokens << " of " << tokens << "\n";
  }
}

INSTANTIATE_TEST_SUITE_P(Models, HfReferenceInt8Test,
                         ::testing::Values("llama_gqa_rope3", "qwen2_bias_tied", "mistral",
                                           "qwen3_qk_norm_tied"));

INSTANTIATE_TEST_SUITE_P(Models, HfReferenceTest,
                         ::testing::Values("llama_gqa_rope3", "qwen2_bias_tied", "mistral",
                                           "qwen3_qk_norm_tied"));

}  // namespace
}  // namespace pdserve
