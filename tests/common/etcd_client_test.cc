// EtcdClient and EtcdRegistration against a real etcd (tests/common/etcd_server.h).
#include "common/etcd_client.h"

#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/time/clock.h"
#include "common/etcd_registration.h"
#include "common/tls.h"
#include "tests/common/etcd_server.h"
#include "tests/common/test_pki.h"

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

// etcd over TLS with client certificates (its --client-cert-auth): the
// cluster's certificate is let in; another CA's, an expired one and a
// plaintext client are refused; a scheme that does not match the TLS
// setting is refused before any connection.
class EtcdTlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (std::system("command -v etcd >/dev/null 2>&1") != 0) {
      GTEST_SKIP() << "etcd is not installed (Debian package etcd-server; deploy/install-deps.sh)";
    }
    ASSERT_TRUE(pki_.MakeCa("ca").ok());
    ASSERT_TRUE(pki_.MakeLeaf("etcd", "ca", "etcd").ok());
    ASSERT_TRUE(pki_.MakeLeaf("worker", "ca", "worker").ok());
    auto server = EtcdServer::Start(testing_util::EtcdTlsFiles{
        .cert_file = pki_.Cert("etcd"), .key_file = pki_.Key("etcd"), .ca_file = pki_.Cert("ca")});
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }

  // A client presenting certificate `name`, trusting CA `ca`.
  std::unique_ptr<EtcdClient> Client(const std::string& name, const std::string& ca = "ca") {
    auto tls = TlsCertificates::Load(
        {.cert_file = pki_.Cert(name), .key_file = pki_.Key(name), .ca_file = pki_.Cert(ca)});
    EXPECT_TRUE(tls.ok()) << tls.status();
    if (!tls.ok()) return nullptr;
    certificates_.push_back(*std::move(tls));
    auto client = EtcdClient::Create(
        {.endpoints = {server_->endpoint()}, .tls = certificates_.back()->ChannelCredentials()});
    EXPECT_TRUE(client.ok()) << client.status();
    return client.ok() ? *std::move(client) : nullptr;
  }

  testing_util::TestPki pki_;
  std::unique_ptr<EtcdServer> server_;
  std::vector<std::unique_ptr<TlsCertificates>> certificates_;
};

TEST_F(EtcdTlsTest, TheClustersCertificateIsLetInAndARegistrationWorks) {
  std::unique_ptr<EtcdClient> client = Client("worker");
  ASSERT_NE(client, nullptr);
  ASSERT_TRUE(client->Put("/t/a", "1").ok());
  auto listing = client->List("/t/");
  ASSERT_TRUE(listing.ok()) << listing.status();
  ASSERT_EQ(listing->kvs.size(), 1u);
  EXPECT_EQ(listing->kvs[0].value, "1");

  auto registration = EtcdRegistration::Start({.endpoints = {server_->endpoint()},
                                               .tls = certificates_.back()->ChannelCredentials(),
                                               .key = "/t/w",
                                               .value = "x",
                                               .ttl = absl::Seconds(2)});
  ASSERT_TRUE(registration.ok()) << registration.status();
  bool present = false;
  for (int i = 0; i < 100 && !present; ++i) {
    auto l = client->List("/t/w");
    present = l.ok() && !l->kvs.empty();
    if (!present) absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_TRUE(present);
}

TEST_F(EtcdTlsTest, AnotherCasCertificateAnExpiredOneAndPlaintextAreRefused) {
  ASSERT_TRUE(pki_.MakeCa("other-ca").ok());
  ASSERT_TRUE(pki_.MakeLeaf("stranger", "other-ca", "stranger").ok());
  ASSERT_TRUE(pki_.MakeLeaf("expired", "ca", "expired", /*days=*/-1).ok());
  for (const char* name : {"stranger", "expired"}) {
    std::unique_ptr<EtcdClient> client = Client(name);
    ASSERT_NE(client, nullptr);
    const absl::Status put = client->Put("/t/x", "1");
    EXPECT_TRUE(absl::IsUnavailable(put)) << name << ": " << put;
  }
  // Trusting another CA, the client refuses etcd's certificate.
  std::unique_ptr<EtcdClient> doubter = Client("stranger", "other-ca");
  ASSERT_NE(doubter, nullptr);
  const absl::Status doubted = doubter->Put("/t/x", "1");
  EXPECT_TRUE(absl::IsUnavailable(doubted)) << doubted;
  // A plaintext client (a bare host:port without TLS) gets no answer.
  std::string bare = server_->endpoint();
  bare.erase(0, bare.find("://") + 3);
  auto plain = EtcdClient::Create({.endpoints = {bare}});
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_TRUE(absl::IsUnavailable((*plain)->Put("/t/x", "1")));
  // Nothing got in.
  std::unique_ptr<EtcdClient> client = Client("worker");
  ASSERT_NE(client, nullptr);
  auto listing = client->List("/t/x");
  ASSERT_TRUE(listing.ok()) << listing.status();
  EXPECT_TRUE(listing->kvs.empty());
}

TEST_F(EtcdTlsTest, ASchemeThatDoesNotMatchTheTlsSettingIsRefusedAtOnce) {
  auto https_without_tls = EtcdClient::Create({.endpoints = {server_->endpoint()}});
  ASSERT_TRUE(absl::IsInvalidArgument(https_without_tls.status()));
  EXPECT_NE(https_without_tls.status().message().find("--etcd_cert_file"), std::string::npos)
      << https_without_tls.status();
  auto tls = TlsCertificates::Load(
      {.cert_file = pki_.Cert("worker"), .key_file = pki_.Key("worker"), .ca_file = pki_.Cert("ca")});
  ASSERT_TRUE(tls.ok()) << tls.status();
  auto http_with_tls =
      EtcdClient::Create({.endpoints = {"http://127.0.0.1:2379"}, .tls = (*tls)->ChannelCredentials()});
  ASSERT_TRUE(absl::IsInvalidArgument(http_with_tls.status()));
  EXPECT_NE(http_with_tls.status().message().find("use https://"), std::string::npos)
      << http_with_tls.status();
}

}  // namespace
}  // namespace pdserve
