// pd-http-bench: how many concurrent Server-Sent-Events streams an HTTP
// front end holds on this machine, and what each costs in memory and CPU.
//
//   pd-http-bench --mode=server --server=beast   the router's HttpServer alone
//   pd-http-bench --mode=server --server=httplib cpp-httplib, for the choice
//   pd-http-bench --mode=router                  the real pd-router binary,
//                 in front of a fake decode worker process (no model) that
//                 streams --events tokens per request, one per --interval_ms
//
// The load comes from another process (this binary, --role=client): one
// epoll loop opening --streams connections at once, each POSTing a streamed
// request and reading its events to "data: [DONE]". The server's memory is
// its resident set at the peak minus before the streams; its CPU is user +
// system time over the run; both divided per stream (and per event).
// "Most open at once" counts the streams that had their first event and not
// yet their last at one moment: the streams truly held together.
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/bench_process.h"
#include "bench/timed_decode_worker.h"
#include "httplib.h"
#include "common/process.h"
#include "common/http_server.h"

ABSL_FLAG(std::string, mode, "server", "server (an HTTP server alone) or router");
ABSL_FLAG(std::string, server, "beast", "--mode=server: beast or httplib");
ABSL_FLAG(int32_t, streams, 2000, "Concurrent SSE streams");
ABSL_FLAG(int32_t, events, 20, "Events (tokens) per stream");
ABSL_FLAG(int32_t, interval_ms, 100, "Time between a stream's events");
ABSL_FLAG(std::string, role, "", "internal: client or fake-decode");
ABSL_FLAG(int32_t, port, 0, "internal: the port the client connects to");
ABSL_FLAG(std::string, router_binary, "",
          "--mode=router: pd-router (default: router/pd-router beside the "
          "bench's build directory)");

