// What the fault-injection suite (tests/fault/fault_test.cc) and the soak
// benchmark (bench/fault_soak.cc) share: a mixed load of concurrent
// Generate streams against a real cluster, its fault-free reference output
// (the colocated engine, which the cluster tests prove the disaggregated
// cluster equals), the verdict on every stream after a fault, the checks on
// the cluster's processes afterwards (KV blocks back, nobody crashed, no
// canary violation), and the fault matrix they print.
//
// Not thread-safe unless a function says so; one scenario at a time.
#ifndef PDSERVE_TESTS_FAULT_FAULT_HARNESS_H_
#define PDSERVE_TESTS_FAULT_FAULT_HARNESS_H_

#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/metrics.h"
#include "engine/builtin_tiny.h"
#include "engine/generator.h"
#include "engine/model_runner.h"
#include "grpcpp/grpcpp.h"
#include "pdserve/internal/v1/worker.grpc.pb.h"
#include "pdserve/v1/generation.grpc.pb.h"
#include "tests/cluster/local_cluster.h"
#include "tests/cluster/stream_case.h"
#include "tests/common/metrics_test_util.h"

namespace pdserve::fault {

namespace v1 = ::pdserve::v1;
namespace internal_v1 = ::pdserve::internal::v1;

using testing_util::StreamCase;
using testing_util::ToRequest;

// `n` streams of builtin:tiny drawn from `seed`: prompts of 1 to 60 tokens
// and, one in four, 150 to 300 (several prefill chunks of the test
// workers' 64); half greedy, half seeded sampling; 8 to 40 new tokens,
// most ignoring EOS.
inline std::vector<StreamCase> MixedLoad(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<StreamCase> cases;
  for (int i = 0; i < n; ++i) {
    const int length = i % 4 == 0 ? 150 + static_cast<int>(rng() % 150)
                                  : 1 + static_cast<int>(rng() % 60);
    std::vector<int32_t> prompt = {256};  // builtin:tiny's BOS, then bytes.
    while (static_cast<int>(prompt.size()) < length)
      prompt.push_back(rng() % 256);
    SamplingParams sampling{.temperature = 0.0f,
                            .max_tokens = 8 + static_cast<int32_t>(rng() % 33)};
    if (i % 2 == 1) {
      sampling.temperature = 0.8f;
      sampling.top_p = 0.95f;
      sampling.seed = rng();
    }
    sampling.ignore_eos = i % 3 != 0;
    cases.push_back({std::move(prompt), sampling});
  }
  return cases;
}

// The fault-free output of every case: the colocated engine in this
// process, all cases in one batch.
inline absl::StatusOr<std::vector<std::vector<int32_t>>> ReferenceOutputs(
    const std::vector<StreamCase>& cases) {
  absl::StatusOr<std::shared_ptr<const Model>> model = MakeTinyModel();
  if (!model.ok()) return model.status();
  absl::StatusOr<std::unique_ptr<ModelRunner>> runner =
      CreateModelRunner(*model, {.num_kv_blocks = 2048, .num_threads = 1});
  if (!runner.ok()) return runner.status();
  absl::StatusOr<std::unique_ptr<Generator>> generator =
      Generator::Create(runner->get(), {});
  if (!generator.ok()) return generator.status();
  for (size_t i = 0; i < cases.size(); ++i) {
    absl::Status added =
        (*generator)->Add({RequestId(i), cases[i].prompt, cases[i].sampling});
    if (!added.ok()) return added;
  }
  std::vector<std::vector<int32_t>> out(cases.size());
  std::vector<GenerationEvent> events;
  while ((*generator)->HasWork()) {
    events.clear();
    absl::Status stepped = (*generator)->Step(events);
    if (!stepped.ok()) return stepped;
    for (const GenerationEvent& e : events) {
      if (e.has_token) out[e.id.value].push_back(e.token.token);
    }
  }
  return out;
}

struct StreamOutcome {
  grpc::Status status;
  std::vector<int32_t> tokens;  // Of the last attempt.
  int attempts = 0;
  absl::Duration elapsed;
};

// One attempt of `request` through `router` within `deadline`: its status
// and tokens. `on_token` (when set) runs at every token's arrival.
inline StreamOutcome StreamOnce(v1::Generation::Stub& router,
                                const v1::GenerateRequest& request,
                                absl::Duration deadline,
                                const std::function<void()>& on_token = {}) {
  StreamOutcome out;
  out.attempts = 1;
  const absl::Time start = absl::Now();
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(start + deadline));
  auto reader = router.Generate(&context, request);
  v1::GenerateResponse response;
  while (reader->Read(&response)) {
    out.tokens.insert(out.tokens.end(), response.token_ids().begin(),
                      response.token_ids().end());
    if (on_token && response.token_ids_size() > 0) on_token();
  }
  out.status = reader->Finish();
  out.elapsed = absl::Now() - start;
  return out;
}

