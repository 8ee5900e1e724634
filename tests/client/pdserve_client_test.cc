// GenerationClient's call contract against a real pd-router (in process)
// with in-process fake workers (tests/router/fake_workers.h) for faults:
// retries only on UNAVAILABLE / RESOURCE_EXHAUSTED and only before the
// first token, bounded attempts, deadlines over all attempts, cancellation
// from another thread, from the callback and during a backoff, the API
// key, the request id, and TLS.
#include "client/pdserve_client.h"

#include <atomic>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/synchronization/notification.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "router/router.h"
#include "tests/router/fake_workers.h"

namespace pdserve {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;
using testing_util::FakeDecodeWorker;
using testing_util::FakePrefillWorker;

bool Eventually(const std::function<bool()>& done) {
  for (int i = 0; i < 500; ++i) {
    if (done()) return true;
    absl::SleepFor(absl::Milliseconds(10));
  }
  return done();
}

// A router with one fake prefill and one fake decode worker.
class Cluster {
 public:
  explicit Cluster(const std::function<void(RouterOptions&)>& tweak = nullptr) {
    RouterOptions options;
    options.cluster.set_model("builtin:tiny");
    auto* p = options.cluster.add_prefill_workers();
    p->set_id("prefill-0");
    p->set_address(prefill_.address());
    auto* d = options.cluster.add_decode_workers();
    d->set_id("decode-0");
    d->set_address(decode_.address());
    options.poll_interval = absl::Milliseconds(20);
    // Every prompt goes to a prefill worker when one is up.
    options.cluster.mutable_routing()->set_local_prefill_max_tokens(0);
    if (tweak) tweak(options);
    auto router = Router::Start(options);
    EXPECT_TRUE(router.ok()) << router.status();
    router_ = *std::move(router);
    address_ = absl::StrCat("127.0.0.1:", router_->port());
    auto probe = *GenerationClient::Create(address_);
    EXPECT_TRUE(Eventually([&] {
      auto h = probe->Health();
      return h.ok() && h->prefill_workers() == 1 && h->decode_workers() == 1;
    }));
  }

  std::unique_ptr<GenerationClient> Client(
      GenerationClient::Options options = {}) {
    auto client = GenerationClient::Create(address_, options);
    EXPECT_TRUE(client.ok()) << client.status();
    return *std::move(client);
  }

  FakePrefillWorker& prefill() { return prefill_; }
  FakeDecodeWorker& decode() { return decode_; }
  Router& router() { return *router_; }

 private:
  FakePrefillWorker prefill_;
  FakeDecodeWorker decode_;
  std::unique_ptr<Router> router_;
  std::string address_;
};

struct Result {
  absl::Status status;
  std::string text;
  std::vector<int32_t> tokens;
  std::vector<std::string> request_ids;
};

Result Generate(
    GenerationClient& client, const v1::GenerateRequest& request,
    Cancellation* cancellation = nullptr,
    const std::function<bool(const v1::GenerateResponse&)>& on = nullptr) {
  Result out;
  out.status = client.Generate(
      request,
      [&](const v1::GenerateResponse& r) {
        out.text += r.text();
        out.tokens.insert(out.tokens.end(), r.token_ids().begin(),
                          r.token_ids().end());
        out.request_ids.push_back(r.request_id());
        return on ? on(r) : true;
      },
      cancellation);
  return out;
}

v1::GenerateRequest Text(const std::string& text, uint32_t max_tokens = 64,
                         bool ignore_eos = false) {
  v1::GenerateRequest r;
  r.set_text(text);
  r.set_max_tokens(max_tokens);
  r.set_ignore_eos(ignore_eos);
  return r;
}

// A router whose one decode worker has room for one long request and that
// queues none, held by such a request (a slow decode worker) until
// release().
class Blocked {
 public:
  Blocked() : cluster_([](RouterOptions& o) { o.max_queued = 0; }) {
    // A pool of 64 blocks of 16 tokens: the long request fills it.
    FakeDecodeWorker::Behavior slow;
    slow.token_delay = absl::Milliseconds(10);
    slow.total_blocks = 64;
    cluster_.decode().set_behavior(slow);
    EXPECT_TRUE(cluster_.decode().AwaitFreshReport());
    blocker_client_ = cluster_.Client();
    blocker_ = std::thread([this] {
      blocker_result_ =
          Generate(*blocker_client_, Text("x", 1000, true), &release_);
    });
    EXPECT_TRUE(
        Eventually([&] { return cluster_.router().running_requests() == 1; }));
  }
  ~Blocked() { Release(); }

