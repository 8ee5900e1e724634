// pd-router end to end against in-process fake workers (fake_workers.h):
// the request flow (reserve, prefill, decode), local prefill, stop strings,
// retries around failing prefill and decode workers, cancellation and
// deadlines reaching the workers, admission limits, and a cluster whose
// decode worker is down. The multi-process tests with real workers are in
// tests/cluster.
#include "router/router.h"

#include <algorithm>
#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "client/pdctl_commands.h"
#include "client/pdserve_client.h"
#include "engine/sampler.h"
#include "gtest/gtest.h"
#include "tests/common/metrics_test_util.h"
#include "tests/router/fake_workers.h"

namespace pdserve {
namespace {

using testing_util::FakeDecodeWorker;
using testing_util::FakePrefillWorker;
namespace wire = ::pdserve::internal::v1;

struct Result {
  absl::Status status;
  std::vector<int32_t> tokens;
  std::string text;
  v1::FinishReason finish = v1::FINISH_REASON_UNSPECIFIED;
  v1::Usage usage;
  int messages = 0;
  std::vector<v1::GenerateResponse> all;
};

// Waits up to 5 s for `done`.
bool Eventually(const std::function<bool()>& done) {
  for (int i = 0; i < 500; ++i) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return done();
}

class Cluster {
 public:
  Cluster(int prefill, int decode,
          const std::function<void(RouterOptions&)>& tweak = nullptr) {
    RouterOptions options;
    options.cluster.set_model("builtin:tiny");
    for (int i = 0; i < prefill; ++i) {
      prefill_.push_back(std::make_unique<FakePrefillWorker>());
      auto* w = options.cluster.add_prefill_workers();
      w->set_id(absl::StrCat("prefill-", i));
      w->set_address(prefill_.back()->address());
    }
    for (int i = 0; i < decode; ++i) {
      decode_.push_back(std::make_unique<FakeDecodeWorker>());
      auto* w = options.cluster.add_decode_workers();
      w->set_id(absl::StrCat("decode-", i));
      w->set_address(decode_.back()->address());
    }
    options.poll_interval = absl::Milliseconds(20);
    // These tests are about the request flow: every prompt, however short,
    // goes to a prefill worker when one is up (no local prefill).
    options.cluster.mutable_routing()->set_local_prefill_max_tokens(0);
    if (tweak) tweak(options);
    auto router = Router::Start(options);
    EXPECT_TRUE(router.ok()) << router.status();
    router_ = *std::move(router);
    address_ = absl::StrCat("127.0.0.1:", router_->port());
    // The router's own answers: the SDK's retries (tests/client) off.
    client_ = *GenerationClient::Create(
        address_, {.retry = {.max_attempts = 1}});
    EXPECT_TRUE(WaitHealthy(prefill, decode));
  }

  bool WaitHealthy(int prefill, int decode) {
    return Eventually([&] {
      auto h = client_->Health();
      return h.ok() && h->prefill_workers() == static_cast<uint32_t>(prefill) &&
             h->decode_workers() == static_cast<uint32_t>(decode);
    });
  }

  FakePrefillWorker& prefill(int i) { return *prefill_[i]; }
  FakeDecodeWorker& decode(int i) { return *decode_[i]; }
  Router& router() { return *router_; }
  GenerationClient& client() { return *client_; }
  const std::string& address() const { return address_; }

  Result Generate(
      const v1::GenerateRequest& request,
      const std::function<bool(const v1::GenerateResponse&)>& on = nullptr,
      GenerationClient* client = nullptr) {
    Result out;
    out.status =
        (client ? client : client_.get())
            ->Generate(request, [&](const v1::GenerateResponse& r) {
              ++out.messages;
              out.all.push_back(r);
              out.tokens.insert(out.tokens.end(), r.token_ids().begin(),
                                r.token_ids().end());
              out.text += r.text();
              if (r.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
                out.finish = r.finish_reason();
                out.usage = r.usage();
              }
              return on ? on(r) : true;
            });
    return out;
  }

