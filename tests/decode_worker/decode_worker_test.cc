// pd-decode's service in-process on loopback, driven through its real gRPC
// stub. Local prefill streams exactly what the engine produces; a prompt
// whose KV the test computes on a second CPU runner and writes into the
// landing over a real "tcp" KvTransport decodes to exactly the colocated
// output; cancelled calls, deadlines, expired and released reservations
// leave no KV blocks behind; bad requests and stray notifications get the
// codes the contract names, and the worker stays up.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <fstream>
#include <random>
#include <span>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/drain.h"
#include "decode_worker/decode_server.h"
#include "engine/generator.h"
#include "engine/kv_cache.h"
#include "engine/kv_layout.h"
#include "engine/model.h"
#include "engine/model_runner.h"
#include "grpcpp/create_channel.h"
#include "grpcpp/security/credentials.h"
#include "gtest/gtest.h"
#include "kv_transfer/transport.h"
#include "proto/convert.h"
#include "tests/engine/test_util.h"

extern char** environ;

namespace pdserve {
namespace {

using testing_util::RandomPrompt;

namespace wire = ::pdserve::internal::v1;

// The worker's pool: 128 blocks of 16 tokens of builtin:tiny.
constexpr size_t kPoolBytes = size_t{4} << 20;
constexpr int32_t kChunk = 64;  // Prefill chunk of the test's prefill side.

SamplingParams Greedy(int max_tokens) {
  return {.temperature = 0.0f, .max_tokens = max_tokens, .ignore_eos = true};
}
SamplingParams Seeded(int max_tokens, uint64_t seed) {
  return {.temperature = 0.9f,
          .top_p = 0.9f,
          .seed = seed,
          .max_tokens = max_tokens,
          .ignore_eos = true,
          .logprobs = 2};
}

wire::DecodeRequest MakeDecode(const GenerationRequest& r) {
  wire::DecodeRequest out;
  ToWire(r, out.mutable_request());
  return out;
}

std::shared_ptr<const Model> LoadTiny() {
  auto m = Model::Load("builtin:tiny");
  EXPECT_TRUE(m.ok()) << m.status();
  return *m;
}

std::unique_ptr<ModelRunner> MakeRunner(std::shared_ptr<const Model> model,
                                        int32_t blocks) {
  auto r = CreateModelRunner(
      std::move(model),
      {.num_kv_blocks = blocks, .block_size = 16, .num_threads = 1});
  EXPECT_TRUE(r.ok()) << r.status();
  return *std::move(r);
}

// What a whole request produced: every token, and how it ended.
struct Output {
  std::vector<SampledToken> tokens;
  FinishReason finish = FinishReason::kNone;
};

void ExpectSameTokens(const Output& got, const Output& want) {
  ASSERT_EQ(got.tokens.size(), want.tokens.size());
  for (size_t i = 0; i < want.tokens.size(); ++i) {
    EXPECT_EQ(got.tokens[i].token, want.tokens[i].token) << "token " << i;
    EXPECT_NEAR(got.tokens[i].logprob, want.tokens[i].logprob, 1e-4)
        << "token " << i;
    ASSERT_EQ(got.tokens[i].top_logprobs.size(),
              want.tokens[i].top_logprobs.size());
    for (size_t k = 0; k < want.tokens[i].top_logprobs.size(); ++k) {
      EXPECT_EQ(got.tokens[i].top_logprobs[k].token,
                want.tokens[i].top_logprobs[k].token);
    }
  }
  EXPECT_EQ(got.finish, want.finish);
}

FinishReason FromWireFinish(wire::FinishReason f) {
  switch (f) {
    case wire::FINISH_REASON_STOP:
      return FinishReason::kStop;
    case wire::FINISH_REASON_LENGTH:
      return FinishReason::kLength;
    default:
      return FinishReason::kNone;
  }
}

// The request run alone on a fresh Generator: the engine's own output.
Output RunOnEngine(const GenerationRequest& r) {
  auto runner = MakeRunner(LoadTiny(), 160);
  auto g = Generator::Create(runner.get(), {.max_batch_tokens = kChunk});
  EXPECT_TRUE(g.ok());
  EXPECT_TRUE((*g)->Add(r).ok());
  Output out;
  std::vector<GenerationEvent> events;
  while ((*g)->HasWork()) {
    events.clear();
    EXPECT_TRUE((*g)->Step(events).ok());
    for (const GenerationEvent& e : events) {
      out.tokens.push_back(e.token);
      out.finish = e.finish;
    }
  }
  return out;
}

// The prefill worker's part, done by the test: computes prompts' KV on its
// own runner (hold_kv; the layer observer notes what each layer wrote) and
// writes it into a landing through a real "tcp" KvTransport, then sends
// KvComplete.
class TestPrefill {
 public:
  TestPrefill() : runner_(MakeRunner(LoadTiny(), 64)) {
    auto g = Generator::Create(runner_.get(), {.max_batch_tokens = kChunk});
    EXPECT_TRUE(g.ok());
    generator_ = *std::move(g);
    generator_->set_kv_layer_observer(
        [this](int32_t layer, std::span<const ComputedKv> computed) {
          for (const ComputedKv& c : computed) {
            written_.push_back({layer,
                                std::vector<BlockId>(c.block_table.begin(),
                                                     c.block_table.end()),
                                c.begin, c.end});
          }
        });
    auto t = kv::CreateKvTransport("tcp", {});
    EXPECT_TRUE(t.ok()) << t.status();
    transport_ = *std::move(t);
    auto region = transport_->RegisterMemory(runner_->kv_memory());
    EXPECT_TRUE(region.ok()) << region.status();
    region_ = *region;
  }