  void Release() {
    release_.Cancel();
    if (blocker_.joinable()) blocker_.join();
    cluster_.decode().set_behavior({});
  }

  Cluster& cluster() { return cluster_; }

 private:
  Cluster cluster_;
  std::unique_ptr<GenerationClient> blocker_client_;
  Cancellation release_;
  Result blocker_result_;
  std::thread blocker_;
};

TEST(GenerationClientTest, GeneratesAndCallsTheUnaryMethods) {
  Cluster c;
  auto client = c.Client();
  const Result r = Generate(*client, Text("Say hi"));
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_EQ(r.text, "Hello, world!");
  auto tokens = client->Tokenize([] {
    v1::TokenizeRequest t;
    t.set_text("ab");
    t.set_add_special_tokens(false);
    return t;
  }());
  ASSERT_TRUE(tokens.ok()) << tokens.status();
  EXPECT_THAT(tokens->token_ids(), ::testing::ElementsAre('a', 'b'));
  auto models = client->ListModels();
  ASSERT_TRUE(models.ok()) << models.status();
  EXPECT_EQ(models->models(0).name(), "builtin:tiny");
}

TEST(GenerationClientTest, RequestIdIsTheCallersOrOneMadeForTheCall) {
  Cluster c;
  auto client = c.Client();
  v1::GenerateRequest mine = Text("x");
  mine.set_request_id("my-request-7");
  const Result a = Generate(*client, mine);
  ASSERT_TRUE(a.status.ok()) << a.status;
  for (const std::string& id : a.request_ids) EXPECT_EQ(id, "my-request-7");

  const Result b = Generate(*client, Text("x"));
  ASSERT_TRUE(b.status.ok()) << b.status;
  ASSERT_FALSE(b.request_ids.empty());
  // The client's id (32 hex digits), not the router's "req-N".
  EXPECT_EQ(b.request_ids[0].size(), 32u) << b.request_ids[0];
  for (const std::string& id : b.request_ids) EXPECT_EQ(id, b.request_ids[0]);
  const Result again = Generate(*client, Text("x"));
  EXPECT_NE(again.request_ids.at(0), b.request_ids[0]);
}

TEST(GenerationClientTest, ResourceExhaustedBeforeTheFirstTokenIsRetried) {
  Blocked blocked;
  // Without retries the router's refusal is what the caller sees.
  auto once = blocked.cluster().Client({.retry = {.max_attempts = 1}});
  const Result refused = Generate(*once, Text("x"));
  EXPECT_EQ(refused.status.code(), absl::StatusCode::kResourceExhausted)
      << refused.status;

  // With retries, the call outlasts the blocker: it is freed 300 ms in,
  // while the client backs off and tries again.
  auto patient = blocked.cluster().Client(
      {.retry = {.max_attempts = 20,
                 .initial_backoff = absl::Milliseconds(50),
                 .multiplier = 1.5,
                 .max_backoff = absl::Milliseconds(200)}});
  std::thread release([&] {
    absl::SleepFor(absl::Milliseconds(300));
    blocked.Release();
  });
  const absl::Time start = absl::Now();
  const Result r = Generate(*patient, Text("Say hi"));
  release.join();
  ASSERT_TRUE(r.status.ok()) << r.status;
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(250));
  EXPECT_EQ(r.text, "Hello, world!");
  // One prefill for the blocker, one for the call that went through: the
  // refused attempts never reached a worker.
  EXPECT_EQ(blocked.cluster().prefill().prefills, 2);
}