 private:
  std::vector<std::unique_ptr<FakePrefillWorker>> prefill_;
  std::vector<std::unique_ptr<FakeDecodeWorker>> decode_;
  std::unique_ptr<Router> router_;
  std::string address_;
  std::unique_ptr<GenerationClient> client_;
};

v1::GenerateRequest Text(const std::string& text, uint32_t max_tokens = 64) {
  v1::GenerateRequest r;
  r.set_text(text);
  r.set_max_tokens(max_tokens);
  return r;
}

std::vector<int32_t> Bytes(const std::string& s) {
  return std::vector<int32_t>(
      reinterpret_cast<const uint8_t*>(s.data()),
      reinterpret_cast<const uint8_t*>(s.data()) + s.size());
}

TEST(RouterTest, DisaggregatedRequestReservesPrefillsAndDecodes) {
  Cluster c(1, 1);
  const Result r = c.Generate(Text("Say hi"));
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.text, "Hello, world!");
  std::vector<int32_t> want = Bytes("Hello, world!");
  want.push_back(257);
  EXPECT_EQ(r.tokens, want);
  EXPECT_EQ(r.finish, v1::FINISH_REASON_STOP);
  EXPECT_EQ(r.usage.prompt_tokens(), 7u);  // BOS + "Say hi".
  EXPECT_EQ(r.usage.completion_tokens(), 14u);
  // The first message is the prefill worker's token, sent before decoding.
  ASSERT_GE(r.messages, 2);
  EXPECT_EQ(r.all[0].token_ids_size(), 1);
  EXPECT_FALSE(r.all[0].request_id().empty());
  for (const auto& m : r.all) EXPECT_EQ(m.request_id(), r.all[0].request_id());
  EXPECT_EQ(c.decode(0).reserves, 1);
  EXPECT_EQ(c.prefill(0).prefills_ok, 1);
  EXPECT_EQ(c.decode(0).decodes_local, 0);
  EXPECT_TRUE(Eventually([&] { return c.decode(0).reservations() == 0; }));
}

TEST(RouterTest, CallerRequestIdIsEchoed) {
  Cluster c(1, 1);
  v1::GenerateRequest req = Text("x", 3);
  req.set_request_id("my-id-1");
  const Result r = c.Generate(req);
  ASSERT_TRUE(r.status.ok()) << r.status;
  for (const auto& m : r.all) EXPECT_EQ(m.request_id(), "my-id-1");
  EXPECT_EQ(r.finish, v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(r.text, "Hel");
}

TEST(RouterTest, WithoutPrefillWorkersTheDecodeWorkerPrefills) {
  Cluster c(0, 1);
  const Result r = c.Generate(Text("Say hi"));
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.text, "Hello, world!");
  EXPECT_EQ(c.decode(0).reserves, 0);
  EXPECT_EQ(c.decode(0).decodes_local, 1);
}

TEST(RouterTest, ShortPromptsArePrefilledOnTheDecodeWorker) {
  Cluster c(1, 1, [](RouterOptions& o) {
    o.cluster.mutable_routing()->set_local_prefill_max_tokens(8);
  });
  ASSERT_TRUE(c.Generate(Text("1234567")).status.ok());  // 8 tokens with BOS.
  EXPECT_EQ(c.prefill(0).prefills, 0);
  EXPECT_EQ(c.decode(0).decodes_local, 1);
  const Result r = c.Generate(Text("12345678"));
  ASSERT_TRUE(r.status.ok());
  EXPECT_EQ(r.text, "Hello, world!");
  EXPECT_EQ(c.prefill(0).prefills, 1);
}

// A burst is placed before any of its Reserves is answered: each request's
// prompt counts on its prefill worker from the decision on, so the ones
// after it see that worker's queue. Here the first prompt alone fills the
// prefill worker past its queue limit, and the second, placed while the
// first still waits for its Reserve, is prefilled by the idle decode
// worker (kv_aware's rule for a prefill bottleneck). No load report comes
// in between (the router polls every 60 s).
TEST(RouterTest, ABurstSeesThePromptsItSentToThePrefillWorker) {
  Cluster c(1, 1, [](RouterOptions& o) {
    o.poll_interval = absl::Seconds(60);
    o.cluster.mutable_routing()->set_prefill_queue_limit_tokens(100);
  });
  FakeDecodeWorker::Behavior slow;
  slow.reserve_delay = absl::Milliseconds(500);
  c.decode(0).set_behavior(slow);
  const std::string long_prompt(150, 'a');
  Result first;
  std::thread burst([&] { first = c.Generate(Text(long_prompt, 4)); });
  ASSERT_TRUE(Eventually([&] { return c.decode(0).reserves == 1; }));
  const Result second = c.Generate(Text(std::string(60, 'b'), 4));
  burst.join();
  ASSERT_TRUE(first.status.ok()) << first.status;
  ASSERT_TRUE(second.status.ok()) << second.status;
  EXPECT_EQ(c.prefill(0).prefills, 1);
  EXPECT_EQ(c.decode(0).reserves, 1);
  EXPECT_EQ(c.decode(0).decodes_local, 1);
}

TEST(RouterTest, FirstTokenThatFinishesReleasesTheReservation) {
  Cluster c(1, 1);
  const Result r = c.Generate(Text("x", 1));
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.text, "H");
  EXPECT_EQ(r.finish, v1::FINISH_REASON_LENGTH);
  EXPECT_EQ(r.usage.completion_tokens(), 1u);
  EXPECT_EQ(c.decode(0).decodes, 0);
  // The release runs beside the answer, not before it.
  EXPECT_TRUE(Eventually([&] {
    return c.decode(0).releases == 1 && c.decode(0).reservations() == 0;
  }));
}

TEST(RouterTest, StopStringCutsTheTextAndCancelsTheDecodeStream) {
  Cluster c(1, 1);
  FakeDecodeWorker::Behavior b;
  b.script = "abc STOP def";
  b.token_delay = absl::Milliseconds(5);
  c.decode(0).set_behavior(b);
  FakePrefillWorker::Behavior pb;
  pb.script = b.script;
  c.prefill(0).set_behavior(pb);
  v1::GenerateRequest req = Text("x", 1000);
  req.set_ignore_eos(true);  // The fake would go on forever.
  req.add_stop("never");
  req.add_stop("STOP");
  const Result r = c.Generate(req);
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.text, "abc ");
  EXPECT_EQ(r.finish, v1::FINISH_REASON_STOP);
  EXPECT_EQ(r.usage.completion_tokens(), 8u);  // Through the 'P'.
  EXPECT_EQ(r.tokens, Bytes("abc STOP"));
  EXPECT_TRUE(Eventually([&] { return c.decode(0).decodes_cancelled == 1; }));
}

TEST(RouterTest, MultiByteStopStringSplitAcrossTokens) {
  Cluster c(0, 1);
  FakeDecodeWorker::Behavior b;
  b.script = "héllo wörld";
  c.decode(0).set_behavior(b);
  v1::GenerateRequest req = Text("x");
  req.add_stop("wö");
  const Result r = c.Generate(req);
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.text, "héllo ");
  EXPECT_EQ(r.finish, v1::FINISH_REASON_STOP);
}

TEST(RouterTest, LogprobsArePassedThrough) {
  Cluster c(1, 1);
  v1::GenerateRequest req = Text("x", 3);
  req.set_logprobs(2);
  const Result r = c.Generate(req);
  ASSERT_TRUE(r.status.ok()) << r.status;
  std::vector<v1::TokenLogprobs> lps;
  for (const auto& m : r.all) {
    ASSERT_EQ(m.logprobs_size(), m.token_ids_size());
    lps.insert(lps.end(), m.logprobs().begin(), m.logprobs().end());
  }
  ASSERT_EQ(lps.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(lps[i].token_id(), r.tokens[i]);
    EXPECT_FLOAT_EQ(lps[i].logprob(), -0.5f * (i + 1));
    ASSERT_EQ(lps[i].top_size(), 2);
    EXPECT_EQ(lps[i].top(1).token_id(), 1);
  }
}

