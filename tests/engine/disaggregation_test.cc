// Invariant (b) of DESIGN.md inside one process: a request prefilled by one
// Generator (hold_kv, KV shipped layer by layer through the observer) and
// decoded by another (Reserve + AddPrefilled) produces exactly the tokens a
// single colocated Generator produces, greedy and seeded, for prompts longer
// than a prefill chunk and with prefix-cache hits on the prefill side.
#include <algorithm>
#include <cstring>
#include <map>
#include <random>

#include "engine/builtin_tiny.h"
#include "engine/generator.h"
#include "gtest/gtest.h"
#include "tests/engine/test_util.h"

namespace pdserve {
namespace {

using testing_util::RandomPrompt;

std::unique_ptr<ModelRunner> MakeRunner(const std::shared_ptr<const Model>& m, int blocks) {
  auto r = CreateModelRunner(m, {.num_kv_blocks = blocks, .block_size = 16, .num_threads = 2});
  EXPECT_TRUE(r.ok()) << r.status();
  return *std::move(r);
}

// A host pool needs no staging: a worker registers the pool itself, and the
// copies a device pool would need only check their ranges.
TEST(KvHostStagingTest, HostPoolIsItsOwnStaging) {
  auto model = MakeTinyModel();
  ASSERT_TRUE(model.ok());
  std::unique_ptr<ModelRunner> runner = MakeRunner(*model, 4);
  auto staging = runner->KvHostStaging();
  ASSERT_TRUE(staging.ok()) << staging.status();
  EXPECT_EQ(staging->data(), runner->kv_memory().data());
  EXPECT_EQ(staging->size(), runner->kv_memory().size());
  const size_t pool = runner->kv_memory().size();
  const std::vector<KvByteRange> inside = {{0, pool}, {pool, 0}};
  EXPECT_TRUE(runner->CopyKvToHostStaging(inside).ok());
  EXPECT_TRUE(runner->CopyKvFromHostStaging(inside).ok());
  const std::vector<KvByteRange> outside = {{pool - 1, 2}};
  EXPECT_EQ(runner->CopyKvToHostStaging(outside).code(), absl::StatusCode::kInvalidArgument);
  const std::vector<KvByteRange> wraps = {{8, SIZE_MAX}};
  EXPECT_EQ(runner->CopyKvFromHostStaging(wraps).code(), absl::StatusCode::kInvalidArgument);
}

std::vector<int32_t> Colocated(ModelRunner& runner, const GenerationRequest& r) {
  return testing_util::GeneratedTokens(runner, r, {.max_batch_tokens = 64});
}

class DisaggregationTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto m = MakeTinyModel();
    ASSERT_TRUE(m.ok());
    model_ = *m;
    prefill_runner_ = MakeRunner(model_, 64);
    decode_runner_ = MakeRunner(model_, 48);
    auto p = Generator::Create(prefill_runner_.get(), {.max_batch_tokens = 64});
    auto d = Generator::Create(decode_runner_.get(), {.max_batch_tokens = 64});
    ASSERT_TRUE(p.ok() && d.ok());
    prefill_ = *std::move(p);
    decode_ = *std::move(d);
    prefill_->set_kv_layer_observer([this](int32_t layer, std::span<const ComputedKv> computed) {
      const KvBlockLayout& layout = prefill_runner_->kv_layout();
      for (const ComputedKv& c : computed) {
        layers_seen_[c.id.value].push_back(layer);
        const std::vector<BlockId>& dst = landing_.at(c.id.value);
        // Positions the decode side shares from its prefix cache are not
        // written (other sequences read those blocks).
        const int32_t begin = std::max(c.begin, cached_[c.id.value]);
        if (c.end <= begin) continue;
        ForEachKvRange(layout, layer, c.block_table.data(), prefill_runner_->num_kv_blocks(),
                       dst.data(), decode_runner_->num_kv_blocks(), begin, c.end,
                       [&](size_t src, size_t to, size_t n) {
                         std::memcpy(decode_runner_->kv_memory().data() + to,
                                     prefill_runner_->kv_memory().data() + src, n);
                       });
      }
    });
  }

