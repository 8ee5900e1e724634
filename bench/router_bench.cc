// pd-router-bench: how many concurrent Generate streams the router holds on
// this machine, what routing costs in CPU per request and per relayed
// token and in memory per held stream, and the latency it adds, measured in
// the same run against streams straight to the decode worker.
//
//   pd-router-bench [--streams=10000] [--tokens=32] [--token_interval_ms=500]
//                   [--ramp_per_s=2000] [--channels=16] [--reps=1]
//
// Three processes:
//  - a fake decode worker (this binary, --role=fake-decode): no model; each
//    Decode call streams max_tokens script tokens, the first at once and
//    token i at i x --token_interval_ms after the call arrived, every
//    stream driven by one timer thread through gRPC's callback API;
//  - the real pd-router (a cluster of that decode worker alone, so every
//    prompt is prefilled "on the decode worker"; its KV pool is far larger
//    than the load, so admission never queues);
//  - the load, from this process: one ClientReadReactor per stream, spread
//    over --channels HTTP/2 connections, opened at --ramp_per_s.
//
// Each repetition runs three phases of --streams streams:
//   direct    Decode on the fake worker (pdserve.internal.v1), --tokens each
//   routed    Generate on the router (pdserve.v1, token-id prompts,
//             ignore_eos, max_tokens --tokens)
//   routed-1  the same with max_tokens 1: setup with almost no relaying
// For token i of a stream, its latency is L_i = arrival - start -
// i x interval (what the client waited beyond the worker's schedule); TTFT
// is L_0. "Added" is routed minus direct. The router's CPU (user + system,
// /proc) over a routed phase, less its idle rate over the direct phase,
// is divided by the phase's requests and relayed tokens ("raw": each ratio
// charges the whole CPU to one unit), and the two routed phases give a
// two-point fit cpu = a x requests + b x tokens (a: per request, b: per
// token). Memory per stream: the router's peak resident set in the routed
// phase minus before it, over the most streams it held at once. "Held" is
// streams that had their first token and not yet their end.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <queue>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "bench/bench_process.h"
#include "bench/timed_decode_worker.h"
#include "common/grpc_server.h"
#include "common/process.h"
#include "grpcpp/grpcpp.h"
#include "pdserve/internal/v1/worker.grpc.pb.h"
#include "pdserve/v1/generation.grpc.pb.h"

ABSL_FLAG(int32_t, streams, 10000, "Streams per phase, all held at once");
ABSL_FLAG(int32_t, tokens, 32, "Tokens per stream (max_tokens)");
ABSL_FLAG(int32_t, token_interval_ms, 500,
          "The fake decode worker's time between a stream's tokens");
ABSL_FLAG(int32_t, ramp_per_s, 2000, "Streams opened per second");
ABSL_FLAG(int32_t, channels, 16,
          "HTTP/2 connections the load spreads its streams over");
ABSL_FLAG(int32_t, reps, 1, "Repetitions of the three phases (medians)");
ABSL_FLAG(std::string, router_binary, "",
          "pd-router (default: router/pd-router beside the bench's build "
          "directory)");
ABSL_FLAG(std::string, role, "", "internal: fake-decode");

namespace pdserve {
namespace {

namespace fs = std::filesystem;
namespace wire = ::pdserve::internal::v1;

// ---- load ------------------------------------------------------------------

// What the streams of one phase share.
struct PhaseCounters {
  std::atomic<int> started{0}, held{0}, max_held{0}, completed{0}, failed{0};
  std::atomic<int64_t> tokens{0};

  absl::Mutex mu;
  std::vector<float> ttft_us ABSL_GUARDED_BY(mu);
  std::vector<float> token_us ABSL_GUARDED_BY(mu);
  std::vector<std::string> errors ABSL_GUARDED_BY(mu);  // The first few.
  int error_count ABSL_GUARDED_BY(mu) = 0;
};

int TokenCount(const wire::DecodeResponse& r) { return r.tokens_size(); }
int TokenCount(const v1::GenerateResponse& r) { return r.token_ids_size(); }

// One stream of the load: records each token's latency against the fake
// worker's schedule, and deletes itself when the call is done.
template <typename Request, typename Response>
class LoadStream final : public grpc::ClientReadReactor<Response> {
 public:
  LoadStream(PhaseCounters* counters, int tokens, absl::Duration interval,
             absl::Time deadline)
      : counters_(counters), tokens_(tokens), interval_(interval) {
    latencies_us_.reserve(tokens);
    context_.set_deadline(absl::ToChronoTime(deadline));
  }

