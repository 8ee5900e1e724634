// KV-aware routing end to end below the orchestrator: a WorkerRegistry with
// the kv_aware policy over real in-process workers (one prefill, two
// decode), driven the way the orchestrator is to drive it: Route(), then
// Reserve with the decision's block hashes, Prefill into the landing,
// Decode. A repeated long prompt goes to the decode worker that holds its
// prefix, moves only the blocks it lacks, and its output equals the
// colocated one.
#include <memory>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "decode_worker/decode_server.h"
#include "engine/generator.h"
#include "engine/kv_cache.h"
#include "engine/model.h"
#include "engine/model_runner.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "prefill_worker/prefill_server.h"
#include "proto/convert.h"
#include "router/worker_registry.h"
#include "tests/engine/test_util.h"

namespace pdserve {
namespace {

namespace wire = ::pdserve::internal::v1;
using testing_util::RandomPrompt;

std::vector<int32_t> Colocated(const GenerationRequest& r) {
  auto model = Model::Load("builtin:tiny");
  EXPECT_TRUE(model.ok());
  auto runner = CreateModelRunner(*model, {.num_kv_blocks = 64, .block_size = 16, .num_threads = 1});
  EXPECT_TRUE(runner.ok());
  return testing_util::GeneratedTokens(**runner, r, {.max_batch_tokens = 64});
}

class KvRoutingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    wire::ClusterConfig config;
    config.set_model("builtin:tiny");
    PrefillServerOptions po;
    po.worker.engine.kv_cache_bytes = size_t{4} << 20;
    po.worker.engine.num_threads = 1;
    po.worker.engine.max_batch_tokens = 64;
    auto p = PrefillServer::Start(po);
    ASSERT_TRUE(p.ok()) << p.status();
    prefill_ = *std::move(p);
    wire::WorkerConfig* pw = config.add_prefill_workers();
    pw->set_id("prefill-0");
    pw->set_address(absl::StrCat("127.0.0.1:", prefill_->port()));
    prefill_->worker().set_worker_id("prefill-0");
    for (int i = 0; i < 2; ++i) {
      DecodeServerOptions o;
      o.worker.engine.kv_cache_bytes = size_t{4} << 20;
      o.worker.engine.num_threads = 1;
      o.worker.engine.max_batch_tokens = 64;
      o.worker.worker_id = absl::StrCat("decode-", i);
      auto d = DecodeServer::Start(o);
      ASSERT_TRUE(d.ok()) << d.status();
      wire::WorkerConfig* dw = config.add_decode_workers();
      dw->set_id(o.worker.worker_id);
      dw->set_address(absl::StrCat("127.0.0.1:", (*d)->port()));
      decode_.push_back(*std::move(d));
    }
    // Disaggregated whatever the cache holds, to see the transfer shrink.
    config.mutable_routing()->set_local_prefill_max_tokens(0);
    auto model = Model::Load("builtin:tiny");
    ASSERT_TRUE(model.ok());
    const ModelConfig& c = (*model)->config();
    auto registry = WorkerRegistry::Create(
        config,
        {.model = "builtin:tiny", .num_layers = c.num_layers,
         .num_kv_heads = c.num_kv_heads, .head_dim = c.head_dim},
        {.poll_interval = absl::Milliseconds(20)});
    ASSERT_TRUE(registry.ok()) << registry.status();
    registry_ = *std::move(registry);
    const absl::Time deadline = absl::Now() + absl::Seconds(10);
    while ((registry_->healthy_decode() < 2 || registry_->healthy_prefill() < 1) &&
           absl::Now() < deadline) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    ASSERT_EQ(registry_->healthy_decode(), 2);
    ASSERT_EQ(registry_->healthy_prefill(), 1);
  }

  struct Run {
    std::vector<int32_t> tokens;
    uint32_t landing_cached_tokens = 0;
    uint64_t kv_bytes = 0;
  };

