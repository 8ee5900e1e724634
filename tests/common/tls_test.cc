// common/tls.h: flag groups, loading and reloading certificate files, and
// gRPC and HTTP servers that refuse what they must (plaintext clients, the
// wrong CA, expired certificates) and pick up reloaded certificates on new
// connections. Certificates come from the real openssl (test_pki.h).
#include "common/tls.h"

#include <cstdio>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_server.h"
#include "common/http_server.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "pdserve/v1/generation.grpc.pb.h"
#include "tests/common/test_pki.h"

namespace pdserve {
namespace {

using ::pdserve::testing_util::TestPki;

// The server end of the gRPC cases: Health answers serving.
class HealthOnly final : public v1::Generation::Service {
  grpc::Status Health(grpc::ServerContext*, const v1::HealthRequest*,
                      v1::HealthResponse* response) override {
    response->set_serving(true);
    return grpc::Status::OK;
  }
};

// Runs `command`; its stdout and stderr together.
std::string Output(const std::string& command) {
  std::string out;
  FILE* pipe = popen(absl::StrCat(command, " 2>&1").c_str(), "r");
  if (pipe == nullptr) return "popen failed";
  char buffer[4096];
  while (size_t n = fread(buffer, 1, sizeof(buffer), pipe)) out.append(buffer, n);
  pclose(pipe);
  return out;
}

// The subject of the certificate a TLS server on `port` presents now.
std::string PresentedSubject(int port) {
  return Output(absl::StrCat("openssl s_client -connect 127.0.0.1:", port,
                             " </dev/null 2>/dev/null | openssl x509 -noout -subject"));
}

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    ASSERT_TRUE(pki_.MakeCa("ca").ok());
    ASSERT_TRUE(pki_.MakeCa("other-ca").ok());
    ASSERT_TRUE(pki_.MakeLeaf("server", "ca", "server-1").ok());
    ASSERT_TRUE(pki_.MakeLeaf("client", "ca", "client-1").ok());
    ASSERT_TRUE(pki_.MakeLeaf("stranger", "other-ca", "stranger").ok());
    ASSERT_TRUE(pki_.MakeLeaf("expired", "ca", "expired", /*days=*/-1).ok());
  }

  TlsFiles Files(const std::string& name, const std::string& ca = "ca") const {
    return TlsFiles{pki_.Cert(name), pki_.Key(name), ca.empty() ? "" : pki_.Cert(ca)};
  }

  TestPki pki_;
};

TEST_F(TlsTest, FlagGroupsMustBeWhole) {
  auto none = TlsFilesFromFlags("mtls", "", "", "", true);
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->has_value());

  auto no_key = TlsFilesFromFlags("mtls", "a.crt", "", "ca.crt", true);
  EXPECT_EQ(no_key.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(no_key.status().message(), "--mtls_key_file is required with --mtls_cert_file");

  auto no_cert = TlsFilesFromFlags("mtls", "", "a.key", "ca.crt", true);
  EXPECT_EQ(no_cert.status().message(), "--mtls_cert_file is required with --mtls_key_file");

  auto only_ca = TlsFilesFromFlags("tls", "", "", "ca.crt", false);
  EXPECT_EQ(only_ca.status().message(), "--tls_cert_file is required with --tls_ca_file");

  auto no_ca = TlsFilesFromFlags("mtls", "a.crt", "a.key", "", true);
  EXPECT_EQ(no_ca.status().message(), "--mtls_ca_file is required with --mtls_cert_file");

  auto public_tls = TlsFilesFromFlags("tls", "a.crt", "a.key", "", false);
  ASSERT_TRUE(public_tls.ok() && public_tls->has_value());
  EXPECT_EQ((*public_tls)->cert_file, "a.crt");
}

TEST_F(TlsTest, LoadNamesTheFileThatFails) {
  TlsFiles missing_key = Files("server");
  missing_key.key_file = pki_.Path("nope.key");
  auto loaded = TlsCertificates::Load(missing_key);
  EXPECT_EQ(loaded.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(loaded.status().message(), missing_key.key_file))
      << loaded.status();
  EXPECT_TRUE(absl::StrContains(loaded.status().message(), "No such file")) << loaded.status();

  pki_.Write("garbage.crt", "-----BEGIN CERTIFICATE-----\nnot base64 at all\n"
                            "-----END CERTIFICATE-----\n");
  TlsFiles garbage = Files("server");
  garbage.cert_file = pki_.Path("garbage.crt");
  loaded = TlsCertificates::Load(garbage);
  EXPECT_EQ(loaded.status().message(),
            absl::StrCat(garbage.cert_file, " holds no PEM certificate"));

  TlsFiles garbage_ca = Files("server");
  garbage_ca.ca_file = pki_.Path("garbage.crt");
  loaded = TlsCertificates::Load(garbage_ca);
  EXPECT_EQ(loaded.status().message(),
            absl::StrCat(garbage_ca.ca_file, " holds no PEM certificate"));

  pki_.Write("garbage.key", "this is no key\n");
  TlsFiles garbage_key = Files("server");
  garbage_key.key_file = pki_.Path("garbage.key");
  loaded = TlsCertificates::Load(garbage_key);
  EXPECT_TRUE(absl::StrContains(loaded.status().message(),
                                absl::StrCat(garbage_key.key_file, " holds no PEM private key")))
      << loaded.status();

  TlsFiles mismatched = Files("server");
  mismatched.key_file = pki_.Key("client");
  loaded = TlsCertificates::Load(mismatched);
  EXPECT_EQ(loaded.status().message(),
            absl::StrCat("the key in ", mismatched.key_file,
                         " does not match the certificate in ", mismatched.cert_file));
}

