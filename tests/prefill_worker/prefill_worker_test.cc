// The PrefillWorker service in-process on loopback, pushing KV over real
// "tcp" into a test-owned decode pool (a second CPU model runner's KV
// memory). A request prefilled by the service and continued on that pool
// gives exactly the colocated output; failures of the landing come back
// with the codes the router retries on, and leave no KV blocks behind.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <functional>
#include <future>
#include <map>
#include <random>
#include <thread>

#include "absl/strings/str_cat.h"
#include "common/drain.h"
#include "engine/builtin_tiny.h"
#include "engine/generator.h"
#include "engine/kv_cache.h"
#include "engine/model_runner.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "tests/engine/test_util.h"
#include "kv_transfer/negotiation.h"
#include "kv_transfer/transport.h"
#include "prefill_worker/prefill_server.h"
#include "proto/convert.h"

namespace pdserve {
namespace {

using testing_util::RandomPrompt;

using ::pdserve::internal::v1::KvComplete;
using ::pdserve::internal::v1::Landing;
using ::pdserve::internal::v1::LoadReport;
using ::pdserve::internal::v1::LoadRequest;
using ::pdserve::internal::v1::PrefillRequest;
using ::pdserve::internal::v1::PrefillResponse;

constexpr int32_t kChunk = 64;  // The prefill worker's max_batch_tokens.

SamplingParams Greedy(int max_tokens) {
  return {.temperature = 0.0f, .max_tokens = max_tokens, .ignore_eos = true};
}
SamplingParams Seeded(int max_tokens, uint64_t seed) {
  return {.temperature = 0.9f,
          .top_p = 0.9f,
          .seed = seed,
          .max_tokens = max_tokens,
          .ignore_eos = true};
}

// A listening socket that never accepts: connections complete in the
// kernel's backlog, and writes are never acknowledged.
class BlackHole {
 public:
  BlackHole() {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(::listen(fd_, 16), 0);
    socklen_t len = sizeof(addr);
    ::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    endpoint_ = absl::StrCat("127.0.0.1:", ntohs(addr.sin_port));
  }
  ~BlackHole() { ::close(fd_); }
  const std::string& endpoint() const { return endpoint_; }

 private:
  int fd_ = -1;
  std::string endpoint_;
};

class PrefillWorkerTest : public ::testing::Test {
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
    auto t = kv::CreateKvTransport("tcp", {});
    ASSERT_TRUE(t.ok()) << t.status();
    receiver_ = *std::move(t);
    auto region = receiver_->RegisterMemory(decode_runner_->kv_memory());
    ASSERT_TRUE(region.ok());
    region_ = *region;
  }

  void TearDown() override {
    if (server_ != nullptr) {
      // Nothing leaks: every block of the prefill worker is free again.
      const LoadReport load = WaitForIdle();
      EXPECT_EQ(load.free_blocks(), load.total_blocks());
      EXPECT_TRUE(
          server_->worker().WaitUntilIdle(absl::Now() + absl::Seconds(5)));
    }
  }

  std::unique_ptr<ModelRunner> MakeRunner(int blocks) {
    auto r = CreateModelRunner(
        model_, {.num_kv_blocks = blocks, .block_size = 16, .num_threads = 1});
    EXPECT_TRUE(r.ok()) << r.status();
    return *std::move(r);
  }

