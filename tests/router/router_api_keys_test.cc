// pd-router with API keys, against in-process fake workers: every call but
// Health needs `authorization: Bearer <key>`; without keys all is open.
#include <memory>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gmock/gmock.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "pdserve/v1/generation.grpc.pb.h"
#include "router/router.h"
#include "tests/router/fake_workers.h"

namespace pdserve {
namespace {

using ::testing::HasSubstr;
using testing_util::FakeDecodeWorker;
using testing_util::FakePrefillWorker;

class KeyedRouter {
 public:
  explicit KeyedRouter(std::vector<std::string> keys) {
    RouterOptions options;
    options.cluster.set_model("builtin:tiny");
    // Every prompt to the prefill worker: its Reserve counts the calls.
    options.cluster.mutable_routing()->set_local_prefill_max_tokens(0);
    auto* p = options.cluster.add_prefill_workers();
    p->set_id("prefill-0");
    p->set_address(prefill_.address());
    auto* d = options.cluster.add_decode_workers();
    d->set_id("decode-0");
    d->set_address(decode_.address());
    options.poll_interval = absl::Milliseconds(20);
    options.api_keys = std::move(keys);
    auto router = Router::Start(options);
    EXPECT_TRUE(router.ok()) << router.status();
    router_ = *std::move(router);
    stub_ = v1::Generation::NewStub(
        grpc::CreateChannel(absl::StrCat("127.0.0.1:", router_->port()),
                            grpc::InsecureChannelCredentials()));
    // Health is open: wait on it until both workers are seen.
    for (int i = 0; i < 500; ++i) {
      v1::HealthResponse h;
      if (Health(&h).ok() && h.decode_workers() == 1 &&
          h.prefill_workers() == 1) {
        break;
      }
      absl::SleepFor(absl::Milliseconds(10));
    }
  }

  Router& router() { return *router_; }

  grpc::Status Health(v1::HealthResponse* out,
                      const std::string& authorization = "") {
    grpc::ClientContext context;
    Prepare(context, authorization);
    return stub_->Health(&context, v1::HealthRequest(), out);
  }

  // Generate's status and text.
  grpc::Status Generate(const std::string& authorization, std::string* text) {
    grpc::ClientContext context;
    Prepare(context, authorization);
    v1::GenerateRequest request;
    request.set_text("Say hi");
    request.set_max_tokens(64);
    auto reader = stub_->Generate(&context, request);
    v1::GenerateResponse response;
    while (reader->Read(&response)) *text += response.text();
    return reader->Finish();
  }

  grpc::Status Tokenize(const std::string& authorization) {
    grpc::ClientContext context;
    Prepare(context, authorization);
    v1::TokenizeRequest request;
    request.set_text("hi");
    v1::TokenizeResponse response;
    return stub_->Tokenize(&context, request, &response);
  }

  grpc::Status ListModels(const std::string& authorization) {
    grpc::ClientContext context;
    Prepare(context, authorization);
    v1::ListModelsResponse response;
    return stub_->ListModels(&context, v1::ListModelsRequest(), &response);
  }

  FakeDecodeWorker& decode() { return decode_; }

 private:
  static void Prepare(grpc::ClientContext& context,
                      const std::string& authorization) {
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    if (!authorization.empty()) {
      context.AddMetadata("authorization", authorization);
    }
  }

  FakePrefillWorker prefill_;
  FakeDecodeWorker decode_;
  std::unique_ptr<Router> router_;
  std::unique_ptr<v1::Generation::Stub> stub_;
};

TEST(RouterApiKeysTest, WithoutKeysEverythingIsOpen) {
  KeyedRouter r({});
  EXPECT_FALSE(r.router().api_keys().enabled());
  std::string text;
  const grpc::Status s = r.Generate("", &text);
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(text, "Hello, world!");
  EXPECT_TRUE(r.Tokenize("").ok());
  EXPECT_TRUE(r.ListModels("").ok());
  // A key sent to an open router is ignored.
  EXPECT_TRUE(r.ListModels("Bearer anything").ok());
}

TEST(RouterApiKeysTest, EveryCallButHealthNeedsAValidKey) {
  KeyedRouter r({"key-a", "key-b"});
  ASSERT_TRUE(r.router().api_keys().enabled());

  v1::HealthResponse health;
  const grpc::Status h = r.Health(&health);
  ASSERT_TRUE(h.ok()) << h.error_message();
  EXPECT_TRUE(health.serving());

  for (const std::string bad : {"", "key-a", "Bearer key-c", "Basic key-a"}) {
    std::string text;
    const grpc::Status g = r.Generate(bad, &text);
    EXPECT_EQ(g.error_code(), grpc::StatusCode::UNAUTHENTICATED) << bad;
    EXPECT_THAT(g.error_message(), HasSubstr("authorization: Bearer <key>"));
    EXPECT_EQ(text, "");
    EXPECT_EQ(r.Tokenize(bad).error_code(), grpc::StatusCode::UNAUTHENTICATED)
        << bad;
    EXPECT_EQ(r.ListModels(bad).error_code(), grpc::StatusCode::UNAUTHENTICATED)
        << bad;
  }
  // Refused calls never reached a worker.
  EXPECT_EQ(r.decode().reserves, 0);

  for (const std::string good : {"Bearer key-a", "bearer key-b"}) {
    std::string text;
    const grpc::Status g = r.Generate(good, &text);
    EXPECT_TRUE(g.ok()) << good << ": " << g.error_message();
    EXPECT_EQ(text, "Hello, world!");
    EXPECT_TRUE(r.Tokenize(good).ok()) << good;
    EXPECT_TRUE(r.ListModels(good).ok()) << good;
  }
  EXPECT_EQ(r.decode().reserves, 2);
  // The HTTP front door checks the same set.
  EXPECT_TRUE(r.router().api_keys().Check("Bearer key-b").ok());
}

TEST(RouterApiKeysTest, AnInvalidKeyStopsTheRouterFromStarting) {
  RouterOptions options;
  options.cluster.set_model("builtin:tiny");
  options.cluster.add_decode_workers()->set_id("decode-0");
  options.cluster.mutable_decode_workers(0)->set_address("127.0.0.1:1");
  options.api_keys = {"has space"};
  auto router = Router::Start(options);
  ASSERT_FALSE(router.ok());
  EXPECT_EQ(router.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(router.status().message(), HasSubstr("API key 1 of 1"));
}

}  // namespace
}  // namespace pdserve