// n choices: each message belongs to one choice, each choice ends with its
// own finish reason and usage, and the choices stream side by side. Choice
// 0 runs disaggregated; the others start once its first Decode message is
// back and go to the same decode worker, prefilled there (from the prefix
// cache the real worker has; see tests/cluster for that part).
TEST(RouterTest, ChoicesStreamSideBySideEachWithItsFinishAndUsage) {
  Cluster c(1, 2);
  FakeDecodeWorker::Behavior b;
  b.token_delay = absl::Milliseconds(5);
  c.decode(0).set_behavior(b);
  c.decode(1).set_behavior(b);
  v1::GenerateRequest req = Text("Say hi", 64);
  req.set_n(3);
  req.mutable_sampling()->set_seed(77);
  req.set_request_id("multi");
  const Result r = c.Generate(req);
  ASSERT_TRUE(r.status.ok()) << r.status;
  std::map<uint32_t, std::string> text;
  std::map<uint32_t, int> finishes;
  std::vector<uint32_t> order;
  for (const v1::GenerateResponse& m : r.all) {
    ASSERT_LT(m.index(), 3u);
    EXPECT_EQ(m.request_id(), "multi");
    EXPECT_EQ(finishes[m.index()], 0)
        << "a message of choice " << m.index() << " after its last";
    text[m.index()] += m.text();
    order.push_back(m.index());
    if (m.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      ++finishes[m.index()];
      EXPECT_EQ(m.finish_reason(), v1::FINISH_REASON_STOP);
      EXPECT_EQ(m.usage().prompt_tokens(), 7u);
      EXPECT_EQ(m.usage().completion_tokens(), 14u);
    } else {
      EXPECT_FALSE(m.has_usage());
    }
  }
  for (uint32_t i = 0; i < 3; ++i) {
    EXPECT_EQ(text[i], "Hello, world!") << "choice " << i;
    EXPECT_EQ(finishes[i], 1) << "choice " << i;
  }
  // Interleaved: some message of a later choice comes before choice 0's last.
  const auto last0 = std::find(order.rbegin(), order.rend(), 0u);
  EXPECT_TRUE(
      std::any_of(last0 + 1, order.rend(), [](uint32_t i) { return i != 0; }));
  // One prefill and one reservation (choice 0); the other choices on the
  // same decode worker, prefilled locally, each with its own seed.
  EXPECT_EQ(c.prefill(0).prefills, 1);
  const int holder = c.decode(0).decodes > 0 ? 0 : 1;
  EXPECT_EQ(c.decode(holder).reserves, 1);
  EXPECT_EQ(c.decode(holder).decodes, 3);
  EXPECT_EQ(c.decode(holder).decodes_local, 2);
  EXPECT_EQ(c.decode(1 - holder).decodes, 0);
  std::set<uint64_t> seeds, ids;
  for (const wire::DecodeRequest& d : c.decode(holder).decode_requests()) {
    seeds.insert(d.request().seed());
    ids.insert(d.request().request_id());
    if (d.has_first_token()) {
      EXPECT_EQ(d.request().seed(), 77u) << "choice 0 keeps the seed";
    }
  }
  EXPECT_EQ(seeds,
            (std::set<uint64_t>{77, ChoiceSeed(77, 1), ChoiceSeed(77, 2)}));
  EXPECT_EQ(ids.size(), 3u);
}

TEST(RouterTest, ChoicesAfterAFirstTokenThatFinishesGoTheUsualWay) {
  Cluster c(1, 1);
  v1::GenerateRequest req = Text("x", 1);
  req.set_n(2);
  const Result r = c.Generate(req);
  ASSERT_TRUE(r.status.ok()) << r.status;
  std::set<uint32_t> finished;
  for (const auto& m : r.all) {
    EXPECT_EQ(m.text(), "H");
    EXPECT_EQ(m.finish_reason(), v1::FINISH_REASON_LENGTH);
    finished.insert(m.index());
  }
  EXPECT_EQ(finished, (std::set<uint32_t>{0, 1}));
  EXPECT_EQ(c.prefill(0).prefills, 2);  // The second from the worker's cache.
  EXPECT_TRUE(Eventually([&] { return c.decode(0).reservations() == 0; }));
}

TEST(RouterTest, AFailingChoiceFailsTheCall) {
  Cluster c(0, 1);
  FakeDecodeWorker::Behavior b;
  b.fail_decode_after = 3;
  c.decode(0).set_behavior(b);
  v1::GenerateRequest req = Text("x", 20);
  req.set_n(4);
  const Result r = c.Generate(req);
  EXPECT_EQ(r.status.code(), absl::StatusCode::kUnavailable) << r.status;
  EXPECT_TRUE(Eventually([&] { return c.decode(0).reservations() == 0; }));
}

// Prompt logprobs come on the first message of choice 0, from the worker
// that prefilled the prompt, disaggregated or not.
TEST(RouterTest, PromptLogprobsComeOnTheFirstMessageOfChoiceZero) {
  for (int prefill_workers : {0, 1}) {
    SCOPED_TRACE(prefill_workers);
    Cluster c(prefill_workers, 1);
    v1::GenerateRequest req = Text("abc", 4);
    req.set_prompt_logprobs(2);
    req.set_n(2);
    const Result r = c.Generate(req);
    ASSERT_TRUE(r.status.ok()) << r.status;
    int with = 0;
    bool first_of_zero = true;
    for (const auto& m : r.all) {
      if (m.index() == 0 && first_of_zero) {
        first_of_zero = false;
        ASSERT_EQ(m.prompt_logprobs_size(), 3);  // BOS a b c: positions 1..3.
        for (int i = 0; i < 3; ++i) {
          EXPECT_EQ(m.prompt_logprobs(i).token_id(), "abc"[i]);
          EXPECT_FLOAT_EQ(m.prompt_logprobs(i).logprob(), -(i + 1.0f));
          EXPECT_EQ(m.prompt_logprobs(i).top_size(), 2);
        }
      }
      with += m.prompt_logprobs_size() > 0;
    }
    EXPECT_EQ(with, 1);
    // Only choice 0 asked the workers for them.
    const auto seen = c.decode(0).decode_requests();
    ASSERT_EQ(seen.size(), 2u);
    EXPECT_EQ(std::count_if(seen.begin(), seen.end(),
                            [](const wire::DecodeRequest& d) {
                              return d.request().has_prompt_logprobs();
                            }),
              1);
  }
}

