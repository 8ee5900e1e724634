// LocalCluster: a real pdserve cluster for tests and benchmarks, started and
// stopped with deploy/local/cluster.sh (the same launcher users run), each
// process its own OS process on loopback. Gives the router's stub, the
// workers' internal stubs, pids to kill, and restarts of killed processes.
#ifndef PDSERVE_TESTS_CLUSTER_LOCAL_CLUSTER_H_
#define PDSERVE_TESTS_CLUSTER_LOCAL_CLUSTER_H_

#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <string>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/strings/strip.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "pdserve/internal/v1/worker.grpc.pb.h"
#include "pdserve/v1/generation.grpc.pb.h"

namespace pdserve::testing_util {

struct ClusterSpec {
  int prefill = 1;
  int decode = 1;
  std::string model = "builtin:tiny";
  // Small pools and chunks so tests exercise chunking and block reuse; one
  // engine thread per worker (the tests share two cores).
  std::string prefill_args = "--num_threads=1 --max_batch_tokens=64 --kv_cache_mb=16";
  // --kv_canary: every free block is checked for writes nobody owns
  // (the teardown check below).
  std::string decode_args = "--num_threads=1 --max_batch_tokens=64 --kv_cache_mb=16 --kv_canary";
  std::string router_args = "";
  // The config's routing section: by default every prompt, however short,
  // goes to a prefill worker when one is up, so that the tests exercise
  // the KV hand-off.
  std::string routing = R"({"localPrefillMaxTokens": 0})";
  // Workers register in an etcd the launcher starts (cluster.sh --etcd),
  // and the router discovers them there.
  bool etcd = false;
  // cluster.sh --tls: TLS and mTLS with DIR/ca.crt, DIR/node.crt and
  // DIR/node.key (made there when DIR has no ca.crt); the stubs below then
  // connect over TLS, presenting node.crt. Empty: plaintext.
  std::string tls_dir = "";
};

class LocalCluster {
 public:
  // Starts the cluster and waits until the router sees every worker.
  // The binaries come from `binary_dir`, the launcher from `source_dir`.
  static absl::StatusOr<std::unique_ptr<LocalCluster>> Start(
      const ClusterSpec& spec, const std::string& source_dir = PDSERVE_SOURCE_DIR,
      const std::string& binary_dir = PDSERVE_BINARY_DIR) {
    std::unique_ptr<LocalCluster> c(new LocalCluster(source_dir));
    c->decode_ = spec.decode;
    c->prefill_ = spec.prefill;
    const std::string cmd = absl::StrCat(
        source_dir, "/deploy/local/cluster.sh up --dir '", c->dir_.string(), "' --bin '",
        binary_dir, "' --prefill ", spec.prefill, " --decode ", spec.decode, " --model '",
        spec.model, "' --prefill-args '", spec.prefill_args, "' --decode-args '",
        spec.decode_args, "' --router-args '", spec.router_args, "' --routing '",
        spec.routing, "'", spec.etcd ? " --etcd" : "",
        spec.tls_dir.empty() ? "" : " --tls '" + spec.tls_dir + "'");
    if (std::system(cmd.c_str()) != 0) {
      return absl::UnavailableError(absl::StrCat("cluster did not start: ", cmd,
                                                 "\nrouter log:\n", c->Log("router")));
    }
    c->credentials_ = grpc::InsecureChannelCredentials();
    if (!spec.tls_dir.empty()) {
      grpc::SslCredentialsOptions ssl;
      ssl.pem_root_certs = ReadFile(spec.tls_dir + "/ca.crt");
      ssl.pem_cert_chain = ReadFile(spec.tls_dir + "/node.crt");
      ssl.pem_private_key = ReadFile(spec.tls_dir + "/node.key");
      c->credentials_ = grpc::SslCredentials(ssl);
    }
    c->router_ = pdserve::v1::Generation::NewStub(
        grpc::CreateChannel(c->Address("router"), c->credentials_));
    return c;
  }

