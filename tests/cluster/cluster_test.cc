// The disaggregated cluster end to end, as separate processes on loopback
// (deploy/local/cluster.sh): outputs equal the colocated engine's token for
// token, cancellation and deadlines free the decode worker's blocks, a
// killed prefill worker is retried around, a killed decode worker ends only
// its own streams, bad requests are refused, and overload is refused.
#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine/builtin_tiny.h"
#include "engine/generator.h"
#include "engine/model_files/llama2c.h"
#include "engine/sampler.h"
#include "gtest/gtest.h"
#include "kv_transfer/transport.h"
#include "nlohmann/json.hpp"
#include "tests/cluster/local_cluster.h"
#include "tests/cluster/stream_case.h"
#include "tests/engine/test_util.h"
#if PDSERVE_HAVE_CUDA
#include "engine/cuda/cuda_model_runner.h"
#endif

namespace pdserve {
namespace {

using testing_util::RandomPrompt;

namespace v1 = ::pdserve::v1;
using testing_util::ClusterSpec;
using testing_util::LocalCluster;

struct StreamResult {
  grpc::Status status;
  std::vector<int32_t> tokens;
  std::string text;
  v1::FinishReason finish = v1::FINISH_REASON_UNSPECIFIED;
  v1::Usage usage;
  int messages = 0;
};

// Runs one Generate stream to its end. `on_message` returning false cancels
// the call.
StreamResult Generate(v1::Generation::Stub& stub,
                      const v1::GenerateRequest& request,
                      absl::Duration deadline = absl::Seconds(120),
                      const std::function<bool(const v1::GenerateResponse&)>&
                          on_message = nullptr) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + deadline));
  StreamResult out;
  auto reader = stub.Generate(&ctx, request);
  v1::GenerateResponse r;
  while (reader->Read(&r)) {
    ++out.messages;
    out.tokens.insert(out.tokens.end(), r.token_ids().begin(),
                      r.token_ids().end());
    out.text += r.text();
    if (r.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      out.finish = r.finish_reason();
      out.usage = r.usage();
    }
    if (on_message && !on_message(r)) ctx.TryCancel();
  }
  out.status = reader->Finish();
  return out;
}

using Case = testing_util::StreamCase;
using testing_util::ToRequest;

// The colocated engine's tokens for each case, computed in this process.
std::vector<std::vector<int32_t>> Colocated(const std::vector<Case>& cases) {
  auto model = MakeTinyModel();
  EXPECT_TRUE(model.ok());
  auto runner =
      CreateModelRunner(*model, {.num_kv_blocks = 512, .num_threads = 1});
  EXPECT_TRUE(runner.ok());
  auto g = Generator::Create(runner->get(), {});
  EXPECT_TRUE(g.ok());
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_TRUE(
        (*g)->Add({RequestId(i), cases[i].prompt, cases[i].sampling}).ok());
  }
  std::vector<std::vector<int32_t>> out(cases.size());
  std::vector<GenerationEvent> events;
  while ((*g)->HasWork()) {
    events.clear();
    EXPECT_TRUE((*g)->Step(events).ok());
    for (const auto& e : events) {
      if (e.has_token) out[e.id.value].push_back(e.token.token);
    }
  }
  return out;
}

// 32 requests: prompt lengths from 1 to 300 (the workers' prefill chunk is
// 64), greedy and seeded, with and without EOS.
std::vector<Case> MixedCases(uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<Case> cases;
  for (int i = 0; i < 32; ++i) {
    const int len = i % 4 == 0 ? 150 + static_cast<int>(rng() % 150)
                               : 1 + static_cast<int>(rng() % 60);
    SamplingParams sp{.temperature = 0.0f,
                      .max_tokens = 8 + static_cast<int32_t>(rng() % 24)};
    if (i % 2 == 1) {
      sp.temperature = 0.8f;
      sp.top_p = 0.95f;
      sp.seed = rng();
    }
    sp.ignore_eos = i % 3 != 0;
    cases.push_back({RandomPrompt(len, rng()), sp});
  }
  return cases;
}

std::vector<StreamResult> RunConcurrently(v1::Generation::Stub& stub,
                                          const std::vector<Case>& cases) {
  std::vector<StreamResult> results(cases.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < cases.size(); ++i) {
    threads.emplace_back(
        [&, i] { results[i] = Generate(stub, ToRequest(cases[i])); });
  }
  for (auto& t : threads) t.join();
  return results;
}