// The logit processing reaches the workers as asked.
TEST(RouterTest, PenaltiesAndLogitBiasReachTheWorkers) {
  Cluster c(0, 1);
  v1::GenerateRequest req = Text("x", 2);
  v1::SamplingParams* s = req.mutable_sampling();
  s->set_presence_penalty(0.5f);
  s->set_frequency_penalty(-1.0f);
  s->set_repetition_penalty(1.2f);
  (*s->mutable_logit_bias())[72] = 3.0f;
  (*s->mutable_logit_bias())[5] = -100.0f;
  ASSERT_TRUE(c.Generate(req).status.ok());
  const auto seen = c.decode(0).decode_requests();
  ASSERT_EQ(seen.size(), 1u);
  const wire::EngineRequest& e = seen[0].request();
  EXPECT_FLOAT_EQ(e.presence_penalty(), 0.5f);
  EXPECT_FLOAT_EQ(e.frequency_penalty(), -1.0f);
  EXPECT_FLOAT_EQ(e.repetition_penalty(), 1.2f);
  ASSERT_EQ(e.logit_bias_size(), 2);
  EXPECT_FLOAT_EQ(e.logit_bias().at(72), 3.0f);
  EXPECT_FLOAT_EQ(e.logit_bias().at(5), -100.0f);
}

TEST(RouterTest, FailedPrefillIsRetriedOnAnotherPrefillWorker) {
  Cluster c(2, 1);
  FakePrefillWorker::Behavior broken;
  broken.fail_code = grpc::StatusCode::INTERNAL;
  c.prefill(0).set_behavior(broken);
  for (int i = 0; i < 4; ++i) {
    const Result r = c.Generate(Text("x"));
    ASSERT_TRUE(r.status.ok()) << r.status;
    EXPECT_EQ(r.text, "Hello, world!");
  }
  EXPECT_EQ(c.prefill(1).prefills_ok, 4);
  EXPECT_EQ(c.prefill(0).prefills_ok, 0);
  EXPECT_TRUE(Eventually([&] { return c.decode(0).reservations() == 0; }));
  // One reservation per request: retries reuse it.
  EXPECT_EQ(c.decode(0).reserves, 4);
}

TEST(RouterTest, WhenEveryPrefillFailsTheReservationIsReleased) {
  Cluster c(2, 1, [](RouterOptions& o) { o.prefill_retries = 5; });
  FakePrefillWorker::Behavior broken;
  broken.fail_code = grpc::StatusCode::DEADLINE_EXCEEDED;
  c.prefill(0).set_behavior(broken);
  c.prefill(1).set_behavior(broken);
  const Result r = c.Generate(Text("x"));
  EXPECT_EQ(r.status.code(), absl::StatusCode::kUnavailable) << r.status;
  EXPECT_NE(r.status.message().find("prefill"), std::string::npos) << r.status;
  EXPECT_EQ(r.messages, 0);
  // Each worker tried once, however many retries are allowed.
  EXPECT_EQ(c.prefill(0).prefills + c.prefill(1).prefills, 2);
  EXPECT_EQ(c.decode(0).releases, 1);
  EXPECT_TRUE(Eventually([&] { return c.decode(0).reservations() == 0; }));
}

TEST(RouterTest, WorkerRefusingACheckedRequestIsInternalNotTheClientsFault) {
  Cluster c(2, 1);
  FakePrefillWorker::Behavior refusing;
  refusing.fail_code = grpc::StatusCode::INVALID_ARGUMENT;
  c.prefill(0).set_behavior(refusing);
  c.prefill(1).set_behavior(refusing);
  const Result r = c.Generate(Text("x"));
  EXPECT_EQ(r.status.code(), absl::StatusCode::kInternal) << r.status;
  EXPECT_EQ(c.prefill(0).prefills + c.prefill(1).prefills, 1);  // No retry.
  EXPECT_TRUE(Eventually([&] { return c.decode(0).reservations() == 0; }));
}

TEST(RouterTest, DecodeWorkerLostMidStreamEndsWithUnavailableKeepingTokens) {
  Cluster c(1, 1);
  FakeDecodeWorker::Behavior b;
  b.fail_decode_after = 4;
  c.decode(0).set_behavior(b);
  const Result r = c.Generate(Text("x"));
  EXPECT_EQ(r.status.code(), absl::StatusCode::kUnavailable) << r.status;
  // The prefill worker's token and four from the decode worker.
  EXPECT_EQ(r.tokens, Bytes("Hello"));
  EXPECT_EQ(r.text, "Hello");
  EXPECT_EQ(r.finish, v1::FINISH_REASON_UNSPECIFIED);
}

TEST(RouterTest, ADecodeCallLostOnItsWayReleasesTheReservation) {
  // The worker never saw the Decode (a partition), so only the router's
  // Release frees the reservation before the worker's timeout.
  Cluster c(1, 1);
  FakeDecodeWorker::Behavior b;
  b.decode_unreached = true;
  c.decode(0).set_behavior(b);
  const Result r = c.Generate(Text("x"));
  EXPECT_EQ(r.status.code(), absl::StatusCode::kUnavailable) << r.status;
  EXPECT_EQ(c.decode(0).reserves, 1);
  EXPECT_TRUE(Eventually([&] { return c.decode(0).reservations() == 0; }));
  EXPECT_EQ(c.decode(0).releases, 1);
}