  grpc::ClientContext* context() { return &context_; }
  // Filled before the stub's async() call; lives as long as the call.
  Request* request() { return &request_; }

  // After the stub's async() call attached this reactor.
  void Go() {
    start_ = absl::Now();
    counters_->started.fetch_add(1, std::memory_order_relaxed);
    this->StartRead(&response_);
    this->StartCall();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // OnDone follows.
    const absl::Time now = absl::Now();
    const int n = TokenCount(response_);
    if (received_ == 0 && n > 0) {
      const int held = counters_->held.fetch_add(1) + 1;
      int max = counters_->max_held.load();
      while (held > max && !counters_->max_held.compare_exchange_weak(max, held)) {
      }
    }
    for (int i = 0; i < n; ++i, ++received_) {
      latencies_us_.push_back(static_cast<float>(
          absl::ToDoubleMicroseconds(now - start_ - received_ * interval_)));
    }
    response_.Clear();
    this->StartRead(&response_);
  }

  void OnDone(const grpc::Status& status) override {
    if (received_ > 0) counters_->held.fetch_sub(1);
    counters_->tokens.fetch_add(received_);
    const bool ok = status.ok() && received_ == tokens_;
    (ok ? counters_->completed : counters_->failed).fetch_add(1);
    {
      absl::MutexLock lock(&counters_->mu);
      if (!latencies_us_.empty()) {
        counters_->ttft_us.push_back(latencies_us_[0]);
      }
      counters_->token_us.insert(counters_->token_us.end(),
                                 latencies_us_.begin(), latencies_us_.end());
      if (!ok && ++counters_->error_count <= 5) {
        counters_->errors.push_back(absl::StrCat(
            "code ", status.error_code(), " '", status.error_message(),
            "' after ", received_, " of ", tokens_, " tokens"));
      }
    }
    delete this;
  }

