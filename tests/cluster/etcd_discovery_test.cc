// Discovery through etcd with real processes: a real etcd started by
// deploy/local/cluster.sh --etcd, workers that register there, routers that
// watch it. Workers join and leave (SIGKILL: within the lease's TTL;
// SIGTERM: at once), two routers serve the same cluster, and a router whose
// etcd dies keeps serving from its last view and says so.
#include <gtest/gtest.h>
#include <signal.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <string>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "pdserve/v1/generation.grpc.pb.h"
#include "tests/cluster/local_cluster.h"

namespace pdserve {
namespace {

using testing_util::ClusterSpec;
using testing_util::LocalCluster;

constexpr char kLeaseTtl[] = "--etcd_lease_ttl=3s";

absl::StatusOr<v1::HealthResponse> Health(v1::Generation::Stub& router) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
  v1::HealthResponse health;
  const grpc::Status s = router.Health(&context, {}, &health);
  if (!s.ok()) return absl::UnavailableError(s.error_message());
  return health;
}

// The ids of the workers in the router's view, sorted, e.g. "decode-0 prefill-0".
std::string Workers(v1::Generation::Stub& router) {
  auto health = Health(router);
  if (!health.ok()) return "(no answer)";
  std::vector<std::string> ids;
  for (const auto& w : health->workers()) ids.push_back(w.id());
  std::sort(ids.begin(), ids.end());
  return absl::StrJoin(ids, " ");
}

// Waits until `predicate` holds, up to `limit`; how long it took.
template <typename Predicate>
absl::StatusOr<absl::Duration> WaitFor(Predicate predicate, absl::Duration limit) {
  const absl::Time start = absl::Now();
  while (absl::Now() - start < limit) {
    if (predicate()) return absl::Now() - start;
    absl::SleepFor(absl::Milliseconds(50));
  }
  return absl::DeadlineExceededError("condition not met");
}

// A greedy generation's text; an error status when the stream fails.
absl::StatusOr<std::string> Generate(v1::Generation::Stub& router, const std::string& prompt) {
  v1::GenerateRequest request;
  request.set_text(prompt);
  request.set_max_tokens(12);
  request.set_ignore_eos(true);
  request.mutable_sampling()->set_temperature(0);
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  auto stream = router.Generate(&context, request);
  std::string text;
  v1::GenerateResponse response;
  while (stream->Read(&response)) text += response.text();
  const grpc::Status s = stream->Finish();
  if (!s.ok()) return absl::UnavailableError(s.error_message());
  return text;
}

class EtcdDiscoveryTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::system("command -v etcd >/dev/null 2>&1") != 0) {
      GTEST_SKIP() << "etcd is not installed (Debian package etcd-server; deploy/install-deps.sh)";
    }
    ClusterSpec spec;
    spec.etcd = true;
    spec.prefill_args = absl::StrCat(spec.prefill_args, " ", kLeaseTtl);
    spec.decode_args = absl::StrCat(spec.decode_args, " ", kLeaseTtl);
    auto cluster = LocalCluster::Start(spec);
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = *std::move(cluster);
  }

  std::unique_ptr<LocalCluster> cluster_;
};