TEST(RouterTest, DecodeWorkerFailingBeforeAnyTokenIsRetriedOnAnother) {
  Cluster c(0, 2);
  FakeDecodeWorker::Behavior broken;
  broken.fail_decode_after = 0;
  broken.free_blocks = 2000;  // Chosen first.
  c.decode(0).set_behavior(broken);
  ASSERT_TRUE(Eventually([&] {
    // Wait for the report with the new free count.
    return c.Generate(Text("x", 2)).status.ok() && c.decode(0).decodes > 0;
  }));
  const int before = c.decode(1).decodes_done;
  const Result r = c.Generate(Text("x"));
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.text, "Hello, world!");
  EXPECT_EQ(c.decode(1).decodes_done, before + 1);
}

TEST(RouterTest, LeastLoadedDecodeWorkerIsChosen) {
  Cluster c(1, 2, [](RouterOptions& o) {
    o.cluster.mutable_routing()->set_policy("least_loaded");
  });
  FakeDecodeWorker::Behavior roomy;
  roomy.free_blocks = 5000;
  roomy.total_blocks = 5000;
  c.decode(1).set_behavior(roomy);
  ASSERT_TRUE(c.decode(1).AwaitFreshReport());
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(c.Generate(Text("x", 2)).status.ok());
  EXPECT_EQ(c.decode(1).reserves, 3);
  EXPECT_EQ(c.decode(0).reserves, 0);
}

// A decode worker that refuses new work as draining before the router saw
// it drain: each request goes on to the other worker, and that is no
// migration (none is allowed here).
TEST(RouterTest, DrainingDecodeWorkersRefusalSendsTheRequestElsewhere) {
  Cluster c(1, 2, [](RouterOptions& o) {
    o.cluster.mutable_routing()->set_policy("least_loaded");
    o.migration_limit = 0;
  });
  FakeDecodeWorker::Behavior draining;  // Preferred, and refusing.
  draining.free_blocks = 5000;
  draining.total_blocks = 5000;
  draining.draining = true;
  c.decode(0).set_behavior(draining);
  ASSERT_TRUE(c.decode(0).AwaitFreshReport());
  for (int i = 0; i < 4; ++i) {
    const Result r = c.Generate(Text("x"));
    ASSERT_TRUE(r.status.ok()) << r.status;
    EXPECT_EQ(r.text, "Hello, world!");
  }
  EXPECT_GE(c.decode(0).reserves, 1);
  EXPECT_EQ(c.decode(1).decodes_done, 4);
  // Once its reports say it drains, it is no longer counted or chosen.
  draining.report_draining = true;
  c.decode(0).set_behavior(draining);
  EXPECT_TRUE(c.WaitHealthy(1, 1));
  const int refused = c.decode(0).reserves;
  ASSERT_TRUE(c.Generate(Text("x")).status.ok());
  EXPECT_EQ(c.decode(0).reserves, refused);
  EXPECT_TRUE(Eventually([&] { return c.decode(0).reservations() == 0; }));
}

// A prefill worker refusing as draining does not use up the retries (none
// here): the prefill goes to the other one; and when the only prefill
// worker drains, the decode worker prefills locally.
TEST(RouterTest, DrainingPrefillWorkersRefusalIsNoFailedAttempt) {
  Cluster c(2, 1, [](RouterOptions& o) {
    o.cluster.mutable_routing()->set_policy("least_loaded");
    o.prefill_retries = 0;
  });
  FakePrefillWorker::Behavior busy;
  busy.pending_prompt_tokens = 100000;
  c.prefill(1).set_behavior(busy);
  FakePrefillWorker::Behavior draining;
  draining.draining = true;
  c.prefill(0).set_behavior(draining);
  absl::SleepFor(absl::Milliseconds(100));  // Reports with prefill-1 busy.
  for (int i = 0; i < 3; ++i) {
    const Result r = c.Generate(Text("x"));
    ASSERT_TRUE(r.status.ok()) << r.status;
    EXPECT_EQ(r.text, "Hello, world!");
  }
  EXPECT_GE(c.prefill(0).prefills, 1);
  EXPECT_EQ(c.prefill(0).prefills_ok, 0);
  EXPECT_EQ(c.prefill(1).prefills_ok, 3);
  EXPECT_TRUE(Eventually([&] { return c.decode(0).reservations() == 0; }));
}

TEST(RouterTest, WhenTheOnlyPrefillWorkerDrainsTheDecodeWorkerPrefills) {
  Cluster c(1, 1);
  FakePrefillWorker::Behavior draining;
  draining.draining = true;
  draining.report_draining = true;
  c.prefill(0).set_behavior(draining);
  for (int i = 0; i < 3; ++i) {
    const Result r = c.Generate(Text("x"));
    ASSERT_TRUE(r.status.ok()) << r.status;
    EXPECT_EQ(r.text, "Hello, world!");
  }
  EXPECT_EQ(c.prefill(0).prefills_ok, 0);
  EXPECT_EQ(c.decode(0).decodes_local, 3);
  EXPECT_TRUE(c.WaitHealthy(0, 1));
  EXPECT_TRUE(Eventually([&] { return c.decode(0).reservations() == 0; }));
}

TEST(RouterTest, LeastLoadedPrefillWorkerIsChosen) {
  Cluster c(2, 1, [](RouterOptions& o) {
    o.cluster.mutable_routing()->set_policy("least_loaded");
  });
  FakePrefillWorker::Behavior busy;
  busy.pending_prompt_tokens = 100000;
  c.prefill(0).set_behavior(busy);
  absl::SleepFor(absl::Milliseconds(100));
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(c.Generate(Text("x", 2)).status.ok());
  EXPECT_EQ(c.prefill(1).prefills, 3);
  EXPECT_EQ(c.prefill(0).prefills, 0);
}

TEST(RouterTest, FullDecodeWorkersMeanResourceExhaustedOrAnotherWorker) {
  Cluster c(1, 2);
  FakeDecodeWorker::Behavior full;
  full.reserve_code = grpc::StatusCode::RESOURCE_EXHAUSTED;
  c.decode(0).set_behavior(full);
  for (int i = 0; i < 3; ++i) {
    const Result r = c.Generate(Text("x"));
    ASSERT_TRUE(r.status.ok()) << r.status;
  }
  EXPECT_EQ(c.decode(1).decodes_done, 3);
  c.decode(1).set_behavior(full);
  const Result r = c.Generate(Text("x"));
  EXPECT_EQ(r.status.code(), absl::StatusCode::kResourceExhausted) << r.status;
  EXPECT_EQ(r.messages, 0);
}

