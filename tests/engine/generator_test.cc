// Continuous batching: what a request gets does not depend on what else is
// in the batch, cancellation frees its blocks, and bad requests are refused.
#include "engine/generator.h"

#include <cstring>
#include <map>
#include <random>

#include "engine/builtin_tiny.h"
#include "gtest/gtest.h"
#include "tests/engine/test_util.h"

namespace pdserve {
namespace {

using testing_util::RandomPrompt;

struct Output {
  std::vector<int32_t> tokens;
  FinishReason finish = FinishReason::kNone;
};

std::shared_ptr<const Model> Tiny() {
  auto m = MakeTinyModel();
  EXPECT_TRUE(m.ok()) << m.status();
  return *m;
}

std::unique_ptr<ModelRunner> MakeRunner(const std::shared_ptr<const Model>& m, int blocks) {
  auto r = CreateModelRunner(m, {.num_kv_blocks = blocks, .block_size = 16, .num_threads = 2});
  EXPECT_TRUE(r.ok()) << r.status();
  return *std::move(r);
}

// Runs until idle; `arrivals[step]` are added before that step.
std::map<uint64_t, Output> RunAll(Generator& g, std::map<int, std::vector<GenerationRequest>> arrivals) {
  std::map<uint64_t, Output> out;
  std::vector<GenerationEvent> events;
  for (int step = 0; g.HasWork() || !arrivals.empty(); ++step) {
    if (auto it = arrivals.find(step); it != arrivals.end()) {
      for (auto& r : it->second) EXPECT_TRUE(g.Add(std::move(r)).ok());
      arrivals.erase(it);
    }
    events.clear();
    EXPECT_TRUE(g.Step(events).ok());
    for (const auto& e : events) {
      Output& o = out[e.id.value];
      EXPECT_EQ(o.finish, FinishReason::kNone) << "event after the last one";
      if (e.has_token) o.tokens.push_back(e.token.token);
      o.finish = e.finish;
    }
    if (step > 10000) break;
  }
  return out;
}

TEST(GeneratorTest, GreedyMatchesArgmaxOfFullRecompute) {
  auto model = Tiny();
  auto runner = MakeRunner(model, 64);
  auto g = Generator::Create(runner.get(), {});
  ASSERT_TRUE(g.ok());
  SamplingParams sp{.temperature = 0.0f, .max_tokens = 12, .ignore_eos = true};
  const auto prompt = RandomPrompt(9, 1);
  auto out = RunAll(**g, {{0, {{RequestId(1), prompt, sp}}}});
  ASSERT_EQ(out[1].tokens.size(), 12u);
  EXPECT_EQ(out[1].finish, FinishReason::kLength);

  // Reference: recompute the whole sequence each step and take the argmax.
  auto ref_runner = MakeRunner(model, 64);
  std::vector<BlockId> table;
  for (int i = 0; i < 64; ++i) table.push_back(BlockId(i));
  std::vector<int32_t> seq = prompt;
  const int vocab = model->config().vocab_size;
  for (int i = 0; i < 12; ++i) {
    ForwardBatch b;
    b.sequences.push_back({.tokens = seq, .start_pos = 0, .block_table = table});
    std::vector<float> logits(vocab);
    ASSERT_TRUE(ref_runner->Forward(b, logits).ok());
    const int32_t next = static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
    EXPECT_EQ(out[1].tokens[i], next) << "token " << i;
    seq.push_back(next);
  }
}

TEST(GeneratorTest, OutputsDoNotDependOnBatchComposition) {
  auto model = Tiny();
  std::vector<GenerationRequest> reqs;
  for (int i = 0; i < 10; ++i) {
    SamplingParams sp;
    sp.max_tokens = 6 + i;
    sp.ignore_eos = true;
    if (i % 2 == 0) {
      sp.temperature = 0.0f;
    } else {
      sp.temperature = 0.9f;
      sp.top_k = 40;
      sp.top_p = 0.95f;
      sp.seed = 1000 + i;
    }
    // Prompts from 3 to 300 tokens; the long ones take several prefill chunks.
    reqs.push_back({RequestId(i + 1), RandomPrompt(3 + i * 33, i), sp});
  }
  // Each alone, in a fresh generator.
  std::map<uint64_t, Output> alone;
  for (const auto& r : reqs) {
    auto runner = MakeRunner(model, 64);
    auto g = Generator::Create(runner.get(), {.max_batch_tokens = 64, .max_running = 4});
    ASSERT_TRUE(g.ok());
    alone[r.id.value] = RunAll(**g, {{0, {r}}})[r.id.value];
  }
  // All together, arriving over several steps, with a small token budget so
  // prefill chunks and decode tokens share steps.
  auto runner = MakeRunner(model, 256);
  auto g = Generator::Create(runner.get(), {.max_batch_tokens = 64, .max_running = 6});
  ASSERT_TRUE(g.ok());
  std::map<int, std::vector<GenerationRequest>> arrivals;
  for (size_t i = 0; i < reqs.size(); ++i) arrivals[static_cast<int>(i % 4) * 3].push_back(reqs[i]);
  auto together = RunAll(**g, arrivals);
  for (const auto& r : reqs) {
    EXPECT_EQ(together[r.id.value].tokens, alone[r.id.value].tokens) << "request " << r.id.value;
    EXPECT_EQ(together[r.id.value].finish, FinishReason::kLength);
  }
  EXPECT_EQ((*g)->block_pool().num_free(), 256);
}

TEST(GeneratorTest, CancelFreesBlocksAndEndsTheStream) {
  auto model = Tiny();
  auto runner = MakeRunner(model, 32);
  auto g = Generator::Create(runner.get(), {});
  ASSERT_TRUE(g.ok());
  SamplingParams sp{.temperature = 0.0f, .max_tokens = 100, .ignore_eos = true};
  ASSERT_TRUE((*g)->Add({RequestId(1), RandomPrompt(20, 1), sp}).ok());
  ASSERT_TRUE((*g)->Add({RequestId(2), RandomPrompt(20, 2), sp}).ok());
  std::vector<GenerationEvent> events;
  for (int i = 0; i < 3; ++i) ASSERT_TRUE((*g)->Step(events).ok());
  EXPECT_LT((*g)->block_pool().num_free(), 32);
  (*g)->Cancel(RequestId(1));
  (*g)->Cancel(RequestId(2));
  (*g)->Cancel(RequestId(99));  // Unknown: ignored.
  EXPECT_EQ((*g)->block_pool().num_free(), 32);
  events.clear();
  ASSERT_TRUE((*g)->Step(events).ok());
  ASSERT_EQ(events.size(), 2u);
  for (const auto& e : events) {
    EXPECT_FALSE(e.has_token);
    EXPECT_EQ(e.finish, FinishReason::kCancelled);
  }
  EXPECT_FALSE((*g)->HasWork());
}

TEST(GeneratorTest, StopTokenEndsWithStopAndMaxTokensWithLength) {
  auto model = Tiny();
  auto runner = MakeRunner(model, 32);
  auto g = Generator::Create(runner.get(), {});
  ASSERT_TRUE(g.ok());
  SamplingParams greedy{.temperature = 0.0f, .max_tokens = 8, .ignore_eos = true};
  auto first = RunAll(**g, {{0, {{RequestId(1), RandomPrompt(5, 3), greedy}}}});
  ASSERT_EQ(first[1].tokens.size(), 8u);
  // Stop on the third token the model would produce.
  SamplingParams stop = greedy;
  stop.stop_token_ids = {first[1].tokens[2]};
  auto second = RunAll(**g, {{0, {{RequestId(2), RandomPrompt(5, 3), stop}}}});
  EXPECT_EQ(second[2].finish, FinishReason::kStop);
  const auto pos = std::find(first[1].tokens.begin(), first[1].tokens.end(), first[1].tokens[2]);
  EXPECT_EQ(second[2].tokens, std::vector<int32_t>(first[1].tokens.begin(), pos + 1));
}

TEST(GeneratorTest, RequestsWaitForBlocksThenRun) {
  auto model = Tiny();
  auto runner = MakeRunner(model, 4);  // 64 tokens of KV.
  auto g = Generator::Create(runner.get(), {});
  ASSERT_TRUE(g.ok());
  SamplingParams sp{.temperature = 0.0f, .max_tokens = 20, .ignore_eos = true};
  std::map<int, std::vector<GenerationRequest>> arrivals;
  for (int i = 0; i < 3; ++i) arrivals[0].push_back({RequestId(i + 1), RandomPrompt(30, i), sp});
  auto out = RunAll(**g, arrivals);  // 50 tokens each: one at a time fits.
  for (int i = 1; i <= 3; ++i) EXPECT_EQ(out[i].tokens.size(), 20u);
  EXPECT_EQ((*g)->block_pool().num_free(), 4);
}

TEST(GeneratorTest, WaitingRequestsAreAdmittedInArrivalOrder) {
  // One request runs at a time (max_running 1). Added in the order 1..5
  // with router arrival times 30, 10, 0, 20, 10: 0 holds its place behind
  // those added before it, equal times keep the order they were added in.
  // The first to be added starts at once, so it runs first.
  auto model = Tiny();
  auto runner = MakeRunner(model, 64);
  auto g = Generator::Create(runner.get(), {.max_running = 1});
  ASSERT_TRUE(g.ok());
  SamplingParams sp{.temperature = 0.0f, .max_tokens = 2, .ignore_eos = true};
  const int64_t arrivals[] = {30, 10, 0, 20, 10};
  std::vector<GenerationEvent> events;
  ASSERT_TRUE((*g)->Add({.id = RequestId(1), .prompt = RandomPrompt(8, 1), .sampling = sp,
                         .arrival_unix_us = arrivals[0]})
                  .ok());
  ASSERT_TRUE((*g)->Step(events).ok());  // Request 1 is running.
  for (int i = 1; i < 5; ++i) {
    ASSERT_TRUE((*g)->Add({.id = RequestId(i + 1), .prompt = RandomPrompt(8, i + 1),
                           .sampling = sp, .arrival_unix_us = arrivals[i]})
                    .ok());
  }
  std::vector<uint64_t> finished;
  // Notes the requests `events` end, then steps until idle noting the rest.
  auto run_to_idle = [&] {
    while (true) {
      for (const GenerationEvent& e : events) {
        if (e.finish != FinishReason::kNone) finished.push_back(e.id.value);
      }
      events.clear();
      if (!(*g)->HasWork()) return;
      ASSERT_TRUE((*g)->Step(events).ok());
    }
  };
  run_to_idle();
  // Waiting after 1: 2 (10), then 3 (0) behind it, then 4 (20) behind 3
  // (a 0 stops the search), then 5 (10) ahead of 4 but behind 3.
  EXPECT_EQ(finished, (std::vector<uint64_t>{1, 2, 3, 5, 4}));

  // Without a 0 among them, the times decide.
  ASSERT_TRUE((*g)->Add({.id = RequestId(11), .prompt = RandomPrompt(8, 11), .sampling = sp,
                         .arrival_unix_us = 1})
                  .ok());
  ASSERT_TRUE((*g)->Step(events).ok());  // 11 is running.
  const int64_t later[] = {50, 40, 60, 40};
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE((*g)->Add({.id = RequestId(12 + i), .prompt = RandomPrompt(8, 12 + i),
                           .sampling = sp, .arrival_unix_us = later[i]})
                    .ok());
  }
  finished.clear();
  run_to_idle();
  EXPECT_EQ(finished, (std::vector<uint64_t>{11, 13, 15, 12, 14}));
  EXPECT_EQ((*g)->block_pool().num_free(), 64);

