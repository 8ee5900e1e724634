// Our logits and greedy tokens against Hugging Face transformers on small
// random models saved with save_pretrained (tests/fixtures/hf, made by
// tests/fixtures/make_hf_fixtures.py): Llama with GQA and llama3 rope
// scaling, Qwen2 with QKV bias and tied embeddings, Mistral in bf16, Qwen3
// with its per-head q/k norm and head_dim != hidden / heads.
#include <fstream>
#include <sstream>

#include "engine/generator.h"
#include "engine/model.h"
#include "engine/model_runner.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/engine/test_util.h"

namespace pdserve {
namespace {

const std::string kFixtures = std::string(PDSERVE_FIXTURES_DIR) + "/hf/";

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
      float max_abs = 0.0f, max_diff = 0.0f;
      for (int v = 0; v < vocab; ++v) {
        max_abs = std::max(max_abs, std::abs(want[v]));
        max_diff = std::max(max_diff, std::abs(want[v] - logits[positions[p] * vocab + v]));
      }
      // 1e-4 relative to the row's largest logit.
      EXPECT_LE(max_diff, 1e-4f * max_abs) << "position " << positions[p];
      worst = std::max(worst, max_diff / max_abs);
    }

    const std::vector<int32_t> want_tokens = c["greedy_new_tokens"].get<std::vector<int32_t>>();
    EXPECT_EQ(testing_util::GreedyTokens(**runner, ids, static_cast<int32_t>(want_tokens.size())),
              want_tokens);
  }
  std::cout << GetParam() << ": largest logit difference " << worst
            << " of the row's largest logit\n";
}

INSTANTIATE_TEST_SUITE_P(Models, HfReferenceTest,
                         ::testing::Values("llama_gqa_rope3", "qwen2_bias_tied", "mistral",
                                           "qwen3_qk_norm_tied"));

}  // namespace
}  // namespace pdserve