TEST_F(TlsTest, ReloadKeepsTheOldCertificatesWhenTheNewFilesAreBad) {
  auto tls = TlsCertificates::Load(Files("server"));
  ASSERT_TRUE(tls.ok()) << tls.status();
  const std::string old_chain = (*tls)->pem().chain;

  // A new certificate whose key has not arrived yet: refused, old kept.
  ASSERT_TRUE(pki_.MakeLeaf("next", "ca", "server-2").ok());
  std::filesystem::copy_file(pki_.Cert("next"), pki_.Cert("server"),
                             std::filesystem::copy_options::overwrite_existing);
  absl::Status reloaded = (*tls)->Reload();
  EXPECT_TRUE(absl::StrContains(reloaded.message(), "does not match")) << reloaded;
  EXPECT_EQ((*tls)->pem().chain, old_chain);
  EXPECT_EQ((*tls)->generation(), 0u);

  std::filesystem::copy_file(pki_.Key("next"), pki_.Key("server"),
                             std::filesystem::copy_options::overwrite_existing);
  ASSERT_TRUE((*tls)->Reload().ok());
  EXPECT_EQ((*tls)->pem().chain, TestPki::Read(pki_.Cert("next")));
  EXPECT_EQ((*tls)->generation(), 1u);
}

// A gRPC server of the internal kind: mTLS, clients need a certificate
// signed by "ca".
class MutualTlsGrpcTest : public TlsTest {
 protected:
  void SetUp() override {
    TlsTest::SetUp();
    auto tls = TlsCertificates::Load(Files("server"));
    ASSERT_TRUE(tls.ok()) << tls.status();
    server_tls_ = *std::move(tls);
    auto started = StartGrpcServer("127.0.0.1:0", {&service_},
                                   server_tls_->ServerCredentials(ClientCertificates::kRequire));
    ASSERT_TRUE(started.ok()) << started.status();
    server_ = std::move(started->server);
    port_ = started->port;
  }
  void TearDown() override {
    if (server_) server_->Shutdown(std::chrono::system_clock::now());
  }

  // Health over a new channel with `credentials`; on success the common
  // name the server presented lands in *server_cn.
  grpc::Status Health(const std::shared_ptr<grpc::ChannelCredentials>& credentials,
                      std::string* server_cn = nullptr) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // A new connection each time.
    auto stub = v1::Generation::NewStub(
        grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port_), credentials, args));
    return HealthOn(*stub, server_cn);
  }
  static grpc::Status HealthOn(v1::Generation::Stub& stub, std::string* server_cn) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    v1::HealthResponse response;
    grpc::Status status = stub.Health(&context, {}, &response);
    if (status.ok() && server_cn != nullptr) {
      auto names = context.auth_context()->FindPropertyValues("x509_common_name");
      *server_cn = names.empty() ? "" : std::string(names.front().data(), names.front().size());
    }
    return status;
  }

  std::shared_ptr<grpc::ChannelCredentials> Client(const std::string& name,
                                                   const std::string& ca = "ca") {
    auto tls = TlsCertificates::Load(Files(name, ca));
    EXPECT_TRUE(tls.ok()) << tls.status();
    auto credentials = (*tls)->ChannelCredentials();
    clients_.push_back(*std::move(tls));
    return credentials;
  }

  HealthOnly service_;
  std::unique_ptr<TlsCertificates> server_tls_;
  std::unique_ptr<grpc::Server> server_;
  int port_ = 0;
  std::vector<std::unique_ptr<TlsCertificates>> clients_;
};

TEST_F(MutualTlsGrpcTest, ClientWithACertificateOfTheCaIsServed) {
  std::string server_cn;
  grpc::Status status = Health(Client("client"), &server_cn);
  ASSERT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(server_cn, "server-1");
}

TEST_F(MutualTlsGrpcTest, PlaintextClientIsRefused) {
  grpc::Status status = Health(grpc::InsecureChannelCredentials());
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  EXPECT_FALSE(status.error_message().empty());
  std::cerr << "plaintext client sees: " << status.error_message() << "\n";
}

TEST_F(MutualTlsGrpcTest, ClientTrustingAnotherCaRefusesTheServer) {
  grpc::Status status = Health(Client("stranger", "other-ca"));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(absl::StrContains(status.error_message(), "andshake")) << status.error_message();
  std::cerr << "wrong-CA client sees: " << status.error_message() << "\n";
}