  // What the orchestrator does with a decision.
  Run Execute(const RouteDecision& d, const GenerationRequest& r) {
    Run run;
    wire::DecodeRequest decode;
    ToWire(r, decode.mutable_request());
    EXPECT_NE(d.decode, nullptr);
    if (d.decode == nullptr) return run;
    if (d.prefill != nullptr) {
      wire::ReserveRequest reserve;
      reserve.set_request_id(r.id.value);
      reserve.set_num_tokens(r.prompt.size() + r.sampling.max_tokens);
      reserve.set_prompt_tokens(r.prompt.size());
      reserve.mutable_prompt_block_hashes()->Add(d.prompt_block_hashes.begin(),
                                                 d.prompt_block_hashes.end());
      wire::Landing landing;
      grpc::ClientContext rc;
      grpc::Status s = d.decode->decode->Reserve(&rc, reserve, &landing);
      EXPECT_TRUE(s.ok()) << s.error_message();
      run.landing_cached_tokens = landing.cached_tokens();
      wire::PrefillRequest prefill;
      *prefill.mutable_request() = decode.request();
      *prefill.mutable_landing() = landing;
      wire::PrefillResponse response;
      grpc::ClientContext pc;
      s = d.prefill->prefill->Prefill(&pc, prefill, &response);
      EXPECT_TRUE(s.ok()) << s.error_message();
      run.kv_bytes = response.kv_bytes();
      run.tokens.push_back(response.first_token().token_id());
      *decode.mutable_first_token() = response.first_token();
    }
    grpc::ClientContext dc;
    dc.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    auto reader = d.decode->decode->Decode(&dc, decode);
    wire::DecodeResponse msg;
    while (reader->Read(&msg)) {
      for (const auto& t : msg.tokens()) run.tokens.push_back(t.token_id());
    }
    const grpc::Status s = reader->Finish();
    EXPECT_TRUE(s.ok()) << s.error_message();
    return run;
  }

  std::unique_ptr<PrefillServer> prefill_;
  std::vector<std::unique_ptr<DecodeServer>> decode_;
  std::unique_ptr<WorkerRegistry> registry_;
};

TEST_F(KvRoutingTest, RepeatedLongPromptGoesToTheWorkerHoldingItsPrefix) {
  EXPECT_EQ(registry_->routing_policy().name(), "kv_aware");
  const std::vector<int32_t> prompt = RandomPrompt(300, 5);
  const SamplingParams sp{.temperature = 0.0f, .max_tokens = 10, .ignore_eos = true};
  const GenerationRequest first{RequestId(1), prompt, sp};
  const RouteDecision d1 = registry_->Route({.prompt = prompt, .max_tokens = 10});
  ASSERT_NE(d1.prefill, nullptr);
  EXPECT_EQ(d1.decode_cached_tokens, 0);
  ASSERT_EQ(d1.prompt_block_hashes, PromptBlockHashes(prompt, 16));
  const Run r1 = Execute(d1, first);
  EXPECT_EQ(r1.tokens, Colocated(first));
  EXPECT_EQ(r1.landing_cached_tokens, 0u);
  // Once the decode worker's report is in, the index has the prefix.
  const absl::Time deadline = absl::Now() + absl::Seconds(5);
  auto held = [&](const WorkerEndpoint* w) {
    return registry_->kv_index().LeadingBlocks(w->id, d1.prompt_block_hashes, 16);
  };
  while ((held(d1.decode) < 18 || held(d1.prefill) < 18) && absl::Now() < deadline) {
    absl::SleepFor(absl::Milliseconds(10));
  }
  // Every time after, the same decode worker, sharing 18 blocks.
  for (uint64_t id : {2, 3, 4}) {
    const GenerationRequest again{RequestId(id), prompt,
                                  {.temperature = 0.7f, .seed = id, .max_tokens = 10,
                                   .ignore_eos = true}};
    const RouteDecision d = registry_->Route({.prompt = prompt, .max_tokens = 10});
    EXPECT_EQ(d.decode, d1.decode) << id;
    EXPECT_EQ(d.decode_cached_tokens, 288);
    EXPECT_EQ(d.prefill_cached_tokens, 288);  // The prefill worker's cache too.
    const Run r = Execute(d, again);
    EXPECT_EQ(r.tokens, Colocated(again)) << id;
    EXPECT_EQ(r.landing_cached_tokens, 288u);
    EXPECT_EQ(r.kv_bytes * 300, r1.kv_bytes * 12) << id;
  }
}

}  // namespace
}  // namespace pdserve
