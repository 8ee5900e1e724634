// pd-prefix-bench: what KV-aware routing saves on a shared-prefix workload.
// Replays a window of the Mooncake conversation trace (its hash_ids name
// shared 512-token blocks) open-loop through the router's public Generate
// API, once per routing policy, each on a fresh 2P2D cluster, and reads
// every worker's counters (GetLoad) afterwards. All in one run:
//   - per policy of --policies: requests ok, prompt tokens computed (on the
//     prefill workers, and locally on the decode workers), prompt tokens
//     taken from prefix caches, KV bytes the prefill workers moved, TTFT
//     p50/p90, each against the first policy;
//   - kv_aware with each local_prefill_max_tokens of --local_prefill_sweep
//     (conditional disaggregation's threshold), the same figures;
//   - greedy outputs of every run compared request by request with the
//     first run's (they must match: routing must not change results).
// --rounds runs every configuration that many times, interleaved, so that
// load from outside the benchmark falls on all of them alike; TTFT on a
// shared machine moves a lot (each run prints the load average).
// Scaling, printed with the tables: each 512-token trace block becomes
// --block_tokens tokens (pseudo-random from its hash_id, so equal ids give
// equal tokens in every request), lengths divide by 512 / --block_tokens
// (rounded up), outputs are capped at --max_output_tokens, prompts are
// cut to fit the model's context, and arrival times divide by
// --time_compression.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <memory>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/blocking_counter.h"
#include "absl/time/clock.h"
#include "common/check.h"
#include "common/status_macros.h"
#include "engine/model_files/model_info.h"
#include "nlohmann/json.hpp"
#include "router/routing_policy.h"
#include "tests/cluster/local_cluster.h"

ABSL_FLAG(std::string, trace,
          PDSERVE_SOURCE_DIR
          "/../shared/traces/mooncake_conversation_trace.jsonl",
          "Mooncake trace (JSON lines: timestamp ms, input_length, "
          "output_length, hash_ids)");
ABSL_FLAG(int32_t, requests, 400, "Replay the trace's first N requests");
ABSL_FLAG(int32_t, block_tokens, 16,
          "Tokens of one trace block (512 tokens in the trace): the length "
          "scale-down is 512 / this. Equal to the workers' KV block size, so "
          "trace blocks and cache blocks line up");
ABSL_FLAG(int32_t, max_output_tokens, 32,
          "Cap on each request's scaled output length");
ABSL_FLAG(double, time_compression, 2.5,
          "Arrival times are the trace's divided by this");
ABSL_FLAG(std::string, policies, "round_robin,least_loaded,kv_aware",
          "Routing policies to compare, one fresh cluster each; the first is "
          "the baseline of the ratios and of the output check");
ABSL_FLAG(std::string, local_prefill_sweep, "0,16,64,256",
          "kv_aware runs with these local_prefill_max_tokens (empty: none)");
ABSL_FLAG(int32_t, rounds, 1,
          "Runs of every configuration, interleaved; the tables show the "
          "counters' means over them and the TTFT percentiles' medians");
ABSL_FLAG(std::string, model, "builtin:tiny", "Model every worker runs");
ABSL_FLAG(int32_t, prefill_workers, 2, "Prefill workers");
ABSL_FLAG(int32_t, decode_workers, 2, "Decode workers");
ABSL_FLAG(std::string, worker_args, "--num_threads=1",
          "Extra flags of every prefill and decode worker");