TEST(GenerationClientTest, AttemptsAreBounded) {
  Blocked blocked;
  auto client = blocked.cluster().Client(
      {.retry = {.max_attempts = 3,
                 .initial_backoff = absl::Milliseconds(20),
                 .max_backoff = absl::Milliseconds(40)}});
  const absl::Time start = absl::Now();
  const Result r = Generate(*client, Text("x"));
  EXPECT_EQ(r.status.code(), absl::StatusCode::kResourceExhausted) << r.status;
  EXPECT_THAT(r.status.message(), HasSubstr("attempt 3; no attempt left"));
  // Two backoffs: 10..20 ms then 20..40 ms (jitter 0.5).
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(30));
  EXPECT_TRUE(r.tokens.empty());
}

TEST(GenerationClientTest, UnreachableServerIsUnavailableAfterEveryAttempt) {
  // A port nobody listens on: bind one and close it.
  std::string dead;
  {
    FakeDecodeWorker gone;
    dead = gone.address();
  }
  auto client = *GenerationClient::Create(
      dead, {.retry = {.max_attempts = 2,
                       .initial_backoff = absl::Milliseconds(10)}});
  const Result r = Generate(*client, Text("x"));
  EXPECT_EQ(r.status.code(), absl::StatusCode::kUnavailable) << r.status;
  EXPECT_THAT(r.status.message(), HasSubstr("attempt 2"));
  auto health = client->Health();
  EXPECT_EQ(health.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_THAT(health.status().message(), HasSubstr("attempt 2"));
}

TEST(GenerationClientTest, AFailureAfterTheFirstTokenIsNeverRetried) {
  Cluster c;
  FakeDecodeWorker::Behavior flaky;
  flaky.fail_decode_after = 3;
  c.decode().set_behavior(flaky);
  auto client = c.Client(
      {.retry = {.max_attempts = 5, .initial_backoff = absl::Milliseconds(1)}});
  const Result r = Generate(*client, Text("Say hi"));
  EXPECT_EQ(r.status.code(), absl::StatusCode::kUnavailable) << r.status;
  EXPECT_THAT(r.status.message(), Not(HasSubstr("(attempt ")));
  // The tokens delivered are a prefix of the script, each once.
  ASSERT_FALSE(r.text.empty());
  EXPECT_EQ(std::string("Hello, world!").substr(0, r.text.size()), r.text);
  // One attempt: one prefill on the prefill worker.
  EXPECT_EQ(c.prefill().prefills, 1);
}

TEST(GenerationClientTest, OtherCodesAreNotRetried) {
  Cluster c;
  auto client = c.Client({.retry = {.max_attempts = 5}});
  v1::GenerateRequest bad = Text("x");
  bad.set_max_tokens(0);
  const Result r = Generate(*client, bad);
  EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument) << r.status;
  EXPECT_THAT(r.status.message(), Not(HasSubstr("(attempt ")));
}

TEST(GenerationClientTest, TheDeadlineCoversTheWholeStream) {
  Cluster c;
  FakeDecodeWorker::Behavior slow;
  slow.token_delay = absl::Milliseconds(20);
  c.decode().set_behavior(slow);
  auto client = c.Client({.generate_timeout = absl::Milliseconds(300)});
  const absl::Time start = absl::Now();
  const Result r = Generate(*client, Text("x", 1000, true));
  EXPECT_EQ(r.status.code(), absl::StatusCode::kDeadlineExceeded) << r.status;
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
  EXPECT_GT(r.tokens.size(), 2u);
  EXPECT_TRUE(Eventually([&] { return c.decode().decodes_cancelled == 1; }));
  EXPECT_EQ(c.prefill().prefills, 1);
}

TEST(GenerationClientTest, TheDeadlineBoundsTheRetries) {
  Blocked blocked;
  auto client = blocked.cluster().Client(
      {.generate_timeout = absl::Milliseconds(400),
       .retry = {.max_attempts = 100,
                 .initial_backoff = absl::Milliseconds(100),
                 .max_backoff = absl::Milliseconds(100)}});
  const absl::Time start = absl::Now();
  const Result r = Generate(*client, Text("x"));
  // Ended by the deadline, not by 100 attempts (~7.5 s of backoff): the
  // last refusal when no backoff fits before it (or, on a machine slow
  // enough that an attempt straddles it, the deadline itself).
  EXPECT_LT(absl::Now() - start, absl::Seconds(1));
  if (r.status.code() == absl::StatusCode::kResourceExhausted) {
    EXPECT_THAT(r.status.message(),
                HasSubstr("no time left before the deadline"));
  } else {
    EXPECT_EQ(r.status.code(), absl::StatusCode::kDeadlineExceeded) << r.status;
  }
}

