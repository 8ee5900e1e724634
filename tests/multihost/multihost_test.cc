// The multi-host test (issue 17): every process on a host of its own — a
// network namespace with its own address, linked to the others through a
// bridge (tests/common/virtual_network.h) — and etcd on one more. Workers
// register in etcd and the router finds them there; KV crosses hosts over
// the transport under test (tcp, ucx:tcp; and tcp with mTLS between all
// processes and to etcd, each with its own host's certificate).
//
// One run, in phases, under a continuous load of concurrent streams whose
// every output is compared with the colocated engine's:
//   1. serve: 1 prefill and 2 decode workers; the KV went over the
//      transport under test;
//   2. membership: a decode worker joins on a new host and another one
//      leaves (SIGTERM: it drains) while streams run; no stream fails, and
//      the new worker serves;
//   3. partition: one decode worker is cut off from every other host for
//      longer than its lease; the router drops it, and takes it back when
//      the cut heals; streams end equal to the reference or with a clear
//      error, and the healed worker serves again.
// After each phase every decode worker still running has all its KV
// blocks free.
//
// Needs root (namespaces) and etcd; skips saying so without them.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "kv_transfer/transport.h"
#include "pdserve/v1/generation.grpc.pb.h"
#include "tests/common/metrics_test_util.h"
#include "tests/common/test_pki.h"
#include "tests/common/virtual_network.h"
#include "tests/fault/fault_harness.h"

namespace pdserve {
namespace {

using fault::ClusterProcess;
using fault::ScenarioTally;
using fault::StreamOutcome;
using testing_util::StreamCase;
using testing_util::TestPki;
using testing_util::VirtualNetwork;

constexpr int kLeaseTtlSeconds = 3;
// Reservations the router made on decode-0 just before the cut, whose
// answers the cut lost, are released once the cut heals (the router
// retries the Release after 1, 2, 4, ... s); on a one-sided transport (ucx)
// their blocks then stay quarantined for pd-decode's --kv_quarantine_ms
// (15 s), in case a write is still on its way. The workers keep their
// default 60 s reservation timeout, so only the Release can free them in
// time.
constexpr absl::Duration kReleaseAndQuarantine = absl::Seconds(8 + 15);
constexpr char kWorkerArgs[] = "--num_threads=1 --max_batch_tokens=64 --kv_cache_mb=16";

struct Variant {
  std::string transport;
  bool mtls = false;
};

void PrintTo(const Variant& v, std::ostream* os) {
  *os << v.transport << (v.mtls ? " with mTLS" : "");
}

std::string VariantName(const ::testing::TestParamInfo<Variant>& info) {
  std::string name = info.param.transport + (info.param.mtls ? "_mtls" : "");
  std::replace(name.begin(), name.end(), ':', '_');
  return name;
}

// Streams from `cases` (round robin) on `clients` concurrent connections,
// one after another, until Stop(): a load that is running whenever
// something happens to the cluster. Thread-safe.
class ContinuousLoad {
 public:
  ContinuousLoad(v1::Generation::Stub& router, const std::vector<StreamCase>& cases, int clients)
      : cases_(cases) {
    for (int c = 0; c < clients; ++c) {
      threads_.emplace_back([this, &router] {
        while (!stop_.load()) {
          const size_t i = next_.fetch_add(1) % cases_.size();
          StreamOutcome out = fault::StreamOnce(router, testing_util::ToRequest(cases_[i]),
                                                absl::Seconds(60));
          absl::MutexLock lock(&mu_);
          done_.push_back({i, std::move(out)});
        }
      });
    }
  }
  ~ContinuousLoad() { Stop(); }

  int64_t finished() const {
    absl::MutexLock lock(&mu_);
    return static_cast<int64_t>(done_.size());
  }

  // Waits for the streams running now; every stream's case and outcome.
  std::vector<std::pair<size_t, StreamOutcome>> Stop() {
    stop_.store(true);
    for (std::thread& t : threads_) {
      if (t.joinable()) t.join();
    }
    absl::MutexLock lock(&mu_);
    return done_;
  }