  // Prefill on one generator, decode on the other.
  // With `share`, the decode side shares the prompt's prefix it caches.
  std::vector<int32_t> Disaggregated(GenerationRequest r, bool share = false) {
    const int32_t prompt_len = static_cast<int32_t>(r.prompt.size());
    const int32_t total = prompt_len + r.sampling.max_tokens;
    auto landing = decode_->Reserve(r.id, total, share ? prompt_len : 0,
                                    PromptBlockHashes(r.prompt, 16));
    EXPECT_TRUE(landing.ok()) << landing.status();
    landing_[r.id.value].assign(landing->blocks.begin(), landing->blocks.end());
    cached_[r.id.value] = landing->cached_tokens;
    GenerationRequest prefill = r;
    prefill.hold_kv = true;
    EXPECT_TRUE(prefill_->Add(prefill).ok());
    std::vector<int32_t> out;
    std::vector<GenerationEvent> events;
    while (prefill_->HasWork()) {
      events.clear();
      EXPECT_TRUE(prefill_->Step(events).ok());
      for (const auto& e : events) {
        out.push_back(e.token.token);
        EXPECT_EQ(e.finish, FinishReason::kNone);
      }
    }
    prefill_->ReleaseKv(r.id);
    EXPECT_EQ(prefill_->block_pool().num_free(), prefill_->block_pool().num_blocks());
    EXPECT_EQ(out.size(), 1u);
    EXPECT_TRUE(decode_->AddPrefilled(r, out[0]).ok());
    while (decode_->HasWork()) {
      events.clear();
      EXPECT_TRUE(decode_->Step(events).ok());
      for (const auto& e : events) out.push_back(e.token.token);
    }
    return out;
  }

  std::shared_ptr<const Model> model_;
  std::unique_ptr<ModelRunner> prefill_runner_, decode_runner_;
  std::unique_ptr<Generator> prefill_, decode_;
  std::map<uint64_t, std::vector<BlockId>> landing_;
  std::map<uint64_t, int32_t> cached_;
  std::map<uint64_t, std::vector<int32_t>> layers_seen_;
};

TEST_F(DisaggregationTest, OutputEqualsColocatedGreedyAndSeeded) {
  auto reference_runner = MakeRunner(model_, 64);
  uint64_t id = 1;
  for (int len : {1, 15, 16, 17, 100, 200}) {
    for (const SamplingParams& sp :
         {SamplingParams{.temperature = 0.0f, .max_tokens = 20, .ignore_eos = true},
          SamplingParams{.temperature = 0.9f, .top_p = 0.9f, .seed = 5, .max_tokens = 20,
                         .ignore_eos = true}}) {
      GenerationRequest r{RequestId(id++), RandomPrompt(len, len), sp};
      const std::vector<int32_t> want = Colocated(*reference_runner, r);
      EXPECT_EQ(Disaggregated(r), want) << "prompt length " << len;
    }
  }
  // The first 200-token prompt, in 64-token chunks, reports every layer 4
  // times; the second one (same prompt) finds 192 tokens in the prefix cache
  // and computes its last 8 in one chunk.
  const size_t layers = model_->config().num_layers;
  EXPECT_EQ(layers_seen_[id - 2].size(), 4 * layers);
  EXPECT_EQ(layers_seen_[id - 1].size(), layers);
  EXPECT_EQ(decode_->block_pool().num_free(), decode_->block_pool().num_blocks());
}

// Invariant (b) with logit processing: the penalties see the prompt and the
// first token on the decode side exactly as one generator does.
TEST_F(DisaggregationTest, PenalizedOutputEqualsColocatedGreedyAndSeeded) {
  auto reference_runner = MakeRunner(model_, 64);
  uint64_t id = 100;
  const SamplingParams penalized{.temperature = 0.0f,
                                 .max_tokens = 24,
                                 .ignore_eos = true,
                                 .presence_penalty = 0.7f,
                                 .frequency_penalty = 0.4f,
                                 .repetition_penalty = 1.3f,
                                 .logit_bias = {{7, 2.0f}, {65, -5.0f}, {200, 1.5f}}};
  SamplingParams seeded = penalized;
  seeded.temperature = 0.8f;
  seeded.top_k = 50;
  seeded.seed = 17;
  SamplingParams unpenalized = penalized;
  unpenalized.presence_penalty = unpenalized.frequency_penalty = 0.0f;
  unpenalized.repetition_penalty = 1.0f;
  unpenalized.logit_bias.clear();
  for (int len : {1, 17, 100}) {
    const std::vector<int32_t> prompt = RandomPrompt(len, 40 + len);
    for (const SamplingParams& sp : {penalized, seeded}) {
      GenerationRequest r{RequestId(id++), prompt, sp};
      const std::vector<int32_t> want = Colocated(*reference_runner, r);
      EXPECT_EQ(Disaggregated(r), want) << "prompt length " << len << ", T " << sp.temperature;
    }
    // The processing changes the output (else the check above proves little).
    EXPECT_NE(Colocated(*reference_runner, {RequestId(id++), prompt, penalized}),
              Colocated(*reference_runner, {RequestId(id++), prompt, unpenalized}));
  }
}