  // Called by the destructor for each decode worker that still holds KV
  // blocks (free below total) 10 s after the cluster's last use: the leak
  // check every cluster test gets (cluster_test.cc makes it a failure).
  // Null: not checked.
  static inline std::function<void(const std::string&)> on_kv_leak;

  ~LocalCluster() {
    if (on_kv_leak) CheckKvReturned();
    const std::string cmd =
        absl::StrCat(source_dir_, "/deploy/local/cluster.sh down --dir '", dir_.string(), "'");
    (void)std::system(cmd.c_str());
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }

  pdserve::v1::Generation::Stub& router() { return *router_; }

  std::string Address(const std::string& name) const {
    return absl::StrCat("127.0.0.1:", Read(name + ".port"));
  }
  pid_t Pid(const std::string& name) const { return std::stoi(Read(name + ".pid")); }
  // The port of the process's Prometheus /metrics (the router's HTTP port).
  int MetricsPort(const std::string& name) const {
    return std::stoi(Read(name + ".metrics_port"));
  }
  std::string Log(const std::string& name) const { return Read(name + ".log"); }
  // The run directory (ports, pids, logs of every process).
  std::string dir() const { return dir_.string(); }

  // kill -9: the process vanishes without a word to its peers.
  bool Kill(const std::string& name) { return ::kill(Pid(name), SIGKILL) == 0; }

  // kill -9 of `name`, `down_for` later the same process again from its
  // own command line with its gRPC (and the router's HTTP) port pinned to
  // the one it had, so that the router's configuration and clients'
  // channels find it again. Returns once the router serves every worker
  // again; UNAVAILABLE if that takes over 30 s. FAILED_PRECONDITION when
  // `name` no longer runs (its command line is gone with it).
  absl::Status Restart(const std::string& name, absl::Duration down_for = absl::ZeroDuration()) {
    const pid_t old_pid = Pid(name);
    const std::string command = PinnedCommandLine(name);
    if (command.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(name, " is not running"));
    }
    ::kill(old_pid, SIGKILL);
    for (int i = 0; i < 500 && ProcessRunning(old_pid); ++i) absl::SleepFor(absl::Milliseconds(10));
    absl::SleepFor(down_for);
    return Relaunch(name, command);
  }

  // The command line `name` runs with, its gRPC (and the router's HTTP)
  // port pinned to the one it has now: what Relaunch starts again. Empty
  // when `name` does not run.
  std::string PinnedCommandLine(const std::string& name) const {
    std::ifstream cmdline_file(absl::StrCat("/proc/", Pid(name), "/cmdline"));
    const std::string cmdline(std::istreambuf_iterator<char>(cmdline_file), {});
    if (cmdline.empty()) return "";
    const std::string port(absl::StripAsciiWhitespace(Read(name + ".port")));
    const std::string http_port(absl::StripAsciiWhitespace(Read("router.http_port")));
    std::string command;
    for (absl::string_view arg : absl::StrSplit(cmdline, '\0', absl::SkipEmpty())) {
      std::string pinned(arg);
      if (absl::StartsWith(arg, "--listen=")) pinned = "--listen=127.0.0.1:" + port;
      if (name == "router" && absl::StartsWith(arg, "--http_listen=")) {
        pinned = "--http_listen=127.0.0.1:" + http_port;
      }
      absl::StrAppend(&command, "'", pinned, "' ");
    }
    return command;
  }

