// EtcdClient and EtcdRegistration against a real etcd (tests/common/etcd_server.h).
#include "common/etcd_client.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "absl/time/clock.h"
#include "common/etcd_registration.h"
#include "tests/common/etcd_server.h"

namespace pdserve {
namespace {

using testing_util::EtcdServer;

class EtcdClientTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = EtcdServer::Start();
    if (absl::IsFailedPrecondition(server.status())) GTEST_SKIP() << server.status();
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    auto client = EtcdClient::Create({.endpoints = {server_->endpoint()}});
    ASSERT_TRUE(client.ok()) << client.status();
    client_ = *std::move(client);
  }

  // Polls until `key`'s presence is `present`, up to `limit`.
  bool WaitForKey(const std::string& key, bool present, absl::Duration limit) {
    const absl::Time end = absl::Now() + limit;
    while (absl::Now() < end) {
      auto listing = client_->List(key);
      if (listing.ok() && (!listing->kvs.empty()) == present) return true;
      absl::SleepFor(absl::Milliseconds(100));
    }
    return false;
  }

  std::unique_ptr<EtcdServer> server_;
  std::unique_ptr<EtcdClient> client_;
};

TEST_F(EtcdClientTest, PutListDeleteUnderAPrefix) {
  ASSERT_TRUE(client_->Put("/p/a", "1").ok());
  ASSERT_TRUE(client_->Put("/p/b", "2").ok());
  ASSERT_TRUE(client_->Put("/q/c", "3").ok());
  auto listing = client_->List("/p/");
  ASSERT_TRUE(listing.ok()) << listing.status();
  ASSERT_EQ(listing->kvs.size(), 2u);
  EXPECT_EQ(listing->kvs[0].key, "/p/a");
  EXPECT_EQ(listing->kvs[0].value, "1");
  EXPECT_EQ(listing->kvs[1].key, "/p/b");
  EXPECT_GT(listing->revision, 0);
  ASSERT_TRUE(client_->Delete("/p/a").ok());
  listing = client_->List("/p/");
  ASSERT_TRUE(listing.ok());
  ASSERT_EQ(listing->kvs.size(), 1u);
  EXPECT_EQ(listing->kvs[0].key, "/p/b");
}

TEST_F(EtcdClientTest, KeysOfARevokedLeaseVanish) {
  auto lease = client_->GrantLease(absl::Seconds(30));
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_TRUE(client_->Put("/l/k", "v", *lease).ok());
  auto left = client_->KeepAlive(*lease);
  ASSERT_TRUE(left.ok()) << left.status();
  EXPECT_GT(*left, absl::Seconds(20));
  ASSERT_TRUE(client_->RevokeLease(*lease).ok());
  EXPECT_TRUE(WaitForKey("/l/k", false, absl::Seconds(1)));
  EXPECT_TRUE(absl::IsNotFound(client_->KeepAlive(*lease).status()));
}

TEST_F(EtcdClientTest, KeysOfAnExpiredLeaseVanishWithinItsTtl) {
  auto lease = client_->GrantLease(absl::Seconds(2));
  ASSERT_TRUE(lease.ok()) << lease.status();
  ASSERT_TRUE(client_->Put("/l/k", "v", *lease).ok());
  const absl::Time put = absl::Now();
  ASSERT_TRUE(WaitForKey("/l/k", false, absl::Seconds(5)));
  EXPECT_LT(absl::Now() - put, absl::Seconds(3.5));
  EXPECT_TRUE(absl::IsNotFound(client_->KeepAlive(*lease).status()));
}

TEST_F(EtcdClientTest, AWatchSeesEveryChangeAfterItsRevisionInOrder) {
  ASSERT_TRUE(client_->Put("/w/a", "before").ok());
  auto listing = client_->List("/w/");
  ASSERT_TRUE(listing.ok());
  // Changes made between the listing and the watch are not lost.
  ASSERT_TRUE(client_->Put("/w/b", "between").ok());
  auto watch = client_->Watch("/w/", listing->revision + 1);
  ASSERT_TRUE(watch.ok()) << watch.status();
  ASSERT_TRUE(client_->Put("/other/x", "not watched").ok());
  ASSERT_TRUE(client_->Delete("/w/a").ok());
  EtcdEvent e;
  ASSERT_TRUE((*watch)->Next(&e));
  EXPECT_EQ(e.type, EtcdEvent::Type::kPut);
  EXPECT_EQ(e.kv.key, "/w/b");
  EXPECT_EQ(e.kv.value, "between");
  ASSERT_TRUE((*watch)->Next(&e));
  EXPECT_EQ(e.type, EtcdEvent::Type::kDelete);
  EXPECT_EQ(e.kv.key, "/w/a");
  (*watch)->Cancel();
  EXPECT_FALSE((*watch)->Next(&e));
  EXPECT_TRUE(absl::IsCancelled((*watch)->status())) << (*watch)->status();
}