  void StartServer(absl::Duration transfer_timeout = absl::Seconds(5),
                   const std::string& kv_transport = "tcp") {
    PrefillServerOptions o;
    o.worker.kv_transport = kv_transport;
    o.worker.engine.kv_cache_bytes = size_t{16} << 20;
    o.worker.engine.num_threads = 1;
    o.worker.engine.max_batch_tokens = kChunk;
    o.worker.transfer_timeout = transfer_timeout;
    auto s = PrefillServer::Start(o);
    ASSERT_TRUE(s.ok()) << s.status();
    server_ = *std::move(s);
    stub_ = internal::v1::PrefillWorker::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                            grpc::InsecureChannelCredentials()));
  }

  // A landing in the test's decode pool, reserved for `total` tokens.
  Landing Reserve(RequestId id, int32_t total) {
    Landing landing;
    auto blocks = decode_->Reserve(id, total);
    EXPECT_TRUE(blocks.ok()) << blocks.status();
    if (!blocks.ok()) return landing;
    landing.set_decode_worker_id("test-decode");
    internal::v1::KvOffer* offer = landing.add_offers();
    offer->set_transport("tcp");
    offer->set_endpoint(receiver_->endpoint());
    offer->set_region_id(region_.value);
    landing.set_pool_blocks(decode_runner_->num_kv_blocks());
    ToWire(decode_runner_->kv_layout(), landing.mutable_layout());
    for (BlockId b : *blocks) landing.add_block_ids(b.value);
    return landing;
  }

  PrefillRequest MakeRequest(const GenerationRequest& r, Landing landing) {
    PrefillRequest req;
    ToWire(r, req.mutable_request());
    *req.mutable_landing() = std::move(landing);
    return req;
  }

  grpc::Status Prefill(const PrefillRequest& req, PrefillResponse* resp,
                       absl::Duration deadline = absl::Seconds(20)) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    return stub_->Prefill(&ctx, req, resp);
  }

  LoadReport GetLoad() {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    LoadReport load;
    EXPECT_TRUE(stub_->GetLoad(&ctx, LoadRequest(), &load).ok());
    return load;
  }

  // The worker's load once it has let go of every request (or after 5 s).
  LoadReport WaitForIdle() {
    const absl::Time deadline = absl::Now() + absl::Seconds(5);
    LoadReport load = GetLoad();
    while (absl::Now() < deadline &&
           (load.free_blocks() != load.total_blocks() || load.running() != 0 ||
            load.waiting() != 0)) {
      absl::SleepFor(absl::Milliseconds(10));
      load = GetLoad();
    }
    return load;
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

  // The next `n` KvComplete notifications (on `receiver`, default the tcp
  // one): num_tokens by request id.
  std::map<uint64_t, uint32_t> Notifications(
      size_t n, kv::KvTransport* receiver = nullptr) {
    if (receiver == nullptr) receiver = receiver_.get();
    std::map<uint64_t, uint32_t> got;
    for (size_t i = 0; i < n; ++i) {
      auto note = receiver->WaitNotification(absl::Seconds(5));
      EXPECT_TRUE(note.ok()) << note.status();
      if (!note.ok()) break;
      KvComplete complete;
      EXPECT_TRUE(complete.ParseFromString(note->message));
      EXPECT_FALSE(got.contains(complete.request_id()))
          << "twice: " << complete.request_id();
      got[complete.request_id()] = complete.num_tokens();
    }
    return got;
  }

  // Continues `r` on the decode pool from the prefill worker's answer.
  std::vector<int32_t> Decode(const GenerationRequest& r,
                              const PrefillResponse& resp) {
    std::vector<int32_t> out = {resp.first_token().token_id()};
    EXPECT_EQ(resp.finish_reason(), internal::v1::FINISH_REASON_UNSPECIFIED);
    absl::Status s = decode_->AddPrefilled(r, out[0]);
    EXPECT_TRUE(s.ok()) << s;
    std::vector<GenerationEvent> events;
    while (decode_->HasWork()) {
      events.clear();
      EXPECT_TRUE(decode_->Step(events).ok());
      for (const auto& e : events) out.push_back(e.token.token);
    }
    return out;
  }

  // Prefill on the service, decode on the test's pool. `edit` changes the
  // landing first; the KV must arrive on `receiver` (default: the tcp one).
  std::vector<int32_t> Disaggregated(
      const GenerationRequest& r,
      const std::function<void(Landing&)>& edit = nullptr,
      kv::KvTransport* receiver = nullptr) {
    const int32_t prompt_len = static_cast<int32_t>(r.prompt.size());
    Landing landing = Reserve(r.id, prompt_len + r.sampling.max_tokens);
    if (edit) edit(landing);
    PrefillResponse resp;
    const grpc::Status s = Prefill(MakeRequest(r, landing), &resp);
    EXPECT_TRUE(s.ok()) << s.error_code() << " " << s.error_message();
    if (!s.ok()) {
      decode_->ReleaseReservation(r.id);
      return {};
    }
    // The notification names the request and its whole prompt, and (the
    // tcp transport orders it after the writes) every byte has landed.
    EXPECT_EQ(Notifications(1, receiver),
              (std::map<uint64_t, uint32_t>{{r.id.value, prompt_len}}));
    const KvBlockLayout& layout = decode_runner_->kv_layout();
    EXPECT_EQ(resp.kv_bytes(), static_cast<uint64_t>(prompt_len) * 2 *
                                   layout.slot_bytes() * layout.num_layers);
    EXPECT_EQ(resp.cached_tokens(), 0u) << "not computed per request yet";
    EXPECT_GT(resp.prefill_micros(), 0u);
    EXPECT_GE(resp.transfer_micros(), resp.transfer_tail_micros());
    return Decode(r, resp);
  }

  // A request whose landing is `landing` (default: a fresh reservation
  // released at once) and whose outcome is only its status.
  grpc::Status PrefillTo(const Landing& landing, int prompt_len = 100,
                         absl::Duration deadline = absl::Seconds(20)) {
    PrefillResponse resp;
    return Prefill(
        MakeRequest({RequestId(next_id_++), RandomPrompt(prompt_len, 1), Greedy(8)},
                    landing),
        &resp, deadline);
  }

  Landing ScratchLanding(int32_t tokens = 200) {
    const RequestId id(next_id_++);
    Landing landing = Reserve(id, tokens);
    decode_->ReleaseReservation(id);
    return landing;
  }

  std::shared_ptr<const Model> model_;
  std::unique_ptr<ModelRunner> decode_runner_, reference_runner_;
  std::unique_ptr<Generator> decode_;
  std::unique_ptr<kv::KvTransport> receiver_;
  kv::RegionId region_;
  std::unique_ptr<PrefillServer> server_;
  std::unique_ptr<internal::v1::PrefillWorker::Stub> stub_;
  uint64_t next_id_ = 1000;
};