namespace pdserve {
namespace {

namespace v1 = ::pdserve::v1;
namespace wire = ::pdserve::internal::v1;
using testing_util::ClusterSpec;
using testing_util::LocalCluster;

constexpr int kTraceBlockTokens = 512;
constexpr int kByteTokens = 256;  // builtin models' byte tokens (no BOS/EOS).

struct TraceRequest {
  absl::Duration arrival;
  std::vector<int32_t> prompt;
  int32_t max_tokens = 0;
};

struct Scaling {
  int block_tokens = 16;
  int max_output_tokens = 32;
  int context = 0;
  double time_compression = 1;
};

// splitmix64: the tokens of one trace block, a function of its hash_id.
uint64_t Mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

absl::StatusOr<std::vector<TraceRequest>> LoadTrace(const std::string& path,
                                                    int n,
                                                    const Scaling& scale) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  const int factor = kTraceBlockTokens / scale.block_tokens;
  std::vector<TraceRequest> out;
  std::string line;
  while (static_cast<int>(out.size()) < n && std::getline(in, line)) {
    const auto row = nlohmann::json::parse(line, nullptr, false);
    if (row.is_discarded() || !row.contains("hash_ids")) {
      return absl::InvalidArgumentError(
          absl::StrCat(path, ": bad line ", out.size() + 1));
    }
    TraceRequest r;
    r.arrival = absl::Milliseconds(row["timestamp"].get<double>() /
                                   scale.time_compression);
    r.max_tokens = static_cast<int32_t>(std::clamp<int64_t>(
        CeilDiv(row["output_length"].get<int64_t>(), factor), 1,
        scale.max_output_tokens));
    const int64_t want =
        std::min<int64_t>(CeilDiv(row["input_length"].get<int64_t>(), factor),
                          scale.context - r.max_tokens);
    for (uint64_t id : row["hash_ids"].get<std::vector<uint64_t>>()) {
      for (int j = 0; j < scale.block_tokens &&
                      static_cast<int64_t>(r.prompt.size()) < want;
           ++j) {
        r.prompt.push_back(static_cast<int32_t>(
            Mix(id * scale.block_tokens + j) % kByteTokens));
      }
    }
    if (r.prompt.empty()) r.prompt.push_back(0);
    out.push_back(std::move(r));
  }
  return out;
}

struct CallResult {
  grpc::Status status;
  double ttft_ms = 0;
  std::vector<int32_t> tokens;
};

// One streaming Generate on the callback API: times the first token,
// keeps the tokens, counts `done` down when the call ends.
class GenerateCall : public grpc::ClientReadReactor<v1::GenerateResponse> {
 public:
  GenerateCall(v1::Generation::Stub& router, const TraceRequest& request,
               CallResult& result, absl::BlockingCounter& done)
      : result_(result), done_(done) {
    request_.mutable_token_ids()->mutable_ids()->Assign(request.prompt.begin(),
                                                        request.prompt.end());
    request_.mutable_sampling()->set_temperature(0.0f);
    request_.set_max_tokens(request.max_tokens);
    request_.set_ignore_eos(true);
    context_.set_deadline(absl::ToChronoTime(absl::Now() + absl::Minutes(10)));
    start_ = absl::Now();
    router.async()->Generate(&context_, &request_, this);
    StartRead(&response_);
    StartCall();
  }

  void OnReadDone(bool ok) override {
    if (!ok) return;  // OnDone follows.
    if (result_.tokens.empty() && response_.token_ids_size() > 0) {
      result_.ttft_ms = absl::ToDoubleMilliseconds(absl::Now() - start_);
    }
    result_.tokens.insert(result_.tokens.end(), response_.token_ids().begin(),
                          response_.token_ids().end());
    StartRead(&response_);
  }

  void OnDone(const grpc::Status& status) override {
    result_.status = status;
    done_.DecrementCount();
  }

 private:
  CallResult& result_;
  absl::BlockingCounter& done_;
  grpc::ClientContext context_;
  v1::GenerateRequest request_;
  v1::GenerateResponse response_;
  absl::Time start_;
};

struct RunFigures {
  std::string label;
  int ok = 0;
  uint64_t prefill_computed = 0;  // On the prefill workers.
  uint64_t decode_computed = 0;   // Local prefill on the decode workers.
  // Prompt tokens taken from prefix caches: on the prefill workers (not
  // computed), on the decode workers (shared by Reserve: not moved, nor
  // computed by a local prefill).
  uint64_t prefill_cached = 0;
  uint64_t decode_cached = 0;
  uint64_t kv_bytes = 0;
  double ttft_p50 = 0, ttft_p90 = 0;
  double seconds = 0;
  std::vector<CallResult> results;
  uint64_t computed() const { return prefill_computed + decode_computed; }
};

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t rank = static_cast<size_t>(std::ceil(p * v.size()));
  return v[std::clamp<size_t>(rank, 1, v.size()) - 1];
}