// Runs MixedCases through a cluster of `spec` (the first `num_cases` of
// them), checks them against the colocated engine, then calls `then`.
void ExpectEqualsColocated(
    const ClusterSpec& spec, size_t num_cases = 32,
    const std::function<void(LocalCluster&)>& then = nullptr) {
  auto started = LocalCluster::Start(spec);
  ASSERT_TRUE(started.ok()) << started.status();
  LocalCluster& cluster = **started;
  std::vector<Case> cases = MixedCases(spec.prefill * 10 + spec.decode);
  cases.resize(std::min(cases.size(), num_cases));
  const std::vector<std::vector<int32_t>> want = Colocated(cases);
  const std::vector<StreamResult> got =
      RunConcurrently(cluster.router(), cases);
  for (size_t i = 0; i < cases.size(); ++i) {
    ASSERT_TRUE(got[i].status.ok())
        << i << ": " << got[i].status.error_message();
    EXPECT_EQ(got[i].tokens, want[i])
        << "request " << i << ", prompt " << cases[i].prompt.size();
    EXPECT_NE(got[i].finish, v1::FINISH_REASON_UNSPECIFIED);
    EXPECT_EQ(got[i].usage.prompt_tokens(), cases[i].prompt.size());
    EXPECT_EQ(got[i].usage.completion_tokens(), want[i].size());
  }
  if (then) then(cluster);
}

// Every test's clusters must give back every KV block they held.
const bool kLeakCheck = [] {
  LocalCluster::on_kv_leak = [](const std::string& leak) {
    ADD_FAILURE() << "KV leak: " << leak;
  };
  return true;
}();

TEST(ClusterTest, OnePrefillOneDecodeEqualsColocated) {
  ExpectEqualsColocated({.prefill = 1, .decode = 1});
}

TEST(ClusterTest, TwoPrefillTwoDecodeEqualsColocated) {
  ExpectEqualsColocated({.prefill = 2, .decode = 2});
}

TEST(ClusterTest, WithoutPrefillWorkersDecodeWorkersPrefillLocally) {
  ExpectEqualsColocated({.prefill = 0, .decode = 1});
}

bool HasKvTransport(const std::string& name) {
  const std::vector<std::string> built = kv::AvailableKvTransports();
  return std::find(built.begin(), built.end(), name) != built.end();
}

// KV pushes per transport of `prefill`, as `pdctl status` shows them (the
// router's Health, from the worker's load reports), once at least
// `at_least` pushes are reported; transports with none are left out.
std::map<std::string, uint64_t> PushesByTransport(LocalCluster& cluster,
                                                  const std::string& prefill,
                                                  uint64_t at_least) {
  std::map<std::string, uint64_t> pushes;
  for (int attempt = 0; attempt < 50; ++attempt) {
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    v1::HealthResponse health;
    EXPECT_TRUE(cluster.router().Health(&ctx, {}, &health).ok());
    pushes.clear();
    uint64_t total = 0;
    for (const v1::WorkerStatus& w : health.workers()) {
      if (w.id() != prefill) continue;
      for (const v1::KvTransportUsage& t : w.kv_transports()) {
        // A worker reports every transport it runs, used or not.
        if (t.pushes() == 0) continue;
        pushes[t.transport()] = t.pushes();
        total += t.pushes();
      }
    }
    if (total >= at_least) break;
    absl::SleepFor(absl::Milliseconds(100));  // The router polls every 100 ms.
  }
  return pushes;
}

constexpr char kWorkerArgs[] =
    "--num_threads=1 --max_batch_tokens=64 --kv_cache_mb=16";

// 1P1D with every request's KV over `transport`, counted as such.
void ExpectOverTransportEqualsColocated(const std::string& transport) {
  if (!HasKvTransport(transport)) GTEST_SKIP() << transport << " is not built";
  const std::string args =
      absl::StrCat(kWorkerArgs, " --kv_transport=", transport);
  ExpectEqualsColocated(
      {.prefill = 1, .decode = 1, .prefill_args = args, .decode_args = args},
      /*num_cases=*/12, [&](LocalCluster& cluster) {
        EXPECT_EQ(PushesByTransport(cluster, "prefill-0", 12),
                  (std::map<std::string, uint64_t>{{transport, 12}}));
      });
}

TEST(ClusterTest, OnePrefillOneDecodeOverUcxSharedMemoryEqualsColocated) {
  ExpectOverTransportEqualsColocated("ucx:shm");
}

TEST(ClusterTest, OnePrefillOneDecodeOverUcxTcpEqualsColocated) {
  ExpectOverTransportEqualsColocated("ucx:tcp");
}

// The decode worker offers ucx:shm and tcp; the prefill worker runs only
// tcp, so every request's KV goes over tcp.
TEST(ClusterTest, DecodeOffersUcxAndTcpPrefillRunsTcpEqualsColocated) {
  if (!HasKvTransport("ucx:shm")) GTEST_SKIP() << "ucx is not built";
  ExpectEqualsColocated(
      {.prefill = 1,
       .decode = 1,
       .prefill_args = absl::StrCat(kWorkerArgs, " --kv_transport=tcp"),
       .decode_args = absl::StrCat(kWorkerArgs, " --kv_transport=ucx:shm,tcp")},
      /*num_cases=*/12, [](LocalCluster& cluster) {
        EXPECT_EQ(PushesByTransport(cluster, "prefill-0", 12),
                  (std::map<std::string, uint64_t>{{"tcp", 12}}));
      });
}