 private:
  const std::vector<StreamCase>& cases_;
  std::atomic<bool> stop_ = false;
  std::atomic<size_t> next_ = 0;
  std::vector<std::thread> threads_;
  mutable absl::Mutex mu_;
  std::vector<std::pair<size_t, StreamOutcome>> done_ ABSL_GUARDED_BY(mu_);
};

class MultiHostTest : public ::testing::TestWithParam<Variant> {
 protected:
  void SetUp() override {
    if (std::system("command -v etcd >/dev/null 2>&1") != 0) {
      GTEST_SKIP() << "etcd is not installed (Debian package etcd-server; deploy/install-deps.sh)";
    }
    const std::vector<std::string> built = kv::AvailableKvTransports();
    if (std::find(built.begin(), built.end(), GetParam().transport) == built.end()) {
      GTEST_SKIP() << GetParam().transport << " is not built in";
    }
    auto network = VirtualNetwork::Create();
    if (!network.ok()) GTEST_SKIP() << network.status().message();
    network_ = *std::move(network);
    char tmpl[] = "/tmp/pdserve-multihost-XXXXXX";
    ASSERT_NE(::mkdtemp(tmpl), nullptr);
    dir_ = tmpl;
    cases_ = fault::MixedLoad(24, 1717);
    auto reference = fault::ReferenceOutputs(cases_);
    ASSERT_TRUE(reference.ok()) << reference.status();
    reference_ = *std::move(reference);
    if (GetParam().mtls) {
      pki_ = std::make_unique<TestPki>();
      ASSERT_TRUE(pki_->MakeCa("ca").ok());
      // The test's own certificate: a client of the workers' internal API.
      ASSERT_TRUE(pki_->MakeLeaf("test", "ca", "pdserve-test").ok());
    }
  }

  void TearDown() override {
    for (const auto& [name, pid] : pids_) ::kill(pid, SIGKILL);
    for (const auto& [name, pid] : pids_) ::waitpid(pid, nullptr, 0);
    network_.reset();
    std::error_code ignored;
    if (!dir_.empty() && !HasFailure()) std::filesystem::remove_all(dir_, ignored);
    if (HasFailure()) std::cout << "logs kept in " << dir_ << "\n";
  }

  std::string File(const std::string& name) const { return dir_ + "/" + name; }
  std::string Read(const std::string& name) const {
    std::ifstream in(File(name));
    return std::string(std::istreambuf_iterator<char>(in), {});
  }
  std::string Log(const std::string& name) const { return Read(name + ".log"); }

  // Starts `binary` with `args` on a new host `name` (logs in name.log);
  // "{ip}" in `args` stands for the host's address.
  void Launch(const std::string& name, const std::string& binary, const std::string& args) {
    auto address = network_->AddHost(name);
    ASSERT_TRUE(address.ok()) << address.status();
    if (GetParam().mtls) {
      ASSERT_TRUE(pki_->MakeLeaf(name, "ca", name, 2, "IP:" + *address).ok());
    }
    const std::string command =
        absl::StrCat("exec ", network_->Exec(name), binary, " ",
                     absl::StrReplaceAll(args, {{"{ip}", *address}}), " >", File(name + ".log"),
                     " 2>&1");
    const pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      ::execl("/bin/sh", "sh", "-c", command.c_str(), nullptr);
      ::_exit(127);
    }
    pids_[name] = pid;
  }

  // Waits for `name`'s port file; its address.
  std::string WaitForPort(const std::string& name) {
    for (int i = 0; i < 600 && Read(name + ".port").empty(); ++i) {
      absl::SleepFor(absl::Milliseconds(100));
    }
    const std::string port = Read(name + ".port");
    EXPECT_FALSE(port.empty()) << name << " did not start:\n" << Log(name);
    return absl::StrCat(network_->address(name), ":", std::stoi(port.empty() ? "0" : port));
  }