  // Prefills `r` and returns its first token; its KV stays held.
  wire::SampledToken Prefill(GenerationRequest r) {
    written_.clear();
    r.hold_kv = true;
    EXPECT_TRUE(generator_->Add(r).ok());
    wire::SampledToken first;
    std::vector<GenerationEvent> events;
    while (generator_->HasWork()) {
      events.clear();
      EXPECT_TRUE(generator_->Step(events).ok());
      for (const GenerationEvent& e : events) ToWire(e.token, &first);
    }
    return first;
  }

  // Writes the KV of the last Prefill into `landing`, one Write per layer
  // report, from the landing's cached_tokens on (as a prefill worker does),
  // then notifies KvComplete for `num_tokens`; frees the held KV. Returns
  // the bytes written.
  uint64_t Push(RequestId id, const wire::Landing& landing,
                uint32_t num_tokens) {
    auto layout = FromWire(landing.layout());
    EXPECT_TRUE(layout.ok()) << layout.status();
    if (!layout.ok()) return 0;
    EXPECT_EQ(*layout, runner_->kv_layout());
    const wire::KvOffer* tcp = TcpOffer(landing);
    if (tcp == nullptr) return 0;
    const std::vector<BlockId> dst(landing.block_ids().begin(),
                                   landing.block_ids().end());
    kv::KvConnection& connection = ConnectionTo(tcp->endpoint());
    const int32_t cached = static_cast<int32_t>(landing.cached_tokens());
    uint64_t bytes = 0;
    for (const Written& w : written_) {
      const int32_t begin = std::max(w.begin, cached);
      if (w.end <= begin) continue;
      std::vector<kv::WriteOp> ops;
      ForEachKvRange(
          *layout, w.layer, w.blocks.data(), runner_->num_kv_blocks(),
          dst.data(), static_cast<int32_t>(landing.pool_blocks()), begin,
          w.end, [&](size_t src, size_t to, size_t length) {
            bytes += length;
            ops.push_back({.local_region = region_,
                           .local_offset = src,
                           .remote_region = kv::RegionId(tcp->region_id()),
                           .remote_offset = to,
                           .length = length,
                           .landing = landing.landing_id()});
          });
      EXPECT_TRUE(connection.Write(ops).ok());
    }
    generator_->ReleaseKv(id);
    Notify(landing, id, num_tokens);
    return bytes;
  }

  // The landing's tcp offer (the worker may offer more transports).
  static const wire::KvOffer* TcpOffer(const wire::Landing& landing) {
    for (const wire::KvOffer& o : landing.offers()) {
      if (o.transport() == "tcp") return &o;
    }
    ADD_FAILURE() << "the landing offers no tcp";
    return nullptr;
  }

  // KvComplete for `id` into `landing` (over its tcp offer, with its
  // cached tokens and landing id) for `num_tokens`.
  void Notify(const wire::Landing& landing, RequestId id, uint32_t num_tokens) {
    const wire::KvOffer* tcp = TcpOffer(landing);
    if (tcp == nullptr) return;
    wire::KvComplete complete;
    complete.set_request_id(id.value);
    complete.set_num_tokens(num_tokens);
    complete.set_cached_tokens(landing.cached_tokens());
    complete.set_landing_id(landing.landing_id());
    EXPECT_TRUE(ConnectionTo(tcp->endpoint())
                    .Notify(complete.SerializeAsString())
                    .ok());
  }

  kv::KvConnection& ConnectionTo(const std::string& endpoint) {
    if (connection_ == nullptr) {
      auto c = transport_->Connect(endpoint);
      EXPECT_TRUE(c.ok()) << c.status();
      connection_ = *std::move(c);
    }
    return *connection_;
  }

 private:
  struct Written {
    int32_t layer;
    std::vector<BlockId> blocks;
    int32_t begin, end;
  };

  std::unique_ptr<ModelRunner> runner_;
  std::unique_ptr<Generator> generator_;
  std::vector<Written> written_;
  std::unique_ptr<kv::KvTransport> transport_;
  kv::RegionId region_;
  std::unique_ptr<kv::KvConnection> connection_;
};

class DecodeWorkerTest : public ::testing::Test {
 protected:
  static DecodeServerOptions Options() {
    DecodeServerOptions options;
    options.worker.engine.kv_cache_bytes = kPoolBytes;
    options.worker.engine.num_threads = 1;
    options.worker.engine.max_batch_tokens = kChunk;
    // Long enough for the test's own prefill under sanitizers; short
    // enough that expiry tests end well before a Decode's 10 s deadline.
    options.worker.reservation_timeout = absl::Seconds(3);
    options.worker.engine.tick_period = absl::Milliseconds(20);
    options.shutdown_grace = absl::Milliseconds(200);
    return options;
  }

  void SetUp() override { Start(Options()); }

  void TearDown() override {
    if (server_ != nullptr) ExpectIdle();
  }

  void Start(const DecodeServerOptions& options) {
    stub_.reset();
    server_.reset();
    auto server = DecodeServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    stub_ = wire::DecodeWorker::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", server_->port()),
                            grpc::InsecureChannelCredentials()));
    idle_ = Load().free_blocks();
    EXPECT_EQ(idle_, Load().total_blocks());
  }

  wire::LoadReport Load() {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    wire::LoadReport load;
    EXPECT_TRUE(stub_->GetLoad(&ctx, {}, &load).ok());
    return load;
  }

