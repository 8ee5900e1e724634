// Runs a receiving KV transport in a child process for the cross-process
// tests, and talks to it over its stdin/stdout line protocol.
#ifndef PDSERVE_TESTS_KV_TRANSFER_PEER_PROCESS_H_
#define PDSERVE_TESTS_KV_TRANSFER_PEER_PROCESS_H_

#include <fcntl.h>
#include <poll.h>
#include <errno.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <memory>
#include <sstream>
#include <string>

namespace pdserve::kv {

// A receiving transport in a child process: `binary` is kv-transfer-peer
// or kv-transfer-device-peer (same command line and line protocol).
class PeerProcess {
 public:
  static std::unique_ptr<PeerProcess> Start(const char* binary,
                                            const std::string& transport,
                                            size_t bytes, int io_timeout_ms,
                                            const std::string& device = "") {
    int to_child[2], from_child[2];
    if (::pipe2(to_child, O_CLOEXEC) != 0 ||
        ::pipe2(from_child, O_CLOEXEC) != 0)
      return nullptr;
    const std::string size = std::to_string(bytes),
                      timeout = std::to_string(io_timeout_ms);
    const pid_t pid = ::fork();
    if (pid == 0) {  // Only async-signal-safe calls until exec.
      ::dup2(to_child[0], 0);
      ::dup2(from_child[1], 1);
      if (device.empty()) {
        ::execl(binary, binary, transport.c_str(), size.c_str(),
                timeout.c_str(), static_cast<char*>(nullptr));
      } else {
        ::execl(binary, binary, transport.c_str(), size.c_str(),
                timeout.c_str(), device.c_str(), static_cast<char*>(nullptr));
      }
      ::_exit(127);
    }
    ::close(to_child[0]);
    ::close(from_child[1]);
    auto p = std::unique_ptr<PeerProcess>(
        new PeerProcess(pid, to_child[1], from_child[0]));
    std::istringstream hello(p->ReadLine());
    hello >> p->endpoint >> p->region >> p->peer_pid;
    if (p->endpoint.empty() || p->peer_pid != pid) return nullptr;
    return p;
  }
  ~PeerProcess() {
    Kill();
    ::close(in_);
    ::close(out_);
  }

  // One command, one answer line ("" when the peer is gone or silent 10 s).
  std::string Command(const std::string& line) {
    const std::string l = line + "\n";
    if (::write(in_, l.data(), l.size()) != static_cast<ssize_t>(l.size()))
      return "";
    return ReadLine();
  }
  void Signal(int sig) { ::kill(pid_, sig); }
  // SIGSTOP, returning once every thread of the peer has stopped: kill()
  // wakes one thread, which stops the others only when it next runs, and
  // until then a polling thread goes on receiving.
  void Stop() {
    ::kill(pid_, SIGSTOP);
    int status = 0;
    while (::waitpid(pid_, &status, WUNTRACED) < 0 && errno == EINTR) {
    }
  }
  void Kill() {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

  std::string endpoint;
  uint32_t region = 0;
  pid_t peer_pid = 0;

 private:
  PeerProcess(pid_t pid, int in, int out) : pid_(pid), in_(in), out_(out) {}
  std::string ReadLine() {
    std::string line;
    while (true) {
      pollfd p{out_, POLLIN, 0};
      if (::poll(&p, 1, 10000) <= 0) return "";
      char c;
      if (::read(out_, &c, 1) != 1) return "";
      if (c == '\n') return line;
      line.push_back(c);
    }
  }
  pid_t pid_;
  const int in_, out_;
};

}  // namespace pdserve::kv

#endif  // PDSERVE_TESTS_KV_TRANSFER_PEER_PROCESS_H_