// A request migrated after k tokens (prompt + k tokens, resumed_tokens k,
// max_tokens what is left) and prefilled remotely goes on, its first token
// from the prefill side and the rest from the decode side, with exactly the
// uninterrupted run's tokens, penalties and seeded draws included.
TEST_F(DisaggregationTest, ResumedRequestGoesOnWithTheUninterruptedTokens) {
  auto reference_runner = MakeRunner(model_, 64);
  SamplingParams seeded{.temperature = 0.9f,
                        .top_p = 0.9f,
                        .seed = 99,
                        .max_tokens = 30,
                        .ignore_eos = true,
                        .presence_penalty = 0.5f,
                        .frequency_penalty = 0.3f,
                        .repetition_penalty = 1.2f};
  SamplingParams greedy = seeded;
  greedy.temperature = 0.0f;
  uint64_t id = 300;
  for (const SamplingParams& sp : {greedy, seeded}) {
    const GenerationRequest r{RequestId(id++), RandomPrompt(40, 8), sp};
    const std::vector<int32_t> want = Colocated(*reference_runner, r);
    for (int32_t k : {1, 9, 27}) {
      GenerationRequest resumed{RequestId(id++), r.prompt, sp};
      resumed.prompt.insert(resumed.prompt.end(), want.begin(), want.begin() + k);
      resumed.resumed_tokens = k;
      resumed.sampling.max_tokens -= k;
      EXPECT_EQ(Disaggregated(resumed), std::vector<int32_t>(want.begin() + k, want.end()))
          << "T " << sp.temperature << ", cut after " << k;
    }
  }
  EXPECT_EQ(decode_->block_pool().num_free(), decode_->block_pool().num_blocks());
}

// Prompt logprobs come with the first token wherever the prompt is
// prefilled, equal on a prefill worker (chunks of 64) and colocated; asking
// for them bypasses the prefix cache, and a prompt prefilled elsewhere
// brings none to the decode side.
TEST_F(DisaggregationTest, PromptLogprobsAreEqualPrefilledHereOrThere) {
  const std::vector<int32_t> prompt = RandomPrompt(150, 77);
  auto first_event_logprobs = [&](Generator& g, const GenerationRequest& r) {
    EXPECT_TRUE(g.Add(r).ok());
    std::vector<SampledToken> got;
    std::vector<GenerationEvent> events;
    bool first = true;
    while (g.HasWork()) {
      events.clear();
      EXPECT_TRUE(g.Step(events).ok());
      for (GenerationEvent& e : events) {
        if (!first) EXPECT_TRUE(e.prompt_logprobs.empty());
        if (first) got = std::move(e.prompt_logprobs);
        first = false;
      }
    }
    return got;
  };
  SamplingParams sp{.temperature = 0.0f, .max_tokens = 3, .ignore_eos = true, .prompt_logprobs = 2};
  // The observer ships the KV somewhere on the decode side; unused here.
  for (uint64_t id : {1, 2}) {
    for (int b = 0; b < 10; ++b) landing_[id].push_back(BlockId(b));
  }
  // Warm the prefill side's prefix cache with the same prompt.
  first_event_logprobs(*prefill_, {RequestId(1), prompt, {.temperature = 0.0f, .max_tokens = 1}});
  const int64_t cached = prefill_->prefix_cached_tokens();
  GenerationRequest held{RequestId(2), prompt, sp};
  held.hold_kv = true;
  const std::vector<SampledToken> there = first_event_logprobs(*prefill_, held);
  prefill_->ReleaseKv(RequestId(2));
  EXPECT_EQ(prefill_->prefix_cached_tokens(), cached) << "prompt_logprobs must not use the cache";
  auto colocated_runner = MakeRunner(model_, 16);
  auto colocated = Generator::Create(colocated_runner.get(), {.max_batch_tokens = 40, .max_running = 4});
  ASSERT_TRUE(colocated.ok());
  const std::vector<SampledToken> here = first_event_logprobs(**colocated, {RequestId(3), prompt, sp});
  ASSERT_EQ(there.size(), prompt.size() - 1);
  ASSERT_EQ(here.size(), prompt.size() - 1);
  for (size_t i = 0; i < here.size(); ++i) {
    EXPECT_EQ(here[i].token, prompt[i + 1]);
    EXPECT_EQ(there[i].token, prompt[i + 1]);
    EXPECT_FLOAT_EQ(here[i].logprob, there[i].logprob) << "position " << i + 1;
    ASSERT_EQ(here[i].top_logprobs.size(), 2u);
    ASSERT_EQ(there[i].top_logprobs.size(), 2u);
    EXPECT_EQ(here[i].top_logprobs[0].token, there[i].top_logprobs[0].token);
    EXPECT_LE(here[i].logprob, here[i].top_logprobs[0].logprob);
  }
}