TEST(ClusterTest, Stories260kThroughTheClusterGivesThePublishedText) {
  namespace fs = std::filesystem;
  const fs::path src = fs::path(PDSERVE_MODELS_DIR) / "stories260K";
  const fs::path dir =
      fs::path(PDSERVE_BINARY_DIR) / "test-models/stories260K-cluster";
  ASSERT_TRUE(
      ConvertLlama2cToHf(src / "stories260K.bin", src / "tok512.bin", dir)
          .ok());
  std::ifstream in(std::string(PDSERVE_FIXTURES_DIR) +
                   "/stories260k_greedy.json");
  const nlohmann::json ref = nlohmann::json::parse(in);
  const auto want = ref["tokens"].get<std::vector<int32_t>>();

  auto started =
      LocalCluster::Start({.prefill = 1, .decode = 1, .model = dir.string()});
  ASSERT_TRUE(started.ok()) << started.status();
  LocalCluster& cluster = **started;
  v1::GenerateRequest r;
  for (int32_t id : ref["prompt_ids"].get<std::vector<int32_t>>())
    r.mutable_token_ids()->add_ids(id);
  r.mutable_sampling()->set_temperature(0.0f);
  r.set_max_tokens(want.size());
  r.set_ignore_eos(true);
  const StreamResult got = Generate(cluster.router(), r);
  ASSERT_TRUE(got.status.ok()) << got.status.error_message();
  EXPECT_EQ(got.tokens, want);
  EXPECT_TRUE(
      got.text.starts_with("Once upon a time, there was a little girl named "
                           "Lily. She loved to play outside in the park."))
      << got.text;
}

int32_t FreeBlocks(LocalCluster& cluster, const std::string& decode) {
  auto stub = cluster.DecodeStub(decode);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  pdserve::internal::v1::LoadReport load;
  EXPECT_TRUE(stub->GetLoad(&ctx, {}, &load).ok());
  return static_cast<int32_t>(load.free_blocks());
}

// Polls until the decode worker is idle again (frees happen asynchronously
// after a call ends).
void ExpectBlocksReturnTo(LocalCluster& cluster, int32_t idle) {
  int32_t free = -1;
  for (int i = 0; i < 100 && free != idle; ++i) {
    free = FreeBlocks(cluster, "decode-0");
    if (free != idle) absl::SleepFor(absl::Milliseconds(50));
  }
  EXPECT_EQ(free, idle);
}

pdserve::internal::v1::LoadReport Load(LocalCluster& cluster,
                                       const std::string& worker) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
  pdserve::internal::v1::LoadReport load;
  const grpc::Status status =
      worker.starts_with("prefill")
          ? cluster.PrefillStub(worker)->GetLoad(&ctx, {}, &load)
          : cluster.DecodeStub(worker)->GetLoad(&ctx, {}, &load);
  EXPECT_TRUE(status.ok()) << status.error_message();
  return load;
}

// n = 4 choices of one 100-token prompt, seeded and with penalties: choice
// i equals the colocated engine run with seed ChoiceSeed(seed, i), and the
// prompt's KV is computed once — the prefill worker computes the prompt,
// the decode worker takes 96 tokens (6 full blocks) of it from its prefix
// cache for each other choice and computes only the 4-token tail.
TEST(ClusterTest, ChoicesShareThePromptsKvComputedOnce) {
  auto started = LocalCluster::Start({.prefill = 1, .decode = 1});
  ASSERT_TRUE(started.ok()) << started.status();
  LocalCluster& cluster = **started;
  const SamplingParams sp{.temperature = 0.8f,
                          .seed = 1234,
                          .max_tokens = 12,
                          .ignore_eos = true,
                          .presence_penalty = 0.5f,
                          .frequency_penalty = 0.3f,
                          .repetition_penalty = 1.2f,
                          .logit_bias = {{65, 2.0f}, {66, -3.0f}}};
  const std::vector<int32_t> prompt = RandomPrompt(100, 99);
  std::vector<Case> cases;
  for (uint32_t i = 0; i < 4; ++i) {
    SamplingParams choice = sp;
    choice.seed = ChoiceSeed(*sp.seed, i);
    cases.push_back({prompt, choice});
  }
  const std::vector<std::vector<int32_t>> want = Colocated(cases);
  v1::GenerateRequest request = ToRequest(cases[0]);
  request.set_n(4);
  v1::SamplingParams* s = request.mutable_sampling();
  s->set_presence_penalty(sp.presence_penalty);
  s->set_frequency_penalty(sp.frequency_penalty);
  s->set_repetition_penalty(sp.repetition_penalty);
  for (const auto& [id, bias] : sp.logit_bias)
    (*s->mutable_logit_bias())[id] = bias;

  const auto prefill_before = Load(cluster, "prefill-0");
  const auto decode_before = Load(cluster, "decode-0");
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
  auto reader = cluster.router().Generate(&ctx, request);
  std::map<uint32_t, std::vector<int32_t>> got;
  std::map<uint32_t, v1::Usage> usage;
  v1::GenerateResponse m;
  while (reader->Read(&m)) {
    got[m.index()].insert(got[m.index()].end(), m.token_ids().begin(),
                          m.token_ids().end());
    if (m.finish_reason() != v1::FINISH_REASON_UNSPECIFIED)
      usage[m.index()] = m.usage();
  }
  const grpc::Status status = reader->Finish();
  ASSERT_TRUE(status.ok()) << status.error_message();
  ASSERT_EQ(got.size(), 4u);
  for (uint32_t i = 0; i < 4; ++i) {
    EXPECT_EQ(got[i], want[i]) << "choice " << i;
    EXPECT_EQ(usage[i].prompt_tokens(), 100u);
    EXPECT_EQ(usage[i].completion_tokens(), 12u);
  }
  EXPECT_NE(want[0], want[1]);
  const auto prefill_after = Load(cluster, "prefill-0");
  const auto decode_after = Load(cluster, "decode-0");
  EXPECT_EQ(prefill_after.computed_prompt_tokens() -
                prefill_before.computed_prompt_tokens(),
            100u);
  EXPECT_EQ(decode_after.prefix_cached_tokens() -
                decode_before.prefix_cached_tokens(),
            3u * 96);
  EXPECT_EQ(decode_after.computed_prompt_tokens() -
                decode_before.computed_prompt_tokens(),
            3u * 4);
}

