// pd-decode's service in-process, driven through its real gRPC stub:
// reservations that expire, Decode calls whose KV never comes, refusals,
// and notifications that are not ours. (Decoding after a real prefill is
// covered end to end by tests/cluster.)
#include <memory>

#include "absl/time/clock.h"
#include "decode_worker/decode_server.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "kv_transfer/transport.h"

namespace pdserve {
namespace {

namespace wire = ::pdserve::internal::v1;

class DecodeWorkerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    DecodeServerOptions options;
    options.worker.kv_cache_bytes = size_t{4} << 20;
    options.worker.num_threads = 1;
    options.worker.reservation_timeout = absl::Milliseconds(300);
    auto server = DecodeServer::Start(options);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    stub_ = wire::DecodeWorker::NewStub(grpc::CreateChannel(
        absl::StrCat("127.0.0.1:", server_->port()), grpc::InsecureChannelCredentials()));
    idle_ = Load().free_blocks();
  }

  wire::LoadReport Load() {
    grpc::ClientContext ctx;
    wire::LoadReport load;
    EXPECT_TRUE(stub_->GetLoad(&ctx, {}, &load).ok());
    return load;
  }

  grpc::Status Reserve(uint64_t id, uint32_t tokens, wire::Landing* landing) {
    grpc::ClientContext ctx;
    wire::ReserveRequest r;
    r.set_request_id(id);
    r.set_num_tokens(tokens);
    return stub_->Reserve(&ctx, r, landing);
  }

  // Runs a Decode call to its end; returns its status and token count.
  std::pair<grpc::Status, int> Decode(uint64_t id, bool with_first_token, int prompt_len = 8,
                                      uint32_t max_tokens = 4) {
    wire::DecodeRequest r;
    wire::EngineRequest* e = r.mutable_request();
    e->set_request_id(id);
    for (int i = 0; i < prompt_len; ++i) e->add_prompt(i == 0 ? 256 : 'a' + i % 26);
    e->set_top_p(1.0f);
    e->set_max_tokens(max_tokens);
    e->set_ignore_eos(true);
    if (with_first_token) r.mutable_first_token()->set_token_id('x');
    grpc::ClientContext ctx;
    ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
    auto reader = stub_->Decode(&ctx, r);
    wire::DecodeResponse msg;
    int tokens = 0;
    while (reader->Read(&msg)) tokens += msg.tokens_size();
    return {reader->Finish(), tokens};
  }

  void ExpectIdle() {
    uint32_t free = 0;
    for (int i = 0; i < 100 && (free = Load().free_blocks()) != idle_; ++i) {
      absl::SleepFor(absl::Milliseconds(20));
    }
    EXPECT_EQ(free, idle_);
    EXPECT_EQ(Load().reservations(), 0u);
  }

  std::unique_ptr<DecodeServer> server_;
  std::unique_ptr<wire::DecodeWorker::Stub> stub_;
  uint32_t idle_ = 0;
};

TEST_F(DecodeWorkerTest, LocalPrefillStreamsEveryToken) {
  auto [status, tokens] = Decode(1, /*with_first_token=*/false, 40, 12);
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(tokens, 12);
  ExpectIdle();
}

TEST_F(DecodeWorkerTest, LandingDescribesThePool) {
  wire::Landing landing;
  ASSERT_TRUE(Reserve(1, 40, &landing).ok());
  EXPECT_EQ(landing.block_ids_size(), 3);  // 40 tokens in blocks of 16.
  EXPECT_EQ(landing.transport(), "tcp");
  EXPECT_FALSE(landing.endpoint().empty());
  EXPECT_EQ(landing.layout().block_size(), 16u);
  EXPECT_EQ(landing.pool_blocks(), Load().total_blocks());
  EXPECT_EQ(Load().free_blocks(), idle_ - 3);
  EXPECT_EQ(Load().reservations(), 1u);
}

TEST_F(DecodeWorkerTest, UnusedReservationExpiresAndFreesItsBlocks) {
  wire::Landing landing;
  ASSERT_TRUE(Reserve(1, 100, &landing).ok());
  EXPECT_LT(Load().free_blocks(), idle_);
  ExpectIdle();
}

TEST_F(DecodeWorkerTest, DecodeWhoseKvNeverArrivesEndsWithDeadlineExceeded) {
  wire::Landing landing;
  ASSERT_TRUE(Reserve(1, 12, &landing).ok());
  auto [status, tokens] = Decode(1, /*with_first_token=*/true);
  EXPECT_EQ(status.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << status.error_message();
  EXPECT_EQ(tokens, 0);
  ExpectIdle();
}

TEST_F(DecodeWorkerTest, ReleaseFreesAReservation) {
  wire::Landing landing;
  ASSERT_TRUE(Reserve(1, 12, &landing).ok());
  grpc::ClientContext ctx;
  wire::ReleaseRequest r;
  r.set_request_id(1);
  wire::ReleaseResponse out;
  ASSERT_TRUE(stub_->Release(&ctx, r, &out).ok());
  EXPECT_EQ(Load().free_blocks(), idle_);
  grpc::ClientContext ctx2;
  r.set_request_id(999);  // Unknown ids are fine.
  EXPECT_TRUE(stub_->Release(&ctx2, r, &out).ok());
}

TEST_F(DecodeWorkerTest, RefusalsHaveTheirCodes) {
  wire::Landing landing;
  EXPECT_EQ(Reserve(1, 0, &landing).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Reserve(2, 4096, &landing).error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED)
      << "a 4 MiB pool cannot hold 4096 tokens";
  EXPECT_EQ(Decode(3, /*with_first_token=*/true).first.error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(Decode(4, false, /*prompt_len=*/0).first.error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(Decode(5, false, 8, /*max_tokens=*/0).first.error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  ASSERT_TRUE(Reserve(6, 12, &landing).ok());
  EXPECT_EQ(Reserve(6, 12, &landing).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ExpectIdle();
}

TEST_F(DecodeWorkerTest, NotificationsThatAreNotOursAreIgnored) {
  wire::Landing landing;
  ASSERT_TRUE(Reserve(1, 12, &landing).ok());
  auto sender = kv::CreateKvTransport("tcp", {});
  ASSERT_TRUE(sender.ok());
  auto conn = (*sender)->Connect(landing.endpoint());
  ASSERT_TRUE(conn.ok()) << conn.status();
  EXPECT_TRUE((*conn)->Notify("\xff\xff not a proto").ok());
  wire::KvComplete unknown;
  unknown.set_request_id(12345);
  EXPECT_TRUE((*conn)->Notify(unknown.SerializeAsString()).ok());
  // The real one: the reserved request decodes (its KV is garbage, which is
  // fine for this test) and the worker is still healthy.
  wire::KvComplete complete;
  complete.set_request_id(1);
  complete.set_num_tokens(8);
  EXPECT_TRUE((*conn)->Notify(complete.SerializeAsString()).ok());
  auto [status, tokens] = Decode(1, /*with_first_token=*/true);
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(tokens, 3);  // The first of max_tokens 4 came from "prefill".
  ExpectIdle();
}

}  // namespace
}  // namespace pdserve