TEST(RouterTest, ClientCancelCancelsTheDecodeStream) {
  Cluster c(1, 1);
  FakeDecodeWorker::Behavior slow;
  slow.token_delay = absl::Milliseconds(20);
  c.decode(0).set_behavior(slow);
  v1::GenerateRequest req = Text("x", 1000);
  req.set_ignore_eos(true);
  int seen = 0;
  const Result r =
      c.Generate(req, [&](const v1::GenerateResponse&) { return ++seen < 3; });
  EXPECT_EQ(r.status.code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(Eventually([&] { return c.decode(0).decodes_cancelled == 1; }));
  EXPECT_TRUE(Eventually([&] { return c.decode(0).reservations() == 0; }));
  EXPECT_TRUE(Eventually([&] { return c.router().running_requests() == 0; }));
}

TEST(RouterTest, ClientDeadlineDuringPrefillReleasesTheReservation) {
  Cluster c(1, 1);
  FakePrefillWorker::Behavior slow;
  slow.delay = absl::Seconds(3);
  c.prefill(0).set_behavior(slow);
  std::unique_ptr<GenerationClient> hasty = *GenerationClient::Create(
      c.address(), {.generate_timeout = absl::Milliseconds(200)});
  const absl::Time start = absl::Now();
  const Result r = c.Generate(Text("x"), nullptr, hasty.get());
  EXPECT_EQ(r.status.code(), absl::StatusCode::kDeadlineExceeded) << r.status;
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_TRUE(Eventually([&] { return c.decode(0).releases == 1; }));
  EXPECT_TRUE(Eventually([&] { return c.decode(0).reservations() == 0; }));
  EXPECT_EQ(c.decode(0).decodes, 0);
}

// A Reserve that the worker's end of the call times out a little before
// the router's clock reaches the request's deadline (gRPC computes the
// worker's deadline with its cached clock: up to 4 ms early was seen) is
// the request's deadline passing, not a failed decode worker: no
// migration, and the request ends DEADLINE_EXCEEDED rather than
// UNAVAILABLE. (The fake answers DEADLINE_EXCEEDED 10 ms early itself.)
TEST(RouterTest, AReserveEndedByTheRequestsDeadlineIsNoWorkerFailure) {
  Cluster c(1, 1);
  FakeDecodeWorker::Behavior late;
  late.reserve_code = grpc::StatusCode::DEADLINE_EXCEEDED;
  late.reserve_delay = absl::Milliseconds(290);
  c.decode(0).set_behavior(late);
  std::unique_ptr<GenerationClient> hasty = *GenerationClient::Create(
      c.address(), {.generate_timeout = absl::Milliseconds(300),
                    .retry = {.max_attempts = 1}});
  const Result r = c.Generate(Text("x"), nullptr, hasty.get());
  EXPECT_EQ(r.status.code(), absl::StatusCode::kDeadlineExceeded) << r.status;
  // The router's own account of it.
  std::string metrics;
  EXPECT_TRUE(Eventually([&] {
    auto got = testing_util::HttpGet(c.router().http_port(), "/metrics");
    metrics = got.ok() ? *got : "";
    return testing_util::SampleValue(
               metrics,
               R"(pdserve_router_requests_total{api="grpc",outcome="deadline_exceeded"})") == 1;
  })) << metrics;
  EXPECT_LT(testing_util::SampleValue(  // -1: no such series.
                metrics, R"(pdserve_router_requests_total{api="grpc",outcome="unavailable"})"),
            1);
  EXPECT_EQ(testing_util::SampleValue(
                metrics, R"(pdserve_router_migrations_total{outcome="limit_spent"})"),
            0);
  EXPECT_EQ(testing_util::SampleValue(
                metrics, R"(pdserve_router_migrations_total{outcome="no_worker"})"),
            0);
  // Cut short, the Reserve may have reserved: it is released.
  EXPECT_TRUE(Eventually([&] { return c.decode(0).releases == 1; }));
}

// The router stopping just as its downstream calls end. A call's context
// holds its worker's channel and may be destroyed on one of gRPC's
// callback threads after the call's callback; it must go before the
// registry's channels do (RequestOrchestrator::NewCallContext), or the
// last reference to gRPC's shared callback queue may go on that thread,
// which then aborts in grpc_cq_internal_unref. Short rounds, each ending
// its router right after its clients gave up, make that race likely.
TEST(RouterTest, StoppingAsCallsEndKeepsTheProcessAlive) {
  for (int round = 0; round < 60; ++round) {
    auto c = std::make_unique<Cluster>(1, 1);
    FakePrefillWorker::Behavior slow;
    slow.delay = absl::Milliseconds(40);
    c->prefill(0).set_behavior(slow);
    std::unique_ptr<GenerationClient> hasty = *GenerationClient::Create(
        c->address(),
        {.generate_timeout = absl::Milliseconds(10 + 5 * (round % 4)),
         .retry = {.max_attempts = 1}});
    std::vector<std::thread> calls;
    for (int i = 0; i < 8; ++i) {
      calls.emplace_back([&] {
        const Result r = c->Generate(Text("x"), nullptr, hasty.get());
        EXPECT_EQ(r.status.code(), absl::StatusCode::kDeadlineExceeded)
            << r.status;
      });
    }
    for (std::thread& t : calls) t.join();
    c.reset();
  }
}

TEST(RouterTest, DeadlineReachesTheDecodeWorker) {
  Cluster c(1, 1);
  FakeDecodeWorker::Behavior slow;
  slow.token_delay = absl::Milliseconds(20);
  c.decode(0).set_behavior(slow);
  std::unique_ptr<GenerationClient> hasty = *GenerationClient::Create(
      c.address(), {.generate_timeout = absl::Milliseconds(300)});
  v1::GenerateRequest req = Text("x", 1000);
  req.set_ignore_eos(true);
  const Result r = c.Generate(req, nullptr, hasty.get());
  EXPECT_EQ(r.status.code(), absl::StatusCode::kDeadlineExceeded) << r.status;
  EXPECT_GT(r.tokens.size(), 2u);
  EXPECT_TRUE(Eventually([&] { return c.decode(0).decodes_cancelled == 1; }));
}

TEST(RouterTest, AdmissionQueueFullIsResourceExhausted) {
  // A pool of 64 blocks of 16 tokens: one long request fills it.
  Cluster c(0, 1, [](RouterOptions& o) { o.max_queued = 1; });
  FakeDecodeWorker::Behavior slow;
  slow.token_delay = absl::Milliseconds(10);
  slow.total_blocks = 64;
  c.decode(0).set_behavior(slow);
  ASSERT_TRUE(c.decode(0).AwaitFreshReport());
  v1::GenerateRequest long_req = Text("x", 1000);
  long_req.set_ignore_eos(true);
  std::atomic<bool> stop = false;
  auto keep_going = [&](const v1::GenerateResponse&) { return !stop.load(); };
  Result first, second;
  std::thread t1([&] { first = c.Generate(long_req, keep_going); });
  ASSERT_TRUE(Eventually([&] { return c.router().running_requests() == 1; }));
  std::thread t2([&] { second = c.Generate(long_req, keep_going); });
  ASSERT_TRUE(Eventually([&] { return c.router().queued_requests() == 1; }));

  const absl::Time start = absl::Now();
  const Result third = c.Generate(Text("x"));
  EXPECT_EQ(third.status.code(), absl::StatusCode::kResourceExhausted)
      << third.status;
  EXPECT_EQ(third.messages, 0);
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));

  // Both end when their client cancels; the router is idle again.
  stop = true;
  t1.join();
  t2.join();
  EXPECT_EQ(first.status.code(), absl::StatusCode::kCancelled);
  EXPECT_TRUE(Eventually([&] {
    return c.router().running_requests() == 0 &&
           c.router().queued_requests() == 0;
  }));
  c.decode(0).set_behavior({});
  EXPECT_TRUE(c.Generate(Text("x")).status.ok());
}