// Prompt logprobs through the public API: equal prefilled on a prefill
// worker (disaggregated, chunks of 64) or on the decode worker (colocated),
// and equal to the engine's in this process.
TEST(ClusterTest, PromptLogprobsAreEqualColocatedAndDisaggregated) {
  const std::vector<int32_t> prompt = RandomPrompt(150, 5);
  const Case c{prompt,
               {.temperature = 0.0f,
                .max_tokens = 3,
                .ignore_eos = true,
                .prompt_logprobs = 2}};
  // In this process.
  auto model = MakeTinyModel();
  ASSERT_TRUE(model.ok());
  auto runner =
      CreateModelRunner(*model, {.num_kv_blocks = 64, .num_threads = 1});
  ASSERT_TRUE(runner.ok());
  auto g = Generator::Create(runner->get(), {});
  ASSERT_TRUE(g.ok());
  ASSERT_TRUE((*g)->Add({RequestId(1), prompt, c.sampling}).ok());
  std::vector<SampledToken> want;
  std::vector<GenerationEvent> events;
  while ((*g)->HasWork()) {
    events.clear();
    ASSERT_TRUE((*g)->Step(events).ok());
    for (GenerationEvent& e : events) {
      if (!e.prompt_logprobs.empty()) want = std::move(e.prompt_logprobs);
    }
  }
  ASSERT_EQ(want.size(), prompt.size() - 1);

  v1::GenerateRequest request = ToRequest(c);
  request.set_prompt_logprobs(2);
  for (int prefill : {1, 0}) {
    SCOPED_TRACE(prefill ? "disaggregated" : "colocated");
    auto started = LocalCluster::Start({.prefill = prefill, .decode = 1});
    ASSERT_TRUE(started.ok()) << started.status();
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
    auto reader = (*started)->router().Generate(&ctx, request);
    std::vector<v1::GenerateResponse> messages;
    v1::GenerateResponse m;
    while (reader->Read(&m)) messages.push_back(m);
    const grpc::Status status = reader->Finish();
    ASSERT_TRUE(status.ok()) << status.error_message();
    ASSERT_FALSE(messages.empty());
    const v1::GenerateResponse& first = messages[0];
    ASSERT_EQ(first.prompt_logprobs_size(), static_cast<int>(want.size()));
    for (size_t i = 0; i < want.size(); ++i) {
      const v1::TokenLogprobs& lp = first.prompt_logprobs(static_cast<int>(i));
      EXPECT_EQ(lp.token_id(), prompt[i + 1]);
      EXPECT_NEAR(lp.logprob(), want[i].logprob, 1e-5) << "position " << i + 1;
      ASSERT_EQ(lp.top_size(), 2);
      EXPECT_EQ(lp.top(0).token_id(), want[i].top_logprobs[0].token);
      EXPECT_NEAR(lp.top(0).logprob(), want[i].top_logprobs[0].logprob, 1e-5);
    }
    for (size_t i = 1; i < messages.size(); ++i)
      EXPECT_EQ(messages[i].prompt_logprobs_size(), 0);
  }
}

