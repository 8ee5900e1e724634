// Invariant (a) of DESIGN.md: prefill (in chunks) then decode through the
// paged cache gives the same logits as recomputing the whole sequence, for
// several block sizes, chunk sizes and mixed batches.
#include <algorithm>
#include <cmath>
#include <random>

#include "engine/builtin_tiny.h"
#include "engine/model_runner.h"
#include "gtest/gtest.h"

namespace pdserve {
namespace {

ModelConfig SmallConfig(bool qkv_bias, int sliding_window) {
  ModelConfig c;
  c.architecture = "LlamaForCausalLM";
  c.vocab_size = 97;
  c.hidden_size = 48;
  c.intermediate_size = 80;
  c.num_layers = 2;
  c.num_heads = 6;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.max_position_embeddings = 256;
  c.rms_norm_eps = 1e-5f;
  c.qkv_bias = qkv_bias;
  c.sliding_window = sliding_window;
  return c;
}

std::vector<int32_t> RandomTokens(int n, int vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> t(n);
  for (int32_t& x : t) x = static_cast<int32_t>(rng() % vocab);
  return t;
}

// Logits of every position, by one forward over the whole sequence in a
// fresh cache.
std::vector<float> Recompute(const std::shared_ptr<const Model>& model,
                             const std::vector<int32_t>& tokens) {
  auto runner = CreateModelRunner(model, {.num_kv_blocks = 64, .block_size = 16, .num_threads = 2});
  EXPECT_TRUE(runner.ok());
  std::vector<BlockId> table;
  for (int i = 0; i < 64; ++i) table.push_back(BlockId(63 - i));
  ForwardBatch batch;
  batch.sequences.push_back({.tokens = tokens, .start_pos = 0, .block_table = table, .all_logits = true});
  std::vector<float> logits(tokens.size() * model->config().vocab_size);
  EXPECT_TRUE((*runner)->Forward(batch, logits).ok());
  return logits;
}

void ExpectClose(std::span<const float> got, std::span<const float> want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  float max_abs = 0.0f;
  for (float w : want) max_abs = std::max(max_abs, std::abs(w));
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_NEAR(got[i], want[i], 1e-5f * max_abs) << what << " index " << i;
  }
}

struct Case {
  int block_size;
  int chunk;
  bool qkv_bias;
  int sliding_window;
};
// gtest names each case by its printed parameter: the fields, not the bytes.
void PrintTo(const Case& c, std::ostream* os) {
  *os << "block " << c.block_size << ", chunk " << c.chunk << (c.qkv_bias ? ", bias" : "")
      << ", window " << c.sliding_window;
}

class CacheInvariantTest : public ::testing::TestWithParam<Case> {};

TEST_P(CacheInvariantTest, ChunkedPrefillThenDecodeEqualsRecompute) {
  const Case p = GetParam();
  auto model = MakeRandomModel("t", SmallConfig(p.qkv_bias, p.sliding_window), DType::kBF16, 11);
  ASSERT_TRUE(model.ok()) << model.status();
  const int vocab = (*model)->config().vocab_size;
  const int prompt_len = 37, decode_steps = 12;
  const std::vector<int32_t> all = RandomTokens(prompt_len + decode_steps, vocab, 5);
  const std::vector<float> ref = Recompute(*model, all);

  auto runner = CreateModelRunner(*model, {.num_kv_blocks = 200, .block_size = p.block_size, .num_threads = 2});
  ASSERT_TRUE(runner.ok());
  // A scattered block table: blocks are not contiguous or ordered.
  std::vector<BlockId> table;
  for (int i = 0; i < 200 / 3; ++i) table.push_back(BlockId((i * 7 + 3) % 200));
  std::vector<float> logits(vocab);
  int pos = 0;
  while (pos < prompt_len) {  // Chunked prefill.
    const int n = std::min(p.chunk, prompt_len - pos);
    ForwardBatch b;
    b.sequences.push_back({.tokens = std::span(all).subspan(pos, n), .start_pos = pos, .block_table = table});
    ASSERT_TRUE((*runner)->Forward(b, logits).ok());
    pos += n;
    ExpectClose(logits, std::span(ref).subspan((pos - 1) * vocab, vocab), "prefill");
  }
  for (; pos < prompt_len + decode_steps; ++pos) {  // Decode one token a step.
    ForwardBatch b;
    b.sequences.push_back({.tokens = std::span(all).subspan(pos, 1), .start_pos = pos, .block_table = table});
    ASSERT_TRUE((*runner)->Forward(b, logits).ok());
    ExpectClose(logits, std::span(ref).subspan(pos * vocab, vocab), "decode");
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CacheInvariantTest,
                         ::testing::Values(Case{1, 1, false, 0}, Case{3, 5, false, 0},
                                           Case{16, 64, false, 0}, Case{16, 8, true, 0},
                                           Case{4, 7, true, 9}, Case{7, 3, false, 0}),
                         [](const auto& info) {
                           const Case& c = info.param;
                           return "block" + std::to_string(c.block_size) + "_chunk" +
                                  std::to_string(c.chunk) + (c.qkv_bias ? "_bias" : "") +
                                  (c.sliding_window ? "_window" : "");
                         });

// Several sequences in one forward — prefill chunks and decode tokens mixed,
// each with its own block table — give the same logits as each alone.
TEST(CacheInvariantTest, MixedBatchEqualsEachSequenceAlone) {
  auto model = MakeRandomModel("t", SmallConfig(true, 0), DType::kF32, 3);
  ASSERT_TRUE(model.ok());
  const int vocab = (*model)->config().vocab_size;
  const std::vector<int32_t> a = RandomTokens(30, vocab, 1), b = RandomTokens(21, vocab, 2),
                             c = RandomTokens(9, vocab, 3);
  const auto ref_a = Recompute(*model, a), ref_b = Recompute(*model, b), ref_c = Recompute(*model, c);

  auto runner = CreateModelRunner(*model, {.num_kv_blocks = 30, .block_size = 4, .num_threads = 2});
  ASSERT_TRUE(runner.ok());
  std::vector<BlockId> ta, tb, tc;
  for (int i = 0; i < 10; ++i) {
    ta.push_back(BlockId(3 * i));
    tb.push_back(BlockId(3 * i + 1));
    tc.push_back(BlockId(29 - 3 * i));
  }
  // Step 1: a and b prefill most of their prompts (b wants all logits).
  ForwardBatch s1;
  s1.sequences.push_back({.tokens = std::span(a).subspan(0, 25), .start_pos = 0, .block_table = ta});
  s1.sequences.push_back({.tokens = std::span(b).subspan(0, 20), .start_pos = 0, .block_table = tb, .all_logits = true});
  std::vector<float> l1(21 * vocab);
  ASSERT_TRUE((*runner)->Forward(s1, l1).ok());
  ExpectClose(std::span(l1).subspan(0, vocab), std::span(ref_a).subspan(24 * vocab, vocab), "a@24");
  ExpectClose(std::span(l1).subspan(vocab, 20 * vocab), std::span(ref_b).subspan(0, 20 * vocab), "b[0,20)");
  // Step 2: b decodes one token, c prefills whole, a finishes its prompt.
  ForwardBatch s2;
  s2.sequences.push_back({.tokens = std::span(b).subspan(20, 1), .start_pos = 20, .block_table = tb});
  s2.sequences.push_back({.tokens = c, .start_pos = 0, .block_table = tc});
  s2.sequences.push_back({.tokens = std::span(a).subspan(25, 5), .start_pos = 25, .block_table = ta});
  std::vector<float> l2(3 * vocab);
  ASSERT_TRUE((*runner)->Forward(s2, l2).ok());
  ExpectClose(std::span(l2).subspan(0, vocab), std::span(ref_b).subspan(20 * vocab, vocab), "b@20");
  ExpectClose(std::span(l2).subspan(vocab, vocab), std::span(ref_c).subspan(8 * vocab, vocab), "c@8");
  ExpectClose(std::span(l2).subspan(2 * vocab, vocab), std::span(ref_a).subspan(29 * vocab, vocab), "a@29");
}

TEST(ForwardValidationTest, IllFormedBatchesAreRejected) {
  auto model = MakeRandomModel("t", SmallConfig(false, 0), DType::kF32, 3);
  ASSERT_TRUE(model.ok());
  auto runner = CreateModelRunner(*model, {.num_kv_blocks = 4, .block_size = 4, .num_threads = 1});
  ASSERT_TRUE(runner.ok());
  const int vocab = (*model)->config().vocab_size;
  std::vector<float> logits(vocab);
  const std::vector<BlockId> table = {BlockId(0), BlockId(1)};
  const std::vector<BlockId> bad_table = {BlockId(0), BlockId(4)};
  const std::vector<int32_t> ok_tokens = {1, 2, 3}, bad_tokens = {1, vocab}, many(9, 1);
  auto run = [&](SequenceInput s, size_t logits_size) {
    ForwardBatch b;
    b.sequences.push_back(s);
    std::vector<float> l(logits_size);
    return (*runner)->Forward(b, l).code();
  };
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(run({.tokens = ok_tokens, .start_pos = 0, .block_table = table}, vocab), absl::StatusCode::kOk);
  EXPECT_EQ(run({.tokens = {}, .start_pos = 0, .block_table = table}, vocab), kInvalid);
  EXPECT_EQ(run({.tokens = bad_tokens, .start_pos = 0, .block_table = table}, vocab), kInvalid);
  EXPECT_EQ(run({.tokens = many, .start_pos = 0, .block_table = table}, vocab), kInvalid);
  EXPECT_EQ(run({.tokens = ok_tokens, .start_pos = 5, .block_table = bad_table}, vocab), kInvalid);
  EXPECT_EQ(run({.tokens = ok_tokens, .start_pos = -1, .block_table = table}, vocab), kInvalid);
  EXPECT_EQ(run({.tokens = ok_tokens, .start_pos = 255, .block_table = table}, vocab), kInvalid);
  EXPECT_EQ(run({.tokens = ok_tokens, .start_pos = 0, .block_table = table}, vocab + 1), kInvalid);
  ForwardBatch empty;
  EXPECT_EQ((*runner)->Forward(empty, {}).code(), kInvalid);
  EXPECT_EQ(CreateModelRunner(*model, {.backend = "tpu"}).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace pdserve
