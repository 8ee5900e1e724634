// TLS and mTLS in real pdserve processes (issue 17): a cluster started with
// cluster.sh --tls streams what a plaintext one does and refuses plaintext
// clients on gRPC and HTTP; the router does not use a worker whose
// certificate another CA signed, or has expired; SIGHUP swaps the router's
// certificate for new connections while old streams go on; bad flags and
// files stop a process at startup with a message naming them.
// Certificates are made by the real openssl (tests/common/test_pki.h).
#include <signal.h>
#include <sys/wait.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "gtest/gtest.h"
#include "pdserve/v1/generation.grpc.pb.h"
#include "tests/cluster/local_cluster.h"
#include "tests/common/test_pki.h"

namespace pdserve {
namespace {

using ::pdserve::testing_util::ClusterSpec;
using ::pdserve::testing_util::LocalCluster;
using ::pdserve::testing_util::TestPki;

const std::string kBin = PDSERVE_BINARY_DIR;

struct Output {
  int exit_code = -1;
  std::string text;  // stdout and stderr together.
};

Output RunCommand(const std::string& command) {
  Output out;
  FILE* pipe = popen(absl::StrCat("timeout 120 ", command, " 2>&1").c_str(), "r");
  if (pipe == nullptr) return out;
  char buffer[4096];
  while (size_t n = fread(buffer, 1, sizeof(buffer), pipe)) out.text.append(buffer, n);
  const int status = pclose(pipe);
  out.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return out;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

struct Generated {
  grpc::Status status;
  std::vector<int32_t> tokens;
};

v1::GenerateRequest Request(int max_tokens) {
  v1::GenerateRequest request;
  request.set_text("Once upon a time");
  request.set_max_tokens(max_tokens);
  request.set_ignore_eos(true);
  request.mutable_sampling()->set_temperature(0);
  return request;
}

Generated Generate(v1::Generation::Stub& stub, const v1::GenerateRequest& request) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(60)));
  Generated out;
  auto reader = stub.Generate(&context, request);
  v1::GenerateResponse response;
  while (reader->Read(&response)) {
    out.tokens.insert(out.tokens.end(), response.token_ids().begin(),
                      response.token_ids().end());
  }
  out.status = reader->Finish();
  return out;
}

std::shared_ptr<grpc::ChannelCredentials> TlsClient(const std::string& ca_file) {
  grpc::SslCredentialsOptions ssl;
  ssl.pem_root_certs = ReadFile(ca_file);
  return grpc::SslCredentials(ssl);
}

std::unique_ptr<v1::Generation::Stub> Stub(const std::string& address,
                                           std::shared_ptr<grpc::ChannelCredentials> credentials) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);  // A connection of its own.
  return v1::Generation::NewStub(grpc::CreateCustomChannel(address, credentials, args));
}

// The subject of the certificate the TLS server at 127.0.0.1:`port`
// presents to a new connection.
std::string PresentedSubject(int port) {
  return RunCommand(absl::StrCat("sh -c 'openssl s_client -connect 127.0.0.1:", port,
                          " </dev/null 2>/dev/null | openssl x509 -noout -subject'"))
      .text;
}

// Processes started one by one (for what cluster.sh cannot do: workers
// with different certificates), stopped with SIGTERM (then SIGKILL) at the
// end.
class Processes {
 public:
  explicit Processes(std::filesystem::path dir) : dir_(std::move(dir)) {}
  ~Processes() {
    for (pid_t pid : pids_) ::kill(pid, SIGTERM);
    for (pid_t pid : pids_) {
      for (int i = 0; i < 100 && LocalCluster::ProcessRunning(pid); ++i) {
        absl::SleepFor(absl::Milliseconds(100));
      }
      if (LocalCluster::ProcessRunning(pid)) ::kill(pid, SIGKILL);
    }
  }