  // With `prompt`, the reservation may share its cached prefix.
  grpc::Status Reserve(uint64_t id, uint32_t tokens, wire::Landing* landing,
                       const std::vector<int32_t>* prompt = nullptr) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    wire::ReserveRequest r;
    r.set_request_id(id);
    r.set_num_tokens(tokens);
    if (prompt != nullptr) {
      r.set_prompt_tokens(static_cast<uint32_t>(prompt->size()));
      for (uint64_t h : PromptBlockHashes(*prompt, 16)) {
        r.add_prompt_block_hashes(h);
      }
    }
    return stub_->Reserve(&ctx, r, landing);
  }

  grpc::Status Release(uint64_t id) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    wire::ReleaseRequest r;
    r.set_request_id(id);
    wire::ReleaseResponse out;
    return stub_->Release(&ctx, r, &out);
  }

  struct Stream {
    grpc::Status status;
    Output output;
    int messages = 0;
    // A message before the last carried a finish reason, or one was empty.
    bool malformed = false;
  };

  // Runs a Decode call to its end (or, with cancel_after > 0, cancels it
  // once that many messages came).
  // Cancels after `cancel_after` messages, or at the first message after
  // `*cancel` turns true.
  Stream Decode(const wire::DecodeRequest& r,
                absl::Duration deadline = absl::Seconds(10),
                int cancel_after = 0,
                const std::atomic<bool>* cancel = nullptr) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
    auto reader = stub_->Decode(&ctx, r);
    Stream out;
    wire::DecodeResponse msg;
    while (reader->Read(&msg)) {
      if (out.output.finish != FinishReason::kNone || msg.tokens_size() == 0) {
        out.malformed = true;
      }
      ++out.messages;
      for (const wire::SampledToken& t : msg.tokens()) {
        out.output.tokens.push_back(FromWire(t));
      }
      out.output.finish = FromWireFinish(msg.finish_reason());
      if (out.messages == cancel_after || (cancel != nullptr && *cancel)) {
        ctx.TryCancel();
      }
    }
    out.status = reader->Finish();
    return out;
  }

  // Waits (up to 10 s) until every block is free and nothing runs or is
  // reserved.
  void ExpectIdle() {
    wire::LoadReport load;
    for (int i = 0; i < 500; ++i) {
      load = Load();
      if (load.free_blocks() == idle_ && load.running() == 0 &&
          load.waiting() == 0 && load.reservations() == 0) {
        break;
      }
      absl::SleepFor(absl::Milliseconds(20));
    }
    EXPECT_EQ(load.free_blocks(), idle_);
    EXPECT_EQ(load.running(), 0u);
    EXPECT_EQ(load.waiting(), 0u);
    EXPECT_EQ(load.reservations(), 0u);
  }

  // Reserve, prefill on the test's side, push the KV, then Decode from the
  // first token: the whole output, first token included.
  // With `share`, the Reserve brings the prompt's block hashes; `landing`
  // and `kv_bytes`, when set, receive the landing and the bytes pushed.
  Output Disaggregated(TestPrefill& prefill, const GenerationRequest& r,
                       bool share = false, wire::Landing* landing_out = nullptr,
                       uint64_t* kv_bytes = nullptr) {
    const uint32_t prompt = static_cast<uint32_t>(r.prompt.size());
    wire::Landing landing;
    EXPECT_TRUE(Reserve(r.id.value, prompt + r.sampling.max_tokens, &landing,
                        share ? &r.prompt : nullptr)
                    .ok());
    wire::DecodeRequest d = MakeDecode(r);
    *d.mutable_first_token() = prefill.Prefill(r);
    const uint64_t bytes = prefill.Push(r.id, landing, prompt);
    if (kv_bytes != nullptr) *kv_bytes = bytes;
    if (landing_out != nullptr) *landing_out = landing;
    Stream s = Decode(d);
    EXPECT_TRUE(s.status.ok()) << s.status.error_message();
    EXPECT_FALSE(s.malformed);
    Output out = std::move(s.output);
    out.tokens.insert(out.tokens.begin(), FromWire(d.first_token()));
    return out;
  }

  std::unique_ptr<DecodeServer> server_;
  std::unique_ptr<wire::DecodeWorker::Stub> stub_;
  uint32_t idle_ = 0;
};

TEST_F(DecodeWorkerTest, LocalPrefillStreamsWhatTheEngineProduces) {
  uint64_t id = 1;
  for (int len : {1, 40, 150}) {
    for (const SamplingParams& sp : {Greedy(24), Seeded(24, len)}) {
      const GenerationRequest r{RequestId(id++), RandomPrompt(len, len), sp};
      Stream s = Decode(MakeDecode(r));
      ASSERT_TRUE(s.status.ok()) << s.status.error_message();
      EXPECT_FALSE(s.malformed);
      ExpectSameTokens(s.output, RunOnEngine(r));
      EXPECT_EQ(s.output.finish, FinishReason::kLength);
    }
  }
  // Stopping at EOS, which the greedy tiny model reaches on this prompt
  // or not: either way the stream says what the engine says.
  SamplingParams eos = Greedy(200);
  eos.ignore_eos = false;
  eos.stop_token_ids = {'e', 't'};
  const GenerationRequest r{RequestId(id++), RandomPrompt(20, 3), eos};
  Stream s = Decode(MakeDecode(r));
  ASSERT_TRUE(s.status.ok()) << s.status.error_message();
  ExpectSameTokens(s.output, RunOnEngine(r));
}

TEST_F(DecodeWorkerTest, KvLandedOverTcpDecodesToTheColocatedOutput) {
  TestPrefill prefill;
  uint64_t id = 1;
  // 100 tokens: two prefill chunks, so each layer arrives in two writes.
  for (int len : {1, 17, 100}) {
    for (const SamplingParams& sp : {Greedy(20), Seeded(20, 7)}) {
      const GenerationRequest r{RequestId(id++), RandomPrompt(len, len + 1),
                                sp};
      ExpectSameTokens(Disaggregated(prefill, r), RunOnEngine(r));
      ExpectIdle();
    }
  }
}