TEST(ClusterTest, CancelAndDeadlineFreeTheDecodeWorkersBlocks) {
  // builtin:tiny streams 2000 tokens in well under a second on a recent
  // CPU, so a deadline would race the last token; llama-110m takes
  // several milliseconds a token on one thread.
  auto started = LocalCluster::Start(
      {.prefill = 1,
       .decode = 1,
       .model = "builtin:llama-110m",
       .decode_args =
           "--num_threads=1 --max_batch_tokens=64 --kv_cache_mb=64 --kv_canary"});
  ASSERT_TRUE(started.ok()) << started.status();
  LocalCluster& cluster = **started;
  const int32_t idle = FreeBlocks(cluster, "decode-0");
  Case short_case{RandomPrompt(20, 2),
                  {.temperature = 0.0f, .max_tokens = 5, .ignore_eos = true}};
  const StreamResult before = Generate(cluster.router(), ToRequest(short_case));
  ASSERT_TRUE(before.status.ok()) << before.status.error_message();
  ASSERT_EQ(before.tokens.size(), 5u);
  ExpectBlocksReturnTo(cluster, idle);
  Case long_case{RandomPrompt(100, 1),
                 {.temperature = 0.0f, .max_tokens = 2000, .ignore_eos = true}};

  // Cancel after a few messages.
  StreamResult cancelled =
      Generate(cluster.router(), ToRequest(long_case), absl::Seconds(60),
               [](const v1::GenerateResponse&) { return false; });
  EXPECT_EQ(cancelled.status.error_code(), grpc::StatusCode::CANCELLED);
  ExpectBlocksReturnTo(cluster, idle);

  // A deadline that passes mid-stream.
  StreamResult late =
      Generate(cluster.router(), ToRequest(long_case), absl::Seconds(1));
  EXPECT_EQ(late.status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  EXPECT_GT(late.tokens.size(), 0u);  // It came mid-stream.
  EXPECT_LT(late.tokens.size(), 2000u);
  ExpectBlocksReturnTo(cluster, idle);

  // Still serving: the tokens it gave before the cancelled and the expired
  // requests (colocated equality is ExpectEqualsColocated's, on tiny).
  EXPECT_EQ(Generate(cluster.router(), ToRequest(short_case)).tokens,
            before.tokens);
  ExpectBlocksReturnTo(cluster, idle);
}

TEST(ClusterTest, KilledPrefillWorkerUnderLoadEveryRequestStillCompletes) {
  auto started = LocalCluster::Start({.prefill = 2, .decode = 1});
  ASSERT_TRUE(started.ok()) << started.status();
  LocalCluster& cluster = **started;
  std::vector<Case> cases;
  for (int i = 0; i < 16; ++i) {
    cases.push_back(
        {RandomPrompt(200 + 10 * i, 100 + i),
         {.temperature = 0.0f, .max_tokens = 8, .ignore_eos = true}});
  }
  const auto want = Colocated(cases);
  // Killed as soon as it is computing prompts.
  std::thread killer([&] {
    auto prefill = cluster.PrefillStub("prefill-0");
    for (int i = 0; i < 5000; ++i) {
      grpc::ClientContext ctx;
      pdserve::internal::v1::LoadReport load;
      if (prefill->GetLoad(&ctx, {}, &load).ok() &&
          load.running() + load.waiting() > 0)
        break;
      absl::SleepFor(absl::Milliseconds(1));
    }
    EXPECT_TRUE(cluster.Kill("prefill-0"));
  });
  const std::vector<StreamResult> got =
      RunConcurrently(cluster.router(), cases);
  killer.join();
  for (size_t i = 0; i < cases.size(); ++i) {
    ASSERT_TRUE(got[i].status.ok())
        << i << ": " << got[i].status.error_message();
    EXPECT_EQ(got[i].tokens, want[i]) << i;
  }
  // The kill hit prefills in flight, which the router retried elsewhere.
  EXPECT_TRUE(cluster.Log("router").find("prefill worker prefill-0") !=
              std::string::npos)
      << "no prefill was in flight on prefill-0 when it was killed";
  // And afterwards, on the surviving worker.
  EXPECT_EQ(Generate(cluster.router(), ToRequest(cases[0])).tokens, want[0]);
}

// Without migration (migration_test.cc has it): the streams of a killed
// decode worker end, the others do not.
TEST(ClusterTest, KilledDecodeWorkerEndsOnlyItsStreamsAndIsNoLongerChosen) {
  ClusterSpec spec{.prefill = 1, .decode = 2};
  spec.router_args = "--migration_limit=0";
  auto started = LocalCluster::Start(spec);
  ASSERT_TRUE(started.ok()) << started.status();
  LocalCluster& cluster = **started;
  std::vector<Case> cases;
  for (int i = 0; i < 8; ++i) {
    cases.push_back(
        {RandomPrompt(30, 200 + i),
         {.temperature = 0.0f, .max_tokens = 400, .ignore_eos = true}});
  }
  const auto want = Colocated(cases);
  std::atomic<int> streaming = 0;
  std::vector<StreamResult> got(cases.size());
  std::vector<std::thread> threads;
  for (size_t i = 0; i < cases.size(); ++i) {
    threads.emplace_back([&, i] {
      bool counted = false;
      got[i] = Generate(cluster.router(), ToRequest(cases[i]),
                        absl::Seconds(120), [&](const v1::GenerateResponse&) {
                          if (!counted) streaming += counted = true;
                          return true;
                        });
    });
  }
  while (streaming < static_cast<int>(cases.size()))
    absl::SleepFor(absl::Milliseconds(10));
  ASSERT_TRUE(cluster.Kill("decode-0"));
  for (auto& t : threads) t.join();
  int unavailable = 0, completed = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    if (got[i].status.ok()) {
      ++completed;
      EXPECT_EQ(got[i].tokens, want[i]) << i;
    } else {
      ++unavailable;
      EXPECT_EQ(got[i].status.error_code(), grpc::StatusCode::UNAVAILABLE)
          << got[i].status.error_message();
      // The tokens streamed before the loss stand, and are right.
      ASSERT_LE(got[i].tokens.size(), want[i].size());
      EXPECT_TRUE(std::equal(got[i].tokens.begin(), got[i].tokens.end(),
                             want[i].begin()))
          << i;
    }
  }
  EXPECT_GT(unavailable, 0);
  EXPECT_GT(completed, 0);
  // New requests all go to the surviving decode worker.
  std::vector<Case> after(cases.begin(), cases.begin() + 4);
  for (Case& c : after) c.sampling.max_tokens = 6;
  const auto want_after = Colocated(after);
  const auto got_after = RunConcurrently(cluster.router(), after);
  for (size_t i = 0; i < after.size(); ++i) {
    EXPECT_TRUE(got_after[i].status.ok())
        << got_after[i].status.error_message();
    EXPECT_EQ(got_after[i].tokens, want_after[i]);
  }
}

