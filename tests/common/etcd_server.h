// EtcdServer: a real etcd (Debian etcd-server) for tests, on free loopback
// ports with its data in a temporary directory; stopped (SIGKILL, or
// SIGTERM through Stop) and its data removed when destroyed. Start()
// answers FAILED_PRECONDITION when the etcd binary is not installed, so
// tests can skip saying why. With TLS files it serves https:// only and
// requires a client certificate its CA signed (etcd's --client-cert-auth).
#ifndef PDSERVE_TESTS_COMMON_ETCD_SERVER_H_
#define PDSERVE_TESTS_COMMON_ETCD_SERVER_H_

#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"

namespace pdserve::testing_util {

// etcd's own certificate and the CA its clients' certificates come from.
struct EtcdTlsFiles {
  std::string cert_file;
  std::string key_file;
  std::string ca_file;
};

class EtcdServer {
 public:
  static absl::StatusOr<std::unique_ptr<EtcdServer>> Start(
      std::optional<EtcdTlsFiles> tls = std::nullopt) {
    if (std::system("command -v etcd >/dev/null 2>&1") != 0) {
      return absl::FailedPreconditionError(
          "etcd is not installed (Debian package etcd-server; deploy/install-deps.sh)");
    }
    std::unique_ptr<EtcdServer> s(new EtcdServer());
    s->tls_ = std::move(tls);
    s->client_port_ = FreePort();
    s->peer_port_ = FreePort();
    if (absl::Status st = s->Launch(); !st.ok()) return st;
    return s;
  }

  ~EtcdServer() {
    Kill();
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }

  std::string endpoint() const {
    return absl::StrCat(tls_ ? "https" : "http", "://127.0.0.1:", client_port_);
  }

  // Stops etcd with SIGKILL (its data stays, so Resume() brings back the
  // same store, leases included).
  void Kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }
  // Starts it again on the same ports and data.
  absl::Status Resume() { return Launch(); }

 private:
  EtcdServer() {
    dir_ = std::filesystem::temp_directory_path() /
           absl::StrCat("pdserve-etcd-", ::getpid(), "-", counter_++);
    std::filesystem::create_directories(dir_);
  }

  static int FreePort() {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    socklen_t len = sizeof(addr);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
    ::close(fd);
    return ntohs(addr.sin_port);
  }

  absl::Status Launch() {
    const std::string client = endpoint();
    const std::string peer = absl::StrCat("http://127.0.0.1:", peer_port_);
    // Everything the child needs is made before fork: between fork and
    // exec only async-signal-safe calls.
    const std::string log = (dir_ / "etcd.log").string();
    std::vector<std::string> args = {
        "etcd", "--name", "t", "--data-dir", (dir_ / "data").string(),
        "--listen-client-urls", client, "--advertise-client-urls", client,
        "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
        "--initial-cluster", absl::StrCat("t=", peer)};
    if (tls_) {
      args.insert(args.end(), {"--cert-file", tls_->cert_file, "--key-file", tls_->key_file,
                               "--trusted-ca-file", tls_->ca_file, "--client-cert-auth"});
    }
    std::vector<char*> argv;
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    pid_ = ::fork();
    if (pid_ == 0) {
      const int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      if (fd >= 0) {
        ::dup2(fd, STDOUT_FILENO);
        ::dup2(fd, STDERR_FILENO);
      }
      ::execvp("etcd", argv.data());
      ::_exit(127);
    }
    const std::string health = absl::StrCat("ETCDCTL_API=3 etcdctl --endpoints=", client,
                                            EtcdctlTlsFlags(), " endpoint health >/dev/null 2>&1");
    for (int i = 0; i < 200; ++i) {
      if (std::system(health.c_str()) == 0) return absl::OkStatus();
      absl::SleepFor(absl::Milliseconds(100));
    }
    return absl::UnavailableError(absl::StrCat("etcd did not come up; see ", dir_.string()));
  }

  // etcdctl's TLS flags: etcd's own certificate serves as a client one
  // (etcd's CA signed it).
  std::string EtcdctlTlsFlags() const {
    if (!tls_) return "";
    return absl::StrCat(" --cacert=", tls_->ca_file, " --cert=", tls_->cert_file,
                        " --key=", tls_->key_file);
  }

  static inline int counter_ = 0;
  std::optional<EtcdTlsFiles> tls_;
  std::filesystem::path dir_;
  int client_port_ = 0;
  int peer_port_ = 0;
  pid_t pid_ = -1;
};

}  // namespace pdserve::testing_util

#endif  // PDSERVE_TESTS_COMMON_ETCD_SERVER_H_