 private:
  PhaseCounters* const counters_;
  const int tokens_;
  const absl::Duration interval_;
  grpc::ClientContext context_;
  Request request_;
  Response response_;
  absl::Time start_;
  int received_ = 0;
  std::vector<float> latencies_us_;
};

// `count` channels to `address`, each its own HTTP/2 connection (distinct
// arguments keep gRPC from sharing one subchannel), connected.
std::vector<std::shared_ptr<grpc::Channel>> Connect(const std::string& address,
                                                    int count) {
  std::vector<std::shared_ptr<grpc::Channel>> channels;
  for (int i = 0; i < count; ++i) {
    grpc::ChannelArguments args;
    args.SetInt(GRPC_ARG_USE_LOCAL_SUBCHANNEL_POOL, 1);
    args.SetInt("pdserve.bench.channel", i);
    channels.push_back(grpc::CreateCustomChannel(
        address, grpc::InsecureChannelCredentials(), args));
    if (!channels.back()->WaitForConnected(
            absl::ToChronoTime(absl::Now() + absl::Seconds(10)))) {
      std::cerr << "cannot connect to " << address << "\n";
    }
  }
  return channels;
}

double Percentile(std::vector<float>& v, double p) {
  if (v.empty()) return 0;
  const size_t k = std::min<size_t>(v.size() - 1, p * v.size());
  std::nth_element(v.begin(), v.begin() + k, v.end());
  return v[k];
}

struct PhaseResult {
  std::string name;
  int streams = 0, tokens = 0;
  int completed = 0, failed = 0, max_held = 0;
  int64_t relayed = 0;  // Tokens the client received.
  double seconds = 0;
  // Microseconds.
  double ttft_p50 = 0, ttft_p99 = 0, token_p50 = 0, token_p99 = 0;
  bench::ProcessSample router_before, router_after, fake_before, fake_after,
      load_before, load_after;
  double router_peak_rss_mib = 0;
  double router_cpu() const {
    return router_after.cpu_seconds - router_before.cpu_seconds;
  }
  double fake_cpu() const {
    return fake_after.cpu_seconds - fake_before.cpu_seconds;
  }
  double load_cpu() const {  // This process: the load generator.
    return load_after.cpu_seconds - load_before.cpu_seconds;
  }
  std::vector<std::string> errors;
};

// Starts stream `i` of a phase of `tokens` tokens per stream; the stream
// reports to `counters` and deletes itself.
using StartStream = std::function<void(int i, int tokens,
                                       PhaseCounters* counters,
                                       absl::Time deadline)>;

PhaseResult RunPhase(const std::string& name, int tokens,
                     const StartStream& start, pid_t router, pid_t fake) {
  const int n = absl::GetFlag(FLAGS_streams);
  const absl::Duration interval =
      absl::Milliseconds(absl::GetFlag(FLAGS_token_interval_ms));
  const double ramp_per_s = absl::GetFlag(FLAGS_ramp_per_s);
  const absl::Duration ramp = absl::Seconds(n / ramp_per_s);
  const absl::Duration give_up_after =
      ramp + interval * (tokens - 1) + absl::Seconds(120);

  PhaseResult r;
  r.name = name;
  r.streams = n;
  r.tokens = tokens;
  PhaseCounters counters;
  r.router_before = bench::SampleProcess(router);
  r.fake_before = bench::SampleProcess(fake);
  r.load_before = bench::SampleProcess(getpid());
  std::atomic<bool> sampling{true};
  std::atomic<double> peak_rss{r.router_before.rss_mib};
  std::thread sampler([&] {
    while (sampling.load()) {
      peak_rss = std::max(peak_rss.load(), bench::SampleProcess(router).rss_mib);
      absl::SleepFor(absl::Milliseconds(20));
    }
  });
  const absl::Time begin = absl::Now();
  const absl::Time deadline = begin + give_up_after;
  absl::Time next_progress = begin + absl::Seconds(1);
  auto progress = [&](absl::Time now) {
    if (now < next_progress) return;
    next_progress = now + absl::Seconds(1);
    std::cerr << absl::StrFormat(
        "  %-8s %5.1f s: opened %d, held %d (most %d), done %d, failed %d, "
        "router RSS %.0f MiB\n",
        name, absl::ToDoubleSeconds(now - begin), counters.started.load(),
        counters.held.load(), counters.max_held.load(),
        counters.completed.load(), counters.failed.load(), peak_rss.load());
  };
  for (int i = 0; i < n; ++i) {
    const absl::Time due = begin + absl::Seconds(i / ramp_per_s);
    absl::Time now = absl::Now();
    if (now < due) {
      absl::SleepFor(due - now);
      now = absl::Now();
    }
    start(i, tokens, &counters, deadline);
    progress(now);
  }
  while (counters.completed.load() + counters.failed.load() < n &&
         absl::Now() < deadline + absl::Seconds(5)) {
    absl::SleepFor(absl::Milliseconds(50));
    progress(absl::Now());
  }
  r.seconds = absl::ToDoubleSeconds(absl::Now() - begin);
  sampling = false;
  sampler.join();
  r.router_after = bench::SampleProcess(router);
  r.fake_after = bench::SampleProcess(fake);
  r.load_after = bench::SampleProcess(getpid());
  r.router_peak_rss_mib = peak_rss.load();
  r.completed = counters.completed.load();
  r.failed = counters.failed.load();
  r.max_held = counters.max_held.load();
  r.relayed = counters.tokens.load();
  absl::MutexLock lock(&counters.mu);
  r.ttft_p50 = Percentile(counters.ttft_us, 0.5);
  r.ttft_p99 = Percentile(counters.ttft_us, 0.99);
  r.token_p50 = Percentile(counters.token_us, 0.5);
  r.token_p99 = Percentile(counters.token_us, 0.99);
  r.errors = counters.errors;
  if (counters.error_count > 0) {
    std::cerr << "  " << name << ": " << counters.error_count
              << " streams failed; the first:\n";
    for (const std::string& e : r.errors) std::cerr << "    " << e << "\n";
  }
  return r;
}

// What one repetition measured, derived from its three phases.
struct RepFigures {
  PhaseResult direct, routed, routed1;
  double idle_cpu_per_s = 0;  // The router's, over the direct phase.
  // The router's CPU over a routed phase less its idle rate, seconds.
  double cpu_routed = 0, cpu_routed1 = 0;
  // Microseconds: raw ratios of the routed phase, and the two-point fit.
  double raw_us_per_request = 0, raw_us_per_token = 0;
  double fit_us_per_request = 0, fit_us_per_token = 0;
  double rss_idle_mib = 0, rss_peak_mib = 0, kib_per_stream = 0;
};

RepFigures Derive(PhaseResult direct, PhaseResult routed,
                  PhaseResult routed1) {
  RepFigures f;
  f.idle_cpu_per_s = direct.router_cpu() / direct.seconds;
  f.cpu_routed = routed.router_cpu() - f.idle_cpu_per_s * routed.seconds;
  f.cpu_routed1 = routed1.router_cpu() - f.idle_cpu_per_s * routed1.seconds;
  f.raw_us_per_request = f.cpu_routed * 1e6 / routed.streams;
  f.raw_us_per_token =
      f.cpu_routed * 1e6 / std::max<int64_t>(1, routed.relayed);
  // cpu = a x requests + b x tokens, through both routed phases.
  const double r1 = routed.streams, t1 = routed.relayed;
  const double r2 = routed1.streams, t2 = routed1.relayed;
  const double det = r1 * t2 - r2 * t1;
  if (det != 0) {
    f.fit_us_per_request = (f.cpu_routed * t2 - f.cpu_routed1 * t1) / det * 1e6;
    f.fit_us_per_token = (r1 * f.cpu_routed1 - r2 * f.cpu_routed) / det * 1e6;
  }
  f.rss_idle_mib = routed.router_before.rss_mib;
  f.rss_peak_mib = routed.router_peak_rss_mib;
  f.kib_per_stream = (f.rss_peak_mib - f.rss_idle_mib) * 1024.0 /
                     std::max(1, routed.max_held);
  f.direct = std::move(direct);
  f.routed = std::move(routed);
  f.routed1 = std::move(routed1);
  return f;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

// The median over repetitions of `get`.
double MedianOf(const std::vector<RepFigures>& reps,
                const std::function<double(const RepFigures&)>& get) {
  std::vector<double> v;
  for (const RepFigures& f : reps) v.push_back(get(f));
  return Median(v);
}

void PrintPhaseTable(const std::vector<RepFigures>& reps) {
  std::cout << "\n| rep | phase | streams x tokens | completed / failed | "
               "most held at once | TTFT p50 / p99 | token latency p50 / p99 "
               "| wall | router CPU | router RSS before / peak | fake worker "
               "CPU | load CPU |\n"
               "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (size_t i = 0; i < reps.size(); ++i) {
    for (const PhaseResult* p :
         {&reps[i].direct, &reps[i].routed, &reps[i].routed1}) {
      std::cout << absl::StrFormat(
          "| %d | %s | %d x %d | %d / %d | %d | %.2f / %.2f ms | %.2f / "
          "%.2f ms | %.1f s | %.2f s | %.0f / %.0f MiB | %.2f s | %.2f s |\n",
          i + 1, p->name, p->streams, p->tokens, p->completed, p->failed,
          p->max_held, p->ttft_p50 / 1e3, p->ttft_p99 / 1e3,
          p->token_p50 / 1e3, p->token_p99 / 1e3, p->seconds,
          p->router_cpu(), p->router_before.rss_mib, p->router_peak_rss_mib,
          p->fake_cpu(), p->load_cpu());
    }
  }
}

void PrintSummary(const std::vector<RepFigures>& reps) {
  auto med = [&](const std::function<double(const RepFigures&)>& get) {
    return MedianOf(reps, get);
  };
  const double added_ttft_p50 =
      med([](const RepFigures& f) { return f.routed.ttft_p50 - f.direct.ttft_p50; });
  const double added_ttft_p99 =
      med([](const RepFigures& f) { return f.routed.ttft_p99 - f.direct.ttft_p99; });
  const double added_token_p50 = med(
      [](const RepFigures& f) { return f.routed.token_p50 - f.direct.token_p50; });
  const double added_token_p99 = med(
      [](const RepFigures& f) { return f.routed.token_p99 - f.direct.token_p99; });
  const double fit_req = med([](const RepFigures& f) { return f.fit_us_per_request; });
  const double fit_tok = med([](const RepFigures& f) { return f.fit_us_per_token; });
  const double raw_req = med([](const RepFigures& f) { return f.raw_us_per_request; });
  const double raw_tok = med([](const RepFigures& f) { return f.raw_us_per_token; });
  const double held = med([](const RepFigures& f) { return f.routed.max_held; });
  const double kib = med([](const RepFigures& f) { return f.kib_per_stream; });
  std::cout << absl::StrFormat(
      "\nMedians of %d repetition(s):\n\n"
      "| figure | measured | target | measured / target |\n"
      "|---|---:|---:|---:|\n"
      "| routed streams held at once (of %d) | %.0f | 10000 | %.2f |\n"
      "| router CPU per request, fit (routing + setup) | %.1f us | 100 us | %.2f |\n"
      "| router CPU per relayed token, fit | %.2f us | 10 us | %.2f |\n"
      "| router CPU per request, raw (all CPU of the %d-token phase / requests) | %.1f us | | |\n"
      "| router CPU per relayed token, raw (all CPU / tokens) | %.2f us | | |\n"
      "| router memory per held stream | %.1f KiB | | |\n"
      "| TTFT added, p50 | %.3f ms | 1 ms | %.2f |\n"
      "| TTFT added, p99 | %.3f ms | | |\n"
      "| per-token latency added, p50 | %.3f ms | | |\n"
      "| per-token latency added, p99 | %.3f ms | | |\n"
      "| router idle CPU (load polling) | %.2f%% of a core | | |\n",
      static_cast<int>(reps.size()), absl::GetFlag(FLAGS_streams), held,
      held / 10000.0, fit_req, fit_req / 100.0, fit_tok, fit_tok / 10.0,
      absl::GetFlag(FLAGS_tokens), raw_req, raw_tok, kib,
      added_ttft_p50 / 1e3, added_ttft_p50 / 1e3, added_ttft_p99 / 1e3,
      added_token_p50 / 1e3, added_token_p99 / 1e3,
      100 * med([](const RepFigures& f) { return f.idle_cpu_per_s; }));
}

int RunBench() {
  RaiseOpenFileLimit();
  const fs::path self = bench::SelfExe();
  std::string router_binary = absl::GetFlag(FLAGS_router_binary);
  if (router_binary.empty()) {
    router_binary =
        (self.parent_path().parent_path() / "router/pd-router").string();
  }
  const int n = absl::GetFlag(FLAGS_streams);
  const int tokens = absl::GetFlag(FLAGS_tokens);
  const int interval_ms = absl::GetFlag(FLAGS_token_interval_ms);
  if (n < 1 || tokens < 2 || interval_ms < 1 ||
      absl::GetFlag(FLAGS_ramp_per_s) < 1 || absl::GetFlag(FLAGS_channels) < 1) {
    std::cerr << "need --streams >= 1, --tokens >= 2, --token_interval_ms, "
                 "--ramp_per_s and --channels >= 1\n";
    return 2;
  }

  int fake_fd = -1;
  const pid_t fake =
      bench::Spawn({self.string(), "--role=fake-decode",
                    absl::StrCat("--token_interval_ms=", interval_ms)},
                   &fake_fd);
  const std::string fake_address = bench::ReadLine(fake_fd);
  const fs::path dir =
      fs::temp_directory_path() / absl::StrCat("pd-router-bench-", getpid());
  fs::create_directories(dir);
  std::ofstream(dir / "cluster.json")
      << R"({"model": "builtin:tiny", "decode_workers": [{"id": "fake-0", "address": ")"
      << fake_address << "\"}]}";
  if (fake_address.empty()) {
    std::cerr << "the fake decode worker did not start\n";
    kill(fake, SIGKILL);
    return 1;
  }

