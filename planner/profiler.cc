#include "planner/profiler.h"

#include <algorithm>
#include <time.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <numeric>
#include <tuple>
#include <thread>

#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "client/pdserve_client.h"
#include "common/status_macros.h"
#include "engine/generator.h"
#include "engine/model.h"
#include "engine/model_runner.h"
#include "kv_transfer/transport.h"
#include "planner/cluster_launcher.h"
#include "planner/least_squares.h"
#include "planner/summary.h"

namespace pdserve::planner {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// Prompt tokens no earlier prompt of the run shares: lower-case letters
// from a counter (a byte-level tokenizer reads them as text).
std::vector<int32_t> FreshPrompt(int32_t length, uint64_t& counter) {
  std::vector<int32_t> prompt(length);
  uint64_t x = ++counter * 0x9E3779B97F4A7C15ull;
  for (int32_t& t : prompt) {
    x ^= x >> 29;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 32;
    t = 'a' + static_cast<int32_t>(x % 26);
  }
  return prompt;
}

// The engine of one worker, as EngineLoop::Start builds it.
struct Engine {
  std::unique_ptr<ModelRunner> runner;
  std::unique_ptr<Generator> generator;
  uint64_t next_id = 1;
  uint64_t prompts = 0;
  double cpu_share = 0;
};

absl::StatusOr<Engine> MakeEngine(const EngineProfileOptions& o, int32_t blocks) {
  Engine e;
  PD_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model, Model::Load(o.model));
  PD_ASSIGN_OR_RETURN(e.runner, CreateModelRunner(model, {.num_kv_blocks = blocks,
                                                          .block_size = o.block_size,
                                                          .num_threads = o.threads}));
  PD_ASSIGN_OR_RETURN(e.generator,
                      Generator::Create(e.runner.get(), {.max_batch_tokens = o.max_batch_tokens,
                                                         .max_running = o.max_running,
                                                         .enable_prefix_caching = false}));
  e.cpu_share = o.cpu_share;
  return e;
}

absl::Status AddRequest(Engine& e, int32_t prompt_len, int32_t max_tokens) {
  GenerationRequest r;
  r.id = RequestId(e.next_id++);
  r.prompt = FreshPrompt(prompt_len, e.prompts);
  r.sampling.temperature = 0;
  r.sampling.max_tokens = max_tokens;
  r.sampling.ignore_eos = true;
  return e.generator->Add(std::move(r));
}

// Runs one step; its wall time.
double ProcessCpuSeconds() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

// Runs one step; its time: wall-clock, or with a CPU share the CPU time it
// took divided by the share — what it takes on average under that quota,
// without the stalls of single quota periods or other processes' noise.
absl::StatusOr<double> TimedStep(Engine& e, std::vector<GenerationEvent>& events) {
  events.clear();
  const auto t0 = Clock::now();
  const double cpu0 = ProcessCpuSeconds();
  PD_RETURN_IF_ERROR(e.generator->Step(events));
  if (e.cpu_share > 0) return (ProcessCpuSeconds() - cpu0) / e.cpu_share;
  return SecondsSince(t0);
}

// Steps until every request in `generated` has its first token, counting
// each one's tokens.
absl::Status StepUntilEveryFirstToken(Engine& e, absl::flat_hash_map<uint64_t, int32_t>& generated) {
  std::vector<GenerationEvent> events;
  auto waiting = [&] {
    for (const auto& [id, n] : generated) {
      if (n == 0) return true;
    }
    return false;
  };
  while (waiting()) {
    if (!e.generator->HasWork()) return absl::InternalError("the engine stopped early");
    events.clear();
    PD_RETURN_IF_ERROR(e.generator->Step(events));
    for (const GenerationEvent& ev : events) {
      if (ev.has_token) ++generated[ev.id.value];
    }
  }
  return absl::OkStatus();
}

