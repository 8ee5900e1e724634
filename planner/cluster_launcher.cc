#include "planner/cluster_launcher.h"

#include <sys/socket.h>
#include <sys/time.h>

#include <cstdio>
#include <fstream>
#include <optional>
#include <sstream>

#include "absl/status/status.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/strip.h"
#include "boost/asio/io_context.hpp"
#include "boost/asio/ip/tcp.hpp"
#include "boost/beast/core/flat_buffer.hpp"
#include "boost/beast/http/empty_body.hpp"
#include "boost/beast/http/read.hpp"
#include "boost/beast/http/string_body.hpp"
#include "boost/beast/http/write.hpp"
#include "common/metrics.h"
#include "common/status_macros.h"

namespace pdserve::planner {
namespace {

// Runs `command` through the shell; its exit status and the tail of its
// output.
int RunShell(const std::string& command, std::string* output) {
  FILE* pipe = popen(absl::StrCat(command, " 2>&1").c_str(), "r");
  if (pipe == nullptr) return -1;
  char buffer[4096];
  std::string all;
  while (fgets(buffer, sizeof buffer, pipe) != nullptr) all += buffer;
  const int status = pclose(pipe);
  if (output != nullptr) *output = all.size() > 2000 ? all.substr(all.size() - 2000) : all;
  return status;
}

// The first line of a file (a port or a pid), trimmed.
std::string ReadLine(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return std::string(absl::StripAsciiWhitespace(line));
}

// GET http://127.0.0.1:<port><path>: the body of a 200 answer.
absl::StatusOr<std::string> LocalHttpGet(int port, const std::string& path) {
  namespace http = boost::beast::http;
  boost::asio::io_context io;
  boost::asio::ip::tcp::socket socket(io);
  boost::system::error_code ec;
  socket.connect({boost::asio::ip::address_v4::loopback(), static_cast<uint16_t>(port)}, ec);
  const std::string where = absl::StrCat("127.0.0.1:", port, path);
  if (ec) return absl::UnavailableError(absl::StrCat(where, ": ", ec.message()));
  // A worker that stops answering must not hang the caller.
  const timeval timeout{.tv_sec = 30, .tv_usec = 0};
  setsockopt(socket.native_handle(), SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof timeout);
  http::request<http::empty_body> request{http::verb::get, path, 11};
  request.set(http::field::host, "127.0.0.1");
  http::write(socket, request, ec);
  boost::beast::flat_buffer buffer;
  http::response<http::string_body> response;
  if (!ec) http::read(socket, buffer, response, ec);
  if (ec) return absl::UnavailableError(absl::StrCat(where, ": ", ec.message()));
  if (response.result() != http::status::ok) {
    return absl::UnavailableError(absl::StrCat(where, ": HTTP ", response.result_int()));
  }
  return std::move(response.body());
}

}  // namespace

std::string ShellQuote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  return out + "'";
}

absl::StatusOr<std::unique_ptr<ClusterLauncher>> ClusterLauncher::Start(
    const LaunchOptions& options) {
  if (options.dir.empty() || options.source_dir.empty() || options.binary_dir.empty()) {
    return absl::InvalidArgumentError("ClusterLauncher needs dir, source_dir and binary_dir");
  }
  if (options.decode < 1 || options.prefill < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("a cluster needs at least one decode worker and no negative count, not ",
                     options.prefill, "P", options.decode, "D"));
  }
  const std::string launcher = absl::StrCat(options.source_dir, "/deploy/local/cluster.sh");
  std::string command = absl::StrCat(
      ShellQuote(launcher), " up --prefill ", options.prefill, " --decode ", options.decode,
      " --model ", ShellQuote(options.model), " --dir ", ShellQuote(options.dir), " --bin ",
      ShellQuote(options.binary_dir), " --prefill-args ",
      ShellQuote(absl::StrCat(options.worker_args, " ", options.prefill_args)), " --decode-args ",
      ShellQuote(absl::StrCat(options.worker_args, " ", options.decode_args)), " --router-args ",
      ShellQuote(options.router_args));
  if (options.cpu_share > 0) {
    absl::StrAppend(&command, " --cpu-share ", absl::StrFormat("%g", options.cpu_share));
  }
  if (!options.routing.empty()) absl::StrAppend(&command, " --routing ", ShellQuote(options.routing));
  std::unique_ptr<ClusterLauncher> cluster(new ClusterLauncher(launcher, options.dir));
  std::string output;
  if (RunShell(command, &output) != 0) {
    return absl::UnavailableError(
        absl::StrCat("the cluster did not start (", command, "): ", output));
  }
  cluster->grpc_address_ = absl::StrCat("127.0.0.1:", ReadLine(options.dir + "/router.port"));
  cluster->http_address_ =
      absl::StrCat("127.0.0.1:", ReadLine(options.dir + "/router.http_port"));
  return cluster;
}

absl::StatusOr<int> ClusterLauncher::Pid(const std::string& process) const {
  const std::string path = absl::StrCat(dir_, "/", process, ".pid");
  int pid = 0;
  if (!absl::SimpleAtoi(ReadLine(path), &pid) || pid <= 0) {
    return absl::NotFoundError(absl::StrCat("the cluster has no process '", process, "' (no pid in ",
                                            path, ")"));
  }
  return pid;
}

absl::StatusOr<double> ClusterLauncher::MetricSum(const std::string& process,
                                                  const std::string& metric,
                                                  const std::string& label) const {
  PD_ASSIGN_OR_RETURN(const std::vector<double> sums, MetricSums(process, {metric}, label));
  return sums.front();
}

absl::StatusOr<std::vector<double>> ClusterLauncher::MetricSums(
    const std::string& process, const std::vector<std::string>& metrics,
    const std::string& label) const {
  PD_RETURN_IF_ERROR(Pid(process).status());
  int port = 0;
  const std::string port_file = absl::StrCat(dir_, "/", process, ".metrics_port");
  if (!absl::SimpleAtoi(ReadLine(port_file), &port) || port <= 0 || port > 65535) {
    return absl::NotFoundError(absl::StrCat("no metrics port in ", port_file));
  }
  PD_ASSIGN_OR_RETURN(const std::string page, LocalHttpGet(port, "/metrics"));
  std::vector<double> sums;
  for (const std::string& metric : metrics) {
    absl::StatusOr<std::optional<double>> sum = SumOfSamples(page, metric, label);
    if (!sum.ok()) {
      return absl::UnavailableError(
          absl::StrCat(process, "'s /metrics has ", sum.status().message()));
    }
    sums.push_back(sum->value_or(0));
  }
  return sums;
}

ClusterLauncher::~ClusterLauncher() {
  RunShell(absl::StrCat(ShellQuote(launcher_), " down --dir ", ShellQuote(dir_)), nullptr);
}

}  // namespace pdserve::planner