  std::cout << "pd-router-bench: " << n << " streams x " << tokens
            << " tokens, one every " << interval_ms << " ms, opened at "
            << absl::GetFlag(FLAGS_ramp_per_s) << "/s over "
            << absl::GetFlag(FLAGS_channels) << " connections\n"
            << "machine: " << bench::MachineDescription() << "\n"
            << "cpu flags: " << bench::CpuFlagsLine() << "\n";

  const int channel_count = absl::GetFlag(FLAGS_channels);
  const auto direct_channels = Connect(fake_address, channel_count);
  const absl::Duration interval = absl::Milliseconds(interval_ms);
  const std::vector<int32_t> prompt = {72, 105, 33, 32};  // "Hi! "

  std::vector<std::unique_ptr<wire::DecodeWorker::Stub>> decode_stubs;
  for (const auto& c : direct_channels) {
    decode_stubs.push_back(wire::DecodeWorker::NewStub(c));
  }
  // The router of the current repetition.
  std::vector<std::unique_ptr<v1::Generation::Stub>> router_stubs;
  uint64_t next_id = 1;
  const StartStream direct = [&](int i, int max_tokens,
                                 PhaseCounters* counters, absl::Time deadline) {
    auto* stream = new LoadStream<wire::DecodeRequest, wire::DecodeResponse>(
        counters, max_tokens, interval, deadline);
    wire::EngineRequest* r = stream->request()->mutable_request();
    r->set_request_id(next_id++);
    r->mutable_prompt()->Assign(prompt.begin(), prompt.end());
    r->set_max_tokens(max_tokens);
    r->set_ignore_eos(true);
    r->set_seed(1);
    decode_stubs[i % decode_stubs.size()]->async()->Decode(
        stream->context(), stream->request(), stream);
    stream->Go();
  };
  const StartStream routed = [&](int i, int max_tokens,
                                 PhaseCounters* counters, absl::Time deadline) {
    auto* stream = new LoadStream<v1::GenerateRequest, v1::GenerateResponse>(
        counters, max_tokens, interval, deadline);
    v1::GenerateRequest* r = stream->request();
    r->mutable_token_ids()->mutable_ids()->Assign(prompt.begin(),
                                                  prompt.end());
    r->set_max_tokens(max_tokens);
    r->set_ignore_eos(true);
    router_stubs[i % router_stubs.size()]->async()->Generate(
        stream->context(), stream->request(), stream);
    stream->Go();
  };

