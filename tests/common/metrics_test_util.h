// Test helpers for /metrics: fetching a page over loopback HTTP and checking
// an exposition with the real `promtool check metrics` (Debian package
// `prometheus`, installed by deploy/install-deps.sh).
#ifndef PDSERVE_TESTS_COMMON_METRICS_TEST_UTIL_H_
#define PDSERVE_TESTS_COMMON_METRICS_TEST_UTIL_H_

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace pdserve::testing_util {

// GET http://<host>:<port><path> (host an IPv4 address): the body of a 200
// answer, else an error with the status line. Connection: close, so the
// body is what is read until EOF.
inline absl::StatusOr<std::string> HttpGet(int port, const std::string& path,
                                           const std::string& host = "127.0.0.1") {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return absl::InternalError("socket");
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  if (::inet_pton(AF_INET, host.c_str(), &addr.sin_addr) != 1) {
    ::close(fd);
    return absl::InvalidArgumentError(absl::StrCat("not an IPv4 address: ", host));
  }
  timeval timeout{.tv_sec = 30, .tv_usec = 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return absl::UnavailableError(absl::StrCat("connect to ", host, ":", port));
  }
  const std::string request = absl::StrCat(
      "GET ", path, " HTTP/1.1\r\nHost: ", host, "\r\nConnection: close\r\n\r\n");
  if (::send(fd, request.data(), request.size(), MSG_NOSIGNAL) !=
      static_cast<ssize_t>(request.size())) {
    ::close(fd);
    return absl::UnavailableError("send");
  }
  std::string response;
  char buffer[65536];
  ssize_t n;
  while ((n = ::recv(fd, buffer, sizeof(buffer), 0)) > 0) response.append(buffer, n);
  ::close(fd);
  const size_t head_end = response.find("\r\n\r\n");
  if (head_end == std::string::npos) {
    return absl::UnavailableError(absl::StrCat("no HTTP answer: ", response));
  }
  const std::string status_line = response.substr(0, response.find("\r\n"));
  if (status_line.find(" 200 ") == std::string::npos) {
    return absl::UnavailableError(status_line);
  }
  return response.substr(head_end + 4);
}

// The path of promtool, or empty.
inline std::string FindPromtool() {
  for (const char* dir : {"/usr/bin", "/usr/local/bin", "/bin"}) {
    const std::string path = absl::StrCat(dir, "/promtool");
    if (::access(path.c_str(), X_OK) == 0) return path;
  }
  return "";
}

// Runs `promtool check metrics` on `exposition`: OK when it passes with no
// finding, else an error holding promtool's output. FAILED_PRECONDITION
// when promtool is not installed.
inline absl::Status CheckWithPromtool(const std::string& exposition) {
  const std::string promtool = FindPromtool();
  if (promtool.empty()) {
    return absl::FailedPreconditionError(
        "promtool not found: run deploy/install-deps.sh (Debian package "
        "'prometheus')");
  }
  static int counter = 0;
  const std::filesystem::path dir = std::filesystem::temp_directory_path();
  const std::string input =
      (dir / absl::StrCat("pdserve-promtool-", ::getpid(), "-", counter, ".txt")).string();
  const std::string output =
      (dir / absl::StrCat("pdserve-promtool-", ::getpid(), "-", counter++, ".out")).string();
  std::ofstream(input) << exposition;
  const std::string cmd =
      absl::StrCat(promtool, " check metrics < '", input, "' > '", output, "' 2>&1");
  const int rc = std::system(cmd.c_str());
  std::ifstream in(output);
  const std::string findings(std::istreambuf_iterator<char>(in), {});
  std::filesystem::remove(input);
  std::filesystem::remove(output);
  // promtool exits 0 with no output when clean; lint findings exit 3.
  if (rc != 0 || !findings.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "promtool check metrics (exit ", WEXITSTATUS(rc), "):\n", findings));
  }
  return absl::OkStatus();
}

// The value of the sample written exactly as `series` (e.g.
// `pdserve_x_total{a="b"}`) in `exposition`, or -1 when absent.
inline double SampleValue(const std::string& exposition, const std::string& series) {
  for (absl::string_view line : absl::StrSplit(exposition, '\n')) {
    if (line.size() > series.size() && line.substr(0, series.size()) == series &&
        line[series.size()] == ' ') {
      double value;
      if (absl::SimpleAtod(line.substr(series.size() + 1), &value)) return value;
    }
  }
  return -1;
}

}  // namespace pdserve::testing_util

#endif  // PDSERVE_TESTS_COMMON_METRICS_TEST_UTIL_H_