TEST(RouterTest, WaitingRequestsArePlacedByPriorityThenArrival) {
  // A pool of 64 blocks: each request of 1000 tokens needs 63 of them, so
  // they run one at a time and the rest wait in the router's queue.
  Cluster c(0, 1);
  FakeDecodeWorker::Behavior b;
  b.token_delay = absl::Milliseconds(1);
  b.total_blocks = 64;
  c.decode(0).set_behavior(b);
  ASSERT_TRUE(c.decode(0).AwaitFreshReport());
  std::atomic<bool> release = false;
  auto hold = [&](const v1::GenerateResponse&) { return !release.load(); };
  v1::GenerateRequest blocker = Text("blocker", 1000);
  blocker.set_ignore_eos(true);
  Result blocked;
  std::thread t0([&] { blocked = c.Generate(blocker, hold); });
  ASSERT_TRUE(Eventually([&] { return c.decode(0).decodes == 1; }));
  // Arrival order: l (priority 5), uu (-1), nnn (0), mmmm (0); the worker
  // tells them apart by their prompt's length.
  std::vector<std::pair<std::string, int>> waiting = {
      {"l", 5}, {"uu", -1}, {"nnn", 0}, {"mmmm", 0}};
  std::vector<std::thread> threads;
  for (size_t i = 0; i < waiting.size(); ++i) {
    threads.emplace_back([&, i] {
      v1::GenerateRequest r = Text(waiting[i].first, 1000);
      r.set_priority(waiting[i].second);
      EXPECT_TRUE(c.Generate(r).status.ok());
    });
    ASSERT_TRUE(Eventually(
        [&] { return c.router().queued_requests() == int64_t(i) + 1; }));
  }
  release = true;
  t0.join();
  for (auto& t : threads) t.join();
  std::vector<int> lengths;  // Prompt lengths less BOS, in Decode order.
  for (const auto& d : c.decode(0).decode_requests()) {
    lengths.push_back(d.request().prompt_size() - 1);
  }
  // blocker, then uu, nnn, mmmm (priority, then arrival), then l.
  EXPECT_EQ(lengths, (std::vector<int>{7, 2, 3, 4, 1}));
}

TEST(RouterTest, QueuedRequestCancelledByItsClientLeavesTheQueue) {
  // A pool of 64 blocks of 16 tokens: one long request fills it.
  Cluster c(0, 1, [](RouterOptions& o) { o.max_queued = 1; });
  FakeDecodeWorker::Behavior slow;
  slow.token_delay = absl::Milliseconds(10);
  slow.total_blocks = 64;
  c.decode(0).set_behavior(slow);
  ASSERT_TRUE(c.decode(0).AwaitFreshReport());
  v1::GenerateRequest long_req = Text("x", 1000);
  long_req.set_ignore_eos(true);
  std::atomic<bool> stop = false;
  Result first;
  std::thread t1([&] {
    first = c.Generate(
        long_req, [&](const v1::GenerateResponse&) { return !stop.load(); });
  });
  ASSERT_TRUE(Eventually([&] { return c.router().running_requests() == 1; }));
  std::unique_ptr<GenerationClient> hasty = *GenerationClient::Create(
      c.address(), {.generate_timeout = absl::Milliseconds(200)});
  const Result queued = c.Generate(Text("x"), nullptr, hasty.get());
  EXPECT_EQ(queued.status.code(), absl::StatusCode::kDeadlineExceeded);
  // It leaves the queue, then ends (running counts it until then).
  EXPECT_TRUE(Eventually([&] {
    return c.router().queued_requests() == 0 &&
           c.router().running_requests() == 1;
  }));
  stop = true;
  t1.join();
}