TEST_F(EtcdDiscoveryTest, WorkersJoinAndLeaveTheRouting) {
  v1::Generation::Stub& router = cluster_->router();
  ASSERT_EQ(Workers(router), "decode-0 prefill-0");
  auto reference = Generate(router, "Once upon a time");
  ASSERT_TRUE(reference.ok()) << reference.status();

  // Joins: a worker started later is found without touching the router.
  ASSERT_EQ(std::system(absl::StrCat(PDSERVE_SOURCE_DIR, "/deploy/local/cluster.sh add --dir '",
                                     cluster_->dir(), "' --role decode --name decode-1")
                            .c_str()),
            0);
  ASSERT_TRUE(WaitFor([&] {
                auto h = Health(router);
                return h.ok() && h->decode_workers() == 2;
              },
                      absl::Seconds(10))
                  .ok())
      << Workers(router);

  // SIGKILL: the worker cannot say goodbye; its lease (3 s) runs out and
  // etcd deletes its key, and the router drops it.
  ASSERT_TRUE(cluster_->Kill("decode-1"));
  auto left = WaitFor([&] { return Workers(router) == "decode-0 prefill-0"; }, absl::Seconds(10));
  ASSERT_TRUE(left.ok()) << Workers(router);
  EXPECT_LE(*left, absl::Seconds(3) + absl::Seconds(1.5)) << "the lease's TTL is 3 s";

  // SIGTERM: the worker withdraws its registration as it stops, before
  // its lease would expire.
  ASSERT_EQ(std::system(absl::StrCat(PDSERVE_SOURCE_DIR, "/deploy/local/cluster.sh add --dir '",
                                     cluster_->dir(), "' --role decode --name decode-2")
                            .c_str()),
            0);
  ASSERT_TRUE(WaitFor([&] { return Workers(router) == "decode-0 decode-2 prefill-0"; },
                      absl::Seconds(10))
                  .ok());
  ASSERT_EQ(::kill(cluster_->Pid("decode-2"), SIGTERM), 0);
  EXPECT_TRUE(WaitFor([&] { return Workers(router) == "decode-0 prefill-0"; }, absl::Seconds(10))
                  .ok())
      << Workers(router);

  auto after = Generate(router, "Once upon a time");
  ASSERT_TRUE(after.ok()) << after.status();
  EXPECT_EQ(*after, *reference);
}

TEST_F(EtcdDiscoveryTest, TwoRoutersServeTheSameCluster) {
  // A second router, from the first one's command line with its own ports.
  const std::string dir = cluster_->dir();
  const std::string command = absl::StrCat(
      PDSERVE_BINARY_DIR, "/router/pd-router --config='", dir, "/cluster.json' --etcd=http://",
      cluster_->Address("etcd"), " --listen=127.0.0.1:0 --http_listen= --port_file='", dir,
      "/router-b.port' >'", dir, "/router-b.log' 2>&1 & echo $! >'", dir, "/router-b.pid'");
  ASSERT_EQ(std::system(command.c_str()), 0);
  ASSERT_TRUE(WaitFor([&] { return !cluster_->Address("router-b").ends_with(":"); },
                      absl::Seconds(10))
                  .ok());
  auto b = v1::Generation::NewStub(
      grpc::CreateChannel(cluster_->Address("router-b"), grpc::InsecureChannelCredentials()));
  ASSERT_TRUE(WaitFor([&] {
                auto h = Health(*b);
                return h.ok() && h->serving() && h->prefill_workers() == 1;
              },
                      absl::Seconds(10))
                  .ok())
      << cluster_->Log("router-b");
  EXPECT_EQ(Workers(*b), Workers(cluster_->router()));
  auto from_a = Generate(cluster_->router(), "The little dog");
  auto from_b = Generate(*b, "The little dog");
  ASSERT_TRUE(from_a.ok()) << from_a.status();
  ASSERT_TRUE(from_b.ok()) << from_b.status();
  EXPECT_EQ(*from_a, *from_b);
}

TEST_F(EtcdDiscoveryTest, WithoutEtcdTheRouterServesFromItsLastViewAndSaysSo) {
  v1::Generation::Stub& router = cluster_->router();
  auto health = Health(router);
  ASSERT_TRUE(health.ok());
  EXPECT_EQ(health->discovery().source(), "etcd");
  EXPECT_TRUE(health->discovery().connected());

  const pid_t etcd = cluster_->Pid("etcd");
  ASSERT_EQ(::kill(etcd, SIGKILL), 0);
  ASSERT_TRUE(WaitFor([&] {
                auto h = Health(router);
                return h.ok() && !h->discovery().connected();
              },
                      absl::Seconds(10))
                  .ok());
  health = Health(router);
  ASSERT_TRUE(health.ok());
  EXPECT_FALSE(health->discovery().error().empty());
  EXPECT_TRUE(health->serving());
  EXPECT_EQ(Workers(router), "decode-0 prefill-0");
  auto text = Generate(router, "Once upon a time");
  EXPECT_TRUE(text.ok()) << text.status();
  // Past the workers' lease TTL: still the last view.
  absl::SleepFor(absl::Seconds(4));
  EXPECT_EQ(Workers(router), "decode-0 prefill-0");
}

}  // namespace
}  // namespace pdserve