namespace pdserve {
namespace {

namespace fs = std::filesystem;

// ---- client role -------------------------------------------------------

struct Stream {
  int fd = -1;
  std::string out;  // Request bytes not yet sent.
  std::string in;   // Response bytes not yet scanned.
  int events = 0;
  bool done = false;
  absl::Time started, first_event;
};

int RunClient(int port, int num_streams, int events) {
  RaiseOpenFileLimit();
  const std::string body = absl::StrCat(
      R"({"prompt": "Hi", "max_tokens": )", events,
      R"(, "stream": true, "ignore_eos": true, "temperature": 0})");
  const std::string request = absl::StrCat(
      "POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: "
      "application/json\r\nContent-Length: ",
      body.size(), "\r\n\r\n", body);
  const int ep = epoll_create1(0);
  std::vector<Stream> streams(num_streams);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const absl::Time begin = absl::Now();
  for (int i = 0; i < num_streams; ++i) {
    Stream& s = streams[i];
    s.fd = socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK, 0);
    connect(s.fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    s.out = request;
    s.started = absl::Now();
    epoll_event ev{};
    ev.events = EPOLLIN | EPOLLOUT;
    ev.data.u32 = i;
    epoll_ctl(ep, EPOLL_CTL_ADD, s.fd, &ev);
  }
  int finished = 0, failed = 0, open_now = 0, max_open = 0;
  std::vector<double> ttfe_ms;
  std::vector<epoll_event> ready(1024);
  char buf[65536];
  const absl::Time give_up = absl::Now() + absl::Minutes(5);
  while (finished + failed < num_streams && absl::Now() < give_up) {
    const int n = epoll_wait(ep, ready.data(), ready.size(), 1000);
    for (int k = 0; k < n; ++k) {
      Stream& s = streams[ready[k].data.u32];
      if (s.done) continue;
      if ((ready[k].events & EPOLLOUT) && !s.out.empty()) {
        const ssize_t w = send(s.fd, s.out.data(), s.out.size(), MSG_NOSIGNAL);
        if (w > 0) s.out.erase(0, w);
        if (s.out.empty()) {
          epoll_event ev{};
          ev.events = EPOLLIN;
          ev.data.u32 = ready[k].data.u32;
          epoll_ctl(ep, EPOLL_CTL_MOD, s.fd, &ev);
        }
      }
      if (!(ready[k].events & (EPOLLIN | EPOLLHUP | EPOLLERR))) continue;
      const ssize_t r = recv(s.fd, buf, sizeof(buf), 0);
      if (r <= 0) {
        if (r < 0 && errno == EAGAIN) continue;
        std::cerr << "connection ended after " << s.events << " events: "
                  << (r == 0 ? "closed" : strerror(errno)) << "\n";
        s.done = true;
        ++failed;
        if (s.events > 0) --open_now;
        close(s.fd);
        continue;
      }
      s.in.append(buf, r);
      size_t pos;
      while ((pos = s.in.find("data: ")) != std::string::npos) {
        const size_t end = s.in.find("\n\n", pos);
        if (end == std::string::npos) break;
        const bool last = s.in.compare(pos, 12, "data: [DONE]") == 0;
        s.in.erase(0, end + 2);
        if (s.events++ == 0) {
          s.first_event = absl::Now();
          ttfe_ms.push_back(
              absl::ToDoubleMilliseconds(s.first_event - s.started));
          max_open = std::max(max_open, ++open_now);
        }
        if (last) {
          s.done = true;
          ++finished;
          --open_now;
          close(s.fd);
          break;
        }
      }
      if (!s.done && s.events == 0 && s.in.size() >= 12 &&
          s.in.compare(0, 12, "HTTP/1.1 200") != 0) {  // Refused (429...).
        std::cerr << "refused: " << s.in.substr(0, s.in.find('\r')) << " "
                  << s.in.substr(s.in.find("\r\n\r\n") + 4, 200) << "\n";
        s.done = true;
        ++failed;
        close(s.fd);
      }
    }
  }
  std::sort(ttfe_ms.begin(), ttfe_ms.end());
  auto pct = [&](double p) {
    return ttfe_ms.empty() ? 0.0
                           : ttfe_ms[std::min<size_t>(
                                 ttfe_ms.size() - 1, p * ttfe_ms.size())];
  };
  std::cout << finished << " " << failed << " " << max_open << " " << pct(0.5)
            << " " << pct(0.99) << " "
            << absl::ToDoubleSeconds(absl::Now() - begin) << std::endl;
  return 0;
}

// ---- measurement --------------------------------------------------------

using bench::ProcessSample;
using bench::ReadLine;
using bench::Spawn;

struct ClientResult {
  int finished = 0, failed = 0, max_open = 0;
  double ttfe_p50_ms = 0, ttfe_p99_ms = 0, seconds = 0;
};

// Runs the load against `port` while sampling `server_pid` every 20 ms.
ClientResult RunLoad(int port, pid_t server_pid, ProcessSample* before,
                     ProcessSample* after, double* peak_rss_mib) {
  *before = bench::SampleProcess(server_pid);
  int out_fd = -1;
  const pid_t client = Spawn(
      {fs::read_symlink("/proc/self/exe").string(), "--role=client",
       absl::StrCat("--port=", port),
       absl::StrCat("--streams=", absl::GetFlag(FLAGS_streams)),
       absl::StrCat("--events=", absl::GetFlag(FLAGS_events))},
      &out_fd);
  std::atomic<bool> done{false};
  double peak = before->rss_mib;
  std::thread sampler([&] {
    while (!done.load()) {
      peak = std::max(peak, bench::SampleProcess(server_pid).rss_mib);
      absl::SleepFor(absl::Milliseconds(20));
    }
  });
  std::istringstream line(ReadLine(out_fd));
  int status = 0;
  waitpid(client, &status, 0);
  done = true;
  sampler.join();
  close(out_fd);
  *after = bench::SampleProcess(server_pid);
  *peak_rss_mib = peak;
  ClientResult r;
  line >> r.finished >> r.failed >> r.max_open >> r.ttfe_p50_ms >>
      r.ttfe_p99_ms >> r.seconds;
  return r;
}

void Report(absl::string_view what, const ClientResult& r,
            const ProcessSample& before, const ProcessSample& after,
            double peak_rss_mib) {
  const int n = absl::GetFlag(FLAGS_streams);
  const int events = absl::GetFlag(FLAGS_events);
  const double cpu = after.cpu_seconds - before.cpu_seconds;
  const double mem = peak_rss_mib - before.rss_mib;
  std::cout << absl::StrFormat(
      "| %s | %d | %d / %d | %d | %.0f / %.0f ms | %.1f s | %.1f MiB "
      "(%.1f KiB/stream) | %.2f s (%.0f us/stream, %.1f us/event) | %.0f%% "
      "|\n",
      what, n, r.finished, r.failed, r.max_open, r.ttfe_p50_ms, r.ttfe_p99_ms,
      r.seconds, mem, mem * 1024.0 / n, cpu, cpu * 1e6 / n,
      cpu * 1e6 / (static_cast<double>(n) * (events + 1)),
      100.0 * cpu / (r.seconds * std::thread::hardware_concurrency()));
}

void PrintHeader() {
  std::cout << absl::StrFormat(
      "\n%d streams x %d events, one every %d ms\n\n"
      "| server | streams | finished / failed | most open at once | first "
      "event p50 / p99 | wall | server memory | server CPU | of the "
      "machine's CPU time |\n"
      "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
      absl::GetFlag(FLAGS_streams), absl::GetFlag(FLAGS_events),
      absl::GetFlag(FLAGS_interval_ms));
}

// Streams `events` events to every exchange, one tick every interval, from
// one thread: the model of decode workers feeding a front end.
class Ticker {
 public:
  void Add(std::shared_ptr<HttpExchange> exchange) {
    exchange->StartEvents();
    absl::MutexLock lock(&mu_);
    streams_.push_back({std::move(exchange), 0});
  }
  void Run(std::atomic<bool>& stop) {
    const int events = absl::GetFlag(FLAGS_events);
    const std::string chunk =
        R"({"id":"cmpl-bench","object":"text_completion","choices":[{"index":0,"text":" word","logprobs":null,"finish_reason":null}]})";
    while (!stop.load()) {
      absl::SleepFor(absl::Milliseconds(absl::GetFlag(FLAGS_interval_ms)));
      absl::MutexLock lock(&mu_);
      for (auto& [exchange, sent] : streams_) {
        if (sent < events) exchange->SendEvent(chunk);
        if (++sent == events) {
          exchange->SendEvent("[DONE]");
          exchange->EndEvents();
        }
      }
      streams_.erase(std::remove_if(streams_.begin(), streams_.end(),
                                    [&](const auto& s) {
                                      return s.second >= events;
                                    }),
                     streams_.end());
    }
  }