  // Runs `command` as `name` (log: dir/name.log) and returns the port it
  // announces in its --port_file; FAILED_PRECONDITION with its log if it
  // exits first, DEADLINE_EXCEEDED after 60 s.
  absl::StatusOr<int> Start(const std::string& name, const std::string& command) {
    const std::string port_file = Path(name + ".port");
    const std::string pid_file = Path(name + ".pid");
    const std::string start = absl::StrCat(command, " --port_file='", port_file, "' >'",
                                           Log(name), "' 2>&1 & echo $! >'", pid_file, "'");
    if (std::system(start.c_str()) != 0) return absl::InternalError(start);
    const pid_t pid = std::stoi(ReadFile(pid_file));
    pids_.push_back(pid);
    for (int i = 0; i < 600; ++i) {
      const std::string port = ReadFile(port_file);
      if (!port.empty()) return std::stoi(port);
      if (!LocalCluster::ProcessRunning(pid)) {
        return absl::FailedPreconditionError(
            absl::StrCat(name, " exited: ", ReadFile(Log(name))));
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
    return absl::DeadlineExceededError(absl::StrCat(name, " did not start"));
  }
  pid_t pid(size_t i) const { return pids_.at(i); }
  std::string Log(const std::string& name) const { return Path(name + ".log"); }
  std::string Path(const std::string& file) const { return (dir_ / file).string(); }

 private:
  const std::filesystem::path dir_;
  std::vector<pid_t> pids_;
};

// Health until `done` holds of it or 60 s pass; the last answer.
v1::HealthResponse WaitForHealth(v1::Generation::Stub& stub,
                                 const std::function<bool(const v1::HealthResponse&)>& done) {
  v1::HealthResponse health;
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline) {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(5)));
    health.Clear();
    if (stub.Health(&context, {}, &health).ok() && done(health)) break;
    absl::SleepFor(absl::Milliseconds(100));
  }
  return health;
}

TEST(TlsClusterTest, TlsClusterStreamsWhatAPlaintextOneDoesAndRefusesPlaintext) {
  std::vector<int32_t> plaintext_tokens;
  {
    auto plaintext = LocalCluster::Start(ClusterSpec{});
    ASSERT_TRUE(plaintext.ok()) << plaintext.status();
    Generated g = Generate((*plaintext)->router(), Request(24));
    ASSERT_TRUE(g.status.ok()) << g.status.error_message();
    plaintext_tokens = g.tokens;
  }
  ASSERT_EQ(plaintext_tokens.size(), 24u);

  TestPki pki;  // Empty: cluster.sh makes the CA and node certificate in it.
  ClusterSpec spec;
  spec.tls_dir = pki.Path("cluster");
  auto cluster = LocalCluster::Start(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::string ca = spec.tls_dir + "/ca.crt";

  // A TLS client that trusts the cluster's CA (no client certificate: the
  // public side asks none) gets the same tokens.
  auto tls_stub = Stub((*cluster)->Address("router"), TlsClient(ca));
  Generated g = Generate(*tls_stub, Request(24));
  ASSERT_TRUE(g.status.ok()) << g.status.error_message();
  EXPECT_EQ(g.tokens, plaintext_tokens);

  // A plaintext client is refused, not left hanging.
  auto plain_stub = Stub((*cluster)->Address("router"), grpc::InsecureChannelCredentials());
  g = Generate(*plain_stub, Request(4));
  EXPECT_EQ(g.status.error_code(), grpc::StatusCode::UNAVAILABLE) << g.status.error_message();
  EXPECT_TRUE(g.tokens.empty());

  // A TLS client trusting another CA refuses the router.
  ASSERT_TRUE(pki.MakeCa("other-ca").ok());
  auto stranger = Stub((*cluster)->Address("router"), TlsClient(pki.Cert("other-ca")));
  g = Generate(*stranger, Request(4));
  EXPECT_EQ(g.status.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_TRUE(absl::StrContains(g.status.error_message(), "certificate verify failed"))
      << g.status.error_message();

  // Workers refuse a client without the cluster's certificate: their
  // internal API is not open to whoever reaches the port.
  {
    auto decode = internal::v1::DecodeWorker::NewStub(
        grpc::CreateChannel((*cluster)->Address("decode-0"), TlsClient(ca)));
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(20)));
    internal::v1::LoadReport load;
    grpc::Status status = decode->GetLoad(&context, {}, &load);
    EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  }

  // The OpenAI API over HTTPS; plaintext HTTP is told to use HTTPS.
  const std::string url =
      absl::StrCat("127.0.0.1:", (*cluster)->MetricsPort("router"), "/v1/completions");
  // ignore_eos: the random model may sample its EOS within 5 tokens.
  const std::string body =
      R"('{"model": "builtin:tiny", "prompt": "Once upon a time", "max_tokens": 5, "ignore_eos": true}')";
  Output https = RunCommand(absl::StrCat("curl -sS --max-time 60 --cacert '", ca, "' https://", url,
                                  " -H 'content-type: application/json' -d ", body));
  EXPECT_EQ(https.exit_code, 0) << https.text;
  EXPECT_TRUE(absl::StrContains(https.text, R"("completion_tokens":5)")) << https.text;
  Output http = RunCommand(absl::StrCat("curl -sS --max-time 60 -i http://", url,
                                 " -H 'content-type: application/json' -d ", body));
  EXPECT_TRUE(absl::StartsWith(http.text, "HTTP/1.1 400")) << http.text;
  EXPECT_TRUE(absl::StrContains(http.text, "this port speaks HTTPS")) << http.text;
}