// One configuration's figures over its `runs`: the counters' means (so
// that a row's parts still add up), the TTFT percentiles' medians (the
// mean of the middle two for an even count), the fewest requests ok.
RunFigures Aggregate(const std::vector<RunFigures>& runs) {
  auto mean = [&](uint64_t RunFigures::*field) {
    double sum = 0;
    for (const RunFigures& f : runs) sum += static_cast<double>(f.*field);
    return static_cast<uint64_t>(std::llround(sum / runs.size()));
  };
  auto median = [&](double RunFigures::*field) {
    std::vector<double> v;
    for (const RunFigures& f : runs) v.push_back(f.*field);
    std::sort(v.begin(), v.end());
    return (v[(v.size() - 1) / 2] + v[v.size() / 2]) / 2;
  };
  RunFigures m;
  m.label = runs.front().label;
  m.ok = runs.front().ok;
  for (const RunFigures& f : runs) m.ok = std::min(m.ok, f.ok);
  m.prefill_computed = mean(&RunFigures::prefill_computed);
  m.decode_computed = mean(&RunFigures::decode_computed);
  m.prefill_cached = mean(&RunFigures::prefill_cached);
  m.decode_cached = mean(&RunFigures::decode_cached);
  m.kv_bytes = mean(&RunFigures::kv_bytes);
  m.ttft_p50 = median(&RunFigures::ttft_p50);
  m.ttft_p90 = median(&RunFigures::ttft_p90);
  m.seconds = median(&RunFigures::seconds);
  return m;
}

absl::StatusOr<wire::LoadReport> GetLoad(LocalCluster& cluster,
                                         const std::string& worker,
                                         bool prefill) {
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(10)));
  wire::LoadReport report;
  grpc::Status s = prefill
                       ? cluster.PrefillStub(worker)->GetLoad(&ctx, {}, &report)
                       : cluster.DecodeStub(worker)->GetLoad(&ctx, {}, &report);
  if (!s.ok()) {
    return absl::UnavailableError(
        absl::StrCat("GetLoad ", worker, ": ", s.error_message()));
  }
  return report;
}

// The machine's 1-minute load average: other work competing for the
// cores shows in the TTFT figures.
std::string LoadAverage() {
  std::ifstream in("/proc/loadavg");
  std::string one_minute;
  in >> one_minute;
  return one_minute.empty() ? "?" : one_minute;
}

// A fresh cluster with `routing` (cluster.json's routing section), the
// workload replayed open-loop, then the workers' counters.
absl::StatusOr<RunFigures> Replay(const std::string& label,
                                  const std::string& routing,
                                  const std::vector<TraceRequest>& workload) {
  const std::string worker_args = absl::GetFlag(FLAGS_worker_args);
  const int num_prefill = absl::GetFlag(FLAGS_prefill_workers);
  const int num_decode = absl::GetFlag(FLAGS_decode_workers);
  std::cerr << "[" << label << "] starting " << num_prefill << "P" << num_decode
            << "D, routing " << routing << ", load average " << LoadAverage()
            << "\n";
  auto cluster = LocalCluster::Start({.prefill = num_prefill,
                                      .decode = num_decode,
                                      .model = absl::GetFlag(FLAGS_model),
                                      .prefill_args = worker_args,
                                      .decode_args = worker_args,
                                      .routing = routing},
                                     PDSERVE_SOURCE_DIR, PDSERVE_BINARY_DIR);
  if (!cluster.ok()) return cluster.status();

  RunFigures f;
  f.label = label;
  f.results.resize(workload.size());
  std::vector<std::unique_ptr<GenerateCall>> calls;
  calls.reserve(workload.size());
  absl::BlockingCounter done(static_cast<int>(workload.size()));
  const absl::Time start = absl::Now();
  absl::Time next_progress = start + absl::Seconds(10);
  for (size_t i = 0; i < workload.size(); ++i) {
    absl::SleepFor(start + workload[i].arrival - absl::Now());
    calls.push_back(std::make_unique<GenerateCall>(
        (*cluster)->router(), workload[i], f.results[i], done));
    if (absl::Now() >= next_progress) {
      std::cerr << absl::StrFormat("[%s] %.0f s: %d/%d sent\n", label,
                                   absl::ToDoubleSeconds(absl::Now() - start),
                                   i + 1, workload.size());
      next_progress += absl::Seconds(10);
    }
  }
  std::cerr << absl::StrFormat("[%s] %.0f s: all %d sent, waiting\n", label,
                               absl::ToDoubleSeconds(absl::Now() - start),
                               workload.size());
  done.Wait();
  f.seconds = absl::ToDoubleSeconds(absl::Now() - start);

  std::vector<double> ttft;
  for (const CallResult& r : f.results) {
    if (!r.status.ok()) continue;
    ++f.ok;
    ttft.push_back(r.ttft_ms);
  }
  f.ttft_p50 = Percentile(ttft, 0.5);
  f.ttft_p90 = Percentile(ttft, 0.9);
  for (int i = 0; i < num_prefill; ++i) {
    PD_ASSIGN_OR_RETURN(wire::LoadReport r,
                        GetLoad(**cluster, absl::StrCat("prefill-", i), true));
    f.prefill_computed += r.computed_prompt_tokens();
    f.prefill_cached += r.prefix_cached_tokens();
    for (const auto& t : r.kv_transports()) f.kv_bytes += t.bytes();
  }
  for (int i = 0; i < num_decode; ++i) {
    PD_ASSIGN_OR_RETURN(wire::LoadReport r,
                        GetLoad(**cluster, absl::StrCat("decode-", i), false));
    f.decode_computed += r.computed_prompt_tokens();
    f.decode_cached += r.prefix_cached_tokens();
  }
  std::cerr << absl::StrFormat(
      "[%s] done in %.1f s: %d/%d ok, %d computed (%d on decode), cached "
      "%d on prefill + %d on decode, %.1f MiB KV moved, TTFT p50 %.1f ms p90 "
      "%.1f ms, load average %s\n",
      label, f.seconds, f.ok, workload.size(), f.computed(), f.decode_computed,
      f.prefill_cached, f.decode_cached, f.kv_bytes / 1048576.0, f.ttft_p50,
      f.ttft_p90, LoadAverage());
  return f;
}