  // Starts `command` (PinnedCommandLine's, taken while `name` ran) as
  // `name` again, once the old process is gone. Returns once the router
  // serves every worker again (healthy and taking new work); UNAVAILABLE
  // if that takes over 30 s.
  absl::Status Relaunch(const std::string& name, const std::string& command) {
    std::filesystem::remove(dir_ / (name + ".port"));
    const std::string start =
        absl::StrCat(command, ">>'", (dir_ / (name + ".log")).string(), "' 2>&1 & echo $! >'",
                     (dir_ / (name + ".pid")).string(), "'");
    if (std::system(start.c_str()) != 0) {
      return absl::UnavailableError(absl::StrCat("could not start ", name, ": ", start));
    }
    for (int i = 0; i < 300; ++i) {
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Milliseconds(500)));
      pdserve::v1::HealthResponse health;
      if (!Read(name + ".port").empty() && router_->Health(&context, {}, &health).ok() &&
          health.serving() && static_cast<int>(health.decode_workers()) == decode_ &&
          static_cast<int>(health.prefill_workers()) == prefill_) {
        return absl::OkStatus();
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
    return absl::UnavailableError(
        absl::StrCat("the router does not serve every worker after restarting ", name));
  }

  // True while `pid` runs (a process killed but not yet reaped is not).
  static bool ProcessRunning(pid_t pid) {
    std::ifstream stat(absl::StrCat("/proc/", pid, "/stat"));
    std::string line;
    if (!std::getline(stat, line)) return false;
    const size_t after_name = line.rfind(')');
    return after_name != std::string::npos && after_name + 2 < line.size() &&
           line[after_name + 2] != 'Z' && line[after_name + 2] != 'X';
  }

  std::unique_ptr<pdserve::internal::v1::DecodeWorker::Stub> DecodeStub(const std::string& name) {
    return pdserve::internal::v1::DecodeWorker::NewStub(
        grpc::CreateChannel(Address(name), credentials_));
  }
  std::unique_ptr<pdserve::internal::v1::PrefillWorker::Stub> PrefillStub(const std::string& name) {
    return pdserve::internal::v1::PrefillWorker::NewStub(
        grpc::CreateChannel(Address(name), credentials_));
  }

 private:
  static std::string ReadFile(const std::string& path) {
    std::ifstream in(path);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

  // Each decode worker still answering must have all its blocks free again
  // and no canary violation (a killed one is skipped).
  void CheckKvReturned() {
    for (int i = 0; i < decode_; ++i) {
      const std::string name = absl::StrCat("decode-", i);
      auto stub = DecodeStub(name);
      pdserve::internal::v1::LoadReport load;
      bool answered = false;
      for (int attempt = 0; attempt < 100; ++attempt) {
        grpc::ClientContext context;
        context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(1)));
        answered = stub->GetLoad(&context, {}, &load).ok();
        if (!answered || load.free_blocks() == load.total_blocks()) break;
        absl::SleepFor(absl::Milliseconds(100));
      }
      if (answered && load.kv_canary_violations() > 0) {
        on_kv_leak(absl::StrCat(name, " found ", load.kv_canary_violations(),
                                " free KV blocks written while nobody owned them"));
      }
      if (answered && load.free_blocks() != load.total_blocks()) {
        on_kv_leak(absl::StrCat(name, " still holds ", load.total_blocks() - load.free_blocks(),
                                " of its ", load.total_blocks(), " KV blocks (", load.reservations(),
                                " reservations, ", load.running(), " running, ", load.waiting(),
                                " waiting)"));
      }
    }
  }

  std::string Read(const std::string& file) const {
    std::ifstream in(dir_ / file);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

  explicit LocalCluster(std::string source_dir) : source_dir_(std::move(source_dir)) {
    dir_ = std::filesystem::temp_directory_path() /
           absl::StrCat("pdserve-cluster-", ::getpid(), "-", counter_++);
    std::filesystem::create_directories(dir_);
  }

  static inline int counter_ = 0;
  const std::string source_dir_;
  int decode_ = 0;
  int prefill_ = 0;
  std::filesystem::path dir_;
  std::unique_ptr<pdserve::v1::Generation::Stub> router_;
  // The credentials of every stub (TLS ones with ClusterSpec::tls_dir).
  std::shared_ptr<grpc::ChannelCredentials> credentials_;
};

}  // namespace pdserve::testing_util

#endif  // PDSERVE_TESTS_CLUSTER_LOCAL_CLUSTER_H_