TEST_F(DisaggregationTest, PrefixCacheHitsOnThePrefillSideAreShippedToo) {
  auto reference_runner = MakeRunner(model_, 64);
  const SamplingParams sp{.temperature = 0.0f, .max_tokens = 10, .ignore_eos = true};
  std::vector<int32_t> prompt = RandomPrompt(70, 3);
  ASSERT_EQ(Disaggregated({RequestId(1), prompt, sp}),
            Colocated(*reference_runner, {RequestId(1), prompt, sp}));
  prompt.push_back(42);  // Same 64-token prefix: four blocks come from the cache.
  const int64_t cached_before = prefill_->prefix_cached_tokens();
  EXPECT_EQ(Disaggregated({RequestId(2), prompt, sp}),
            Colocated(*reference_runner, {RequestId(2), prompt, sp}));
  EXPECT_EQ(prefill_->prefix_cached_tokens() - cached_before, 64);
}

// The decode side shares the prefix blocks its cache holds from an earlier
// request; only the rest is written, and the output stays the colocated one.
TEST_F(DisaggregationTest, DecodeSideSharesItsCachedPrefix) {
  auto reference_runner = MakeRunner(model_, 64);
  const std::vector<int32_t> prompt = RandomPrompt(100, 9);
  const SamplingParams sp{.temperature = 0.0f, .max_tokens = 12, .ignore_eos = true};
  EXPECT_EQ(Disaggregated({RequestId(1), prompt, sp}, true),
            Colocated(*reference_runner, {RequestId(1), prompt, sp}));
  EXPECT_EQ(cached_[1], 0);
  const int64_t cached_before = decode_->prefix_cached_tokens();
  const SamplingParams seeded{.temperature = 0.8f, .seed = 3, .max_tokens = 12, .ignore_eos = true};
  EXPECT_EQ(Disaggregated({RequestId(2), prompt, seeded}, true),
            Colocated(*reference_runner, {RequestId(2), prompt, seeded}));
  EXPECT_EQ(cached_[2], 96);  // Six full blocks; the seventh holds the last token.
  EXPECT_EQ(decode_->prefix_cached_tokens() - cached_before, 96);
  // A 96-token prompt would share its own last token's block: five only.
  std::vector<int32_t> shorter(prompt.begin(), prompt.begin() + 96);
  EXPECT_EQ(Disaggregated({RequestId(3), shorter, sp}, true),
            Colocated(*reference_runner, {RequestId(3), shorter, sp}));
  EXPECT_EQ(cached_[3], 80);
  // Shared blocks of another prompt are refused and given back.
  auto reserved = decode_->Reserve(RequestId(4), 112, 100, PromptBlockHashes(prompt, 16));
  ASSERT_TRUE(reserved.ok());
  ASSERT_EQ(reserved->cached_tokens, 96);
  std::vector<int32_t> other = prompt;
  other[50] = (other[50] + 1) % 256;
  EXPECT_EQ(decode_->AddPrefilled({RequestId(4), other, sp}, 5).code(),
            absl::StatusCode::kInvalidArgument);
  decode_->ReleaseReservation(RequestId(4));
  EXPECT_EQ(decode_->block_pool().num_free(), decode_->block_pool().num_blocks());
}

