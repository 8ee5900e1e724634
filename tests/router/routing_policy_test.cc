#include "router/routing_policy.h"

#include <set>

#include "gtest/gtest.h"

namespace pdserve {
namespace {

std::unique_ptr<RoutingPolicy> Make(const std::string& name, RoutingOptions o = {}) {
  o.policy = name;
  auto p = CreateRoutingPolicy(o);
  EXPECT_TRUE(p.ok()) << p.status();
  return *std::move(p);
}

WorkerLoad Idle(std::string id, int64_t free_blocks = 1000) {
  return {.id = std::move(id), .free_blocks = free_blocks};
}

// 1000-token prompt (62 full blocks shareable), 100 new tokens.
RoutingInput Input(std::span<const WorkerLoad> decode, std::span<const WorkerLoad> prefill,
                   int32_t prompt = 1000) {
  return {.prompt_tokens = prompt, .max_tokens = 100, .block_size = 16,
          .decode = decode, .prefill = prefill};
}

TEST(RoutingPolicyTest, RegistryKnowsThePoliciesAndChecksOptions) {
  EXPECT_EQ(RoutingPolicyNames(),
            (std::vector<std::string>{"kv_aware", "least_loaded", "round_robin"}));
  EXPECT_EQ(CreateRoutingPolicy({.policy = "random"}).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(CreateRoutingPolicy({.local_prefill_max_tokens = -1}).status().code(),
            absl::StatusCode::kInvalidArgument);
  // The default is kv_aware.
  auto o = RoutingOptionsFromConfig({});
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->policy, "kv_aware");
  EXPECT_EQ(o->local_prefill_max_tokens, 64);
  internal::v1::RoutingConfig config;
  config.set_policy("round_robin");
  config.set_local_prefill_max_tokens(0);
  o = RoutingOptionsFromConfig(config);
  ASSERT_TRUE(o.ok());
  EXPECT_EQ(o->policy, "round_robin");
  EXPECT_EQ(o->local_prefill_max_tokens, 0);
  config.set_policy("nope");
  EXPECT_EQ(RoutingOptionsFromConfig(config).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(RoutingPolicyTest, RoundRobinRotatesBothRoles) {
  auto policy = Make("round_robin");
  const std::vector<WorkerLoad> d = {Idle("d0"), Idle("d1")};
  std::vector<WorkerLoad> p = {Idle("p0"), Idle("p1"), Idle("p2")};
  p[0].cached_blocks = 62;  // Ignored.
  std::vector<int> decode, prefill;
  for (int i = 0; i < 6; ++i) {
    const RoutingChoice c = policy->Choose(Input(d, p));
    decode.push_back(c.decode);
    prefill.push_back(c.prefill);
  }
  EXPECT_EQ(decode, (std::vector<int>{0, 1, 0, 1, 0, 1}));
  EXPECT_EQ(prefill, (std::vector<int>{0, 1, 2, 0, 1, 2}));
  // No prefill worker: local prefill.
  EXPECT_EQ(policy->Choose(Input(d, {})).prefill, -1);
}

TEST(RoutingPolicyTest, LeastLoadedIgnoresTheCache) {
  auto policy = Make("least_loaded");
  std::vector<WorkerLoad> d = {Idle("d0", 500), Idle("d1", 900)};
  d[0].cached_blocks = 62;
  std::vector<WorkerLoad> p = {Idle("p0"), Idle("p1")};
  p[0].pending_prompt_tokens = 2000;
  p[0].cached_blocks = 62;
  for (int i = 0; i < 4; ++i) {
    const RoutingChoice c = policy->Choose(Input(d, p));
    EXPECT_EQ(c.decode, 1);
    EXPECT_EQ(c.prefill, 1);
  }
  // Blocks reserved since the report count against a worker.
  d[1].dispatched_blocks = 500;
  EXPECT_EQ(policy->Choose(Input(d, p)).decode, 0);
  // Ties rotate.
  std::set<int> seen;
  const std::vector<WorkerLoad> same = {Idle("d0"), Idle("d1")};
  for (int i = 0; i < 4; ++i) seen.insert(policy->Choose(Input(same, p)).decode);
  EXPECT_EQ(seen.size(), 2u);
}

TEST(RoutingPolicyTest, KvAwareGoesWhereThePrefixIsUnlessThatWorkerIsMuchBusier) {
  auto policy = Make("kv_aware");
  std::vector<WorkerLoad> d = {Idle("d0"), Idle("d1")};
  std::vector<WorkerLoad> p = {Idle("p0"), Idle("p1")};
  // p1 holds 40 blocks (640 tokens) of the prompt, d1 30: both are chosen.
  p[1].cached_blocks = 40;
  d[1].cached_blocks = 30;
  RoutingChoice c = policy->Choose(Input(d, p));
  EXPECT_EQ(c.decode, 1);
  EXPECT_EQ(c.prefill, 1);
  // p1 with a long queue: computing 1000 tokens on p0 is cheaper.
  p[1].pending_prompt_tokens = 5000;
  c = policy->Choose(Input(d, p));
  EXPECT_EQ(c.prefill, 0);
  EXPECT_EQ(c.decode, 1);
  // d1 with a big batch (8 cost per request): d0 wins despite moving more.
  d[1].running = 60;
  EXPECT_EQ(policy->Choose(Input(d, p)).decode, 0);
  // d1 without room for the request: never chosen.
  d[1].running = 0;
  d[1].free_blocks = 10;
  EXPECT_EQ(policy->Choose(Input(d, p)).decode, 0);
}

TEST(RoutingPolicyTest, KvAwarePrefillsLocallyWhenLittleIsLeftToCompute) {
  auto policy = Make("kv_aware");
  std::vector<WorkerLoad> d = {Idle("d0"), Idle("d1")};
  const std::vector<WorkerLoad> p = {Idle("p0")};
  // d0 holds 59 of the prompt's blocks: 1000 - 944 = 56 tokens <= 64.
  d[0].cached_blocks = 59;
  RoutingChoice c = policy->Choose(Input(d, p));
  EXPECT_EQ(c.decode, 0);
  EXPECT_EQ(c.prefill, -1);
  // 58 blocks leave 72 tokens: disaggregated.
  d[0].cached_blocks = 58;
  c = policy->Choose(Input(d, p));
  EXPECT_EQ(c.decode, 0);
  EXPECT_EQ(c.prefill, 0);
  // A short prompt prefills locally anywhere.
  EXPECT_EQ(policy->Choose(Input(d, p, 40)).prefill, -1);
  // With the threshold at 0, even that goes to the prefill worker.
  auto strict = Make("kv_aware", {.local_prefill_max_tokens = 0});
  EXPECT_EQ(strict->Choose(Input(d, p, 40)).prefill, 0);
}

TEST(RoutingPolicyTest, KvAwarePrefillsLocallyWhenPrefillWorkersAreTheBottleneck) {
  auto policy = Make("kv_aware");
  std::vector<WorkerLoad> d = {Idle("d0")};
  std::vector<WorkerLoad> p = {Idle("p0"), Idle("p1")};
  p[0].pending_prompt_tokens = 6000;
  p[1].pending_prompt_tokens = 3000;
  p[1].dispatched_tokens = 1000;  // 4000: not above the 4096 limit.
  EXPECT_EQ(policy->Choose(Input(d, p)).prefill, 1);
  p[1].dispatched_tokens = 2000;  // Every prefill worker above the limit.
  EXPECT_EQ(policy->Choose(Input(d, p)).prefill, -1);
  // Unless the decode worker has requests waiting already.
  d[0].waiting = 1;
  EXPECT_EQ(policy->Choose(Input(d, p)).prefill, 1);
}

TEST(RoutingPolicyTest, NothingToChooseFrom) {
  for (const std::string name : {"round_robin", "least_loaded", "kv_aware"}) {
    auto policy = Make(name);
    const RoutingChoice c = policy->Choose(Input({}, {}));
    EXPECT_EQ(c.decode, -1) << name;
    // No decode worker has room: kv_aware still names the one with the most.
    const std::vector<WorkerLoad> d = {Idle("d0", 2), Idle("d1", 5)};
    const std::vector<WorkerLoad> p = {Idle("p0")};
    if (name != "round_robin") {
      EXPECT_EQ(policy->Choose(Input(d, p)).decode, 1) << name;
    }
  }
}

}  // namespace
}  // namespace pdserve