TEST_F(MutualTlsGrpcTest, ClientCertificateOfAnotherCaIsRefused) {
  // The client trusts the server's CA, but presents a stranger's certificate.
  auto tls = TlsCertificates::Load(
      TlsFiles{pki_.Cert("stranger"), pki_.Key("stranger"), pki_.Cert("ca")});
  ASSERT_TRUE(tls.ok()) << tls.status();
  grpc::Status status = Health((*tls)->ChannelCredentials());
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  std::cerr << "client of another CA sees: " << status.error_message() << "\n";
}

TEST_F(MutualTlsGrpcTest, ExpiredClientCertificateIsRefused) {
  grpc::Status status = Health(Client("expired"));
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  std::cerr << "expired client sees: " << status.error_message() << "\n";
}

TEST_F(MutualTlsGrpcTest, ReloadServesTheNewCertificateOnNewConnections) {
  auto credentials = Client("client");
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
  auto old_stub = v1::Generation::NewStub(
      grpc::CreateCustomChannel(absl::StrCat("127.0.0.1:", port_), credentials, args));
  std::string cn;
  ASSERT_TRUE(HealthOn(*old_stub, &cn).ok());
  ASSERT_EQ(cn, "server-1");

  ASSERT_TRUE(pki_.MakeLeaf("server", "ca", "server-2").ok());  // Overwrites both files.
  ASSERT_TRUE(server_tls_->Reload().ok());
  // Within kRefreshInterval; allow a loaded machine far more.
  const absl::Time deadline = absl::Now() + absl::Seconds(30);
  std::string seen;
  while (absl::Now() < deadline) {
    ASSERT_TRUE(Health(credentials, &seen).ok());
    if (seen == "server-2") break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_EQ(seen, "server-2");
  // The connection made before the reload goes on with the old certificate.
  ASSERT_TRUE(HealthOn(*old_stub, &cn).ok());
  EXPECT_EQ(cn, "server-1");
}

class HttpsTest : public TlsTest {
 protected:
  void Start(const std::string& client_ca) {
    auto tls = TlsCertificates::Load(Files("server", client_ca));
    ASSERT_TRUE(tls.ok()) << tls.status();
    tls_ = *std::move(tls);
    HttpServer::Options options;
    options.threads = 1;
    options.tls = tls_.get();
    auto server = HttpServer::Start(options, [](HttpRequest request,
                                                std::shared_ptr<HttpExchange> exchange) {
      exchange->Respond(200, "text/plain", absl::StrCat("hello ", request.path));
    });
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }
  std::string Url(const std::string& scheme) const {
    return absl::StrCat(scheme, "://127.0.0.1:", server_->port(), "/x");
  }

  std::unique_ptr<TlsCertificates> tls_;
  std::unique_ptr<HttpServer> server_;
};

TEST_F(HttpsTest, TlsClientIsServedAndPlaintextIsToldToUseHttps) {
  Start("");
  EXPECT_EQ(Output(absl::StrCat("curl -sS --max-time 20 --cacert '", pki_.Cert("ca"), "' ",
                                Url("https"))),
            "hello /x");
  const std::string plaintext =
      Output(absl::StrCat("curl -sS --max-time 20 -i ", Url("http")));
  EXPECT_TRUE(absl::StartsWith(plaintext, "HTTP/1.1 400")) << plaintext;
  EXPECT_TRUE(absl::StrContains(plaintext, "this port speaks HTTPS")) << plaintext;
  const std::string wrong_ca = Output(absl::StrCat(
      "curl -sS --max-time 20 --cacert '", pki_.Cert("other-ca"), "' ", Url("https")));
  EXPECT_TRUE(absl::StrContains(wrong_ca, "certificate")) << wrong_ca;
  EXPECT_FALSE(absl::StrContains(wrong_ca, "hello")) << wrong_ca;
}

TEST_F(HttpsTest, ClientCaRequiresAClientCertificate) {
  Start("ca");
  const std::string curl =
      absl::StrCat("curl -sS --max-time 20 --cacert '", pki_.Cert("ca"), "' ");
  EXPECT_EQ(Output(absl::StrCat(curl, "--cert '", pki_.Cert("client"), "' --key '",
                                pki_.Key("client"), "' ", Url("https"))),
            "hello /x");
  const std::string anonymous = Output(absl::StrCat(curl, Url("https")));
  EXPECT_FALSE(absl::StrContains(anonymous, "hello")) << anonymous;
  const std::string expired = Output(absl::StrCat(
      curl, "--cert '", pki_.Cert("expired"), "' --key '", pki_.Key("expired"), "' ",
      Url("https")));
  EXPECT_FALSE(absl::StrContains(expired, "hello")) << expired;
}

TEST_F(HttpsTest, NewConnectionsGetTheReloadedCertificate) {
  Start("");
  EXPECT_TRUE(absl::StrContains(PresentedSubject(server_->port()), "CN = server-1"));
  ASSERT_TRUE(pki_.MakeLeaf("server", "ca", "server-2").ok());
  ASSERT_TRUE(tls_->Reload().ok());
  EXPECT_TRUE(absl::StrContains(PresentedSubject(server_->port()), "CN = server-2"));
}

}  // namespace
}  // namespace pdserve