TEST_F(DisaggregationTest, ReservationsAreCheckedAndFreed) {
  const SamplingParams sp{.temperature = 0.0f, .max_tokens = 8};
  const std::vector<int32_t> prompt = RandomPrompt(20, 1);
  EXPECT_EQ(decode_->AddPrefilled({RequestId(1), prompt, sp}, 5).code(),
            absl::StatusCode::kNotFound);
  ASSERT_TRUE(decode_->Reserve(RequestId(1), 10).ok());
  EXPECT_EQ(decode_->Reserve(RequestId(1), 10).status().code(),
            absl::StatusCode::kInvalidArgument);
  // 20 + 8 tokens need two blocks; one was reserved.
  EXPECT_EQ(decode_->AddPrefilled({RequestId(1), prompt, sp}, 5).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(decode_->Reserve(RequestId(2), 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(decode_->Reserve(RequestId(3), 49 * 16).status().code(),
            absl::StatusCode::kResourceExhausted);
  decode_->ReleaseReservation(RequestId(1));
  decode_->ReleaseReservation(RequestId(99));
  EXPECT_EQ(decode_->block_pool().num_free(), decode_->block_pool().num_blocks());
}

TEST_F(DisaggregationTest, CancelledHoldKvRequestKeepsItsBlocksUntilReleased) {
  landing_[7] = {};
  const SamplingParams sp{.temperature = 0.0f, .max_tokens = 8};
  ASSERT_TRUE(prefill_->Add({RequestId(7), RandomPrompt(100, 2), sp, /*hold_kv=*/true}).ok());
  std::vector<GenerationEvent> events;
  prefill_->set_kv_layer_observer(nullptr);
  ASSERT_TRUE(prefill_->Step(events).ok());  // First 64-token chunk.
  prefill_->Cancel(RequestId(7));
  EXPECT_LT(prefill_->block_pool().num_free(), prefill_->block_pool().num_blocks());
  prefill_->ReleaseKv(RequestId(7));
  EXPECT_EQ(prefill_->block_pool().num_free(), prefill_->block_pool().num_blocks());
}

// A prefilled request waits for a batch slot holding its reserved blocks;
// cancelling it there gives them back.
TEST(GeneratorPrefilledTest, CancelWhileWaitingForASlotFreesItsBlocks) {
  auto m = MakeTinyModel();
  ASSERT_TRUE(m.ok());
  std::unique_ptr<ModelRunner> runner = MakeRunner(*m, 48);
  auto g = Generator::Create(runner.get(), {.max_batch_tokens = 64, .max_running = 1});
  ASSERT_TRUE(g.ok());
  const SamplingParams sp{.temperature = 0.0f, .max_tokens = 8};
  ASSERT_TRUE((*g)->Add({RequestId(1), RandomPrompt(8, 1), sp}).ok());
  std::vector<GenerationEvent> events;
  ASSERT_TRUE((*g)->Step(events).ok());  // Request 1 takes the only slot.
  const int32_t free_before = (*g)->block_pool().num_free();
  ASSERT_TRUE((*g)->Reserve(RequestId(2), 16).ok());
  ASSERT_TRUE((*g)->AddPrefilled({RequestId(2), RandomPrompt(8, 2), sp}, 7).ok());
  ASSERT_TRUE((*g)->Step(events).ok());  // Still waiting: no slot.
  EXPECT_LT((*g)->block_pool().num_free(), free_before);
  (*g)->Cancel(RequestId(2));
  EXPECT_EQ((*g)->block_pool().num_free(), free_before);
  (*g)->Cancel(RequestId(1));
  EXPECT_EQ((*g)->block_pool().num_free(), (*g)->block_pool().num_blocks());
}

}  // namespace
}  // namespace pdserve