struct LoadOptions {
  // Deadline of each attempt. Default: 60 s.
  absl::Duration deadline = absl::Seconds(60);
  // Retries a stream that ended UNAVAILABLE, from the start, as a client
  // whose server restarted would (the outputs are deterministic, so a
  // retry must give the same tokens). Default: false (UNAVAILABLE stands).
  bool retry_unavailable = false;
  // How long a stream keeps retrying. Default: 30 s.
  absl::Duration retry_for = absl::Seconds(30);
};

// Every case as a concurrent stream through `router`, started at
// construction. Thread-safe.
class LoadRun {
 public:
  LoadRun(v1::Generation::Stub& router, const std::vector<StreamCase>& cases,
          LoadOptions options = {})
      : outcomes_(cases.size()) {
    for (size_t i = 0; i < cases.size(); ++i) {
      threads_.emplace_back(
          [this, &router, request = ToRequest(cases[i]), options, i] {
            outcomes_[i] = Run(router, request, options);
          });
    }
  }
  ~LoadRun() { (void)Join(); }

  // Streams that have had at least one token (so are decoding or done).
  int streaming() const { return streaming_.load(); }

  const std::vector<StreamOutcome>& Join() {
    for (std::thread& t : threads_) {
      if (t.joinable()) t.join();
    }
    return outcomes_;
  }

 private:
  StreamOutcome Run(v1::Generation::Stub& router,
                    const v1::GenerateRequest& request,
                    const LoadOptions& options) {
    StreamOutcome out;
    const absl::Time start = absl::Now();
    bool counted = false;
    while (true) {
      const int attempts = out.attempts + 1;
      out = StreamOnce(router, request, options.deadline, [&] {
        if (!counted) ++streaming_;
        counted = true;
      });
      out.attempts = attempts;
      if (out.status.error_code() != grpc::StatusCode::UNAVAILABLE ||
          !options.retry_unavailable ||
          absl::Now() - start > options.retry_for) {
        break;
      }
      absl::SleepFor(absl::Milliseconds(200));
    }
    out.elapsed = absl::Now() - start;
    return out;
  }

  std::vector<StreamOutcome> outcomes_;
  std::vector<std::thread> threads_;
  std::atomic<int> streaming_ = 0;
};

// One row of the fault matrix, and what went wrong.
struct ScenarioTally {
  std::string scenario;
  int faults = 0;  // Faults injected: kills, stops, restarts, kv_fault log
                   // lines, link spells.
  int streams = 0;
  int completed_equal = 0;
  int completed_different = 0;  // Must be 0.
  int retried = 0;              // Streams that needed more than one attempt.
  std::map<std::string, int> failed_by_code;
  int64_t leaked_blocks = 0;          // Must be 0.
  int canary_violations = 0;          // Must be 0.
  int migrations = -1;                // The router's count (-1: not reported).
  std::vector<std::string> problems;  // Each a broken expectation.
};