// mTLS flags of a process presenting `name` and trusting `ca`.
std::string Mtls(const TestPki& pki, const std::string& name, const std::string& ca) {
  return absl::StrCat(" --mtls_cert_file='", pki.Cert(name), "' --mtls_key_file='",
                      pki.Key(name), "' --mtls_ca_file='", pki.Cert(ca), "'");
}

std::string Decode(const std::string& id) {
  return absl::StrCat(kBin, "/decode_worker/pd-decode --listen=127.0.0.1:0 --worker_id=", id,
                      " --model=builtin:tiny --num_threads=1 --kv_cache_mb=16");
}

// cluster.sh --etcd --tls: etcd serves https:// only and requires the
// cluster's client certificate; the workers register and the router
// discovers them over TLS, and the cluster serves. A plaintext etcdctl
// gets nothing.
TEST(TlsClusterTest, DiscoveryThroughEtcdOverTls) {
  if (std::system("command -v etcd >/dev/null 2>&1") != 0) {
    GTEST_SKIP() << "etcd is not installed (Debian package etcd-server; deploy/install-deps.sh)";
  }
  TestPki pki;
  ClusterSpec spec;
  spec.etcd = true;
  spec.tls_dir = pki.Path("cluster");
  auto cluster = LocalCluster::Start(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const std::string ca = spec.tls_dir + "/ca.crt";
  auto stub = Stub((*cluster)->Address("router"), TlsClient(ca));
  const v1::HealthResponse health = WaitForHealth(*stub, [](const v1::HealthResponse& h) {
    return h.discovery().connected() && h.decode_workers() == 1 && h.prefill_workers() == 1;
  });
  EXPECT_EQ(health.discovery().source(), "etcd");
  EXPECT_TRUE(health.discovery().connected()) << health.DebugString();
  Generated g = Generate(*stub, Request(8));
  ASSERT_TRUE(g.status.ok()) << g.status.error_message();
  EXPECT_EQ(g.tokens.size(), 8u);

  const std::string etcd =
      absl::StrCat("127.0.0.1:", ReadFile((*cluster)->dir() + "/etcd.port"));
  Output plain = RunCommand(absl::StrCat("env ETCDCTL_API=3 etcdctl --dial-timeout=2s --endpoints=http://",
                                         etcd, " get --prefix /pdserve/ 2>&1"));
  EXPECT_NE(plain.exit_code, 0) << plain.text;
  Output with_cert = RunCommand(absl::StrCat(
      "env ETCDCTL_API=3 etcdctl --endpoints=https://", etcd, " --cacert=", ca,
      " --cert=", spec.tls_dir, "/node.crt --key=", spec.tls_dir,
      "/node.key get --prefix --keys-only /pdserve/ 2>&1"));
  EXPECT_EQ(with_cert.exit_code, 0) << with_cert.text;
  EXPECT_TRUE(absl::StrContains(with_cert.text, "/pdserve/workers/decode-0")) << with_cert.text;
}

TEST(TlsClusterTest, RouterDoesNotUseWorkersWithAnotherCaOrAnExpiredCertificate) {
  TestPki pki;
  ASSERT_TRUE(pki.MakeCa("ca").ok());
  ASSERT_TRUE(pki.MakeCa("other-ca").ok());
  ASSERT_TRUE(pki.MakeLeaf("node", "ca", "node").ok());
  ASSERT_TRUE(pki.MakeLeaf("stranger", "other-ca", "stranger").ok());
  ASSERT_TRUE(pki.MakeLeaf("expired", "ca", "expired", /*days=*/-1).ok());
  Processes processes(pki.dir());
  absl::StatusOr<int> good = processes.Start("decode-0", Decode("decode-0") + Mtls(pki, "node", "ca"));
  ASSERT_TRUE(good.ok()) << good.status();
  absl::StatusOr<int> stranger =
      processes.Start("decode-1", Decode("decode-1") + Mtls(pki, "stranger", "other-ca"));
  ASSERT_TRUE(stranger.ok()) << stranger.status();
  absl::StatusOr<int> expired =
      processes.Start("decode-2", Decode("decode-2") + Mtls(pki, "expired", "ca"));
  ASSERT_TRUE(expired.ok()) << expired.status();

  const auto config = [&](const std::string& file, const std::vector<std::pair<std::string, int>>& workers) {
    std::string list;
    for (const auto& [id, port] : workers) {
      absl::StrAppend(&list, list.empty() ? "" : ", ", R"({"id": ")", id,
                      R"(", "address": "127.0.0.1:)", port, R"("})");
    }
    pki.Write(file, absl::StrCat(R"({"model": "builtin:tiny", "prefill_workers": [], )",
                                 R"("decode_workers": [)", list, "]}"));
    return pki.Path(file);
  };
  const std::string router_command = absl::StrCat(
      kBin, "/router/pd-router --listen=127.0.0.1:0 --http_listen= --poll_interval_ms=50",
      Mtls(pki, "node", "ca"));
  absl::StatusOr<int> router = processes.Start(
      "router", absl::StrCat(router_command, " --config='",
                             config("all.json", {{"decode-0", *good},
                                                 {"decode-1", *stranger},
                                                 {"decode-2", *expired}}),
                             "'"));
  ASSERT_TRUE(router.ok()) << router.status();
  auto stub = Stub(absl::StrCat("127.0.0.1:", *router), grpc::InsecureChannelCredentials());
  v1::HealthResponse health =
      WaitForHealth(*stub, [](const v1::HealthResponse& h) { return h.decode_workers() >= 1; });
  ASSERT_EQ(health.decode_workers(), 1u) << health.ShortDebugString();
  // Every request goes to the one worker the router can verify.
  for (int i = 0; i < 6; ++i) {
    Generated g = Generate(*stub, Request(4));
    EXPECT_TRUE(g.status.ok()) << g.status.error_message();
    EXPECT_EQ(g.tokens.size(), 4u);
  }
  health = WaitForHealth(*stub, [](const v1::HealthResponse&) { return true; });
  EXPECT_EQ(health.decode_workers(), 1u) << health.ShortDebugString();
  // The router says why, naming each worker.
  const std::string log = ReadFile(processes.Log("router"));
  for (const std::string id : {"decode-1", "decode-2"}) {
    const size_t at = log.find(absl::StrCat("decode worker ", id, " at "));
    ASSERT_NE(at, std::string::npos) << log;
    const std::string line = log.substr(at, log.find('\n', at) - at);
    EXPECT_TRUE(absl::StrContains(line, "certificate verify failed")) << line;
  }

  // With no worker it can verify, a request fails at once, not at its
  // deadline.
  absl::StatusOr<int> lonely = processes.Start(
      "router-2", absl::StrCat(router_command, " --config='",
                               config("stranger.json", {{"decode-1", *stranger}}), "'"));
  ASSERT_TRUE(lonely.ok()) << lonely.status();
  auto lonely_stub = Stub(absl::StrCat("127.0.0.1:", *lonely), grpc::InsecureChannelCredentials());
  const absl::Time start = absl::Now();
  Generated g = Generate(*lonely_stub, Request(4));
  EXPECT_EQ(g.status.error_code(), grpc::StatusCode::UNAVAILABLE) << g.status.error_message();
  EXPECT_LT(absl::Now() - start, absl::Seconds(30));
}