TEST_F(EtcdClientTest, AWatchEndsWhenEtcdDies) {
  auto watch = client_->Watch("/w/", 0);
  ASSERT_TRUE(watch.ok()) << watch.status();
  server_->Kill();
  EtcdEvent e;
  EXPECT_FALSE((*watch)->Next(&e));
  EXPECT_TRUE(absl::IsUnavailable((*watch)->status())) << (*watch)->status();
}

TEST_F(EtcdClientTest, AnUnreachableEtcdIsUnavailableWithinTheCallTimeout) {
  server_->Kill();
  auto client = EtcdClient::Create({.endpoints = {server_->endpoint()},
                                    .call_timeout = absl::Seconds(1)});
  ASSERT_TRUE(client.ok());
  const absl::Time start = absl::Now();
  const absl::Status s = (*client)->Put("/k", "v");
  EXPECT_TRUE(absl::IsUnavailable(s) || absl::IsDeadlineExceeded(s)) << s;
  EXPECT_LT(absl::Now() - start, absl::Seconds(3));
}

TEST_F(EtcdClientTest, ADeadEndpointIsSkippedForALiveOne) {
  auto server = EtcdServer::Start();
  ASSERT_TRUE(server.ok());
  const std::string dead = (*server)->endpoint();
  (*server)->Kill();
  auto client = EtcdClient::Create({.endpoints = {dead, server_->endpoint()}});
  ASSERT_TRUE(client.ok());
  ASSERT_TRUE((*client)->Put("/f/k", "v").ok());
  EXPECT_EQ("http://" + (*client)->current_endpoint(), server_->endpoint());
}

TEST(EtcdClientOptionsTest, BadEndpointsAreRefusedSayingWhy) {
  auto none = EtcdClient::Create({});
  EXPECT_TRUE(absl::IsInvalidArgument(none.status()));
  auto tls = EtcdClient::Create({.endpoints = {"https://127.0.0.1:2379"}});
  EXPECT_TRUE(absl::IsInvalidArgument(tls.status()));
  EXPECT_NE(tls.status().message().find("TLS"), std::string::npos) << tls.status();
  for (const char* bad : {"127.0.0.1", "http://:2379", "http://h:", "http://h:1/path"}) {
    auto c = EtcdClient::Create({.endpoints = {bad}});
    EXPECT_TRUE(absl::IsInvalidArgument(c.status())) << bad;
  }
  EXPECT_EQ(EtcdClient::SplitEndpoints("http://a:1, http://b:2,,"),
            (std::vector<std::string>{"http://a:1", "http://b:2"}));
}

TEST_F(EtcdClientTest, ARegistrationStaysWhileAliveAndGoesWhenWithdrawn) {
  auto r = EtcdRegistration::Start(
      {.endpoints = {server_->endpoint()}, .key = "/r/w", .value = "x", .ttl = absl::Seconds(2)});
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(WaitForKey("/r/w", true, absl::Seconds(5)));
  // Kept alive past several TTLs.
  absl::SleepFor(absl::Seconds(5));
  EXPECT_TRUE(WaitForKey("/r/w", true, absl::Milliseconds(1)));
  (*r)->Withdraw();
  EXPECT_TRUE(WaitForKey("/r/w", false, absl::Milliseconds(500)));
}

TEST_F(EtcdClientTest, ARegistrationWhoseLeaseWasLostComesBack) {
  auto r = EtcdRegistration::Start(
      {.endpoints = {server_->endpoint()}, .key = "/r/w", .value = "x", .ttl = absl::Seconds(3)});
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(WaitForKey("/r/w", true, absl::Seconds(5)));
  auto listing = client_->List("/r/w");
  ASSERT_TRUE(listing.ok());
  ASSERT_EQ(listing->kvs.size(), 1u);
  // The lease ends behind the registration's back (as when etcd expired it
  // during an outage): the next keep-alive finds it gone and registers again.
  ASSERT_TRUE(client_->RevokeLease(listing->kvs[0].lease).ok());
  ASSERT_TRUE(WaitForKey("/r/w", true, absl::Seconds(5)));
  listing = client_->List("/r/w");
  ASSERT_TRUE(listing.ok());
  ASSERT_EQ(listing->kvs.size(), 1u);
}

TEST_F(EtcdClientTest, ARegistrationOutlivesAnEtcdOutage) {
  auto r = EtcdRegistration::Start(
      {.endpoints = {server_->endpoint()}, .key = "/r/w", .value = "x", .ttl = absl::Seconds(3)});
  ASSERT_TRUE(r.ok()) << r.status();
  ASSERT_TRUE(WaitForKey("/r/w", true, absl::Seconds(5)));
  server_->Kill();
  absl::SleepFor(absl::Seconds(4));  // Past the TTL.
  ASSERT_TRUE(server_->Resume().ok());
  ASSERT_TRUE(WaitForKey("/r/w", true, absl::Seconds(10)));
}

}  // namespace
}  // namespace pdserve