// A status a client can act on: one of the codes a fault may end a stream
// with, and a message saying why.
inline bool IsClearFailure(const grpc::Status& status) {
  switch (status.error_code()) {
    case grpc::StatusCode::UNAVAILABLE:
    case grpc::StatusCode::DEADLINE_EXCEEDED:
    case grpc::StatusCode::ABORTED:
    case grpc::StatusCode::RESOURCE_EXHAUSTED:
      return !status.error_message().empty();
    default:
      return false;
  }
}

inline std::string CodeName(grpc::StatusCode code) {
  return absl::StatusCodeToString(static_cast<absl::StatusCode>(code));
}

// Each stream: completed with the reference's tokens, or ended with a
// clear status after streaming only a prefix of them.
inline void JudgeStreams(const std::vector<std::vector<int32_t>>& reference,
                         const std::vector<StreamOutcome>& outcomes,
                         ScenarioTally& tally) {
  for (size_t i = 0; i < outcomes.size(); ++i) {
    const StreamOutcome& o = outcomes[i];
    const std::vector<int32_t>& want = reference[i];
    ++tally.streams;
    tally.retried += o.attempts > 1;
    if (o.status.ok()) {
      if (o.tokens == want) {
        ++tally.completed_equal;
      } else {
        ++tally.completed_different;
        tally.problems.push_back(absl::StrCat(
            "stream ", i, " completed with ", o.tokens.size(),
            " tokens that differ from the fault-free run's ", want.size()));
      }
      continue;
    }
    ++tally.failed_by_code[CodeName(o.status.error_code())];
    if (!IsClearFailure(o.status)) {
      tally.problems.push_back(
          absl::StrCat("stream ", i, " ended with an unclear status ",
                       CodeName(o.status.error_code()), ": '",
                       o.status.error_message(), "'"));
    }
    if (o.tokens.size() > want.size() ||
        !std::equal(o.tokens.begin(), o.tokens.end(), want.begin())) {
      tally.problems.push_back(absl::StrCat(
          "stream ", i,
          " streamed tokens the fault-free run does not have before ",
          CodeName(o.status.error_code())));
    }
  }
}

// The sum of every sample of metric `name` (any labels) in a Prometheus
// text exposition; -1 when it has none or one does not read.
inline double MetricSum(const std::string& exposition,
                        const std::string& name) {
  const absl::StatusOr<std::optional<double>> sum =
      SumOfSamples(exposition, name);
  return sum.ok() ? sum->value_or(-1) : -1;
}

// One process of a cluster under test.
struct ClusterProcess {
  std::string name;     // "router", "prefill-0", "decode-1", ...
  std::string address;  // Its gRPC address.
  std::string metrics_host = "127.0.0.1";
  int metrics_port = 0;
  pid_t pid = 0;
  bool decode() const { return name.starts_with("decode"); }
};

// How many faults --kv_fault injected, from the "kv_fault:" lines of a
// worker's log.
inline int KvFaultsLogged(const std::string& log) {
  int count = 0;
  for (size_t at = log.find("kv_fault: "); at != std::string::npos;
       at = log.find("kv_fault: ", at + 1)) {
    ++count;
  }
  return count;
}

// The processes of a LocalCluster of `prefill` and `decode` workers.
inline std::vector<ClusterProcess> Processes(
    const testing_util::LocalCluster& cluster, int prefill, int decode) {
  std::vector<std::string> names = {"router"};
  for (int i = 0; i < prefill; ++i)
    names.push_back(absl::StrCat("prefill-", i));
  for (int i = 0; i < decode; ++i) names.push_back(absl::StrCat("decode-", i));
  std::vector<ClusterProcess> out;
  for (const std::string& name : names) {
    out.push_back({.name = name,
                   .address = cluster.Address(name),
                   .metrics_port = cluster.MetricsPort(name),
                   .pid = cluster.Pid(name)});
  }
  return out;
}