absl::Status Drain(Engine& e) {
  std::vector<GenerationEvent> events;
  while (e.generator->HasWork()) PD_RETURN_IF_ERROR(e.generator->Step(events));
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::vector<StepSample>> MeasureEngineSteps(const EngineProfileOptions& o) {
  if (o.max_batch_tokens < 16 || o.max_running < 1 || o.reps < 1 || o.max_context < 64) {
    return absl::InvalidArgumentError(
        "engine profile needs max_batch_tokens >= 16, max_running >= 1, reps >= 1, "
        "max_context >= 64");
  }
  const int32_t decode_tokens = 8;  // Timed decode steps per batch.
  const int32_t blocks = (o.max_running * (o.max_context + 2 * decode_tokens + 64) +
                          4 * o.max_batch_tokens) / o.block_size + 64;
  PD_ASSIGN_OR_RETURN(Engine e, MakeEngine(o, blocks));
  std::vector<StepSample> samples;
  std::vector<GenerationEvent> events;
  auto progress = [&](const std::string& line) {
    if (o.progress) o.progress(line);
  };

  // The design: prefill chunk sizes, decode batches at contexts, and the
  // decode batches of mixed steps. The chunk sizes and decode batches are
  // the row counts of the step model's dense table (profile.h): every
  // batch up to 6, around where the kernels move from streaming the
  // weights to packed panels (from 5 rows on the CPU engine), then 8, 12,
  // 16, 24, ... and max_running.
  std::vector<int32_t> chunk_sizes, batches, contexts, mixed_batches;
  if (o.probe) {
    chunk_sizes = {std::min(64, o.max_batch_tokens), o.max_batch_tokens};
    batches = {1, std::min(8, o.max_running)};
    contexts = {o.max_context / 4};
  } else {
    for (int32_t n = 16; n <= o.max_batch_tokens; n *= 2) chunk_sizes.push_back(n);
    for (int32_t b = 1; b <= std::min(6, o.max_running); ++b) batches.push_back(b);
    for (int32_t b = 8; b <= o.max_running; b *= 2) {
      batches.push_back(b);
      if (b / 2 * 3 <= o.max_running) batches.push_back(b / 2 * 3);
    }
    batches.push_back(o.max_running);
    contexts = {64, o.max_context / 4, o.max_context};
    mixed_batches = {1, 8, 32};
  }
  chunk_sizes.erase(std::unique(chunk_sizes.begin(), chunk_sizes.end()), chunk_sizes.end());
  std::sort(batches.begin(), batches.end());
  batches.erase(std::unique(batches.begin(), batches.end()), batches.end());

  // Prefill: one prompt of 4 chunks of n tokens; every chunk is a step of
  // n tokens at context (k + 1) n.
  for (int32_t n : chunk_sizes) {
    progress(absl::StrFormat("engine: prefill chunks of %d tokens", n));
    const int32_t chunks = std::min<int32_t>(4, std::max<int32_t>(1, o.max_context / n));
    // An engine whose budget is n cuts the prompt into chunks of n (the
    // budget changes which tokens share a step, not what a step costs).
    EngineProfileOptions chunked = o;
    chunked.max_batch_tokens = n;
    chunked.max_running = std::min(o.max_running, n);
    PD_ASSIGN_OR_RETURN(Engine c, MakeEngine(chunked, (chunks * n) / o.block_size + 8));
    for (int32_t r = 0; r < o.reps + 1; ++r) {
      PD_RETURN_IF_ERROR(AddRequest(c, chunks * n, 1));
      for (int32_t k = 0; k < chunks; ++k) {
        PD_ASSIGN_OR_RETURN(double t, TimedStep(c, events));
        if (r == 0) continue;  // Warm-up.
        samples.push_back({.tokens = n,
                           .sequences = 1,
                           .attention = AttentionPairs(static_cast<int64_t>(k) * n, n),
                           .seconds = t,
                           .kind = "prefill"});
      }
      PD_RETURN_IF_ERROR(Drain(c));
    }
  }

  // Decode: b sequences at context about L; the timed steps start once
  // every prompt is computed. Sequences whose prompts finished early have
  // decoded meanwhile: each one's context is tracked from its events.
  for (int32_t b : batches) {
    for (int32_t context : contexts) {
      if (context < 16) continue;
      progress(absl::StrFormat("engine: decode batches of %d at context %d", b, context));
      for (int32_t r = 0; r < std::max(1, o.reps / 2); ++r) {
        const int32_t prefill_steps = (b * context + o.max_batch_tokens - 1) / o.max_batch_tokens;
        absl::flat_hash_map<uint64_t, int32_t> generated;
        for (int32_t i = 0; i < b; ++i) {
          generated[e.next_id] = 0;
          PD_RETURN_IF_ERROR(AddRequest(e, context, prefill_steps + decode_tokens + 2));
        }
        PD_RETURN_IF_ERROR(StepUntilEveryFirstToken(e, generated));
        for (int32_t j = 0; j < decode_tokens; ++j) {
          // The step computes each sequence's last sampled token: its
          // context after the step is prompt + generated.
          double attention = 0;
          for (const auto& [id, n] : generated) attention += AttentionPairs(context + n - 1, 1);
          PD_ASSIGN_OR_RETURN(double t, TimedStep(e, events));
          samples.push_back({.tokens = b,
                             .sequences = b,
                             .decode_attention = attention,
                             .seconds = t,
                             .kind = "decode",
                             .after_prefill = j == 0});
          for (const GenerationEvent& ev : events) {
            if (ev.has_token) ++generated[ev.id.value];
          }
        }
        PD_RETURN_IF_ERROR(Drain(e));
      }
    }
  }

  // Mixed: b decodes at context 256 plus a new prompt of n tokens.
  for (int32_t b : mixed_batches) {
    if (b > o.max_running - 1) continue;
    for (int32_t n : {64, o.max_batch_tokens - b}) {
      if (n < 1 || n > o.max_batch_tokens - b) continue;
      progress(absl::StrFormat("engine: mixed steps, %d decodes and a %d-token chunk", b, n));
      for (int32_t r = 0; r < std::max(1, o.reps / 2); ++r) {
        const int32_t prefill_steps = (b * 256 + o.max_batch_tokens - 1) / o.max_batch_tokens;
        absl::flat_hash_map<uint64_t, int32_t> generated;
        for (int32_t i = 0; i < b; ++i) {
          generated[e.next_id] = 0;
          PD_RETURN_IF_ERROR(AddRequest(e, 256, prefill_steps + 8));
        }
        PD_RETURN_IF_ERROR(StepUntilEveryFirstToken(e, generated));
        double decode_attention = 0;
        for (const auto& [id, g] : generated) decode_attention += AttentionPairs(256 + g - 1, 1);
        PD_RETURN_IF_ERROR(AddRequest(e, n, 1));
        PD_ASSIGN_OR_RETURN(double t, TimedStep(e, events));
        samples.push_back({.tokens = b + n,
                           .sequences = b + 1,
                           .attention = AttentionPairs(0, n),
                           .decode_attention = decode_attention,
                           .seconds = t,
                           .kind = "mixed",
                           .after_prefill = true});
        PD_RETURN_IF_ERROR(Drain(e));
      }
    }
  }
  return samples;
}

absl::StatusOr<StepFit> FitStepCost(const std::vector<StepSample>& samples,
                                    double decode_cache_tokens) {
  // The steps of one design point (kind, tokens, sequences, attention
  // within 5%, right after its prefill or not) are averaged first: under a
  // CPU quota a short step runs either at full speed or after a stall, and
  // what the simulator needs is the mean. Then relative least squares (rows
  // scaled by 1 / measured), so that short decode steps weigh as much as
  // long prefills, non-negative.
  struct Group {
    StepSample sum;
    int n = 0;
  };
  auto bucket = [](double x) {
    return x > 0 ? static_cast<int64_t>(std::floor(std::log(x) / std::log(1.05))) : -1;
  };
  std::map<std::tuple<std::string, int64_t, int64_t, int64_t, int64_t, bool>, Group> groups;
  for (const StepSample& s : samples) {
    if (s.tokens < 1 || !(s.seconds > 0)) {
      return absl::InvalidArgumentError("fitting the step cost needs steps of at least one token "
                                        "that took some time");
    }
    Group& g = groups[{s.kind, s.tokens, s.sequences, bucket(s.attention),
                       bucket(s.decode_attention), s.after_prefill}];
    g.sum.kind = s.kind;
    g.sum.tokens = s.tokens;
    g.sum.sequences = s.sequences;
    g.sum.after_prefill = s.after_prefill;
    g.sum.attention += s.attention;
    g.sum.decode_attention += s.decode_attention;
    g.sum.seconds += s.seconds;
    ++g.n;
  }
  std::vector<StepSample> points;
  for (const auto& [key, g] : groups) {
    StepSample m = g.sum;
    m.attention /= g.n;
    m.decode_attention /= g.n;
    m.seconds /= g.n;
    points.push_back(m);
  }
  // The dense table's row counts: those of the prefill and decode steps
  // (a mixed step's count, one design point each, is interpolated).
  StepFit fit;
  StepCost& cost = fit.cost;
  cost.decode_cache_tokens = decode_cache_tokens;
  for (const StepSample& s : points) {
    if (s.kind != "mixed") cost.dense_tokens.push_back(static_cast<int32_t>(s.tokens));
  }
  std::sort(cost.dense_tokens.begin(), cost.dense_tokens.end());
  cost.dense_tokens.erase(std::unique(cost.dense_tokens.begin(), cost.dense_tokens.end()),
                          cost.dense_tokens.end());
  const size_t knots = cost.dense_tokens.size();
  const size_t columns = knots + 3;
  if (knots < 2 || points.size() < columns) {
    return absl::InvalidArgumentError(absl::StrCat(
        "fitting the step cost needs prefill or decode steps of at least 2 row counts and a "
        "design point per coefficient: ", points.size(), " design points for ", columns,
        " coefficients"));
  }
  // The table's unknowns are its steps up, dense_s[0] and then dense_s[k]
  // - dense_s[k - 1], none negative: a step of more tokens costs no less
  // (the machine's noise would otherwise put one row count under a
  // smaller one now and then). A design point's row: its weight on each
  // step up (StepCost::Dense is linear in the table: 1 - f on the row count
  // below it, f on the one above, so every step up to the one below
  // weighs 1 and that to the one above f), then its attention terms, all
  // over its time (relative error).
  std::vector<std::vector<double>> a;
  for (const StepSample& s : points) {
    std::vector<double>& r = a.emplace_back(columns, 0.0);
    const auto [i, f] = cost.DenseSegment(s.tokens);
    for (size_t k = 0; k < i; ++k) r[k] = 1;
    r[i] = f;
    r[knots] = s.attention;
    r[knots + 1] = s.decode_attention;
    r[knots + 2] =
        decode_cache_tokens > 0 ? std::max(0.0, s.decode_attention - decode_cache_tokens) : 0;
    for (double& x : r) x /= s.seconds;
  }
  const std::vector<double> x = NonNegativeLeastSquares(a, std::vector<double>(a.size(), 1.0));
  cost.dense_s.resize(knots);
  std::partial_sum(x.begin(), x.begin() + knots, cost.dense_s.begin());
  cost.per_attention_s = x[knots];
  cost.per_decode_attention_s = x[knots + 1];
  cost.per_decode_kv_beyond_cache_s = x[knots + 2];

  std::map<std::string, std::vector<double>> errors;
  for (const StepSample& s : points) {
    const double predicted = cost.Seconds(s.tokens, s.sequences, s.attention, s.decode_attention);
    const std::string kind =
        s.kind == "decode" && s.after_prefill ? "decode, right after its prefill" : s.kind;
    errors[kind].push_back(std::abs(predicted - s.seconds) / s.seconds);
  }
  for (auto& [kind, e] : errors) {
    fit.relative_error.push_back({kind, {Percentile(e, 50), Percentile(e, 90)}});
  }
  return fit;
}

int64_t CoreCacheBytes() {
  const long bytes = sysconf(_SC_LEVEL2_CACHE_SIZE);
  return bytes > 0 ? bytes : 0;
}

absl::StatusOr<double> KvBytesPerToken(const std::string& model_spec) {
  PD_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model, Model::Load(model_spec));
  PD_ASSIGN_OR_RETURN(std::unique_ptr<ModelRunner> runner,
                      CreateModelRunner(model, {.num_kv_blocks = 1, .block_size = 16,
                                                .num_threads = 1}));
  return static_cast<double>(runner->kv_layout().block_bytes()) / 16.0;
}