TEST(ClusterTest, BadRequestsAreInvalidArgumentAndTheClusterKeepsServing) {
  auto started = LocalCluster::Start({.prefill = 1, .decode = 1});
  ASSERT_TRUE(started.ok()) << started.status();
  LocalCluster& cluster = **started;
  auto base = [] {
    v1::GenerateRequest r;
    r.set_text("hello");
    r.set_max_tokens(4);
    return r;
  };
  std::vector<std::pair<std::string, v1::GenerateRequest>> bad;
  bad.emplace_back("no prompt", [] {
    v1::GenerateRequest r;
    r.set_max_tokens(4);
    return r;
  }());
  bad.emplace_back("empty text", [&] {
    auto r = base();
    r.set_text("");
    r.set_add_special_tokens(false);
    return r;
  }());
  bad.emplace_back("empty ids", [&] {
    auto r = base();
    r.mutable_token_ids();
    return r;
  }());
  bad.emplace_back("id outside vocab", [&] {
    auto r = base();
    r.mutable_token_ids()->add_ids(100000);
    return r;
  }());
  bad.emplace_back("negative id", [&] {
    auto r = base();
    r.mutable_token_ids()->add_ids(-1);
    return r;
  }());
  bad.emplace_back("longer than context", [&] {
    auto r = base();
    r.set_text(std::string(5000, 'a'));
    return r;
  }());
  bad.emplace_back("max_tokens 0", [&] {
    auto r = base();
    r.set_max_tokens(0);
    return r;
  }());
  bad.emplace_back("max_tokens huge", [&] {
    auto r = base();
    r.set_max_tokens(4000000000u);
    return r;
  }());
  bad.emplace_back("temperature < 0", [&] {
    auto r = base();
    r.mutable_sampling()->set_temperature(-1);
    return r;
  }());
  bad.emplace_back("top_p 0", [&] {
    auto r = base();
    r.mutable_sampling()->set_top_p(0);
    return r;
  }());
  bad.emplace_back("top_p > 1", [&] {
    auto r = base();
    r.mutable_sampling()->set_top_p(1.5f);
    return r;
  }());
  bad.emplace_back("top_k < 0", [&] {
    auto r = base();
    r.mutable_sampling()->set_top_k(-3);
    return r;
  }());
  bad.emplace_back("min_p > 1", [&] {
    auto r = base();
    r.mutable_sampling()->set_min_p(2);
    return r;
  }());
  bad.emplace_back("logprobs 21", [&] {
    auto r = base();
    r.set_logprobs(21);
    return r;
  }());
  bad.emplace_back("invalid UTF-8", [&] {
    auto r = base();
    r.set_text(std::string("ab\xff\xfe", 4));
    return r;
  }());
  bad.emplace_back("unknown model", [&] {
    auto r = base();
    r.set_model("no-such-model");
    return r;
  }());
  bad.emplace_back("stop id outside vocab", [&] {
    auto r = base();
    r.add_stop_token_ids(99999);
    return r;
  }());
  for (const auto& [what, request] : bad) {
    const StreamResult got =
        Generate(cluster.router(), request, absl::Seconds(10));
    EXPECT_EQ(got.status.error_code(), grpc::StatusCode::INVALID_ARGUMENT)
        << what << ": " << got.status.error_code() << " "
        << got.status.error_message();
    EXPECT_FALSE(got.status.error_message().empty()) << what;
    EXPECT_EQ(got.messages, 0) << what;
  }
  // Greedy, so an end-of-sequence token cannot be drawn before the limit.
  v1::GenerateRequest good = base();
  good.mutable_sampling()->set_temperature(0);
  const StreamResult ok = Generate(cluster.router(), good);
  EXPECT_TRUE(ok.status.ok()) << ok.status.error_message();
  EXPECT_EQ(ok.tokens.size(), 4u);
  EXPECT_EQ(ok.finish, v1::FINISH_REASON_LENGTH);
}