// "value (ratio)" against the baseline, `digits` after the point.
std::string WithRatio(double value, double base, int digits) {
  return absl::StrCat(absl::StrFormat("%.*f", digits, value),
                      base > 0 ? absl::StrFormat(" (%.2f)", value / base)
                               : std::string(" (-)"));
}

void PrintTable(const std::vector<RunFigures>& runs, const char* first_column,
                size_t num_requests) {
  const RunFigures& base = runs.front();
  std::cout << "| " << first_column
            << " | ok | prompt tokens computed | of which on decode | "
               "cache hits on prefill | cache hits on decode | KV MiB moved | "
               "TTFT p50 ms | TTFT p90 ms |\n"
               "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n";
  for (const RunFigures& f : runs) {
    std::cout << absl::StrFormat(
        "| %s | %d/%d | %s | %d | %d | %d | %s | %s | %s |\n", f.label, f.ok,
        num_requests, WithRatio(f.computed(), base.computed(), 0),
        f.decode_computed, f.prefill_cached, f.decode_cached,
        WithRatio(f.kv_bytes / 1048576.0, base.kv_bytes / 1048576.0, 1),
        WithRatio(f.ttft_p50, base.ttft_p50, 1),
        WithRatio(f.ttft_p90, base.ttft_p90, 1));
  }
}

// Requests whose outputs differ from the reference run's (or failed in
// either), printed.
int CountMismatches(const RunFigures& reference, const RunFigures& run) {
  int mismatches = 0;
  for (size_t i = 0; i < run.results.size(); ++i) {
    const CallResult& a = reference.results[i];
    const CallResult& b = run.results[i];
    if (a.status.ok() && b.status.ok() && a.tokens == b.tokens) continue;
    ++mismatches;
    std::cerr << absl::StrFormat(
        "mismatch: request %d, %s (%s, %d tokens) vs %s (%s, %d tokens)\n", i,
        reference.label, a.status.ok() ? "ok" : a.status.error_message(),
        a.tokens.size(), run.label,
        b.status.ok() ? "ok" : b.status.error_message(), b.tokens.size());
  }
  return mismatches;
}