absl::StatusOr<std::vector<TransferCost>> MeasureTransfers(const std::vector<std::string>& names,
                                                           int32_t reps) {
  const size_t max_bytes = size_t{4} << 20;
  std::vector<std::byte> src(max_bytes, std::byte{1}), dst(max_bytes);
  std::vector<TransferCost> out;
  for (const std::string& name : names) {
    PD_ASSIGN_OR_RETURN(std::unique_ptr<kv::KvTransport> sender, kv::CreateKvTransport(name, {}));
    PD_ASSIGN_OR_RETURN(std::unique_ptr<kv::KvTransport> receiver,
                        kv::CreateKvTransport(name, {}));
    PD_ASSIGN_OR_RETURN(kv::RegionId local, sender->RegisterMemory(src));
    PD_ASSIGN_OR_RETURN(kv::RegionId remote, receiver->RegisterMemory(dst));
    PD_ASSIGN_OR_RETURN(std::unique_ptr<kv::KvConnection> conn,
                        sender->Connect(receiver->endpoint()));
    // Median post time per size, then a least-squares line through them.
    std::vector<std::vector<double>> a;
    std::vector<double> b;
    for (size_t bytes = 4096; bytes <= max_bytes; bytes *= 4) {
      std::vector<double> secs;
      for (int32_t r = 0; r < reps + 1; ++r) {
        const auto t0 = Clock::now();
        const std::vector<kv::WriteOp> ops = {{local, 0, remote, 0, bytes}};
        PD_RETURN_IF_ERROR(conn->Write(ops));
        if (r > 0) secs.push_back(SecondsSince(t0));
      }
      const double t = Percentile(secs, 50);
      const double w = 1.0 / t;  // Relative error, as for the step cost.
      a.push_back({w, w * static_cast<double>(bytes)});
      b.push_back(1.0);
    }
    const std::vector<double> x = NonNegativeLeastSquares(a, b);
    out.push_back({.transport = name,
                   .latency_s = x[0],
                   .bytes_per_s = x[1] > 0 ? 1.0 / x[1] : 0});
  }
  return out;
}