// A prompt whose prefix the worker's pool holds: the second Reserve shares
// those blocks (every full block but the last token's), the push writes
// only the rest, and the output stays the colocated one. The load report
// told the router which blocks the first request left cached.
TEST_F(DecodeWorkerTest, RepeatedPromptSharesItsCachedPrefix) {
  TestPrefill prefill;
  const std::vector<int32_t> prompt = RandomPrompt(150, 11);
  const std::vector<uint64_t> chain = PromptBlockHashes(prompt, 16);
  ASSERT_EQ(chain.size(), 9u);
  wire::Landing landing;
  uint64_t first_bytes = 0, second_bytes = 0;
  const GenerationRequest first{RequestId(1), prompt, Greedy(12)};
  ExpectSameTokens(Disaggregated(prefill, first, true, &landing, &first_bytes),
                   RunOnEngine(first));
  EXPECT_EQ(landing.cached_tokens(), 0u);
  ExpectIdle();
  // The report carries the prompt's nine full blocks.
  wire::LoadReport load = Load();
  ASSERT_TRUE(load.kv_events().snapshot());
  EXPECT_NE(load.kv_events().epoch(), 0u);
  std::vector<uint64_t> held(load.kv_events().stored().begin(),
                             load.kv_events().stored().end());
  std::sort(held.begin(), held.end());
  std::vector<uint64_t> want = chain;
  std::sort(want.begin(), want.end());
  EXPECT_EQ(held, want);
  for (uint64_t id : {2, 3}) {
    const GenerationRequest again{RequestId(id), prompt, Seeded(12, id)};
    ExpectSameTokens(
        Disaggregated(prefill, again, true, &landing, &second_bytes),
        RunOnEngine(again));
    EXPECT_EQ(landing.cached_tokens(), 144u) << "(150 - 1) / 16 full blocks";
    EXPECT_EQ(second_bytes * 150, first_bytes * (150 - 144)) << id;
    ExpectIdle();
  }
  // Nothing changed in the pool's hashes since: an empty delta.
  wire::LoadRequest cursor;
  cursor.set_kv_events_epoch(load.kv_events().epoch());
  cursor.set_kv_events_seq(load.kv_events().last_seq());
  grpc::ClientContext ctx;
  ASSERT_TRUE(stub_->GetLoad(&ctx, cursor, &load).ok());
  EXPECT_FALSE(load.kv_events().snapshot());
  EXPECT_EQ(load.kv_events().stored_size() + load.kv_events().evicted_size(),
            0);
}