 private:
  absl::Mutex mu_;
  std::vector<std::pair<std::shared_ptr<HttpExchange>, int>> streams_
      ABSL_GUARDED_BY(mu_);
};

int RunServerMode() {
  const std::string which = absl::GetFlag(FLAGS_server);
  PrintHeader();
  ClientResult r;
  ProcessSample before, after;
  double peak = 0;
  if (which == "beast") {
    Ticker ticker;
    std::atomic<bool> stop{false};
    std::thread tick([&] { ticker.Run(stop); });
    auto server = HttpServer::Start(
        HttpServer::Options{}, [&](HttpRequest, std::shared_ptr<HttpExchange> e) {
          ticker.Add(std::move(e));
        });
    if (!server.ok()) {
      std::cerr << server.status() << "\n";
      return 1;
    }
    r = RunLoad((*server)->port(), getpid(), &before, &after, &peak);
    stop = true;
    tick.join();
    Report("Boost.Beast (common/http_server.h), 2 threads", r, before, after,
           peak);
  } else if (which == "httplib") {
    httplib::Server server;
    const int events = absl::GetFlag(FLAGS_events);
    const auto interval =
        std::chrono::milliseconds(absl::GetFlag(FLAGS_interval_ms));
    server.Post("/v1/completions", [&](const httplib::Request&,
                                       httplib::Response& res) {
      res.set_chunked_content_provider(
          "text/event-stream", [events, interval](size_t, httplib::DataSink& sink) {
            const std::string chunk =
                R"(data: {"id":"cmpl-bench","object":"text_completion","choices":[{"index":0,"text":" word","logprobs":null,"finish_reason":null}]})"
                "\n\n";
            for (int i = 0; i < events; ++i) {
              std::this_thread::sleep_for(interval);
              if (!sink.write(chunk.data(), chunk.size())) return false;
            }
            sink.write("data: [DONE]\n\n", 14);
            sink.done();
            return true;
          });
    });
    const int port = server.bind_to_any_port("127.0.0.1");
    std::thread serve([&] { server.listen_after_bind(); });
    r = RunLoad(port, getpid(), &before, &after, &peak);
    server.stop();
    serve.join();
    Report(absl::StrCat("cpp-httplib ", CPPHTTPLIB_VERSION,
                        ", its default thread pool"),
           r, before, after, peak);
  } else {
    std::cerr << "--server must be beast or httplib\n";
    return 2;
  }
  return 0;
}

int RunRouterMode() {
  const fs::path self = fs::read_symlink("/proc/self/exe");
  std::string router = absl::GetFlag(FLAGS_router_binary);
  if (router.empty()) {
    router = (self.parent_path().parent_path() / "router/pd-router").string();
  }
  int fake_fd = -1;
  const pid_t fake = Spawn(
      {self.string(), "--role=fake-decode",
       absl::StrCat("--interval_ms=", absl::GetFlag(FLAGS_interval_ms))},
      &fake_fd);
  const std::string fake_address = ReadLine(fake_fd);
  const fs::path dir = fs::temp_directory_path() /
                       absl::StrCat("pd-http-bench-", getpid());
  fs::create_directories(dir);
  std::ofstream(dir / "cluster.json")
      << R"({"model": "builtin:tiny", "decode_workers": [{"id": "fake-0", "address": ")"
      << fake_address << "\"}]}";
  int router_fd = -1;
  const pid_t router_pid = Spawn(
      {router, absl::StrCat("--config=", (dir / "cluster.json").string()),
       absl::StrCat("--http_port_file=", (dir / "http.port").string()),
       absl::StrCat("--port_file=", (dir / "grpc.port").string())},
      &router_fd);
  for (int i = 0; i < 300 && !fs::exists(dir / "grpc.port"); ++i) {
    absl::SleepFor(absl::Milliseconds(100));
  }
  absl::SleepFor(absl::Milliseconds(500));  // The worker's first report.
  int port = 0;
  std::ifstream(dir / "http.port") >> port;
  PrintHeader();
  ProcessSample before, after;
  double peak = 0;
  const ClientResult r = RunLoad(port, router_pid, &before, &after, &peak);
  Report("pd-router, fake decode", r, before, after, peak);
  kill(router_pid, SIGTERM);
  kill(fake, SIGKILL);
  waitpid(router_pid, nullptr, 0);
  waitpid(fake, nullptr, 0);
  fs::remove_all(dir);
  return 0;
}

}  // namespace
}  // namespace pdserve

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  signal(SIGPIPE, SIG_IGN);
  const std::string role = absl::GetFlag(FLAGS_role);
  if (role == "client") {
    return pdserve::RunClient(absl::GetFlag(FLAGS_port),
                              absl::GetFlag(FLAGS_streams),
                              absl::GetFlag(FLAGS_events));
  }
  if (role == "fake-decode") {
    return pdserve::bench::RunTimedDecodeWorker(
        absl::Milliseconds(absl::GetFlag(FLAGS_interval_ms)));
  }
  pdserve::RaiseOpenFileLimit();
  const std::string mode = absl::GetFlag(FLAGS_mode);
  if (mode == "server") return pdserve::RunServerMode();
  if (mode == "router") return pdserve::RunRouterMode();
  std::cerr << "--mode must be server or router\n";
  return 2;
}