  EXPECT_EQ((*g)->Add({.id = RequestId(20), .prompt = RandomPrompt(8, 20), .sampling = sp,
                       .arrival_unix_us = -1})
                .code(),
            absl::StatusCode::kInvalidArgument);
}

// Greedy output of `prompt` from a fresh generator without prefix caching.
std::vector<int32_t> Uncached(const std::shared_ptr<const Model>& model, const std::vector<int32_t>& prompt,
                              int max_tokens) {
  auto runner = MakeRunner(model, 64);
  auto g = Generator::Create(runner.get(), {.enable_prefix_caching = false});
  EXPECT_TRUE(g.ok());
  SamplingParams sp{.temperature = 0.0f, .max_tokens = max_tokens, .ignore_eos = true};
  return RunAll(**g, {{0, {{RequestId(1), prompt, sp}}}})[1].tokens;
}

TEST(GeneratorTest, PrefixCacheReusesComputedBlocksWithTheSameOutput) {
  auto model = Tiny();
  auto runner = MakeRunner(model, 64);
  auto g = Generator::Create(runner.get(), {});
  ASSERT_TRUE(g.ok());
  SamplingParams sp{.temperature = 0.0f, .max_tokens = 8, .ignore_eos = true};
  const std::vector<int32_t> shared = RandomPrompt(50, 7);  // 3 full blocks of 16, and 2 tokens.
  std::vector<int32_t> other = shared;
  other.resize(48);
  for (int32_t t : RandomPrompt(20, 8)) other.push_back(t % 256);

  auto first = RunAll(**g, {{0, {{RequestId(1), shared, sp}}}});
  EXPECT_EQ((*g)->prefix_cached_tokens(), 0);
  auto again = RunAll(**g, {{0, {{RequestId(2), shared, sp}}}});
  EXPECT_EQ((*g)->prefix_cached_tokens(), 48);  // Three blocks; the last token is recomputed.
  EXPECT_EQ(again[2].tokens, first[1].tokens);
  auto diverging = RunAll(**g, {{0, {{RequestId(3), other, sp}}}});
  EXPECT_EQ((*g)->prefix_cached_tokens(), 96);  // The same three blocks again.
  EXPECT_EQ(first[1].tokens, Uncached(model, shared, 8));
  EXPECT_EQ(diverging[3].tokens, Uncached(model, other, 8));
  EXPECT_EQ((*g)->block_pool().num_free(), 64);
}

// KV landed from a prefill worker joins the decode side's prefix cache at
// once: the choices of an n > 1 request, sent after it, compute only the
// tail of the prompt (the block holding its last token).
TEST(GeneratorTest, PrefilledKvJoinsThePrefixCache) {
  auto model = Tiny();
  auto runner = MakeRunner(model, 64);
  auto g = Generator::Create(runner.get(), {});
  ASSERT_TRUE(g.ok());
  const std::vector<int32_t> prompt = RandomPrompt(40, 9);  // Two full blocks and 8 tokens.
  const SamplingParams sp{.temperature = 0.0f, .max_tokens = 4, .ignore_eos = true};
  // Land the prompt's KV as a prefill worker would: computed by a reference
  // generator, copied into the reservation.
  auto src_runner = MakeRunner(model, 64);
  auto src = Generator::Create(src_runner.get(), {});
  ASSERT_TRUE(src.ok());
  GenerationRequest held{RequestId(1), prompt, sp};
  held.hold_kv = true;
  std::vector<BlockId> src_blocks;
  (*src)->set_kv_layer_observer([&](int32_t, std::span<const ComputedKv> c) {
    src_blocks.assign(c[0].block_table.begin(), c[0].block_table.end());
  });
  ASSERT_TRUE((*src)->Add(held).ok());
  std::vector<GenerationEvent> events;
  while ((*src)->HasWork()) ASSERT_TRUE((*src)->Step(events).ok());
  ASSERT_EQ(events.size(), 1u);
  auto landing = (*g)->Reserve(RequestId(1), 44);
  ASSERT_TRUE(landing.ok());
  const KvBlockLayout& layout = runner->kv_layout();
  for (int32_t layer = 0; layer < layout.num_layers; ++layer) {
    ForEachKvRange(layout, layer, src_blocks.data(), 64, landing->data(), 64, 0, 40,
                   [&](size_t from, size_t to, size_t n) {
                     std::memcpy(runner->kv_memory().data() + to,
                                 src_runner->kv_memory().data() + from, n);
                   });
  }
  ASSERT_TRUE((*g)->AddPrefilled({RequestId(1), prompt, sp}, events[0].token.token).ok());
  const int64_t computed_before = (*g)->computed_prompt_tokens();
  // Before the prefilled request has run a step, a same-prompt request
  // finds its two full blocks and computes the 8-token tail only.
  auto out = RunAll(**g, {{0, {{RequestId(2), prompt, sp}}}});
  EXPECT_EQ((*g)->prefix_cached_tokens(), 32);
  EXPECT_EQ((*g)->computed_prompt_tokens() - computed_before, 8);
  EXPECT_EQ(out[2].tokens, Uncached(model, prompt, 4));
  std::vector<int32_t> continued = {events[0].token.token};
  continued.insert(continued.end(), out[1].tokens.begin(), out[1].tokens.end());
  EXPECT_EQ(continued, Uncached(model, prompt, 4));
  EXPECT_EQ((*g)->block_pool().num_free(), 64);
}

// Prompt logprobs at every position, in any chunking, equal those of one
// full forward with logits at every position, next to other requests.
TEST(GeneratorTest, PromptLogprobsDoNotDependOnChunking) {
  auto model = Tiny();
  auto runner = MakeRunner(model, 64);
  const int32_t vocab = model->config().vocab_size;
  const std::vector<int32_t> prompt = RandomPrompt(45, 12);
  std::vector<BlockId> table;
  for (int i = 0; i < 4; ++i) table.push_back(BlockId(60 + i));
  ForwardBatch b;
  b.sequences.push_back({.tokens = prompt, .start_pos = 0, .block_table = table, .all_logits = true});
  std::vector<float> logits(prompt.size() * vocab);
  ASSERT_TRUE(runner->Forward(b, logits).ok());
  for (int32_t chunk : {7, 16, 64}) {
    SCOPED_TRACE(chunk);
    auto g = Generator::Create(runner.get(), {.max_batch_tokens = chunk, .max_running = 2});
    ASSERT_TRUE(g.ok());
    const SamplingParams sp{.temperature = 0.0f, .max_tokens = 2, .ignore_eos = true,
                            .prompt_logprobs = 3};
    ASSERT_TRUE((*g)->Add({RequestId(1), prompt, sp}).ok());
    ASSERT_TRUE((*g)->Add({RequestId(2), RandomPrompt(30, 13), sp}).ok());
    std::map<uint64_t, std::vector<SampledToken>> got;
    std::vector<GenerationEvent> events;
    while ((*g)->HasWork()) {
      events.clear();
      ASSERT_TRUE((*g)->Step(events).ok());
      for (GenerationEvent& e : events) {
        if (!e.prompt_logprobs.empty()) got[e.id.value] = std::move(e.prompt_logprobs);
      }
    }
    ASSERT_EQ(got[1].size(), prompt.size() - 1);
    EXPECT_EQ(got[2].size(), 29u);
    std::vector<std::pair<float, int32_t>> scratch;
    for (size_t i = 1; i < prompt.size(); ++i) {
      SampledToken want;
      FillLogprobs(std::span<const float>(logits).subspan((i - 1) * vocab, vocab), prompt[i], 3,
                   scratch, want);
      const SampledToken& t = got[1][i - 1];
      EXPECT_EQ(t.token, prompt[i]);
      EXPECT_NEAR(t.logprob, want.logprob, 1e-4) << "position " << i;
      ASSERT_EQ(t.top_logprobs.size(), 3u);
      EXPECT_EQ(t.top_logprobs[0].token, want.top_logprobs[0].token);
    }
  }
}

TEST(GeneratorTest, PrefixCacheSurvivesBlockReuseUnderPressure) {
  auto model = Tiny();
  auto runner = MakeRunner(model, 8);  // Room for two 40-token requests.
  auto g = Generator::Create(runner.get(), {});
  ASSERT_TRUE(g.ok());
  SamplingParams sp{.temperature = 0.0f, .max_tokens = 8, .ignore_eos = true};
  const std::vector<int32_t> a = RandomPrompt(40, 1);
  const auto want = Uncached(model, a, 8);
  EXPECT_EQ(RunAll(**g, {{0, {{RequestId(1), a, sp}}}})[1].tokens, want);
  // Other prompts recycle every block, overwriting the cached prefix...
  for (int i = 0; i < 6; ++i) {
    RunAll(**g, {{0, {{RequestId(10 + i), RandomPrompt(40, 100 + i), sp}}}});
  }
  // ...and `a` still comes out right, from whatever survived.
  EXPECT_EQ(RunAll(**g, {{0, {{RequestId(2), a, sp}}}})[2].tokens, want);
  // Two identical prompts in flight at once share nothing unsafe.
  std::map<int, std::vector<GenerationRequest>> both = {{0, {{RequestId(3), a, sp}, {RequestId(4), a, sp}}}};
  auto out = RunAll(**g, both);
  EXPECT_EQ(out[3].tokens, want);
  EXPECT_EQ(out[4].tokens, want);
  EXPECT_EQ((*g)->block_pool().num_free(), 8);
}

TEST(GeneratorTest, BadRequestsAreRefused) {
  auto model = Tiny();
  auto runner = MakeRunner(model, 8);
  auto g = Generator::Create(runner.get(), {});
  ASSERT_TRUE(g.ok());
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  SamplingParams sp;
  EXPECT_EQ((*g)->Add({RequestId(1), {}, sp}).code(), kInvalid);
  EXPECT_EQ((*g)->Add({RequestId(1), {1, 258}, sp}).code(), kInvalid);
  EXPECT_EQ((*g)->Add({RequestId(1), {1, -1}, sp}).code(), kInvalid);
  SamplingParams zero = sp;
  zero.max_tokens = 0;
  EXPECT_EQ((*g)->Add({RequestId(1), {1}, zero}).code(), kInvalid);
  SamplingParams huge = sp;
  huge.max_tokens = 5000;
  EXPECT_EQ((*g)->Add({RequestId(1), {1}, huge}).code(), kInvalid);
  SamplingParams big = sp;
  big.max_tokens = 200;  // Fits the context but never the 8-block pool.
  EXPECT_EQ((*g)->Add({RequestId(1), {1}, big}).code(), absl::StatusCode::kResourceExhausted);
  SamplingParams neg = sp;
  neg.temperature = -1.0f;
  EXPECT_EQ((*g)->Add({RequestId(1), {1}, neg}).code(), kInvalid);
  ASSERT_TRUE((*g)->Add({RequestId(1), {1}, sp}).ok());
  EXPECT_EQ((*g)->Add({RequestId(1), {2}, sp}).code(), kInvalid);  // Duplicate id.
  EXPECT_EQ(Generator::Create(runner.get(), {.max_batch_tokens = 4, .max_running = 8}).status().code(),
            kInvalid);
}

}  // namespace
}  // namespace pdserve
