// 1P1D in one process over each KV transport: the PrefillWorker service
// (gRPC on loopback) pushes every layer's KV through the transport under
// test into a test-owned decode pool, and the request continued there
// gives exactly the colocated tokens (greedy and seeded, prompts longer
// than a prefill chunk, several requests at once). The multi-process
// cluster runs the same workers with --kv_transport=NAME.
#include <future>
#include <map>

#include "absl/strings/str_cat.h"
#include "engine/builtin_tiny.h"
#include "engine/generator.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "kv_transfer/transport.h"
#include "prefill_worker/prefill_server.h"
#include "proto/convert.h"
#include "tests/engine/test_util.h"
#include "tests/kv_transfer/transport_names.h"

namespace pdserve {
namespace {

using ::pdserve::internal::v1::KvComplete;
using ::pdserve::internal::v1::Landing;
using ::pdserve::internal::v1::PrefillRequest;
using ::pdserve::internal::v1::PrefillResponse;
using testing_util::RandomPrompt;

class DisaggregatedTransferTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    auto m = MakeTinyModel();
    ASSERT_TRUE(m.ok()) << m.status();
    model_ = *m;
    decode_runner_ = MakeRunner(256);
    reference_runner_ = MakeRunner(64);
    auto d = Generator::Create(decode_runner_.get(), {.max_batch_tokens = 64});
    ASSERT_TRUE(d.ok());
    decode_ = *std::move(d);
    auto t = kv::CreateKvTransport(GetParam(), {});
    ASSERT_TRUE(t.ok()) << t.status();
    receiver_ = *std::move(t);
    auto region = receiver_->RegisterMemory(decode_runner_->kv_memory());
    ASSERT_TRUE(region.ok());
    region_ = *region;
    PrefillServerOptions o;
    o.worker.kv_transport = GetParam();
    o.worker.engine.kv_cache_bytes = size_t{16} << 20;
    o.worker.engine.num_threads = 1;
    o.worker.engine.max_batch_tokens = 64;
    o.worker.transfer_timeout = absl::Seconds(5);
    auto s = PrefillServer::Start(o);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
    stub_ = internal::v1::PrefillWorker::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                            grpc::InsecureChannelCredentials()));
  }

  std::unique_ptr<ModelRunner> MakeRunner(int blocks) {
    auto r = CreateModelRunner(
        model_, {.num_kv_blocks = blocks, .block_size = 16, .num_threads = 1});
    EXPECT_TRUE(r.ok()) << r.status();
    return *std::move(r);
  }

  Landing Reserve(RequestId id, int32_t total) {
    Landing landing;
    auto blocks = decode_->Reserve(id, total);
    EXPECT_TRUE(blocks.ok()) << blocks.status();
    if (!blocks.ok()) return landing;
    landing.set_decode_worker_id("test-decode");
    landing.set_transport(receiver_->capabilities().name);
    landing.set_endpoint(receiver_->endpoint());
    landing.set_region_id(region_.value);
    landing.set_pool_blocks(decode_runner_->num_kv_blocks());
    ToWire(decode_runner_->kv_layout(), landing.mutable_layout());
    for (BlockId b : *blocks) landing.add_block_ids(b.value);
    return landing;
  }

  std::vector<int32_t> Colocated(const GenerationRequest& r) {
    auto g =
        Generator::Create(reference_runner_.get(), {.max_batch_tokens = 64});
    EXPECT_TRUE(g.ok());
    EXPECT_TRUE((*g)->Add(r).ok());
    std::vector<int32_t> out;
    std::vector<GenerationEvent> events;
    while ((*g)->HasWork()) {
      events.clear();
      EXPECT_TRUE((*g)->Step(events).ok());
      for (const auto& e : events) out.push_back(e.token.token);
    }
    return out;
  }

  std::shared_ptr<const Model> model_;
  std::unique_ptr<ModelRunner> decode_runner_, reference_runner_;
  std::unique_ptr<Generator> decode_;
  std::unique_ptr<kv::KvTransport> receiver_;
  kv::RegionId region_;
  std::unique_ptr<PrefillServer> server_;
  std::unique_ptr<internal::v1::PrefillWorker::Stub> stub_;
};

TEST_P(DisaggregatedTransferTest,
       PrefilledElsewhereDecodesToTheColocatedTokens) {
  std::vector<GenerationRequest> requests;
  for (int i = 0; i < 4; ++i) {
    SamplingParams sampling{.max_tokens = 12, .ignore_eos = true};
    if (i % 2 == 1) {
      sampling.temperature = 0.9f;
      sampling.top_p = 0.9f;
      sampling.seed = 100 + i;
    } else {
      sampling.temperature = 0.0f;
    }
    requests.push_back(
        {RequestId(i + 1), RandomPrompt(40 + 57 * i, i + 3), sampling});
  }
  // All prompts at once: the worker batches them and pushes layer by layer.
  std::vector<std::future<std::pair<grpc::Status, PrefillResponse>>> calls;
  for (const GenerationRequest& r : requests) {
    PrefillRequest req;
    ToWire(r, req.mutable_request());
    *req.mutable_landing() = Reserve(
        r.id, static_cast<int32_t>(r.prompt.size()) + r.sampling.max_tokens);
    calls.push_back(std::async(std::launch::async, [this, req] {
      grpc::ClientContext ctx;
      ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
      PrefillResponse resp;
      grpc::Status s = stub_->Prefill(&ctx, req, &resp);
      return std::pair{s, resp};
    }));
  }
  std::map<uint64_t, int32_t> first_token;
  for (size_t i = 0; i < calls.size(); ++i) {
    auto [s, resp] = calls[i].get();
    ASSERT_TRUE(s.ok()) << s.error_message();
    first_token[requests[i].id.value] = resp.first_token().token_id();
  }
  // One KvComplete per request, each after all of its KV.
  std::map<uint64_t, uint32_t> complete;
  for (size_t i = 0; i < requests.size(); ++i) {
    auto note = receiver_->WaitNotification(absl::Seconds(10));
    ASSERT_TRUE(note.ok()) << note.status();
    KvComplete c;
    ASSERT_TRUE(c.ParseFromString(note->message));
    complete[c.request_id()] = c.num_tokens();
  }
  for (const GenerationRequest& r : requests) {
    EXPECT_EQ(complete[r.id.value], r.prompt.size());
    ASSERT_TRUE(decode_->AddPrefilled(r, first_token[r.id.value]).ok());
  }
  std::map<uint64_t, std::vector<int32_t>> out;
  for (const GenerationRequest& r : requests)
    out[r.id.value] = {first_token[r.id.value]};
  std::vector<GenerationEvent> events;
  while (decode_->HasWork()) {
    events.clear();
    ASSERT_TRUE(decode_->Step(events).ok());
    for (const auto& e : events) {
      if (e.has_token) out[e.id.value].push_back(e.token.token);
    }
  }
  for (const GenerationRequest& r : requests) {
    EXPECT_EQ(out[r.id.value], Colocated(r)) << "request " << r.id.value;
  }
}

// The decode pool here is the cpu backend's (host memory); "ucx" is the
// environment's mix.
INSTANTIATE_TEST_SUITE_P(Transports, DisaggregatedTransferTest,
                         ::testing::ValuesIn(kv::HostMemoryTransports({"ucx"})),
                         kv::TransportTestName);

}  // namespace
}  // namespace pdserve