int Run() {
  const std::string model = absl::GetFlag(FLAGS_model);
  Scaling scale{.block_tokens = absl::GetFlag(FLAGS_block_tokens),
                .max_output_tokens = absl::GetFlag(FLAGS_max_output_tokens),
                .time_compression = absl::GetFlag(FLAGS_time_compression)};
  PD_CHECK(scale.block_tokens > 0 &&
           kTraceBlockTokens % scale.block_tokens == 0)
      << "--block_tokens must divide 512";
  PD_CHECK(scale.max_output_tokens > 0 && scale.time_compression > 0);
  auto fail = [](const absl::Status& s) {
    std::cerr << "pd-prefix-bench: " << s << "\n";
    return 1;
  };
  auto info = LoadModelInfo(model);
  if (!info.ok()) return fail(info.status());
  scale.context = (*info)->config().max_position_embeddings;
  auto workload = LoadTrace(absl::GetFlag(FLAGS_trace),
                            absl::GetFlag(FLAGS_requests), scale);
  if (!workload.ok()) return fail(workload.status());
  int64_t prompt_tokens = 0, output_tokens = 0;
  for (const TraceRequest& r : *workload) {
    prompt_tokens += r.prompt.size();
    output_tokens += r.max_tokens;
  }

  // Every configuration once per round, rounds interleaved, so that a
  // burst of load from outside the benchmark spreads over all of them.
  struct Config {
    std::string label;
    std::string routing;
    bool sweep = false;
  };
  std::vector<Config> configs;
  for (absl::string_view p :
       absl::StrSplit(absl::GetFlag(FLAGS_policies), ',', absl::SkipEmpty())) {
    configs.push_back({.label = std::string(p),
                       .routing = absl::StrFormat(R"({"policy": "%s"})", p)});
  }
  PD_CHECK(!configs.empty()) << "empty --policies";
  for (absl::string_view t : absl::StrSplit(
           absl::GetFlag(FLAGS_local_prefill_sweep), ',', absl::SkipEmpty())) {
    int64_t threshold = 0;
    PD_CHECK(absl::SimpleAtoi(t, &threshold) && threshold >= 0)
        << "bad --local_prefill_sweep";
    configs.push_back(
        {.label = absl::StrCat(threshold),
         .routing = absl::StrFormat(
             R"({"policy": "kv_aware", "local_prefill_max_tokens": %d})",
             threshold),
         .sweep = true});
  }
  const int rounds = absl::GetFlag(FLAGS_rounds);
  PD_CHECK(rounds >= 1) << "bad --rounds";
  // runs[c]: configuration c's runs, one per round.
  std::vector<std::vector<RunFigures>> runs(configs.size());
  for (int r = 0; r < rounds; ++r) {
    for (size_t c = 0; c < configs.size(); ++c) {
      const std::string label = absl::StrCat(
          configs[c].sweep ? "kv_aware, local_prefill_max_tokens " : "",
          configs[c].label, ", round ", r + 1, "/", rounds);
      auto f = Replay(label, configs[c].routing, *workload);
      if (!f.ok()) return fail(f.status());
      f->label = configs[c].label;
      runs[c].push_back(*std::move(f));
    }
  }
  std::vector<RunFigures> policy_runs, sweep_runs;
  for (size_t c = 0; c < configs.size(); ++c) {
    (configs[c].sweep ? sweep_runs : policy_runs).push_back(Aggregate(runs[c]));
  }

  int mismatches = 0;
  for (const auto& config_runs : runs) {
    for (const RunFigures& f : config_runs) {
      if (&f != &runs[0][0]) mismatches += CountMismatches(runs[0][0], f);
    }
  }

  const int factor = kTraceBlockTokens / scale.block_tokens;
  std::cout << absl::StrFormat(
      "workload: first %d requests of %s; each 512-token trace block -> %d "
      "tokens (lengths / %d, rounded up), outputs capped at %d, prompts cut "
      "to %d - output tokens; arrivals / %.2f (%.1f s); %d prompt tokens, %d "
      "output tokens in all\n",
      workload->size(), absl::GetFlag(FLAGS_trace), scale.block_tokens, factor,
      scale.max_output_tokens, scale.context, scale.time_compression,
      absl::ToDoubleSeconds(workload->back().arrival), prompt_tokens,
      output_tokens);
  std::cout << absl::StrFormat(
      "cluster: %dP%dD %s, worker flags '%s', default routing thresholds "
      "unless given; ratios (in parentheses) against %s, and in the sweep "
      "against its first value; %d interleaved round(s): counters their "
      "means, TTFT percentiles their medians\n\n",
      absl::GetFlag(FLAGS_prefill_workers), absl::GetFlag(FLAGS_decode_workers),
      model, absl::GetFlag(FLAGS_worker_args), policy_runs[0].label, rounds);
  PrintTable(policy_runs, "policy", workload->size());
  if (!sweep_runs.empty()) {
    std::cout << "\nkv_aware by local_prefill_max_tokens (default "
              << RoutingOptions{}.local_prefill_max_tokens << ")\n\n";
    PrintTable(sweep_runs, "local_prefill_max_tokens", workload->size());
  }
  if (rounds > 1) {
    std::cout << "\nTTFT p50 / p90 ms of each round:\n\n";
    for (size_t c = 0; c < configs.size(); ++c) {
      std::cout << "- " << (configs[c].sweep ? "local_prefill_max_tokens " : "")
                << configs[c].label << ":";
      for (const RunFigures& f : runs[c]) {
        std::cout << absl::StrFormat(" %.0f / %.0f;", f.ttft_p50, f.ttft_p90);
      }
      std::cout << "\n";
    }
  }
  std::cout << "\ngreedy outputs (request by request, every run) differing "
               "from the first run's ("
            << runs[0][0].label << "): " << mismatches << "\n";
  return mismatches == 0 ? 0 : 1;
}

}  // namespace
}  // namespace pdserve

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return pdserve::Run();
}