// Generate streams opened all at once on gRPC's callback client API (no
// thread per stream), each collecting its tokens and status.
class ConcurrentStreams {
 public:
  ConcurrentStreams(v1::Generation::Stub& stub,
                    const std::vector<v1::GenerateRequest>& requests)
      : results_(requests.size()), remaining_(requests.size()) {
    for (size_t i = 0; i < requests.size(); ++i) {
      calls_.push_back(std::make_unique<Call>(this, i));
      calls_.back()->Start(stub, requests[i]);
    }
  }

  // Waits until every stream ended.
  std::vector<StreamResult> Wait() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](size_t* remaining) { return *remaining == 0; }, &remaining_));
    return results_;
  }

 private:
  class Call final : public grpc::ClientReadReactor<v1::GenerateResponse> {
   public:
    Call(ConcurrentStreams* owner, size_t index)
        : owner_(owner), index_(index) {}
    void Start(v1::Generation::Stub& stub, const v1::GenerateRequest& r) {
      request_ = r;
      context_.set_deadline(
          absl::ToChronoTime(absl::Now() + absl::Minutes(10)));
      stub.async()->Generate(&context_, &request_, this);
      StartRead(&response_);
      StartCall();
    }
    void OnReadDone(bool ok) override {
      if (!ok) return;
      ++result_.messages;
      result_.tokens.insert(result_.tokens.end(),
                            response_.token_ids().begin(),
                            response_.token_ids().end());
      if (response_.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
        result_.finish = response_.finish_reason();
      }
      StartRead(&response_);
    }
    void OnDone(const grpc::Status& status) override {
      result_.status = status;
      owner_->Done(index_, std::move(result_));
    }

   private:
    ConcurrentStreams* const owner_;
    const size_t index_;
    grpc::ClientContext context_;
    v1::GenerateRequest request_;
    v1::GenerateResponse response_;
    StreamResult result_;
  };

  void Done(size_t index, StreamResult result) {
    absl::MutexLock lock(&mu_);
    results_[index] = std::move(result);
    --remaining_;
  }

  absl::Mutex mu_;
  std::vector<StreamResult> results_ ABSL_GUARDED_BY(mu_);
  size_t remaining_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Call>> calls_;
};

// A thousand streams at once on one router: the router holds them all
// (no thread per request); those the decode worker's KV pool cannot take
// at once wait in the router's queue, none is refused, every output equals
// the colocated engine's, and the pool is whole again afterwards.
TEST(ClusterTest, AThousandConcurrentStreamsAllComplete) {
  auto started = LocalCluster::Start({.prefill = 1, .decode = 1});
  ASSERT_TRUE(started.ok()) << started.status();
  LocalCluster& cluster = **started;
  const int32_t idle = FreeBlocks(cluster, "decode-0");
  // 25 prompts, 40 streams each: later ones meet their prompt in the
  // prefix caches.
  std::vector<Case> distinct;
  for (int i = 0; i < 25; ++i) {
    distinct.push_back(
        {RandomPrompt(12 + i, 700 + i),
         {.temperature = 0.0f, .max_tokens = 6, .ignore_eos = true}});
  }
  const auto want = Colocated(distinct);
  std::vector<v1::GenerateRequest> requests;
  for (int i = 0; i < 1000; ++i) {
    requests.push_back(ToRequest(distinct[i % distinct.size()]));
  }
  const std::vector<StreamResult> got =
      ConcurrentStreams(cluster.router(), requests).Wait();
  int ok = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(got[i].status.ok())
        << i << ": " << got[i].status.error_code() << " "
        << got[i].status.error_message();
    EXPECT_EQ(got[i].tokens, want[i % distinct.size()]) << i;
    ++ok;
  }
  EXPECT_EQ(ok, 1000);
  ExpectBlocksReturnTo(cluster, idle);
}