TEST(GenerationClientTest, CancelFromAnotherThreadEndsTheStreamAtTheWorker) {
  Cluster c;
  FakeDecodeWorker::Behavior slow;
  slow.token_delay = absl::Milliseconds(20);
  c.decode().set_behavior(slow);
  auto client = c.Client();
  Cancellation cancellation;
  absl::Notification first;
  std::thread canceller([&] {
    first.WaitForNotificationWithTimeout(absl::Seconds(10));
    absl::SleepFor(absl::Milliseconds(50));
    cancellation.Cancel();
  });
  const Result r = Generate(*client, Text("x", 1000, true), &cancellation,
                            [&](const v1::GenerateResponse&) {
                              if (!first.HasBeenNotified()) first.Notify();
                              return true;
                            });
  canceller.join();
  EXPECT_EQ(r.status.code(), absl::StatusCode::kCancelled) << r.status;
  EXPECT_GE(r.tokens.size(), 1u);
  EXPECT_TRUE(Eventually([&] { return c.decode().decodes_cancelled == 1; }));
  EXPECT_TRUE(Eventually([&] { return c.router().running_requests() == 0; }));
  EXPECT_EQ(c.decode().reservations(), 0);
}

TEST(GenerationClientTest, CancelFromTheCallbackStopsTheMessages) {
  Cluster c;
  FakeDecodeWorker::Behavior slow;
  slow.token_delay = absl::Milliseconds(5);
  c.decode().set_behavior(slow);
  auto client = c.Client();
  Cancellation cancellation;
  int calls = 0;
  const Result r = Generate(*client, Text("x", 1000, true), &cancellation,
                            [&](const v1::GenerateResponse&) {
                              if (++calls == 3) cancellation.Cancel();
                              return true;
                            });
  EXPECT_EQ(r.status.code(), absl::StatusCode::kCancelled) << r.status;
  // gRPC may have had a few messages buffered, never the whole stream.
  EXPECT_LT(calls, 50);
  EXPECT_TRUE(Eventually([&] { return c.decode().decodes_cancelled == 1; }));

  // Returning false from the callback cancels as well (at the third
  // message, when the decode worker is streaming: the first comes from the
  // prefill worker).
  int seen = 0;
  const Result stopped =
      Generate(*client, Text("x", 1000, true), nullptr,
               [&](const v1::GenerateResponse&) { return ++seen < 3; });
  EXPECT_EQ(stopped.status.code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(stopped.request_ids.size(), 3u);
  EXPECT_TRUE(Eventually([&] { return c.decode().decodes_cancelled == 2; }));
}

TEST(GenerationClientTest, ACancelledCancellationStopsACallBeforeAndBetween) {
  {
    Cluster c;
    auto client = c.Client();
    Cancellation cancelled;
    cancelled.Cancel();
    const Result r = Generate(*client, Text("x"), &cancelled);
    EXPECT_EQ(r.status.code(), absl::StatusCode::kCancelled);
    EXPECT_EQ(c.decode().reserves, 0);
  }
  // During a backoff: the wait ends at once.
  Blocked blocked;
  auto client =
      blocked.cluster().Client({.retry = {.max_attempts = 5,
                                          .initial_backoff = absl::Seconds(5),
                                          .max_backoff = absl::Seconds(5),
                                          .jitter = 0}});
  Cancellation cancellation;
  std::thread canceller([&] {
    absl::SleepFor(absl::Milliseconds(200));
    cancellation.Cancel();
  });
  const absl::Time start = absl::Now();
  const Result r = Generate(*client, Text("x"), &cancellation);
  canceller.join();
  EXPECT_EQ(r.status.code(), absl::StatusCode::kCancelled) << r.status;
  EXPECT_LT(absl::Now() - start, absl::Seconds(2));
}

TEST(GenerationClientTest, TheApiKeyIsSentAsBearer) {
  Cluster c([](RouterOptions& o) { o.api_keys = {"sdk-key"}; });
  auto keyed = c.Client({.api_key = "sdk-key"});
  const Result ok = Generate(*keyed, Text("Say hi"));
  ASSERT_TRUE(ok.status.ok()) << ok.status;
  EXPECT_EQ(ok.text, "Hello, world!");
  EXPECT_TRUE(keyed->ListModels().ok());

  for (const std::string key : {"", "other-key"}) {
    auto client = c.Client({.retry = {.max_attempts = 5}, .api_key = key});
    const Result r = Generate(*client, Text("x"));
    EXPECT_EQ(r.status.code(), absl::StatusCode::kUnauthenticated) << key;
    // Not retried.
    EXPECT_THAT(r.status.message(), Not(HasSubstr("(attempt "))) << key;
    EXPECT_EQ(client->ListModels().status().code(),
              absl::StatusCode::kUnauthenticated);
    // Health stays open.
    EXPECT_TRUE(client->Health().ok());
  }
  EXPECT_EQ(c.prefill().prefills, 1);
}

TEST(GenerationClientTest, CreateRefusesBadOptions) {
  EXPECT_EQ(GenerationClient::Create("").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GenerationClient::Create("127.0.0.1:1", {.api_key = "a b"})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      GenerationClient::Create("127.0.0.1:1", {.retry = {.max_attempts = 0}})
          .status()
          .code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GenerationClient::Create("127.0.0.1:1", {.retry = {.jitter = 2}})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(GenerationClient::Create("127.0.0.1:1",
                                     {.generate_timeout = absl::ZeroDuration()})
                .status()
                .code(),
            absl::StatusCode::kInvalidArgument);
}

std::string Fixture(const std::string& name) {
  std::ifstream in(std::string(PDSERVE_FIXTURES_DIR) + "/tls/" + name);
  std::stringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

// A TLS server of the public API answering Health: pd-router serves
// plaintext (TLS ends in front of it), so the client's TLS options are
// tested against this one, with the self-signed certificate of
// tests/fixtures/tls.
class TlsHealthServer final : public v1::Generation::Service {
 public:
  TlsHealthServer() {
    grpc::SslServerCredentialsOptions ssl;
    ssl.pem_key_cert_pairs.push_back(
        {Fixture("server.key"), Fixture("server.pem")});
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::SslServerCredentials(ssl),
                             &port_);
    builder.RegisterService(this);
    server_ = builder.BuildAndStart();
  }
  ~TlsHealthServer() override {
    server_->Shutdown(absl::ToChronoTime(absl::Now()));
  }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }

  grpc::Status Health(grpc::ServerContext*, const v1::HealthRequest*,
                      v1::HealthResponse* response) override {
    response->set_serving(true);
    return grpc::Status::OK;
  }

 private:
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

TEST(GenerationClientTest, TlsWithTheServersRootCertificate) {
  const std::string pem = Fixture("server.pem");
  ASSERT_FALSE(pem.empty());
  TlsHealthServer server;
  const RetryPolicy once = {.max_attempts = 1};
  auto trusted = *GenerationClient::Create(
      server.address(),
      {.retry = once, .tls = true, .tls_root_certificates = pem});
  auto health = trusted->Health();
  ASSERT_TRUE(health.ok()) << health.status();
  EXPECT_TRUE(health->serving());

  // Plaintext to a TLS server, and TLS with roots that do not sign its
  // certificate (the system's), both fail to connect.
  auto plaintext = *GenerationClient::Create(
      server.address(), {.call_timeout = absl::Seconds(2), .retry = once});
  EXPECT_EQ(plaintext->Health().status().code(),
            absl::StatusCode::kUnavailable);
  auto untrusting = *GenerationClient::Create(
      server.address(),
      {.call_timeout = absl::Seconds(2), .retry = once, .tls = true});
  EXPECT_EQ(untrusting->Health().status().code(),
            absl::StatusCode::kUnavailable);
}

}  // namespace
}  // namespace pdserve