  std::vector<RepFigures> reps;
  for (int rep = 1; rep <= absl::GetFlag(FLAGS_reps); ++rep) {
    // A fresh router each repetition: its idle resident set is the one
    // before its first streams (an allocator keeps what it freed).
    fs::remove(dir / "grpc.port");
    int router_fd = -1;
    const pid_t router = bench::Spawn(
        {router_binary,
         absl::StrCat("--config=", (dir / "cluster.json").string()),
         "--http_listen=", absl::StrCat("--max_queued=", n),
         absl::StrCat("--port_file=", (dir / "grpc.port").string())},
        &router_fd);
    for (int i = 0; i < 300 && !fs::exists(dir / "grpc.port"); ++i) {
      absl::SleepFor(absl::Milliseconds(100));
    }
    int router_port = 0;
    std::ifstream(dir / "grpc.port") >> router_port;
    if (router_port == 0) {
      std::cerr << "the router did not start\n";
      kill(router, SIGKILL);
      kill(fake, SIGKILL);
      return 1;
    }
    absl::SleepFor(absl::Milliseconds(500));  // The worker's first report.
    router_stubs.clear();
    for (const auto& c : Connect(absl::StrCat("127.0.0.1:", router_port),
                                 channel_count)) {
      router_stubs.push_back(v1::Generation::NewStub(c));
    }
    std::cerr << "repetition " << rep << " (router pid " << router << ")\n";
    PhaseResult d = RunPhase("direct", tokens, direct, router, fake);
    PhaseResult r = RunPhase("routed", tokens, routed, router, fake);
    PhaseResult r1 = RunPhase("routed-1", 1, routed, router, fake);
    reps.push_back(Derive(std::move(d), std::move(r), std::move(r1)));
    router_stubs.clear();
    kill(router, SIGTERM);
    waitpid(router, nullptr, 0);
    close(router_fd);
  }
  PrintPhaseTable(reps);
  PrintSummary(reps);

  kill(fake, SIGKILL);
  waitpid(fake, nullptr, 0);
  close(fake_fd);
  fs::remove_all(dir);
  return 0;
}

}  // namespace
}  // namespace pdserve

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  signal(SIGPIPE, SIG_IGN);
  if (absl::GetFlag(FLAGS_role) == "fake-decode") {
    return pdserve::bench::RunTimedDecodeWorker(
        absl::Milliseconds(absl::GetFlag(FLAGS_token_interval_ms)));
  }
  return pdserve::RunBench();
}