TEST(TlsClusterTest, SighupServesTheNewCertificateAndOldStreamsGoOn) {
  TestPki pki;
  ASSERT_TRUE(pki.MakeCa("ca").ok());
  ASSERT_TRUE(pki.MakeLeaf("node", "ca", "node-1").ok());
  ClusterSpec spec;
  spec.tls_dir = pki.dir().string();  // Has ca.crt: cluster.sh uses node.crt as it is.
  auto cluster = LocalCluster::Start(spec);
  ASSERT_TRUE(cluster.ok()) << cluster.status();
  const int port = std::stoi((*cluster)->Address("router").substr(10));
  ASSERT_TRUE(absl::StrContains(PresentedSubject(port), "CN = node-1"));

  // A long stream, begun before the reload.
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(120)));
  v1::GenerateRequest long_request = Request(400);
  auto reader = (*cluster)->router().Generate(&context, long_request);
  v1::GenerateResponse response;
  ASSERT_TRUE(reader->Read(&response));
  size_t tokens = response.token_ids_size();

  // New files (every process reads them; only the router is told).
  ASSERT_TRUE(pki.MakeLeaf("node", "ca", "node-2").ok());
  ASSERT_EQ(::kill((*cluster)->Pid("router"), SIGHUP), 0);
  std::string subject;
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < deadline) {
    subject = PresentedSubject(port);
    if (absl::StrContains(subject, "CN = node-2")) break;
    absl::SleepFor(absl::Milliseconds(200));
  }
  EXPECT_TRUE(absl::StrContains(subject, "CN = node-2")) << subject;
  EXPECT_TRUE(absl::StrContains((*cluster)->Log("router"), "SIGHUP: reloaded"));

  while (reader->Read(&response)) tokens += response.token_ids_size();
  grpc::Status status = reader->Finish();
  EXPECT_TRUE(status.ok()) << status.error_message();
  EXPECT_EQ(tokens, 400u);
  // ... on the connection it began on, made with the old certificate.
  const auto names = context.auth_context()->FindPropertyValues("x509_common_name");
  ASSERT_EQ(names.size(), 1u);
  EXPECT_EQ(std::string(names.front().data(), names.front().size()), "node-1");

  // Bad files on the next SIGHUP: logged, and the router keeps serving
  // with node-2 (new connections included).
  pki.Write("node.key", "not a key\n");
  ASSERT_EQ(::kill((*cluster)->Pid("router"), SIGHUP), 0);
  const absl::Time log_deadline = absl::Now() + absl::Seconds(60);
  while (absl::Now() < log_deadline &&
         !absl::StrContains((*cluster)->Log("router"), "still serving with the certificates")) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  EXPECT_TRUE(absl::StrContains((*cluster)->Log("router"),
                                absl::StrCat(pki.Key("node"), " holds no PEM private key")))
      << (*cluster)->Log("router");
  EXPECT_TRUE(absl::StrContains(PresentedSubject(port), "CN = node-2"));
  auto fresh = Stub((*cluster)->Address("router"), TlsClient(pki.Cert("ca")));
  Generated g = Generate(*fresh, Request(4));
  EXPECT_TRUE(g.status.ok()) << g.status.error_message();
}