TEST(RouterTest, BadRequestsAreInvalidArgumentWithoutMessages) {
  Cluster c(1, 1);
  v1::GenerateRequest none;
  v1::GenerateRequest bad_utf8 = Text(std::string("\xff", 1));
  v1::GenerateRequest model = Text("x");
  model.set_model("other");
  for (const v1::GenerateRequest& req : {none, bad_utf8, model}) {
    const Result r = c.Generate(req);
    EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument) << r.status;
    EXPECT_FALSE(r.status.message().empty());
    EXPECT_EQ(r.messages, 0);
  }
  EXPECT_EQ(c.decode(0).reserves, 0);
}

TEST(RouterTest, TokenizeListModelsAndHealth) {
  Cluster c(1, 2);
  v1::TokenizeRequest t;
  t.set_text("hi");
  auto ids = c.client().Tokenize(t);
  ASSERT_TRUE(ids.ok()) << ids.status();
  EXPECT_EQ(
      std::vector<int32_t>(ids->token_ids().begin(), ids->token_ids().end()),
      (std::vector<int32_t>{256, 'h', 'i'}));
  t.set_add_special_tokens(false);
  EXPECT_EQ(c.client().Tokenize(t)->token_ids_size(), 2);
  t.set_model("nope");
  EXPECT_EQ(c.client().Tokenize(t).status().code(),
            absl::StatusCode::kInvalidArgument);

  auto models = c.client().ListModels();
  ASSERT_TRUE(models.ok());
  ASSERT_EQ(models->models_size(), 1);
  EXPECT_EQ(models->models(0).name(), "builtin:tiny");
  EXPECT_EQ(models->models(0).context_length(), 4096u);
  EXPECT_EQ(models->models(0).vocab_size(), 258u);

  auto health = c.client().Health();
  ASSERT_TRUE(health.ok());
  EXPECT_TRUE(health->serving());
  EXPECT_EQ(health->prefill_workers(), 1u);
  EXPECT_EQ(health->decode_workers(), 2u);
}

TEST(RouterTest, StoppedWorkersLeaveHealth) {
  Cluster c(1, 2);
  c.decode(1).Stop();
  EXPECT_TRUE(c.WaitHealthy(1, 1));
  c.prefill(0).Stop();
  EXPECT_TRUE(c.WaitHealthy(0, 1));
  // Without prefill workers the remaining decode worker prefills itself.
  const Result r = c.Generate(Text("x"));
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(c.decode(0).decodes_local, 1);
}

TEST(RouterTest, WorkerWithTheWrongRoleIsNotUsed) {
  FakePrefillWorker prefill;
  RouterOptions options;
  options.cluster.set_model("builtin:tiny");
  auto* w = options.cluster.add_decode_workers();
  w->set_id("decode-0");
  w->set_address(prefill.address());  // Configured as decode: it is not one.
  options.poll_interval = absl::Milliseconds(20);
  auto router = Router::Start(options);
  ASSERT_TRUE(router.ok());
  auto client =
      *GenerationClient::Create(absl::StrCat("127.0.0.1:", (*router)->port()));
  absl::SleepFor(absl::Milliseconds(200));
  auto health = client->Health();
  ASSERT_TRUE(health.ok());
  EXPECT_FALSE(health->serving());
}

TEST(RouterTest, DeadDecodeWorkerMeansNotServingAndQuickUnavailable) {
  // A port nobody listens on: bind one and close it.
  std::string dead;
  {
    FakeDecodeWorker gone;
    dead = gone.address();
  }
  RouterOptions options;
  options.cluster.set_model("builtin:tiny");
  auto* w = options.cluster.add_decode_workers();
  w->set_id("decode-0");
  w->set_address(dead);
  options.poll_interval = absl::Milliseconds(20);
  auto router = Router::Start(options);
  ASSERT_TRUE(router.ok()) << router.status();
  auto client = *GenerationClient::Create(
      absl::StrCat("127.0.0.1:", (*router)->port()),
      {.retry = {.max_attempts = 1}});
  absl::SleepFor(absl::Milliseconds(100));
  auto health = client->Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_FALSE(health->serving());
  EXPECT_EQ(health->decode_workers(), 0u);

  const absl::Time start = absl::Now();
  absl::Status s = client->Generate(
      Text("x"), [](const v1::GenerateResponse&) { return true; });
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("decode"), std::string::npos) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
}

TEST(RouterTest, RouterStartFailsOnBadConfigOrAddress) {
  RouterOptions options;
  EXPECT_EQ(Router::Start(options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.cluster.set_model("builtin:tiny");
  auto* w = options.cluster.add_decode_workers();
  w->set_id("d");
  w->set_address("127.0.0.1:1");
  options.max_queued = -1;
  EXPECT_EQ(Router::Start(options).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.max_queued = 0;
  options.listen = "256.0.0.1:99999";
  EXPECT_FALSE(Router::Start(options).ok());
}

TEST(PdctlTest, RemoteCommandsPrintWhatScriptsExpect) {
  Cluster c(1, 1);
  std::ostringstream out, err;
  ASSERT_TRUE(ServerStatus(c.address(), out).ok());
  EXPECT_EQ(out.str(),
            "serving: true prefill_workers: 1 decode_workers: 1\n"
            "worker: prefill-0 role: prefill healthy: true\n"
            "  kv_transport: tcp pushes: 3 bytes: 4096 fallbacks: 1\n"
            "worker: decode-0 role: decode healthy: true\n"
            "model: builtin:tiny context_length: 4096 vocab_size: 258\n");

  out.str("");
  v1::GenerateRequest req = Text("Q: ");
  ASSERT_TRUE(GenerateRemote(c.address(), req, out, err).ok());
  EXPECT_EQ(out.str(), "Q: Hello, world!\n");
  EXPECT_EQ(err.str(),
            "[finish: stop, prompt_tokens: 4, completion_tokens: 14]\n");

  out.str("");
  ASSERT_TRUE(TokenizeRemote(c.address(), "ab", false, out).ok());
  EXPECT_EQ(out.str(), "97\n98\n");

  out.str("");
  req.set_max_tokens(0);
  EXPECT_EQ(GenerateRemote(c.address(), req, out, err).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ServerStatus("127.0.0.1:1", out).code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace pdserve