TEST_F(PrefillWorkerTest, OutputEqualsColocatedGreedyAndSeeded) {
  StartServer();
  uint64_t id = 1;
  // Up to 200 tokens: up to four chunks of 64, each reporting every layer.
  for (int len : {1, 15, 16, 17, 100, 200}) {
    for (const SamplingParams& sp : {Greedy(12), Seeded(12, 5)}) {
      const GenerationRequest r{RequestId(id++), RandomPrompt(len, len), sp};
      EXPECT_EQ(Disaggregated(r), Colocated(r)) << "prompt length " << len;
    }
  }
  EXPECT_EQ(decode_->block_pool().num_free(),
            decode_->block_pool().num_blocks());
}

// Draining: a Prefill is refused UNAVAILABLE "worker is draining" and the
// load report says draining; the worker holds nothing.
TEST_F(PrefillWorkerTest, DrainingRefusesNewPrefills) {
  StartServer();
  const GenerationRequest r{RequestId(1), RandomPrompt(30, 1), Greedy(4)};
  EXPECT_EQ(Disaggregated(r), Colocated(r));
  EXPECT_FALSE(GetLoad().draining());
  server_->worker().StartDraining();
  EXPECT_TRUE(GetLoad().draining());
  EXPECT_TRUE(server_->worker().drain_reported());
  const grpc::Status refused = PrefillTo(ScratchLanding());
  EXPECT_EQ(refused.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(IsDrainingRefusal(FromGrpcStatus(refused))) << refused.error_message();
  EXPECT_TRUE(server_->worker().WaitUntilIdle(absl::Now() + absl::Seconds(5)));
  EXPECT_EQ(server_->worker().RequestsInFlight(), 0);
}

TEST_F(PrefillWorkerTest, RepeatedPromptFromThePrefixCacheIsShippedToo) {
  StartServer();
  // The second prompt shares 128 tokens (8 full blocks) with the first: the
  // prefill worker takes them from its prefix cache, and must still ship
  // their KV, which the decode pool does not have.
  std::vector<int32_t> prompt = RandomPrompt(150, 3);
  const GenerationRequest first{RequestId(1), prompt, Greedy(10)};
  EXPECT_EQ(Disaggregated(first), Colocated(first));
  prompt.resize(140);
  prompt.push_back(7);
  for (uint64_t id : {2, 3}) {  // Then the very same prompt again.
    const GenerationRequest again{RequestId(id), prompt, Seeded(10, id)};
    EXPECT_EQ(Disaggregated(again), Colocated(again)) << id;
  }
}

// The decode pool holds the prompt's prefix from the first request: the
// second reservation shares it (Landing.cached_tokens) and the prefill
// worker pushes only the positions after it, fewer KV bytes, with the
// same output as colocated.
TEST_F(PrefillWorkerTest, PromptTheDecodePoolHoldsIsPushedPastItsPrefixOnly) {
  StartServer();
  const std::vector<int32_t> prompt = RandomPrompt(150, 21);
  const GenerationRequest first{RequestId(1), prompt, Greedy(10)};
  EXPECT_EQ(Disaggregated(first), Colocated(first));
  const KvBlockLayout& layout = decode_runner_->kv_layout();
  const uint64_t per_token = 2 * layout.slot_bytes() * layout.num_layers;
  for (uint64_t id : {2, 3}) {
    const GenerationRequest again{RequestId(id), prompt, Seeded(10, id)};
    auto reserved = decode_->Reserve(again.id, 150 + 10, 150,
                                     PromptBlockHashes(prompt, 16));
    ASSERT_TRUE(reserved.ok()) << reserved.status();
    ASSERT_EQ(reserved->cached_tokens, 144);
    Landing landing = Reserve(RequestId(next_id_++), 16);  // The offers.
    decode_->ReleaseReservation(RequestId(next_id_ - 1));
    landing.clear_block_ids();
    for (BlockId b : reserved->blocks) landing.add_block_ids(b.value);
    landing.set_cached_tokens(144);
    PrefillResponse resp;
    const grpc::Status s = Prefill(MakeRequest(again, landing), &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(resp.kv_bytes(), (150 - 144) * per_token);
    EXPECT_EQ(Notifications(1),
              (std::map<uint64_t, uint32_t>{{id, 150}}));
    EXPECT_EQ(Decode(again, resp), Colocated(again)) << id;
  }
  // A cached_tokens that is no block boundary, or the whole prompt, is
  // refused.
  for (uint32_t bad : {10u, 160u}) {
    Landing landing = ScratchLanding(200);
    landing.set_cached_tokens(bad);
    EXPECT_EQ(PrefillTo(landing, 150).error_code(),
              grpc::StatusCode::INVALID_ARGUMENT)
        << bad;
  }
  EXPECT_EQ(decode_->block_pool().num_free(),
            decode_->block_pool().num_blocks());
}

TEST_F(PrefillWorkerTest,
       ConcurrentPromptsAreBatchedAndEachLandsWhereItShould) {
  StartServer();
  std::vector<GenerationRequest> requests;
  std::vector<PrefillRequest> wire_requests;
  for (uint64_t i = 0; i < 6; ++i) {
    GenerationRequest r{RequestId(10 + i),
                        RandomPrompt(20 + 37 * static_cast<int>(i), 100 + i),
                        i % 2 ? Seeded(8, i) : Greedy(8)};
    wire_requests.push_back(MakeRequest(r, Reserve(r.id, r.prompt.size() + 8)));
    requests.push_back(std::move(r));
  }
  std::vector<PrefillResponse> responses(requests.size());
  std::vector<grpc::Status> statuses(requests.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < requests.size(); ++i) {
    threads.emplace_back(
        [&, i] { statuses[i] = Prefill(wire_requests[i], &responses[i]); });
  }
  for (auto& t : threads) t.join();
  std::map<uint64_t, uint32_t> want;
  for (const auto& r : requests) want[r.id.value] = r.prompt.size();
  EXPECT_EQ(Notifications(requests.size()), want);
  for (size_t i = 0; i < requests.size(); ++i) {
    ASSERT_TRUE(statuses[i].ok()) << statuses[i].error_message();
    EXPECT_EQ(Decode(requests[i], responses[i]), Colocated(requests[i])) << i;
  }
}

TEST_F(PrefillWorkerTest, FinishReasonOfTheFirstToken) {
  StartServer();
  const std::vector<int32_t> prompt = RandomPrompt(40, 9);
  const int32_t first = Colocated({RequestId(1), prompt, Greedy(1)})[0];
  struct Case {
    SamplingParams sampling;
    internal::v1::FinishReason want;
  } cases[] = {
      {Greedy(1), internal::v1::FINISH_REASON_LENGTH},
      {Greedy(5), internal::v1::FINISH_REASON_UNSPECIFIED},
      {{.temperature = 0.0f, .max_tokens = 5, .stop_token_ids = {first}},
       internal::v1::FINISH_REASON_STOP},
  };
  uint64_t id = 1;
  for (const Case& c : cases) {
    const GenerationRequest r{RequestId(id++), prompt, c.sampling};
    PrefillResponse resp;
    const grpc::Status s = Prefill(
        MakeRequest(r, Reserve(r.id, 40 + c.sampling.max_tokens)), &resp);
    ASSERT_TRUE(s.ok()) << s.error_message();
    EXPECT_EQ(resp.first_token().token_id(), first);
    EXPECT_EQ(resp.finish_reason(), c.want) << c.sampling.max_tokens;
    EXPECT_EQ(Notifications(1).count(r.id.value), 1u);
    decode_->ReleaseReservation(r.id);
  }
}

TEST_F(PrefillWorkerTest, LayoutOrTransportMismatchIsFailedPrecondition) {
  StartServer();
  Landing landing = ScratchLanding();
  landing.mutable_layout()->set_block_size(32);
  EXPECT_EQ(PrefillTo(landing).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  landing = ScratchLanding();
  landing.mutable_layout()->set_dtype("bf16");
  EXPECT_EQ(PrefillTo(landing).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  landing = ScratchLanding();
  landing.clear_layout();
  EXPECT_EQ(PrefillTo(landing).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  landing = ScratchLanding();
  landing.mutable_offers(0)->set_transport("carrier-pigeon");
  EXPECT_EQ(PrefillTo(landing).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_EQ(receiver_->WaitNotification(absl::Milliseconds(50)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST_F(PrefillWorkerTest, BadRequestsAreInvalidArgument) {
  StartServer();
  auto code = [&](const GenerationRequest& r, const Landing& landing) {
    PrefillResponse resp;
    return Prefill(MakeRequest(r, landing), &resp).error_code();
  };
  const Landing landing = ScratchLanding();
  constexpr auto kInvalid = grpc::StatusCode::INVALID_ARGUMENT;
  EXPECT_EQ(code({RequestId(1), {}, Greedy(4)}, landing), kInvalid)
      << "empty prompt";
  EXPECT_EQ(code({RequestId(2), {256, 999}, Greedy(4)}, landing), kInvalid)
      << "outside vocab";
  EXPECT_EQ(code({RequestId(3), RandomPrompt(10, 1), Greedy(0)}, landing), kInvalid)
      << "max_tokens 0";
  EXPECT_EQ(
      code({RequestId(4), RandomPrompt(10, 1), {.temperature = -1.0f}}, landing),
      kInvalid);
  EXPECT_EQ(code({RequestId(5), RandomPrompt(10, 1), {.top_p = 0.0f}}, landing),
            kInvalid);
  EXPECT_EQ(code({RequestId(6), RandomPrompt(100, 1), Greedy(4000)}, landing),
            kInvalid)
      << "beyond the context";
  SamplingParams penalized = Greedy(4);
  penalized.frequency_penalty = -3.0f;
  EXPECT_EQ(code({RequestId(8), RandomPrompt(10, 1), penalized}, landing),
            kInvalid)
      << "frequency_penalty";
  SamplingParams biased = Greedy(4);
  biased.logit_bias = {{999, 1.0f}};
  EXPECT_EQ(code({RequestId(9), RandomPrompt(10, 1), biased}, landing),
            kInvalid)
      << "logit_bias outside the vocabulary";
  SamplingParams prompt_logprobs = Greedy(4);
  prompt_logprobs.prompt_logprobs = 40;
  EXPECT_EQ(
      code({RequestId(10), RandomPrompt(10, 1), prompt_logprobs}, landing),
      kInvalid)
      << "prompt_logprobs";

  const GenerationRequest ok{RequestId(7), RandomPrompt(100, 1),
                             Greedy(4)};  // Needs 7 blocks.
  Landing short_landing = landing;
  short_landing.mutable_block_ids()->Truncate(6);
  EXPECT_EQ(code(ok, short_landing), kInvalid) << "too few blocks";
  Landing outside = landing;
  outside.set_block_ids(3, static_cast<int32_t>(landing.pool_blocks()));
  EXPECT_EQ(code(ok, outside), kInvalid) << "block id outside the pool";
  outside.set_block_ids(3, -1);
  EXPECT_EQ(code(ok, outside), kInvalid) << "negative block id";
  Landing long_id = landing;
  long_id.set_decode_worker_id(std::string(2000, 'd'));
  EXPECT_EQ(code(ok, long_id), kInvalid) << "decode_worker_id of 2000 bytes";
  Landing no_endpoint = landing;
  no_endpoint.mutable_offers(0)->clear_endpoint();
  EXPECT_EQ(code(ok, no_endpoint), kInvalid);
  PrefillRequest no_landing;
  ToWire(ok, no_landing.mutable_request());
  PrefillResponse resp;
  EXPECT_EQ(Prefill(no_landing, &resp).error_code(), kInvalid);
  EXPECT_EQ(receiver_->WaitNotification(absl::Milliseconds(50)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST_F(PrefillWorkerTest, UnreachableLandingIsUnavailableAndFreesTheBlocks) {
  StartServer();
  std::string closed;
  {
    auto gone = kv::CreateKvTransport("tcp", {});
    ASSERT_TRUE(gone.ok());
    closed = (*gone)->endpoint();
  }
  Landing landing = ScratchLanding();
  landing.mutable_offers(0)->set_endpoint(closed);
  for (int len : {10, 200}) {
    const grpc::Status s = PrefillTo(landing, len);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE)
        << s.error_message();
    const LoadReport load = WaitForIdle();
    EXPECT_EQ(load.free_blocks(), load.total_blocks());
  }
  // The worker still serves a good landing afterwards.
  const GenerationRequest r{RequestId(1), RandomPrompt(70, 2), Greedy(6)};
  EXPECT_EQ(Disaggregated(r), Colocated(r));
}

TEST_F(PrefillWorkerTest, RangesThePeerRefusesFailWithItsCode) {
  StartServer();
  Landing landing = ScratchLanding();
  landing.mutable_offers(0)->set_region_id(region_.value + 17);
  grpc::Status s = PrefillTo(landing);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND) << s.error_message();
  // The landing claims a bigger pool than the peer registered.
  landing = ScratchLanding();
  const int32_t real_blocks = decode_runner_->num_kv_blocks();
  landing.set_pool_blocks(real_blocks * 8);
  for (int i = 0; i < landing.block_ids_size(); ++i)
    landing.set_block_ids(i, real_blocks * 8 - 1 - i);
  s = PrefillTo(landing);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::OUT_OF_RANGE)
      << s.error_message();
  const LoadReport load = WaitForIdle();
  EXPECT_EQ(load.free_blocks(), load.total_blocks());
  // A connection dropped after an error is made anew for the next request.
  const GenerationRequest r{RequestId(1), RandomPrompt(70, 2), Greedy(6)};
  EXPECT_EQ(Disaggregated(r), Colocated(r));
}

TEST_F(PrefillWorkerTest, StalledLandingTimesOutAsDeadlineExceeded) {
  StartServer(/*transfer_timeout=*/absl::Milliseconds(300));
  BlackHole hole;
  Landing landing = ScratchLanding();
  landing.mutable_offers(0)->set_endpoint(hole.endpoint());
  const absl::Time start = absl::Now();
  const grpc::Status s = PrefillTo(landing, 150);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
      << s.error_message();
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
}

TEST_F(PrefillWorkerTest, ClientDeadlineReleasesTheBlocksOnceTheSenderLetsGo) {
  StartServer(/*transfer_timeout=*/absl::Seconds(2));
  BlackHole hole;
  Landing landing = ScratchLanding();
  landing.mutable_offers(0)->set_endpoint(hole.endpoint());
  const absl::Time start = absl::Now();
  const grpc::Status s =
      PrefillTo(landing, 150, /*deadline=*/absl::Milliseconds(600));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
      << s.error_message();
  // (The deadline leaves time to compute the prompt even under sanitizers,
  // so the push has started.) The sender is stuck in a write to the
  // landing for two seconds: the
  // request's blocks stay held until it gives up, then come back.
  LoadReport load = GetLoad();
  EXPECT_LT(load.free_blocks(), load.total_blocks());
  load = WaitForIdle();
  EXPECT_EQ(load.free_blocks(), load.total_blocks());
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(1900));
}

TEST_F(PrefillWorkerTest, DeadlineDuringALongPromptStopsTheEngine) {
  StartServer();
  // 4000 tokens in 64-token chunks: the deadline comes mid-prompt.
  const GenerationRequest r{RequestId(1), RandomPrompt(4000, 8), Greedy(8)};
  Landing landing = Reserve(r.id, 4008);
  landing.set_landing_id(77);
  PrefillResponse resp;
  const grpc::Status s =
      Prefill(MakeRequest(r, landing), &resp, absl::Milliseconds(50));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
      << s.error_message();
  const LoadReport load = WaitForIdle();
  EXPECT_EQ(load.free_blocks(), load.total_blocks());
  // Abandoned before its last layer: the decode worker is never told the
  // KV is complete. A push that had connected (the usual case: the first
  // chunk's layers are out within the 50 ms) tells it instead that no
  // further byte comes.
  auto note = receiver_->WaitNotification(absl::Milliseconds(500));
  if (note.ok()) {
    KvComplete aborted;
    ASSERT_TRUE(aborted.ParseFromString(note->message));
    EXPECT_TRUE(aborted.aborted());
    EXPECT_EQ(aborted.request_id(), r.id.value);
    EXPECT_EQ(aborted.landing_id(), 77u);
    EXPECT_EQ(aborted.num_tokens(), 0u);
  } else {
    EXPECT_TRUE(absl::IsDeadlineExceeded(note.status())) << note.status();
  }
  EXPECT_EQ(
      receiver_->WaitNotification(absl::Milliseconds(200)).status().code(),
      absl::StatusCode::kDeadlineExceeded);
  decode_->ReleaseReservation(r.id);
}

TEST_F(PrefillWorkerTest, ClientCancelReleasesTheBlocksAndTheIdCanBeUsedAgain) {
  StartServer(/*transfer_timeout=*/absl::Seconds(1));
  BlackHole hole;
  Landing landing = ScratchLanding();
  landing.mutable_offers(0)->set_endpoint(hole.endpoint());
  const GenerationRequest r{RequestId(1), RandomPrompt(150, 4), Greedy(8)};
  grpc::ClientContext ctx;
  PrefillResponse resp;
  std::promise<grpc::Status> done;
  const PrefillRequest req = MakeRequest(r, landing);
  stub_->async()->Prefill(
      &ctx, &req, &resp, [&](grpc::Status s) { done.set_value(std::move(s)); });
  absl::SleepFor(
      absl::Milliseconds(300));  // In the engine or stuck on the landing.
  // While it is in flight, the same id is refused.
  PrefillResponse dup_resp;
  EXPECT_EQ(Prefill(MakeRequest(r, ScratchLanding()), &dup_resp).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  ctx.TryCancel();
  EXPECT_EQ(done.get_future().get().error_code(), grpc::StatusCode::CANCELLED);
  const LoadReport load = WaitForIdle();
  EXPECT_EQ(load.free_blocks(), load.total_blocks());
  // Once released, the id is free for a retry.
  EXPECT_EQ(Disaggregated(r), Colocated(r));
}

TEST_F(PrefillWorkerTest, GetLoadDescribesTheWorker) {
  StartServer();
  const LoadReport load = GetLoad();
  EXPECT_EQ(load.worker_id(), absl::StrCat("prefill-", server_->port()));
  EXPECT_EQ(load.role(), "prefill");
  EXPECT_EQ(load.model(), "builtin:tiny");
  absl::StatusOr<KvBlockLayout> layout = FromWire(load.layout());
  ASSERT_TRUE(layout.ok());
  EXPECT_EQ(*layout, decode_runner_->kv_layout());
  // 16 MiB of 4 layers x 16 slots x (K + V) x 2 heads x 32 dims x fp32.
  EXPECT_EQ(load.total_blocks(), (16u << 20) / layout->block_bytes());
  EXPECT_EQ(load.free_blocks(), load.total_blocks());
  EXPECT_EQ(load.running() + load.waiting(), 0u);
  EXPECT_EQ(load.pending_prompt_tokens(), 0u);
  ASSERT_EQ(load.kv_transports_size(), 1);
  EXPECT_EQ(load.kv_transports(0).transport(), "tcp");
  EXPECT_EQ(load.kv_transports(0).pushes(), 0u);
}

// --- Transport negotiation (kv_transfer/negotiation.h) ---

bool HasKvTransport(const std::string& name) {
  const std::vector<std::string> built = kv::AvailableKvTransports();
  return std::find(built.begin(), built.end(), name) != built.end();
}

internal::v1::KvTransportCounters CountersOf(const LoadReport& load,
                                             const std::string& transport) {
  for (const auto& c : load.kv_transports()) {
    if (c.transport() == transport) return c;
  }
  ADD_FAILURE() << "no counters for " << transport;
  return {};
}

// Puts `offer` first in the landing's offers.
void PrependOffer(Landing& landing, const std::string& transport,
                  const std::string& endpoint, kv::RegionId region) {
  internal::v1::KvOffer offer;
  offer.set_transport(transport);
  offer.set_endpoint(endpoint);
  offer.set_region_id(region.value);
  landing.mutable_offers()->Add(std::move(offer));
  std::rotate(landing.mutable_offers()->rbegin(),
              landing.mutable_offers()->rbegin() + 1,
              landing.mutable_offers()->rend());
}

// The decode side offers [ucx:shm, tcp]: a tcp-only prefill worker takes
// tcp; one that runs both takes ucx:shm, which ranks higher.
TEST_F(PrefillWorkerTest, PicksTheBestTransportBothSidesRun) {
  if (!HasKvTransport("ucx:shm")) GTEST_SKIP() << "ucx is not built";
  auto shm = kv::CreateKvTransport("ucx:shm", {});
  ASSERT_TRUE(shm.ok()) << shm.status();
  auto shm_region = (*shm)->RegisterMemory(decode_runner_->kv_memory());
  ASSERT_TRUE(shm_region.ok());
  auto offer_both = [&](Landing& landing) {
    PrependOffer(landing, "ucx:shm", (*shm)->endpoint(), *shm_region);
  };

  StartServer(absl::Seconds(5), "tcp");
  const GenerationRequest r1{RequestId(1), RandomPrompt(90, 1), Greedy(8)};
  EXPECT_EQ(Disaggregated(r1, offer_both, receiver_.get()), Colocated(r1));
  LoadReport load = GetLoad();
  ASSERT_EQ(load.kv_transports_size(), 1);
  EXPECT_EQ(CountersOf(load, "tcp").pushes(), 1u);
  EXPECT_GT(CountersOf(load, "tcp").bytes(), 0u);

  TearDown();
  server_.reset();
  StartServer(absl::Seconds(5), "tcp,ucx:shm");
  const GenerationRequest r2{RequestId(2), RandomPrompt(90, 2), Seeded(8, 3)};
  EXPECT_EQ(Disaggregated(r2, offer_both, shm->get()), Colocated(r2));
  load = GetLoad();
  ASSERT_EQ(load.kv_transports_size(), 2);
  EXPECT_EQ(CountersOf(load, "ucx:shm").pushes(), 1u);
  EXPECT_GT(CountersOf(load, "ucx:shm").bytes(), 0u);
  EXPECT_EQ(CountersOf(load, "ucx:shm").fallbacks(), 0u);
  EXPECT_EQ(CountersOf(load, "tcp").pushes(), 0u);
  EXPECT_EQ(CountersOf(load, "tcp").bytes(), 0u);
  // Nothing arrived over tcp.
  EXPECT_EQ(receiver_->WaitNotification(absl::Milliseconds(50)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  TearDown();
  server_.reset();  // Before the ucx receiver it wrote to.
}

// The first offer names a closed port: the push falls back to the next
// one, the request still gives the colocated tokens, and the fallback is
// counted. While the dead offer is fresh in memory it is passed over.
TEST_F(PrefillWorkerTest, FallsBackPastAnOfferThatDoesNotConnect) {
  std::string closed;
  {
    auto gone = kv::CreateKvTransport("tcp", {});
    ASSERT_TRUE(gone.ok());
    closed = (*gone)->endpoint();
  }
  StartServer();
  // Two tcp offers rank alike, so the landing's order decides.
  auto dead_first = [&](Landing& landing) {
    PrependOffer(landing, "tcp", closed, region_);
  };
  for (uint64_t id : {1, 2}) {
    const GenerationRequest r{RequestId(id), RandomPrompt(80, id), Greedy(8)};
    EXPECT_EQ(Disaggregated(r, dead_first), Colocated(r)) << id;
  }
  const LoadReport load = GetLoad();
  EXPECT_EQ(CountersOf(load, "tcp").pushes(), 2u);
  EXPECT_EQ(CountersOf(load, "tcp").fallbacks(), 2u);
}

TEST_F(PrefillWorkerTest, NoCommonTransportIsFailedPreconditionNamingBoth) {
  StartServer();
  Landing landing = ScratchLanding();
  landing.mutable_offers(0)->set_transport("cuda_ipc");
  PrependOffer(landing, "nccl", "somewhere", region_);
  const grpc::Status s = PrefillTo(landing);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_NE(s.error_message().find("'nccl', 'cuda_ipc'"), std::string::npos)
      << s.error_message();
  EXPECT_NE(s.error_message().find("runs 'tcp'"), std::string::npos)
      << s.error_message();
  EXPECT_EQ(receiver_->WaitNotification(absl::Milliseconds(50)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
}

TEST_F(PrefillWorkerTest, MalformedOffersAreInvalidArgument) {
  StartServer();
  const Landing good = ScratchLanding();
  auto code = [&](const Landing& landing) {
    return PrefillTo(landing).error_code();
  };
  constexpr auto kInvalid = grpc::StatusCode::INVALID_ARGUMENT;
  Landing none = good;
  none.clear_offers();
  EXPECT_EQ(code(none), kInvalid) << "no offer";
  Landing many = good;
  for (int i = 0; i < 8; ++i) *many.add_offers() = good.offers(0);
  EXPECT_EQ(code(many), kInvalid) << "9 offers";
  Landing no_name = good;
  PrependOffer(no_name, "", receiver_->endpoint(), region_);
  EXPECT_EQ(code(no_name), kInvalid) << "an offer without a name";
  Landing huge = good;
  PrependOffer(huge, "tcp", std::string(5000, 'x'), region_);
  EXPECT_EQ(code(huge), kInvalid) << "a 5000-byte endpoint";
  EXPECT_EQ(receiver_->WaitNotification(absl::Milliseconds(50)).status().code(),
            absl::StatusCode::kDeadlineExceeded);
  // The worker still serves a good landing.
  const GenerationRequest r{RequestId(1), RandomPrompt(30, 2), Greedy(6)};
  EXPECT_EQ(Disaggregated(r), Colocated(r));
}

// A landing from before offers (the single transport, endpoint, region_id
// fields) is read as one offer.
TEST_F(PrefillWorkerTest, SingleOfferLandingOfOlderDecodeWorkersWorks) {
  StartServer();
  const GenerationRequest r{RequestId(1), RandomPrompt(50, 4), Greedy(6)};
  EXPECT_EQ(Disaggregated(r,
                          [](Landing& landing) {
                            const internal::v1::KvOffer offer =
                                landing.offers(0);
                            landing.clear_offers();
                            landing.set_transport(offer.transport());
                            landing.set_endpoint(offer.endpoint());
                            landing.set_region_id(offer.region_id());
                          }),
            Colocated(r));
}

}  // namespace
}  // namespace pdserve