// The hashes a Reserve shared must be the prompt's; a push that wrote the
// shared blocks (it ignored cached_tokens) is refused too.
TEST_F(DecodeWorkerTest, SharedPrefixOfAnotherPromptIsRefused) {
  TestPrefill prefill;
  const std::vector<int32_t> prompt = RandomPrompt(100, 12);
  const GenerationRequest first{RequestId(1), prompt, Greedy(4)};
  Disaggregated(prefill, first, true);
  ExpectIdle();
  wire::Landing landing;
  ASSERT_TRUE(Reserve(2, 100 + 4, &landing, &prompt).ok());
  ASSERT_EQ(landing.cached_tokens(), 96u);
  std::vector<int32_t> other = prompt;
  other[0] = (other[0] + 1) % 256;
  const GenerationRequest r{RequestId(2), other, Greedy(4)};
  wire::DecodeRequest d = MakeDecode(r);
  *d.mutable_first_token() = prefill.Prefill(r);
  prefill.Push(r.id, landing, 100);
  Stream s = Decode(d);
  EXPECT_EQ(s.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
      << s.status.error_message();
  ExpectIdle();
}

// Draining: new work (a Reserve, a local prefill) is refused UNAVAILABLE
// "worker is draining"; a reservation made before is decoded to the
// colocated output and counts as a request in flight until it is; the
// load report and the gauge say draining.
TEST_F(DecodeWorkerTest, DrainingRefusesNewWorkAndServesWhatItHas) {
  TestPrefill prefill;
  const GenerationRequest r{RequestId(5), RandomPrompt(40, 5), Greedy(16)};
  wire::Landing landing;
  ASSERT_TRUE(Reserve(5, 40 + 16, &landing).ok());
  EXPECT_FALSE(Load().draining());
  EXPECT_EQ(server_->worker().RequestsInFlight(), 1);

  server_->worker().StartDraining();
  EXPECT_TRUE(Load().draining());
  EXPECT_TRUE(server_->worker().drain_reported());
  wire::Landing refused;
  const grpc::Status reserve = Reserve(6, 40, &refused);
  EXPECT_EQ(reserve.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(IsDrainingRefusal(FromGrpcStatus(reserve))) << reserve.error_message();
  const Stream local = Decode(MakeDecode({RequestId(7), RandomPrompt(10, 7), Greedy(4)}));
  EXPECT_EQ(local.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(IsDrainingRefusal(FromGrpcStatus(local.status))) << local.status.error_message();
  EXPECT_EQ(local.messages, 0);
  EXPECT_EQ(server_->worker().RequestsInFlight(), 1);

  wire::DecodeRequest d = MakeDecode(r);
  *d.mutable_first_token() = prefill.Prefill(r);
  prefill.Push(r.id, landing, 40);
  Stream s = Decode(d);
  ASSERT_TRUE(s.status.ok()) << s.status.error_message();
  s.output.tokens.insert(s.output.tokens.begin(), FromWire(d.first_token()));
  ExpectSameTokens(s.output, RunOnEngine(r));
  EXPECT_EQ(server_->worker().RequestsInFlight(), 0);
}

TEST_F(DecodeWorkerTest, DecodeThatComesBeforeItsKvWaitsForIt) {
  TestPrefill prefill;
  const GenerationRequest r{RequestId(5), RandomPrompt(70, 5), Seeded(16, 3)};
  wire::Landing landing;
  ASSERT_TRUE(Reserve(5, 70 + 16, &landing).ok());
  wire::DecodeRequest d = MakeDecode(r);
  *d.mutable_first_token() = prefill.Prefill(r);
  std::thread push([&] {
    absl::SleepFor(absl::Milliseconds(150));  // The Decode is parked by then.
    prefill.Push(r.id, landing, 70);
  });
  Stream s = Decode(d);
  push.join();
  ASSERT_TRUE(s.status.ok()) << s.status.error_message();
  s.output.tokens.insert(s.output.tokens.begin(), FromWire(d.first_token()));
  ExpectSameTokens(s.output, RunOnEngine(r));
}

TEST_F(DecodeWorkerTest, CancelMidStreamFreesTheBlocks) {
  const GenerationRequest r{RequestId(1), RandomPrompt(8, 1), Greedy(1900)};
  Stream s = Decode(MakeDecode(r), absl::Seconds(10), /*cancel_after=*/1);
  EXPECT_EQ(s.status.error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_LT(s.output.tokens.size(), 1900u);
  ExpectIdle();

  // The same for a request continued from a landing (its KV is whatever
  // the blocks held: this is about blocks, not tokens).
  wire::Landing landing;
  const grpc::Status reserved = Reserve(2, 8 + 1900, &landing);
  ASSERT_TRUE(reserved.ok()) << reserved.error_code() << ": " << reserved.error_message();
  TestPrefill prefill;
  prefill.Notify(landing, RequestId(2), 8);
  wire::DecodeRequest d =
      MakeDecode({RequestId(2), RandomPrompt(8, 1), Greedy(1900)});
  d.mutable_first_token()->set_token_id(7);
  s = Decode(d, absl::Seconds(10), /*cancel_after=*/1);
  EXPECT_EQ(s.status.error_code(), grpc::StatusCode::CANCELLED);
  ExpectIdle();
}

TEST_F(DecodeWorkerTest, DeadlineMidStreamFreesTheBlocks) {
  // builtin:tiny decodes 1900 tokens in about 0.3 s on a recent CPU, so a
  // deadline would race the last token; llama-110m takes several
  // milliseconds a token on one thread (a second buys a few hundred).
  DecodeServerOptions options = Options();
  options.worker.engine.model = "builtin:llama-110m";
  options.worker.engine.kv_cache_bytes = size_t{64} << 20;
  Start(options);
  const GenerationRequest r{RequestId(1), RandomPrompt(8, 1), Greedy(1900)};
  Stream s = Decode(MakeDecode(r), absl::Seconds(1));
  EXPECT_EQ(s.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_GT(s.output.tokens.size(), 0u);  // The deadline came mid-stream.
  EXPECT_LT(s.output.tokens.size(), 1900u);
  ExpectIdle();
}

TEST_F(DecodeWorkerTest, DeadlineWhileWaitingForKvFreesTheReservation) {
  DecodeServerOptions options = Options();
  options.worker.reservation_timeout = absl::Seconds(60);
  Start(options);
  wire::Landing landing;
  ASSERT_TRUE(Reserve(1, 40, &landing).ok());
  wire::DecodeRequest d =
      MakeDecode({RequestId(1), RandomPrompt(20, 1), Greedy(20)});
  d.mutable_first_token()->set_token_id(7);
  Stream s = Decode(d, absl::Milliseconds(200));
  EXPECT_EQ(s.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  ExpectIdle();  // Long before the reservation would expire.
}

TEST_F(DecodeWorkerTest, LandingDescribesThePool) {
  wire::Landing landing;
  ASSERT_TRUE(Reserve(1, 40, &landing).ok());
  EXPECT_EQ(landing.block_ids_size(), 3);  // 40 tokens in blocks of 16.
  EXPECT_EQ(landing.decode_worker_id(),
            absl::StrCat("decode-", server_->port()));
  ASSERT_EQ(landing.offers_size(), 1);
  EXPECT_EQ(landing.offers(0).transport(), "tcp");
  EXPECT_FALSE(landing.offers(0).endpoint().empty());
  EXPECT_EQ(landing.layout().block_size(), 16u);
  EXPECT_EQ(landing.layout().num_layers(), 4u);
  EXPECT_EQ(landing.layout().dtype(), "F32");
  EXPECT_EQ(landing.pool_blocks(), 128u);
  const wire::LoadReport load = Load();
  EXPECT_EQ(load.worker_id(), landing.decode_worker_id());
  EXPECT_EQ(load.role(), "decode");
  EXPECT_EQ(load.model(), "builtin:tiny");
  EXPECT_EQ(load.total_blocks(), 128u);
  EXPECT_EQ(load.free_blocks(), idle_ - 3);
  EXPECT_EQ(load.reservations(), 1u);
  EXPECT_EQ(load.layout().num_kv_heads(), landing.layout().num_kv_heads());
  EXPECT_TRUE(Release(1).ok());
}

bool HasKvTransport(const std::string& name) {
  const std::vector<std::string> built = kv::AvailableKvTransports();
  return std::find(built.begin(), built.end(), name) != built.end();
}

TEST_F(DecodeWorkerTest, LandingOffersEveryTransportInPreferenceOrder) {
  if (!HasKvTransport("ucx:shm")) GTEST_SKIP() << "ucx is not built";
  DecodeServerOptions options = Options();
  options.worker.kv_transport = "ucx:shm,tcp";
  // A released landing that ucx:shm (one-sided) could have written waits
  // out the quarantine before its blocks are free again.
  options.worker.kv_quarantine = absl::Milliseconds(300);
  Start(options);
  wire::Landing landing;
  ASSERT_TRUE(Reserve(1, 40, &landing).ok());
  ASSERT_EQ(landing.offers_size(), 2);
  EXPECT_EQ(landing.offers(0).transport(), "ucx:shm");
  EXPECT_TRUE(landing.offers(0).endpoint().starts_with("ucx://"));
  EXPECT_EQ(landing.offers(1).transport(), "tcp");
  EXPECT_FALSE(landing.offers(1).endpoint().empty());
  EXPECT_TRUE(landing.transport().empty())
      << "the single-offer fields stay unset";
  EXPECT_TRUE(Release(1).ok());
  // KV and its notification arriving over the second offer work as well.
  TestPrefill prefill;
  const GenerationRequest r{RequestId(2), RandomPrompt(70, 5), Greedy(12)};
  ExpectSameTokens(Disaggregated(prefill, r), RunOnEngine(r));
}

TEST(DecodeWorkerOptionsTest, BadTransportListsAreRefused) {
  auto code = [](const std::string& list) {
    DecodeWorkerOptions o;
    o.engine.kv_cache_bytes = kPoolBytes;
    o.engine.num_threads = 1;
    o.kv_transport = list;
    return DecodeWorker::Create(o).status().code();
  };
  constexpr auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(code(""), kInvalid);
  EXPECT_EQ(code("tcp,"), kInvalid);
  EXPECT_EQ(code("tcp,tcp"), kInvalid);
  EXPECT_EQ(code("tcp,a,b,c,d,e,f,g,h"), kInvalid) << "more than 8";
  EXPECT_EQ(code("tcp,carrier-pigeon"), absl::StatusCode::kNotFound);
  EXPECT_EQ(code("tcp,inproc"), absl::StatusCode::kOk);
}

TEST_F(DecodeWorkerTest, UnusedReservationExpiresAndFreesItsBlocks) {
  wire::Landing landing;
  ASSERT_TRUE(Reserve(1, 100, &landing).ok());
  EXPECT_EQ(Load().free_blocks(), idle_ - 7);
  ExpectIdle();
}

TEST_F(DecodeWorkerTest, DecodeWhoseKvNeverArrivesEndsWithDeadlineExceeded) {
  wire::Landing landing;
  ASSERT_TRUE(Reserve(1, 12, &landing).ok());
  wire::DecodeRequest d =
      MakeDecode({RequestId(1), RandomPrompt(8, 1), Greedy(4)});
  d.mutable_first_token()->set_token_id(7);
  const absl::Time start = absl::Now();
  Stream s = Decode(d);
  EXPECT_EQ(s.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED)
      << s.status.error_message();
  EXPECT_LT(absl::Now() - start, absl::Seconds(5));  // The worker's timeout.
  EXPECT_TRUE(s.output.tokens.empty());
  ExpectIdle();
}

TEST_F(DecodeWorkerTest, AReserveThatArrivesAfterItsReleaseIsRefused) {
  // The router releases a Reserve it got no answer to; after a partition
  // heals, the two may be handled in either order. The late Reserve must
  // not hold blocks until the reservation timeout.
  EXPECT_TRUE(Release(5).ok());
  wire::Landing landing;
  const grpc::Status late = Reserve(5, 12, &landing);
  EXPECT_EQ(late.error_code(), grpc::StatusCode::ABORTED) << late.error_message();
  EXPECT_NE(late.error_message().find("released before"), std::string::npos)
      << late.error_message();
  EXPECT_EQ(Load().free_blocks(), idle_);
  // Only once: another Reserve of the id is a new one (the router never
  // reuses an id, but the worker does not rely on that).
  ASSERT_TRUE(Reserve(5, 12, &landing).ok());
  EXPECT_LT(Load().free_blocks(), idle_);
  EXPECT_TRUE(Release(5).ok());
  EXPECT_EQ(Load().free_blocks(), idle_);
  ExpectIdle();
}

TEST_F(DecodeWorkerTest, ReleaseFreesAReservationAndEndsItsWaitingDecode) {
  wire::Landing landing;
  ASSERT_TRUE(Reserve(1, 12, &landing).ok());
  EXPECT_TRUE(Release(1).ok());
  EXPECT_EQ(Load().free_blocks(), idle_);
  EXPECT_TRUE(Release(999).ok());  // Unknown ids are fine.
  EXPECT_TRUE(Release(0).ok());

  ASSERT_TRUE(Reserve(2, 12, &landing).ok());
  wire::DecodeRequest d =
      MakeDecode({RequestId(2), RandomPrompt(8, 1), Greedy(4)});
  d.mutable_first_token()->set_token_id(7);
  std::thread release([&] {
    absl::SleepFor(absl::Milliseconds(100));
    EXPECT_TRUE(Release(2).ok());
  });
  Stream s = Decode(d);
  release.join();
  EXPECT_EQ(s.status.error_code(), grpc::StatusCode::ABORTED);
  ExpectIdle();
}

TEST_F(DecodeWorkerTest, BadReservationsAreRefused) {
  wire::Landing landing;
  EXPECT_EQ(Reserve(0, 12, &landing).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Reserve(1, 0, &landing).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Reserve(1, 4097, &landing).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT)
      << "beyond the model's context";
  EXPECT_EQ(Reserve(1, 0xffffffffu, &landing).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Reserve(1, 4096, &landing).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED)
      << "a 4 MiB pool holds 2048 tokens";
  ASSERT_TRUE(Reserve(2, 1600, &landing).ok());
  EXPECT_EQ(Reserve(3, 1600, &landing).error_code(),
            grpc::StatusCode::RESOURCE_EXHAUSTED)
      << "not free now";
  EXPECT_EQ(Reserve(2, 12, &landing).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT)
      << "duplicate id";
  EXPECT_TRUE(Release(2).ok());
  EXPECT_TRUE(Reserve(3, 1600, &landing).ok());
  EXPECT_TRUE(Release(3).ok());
}

TEST_F(DecodeWorkerTest, BadDecodesAreRefused) {
  auto code = [&](const wire::DecodeRequest& d) {
    Stream s = Decode(d);
    EXPECT_TRUE(s.output.tokens.empty());
    return s.status.error_code();
  };
  const GenerationRequest good{RequestId(1), RandomPrompt(8, 1), Greedy(4)};
  wire::DecodeRequest d = MakeDecode(good);
  d.mutable_request()->set_request_id(0);
  EXPECT_EQ(code(d), grpc::StatusCode::INVALID_ARGUMENT);
  d = MakeDecode(good);
  d.mutable_request()->clear_prompt();
  EXPECT_EQ(code(d), grpc::StatusCode::INVALID_ARGUMENT);
  d = MakeDecode(good);
  d.mutable_request()->set_prompt(3, 258);  // Outside the vocabulary.
  EXPECT_EQ(code(d), grpc::StatusCode::INVALID_ARGUMENT);
  d = MakeDecode(good);
  d.mutable_request()->set_prompt(3, -1);
  EXPECT_EQ(code(d), grpc::StatusCode::INVALID_ARGUMENT);
  d = MakeDecode(good);
  d.mutable_request()->set_max_tokens(0);
  EXPECT_EQ(code(d), grpc::StatusCode::INVALID_ARGUMENT);
  d = MakeDecode(good);
  d.mutable_request()->set_top_p(0.0f);
  EXPECT_EQ(code(d), grpc::StatusCode::INVALID_ARGUMENT);
  d = MakeDecode(good);
  d.mutable_request()->set_temperature(-1.0f);
  EXPECT_EQ(code(d), grpc::StatusCode::INVALID_ARGUMENT);
  d = MakeDecode(good);
  d.mutable_request()->set_logprobs(1000);
  EXPECT_EQ(code(d), grpc::StatusCode::INVALID_ARGUMENT);
  // Logit processing out of range, as a peer could send it.
  d = MakeDecode(good);
  d.mutable_request()->set_presence_penalty(5.0f);
  EXPECT_EQ(code(d), grpc::StatusCode::INVALID_ARGUMENT);
  d = MakeDecode(good);
  d.mutable_request()->set_repetition_penalty(-1.0f);
  EXPECT_EQ(code(d), grpc::StatusCode::INVALID_ARGUMENT);
  d = MakeDecode(good);
  (*d.mutable_request()->mutable_logit_bias())[258] = 1.0f;
  EXPECT_EQ(code(d), grpc::StatusCode::INVALID_ARGUMENT);
  d = MakeDecode(good);
  (*d.mutable_request()->mutable_logit_bias())[3] = NAN;
  EXPECT_EQ(code(d), grpc::StatusCode::INVALID_ARGUMENT);
  d = MakeDecode(good);
  d.mutable_request()->set_prompt_logprobs(21);
  EXPECT_EQ(code(d), grpc::StatusCode::INVALID_ARGUMENT);
  d = MakeDecode(good);
  d.mutable_request()->set_max_tokens(4090);  // Beyond the context.
  EXPECT_EQ(code(d), grpc::StatusCode::INVALID_ARGUMENT);
  d = MakeDecode(good);
  d.mutable_request()->set_max_tokens(3000);  // Beyond the pool, ever.
  EXPECT_EQ(code(d), grpc::StatusCode::RESOURCE_EXHAUSTED);

  // With a first token: no reservation.
  d = MakeDecode(good);
  d.mutable_first_token()->set_token_id(7);
  EXPECT_EQ(code(d), grpc::StatusCode::NOT_FOUND);

  // A reserved id is for a Decode with a first token only.
  wire::Landing landing;
  ASSERT_TRUE(Reserve(1, 12, &landing).ok());
  EXPECT_EQ(code(MakeDecode(good)), grpc::StatusCode::INVALID_ARGUMENT);
  TestPrefill prefill;
  // A first token outside the vocabulary; the reservation goes with it.
  prefill.Notify(landing, RequestId(1), 8);
  d = MakeDecode(good);
  d.mutable_first_token()->set_token_id(258);
  EXPECT_EQ(code(d), grpc::StatusCode::INVALID_ARGUMENT);
  // Its blocks come back once the KvComplete sent above has landed, which
  // may be after the refusal (a clean-clone CI run here saw the
  // reservation still held at the refusal).
  ExpectIdle();
  // KvComplete for fewer tokens than the prompt has: the hand-off went
  // wrong, not the request (DATA_LOSS, which the router prefills again).
  ASSERT_TRUE(Reserve(1, 12, &landing).ok());
  prefill.Notify(landing, RequestId(1), 5);
  d = MakeDecode(good);
  d.mutable_first_token()->set_token_id(7);
  EXPECT_EQ(code(d), grpc::StatusCode::DATA_LOSS);
  // max_tokens 1: the first token was the last.
  ASSERT_TRUE(Reserve(1, 12, &landing).ok());
  prefill.Notify(landing, RequestId(1), 8);
  d.mutable_request()->set_max_tokens(1);
  EXPECT_EQ(code(d), grpc::StatusCode::INVALID_ARGUMENT);
  // A reservation smaller than prompt + max_tokens.
  ASSERT_TRUE(Reserve(1, 16, &landing).ok());
  prefill.Notify(landing, RequestId(1), 8);
  d.mutable_request()->set_max_tokens(20);
  EXPECT_EQ(code(d), grpc::StatusCode::INVALID_ARGUMENT);
}

TEST_F(DecodeWorkerTest, SecondDecodeOfAWaitingReservationIsRefused) {
  TestPrefill prefill;
  const GenerationRequest r{RequestId(1), RandomPrompt(30, 2), Greedy(10)};
  wire::Landing landing;
  ASSERT_TRUE(Reserve(1, 40, &landing).ok());
  wire::DecodeRequest d = MakeDecode(r);
  *d.mutable_first_token() = prefill.Prefill(r);
  Stream first;
  std::thread waiting([&] { first = Decode(d); });
  absl::SleepFor(absl::Milliseconds(100));  // The first one is parked.
  Stream second = Decode(d);
  EXPECT_EQ(second.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  // The refused call took nothing from the first.
  prefill.Push(r.id, landing, 30);
  waiting.join();
  ASSERT_TRUE(first.status.ok()) << first.status.error_message();
  first.output.tokens.insert(first.output.tokens.begin(),
                             FromWire(d.first_token()));
  ExpectSameTokens(first.output, RunOnEngine(r));
}

TEST_F(DecodeWorkerTest, NotificationsThatAreNotOursAreIgnored) {
  TestPrefill prefill;
  const GenerationRequest r{RequestId(1), RandomPrompt(8, 1), Greedy(4)};
  wire::Landing landing;
  ASSERT_TRUE(Reserve(1, 12, &landing).ok());
  kv::KvConnection& conn = prefill.ConnectionTo(landing.offers(0).endpoint());
  EXPECT_TRUE(conn.Notify("\xff\xff not a proto").ok());
  EXPECT_TRUE(conn.Notify("").ok());
  EXPECT_TRUE(conn.Notify(std::string(1000, '\x0a')).ok());
  prefill.Notify(landing, RequestId(12345),
                 8);  // Unknown id.
  prefill.Notify(landing, RequestId(0), 8);
  // Raw bytes on the KV port that are no frame at all.
  {
    const size_t colon = landing.offers(0).endpoint().rfind(':');
    ASSERT_NE(colon, std::string::npos);
    int port = 0;
    ASSERT_TRUE(absl::SimpleAtoi(landing.offers(0).endpoint().substr(colon + 1),
                                 &port));
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(static_cast<uint16_t>(port));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)),
              0);
    std::mt19937 rng(1);
    std::vector<char> junk(64 << 10);
    for (char& c : junk) c = static_cast<char>(rng());
    (void)!::send(fd, junk.data(), junk.size(), MSG_NOSIGNAL);
    ::close(fd);
  }
  // The worker is still healthy: the reserved request decodes.
  wire::DecodeRequest d = MakeDecode(r);
  *d.mutable_first_token() = prefill.Prefill(r);
  prefill.Push(r.id, landing, 8);
  Stream s = Decode(d);
  ASSERT_TRUE(s.status.ok()) << s.status.error_message();
  s.output.tokens.insert(s.output.tokens.begin(), FromWire(d.first_token()));
  ExpectSameTokens(s.output, RunOnEngine(r));
}

// A prefilled request that waits for a slot in a full running batch, then
// is cancelled, must give back its reserved blocks.
// Disabled: Generator::Cancel drops a waiting AddPrefilled sequence without
// releasing its blocks (engine/generator.cc); enable with the engine fix.
TEST_F(DecodeWorkerTest, CancelWhileWaitingForABatchSlotFreesBlocks) {
  DecodeServerOptions options = Options();
  options.worker.engine.max_running = 1;
  options.worker.engine.kv_cache_bytes = size_t{16} << 20;  // 8192 tokens.
  Start(options);
  // The busy request holds the only slot until request 2 has given up:
  // it could not finish first (4000 tokens) unless the machine decoded
  // faster than ~25k tokens/s.
  std::atomic<bool> release_slot = false;
  std::thread busy([&] {
    const GenerationRequest r{RequestId(1), RandomPrompt(8, 1), Greedy(4000)};
    const grpc::Status s =
        Decode(MakeDecode(r), absl::Seconds(120), 0, &release_slot).status;
    EXPECT_EQ(s.error_code(), grpc::StatusCode::CANCELLED) << s.error_message();
  });
  absl::SleepFor(absl::Milliseconds(50));
  wire::Landing landing;
  ASSERT_TRUE(Reserve(2, 20, &landing).ok());
  TestPrefill prefill;
  prefill.Notify(landing, RequestId(2), 8);
  wire::DecodeRequest d =
      MakeDecode({RequestId(2), RandomPrompt(8, 1), Greedy(10)});
  d.mutable_first_token()->set_token_id(7);
  EXPECT_EQ(Decode(d, absl::Milliseconds(100)).status.error_code(),
            grpc::StatusCode::DEADLINE_EXCEEDED);
  release_slot = true;
  busy.join();
  ExpectIdle();
}

// pd-decode as a process: it writes its port file, serves, and exits 0 on
// SIGTERM.
TEST(PdDecodeProcessTest, ServesAndExitsCleanlyOnSigterm) {
  const std::string binary =
      absl::StrCat(PDSERVE_BINARY_DIR, "/decode_worker/pd-decode");
  const std::string port_file =
      absl::StrCat(::testing::TempDir(), "/pd-decode-", ::getpid(), ".port");
  std::remove(port_file.c_str());
  std::vector<std::string> args = {binary,
                                   "--port_file=" + port_file,
                                   "--kv_cache_mb=4",
                                   "--num_threads=1",
                                   "--max_batch_tokens=64",
                                   "--worker_id=decode-under-test"};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = 0;
  ASSERT_EQ(::posix_spawn(&pid, binary.c_str(), nullptr, nullptr, argv.data(),
                          environ),
            0)
      << binary;
  int port = 0;
  for (int i = 0; i < 300 && port == 0; ++i) {
    std::ifstream in(port_file);
    if (!(in >> port)) {
      port = 0;
      absl::SleepFor(absl::Milliseconds(50));
    }
  }
  ASSERT_GT(port, 0) << "no port file";
  auto stub = wire::DecodeWorker::NewStub(grpc::CreateChannel(
      absl::StrCat("127.0.0.1:", port), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  wire::LoadReport load;
  ASSERT_TRUE(stub->GetLoad(&ctx, {}, &load).ok());
  EXPECT_EQ(load.worker_id(), "decode-under-test");
  EXPECT_EQ(load.total_blocks(), 128u);

  ASSERT_EQ(::kill(pid, SIGTERM), 0);
  int status = 0;
  pid_t done = 0;
  for (int i = 0; i < 200 && done == 0; ++i) {
    done = ::waitpid(pid, &status, WNOHANG);
    if (done == 0) absl::SleepFor(absl::Milliseconds(50));
  }
  if (done == 0) ::kill(pid, SIGKILL);
  ASSERT_EQ(done, pid) << "pd-decode did not exit within 10 s of SIGTERM";
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  std::remove(port_file.c_str());
}

}  // namespace
}  // namespace pdserve