TEST(TlsClusterTest, RouterWithAClientCaServesOnlyClientsWithItsCertificates) {
  TestPki pki;
  ASSERT_TRUE(pki.MakeCa("ca").ok());
  ASSERT_TRUE(pki.MakeCa("other-ca").ok());
  ASSERT_TRUE(pki.MakeLeaf("node", "ca", "node").ok());
  ASSERT_TRUE(pki.MakeLeaf("client", "ca", "client").ok());
  ASSERT_TRUE(pki.MakeLeaf("stranger", "other-ca", "stranger").ok());
  ASSERT_TRUE(pki.MakeLeaf("expired", "ca", "expired", /*days=*/-1).ok());
  // No worker answers: Health (pdctl status) needs none.
  pki.Write("cluster.json",
            R"({"model": "builtin:tiny", "prefill_workers": [], )"
            R"("decode_workers": [{"id": "d", "address": "127.0.0.1:1"}]})");
  Processes processes(pki.dir());
  absl::StatusOr<int> router = processes.Start(
      "router", absl::StrCat(kBin, "/router/pd-router --listen=127.0.0.1:0 --http_listen= ",
                             "--config='", pki.Path("cluster.json"), "' --tls_cert_file='",
                             pki.Cert("node"), "' --tls_key_file='", pki.Key("node"),
                             "' --tls_client_ca_file='", pki.Cert("ca"), "'"));
  ASSERT_TRUE(router.ok()) << router.status();
  const std::string pdctl = absl::StrCat(kBin, "/client/pdctl status --server=127.0.0.1:",
                                         *router, " --tls_root_certs='", pki.Cert("ca"), "'");
  const auto with = [&](const std::string& name) {
    return absl::StrCat(pdctl, " --tls_cert='", pki.Cert(name), "' --tls_key='", pki.Key(name),
                        "'");
  };
  Output served = RunCommand(with("client"));
  EXPECT_EQ(served.exit_code, 0) << served.text;
  EXPECT_TRUE(absl::StrContains(served.text, "serving")) << served.text;
  for (const std::string& refused : {pdctl, with("stranger"), with("expired")}) {
    Output out = RunCommand(refused);
    EXPECT_EQ(out.exit_code, 1) << refused << "\n" << out.text;
    EXPECT_TRUE(absl::StrContains(out.text, "UNAVAILABLE")) << refused << "\n" << out.text;
  }
  Output half = RunCommand(absl::StrCat(pdctl, " --tls_cert='", pki.Cert("client"), "'"));
  EXPECT_TRUE(absl::StrContains(half.text, "--tls_key is required with --tls_cert")) << half.text;
}