TEST(ClusterTest, OverloadIsRefusedWithResourceExhaustedAndNothingLeaks) {
  // Room for two requests of 100 tokens (7 blocks each) on the decode
  // worker, two more waiting: the rest are refused.
  auto started = LocalCluster::Start(
      {.prefill = 1,
       .decode = 1,
       .decode_args = "--num_threads=1 --max_batch_tokens=64 --kv_blocks=14 --kv_canary",
       .router_args = "--max_queued=2"});
  ASSERT_TRUE(started.ok()) << started.status();
  LocalCluster& cluster = **started;
  const int32_t idle = FreeBlocks(cluster, "decode-0");
  std::vector<Case> cases;
  for (int i = 0; i < 24; ++i) {
    cases.push_back(
        {RandomPrompt(40, 300 + i),
         {.temperature = 0.0f, .max_tokens = 60, .ignore_eos = true}});
  }
  const auto want = Colocated(cases);
  const auto got = RunConcurrently(cluster.router(), cases);
  int refused = 0, served = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    if (got[i].status.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
      ++refused;
      EXPECT_EQ(got[i].messages, 0);
    } else {
      ASSERT_TRUE(got[i].status.ok()) << got[i].status.error_message();
      EXPECT_EQ(got[i].tokens, want[i]);
      ++served;
    }
  }
  EXPECT_GT(refused, 0);
  EXPECT_GE(served, 4);
  ExpectBlocksReturnTo(cluster, idle);
  EXPECT_TRUE(Generate(cluster.router(), ToRequest(cases[0])).status.ok());
}

// Workers on the cuda backend (label gpu; skipped without a device): the KV
// pool in device memory, moved over tcp through pinned host staging on both
// sides, or device to device over cuda_ipc (both workers on one GPU).
// Requests run one at a time, so that the engines see the batch shapes of
// the reference, a cuda decode worker prefilling locally, whose tokens they
// must equal exactly.
bool HasCudaDevice() {
#if PDSERVE_HAVE_CUDA
  return CudaDeviceCount() > 0;
#else
  return false;
#endif
}

constexpr char kGpuWorkerArgs[] =
    "--backend=cuda --max_batch_tokens=64 --kv_cache_mb=64";

std::vector<StreamResult> RunOneByOne(LocalCluster& cluster,
                                      const std::vector<Case>& cases) {
  std::vector<StreamResult> out;
  for (const Case& c : cases)
    out.push_back(Generate(cluster.router(), ToRequest(c)));
  return out;
}

void ExpectGpuClusterEqualsColocated(const std::string& prefill_transports,
                                     const std::string& decode_transports,
                                     const std::string& used_transport) {
  if (!HasCudaDevice()) GTEST_SKIP() << "no CUDA device";
  std::vector<Case> cases = MixedCases(77);
  cases.resize(10);
  std::vector<StreamResult> want;
  {
    auto colocated = LocalCluster::Start(
        {.prefill = 0, .decode = 1, .decode_args = kGpuWorkerArgs});
    ASSERT_TRUE(colocated.ok()) << colocated.status();
    want = RunOneByOne(**colocated, cases);
  }
  auto started = LocalCluster::Start(
      {.prefill = 1,
       .decode = 1,
       .prefill_args =
           absl::StrCat(kGpuWorkerArgs, " --kv_transport=", prefill_transports),
       .decode_args = absl::StrCat(kGpuWorkerArgs,
                                   " --kv_transport=", decode_transports)});
  ASSERT_TRUE(started.ok()) << started.status();
  const std::vector<StreamResult> got = RunOneByOne(**started, cases);
  for (size_t i = 0; i < cases.size(); ++i) {
    ASSERT_TRUE(want[i].status.ok())
        << i << ": " << want[i].status.error_message();
    ASSERT_TRUE(got[i].status.ok())
        << i << ": " << got[i].status.error_message();
    EXPECT_EQ(got[i].tokens, want[i].tokens)
        << "request " << i << ", prompt " << cases[i].prompt.size();
  }
  EXPECT_EQ(PushesByTransport(**started, "prefill-0", cases.size()),
            (std::map<std::string, uint64_t>{{used_transport, cases.size()}}));
}

TEST(ClusterOnGpuTest, OverTcpThroughPinnedHostStagingEqualsColocated) {
  ExpectGpuClusterEqualsColocated("tcp", "tcp", "tcp");
}

TEST(ClusterOnGpuTest, OverCudaIpcEqualsColocated) {
  if (!HasKvTransport("cuda_ipc")) GTEST_SKIP() << "cuda_ipc is not built";
  ExpectGpuClusterEqualsColocated("cuda_ipc,tcp", "cuda_ipc,tcp", "cuda_ipc");
}

TEST(ClusterOnGpuTest, DecodeOffersCudaIpcAndTcpPrefillRunsTcpEqualsColocated) {
  if (!HasKvTransport("cuda_ipc")) GTEST_SKIP() << "cuda_ipc is not built";
  ExpectGpuClusterEqualsColocated("tcp", "cuda_ipc,tcp", "tcp");
}

}  // namespace
}  // namespace pdserve
