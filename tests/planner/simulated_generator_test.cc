// The simulator's Generator against the real one (builtin:tiny on the cpu
// backend): the same random script of requests (shared prefixes, a pool
// small enough that requests wait for blocks and freed prefixes get
// evicted, hold_kv requests released later, reservations continued by
// AddPrefilled) must give, step by step, the same batch (which sequences,
// which positions: what the KV observer reports), the same tokens sampled
// and finished, and the same pool (free blocks, prefix hashes held).
#include "planner/sim/simulated_generator.h"

#include <algorithm>
#include <map>
#include <random>
#include <tuple>
#include <vector>

#include "engine/builtin_tiny.h"
#include "engine/generator.h"
#include "engine/kv_cache.h"
#include "gtest/gtest.h"

namespace pdserve::planner {
namespace {

constexpr int kBlocks = 32;
constexpr int kBlockSize = 16;
constexpr int kMaxBatchTokens = 32;
constexpr int kMaxRunning = 4;

using Batch = std::vector<std::tuple<int64_t, int32_t, int32_t>>;  // id, begin, end
using Events = std::vector<std::tuple<int64_t, bool>>;             // id, last

std::vector<uint64_t> SortedHashes(const KvBlockPool& pool) {
  std::vector<uint64_t> h = pool.HeldHashes();
  std::sort(h.begin(), h.end());
  return h;
}

class GeneratorConformance : public testing::TestWithParam<uint32_t> {};

TEST_P(GeneratorConformance, SameStepsAsTheRealGenerator) {
  absl::StatusOr<std::shared_ptr<const Model>> model = MakeTinyModel();
  ASSERT_TRUE(model.ok()) << model.status();
  absl::StatusOr<std::unique_ptr<ModelRunner>> runner = CreateModelRunner(
      *model, {.num_kv_blocks = kBlocks, .block_size = kBlockSize, .num_threads = 1});
  ASSERT_TRUE(runner.ok()) << runner.status();
  absl::StatusOr<std::unique_ptr<Generator>> real = Generator::Create(
      runner->get(), {.max_batch_tokens = kMaxBatchTokens, .max_running = kMaxRunning});
  ASSERT_TRUE(real.ok()) << real.status();
  SimulatedGenerator sim(kBlocks, kBlockSize, kMaxBatchTokens, kMaxRunning);

  Batch real_batch;
  (*real)->set_kv_layer_observer([&](int32_t layer, std::span<const ComputedKv> computed) {
    if (layer != 0) return;
    for (const ComputedKv& c : computed) real_batch.emplace_back(c.id.value, c.begin, c.end);
  });

  std::mt19937 rng(GetParam());
  // Three prompt families: prompts share a leading part of one of them.
  std::vector<std::vector<int32_t>> families(3);
  for (auto& f : families) {
    for (int i = 0; i < 96; ++i) f.push_back(static_cast<int32_t>(rng() % 256));
  }
  std::map<int64_t, std::vector<uint64_t>> hashes;  // Kept while in use.
  std::map<int64_t, bool> hold_kv;
  std::map<int, std::vector<int64_t>> release_at;  // Step -> hold_kv ids to release.
  // KV blocks of the whole budget of every request not finished. A
  // reservation is made only when they all fit the pool with it, as the
  // router's ledger would: a continued request waiting behind a local one
  // that waits for its blocks would otherwise hold them forever (in the
  // real Generator too). Local requests come regardless.
  std::map<int64_t, int64_t> live_blocks;
  auto live = [&] {
    int64_t n = 0;
    for (const auto& [id, blocks] : live_blocks) n += blocks;
    return n;
  };
  int64_t next_id = 1;
  int steps_with_work = 0, waits_for_blocks = 0, continued = 0;

  int last_release = 0;
  for (int step = 0; step < 300 || (*real)->HasWork() || step <= last_release; ++step) {
    ASSERT_LT(step, 5000) << "the script does not drain";
    for (int64_t id : release_at[step]) {
      (*real)->ReleaseKv(RequestId(id));
      sim.ReleaseKv(id);
      live_blocks.erase(id);
    }
    // New requests for the first 300 steps.
    const int arrivals = step < 300 ? static_cast<int>(rng() % 4 == 0) + (rng() % 9 == 0) : 0;
    for (int a = 0; a < arrivals; ++a) {
      const int64_t id = next_id++;
      const std::vector<int32_t>& family = families[rng() % families.size()];
      const int shared = static_cast<int>(rng() % 80);
      const int tail = 1 + static_cast<int>(rng() % 40);
      std::vector<int32_t> prompt(family.begin(), family.begin() + shared);
      for (int i = 0; i < tail; ++i) prompt.push_back(static_cast<int32_t>(rng() % 256));
      const int kind = static_cast<int>(rng() % 6);  // 0: hold_kv, 1, 2: reserve, else Add.
      const int32_t max_tokens = kind == 0 ? 1 : 2 + static_cast<int32_t>(rng() % 24);
      const int32_t budget = static_cast<int32_t>(prompt.size()) + max_tokens;
      hashes[id] = PromptBlockHashes(prompt, kBlockSize);
      hold_kv[id] = kind == 0;
      GenerationRequest r{
          .id = RequestId(static_cast<uint64_t>(id)),
          .prompt = prompt,
          .sampling = {.temperature = 0.0f, .max_tokens = max_tokens, .ignore_eos = true},
          .hold_kv = kind == 0};
      const SimRequest s{.id = id,
                         .prompt_tokens = static_cast<int32_t>(prompt.size()),
                         .max_tokens = max_tokens,
                         .hold_kv = kind == 0,
                         .block_hashes = hashes[id]};
      const int64_t blocks = sim.BlocksForTokens(budget);
      if (kind == 1 || kind == 2) {
        if (live() + blocks > kBlocks) continue;
        absl::StatusOr<KvReservation> got =
            (*real)->Reserve(r.id, budget, static_cast<int32_t>(prompt.size()), hashes[id]);
        absl::StatusOr<int32_t> cached =
            sim.Reserve(id, budget, static_cast<int32_t>(prompt.size()), hashes[id]);
        ASSERT_EQ(got.ok(), cached.ok()) << "step " << step << " request " << id;
        if (!got.ok()) continue;  // No room now.
        EXPECT_EQ(got->cached_tokens, *cached);
        ASSERT_TRUE((*real)->AddPrefilled(std::move(r), /*first_token=*/1).ok());
        ASSERT_TRUE(sim.AddPrefilled(s).ok());
        ++continued;
      } else {
        ASSERT_TRUE((*real)->Add(std::move(r)).ok());
        sim.Add(s);
      }
      live_blocks[id] = blocks;
    }
    ASSERT_EQ((*real)->num_pending_prompt_tokens(), sim.num_pending_prompt_tokens());

    real_batch.clear();
    std::vector<GenerationEvent> real_events;
    ASSERT_TRUE((*real)->Step(real_events).ok());
    StepShape shape;
    const bool ran = sim.BeginStep(shape);
    Batch sim_batch;
    for (const StepEntry& e : sim.batch()) {
      sim_batch.emplace_back(e.id, e.reported_from, e.start + e.tokens);
    }
    std::vector<SimEvent> sim_events;
    if (ran) sim.EndStep(sim_events);
    ASSERT_EQ(sim_batch, real_batch) << "step " << step;
    ASSERT_EQ(static_cast<int64_t>(sim_batch.size()), shape.sequences);

    Events want, got;
    for (const GenerationEvent& e : real_events) {
      ASSERT_TRUE(e.has_token);
      const int64_t id = static_cast<int64_t>(e.id.value);
      want.emplace_back(id, e.finish != FinishReason::kNone || hold_kv[id]);
      if (e.finish != FinishReason::kNone && !hold_kv[id]) live_blocks.erase(id);
      if (hold_kv[id]) {
        const int at = step + 1 + static_cast<int>(rng() % 4);
        release_at[at].push_back(id);
        last_release = std::max(last_release, at);
      }
    }
    for (const SimEvent& e : sim_events) got.emplace_back(e.id, e.finished);
    ASSERT_EQ(got, want) << "step " << step;

    ASSERT_EQ((*real)->block_pool().num_free(), sim.pool().num_free()) << "step " << step;
    ASSERT_EQ(SortedHashes((*real)->block_pool()), SortedHashes(sim.pool())) << "step " << step;
    ASSERT_EQ((*real)->num_running(), sim.num_running());
    ASSERT_EQ((*real)->num_waiting(), sim.num_waiting());
    steps_with_work += ran;
    waits_for_blocks += sim.num_waiting() > 0 && sim.num_running() < kMaxRunning;
  }
  EXPECT_FALSE(sim.HasWork());
  EXPECT_EQ(sim.pool().num_free(), kBlocks);
  // The script exercised what it is for.
  EXPECT_GT(steps_with_work, 200);
  EXPECT_GT(waits_for_blocks, 10);
  EXPECT_GT(continued, 10);
  EXPECT_GT((*real)->prefix_cached_tokens(), 0);
}

INSTANTIATE_TEST_SUITE_P(Seeds, GeneratorConformance, testing::Values(1u, 2u, 3u, 4u));

}  // namespace
}  // namespace pdserve::planner