// After a scenario: every process not in `killed` still runs; every such
// decode worker has all its KV blocks free again within `settle` and
// counts no canary violation (the clusters run --kv_canary); the router's
// migrations are read when it reports them. `credentials` reach the
// workers' gRPC (null: plaintext).
inline void CheckProcesses(
    const std::vector<ClusterProcess>& processes,
    const std::set<std::string>& killed, ScenarioTally& tally,
    absl::Duration settle = absl::Seconds(15),
    std::shared_ptr<grpc::ChannelCredentials> credentials = nullptr) {
  if (credentials == nullptr) credentials = grpc::InsecureChannelCredentials();
  tally.canary_violations = 0;
  for (const ClusterProcess& p : processes) {
    if (killed.contains(p.name)) continue;
    if (!testing_util::LocalCluster::ProcessRunning(p.pid)) {
      tally.problems.push_back(
          absl::StrCat(p.name, " (pid ", p.pid, ") is no longer running"));
      continue;
    }
    absl::StatusOr<std::string> metrics =
        testing_util::HttpGet(p.metrics_port, "/metrics", p.metrics_host);
    if (p.name == "router") {
      if (metrics.ok()) {
        const double migrations =
            MetricSum(*metrics, "pdserve_router_migrations_total");
        tally.migrations = migrations < 0 ? -1 : static_cast<int>(migrations);
      }
      continue;
    }
    if (!p.decode()) continue;
    auto stub = internal_v1::DecodeWorker::NewStub(
        grpc::CreateChannel(p.address, credentials));
    internal_v1::LoadReport load;
    bool answered = false;
    const absl::Time give_up = absl::Now() + settle;
    do {
      grpc::ClientContext context;
      context.set_deadline(absl::ToChronoTime(absl::Now() + absl::Seconds(2)));
      answered = stub->GetLoad(&context, {}, &load).ok();
      if (answered && load.free_blocks() == load.total_blocks()) break;
      absl::SleepFor(absl::Milliseconds(100));
    } while (absl::Now() < give_up);
    if (!answered) {
      tally.problems.push_back(
          absl::StrCat(p.name, " does not answer GetLoad"));
    } else if (load.free_blocks() != load.total_blocks()) {
      tally.leaked_blocks += load.total_blocks() - load.free_blocks();
      tally.problems.push_back(absl::StrCat(
          p.name, " still holds ", load.total_blocks() - load.free_blocks(),
          " of its ", load.total_blocks(), " KV blocks ",
          absl::ToInt64Seconds(settle), " s after the load (",
          load.reservations(), " reservations, ", load.running(), " running, ",
          load.waiting(), " waiting)"));
    }
    if (answered && load.kv_canary_violations() > 0) {
      tally.canary_violations += static_cast<int>(load.kv_canary_violations());
      tally.problems.push_back(absl::StrCat(
          p.name, " found ", load.kv_canary_violations(),
          " free KV blocks written while nobody owned them (canary)"));
    }
  }
}

// The fault matrix as a Markdown table, one row per scenario.
inline std::string FormatMatrix(const std::vector<ScenarioTally>& tallies) {
  std::string out =
      "| scenario | faults | streams | completed equal | completed different | "
      "failed by code | retried "
      "| migrations | leaked blocks | canary violations | verdict |\n"
      "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n";
  for (const ScenarioTally& t : tallies) {
    std::string failed;
    for (const auto& [code, count] : t.failed_by_code) {
      absl::StrAppend(&failed, failed.empty() ? "" : ", ", code, " ", count);
    }
    absl::StrAppendFormat(
        &out, "| %s | %d | %d | %d | %d | %s | %d | %s | %d | %s | %s |\n",
        t.scenario, t.faults, t.streams, t.completed_equal,
        t.completed_different, failed.empty() ? "-" : failed, t.retried,
        t.migrations < 0 ? "n/a" : absl::StrCat(t.migrations), t.leaked_blocks,
        absl::StrCat(t.canary_violations),
        t.problems.empty() ? "pass" : "FAIL");
  }
  return out;
}

}  // namespace pdserve::fault

#endif  // PDSERVE_TESTS_FAULT_FAULT_HARNESS_H_