namespace {

// One request's token arrival times, seconds from its send.
struct Timed {
  std::vector<double> tokens;
};

absl::StatusOr<Timed> TimedRequest(GenerationClient& client, std::vector<int32_t> prompt,
                                   int32_t output_tokens) {
  v1::GenerateRequest request;
  request.mutable_token_ids()->mutable_ids()->Assign(prompt.begin(), prompt.end());
  request.mutable_sampling()->set_temperature(0);
  request.set_max_tokens(output_tokens);
  request.set_ignore_eos(true);
  Timed out;
  const auto t0 = Clock::now();
  PD_RETURN_IF_ERROR(client.Generate(request, [&](const v1::GenerateResponse& r) {
    const double t = SecondsSince(t0);
    for (int i = 0; i < r.token_ids_size(); ++i) out.tokens.push_back(t);
    return true;
  }));
  if (static_cast<int32_t>(out.tokens.size()) != output_tokens) {
    return absl::InternalError(absl::StrCat("asked for ", output_tokens, " tokens, got ",
                                            out.tokens.size()));
  }
  return out;
}

// Seconds of the prefill steps of one prompt alone on a worker.
double PrefillSeconds(const Profile& p, int32_t prompt) {
  double t = 0;
  for (int32_t done = 0; done < prompt;) {
    const int32_t n = std::min(p.max_batch_tokens, prompt - done);
    done += n;
    t += p.step.Seconds(n, 1, AttentionPairs(done - n, n));
  }
  return t;
}

// A cluster of `prefill` prefill workers (0: colocated) and one decode
// worker, every prompt prefilled where that shape says, and a client of it.
struct ProfiledCluster {
  std::unique_ptr<ClusterLauncher> cluster;
  std::unique_ptr<GenerationClient> client;
};

// A disaggregated one never prefills on its decode worker (the decode
// figures need it to only decode): kv_aware's prefill queue limit is off,
// which 16 closed-loop streams of 256-token prompts crossed on the Zen 5
// VM of docs/capacity_planning.md run 24.
absl::StatusOr<ProfiledCluster> StartCluster(LaunchOptions launch, int32_t prefill) {
  launch.prefill = prefill;
  launch.routing = prefill > 0
                       ? R"({"localPrefillMaxTokens": 0, "prefillQueueLimitTokens": 1000000000})"
                       : R"({"localPrefillMaxTokens": 1000000000})";
  ProfiledCluster out;
  PD_ASSIGN_OR_RETURN(out.cluster, ClusterLauncher::Start(launch));
  PD_ASSIGN_OR_RETURN(out.client, GenerationClient::Create(out.cluster->grpc_address()));
  return out;
}

// `requests` single requests of fresh prompts one after another; the first
// is a warm-up and left out.
absl::StatusOr<std::vector<Timed>> SingleRequests(GenerationClient& client, int32_t requests,
                                                  int32_t prompt_tokens, int32_t output_tokens,
                                                  uint64_t& prompts) {
  std::vector<Timed> out;
  for (int32_t r = 0; r < requests; ++r) {
    PD_ASSIGN_OR_RETURN(Timed t,
                        TimedRequest(client, FreshPrompt(prompt_tokens, prompts), output_tokens));
    if (r > 0) out.push_back(std::move(t));
  }
  return out;
}

// `streams` clients at once, each sending `requests_each` requests of
// fresh prompts (no prefix-cache hit) one after another.
absl::Status ConcurrentStreams(GenerationClient& client, int32_t streams, int32_t requests_each,
                               int32_t prompt_tokens, int32_t output_tokens, uint64_t& prompts) {
  std::vector<std::vector<int32_t>> mine;
  for (int32_t i = 0; i < streams * requests_each; ++i) {
    mine.push_back(FreshPrompt(prompt_tokens, prompts));
  }
  std::vector<absl::Status> status(streams);
  std::vector<std::thread> threads;
  for (int32_t i = 0; i < streams; ++i) {
    threads.emplace_back([&, i] {
      for (int32_t r = 0; r < requests_each && status[i].ok(); ++r) {
        status[i] =
            TimedRequest(client, std::move(mine[i * requests_each + r]), output_tokens).status();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (const absl::Status& s : status) PD_RETURN_IF_ERROR(s);
  return absl::OkStatus();
}

// CPU seconds run so far by the threads of process `pid`: its engine's
// ("pd-engine": EngineLoop, and the compute threads it starts, which take
// its name) and the others (gRPC's, the KV lanes). From
// /proc/PID/task/*/schedstat, whose first field is the nanoseconds the
// thread has run. A thread that ended since an earlier reading drops out of
// the sum, so compare readings of one phase whose threads live through it.
struct ThreadsCpu {
  double engine = 0;
  double serving = 0;
};

absl::StatusOr<ThreadsCpu> ThreadsCpuSeconds(int pid) {
  const std::filesystem::path tasks = absl::StrCat("/proc/", pid, "/task");
  std::error_code error;
  std::filesystem::directory_iterator it(tasks, error);
  if (error) {
    return absl::UnavailableError(
        absl::StrCat("cannot read the threads of process ", pid, ": ", error.message()));
  }
  ThreadsCpu cpu;
  for (const auto& task : it) {
    std::ifstream comm(task.path() / "comm"), schedstat(task.path() / "schedstat");
    std::string name;
    uint64_t run_ns = 0;
    if (!std::getline(comm, name) || !(schedstat >> run_ns)) continue;  // It just ended.
    (name == "pd-engine" ? cpu.engine : cpu.serving) += static_cast<double>(run_ns) * 1e-9;
  }
  return cpu;
}

// The serving threads' CPU time of a process at one moment.
struct ServingReading {
  double cpu = 0;
  Clock::time_point at;
};

absl::StatusOr<ServingReading> ReadServing(int pid) {
  PD_ASSIGN_OR_RETURN(const ThreadsCpu cpu, ThreadsCpuSeconds(pid));
  return ServingReading{.cpu = cpu.serving, .at = Clock::now()};
}

// What process `pid`'s serving threads spend a second with nothing to do
// (answering the router's load polls), over one second.
absl::StatusOr<double> IdleServingRate(int pid) {
  PD_ASSIGN_OR_RETURN(const ServingReading start, ReadServing(pid));
  std::this_thread::sleep_for(std::chrono::seconds(1));
  PD_ASSIGN_OR_RETURN(const ServingReading end, ReadServing(pid));
  return (end.cpu - start.cpu) / std::chrono::duration<double>(end.at - start.at).count();
}

// The serving threads' CPU per request from `start` to `end`, less their
// idle rate.
double ServingPerRequest(const ServingReading& start, const ServingReading& end,
                         double idle_rate, int32_t requests) {
  const double seconds = std::chrono::duration<double>(end.at - start.at).count();
  return (end.cpu - start.cpu - idle_rate * seconds) / requests;
}

// The engine CPU per prompt of the worker `pid` that computes the prompts
// of `client`'s cluster, when it is kept busy (two clients, each sending its
// next prompt as soon as the last is answered, so one prompt waits while
// another computes), over what `profile`'s step model gives for those
// prompts alone: Profile::prefill_engine_scale and decode_engine_scale. The
// prompts are `prompt_tokens` long (several quota periods each) and ask
// for 2 tokens, so the rest of the cluster has little to do.
absl::StatusOr<double> BusyEngineScale(GenerationClient& client, int pid, const Profile& profile,
                                       int32_t prompt_tokens, uint64_t& prompts,
                                       const std::function<void(const std::string&)>& progress) {
  static_assert(kBusyPrompts % kBusyClients == 0);
  constexpr int32_t kPromptsEach = kBusyPrompts / kBusyClients;
  const double predicted =
      kBusyPrompts * PrefillSeconds(profile, prompt_tokens) * profile.worker_cpus;
  std::vector<double> scales;
  for (int32_t round = 1; round <= kBusyRounds; ++round) {
    progress(absl::StrFormat(
        "serving costs: an engine busy with %d prompts of %d tokens (%d of %d)", kBusyPrompts,
        prompt_tokens, round, kBusyRounds));
    PD_ASSIGN_OR_RETURN(const ThreadsCpu start, ThreadsCpuSeconds(pid));
    PD_RETURN_IF_ERROR(ConcurrentStreams(client, kBusyClients, kPromptsEach, prompt_tokens,
                                         kBusyOutputTokens, prompts));
    PD_ASSIGN_OR_RETURN(const ThreadsCpu end, ThreadsCpuSeconds(pid));
    const double measured = end.engine - start.engine;
    if (!(predicted > 0 && measured > 0)) {
      return absl::InternalError(absl::StrFormat(
          "the busy worker's engine ran %.3f CPU s where the step model gives %.3f",
          measured, predicted));
    }
    scales.push_back(measured / predicted);
  }
  const double median = Percentile(scales, 50);
  progress(absl::StrFormat("serving costs: engine busy scale x%s, median x%.3f",
                           absl::StrJoin(scales, ", x",
                                         [](std::string* out, double v) {
                                           absl::StrAppendFormat(out, "%.3f", v);
                                         }),
                           median));
  return median;
}

}  // namespace

double MeanDecodeSteps(const StepCost& step, double steps, double tokens, double attention) {
  if (!(steps > 0 && tokens >= steps)) return 0;
  const double batch = tokens / steps;
  const double context = attention / tokens;
  const auto whole = static_cast<int64_t>(batch);
  const double f = batch - static_cast<double>(whole);
  auto at = [&](int64_t b) {
    return step.Seconds(b, b, 0, static_cast<double>(b) * context);
  };
  return steps * ((1 - f) * at(whole) + f * at(whole + 1));
}

int32_t BusyPromptTokens(const ServingCostOptions& o, const Profile& profile) {
  return std::max(o.prompt_tokens + 1,
                  std::min(4 * o.prompt_tokens,
                           (profile.max_context > 0 ? profile.max_context : 4 * o.prompt_tokens) -
                               o.output_tokens));
}

EngineProfileOptions DriftProbeOptions(const Profile& p) {
  return {.model = p.model,
          .threads = p.threads,
          .block_size = p.block_size,
          .max_batch_tokens = p.max_batch_tokens,
          .max_running = p.max_running,
          .max_context = std::clamp(p.max_context, 64, 1024),
          .reps = 3,
          .cpu_share = p.worker_cpus,
          .probe = true};
}

absl::StatusOr<double> ProbeRatio(const Profile& p, const std::vector<StepSample>& samples) {
  std::vector<double> ratios;
  for (const StepSample& s : samples) {
    const double predicted = p.step.Seconds(s.tokens, s.sequences, s.attention, s.decode_attention);
    if (predicted > 0) ratios.push_back(s.seconds / predicted);
  }
  if (ratios.empty()) {
    return absl::InvalidArgumentError("the drift probe has no step the profile predicts");
  }
  return Percentile(ratios, 50);
}

LaunchOptions LaunchOptionsFor(const Profile& p) {
  LaunchOptions o;
  o.model = p.model;
  o.cpu_share = p.worker_cpus;
  o.worker_args = absl::StrFormat("--num_threads=%d --block_size=%d --max_batch_tokens=%d "
                                  "--max_running=%d",
                                  p.threads, p.block_size, p.max_batch_tokens, p.max_running);
  o.prefill_args = absl::StrCat("--kv_blocks=", p.prefill_kv_blocks);
  o.decode_args = absl::StrCat("--kv_blocks=", p.decode_kv_blocks);
  return o;
}

absl::Status MeasureServingCosts(const ServingCostOptions& o, Profile& profile) {
  if (profile.transfers.empty()) {
    return absl::FailedPreconditionError("measure the transfers before the serving costs");
  }
  if (o.requests < 2 || o.output_tokens < 4 || o.prompt_tokens < 1) {
    return absl::InvalidArgumentError(
        "serving costs need at least 2 requests of at least 4 output tokens");
  }
  auto progress = [&](const std::string& line) {
    if (o.progress) o.progress(line);
  };
  uint64_t prompts = 1000;
  const double prefill = PrefillSeconds(profile, o.prompt_tokens);
  const TransferCost& link = profile.transfers.front();
  const int32_t last_chunk =
      o.prompt_tokens - (o.prompt_tokens - 1) / profile.max_batch_tokens * profile.max_batch_tokens;
  const double push_tail =
      link.latency_s + last_chunk * profile.kv_bytes_per_token / std::max(link.bytes_per_s, 1.0);
  // The longer prompts: several quota periods of prefill each.
  const int32_t long_prompt = BusyPromptTokens(o, profile);
  // A decode worker's decode step, as the simulator costs it.
  auto decode_engine = [&](int64_t b, double context) {
    return profile.step.Seconds(b, b, 0, b * context) * profile.decode_batch_scale;
  };
  // With what its serving threads spend streaming the last step's tokens
  // (a busy worker pays it in its next step).
  auto decode_step = [&](int64_t b, double context) {
    return decode_engine(b, context) + profile.decode_step_overhead_s +
           (profile.decode_sequence_overhead_s + profile.decode_cpu_per_token_s) * b;
  };

  // First, a decode worker's engine kept busy with colocated prompts: every
  // later figure of a decode worker is measured against its scaled steps.
  if (profile.worker_cpus > 0) {
    progress("serving costs: a busy colocated cluster (0P1D)");
    PD_ASSIGN_OR_RETURN(ProfiledCluster c, StartCluster(o.launch, 0));
    PD_ASSIGN_OR_RETURN(const int decode_pid, c.cluster->Pid("decode-0"));
    PD_ASSIGN_OR_RETURN(profile.decode_engine_scale,
                        BusyEngineScale(*c.client, decode_pid, profile, long_prompt, prompts,
                                        progress));
  }

  // Then the decode overheads, on a disaggregated cluster whose decode
  // worker only decodes: b closed-loop streams at a time, and the worker's
  // own account of its time between back-to-back steps
  // (pdserve_decode_step_gap_seconds: handing each token to its stream,
  // the loop's commands and load reports, and the CPU they wait for under
  // the share), per step, fitted as a + c * b. Until 2026-11-28 they were
  // fitted to the streams' median token gap less the step, which the
  // worker's packing of several tokens into one message (a gap of 0)
  // pulled to nothing: 0 in runs 14 to 18, where the decode worker of
  // 2P1D spent 37-40% of its step time between steps
  // (docs/capacity_planning.md run 18). The same streams give
  // decode_batch_scale under a share: the worker's CPU in its steps over
  // the step model's for them. A colocated worker's busy scale, applied to
  // decode batches until run 23, put them 18% over the model where these
  // came to 4% (runs 22 and 23).
  {
    progress("serving costs: decode overheads on a 1P1D cluster");
    PD_ASSIGN_OR_RETURN(ProfiledCluster c, StartCluster(o.launch, 1));
    GenerationClient& client = *c.client;
    // The gap histogram's {sum, count}, the step CPU histogram's, the
    // tokens generated and the prompt tokens computed.
    auto so_far = [&] {
      return c.cluster->MetricSums(
          "decode-0",
          {"pdserve_decode_step_gap_seconds_sum", "pdserve_decode_step_gap_seconds_count",
           "pdserve_decode_step_cpu_seconds_sum", "pdserve_decode_step_cpu_seconds_count",
           "pdserve_decode_generated_tokens_total", "pdserve_decode_computed_prompt_tokens_total"});
    };
    const int32_t output_tokens = o.output_tokens * 2;
    std::vector<std::vector<double>> a;
    std::vector<double> y;
    // The decode worker's step CPU and what the step model gives for the
    // same steps (at their mean batch and context), for
    // decode_batch_scale.
    double step_cpu = 0, model_cpu = 0;
    std::vector<std::string> ratios;
    for (int32_t b : o.batches) {
      progress(absl::StrFormat("serving costs: %d concurrent streams", b));
      PD_ASSIGN_OR_RETURN(const auto before, so_far());
      PD_RETURN_IF_ERROR(
          ConcurrentStreams(client, b, 3, o.prompt_tokens, output_tokens, prompts));
      PD_ASSIGN_OR_RETURN(const auto after, so_far());
      const double gap_steps = after[1] - before[1];
      if (gap_steps < 1) {
        return absl::InternalError(absl::StrFormat(
            "the decode worker reported no back-to-back steps for %d streams", b));
      }
      a.push_back({1.0, static_cast<double>(b)});
      y.push_back((after[0] - before[0]) / gap_steps);
      // Each request's decode steps feed its first to its last but one
      // token (the prefill worker sampled the first), reading contexts
      // prompt + 1 to prompt + output - 1: a mean of prompt + output / 2
      // KV tokens a token. A prompt the decode worker computed itself
      // would break that; none is routed there at these lengths.
      const double steps = after[3] - before[3];
      const double tokens = after[4] - before[4];
      if (after[5] != before[5]) {
        return absl::InternalError(absl::StrFormat(
            "the 1P1D cluster's decode worker computed %g prompt tokens for %d streams; the "
            "decode batches' scale needs it to only decode",
            after[5] - before[5], b));
      }
      const double context = o.prompt_tokens + output_tokens / 2.0;
      const double model =
          MeanDecodeSteps(profile.step, steps, tokens, tokens * context) * StepCpus(profile);
      if (!(model > 0)) {
        return absl::InternalError(absl::StrFormat(
            "the decode worker reported %g steps and %g tokens for %d streams", steps, tokens, b));
      }
      step_cpu += after[2] - before[2];
      model_cpu += model;
      ratios.push_back(absl::StrFormat("%d streams x%.3f", b, (after[2] - before[2]) / model));
    }
    const std::vector<double> x = NonNegativeLeastSquares(a, y);
    profile.decode_step_overhead_s = x[0];
    profile.decode_sequence_overhead_s = x[1];
    // The step CPU is the engine loop thread's (pdserve_decode_step_cpu_seconds):
    // all of it with one compute thread only.
    if (profile.worker_cpus > 0 && profile.threads == 1) {
      profile.decode_batch_scale = step_cpu / model_cpu;
      progress(absl::StrFormat("serving costs: decode batches' CPU over the step model: %s; x%.3f",
                               absl::StrJoin(ratios, ", "), profile.decode_batch_scale));
    } else if (profile.worker_cpus > 0) {
      profile.decode_batch_scale = profile.decode_engine_scale;
      progress("serving costs: decode batches take the colocated busy scale (the step CPU "
               "metric holds one compute thread of several)");
    }

    // The decode worker's serving threads' CPU per token streamed: the
    // same streams at two output lengths, their CPU (less the idle rate)
    // per request apart. Several streams, as a serving worker has them:
    // single requests on an otherwise idle machine gave 21-41 us a token,
    // four streams 51 and a serving 2P1D cluster 55-60
    // (docs/capacity_planning.md run 20). The engine thread's time between
    // steps above holds only the part of it that lands there.
    if (profile.worker_cpus > 0) {
      progress("serving costs: the decode worker's serving threads at two output lengths");
      PD_ASSIGN_OR_RETURN(const int decode_pid, c.cluster->Pid("decode-0"));
      PD_ASSIGN_OR_RETURN(const double idle_rate, IdleServingRate(decode_pid));
      constexpr int32_t kStreams = 4;
      constexpr int32_t kRequestsEach = 3;
      const int32_t long_output = 4 * o.output_tokens;
      PD_ASSIGN_OR_RETURN(const ServingReading start, ReadServing(decode_pid));
      PD_RETURN_IF_ERROR(ConcurrentStreams(client, kStreams, kRequestsEach, o.prompt_tokens,
                                           o.output_tokens, prompts));
      PD_ASSIGN_OR_RETURN(const ServingReading middle, ReadServing(decode_pid));
      PD_RETURN_IF_ERROR(ConcurrentStreams(client, kStreams, kRequestsEach, o.prompt_tokens,
                                           long_output, prompts));
      PD_ASSIGN_OR_RETURN(const ServingReading end, ReadServing(decode_pid));
      constexpr int32_t kRequests = kStreams * kRequestsEach;
      const double per_token = (ServingPerRequest(middle, end, idle_rate, kRequests) -
                                ServingPerRequest(start, middle, idle_rate, kRequests)) /
                               (long_output - o.output_tokens);
      profile.decode_cpu_per_token_s = std::max(0.0, per_token) / profile.worker_cpus;
    }
  }
  {
    progress("serving costs: colocated cluster (0P1D)");
    PD_ASSIGN_OR_RETURN(ProfiledCluster c, StartCluster(o.launch, 0));
    PD_ASSIGN_OR_RETURN(std::vector<Timed> timed,
                        SingleRequests(*c.client, o.requests, o.prompt_tokens, o.output_tokens,
                                       prompts));
    // First token at prefill end + colocated_first_token_s; the second at
    // the next step's end + token_delivery_s.
    std::vector<double> first, delivery;
    for (const Timed& t : timed) {
      first.push_back(t.tokens[0] - prefill * profile.decode_engine_scale);
      delivery.push_back(t.tokens[1] - t.tokens[0] + first.back() -
                         decode_step(1, o.prompt_tokens + 1));
    }
    profile.colocated_first_token_s = std::max(0.0, Percentile(first, 50));
    profile.token_delivery_s = std::max(0.0, Percentile(delivery, 50));
  }
  {
    progress("serving costs: disaggregated cluster (1P1D)");
    PD_ASSIGN_OR_RETURN(ProfiledCluster c, StartCluster(o.launch, 1));
    PD_ASSIGN_OR_RETURN(const int prefill_pid, c.cluster->Pid("prefill-0"));
    // The prefill worker's serving threads' CPU per request at two prompt
    // lengths, less what they spend idle (answering the router's load
    // polls): a cost per request and one per KV byte pushed.
    PD_ASSIGN_OR_RETURN(const double idle_rate, IdleServingRate(prefill_pid));
    PD_ASSIGN_OR_RETURN(const ServingReading short_start, ReadServing(prefill_pid));
    PD_ASSIGN_OR_RETURN(std::vector<Timed> timed,
                        SingleRequests(*c.client, o.requests, o.prompt_tokens, o.output_tokens,
                                       prompts));
    PD_ASSIGN_OR_RETURN(const ServingReading short_end, ReadServing(prefill_pid));
    progress(absl::StrFormat(
        "serving costs: the prefill worker's serving threads at prompts of %d and %d tokens",
        o.prompt_tokens, long_prompt));
    PD_RETURN_IF_ERROR(
        SingleRequests(*c.client, o.requests, long_prompt, o.output_tokens, prompts).status());
    PD_ASSIGN_OR_RETURN(const ServingReading long_end, ReadServing(prefill_pid));
    const double cpu_short = ServingPerRequest(short_start, short_end, idle_rate, o.requests);
    const double cpu_long = ServingPerRequest(short_end, long_end, idle_rate, o.requests);
    const double bytes_short = o.prompt_tokens * profile.kv_bytes_per_token;
    const double bytes_long = long_prompt * profile.kv_bytes_per_token;
    if (profile.worker_cpus > 0 && bytes_long > bytes_short) {
      const double per_byte = std::max(0.0, (cpu_long - cpu_short) / (bytes_long - bytes_short));
      profile.prefill_cpu_per_kv_byte_s = per_byte / profile.worker_cpus;
      profile.prefill_cpu_per_request_s =
          std::max(0.0, cpu_short - per_byte * bytes_short) / profile.worker_cpus;
    }
    if (profile.worker_cpus > 0) {
      PD_ASSIGN_OR_RETURN(profile.prefill_engine_scale,
                          BusyEngineScale(*c.client, prefill_pid, profile, long_prompt, prompts,
                                          progress));
    }
    // First token at push end + disaggregated_first_token_s; the second
    // at push end + a step + disaggregated_token_delivery_s. The prefill
    // steps are scaled by prefill_engine_scale and take their push's CPU
    // too (as the simulator charges them).
    const double push_end = prefill * profile.prefill_engine_scale +
                            bytes_short * profile.prefill_cpu_per_kv_byte_s + push_tail;
    const double second_step = decode_step(1, o.prompt_tokens + 1);
    std::vector<double> first, delivery;
    for (const Timed& t : timed) {
      first.push_back(t.tokens[0] - push_end);
      delivery.push_back(t.tokens[1] - push_end - second_step);
    }
    profile.disaggregated_first_token_s = std::max(0.0, Percentile(first, 50));
    profile.disaggregated_token_delivery_s = std::max(0.0, Percentile(delivery, 50));
  }
  return absl::OkStatus();
}

}  // namespace pdserve::planner