  // Process `name`'s flags for mTLS to its peers and to etcd, with its
  // host's certificate.
  std::string MtlsFlags(const std::string& name) const {
    if (!GetParam().mtls) return "";
    return absl::StrCat(" --mtls_cert_file=", pki_->Cert(name), " --mtls_key_file=",
                        pki_->Key(name), " --mtls_ca_file=", pki_->Cert("ca"),
                        " --etcd_cert_file=", pki_->Cert(name), " --etcd_key_file=",
                        pki_->Key(name), " --etcd_ca_file=", pki_->Cert("ca"));
  }

  // etcdctl against the cluster's etcd, as the test.
  std::string Etcdctl() const {
    std::string command = "ETCDCTL_API=3 etcdctl --endpoints=" + etcd_;
    if (GetParam().mtls) {
      absl::StrAppend(&command, " --cacert=", pki_->Cert("ca"), " --cert=", pki_->Cert("test"),
                      " --key=", pki_->Key("test"));
    }
    return command;
  }

  // With mTLS, etcd serves https:// only and requires a certificate of
  // the cluster's CA.
  void StartEtcd() {
    const std::string scheme = GetParam().mtls ? "https" : "http";
    std::string tls;
    if (GetParam().mtls) {
      tls = absl::StrCat(" --cert-file ", pki_->Cert("etcd"), " --key-file ",
                         pki_->Key("etcd"), " --trusted-ca-file ", pki_->Cert("ca"),
                         " --client-cert-auth");
    }
    ASSERT_NO_FATAL_FAILURE(
        Launch("etcd", "etcd",
               absl::StrCat("--name m --data-dir ", File("etcd.data"), " --listen-client-urls ",
                            scheme, "://{ip}:2379 --advertise-client-urls ", scheme,
                            "://{ip}:2379 --listen-peer-urls http://{ip}:2380"
                            " --initial-advertise-peer-urls http://{ip}:2380"
                            " --initial-cluster m=http://{ip}:2380",
                            tls)));
    etcd_ = absl::StrCat(scheme, "://", network_->address("etcd"), ":2379");
    for (int i = 0; i < 100; ++i) {
      if (std::system((Etcdctl() + " endpoint health >/dev/null 2>&1").c_str()) == 0) {
        return;
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
    FAIL() << "etcd did not come up:\n" << Log("etcd");
  }

  void StartDecode(const std::string& name) {
    ASSERT_NO_FATAL_FAILURE(Launch(
        name, absl::StrCat(PDSERVE_BINARY_DIR, "/decode_worker/pd-decode"),
        absl::StrCat("--port_file=", File(name + ".port"), " --worker_id=", name,
                     " --listen={ip}:0 --kv_listen={ip}:0 --metrics_listen={ip}:0",
                     " --metrics_port_file=", File(name + ".metrics_port"),
                     " --kv_canary --drain_timeout=60s", WorkerFlags(name))));
    addresses_[name] = WaitForPort(name);
  }

  void StartPrefill(const std::string& name) {
    ASSERT_NO_FATAL_FAILURE(Launch(
        name, absl::StrCat(PDSERVE_BINARY_DIR, "/prefill_worker/pd-prefill"),
        absl::StrCat("--port_file=", File(name + ".port"), " --worker_id=", name,
                     " --listen={ip}:0 --metrics_listen={ip}:0 --metrics_port_file=",
                     File(name + ".metrics_port"), WorkerFlags(name))));
    addresses_[name] = WaitForPort(name);
  }

  std::string WorkerFlags(const std::string& name) const {
    return absl::StrCat(" --model=builtin:tiny ", kWorkerArgs, " --kv_transport=",
                        GetParam().transport, " --etcd=", etcd_,
                        " --etcd_lease_ttl=", kLeaseTtlSeconds, "s", MtlsFlags(name));
  }

  void StartRouter() {
    std::ofstream(File("cluster.json"))
        << R"({"model": "builtin:tiny", "routing": {"localPrefillMaxTokens": 0}})";
    std::string tls;
    if (GetParam().mtls) {
      tls = absl::StrCat(" --tls_cert_file=", pki_->Cert("router"),
                         " --tls_key_file=", pki_->Key("router"), MtlsFlags("router"));
    }
    ASSERT_NO_FATAL_FAILURE(Launch(
        "router", absl::StrCat(PDSERVE_BINARY_DIR, "/router/pd-router"),
        absl::StrCat("--port_file=", File("router.port"),
                     " --listen={ip}:0 --http_listen={ip}:0 --http_port_file=",
                     File("router.metrics_port"), " --config=", File("cluster.json"),
                     " --etcd=", etcd_, tls)));
    addresses_["router"] = WaitForPort("router");
    std::shared_ptr<grpc::ChannelCredentials> credentials = grpc::InsecureChannelCredentials();
    if (GetParam().mtls) {
      grpc::SslCredentialsOptions ssl;
      ssl.pem_root_certs = TestPki::Read(pki_->Cert("ca"));
      credentials = grpc::SslCredentials(ssl);
    }
    router_ = v1::Generation::NewStub(grpc::CreateChannel(addresses_["router"], credentials));
  }

  // The test's credentials for the workers' internal API.
  std::shared_ptr<grpc::ChannelCredentials> WorkerCredentials() const {
    if (!GetParam().mtls) return grpc::InsecureChannelCredentials();
    grpc::SslCredentialsOptions ssl;
    ssl.pem_root_certs = TestPki::Read(pki_->Cert("ca"));
    ssl.pem_cert_chain = TestPki::Read(pki_->Cert("test"));
    ssl.pem_private_key = TestPki::Read(pki_->Key("test"));
    return grpc::SslCredentials(ssl);
  }

  absl::StatusOr<v1::HealthResponse> Health() {
    grpc::ClientContext context;
    context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
    v1::HealthResponse health;
    const grpc::Status s = router_->Health(&context, {}, &health);
    if (!s.ok()) return absl::UnavailableError(s.error_message());
    return health;
  }

  // The healthy workers in the router's view, sorted: "decode-0 prefill-0".
  std::string View() {
    auto health = Health();
    if (!health.ok()) return "(no answer: " + std::string(health.status().message()) + ")";
    std::vector<std::string> ids;
    for (const auto& w : health->workers()) {
      if (w.healthy()) ids.push_back(w.id());
    }
    std::sort(ids.begin(), ids.end());
    return absl::StrJoin(ids, " ");
  }

  // Waits up to `limit` for the router's view to be `want`; how long it took.
  absl::StatusOr<absl::Duration> WaitForView(const std::string& want, absl::Duration limit) {
    const absl::Time start = absl::Now();
    std::string view;
    while (absl::Now() - start < limit) {
      view = View();
      if (view == want) return absl::Now() - start;
      absl::SleepFor(absl::Milliseconds(50));
    }
    return absl::DeadlineExceededError(
        absl::StrCat("the router's view is '", view, "', not '", want, "'"));
  }

  ClusterProcess Process(const std::string& name) const {
    return {.name = name,
            .address = addresses_.at(name),
            .metrics_host = network_->address(name),
            .metrics_port = std::stoi(Read(name + ".metrics_port")),
            .pid = pids_.at(name)};
  }

  // Whether etcd holds worker `name`'s registration (asked with etcdctl).
  bool Registered(const std::string& name) const {
    return std::system(absl::StrCat(Etcdctl(), " get --keys-only /pdserve/workers/", name,
                                    " 2>/dev/null | grep -q ", name)
                           .c_str()) == 0;
  }

  // Tokens decode worker `name` has generated since it started.
  double Generated(const std::string& name) {
    absl::StatusOr<std::string> metrics = testing_util::HttpGet(
        std::stoi(Read(name + ".metrics_port")), "/metrics", network_->address(name));
    if (!metrics.ok()) return -1;
    return fault::MetricSum(*metrics, "pdserve_decode_generated_tokens_total");
  }

  // Judges every stream against the reference, and checks that `running`
  // decode workers all have every KV block free again within `settle`.
  ScenarioTally Judge(const std::string& scenario,
                      const std::vector<std::pair<size_t, StreamOutcome>>& streams,
                      const std::vector<std::string>& running, absl::Duration settle) {
    ScenarioTally tally{.scenario = scenario};
    std::vector<std::vector<int32_t>> reference;
    std::vector<StreamOutcome> outcomes;
    for (const auto& [i, outcome] : streams) {
      reference.push_back(reference_[i]);
      outcomes.push_back(outcome);
    }
    fault::JudgeStreams(reference, outcomes, tally);
    std::vector<ClusterProcess> processes = {Process("router")};
    for (const std::string& name : running) processes.push_back(Process(name));
    fault::CheckProcesses(processes, {}, tally, settle, WorkerCredentials());
    std::cout << fault::FormatMatrix({tally});
    return tally;
  }

  std::unique_ptr<VirtualNetwork> network_;
  std::unique_ptr<TestPki> pki_;
  std::string dir_, etcd_;
  std::map<std::string, pid_t> pids_;
  std::map<std::string, std::string> addresses_;
  std::unique_ptr<v1::Generation::Stub> router_;
  std::vector<StreamCase> cases_;
  std::vector<std::vector<int32_t>> reference_;
};

TEST_P(MultiHostTest, ServesAcrossHostsThroughMembershipChangesAndAPartition) {
  const std::string transport = GetParam().transport;
  ASSERT_NO_FATAL_FAILURE(StartEtcd());
  ASSERT_NO_FATAL_FAILURE(StartDecode("decode-0"));
  ASSERT_NO_FATAL_FAILURE(StartDecode("decode-1"));
  ASSERT_NO_FATAL_FAILURE(StartPrefill("prefill-0"));
  ASSERT_NO_FATAL_FAILURE(StartRouter());
  ASSERT_TRUE(WaitForView("decode-0 decode-1 prefill-0", absl::Seconds(30)).ok())
      << View() << "\n" << Log("router");

  // 1. Serve: every stream equals the colocated engine's output, and every
  // request's KV crossed hosts over the transport under test.
  {
    fault::LoadRun load(*router_, cases_);
    ScenarioTally tally;
    fault::JudgeStreams(reference_, load.Join(), tally);
    EXPECT_EQ(tally.completed_equal, static_cast<int>(cases_.size()))
        << absl::StrJoin(tally.problems, "\n");
    // The router learns the counts from load reports (every 100 ms).
    v1::WorkerStatus prefill;
    for (int i = 0; i < 50; ++i) {
      auto health = Health();
      ASSERT_TRUE(health.ok()) << health.status();
      for (const v1::WorkerStatus& w : health->workers()) {
        if (w.id() == "prefill-0") prefill = w;
      }
      if (prefill.kv_transports_size() == 1 &&
          prefill.kv_transports(0).pushes() >= cases_.size()) {
        break;
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
    ASSERT_EQ(prefill.kv_transports_size(), 1) << prefill.DebugString();
    EXPECT_EQ(prefill.kv_transports(0).transport(), transport);
    EXPECT_EQ(prefill.kv_transports(0).pushes(), cases_.size());
    EXPECT_GT(Generated("decode-0"), 0);
    EXPECT_GT(Generated("decode-1"), 0);
  }

  // 2. Membership while streams run: decode-2 joins on a new host, then
  // decode-1 leaves (SIGTERM: it drains, deregisters and exits 0).
  {
    ContinuousLoad load(*router_, cases_, 8);
    while (load.finished() < 8) absl::SleepFor(absl::Milliseconds(20));
    ASSERT_NO_FATAL_FAILURE(StartDecode("decode-2"));
    auto joined = WaitForView("decode-0 decode-1 decode-2 prefill-0", absl::Seconds(15));
    ASSERT_TRUE(joined.ok()) << joined.status();
    std::cout << "decode-2 in the router's view " << absl::FormatDuration(*joined)
              << " after its port opened\n";
    const double generated_before = Generated("decode-2");
    const int64_t finished_before = load.finished();
    ASSERT_EQ(::kill(pids_["decode-1"], SIGTERM), 0);
    auto left = WaitForView("decode-0 decode-2 prefill-0", absl::Seconds(15));
    EXPECT_TRUE(left.ok()) << left.status();
    int status = 0;
    ASSERT_EQ(::waitpid(pids_["decode-1"], &status, 0), pids_["decode-1"]);
    pids_.erase("decode-1");
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
        << "decode-1 did not drain and exit 0:\n" << Log("decode-1");
    // Streams go on after the change, and reach the new worker.
    while (load.finished() < finished_before + 16) absl::SleepFor(absl::Milliseconds(20));
    const std::vector<std::pair<size_t, StreamOutcome>> streams = load.Stop();
    ScenarioTally tally = Judge("decode-2 joins, decode-1 drains and leaves, under load",
                                streams, {"decode-0", "decode-2"}, absl::Seconds(15));
    EXPECT_TRUE(tally.problems.empty()) << absl::StrJoin(tally.problems, "\n");
    EXPECT_EQ(tally.completed_equal, tally.streams) << "a membership change failed streams";
    EXPECT_GT(Generated("decode-2"), generated_before) << "decode-2 never served";
  }

  // 3. Partition: decode-0 cut off from every host (the router, the prefill
  // worker, etcd) for longer than its lease; then the cut heals.
  {
    ContinuousLoad load(*router_, cases_, 8);
    while (load.finished() < 8) absl::SleepFor(absl::Milliseconds(20));
    ASSERT_TRUE(network_->SetCut("decode-0", true).ok());
    const absl::Time cut = absl::Now();
    // The router stops routing to it as soon as its load reports stop
    // (before the lease runs out) ...
    auto dropped = WaitForView("decode-2 prefill-0", absl::Seconds(kLeaseTtlSeconds + 5));
    EXPECT_TRUE(dropped.ok()) << dropped.status();
    // ... and etcd deletes its registration within the lease's TTL.
    const absl::Time gone_by = cut + absl::Seconds(kLeaseTtlSeconds) + absl::Seconds(1.5);
    while (Registered("decode-0") && absl::Now() < gone_by) {
      absl::SleepFor(absl::Milliseconds(100));
    }
    EXPECT_FALSE(Registered("decode-0")) << "the cut-off worker's lease did not expire";
    absl::SleepFor(absl::Seconds(kLeaseTtlSeconds + 3) - (absl::Now() - cut));
    ASSERT_TRUE(network_->SetCut("decode-0", false).ok());
    // It finds its lease gone, registers again, and the router takes it back.
    auto back = WaitForView("decode-0 decode-2 prefill-0", absl::Seconds(20));
    EXPECT_TRUE(back.ok()) << back.status() << "\n" << Log("decode-0");
    EXPECT_TRUE(Registered("decode-0"));
    if (back.ok()) {
      std::cout << "partition: decode-0 dropped " << absl::FormatDuration(*dropped)
                << " after the cut, back " << absl::FormatDuration(*back)
                << " after the heal\n";
    }
    const int64_t finished_at_heal = load.finished();
    while (load.finished() < finished_at_heal + 16) absl::SleepFor(absl::Milliseconds(20));
    ScenarioTally tally = Judge("decode-0 cut off for lease + 3 s, then healed, under load",
                                load.Stop(), {"decode-0", "decode-2"},
                                kReleaseAndQuarantine + absl::Seconds(5));
    EXPECT_TRUE(tally.problems.empty()) << absl::StrJoin(tally.problems, "\n");
  }

  // After the heal, every stream completes and the healed worker serves.
  const double generated_before = Generated("decode-0");
  for (int round = 0; round < 5 && Generated("decode-0") <= generated_before; ++round) {
    fault::LoadRun load(*router_, cases_);
    ScenarioTally tally;
    fault::JudgeStreams(reference_, load.Join(), tally);
    EXPECT_EQ(tally.completed_equal, static_cast<int>(cases_.size()))
        << absl::StrJoin(tally.problems, "\n");
  }
  EXPECT_GT(Generated("decode-0"), generated_before) << "decode-0 never served after the heal";
}

INSTANTIATE_TEST_SUITE_P(Transports, MultiHostTest,
                         ::testing::Values(Variant{.transport = "tcp"},
                                           Variant{.transport = "ucx:tcp"},
                                           Variant{.transport = "tcp", .mtls = true}),
                         VariantName);

}  // namespace
}  // namespace pdserve