TEST(TlsStartupTest, BadFlagsAndFilesStopTheProcessNamingThem) {
  TestPki pki;
  ASSERT_TRUE(pki.MakeCa("ca").ok());
  ASSERT_TRUE(pki.MakeLeaf("node", "ca", "node").ok());
  pki.Write("garbage.pem", "-----BEGIN CERTIFICATE-----\ngarbage\n-----END CERTIFICATE-----\n");
  pki.Write("cluster.json",
            R"({"model": "builtin:tiny", "prefill_workers": [], )"
            R"("decode_workers": [{"id": "d", "address": "127.0.0.1:1"}]})");
  const std::string decode = absl::StrCat(kBin, "/decode_worker/pd-decode --model=builtin:tiny");
  const std::string prefill = absl::StrCat(kBin, "/prefill_worker/pd-prefill --model=builtin:tiny");
  const std::string router =
      absl::StrCat(kBin, "/router/pd-router --config='", pki.Path("cluster.json"), "'");
  const std::string missing_key = pki.Path("missing.key");
  struct Case {
    std::string command;
    std::string message;
  };
  const std::vector<Case> cases = {
      {absl::StrCat(decode, " --mtls_cert_file='", pki.Cert("node"), "' --mtls_ca_file='",
                    pki.Cert("ca"), "'"),
       "--mtls_key_file is required with --mtls_cert_file"},
      {absl::StrCat(prefill, " --mtls_cert_file='", pki.Cert("node"), "' --mtls_key_file='",
                    pki.Key("node"), "'"),
       "--mtls_ca_file is required with --mtls_cert_file"},
      {absl::StrCat(decode, Mtls(pki, "node", "ca"), " --mtls_key_file='", missing_key, "'"),
       absl::StrCat("cannot read ", missing_key, ": No such file or directory")},
      {absl::StrCat(prefill, " --mtls_cert_file='", pki.Cert("node"), "' --mtls_key_file='",
                    pki.Key("node"), "' --mtls_ca_file='", pki.Path("garbage.pem"), "'"),
       absl::StrCat(pki.Path("garbage.pem"), " holds no PEM certificate")},
      {absl::StrCat(router, " --tls_key_file='", pki.Key("node"), "'"),
       "--tls_cert_file is required with --tls_key_file"},
      {absl::StrCat(router, " --tls_cert_file='", pki.Path("garbage.pem"), "' --tls_key_file='",
                    pki.Key("node"), "'"),
       absl::StrCat(pki.Path("garbage.pem"), " holds no PEM certificate")},
      {absl::StrCat(router, " --mtls_cert_file='", pki.Cert("node"), "' --mtls_key_file='",
                    pki.Cert("node"), "' --mtls_ca_file='", pki.Cert("ca"), "'"),
       absl::StrCat(pki.Cert("node"), " holds no PEM private key")},
  };
  for (const Case& c : cases) {
    Output out = RunCommand(c.command);
    EXPECT_NE(out.exit_code, 0) << c.command << "\n" << out.text;
    EXPECT_NE(out.exit_code, -1) << c.command << "\n" << out.text;  // Exited, not killed.
    EXPECT_TRUE(absl::StrContains(out.text, c.message)) << c.command << "\n" << out.text;
  }
}

}  // namespace
}  // namespace pdserve
