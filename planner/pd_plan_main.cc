// pd-plan: capacity planning on the prefill:decode ratio.
//
//   pd-plan profile   --out=profile.json [--worker_cpus=0.5 --model=...]
//       measures this machine's workers (planner/profiler.h)
//   pd-plan simulate  --profile=profile.json --prefill=X --decode=Y <workload> <load>
//       the summary pd-bench would print, from the simulator
//   pd-plan search    --profile=profile.json --workers=N <workload> <slo>
//       the xPyD (x + y <= N, colocated 0PyD included) with the highest
//       goodput per worker, and why
//   pd-plan validate  --profile=profile.json --configs=1P1D,0P2D <workload> <load>
//       pd-bench on real clusters next to the simulation; the error of every
//       figure (exit 1 past --max_error)
//
// <workload> <load> <slo>: the flags of planner/workload_flags.h, the same
// as pd-bench's. docs/capacity_planning.md walks through a plan.
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "bench/bench_process.h"
#include "common/status_macros.h"
#include "google/protobuf/util/json_util.h"
#include "planner/simulator.h"
#include "planner/workload_flags.h"
#include "engine/model.h"
#include "planner/loadgen.h"
#include "planner/profiler.h"

ABSL_FLAG(std::string, out, "profile.json", "profile: where the profile goes");
ABSL_FLAG(std::string, profile, "", "simulate, search, validate: the profile to read");
ABSL_FLAG(std::string, model, "builtin:tiny", "profile: the model every worker serves");
ABSL_FLAG(double, worker_cpus, 0,
          "profile: CPUs of time each worker is held to (cgroup cpu quota; needs root); "
          "0: no limit");
ABSL_FLAG(int32_t, threads, 1, "profile: engine threads of each worker");
ABSL_FLAG(int32_t, block_size, 16, "profile: tokens per KV block");
ABSL_FLAG(int32_t, max_batch_tokens, 512, "profile: token budget of an engine step");
ABSL_FLAG(int32_t, max_running, 64, "profile: most sequences in a batch");
ABSL_FLAG(int32_t, prefill_kv_cache_mb, 64, "profile: KV pool of each prefill worker, MiB");
ABSL_FLAG(int32_t, decode_kv_cache_mb, 64, "profile: KV pool of each decode worker, MiB");
ABSL_FLAG(int32_t, max_context, 1024, "profile: longest decode context measured");
ABSL_FLAG(std::vector<std::string>, transports, {"tcp"},
          "profile: KV transports to measure (the first is the clusters')");
ABSL_FLAG(int32_t, reps, 5, "profile: repetitions of each measured step");
ABSL_FLAG(std::string, samples_out, "", "(internal) profile_engine: where the samples go");
ABSL_FLAG(bool, probe, false, "(internal) profile_engine: the drift probe's short design");
ABSL_FLAG(std::string, bin, "", "The build directory with the pdserve binaries "
          "(default: the one this pd-plan was built in)");
ABSL_FLAG(std::string, run_dir, "", "Where clusters keep ports and logs (default: a temporary "
          "directory)");
ABSL_FLAG(int32_t, prefill, 1, "simulate: prefill workers (0: colocated)");
ABSL_FLAG(int32_t, decode, 1, "simulate: decode workers");
ABSL_FLAG(std::string, routing, "",
          "The cluster config's routing section as JSON (docs/routing.md); default kv_aware");
ABSL_FLAG(std::string, records, "", "simulate: per-request records (JSONL) of the last level");
ABSL_FLAG(int32_t, repeats, 1,
          "validate: measure each load this many times on the same cluster and compare with "
          "the median of each figure (the table also gives the runs' range)");
ABSL_FLAG(std::string, records_dir, "",
          "validate: write each run's per-request records here, predicted and measured side by "
          "side (CONFIG-LEVEL.predicted.jsonl, .measured.jsonl), for planner/compare_records.py; "
          "with --measured_json, the earlier run's measured records are read from here where "
          "they are, and its figures summarized again from them");
ABSL_FLAG(std::string, summary_json, "", "Write the summary (JSON) here");
ABSL_FLAG(int32_t, workers, 4, "search: the worker budget (x + y <= workers)");
ABSL_FLAG(std::vector<std::string>, configs, {"1P1D"},
          "validate: the xPyD configurations to run, e.g. 0P2D,1P1D");
ABSL_FLAG(std::string, measured_json, "",
          "validate: compare with the measurements of an earlier validate's --summary_json "
          "(same workload, load and SLO flags) instead of running the clusters again: "
          "predictions of a new profile against the same runs");
ABSL_FLAG(double, max_error, 0.10,
          "validate: largest relative error of the P90 TTFT and P90 TPOT predictions that passes");
ABSL_FLAG(double, max_tpot_error, -1,
          "validate: the bound for P90 TPOT alone (default: --max_error)");
ABSL_FLAG(double, max_attainment_error, 0.03,
          "validate: largest attainment error (as a share, 0.03 = 3 points) that passes");
ABSL_FLAG(bool, drift_check, true,
          "validate: before each configuration's runs, keep the workers that prefill (prefill "
          "workers, or decode workers when colocated) busy for a few seconds, as pd-plan profile "
          "did for its engine scales, and scale every worker's CPU costs by their measured / "
          "predicted step time; with --measured_json, the drift the earlier run measured");
ABSL_FLAG(double, drift_threshold, 0,
          "validate: apply the drift check's scaling only when it is off by more than this "
          "share (default: always; docs/capacity_planning.md run 27)");
ABSL_FLAG(double, engine_scale, 1,
          "simulate, search, validate: multiply the profile's CPU costs (engine steps, decode "
          "step overheads, serving threads) by this, as the drift check does: what if the "
          "workers run 5% slower (1.05) than profiled");

namespace pdserve::planner {
namespace {

std::string SelfPath() { return std::filesystem::read_symlink("/proc/self/exe").string(); }

std::string BinaryDir() {
  const std::string flag = absl::GetFlag(FLAGS_bin);
  return flag.empty() ? PDSERVE_BINARY_DIR : flag;
}

std::string RunDir(const std::string& name) {
  std::string dir = absl::GetFlag(FLAGS_run_dir);
  if (dir.empty()) dir = absl::StrCat(std::filesystem::temp_directory_path().string(), "/pd-plan-",
                                      getpid());
  return absl::StrCat(dir, "/", name);
}

void Progress(std::string_view line) { std::cerr << "pd-plan: " << line << "\n"; }

// validate --records_dir: one run's records as CONFIG-LEVEL.KIND.jsonl, the
// level's name made a file name ("3 req/s" -> "3rps"); KIND is "predicted",
// "measured" (the first run) or "measured-K" (run K of --repeats).
std::string RunRecordsPath(const std::string& config, const LoadLevel& level,
                           const std::string& kind) {
  const std::string name = absl::StrReplaceAll(level.Name(), {{" req/s", "rps"}, {" ", "-"}});
  return absl::StrCat(absl::GetFlag(FLAGS_records_dir), "/", config, "-", name, ".", kind,
                      ".jsonl");
}

std::string MeasuredKind(int32_t run) {
  return run == 1 ? "measured" : absl::StrCat("measured-", run);
}

absl::Status WriteRunRecords(const std::string& config, const LoadLevel& level,
                             const std::string& kind, std::span<const RequestRecord> records) {
  const std::string dir = absl::GetFlag(FLAGS_records_dir);
  if (dir.empty()) return absl::OkStatus();
  std::error_code error;
  std::filesystem::create_directories(dir, error);
  if (error) {
    return absl::InvalidArgumentError(
        absl::StrCat("--records_dir: cannot create ", dir, ": ", error.message()));
  }
  return WriteRecords(RunRecordsPath(config, level, kind), records);
}

// An earlier validate's measured runs of one point, summarized again from
// their records in --records_dir; none when it holds no records of the
// point (or there is no --records_dir).
absl::StatusOr<std::vector<Summary>> EarlierRecords(const std::string& config,
                                                    const LoadLevel& level,
                                                    const SummarySpec& spec) {
  std::vector<Summary> runs;
  if (absl::GetFlag(FLAGS_records_dir).empty()) return runs;
  for (int32_t run = 1;; ++run) {
    const std::string path = RunRecordsPath(config, level, MeasuredKind(run));
    if (!std::filesystem::exists(path)) break;
    PD_ASSIGN_OR_RETURN(const std::vector<RequestRecord> records, ReadRecords(path));
    runs.push_back(Summarize(records, spec.OptionsFor(records)));
  }
  return runs;
}

EngineProfileOptions EngineOptionsFromFlags() {
  EngineProfileOptions o;
  o.model = absl::GetFlag(FLAGS_model);
  o.threads = absl::GetFlag(FLAGS_threads);
  o.block_size = absl::GetFlag(FLAGS_block_size);
  o.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  o.max_running = absl::GetFlag(FLAGS_max_running);
  o.max_context = absl::GetFlag(FLAGS_max_context);
  o.reps = absl::GetFlag(FLAGS_reps);
  o.cpu_share = absl::GetFlag(FLAGS_worker_cpus);
  o.probe = absl::GetFlag(FLAGS_probe);
  o.progress = Progress;
  return o;
}

// The child of `profile` that runs under the workers' CPU share.
absl::Status ProfileEngine() {
  PD_ASSIGN_OR_RETURN(std::vector<StepSample> samples,
                      MeasureEngineSteps(EngineOptionsFromFlags()));
  Progress("transfers");
  PD_ASSIGN_OR_RETURN(std::vector<TransferCost> transfers,
                      MeasureTransfers(absl::GetFlag(FLAGS_transports), absl::GetFlag(FLAGS_reps)));
  nlohmann::json out = {{"samples", nlohmann::json::array()},
                        {"transfers", nlohmann::json::array()}};
  for (const StepSample& s : samples) {
    out["samples"].push_back({{"tokens", s.tokens}, {"sequences", s.sequences},
                              {"attention", s.attention},
                              {"decode_attention", s.decode_attention}, {"seconds", s.seconds},
                              {"kind", s.kind}, {"after_prefill", s.after_prefill}});
  }
  for (const TransferCost& t : transfers) {
    out["transfers"].push_back(
        {{"transport", t.transport}, {"latency_s", t.latency_s}, {"bytes_per_s", t.bytes_per_s}});
  }
  std::ofstream(absl::GetFlag(FLAGS_samples_out)) << out.dump() << "\n";
  return absl::OkStatus();
}

// Engine steps (and transfers over `transports`) measured by a child,
// `pd-plan profile_engine`, under the workers' CPU share (o.cpu_share) when
// there is one.
struct ChildMeasurement {
  std::vector<StepSample> samples;
  std::vector<TransferCost> transfers;
};

absl::StatusOr<ChildMeasurement> MeasureInChild(const EngineProfileOptions& o,
                                                const std::vector<std::string>& transports,
                                                const std::string& dir) {
  std::filesystem::create_directories(dir);
  const std::string samples_path = dir + "/engine_samples.json";
  const std::string share_script = std::string(PDSERVE_SOURCE_DIR) + "/deploy/local/cpu_share.sh";
  const std::string group = absl::StrCat("pdserve.profile.", getpid());
  std::string command;
  if (o.cpu_share > 0) {
    command = absl::StrCat(ShellQuote(share_script), " run ", absl::StrFormat("%g", o.cpu_share),
                           " ", group, " ");
  }
  absl::StrAppend(
      &command, ShellQuote(SelfPath()), " profile_engine --model=", ShellQuote(o.model),
      " --threads=", o.threads, " --block_size=", o.block_size,
      " --max_batch_tokens=", o.max_batch_tokens, " --max_running=", o.max_running,
      " --max_context=", o.max_context, " --reps=", o.reps,
      " --worker_cpus=", absl::StrFormat("%g", o.cpu_share), " --probe=", o.probe ? "true" : "false",
      " --transports=", ShellQuote(absl::StrJoin(transports, ",")),
      " --samples_out=", ShellQuote(samples_path));
  const int rc = std::system(command.c_str());
  if (o.cpu_share > 0) std::system(absl::StrCat(ShellQuote(share_script), " remove ", group).c_str());
  if (rc != 0) return absl::InternalError(absl::StrCat("the engine profile failed: ", command));
  std::ifstream in(samples_path);
  const nlohmann::json measured = nlohmann::json::parse(in, nullptr, false);
  if (measured.is_discarded()) return absl::InternalError("unreadable " + samples_path);
  ChildMeasurement out;
  for (const auto& s : measured["samples"]) {
    out.samples.push_back({.tokens = s["tokens"], .sequences = s["sequences"],
                           .attention = s["attention"], .decode_attention = s["decode_attention"],
                           .seconds = s["seconds"], .kind = s["kind"],
                           .after_prefill = s["after_prefill"]});
  }
  for (const auto& t : measured["transfers"]) {
    out.transfers.push_back(
        {.transport = t["transport"], .latency_s = t["latency_s"], .bytes_per_s = t["bytes_per_s"]});
  }
  return out;
}

// The profile's drift probe (DriftProbeOptions), run now in a child under
// its share: its ProbeRatio (profiler.h).
absl::StatusOr<double> ProbeRatioNow(const Profile& profile, const std::string& dir) {
  PD_ASSIGN_OR_RETURN(ChildMeasurement probe, MeasureInChild(DriftProbeOptions(profile), {}, dir));
  return ProbeRatio(profile, probe.samples);
}

// "1: 441 us, 2: 539 us, ...": the step model's dense table, with its
// base, per-token and per-sequence costs where a profile has them.
std::string DenseTable(const StepCost& step) {
  std::vector<std::string> parts;
  for (size_t i = 0; i < step.dense_tokens.size(); ++i) {
    parts.push_back(absl::StrFormat("%d: %.0f us", step.dense_tokens[i], step.dense_s[i] * 1e6));
  }
  if (step.base_s > 0 || step.per_token_s > 0 || step.per_sequence_s > 0) {
    parts.push_back(absl::StrFormat("plus %.1f us + %.2f us per token + %.2f us per sequence",
                                    step.base_s * 1e6, step.per_token_s * 1e6,
                                    step.per_sequence_s * 1e6));
  }
  return parts.empty() ? "none" : absl::StrJoin(parts, ", ");
}

absl::Status RunProfile() {
  const double cpus = absl::GetFlag(FLAGS_worker_cpus);
  Progress(absl::StrCat("engine steps and transfers",
                        cpus > 0 ? absl::StrFormat(" under a %g-CPU share", cpus) : ""));
  PD_ASSIGN_OR_RETURN(ChildMeasurement measured,
                      MeasureInChild(EngineOptionsFromFlags(), absl::GetFlag(FLAGS_transports),
                                     RunDir("profile")));
  const std::vector<StepSample>& samples = measured.samples;
  Profile p;
  p.model = absl::GetFlag(FLAGS_model);
  PD_ASSIGN_OR_RETURN(p.kv_bytes_per_token, KvBytesPerToken(p.model));
  PD_ASSIGN_OR_RETURN(
      StepFit fit,
      FitStepCost(samples, static_cast<double>(CoreCacheBytes()) / p.kv_bytes_per_token));

  p.machine = bench::MachineDescription();
  p.worker_cpus = cpus;
  if (cpus > 0) {
    std::string how;
    FILE* pipe = popen(
        (ShellQuote(std::string(PDSERVE_SOURCE_DIR) + "/deploy/local/cpu_share.sh") + " how").c_str(),
        "r");
    char line[512];
    if (pipe != nullptr && fgets(line, sizeof line, pipe) != nullptr) how = line;
    if (pipe != nullptr) pclose(pipe);
    while (!how.empty() && how.back() == '\n') how.pop_back();
    p.cpu_share = absl::StrFormat("%g CPU per worker: %s", cpus, how);
  } else {
    p.cpu_share = "no limit";
  }
  p.threads = absl::GetFlag(FLAGS_threads);
  p.block_size = absl::GetFlag(FLAGS_block_size);
  p.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  p.max_running = absl::GetFlag(FLAGS_max_running);
  p.step = fit.cost;
  const double block_bytes = p.kv_bytes_per_token * p.block_size;
  p.prefill_kv_blocks =
      static_cast<int64_t>((int64_t{absl::GetFlag(FLAGS_prefill_kv_cache_mb)} << 20) / block_bytes);
  p.decode_kv_blocks =
      static_cast<int64_t>((int64_t{absl::GetFlag(FLAGS_decode_kv_cache_mb)} << 20) / block_bytes);
  {
    PD_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model, Model::Load(p.model));
    p.max_context = model->config().max_position_embeddings;
  }
  p.transfers = measured.transfers;
  // The drift probe, right after the fit: did the machine's speed change
  // while it was profiled (ProfileSpeedWarning).
  Progress("the drift probe");
  PD_ASSIGN_OR_RETURN(p.probe_ratio, ProbeRatioNow(p, RunDir("profile-probe")));
  ServingCostOptions serving;
  serving.launch = LaunchOptionsFor(p);
  serving.launch.dir = RunDir("profile-cluster");
  serving.launch.source_dir = PDSERVE_SOURCE_DIR;
  serving.launch.binary_dir = BinaryDir();
  serving.progress = Progress;
  PD_RETURN_IF_ERROR(MeasureServingCosts(serving, p));
  PD_RETURN_IF_ERROR(WriteProfile(absl::GetFlag(FLAGS_out), p));

  std::cout << absl::StrFormat(
      "Profile of %s on %s (%s), written to %s\n\n"
      "| engine step cost | value |\n|---|---|\n"
      "| dense, by the step's tokens | %s |\n"
      "| per prefill attention pair | %.4f us |\n| per decode KV token | %.4f us |\n"
      "| decode KV beyond %.0f tokens (%.1f MiB, one core's L2) | +%.4f us per token |\n"
      "| drift probe, measured / fitted (probe_ratio) | %.2f |\n",
      p.model, p.machine, p.cpu_share, absl::GetFlag(FLAGS_out), DenseTable(p.step),
      p.step.per_attention_s * 1e6, p.step.per_decode_attention_s * 1e6,
      p.step.decode_cache_tokens, p.step.decode_cache_tokens * p.kv_bytes_per_token / (1 << 20),
      p.step.per_decode_kv_beyond_cache_s * 1e6, p.probe_ratio);
  std::cout << "\n| step kind | fit error p50 | fit error p90 |\n|---|---|---|\n";
  for (const auto& [kind, e] : fit.relative_error) {
    std::cout << absl::StrFormat("| %s | %.1f%% | %.1f%% |\n", kind, e.first * 100, e.second * 100);
  }
  std::cout << "\n| serving cost | value |\n|---|---|\n";
  for (const TransferCost& t : p.transfers) {
    std::cout << absl::StrFormat("| KV transfer %s | %.1f us + %.2f GB/s |\n", t.transport,
                                 t.latency_s * 1e6, t.bytes_per_s / 1e9);
  }
  std::cout << absl::StrFormat(
      "| colocated first token | +%.2f ms |\n| disaggregated first token | +%.2f ms |\n"
      "| later tokens, from their step's end | colocated +%.2f ms, disaggregated +%.2f ms |\n"
      "| decode step overhead | %.1f us + %.1f us per sequence |\n"
      "| prefill worker's serving threads | %.1f us per request + %.1f us per KV MiB |\n"
      "| decode worker's serving threads | %.1f us per token streamed |\n"
      "| engine when busy, prefill / decode worker | x %.3f / x %.3f the step model |\n"
      "| decode worker's decode batches | x %.3f the step model |\n",
      p.colocated_first_token_s * 1e3, p.disaggregated_first_token_s * 1e3,
      p.token_delivery_s * 1e3, p.disaggregated_token_delivery_s * 1e3,
      p.decode_step_overhead_s * 1e6, p.decode_sequence_overhead_s * 1e6,
      p.prefill_cpu_per_request_s * 1e6, p.prefill_cpu_per_kv_byte_s * 1e6 * (1 << 20),
      p.decode_cpu_per_token_s * 1e6, p.prefill_engine_scale, p.decode_engine_scale,
      p.decode_batch_scale);
  if (const std::string warning = ProfileSpeedWarning(p); !warning.empty()) {
    std::cout << "\nWarning: " << warning << "\n";
  }
  return absl::OkStatus();
}

// --profile, its CPU costs scaled by --engine_scale.
absl::StatusOr<Profile> ProfileFromFlags() {
  PD_ASSIGN_OR_RETURN(Profile profile, ReadProfile(absl::GetFlag(FLAGS_profile)));
  const double scale = absl::GetFlag(FLAGS_engine_scale);
  if (!(std::isfinite(scale) && scale > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--engine_scale must be a positive number (1: the profile as measured), not ",
                     scale));
  }
  return WithDrift(std::move(profile), scale, scale);
}

absl::StatusOr<RoutingOptions> RoutingFromFlag() {
  internal::v1::RoutingConfig config;
  const std::string json = absl::GetFlag(FLAGS_routing);
  if (!json.empty()) {
    const auto status = google::protobuf::util::JsonStringToMessage(json, &config);
    if (!status.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--routing: not a routing section (docs/routing.md): ", status.ToString()));
    }
  }
  return RoutingOptionsFromConfig(config);
}

// Simulates `shape` at every level of the flags; one sweep point each.
absl::StatusOr<std::vector<SweepPoint>> SimulateLevels(const Profile& profile,
                                                       const ClusterShape& shape,
                                                       const Workload& workload,
                                                       const std::vector<LoadLevel>& levels,
                                                       const SummarySpec& spec,
                                                       std::vector<RequestRecord>* last) {
  std::vector<SweepPoint> points;
  for (const LoadLevel& level : levels) {
    PD_ASSIGN_OR_RETURN(Workload at, WorkloadAtLoad(workload, level));
    PD_ASSIGN_OR_RETURN(Simulation simulation,
                        Simulate(profile, shape, at, {.concurrency = level.concurrency}));
    std::vector<RequestRecord>& records = simulation.records;
    points.push_back({.rate = OfferedRate(at, level),
                      .concurrency = level.concurrency,
                      .summary = Summarize(records, spec.OptionsFor(records))});
    if (last != nullptr) *last = std::move(records);
  }
  return points;
}

absl::Status WriteSummaryJson(const nlohmann::json& json) {
  const std::string path = absl::GetFlag(FLAGS_summary_json);
  if (path.empty()) return absl::OkStatus();
  std::ofstream out(path);
  out << json.dump(2) << "\n";
  return out ? absl::OkStatus() : absl::UnavailableError("cannot write " + path);
}

absl::Status RunSimulate() {
  PD_ASSIGN_OR_RETURN(Profile profile, ProfileFromFlags());
  PD_ASSIGN_OR_RETURN(Workload workload, WorkloadFromFlags());
  PD_ASSIGN_OR_RETURN(std::vector<LoadLevel> levels, LoadLevelsFromFlags());
  PD_ASSIGN_OR_RETURN(SummarySpec spec, SummarySpecFromFlags());
  ClusterShape shape;
  shape.prefill = absl::GetFlag(FLAGS_prefill);
  shape.decode = absl::GetFlag(FLAGS_decode);
  PD_ASSIGN_OR_RETURN(shape.routing, RoutingFromFlag());
  std::vector<RequestRecord> records;
  const auto t0 = std::chrono::steady_clock::now();
  PD_ASSIGN_OR_RETURN(std::vector<SweepPoint> points,
                      SimulateLevels(profile, shape, workload, levels, spec, &records));
  const double took =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double target = spec.attainment_target;
  std::cout << absl::StrFormat("Simulated %s on %s (profile: %s, %s), %s; took %.2f s\n\n",
                               shape.Name(), workload.description, profile.machine,
                               profile.cpu_share, profile.model, took)
            << SweepTable(points, target);
  if (!absl::GetFlag(FLAGS_records).empty()) {
    PD_RETURN_IF_ERROR(WriteRecords(absl::GetFlag(FLAGS_records), records));
  }
  return WriteSummaryJson(SweepToJson(points, target));
}

// The highest rate at which `shape` meets the attainment target: doubling
// from `start` until it misses, then bisecting to 2%.
absl::StatusOr<double> SimulatedGoodput(const Profile& profile, const ClusterShape& shape,
                                        const Workload& workload, const SummarySpec& spec,
                                        double start) {
  auto meets = [&](double rate) -> absl::StatusOr<bool> {
    PD_ASSIGN_OR_RETURN(Workload at, WorkloadAtLoad(workload, {.rate = rate}));
    PD_ASSIGN_OR_RETURN(Simulation simulation, Simulate(profile, shape, at));
    const std::vector<RequestRecord>& records = simulation.records;
    return Summarize(records, spec.OptionsFor(records)).slo_attainment >=
           spec.attainment_target;
  };
  double lo = 0, hi = start;
  for (int i = 0; i < 20; ++i) {
    PD_ASSIGN_OR_RETURN(bool ok, meets(hi));
    if (!ok) break;
    lo = hi;
    hi *= 2;
  }
  if (lo == hi) return lo;
  // Bisect to 2%, or to "none" below a thousandth of a request per second.
  while (hi - lo > 0.02 * hi && hi > 1e-3) {
    const double mid = (lo + hi) / 2;
    PD_ASSIGN_OR_RETURN(bool ok, meets(mid));
    (ok ? lo : hi) = mid;
  }
  return lo < 1e-3 ? 0 : lo;
}

// Why a shape stops meeting the SLO just past its goodput: the share of
// the misses there that are TTFT misses (queueing for or computing the
// prompt: the prefill side, or KV capacity) and TPOT misses (the decode
// side).
absl::StatusOr<std::string> Bottleneck(const Profile& profile, const ClusterShape& shape,
                                       const Workload& workload, const SummarySpec& spec,
                                       double rate) {
  PD_ASSIGN_OR_RETURN(Workload at, WorkloadAtLoad(workload, {.rate = rate}));
  PD_ASSIGN_OR_RETURN(Simulation simulation, Simulate(profile, shape, at));
  const std::vector<RequestRecord>& records = simulation.records;
  const SummaryOptions options = spec.OptionsFor(records);
  int64_t ttft_misses = 0, tpot_misses = 0, failed = 0, counted = 0;
  for (const RequestRecord& r : records) {
    if (r.send_s < options.window_begin_s || r.send_s >= options.window_end_s) continue;
    ++counted;
    if (!r.ok() || r.token_s.empty()) {
      ++failed;
      continue;
    }
    const double ttft = r.token_s.front() - r.send_s;
    const double tpot = r.token_s.size() > 1 ? (r.token_s.back() - r.token_s.front()) /
                                                   (r.token_s.size() - 1)
                                             : 0;
    ttft_misses += ttft > options.slo.ttft_s;
    tpot_misses += tpot > options.slo.tpot_s;
  }
  const std::string side = ttft_misses >= tpot_misses
                               ? (shape.prefill > 0 ? "prefill-bound" : "prompt-bound")
                               : "decode-bound";
  return absl::StrFormat("%s at %.3g req/s: %d of %d requests miss TTFT, %d miss TPOT, %d fail",
                         side, rate, ttft_misses, counted, tpot_misses, failed);
}

absl::Status RunSearch() {
  PD_ASSIGN_OR_RETURN(Profile profile, ProfileFromFlags());
  PD_ASSIGN_OR_RETURN(Workload workload, WorkloadFromFlags());
  PD_ASSIGN_OR_RETURN(SummarySpec spec, SummarySpecFromFlags());
  PD_ASSIGN_OR_RETURN(RoutingOptions routing, RoutingFromFlag());
  const int32_t budget = absl::GetFlag(FLAGS_workers);
  if (budget < 1) return absl::InvalidArgumentError("--workers must be at least 1");
  struct Row {
    ClusterShape shape;
    double goodput = 0;
    std::string why;
  };
  std::vector<Row> rows;
  for (int32_t total = 1; total <= budget; ++total) {
    for (int32_t x = 0; x < total; ++x) {
      Row row;
      row.shape.prefill = x;
      row.shape.decode = total - x;
      row.shape.routing = routing;
      Progress(absl::StrCat("search: ", row.shape.Name()));
      PD_ASSIGN_OR_RETURN(row.goodput, SimulatedGoodput(profile, row.shape, workload, spec, 0.25));
      PD_ASSIGN_OR_RETURN(row.why, Bottleneck(profile, row.shape, workload, spec,
                                              std::max(row.goodput, 0.05) * 1.1));
      rows.push_back(row);
    }
  }
  std::sort(rows.begin(), rows.end(), [](const Row& a, const Row& b) {
    const double pa = a.goodput / (a.shape.prefill + a.shape.decode);
    const double pb = b.goodput / (b.shape.prefill + b.shape.decode);
    return pa != pb ? pa > pb : a.goodput > b.goodput;
  });
  std::cout << absl::StrFormat(
      "Search on %s, SLO TTFT <= %g ms and TPOT <= %g ms for %.0f%% of requests, at most %d "
      "workers (profile: %s on %s, %s)\n\n"
      "| xPyD | goodput (req/s) | per worker | past the goodput |\n|---|---|---|---|\n",
      workload.description, spec.slo.ttft_s * 1e3, spec.slo.tpot_s * 1e3,
      spec.attainment_target * 100, budget, profile.model, profile.machine,
      profile.cpu_share);
  nlohmann::json json = nlohmann::json::array();
  for (const Row& r : rows) {
    const int32_t n = r.shape.prefill + r.shape.decode;
    std::cout << absl::StrFormat("| %s | %.3g | %.3g | %s |\n", r.shape.Name(), r.goodput,
                                 r.goodput / n, r.why);
    json.push_back({{"config", r.shape.Name()}, {"prefill", r.shape.prefill},
                    {"decode", r.shape.decode}, {"goodput", r.goodput},
                    {"goodput_per_worker", r.goodput / n}, {"bottleneck", r.why}});
  }
  const Row& best = rows.front();
  std::cout << absl::StrFormat(
      "\nRecommended: %s, %.3g req/s per worker (%.3g req/s in all). Past that rate it is %s.\n",
      best.shape.Name(), best.goodput / (best.shape.prefill + best.shape.decode), best.goodput,
      best.why);
  return WriteSummaryJson(json);
}

absl::StatusOr<ClusterShape> ParseShape(const std::string& name) {
  ClusterShape shape;
  std::vector<std::string> parts = absl::StrSplit(name, absl::ByAnyChar("PD"));
  if (parts.size() != 3 || !parts[2].empty() || !absl::SimpleAtoi(parts[0], &shape.prefill) ||
      !absl::SimpleAtoi(parts[1], &shape.decode) || shape.prefill < 0 || shape.decode < 1 ||
      name.find('P') > name.find('D')) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", name, "' is not a configuration like 1P2D (x prefill, y >= 1 decode workers)"));
  }
  return shape;
}

// One predicted figure next to its measurement.
struct Comparison {
  std::string figure;
  double predicted = 0;
  double measured = 0;
  // Relative error (predicted - measured) / measured; for attainment the
  // difference in points.
  double error = 0;
  // A P90's 90% confidence interval from the measured requests (summary.h);
  // NaN for the other figures.
  double measured_low = std::numeric_limits<double>::quiet_NaN();
  double measured_high = std::numeric_limits<double>::quiet_NaN();
  bool checked = false;  // Against --max_error / --max_attainment_error.
  bool passed = true;
};

std::vector<Comparison> Compare(const Summary& p, const Summary& m) {
  std::vector<Comparison> out;
  const double tpot_bound = absl::GetFlag(FLAGS_max_tpot_error) >= 0
                                ? absl::GetFlag(FLAGS_max_tpot_error)
                                : absl::GetFlag(FLAGS_max_error);
  auto relative = [&](std::string name, double pv, double mv, bool checked,
                      double low = std::numeric_limits<double>::quiet_NaN(),
                      double high = std::numeric_limits<double>::quiet_NaN()) {
    Comparison c{.figure = std::move(name), .predicted = pv, .measured = mv,
                 .error = mv != 0 ? (pv - mv) / mv : 0, .measured_low = low,
                 .measured_high = high, .checked = checked};
    const double bound =
        absl::StartsWith(c.figure, "TPOT") ? tpot_bound : absl::GetFlag(FLAGS_max_error);
    c.passed = !checked || std::abs(c.error) <= bound;
    out.push_back(c);
  };
  relative("TTFT p50 (ms)", p.ttft_s.p50 * 1e3, m.ttft_s.p50 * 1e3, false);
  relative("TTFT p90 (ms)", p.ttft_s.p90 * 1e3, m.ttft_s.p90 * 1e3, true, m.ttft_s.p90_low * 1e3,
           m.ttft_s.p90_high * 1e3);
  relative("TPOT p50 (ms)", p.tpot_s.p50 * 1e3, m.tpot_s.p50 * 1e3, false);
  relative("TPOT p90 (ms)", p.tpot_s.p90 * 1e3, m.tpot_s.p90 * 1e3, true, m.tpot_s.p90_low * 1e3,
           m.tpot_s.p90_high * 1e3);
  relative("ITL p50 (ms)", p.itl_s.p50 * 1e3, m.itl_s.p50 * 1e3, false);
  relative("E2E p50 (ms)", p.e2e_s.p50 * 1e3, m.e2e_s.p50 * 1e3, false);
  relative("output tok/s", p.output_token_throughput, m.output_token_throughput, false);
  Comparison a{.figure = "attainment (%)", .predicted = p.slo_attainment * 100,
               .measured = m.slo_attainment * 100,
               .error = p.slo_attainment - m.slo_attainment, .checked = true};
  a.passed = std::abs(a.error) <= absl::GetFlag(FLAGS_max_attainment_error) + 1e-9;
  out.push_back(a);
  return out;
}

// A confidence interval's bound as validate prints it; "?" for none.
std::string IntervalBound(double value) {
  return std::isnan(value) ? "?" : absl::StrFormat("%.3g", value);
}

Distribution DistributionFromJson(const nlohmann::json& j) {
  auto number = [&](const char* key) {
    return j.contains(key) && j[key].is_number() ? j[key].get<double>() : 0.0;
  };
  Distribution d{.count = static_cast<int64_t>(number("count")), .mean = number("mean"),
                 .p50 = number("p50"), .p90 = number("p90"), .p99 = number("p99")};
  // Validations before 2026-11-28 have no interval.
  if (j.contains("p90_ci") && j["p90_ci"].is_array() && j["p90_ci"].size() == 2) {
    const nlohmann::json& ci = j["p90_ci"];
    if (ci[0].is_number()) d.p90_low = ci[0].get<double>();
    if (ci[1].is_number()) d.p90_high = ci[1].get<double>();
  }
  return d;
}

// The measured summary of (config, rate) in an earlier validate's JSON:
// the figures Compare reads.
// The figures validate compares, from a summary's JSON.
Summary MeasuredFromJson(const nlohmann::json& m) {
  Summary s;
  s.ttft_s = DistributionFromJson(m["ttft_s"]);
  s.tpot_s = DistributionFromJson(m["tpot_s"]);
  s.itl_s = DistributionFromJson(m["itl_s"]);
  s.e2e_s = DistributionFromJson(m["e2e_s"]);
  s.output_token_throughput = m.value("output_token_throughput", 0.0);
  s.slo_attainment = m.value("slo_attainment", 0.0);
  s.requests = m.value("requests", 0);
  s.completed = m.value("completed", 0);
  return s;
}

// One point of an earlier validate's JSON, or null.
const nlohmann::json* EarlierPoint(const nlohmann::json& earlier, const std::string& config,
                                   double rate, int32_t concurrency) {
  for (const nlohmann::json& row : earlier) {
    if (row.value("config", "") != config || row.value("concurrency", -1) != concurrency) continue;
    const double r = row["rate"].is_number() ? row["rate"].get<double>() : 0;
    if (std::abs(r - rate) <= 1e-9 * std::max(1.0, rate)) return &row;
  }
  return nullptr;
}

// The drift check's reading before an earlier validate's runs of `config`
// (1 where it made none).
double EarlierDrift(const nlohmann::json& earlier, const std::string& config) {
  for (const nlohmann::json& row : earlier) {
    if (row.value("config", "") == config && row.contains("drift") && row["drift"].is_number()) {
      return row["drift"].get<double>();
    }
  }
  return 1;
}

// The runs of one point of an earlier validate (--repeats of them, or the
// one "measured" of a validate run without).
absl::StatusOr<std::vector<Summary>> EarlierMeasurement(const nlohmann::json& earlier,
                                                        const std::string& config, double rate,
                                                        int32_t concurrency) {
  const nlohmann::json* row = EarlierPoint(earlier, config, rate, concurrency);
  if (row == nullptr) {
    return absl::NotFoundError(absl::StrFormat(
        "--measured_json has no measurement of %s at %g req/s (concurrency %d): give the "
        "flags of that run",
        config, rate, concurrency));
  }
  std::vector<Summary> runs;
  if (row->contains("measured_runs") && (*row)["measured_runs"].is_array()) {
    for (const nlohmann::json& m : (*row)["measured_runs"]) runs.push_back(MeasuredFromJson(m));
  }
  if (runs.empty()) runs.push_back(MeasuredFromJson((*row)["measured"]));
  return runs;
}

// What a cluster's workers and router have done so far, from their
// /metrics, for what Simulation reports beside the records.
struct EngineWork {
  double prefill_s = 0;
  double decode_s = 0;
  // The decode workers' wall time between back-to-back steps
  // (Simulation::decode_gap_s).
  double decode_gap_s = 0;
  // The decode workers' steps and the sequences in them (their batch-size
  // histograms' count and sum).
  double decode_steps = 0;
  double decode_step_sequences = 0;
  double decode_prefills = 0;
  // The decode workers' engine CPU in their steps
  // (pdserve_decode_step_cpu_seconds): beside decode_s, what the quota's
  // waits added.
  double decode_cpu_s = 0;
};

// The engine step time summed by role (their step-time histograms' sums; a
// colocated decode worker's prefill chunks are decode steps, as in
// Simulation), and the router's decode routes that had no prefill route
// (a decode worker prefilled them).
absl::StatusOr<EngineWork> MeasuredEngineWork(const ClusterLauncher& cluster,
                                              const ClusterShape& shape) {
  EngineWork t;
  PD_ASSIGN_OR_RETURN(const double decodes, cluster.MetricSum("router", "pdserve_router_routed_total",
                                                              "role=\"decode\""));
  PD_ASSIGN_OR_RETURN(const double prefills, cluster.MetricSum("router", "pdserve_router_routed_total",
                                                               "role=\"prefill\""));
  t.decode_prefills = decodes - prefills;
  for (int32_t i = 0; i < shape.prefill; ++i) {
    PD_ASSIGN_OR_RETURN(const double s, cluster.MetricSum(absl::StrCat("prefill-", i),
                                                          "pdserve_prefill_batch_seconds_sum"));
    t.prefill_s += s;
  }
  for (int32_t i = 0; i < shape.decode; ++i) {
    PD_ASSIGN_OR_RETURN(const std::vector<double> sums,
                        cluster.MetricSums(absl::StrCat("decode-", i),
                                           {"pdserve_decode_step_seconds_sum",
                                            "pdserve_decode_step_gap_seconds_sum",
                                            "pdserve_decode_batch_size_count",
                                            "pdserve_decode_batch_size_sum",
                                            "pdserve_decode_step_cpu_seconds_sum"}));
    t.decode_s += sums[0];
    t.decode_gap_s += sums[1];
    t.decode_steps += sums[2];
    t.decode_step_sequences += sums[3];
    t.decode_cpu_s += sums[4];
  }
  return t;
}

// The drift check: the workers of `cluster` that prefill its prompts (the
// prefill workers; the decode workers when colocated) each kept busy as
// pd-plan profile keeps one for its engine scales (profiler.h
// kBusyClients clients and kBusyPrompts prompts of BusyPromptTokens per
// worker, after one warm-up prompt per client), their step time (the
// workers' step histograms, as the step-time rows measure it) over what
// the simulator gives for the same requests on `shape` with `profile`;
// kBusyRounds such loads, new prompts each, and their median, as the
// profile takes its scales: one load of a couple of seconds on a shared VM
// can be off (docs/capacity_planning.md run 27: 1.28 on a cluster whose
// engines then ran 0.6 to 1.3 times the profile). The median takes out
// one round's noise, not a slow minute's: on twelve fresh clusters a
// minute apart the first rounds read 0.93 to 1.08 and the medians 0.93 to
// 1.06. Above 1 the engines run slower now than profiled. The prompts
// share nothing with any load level's.
struct Drift {
  double median = 1;
  std::vector<double> rounds;
};

absl::StatusOr<Drift> DriftNow(const Profile& profile, const ClusterShape& shape,
                               const ClusterLauncher& cluster, LoadTarget& target) {
  const bool prefill_role = shape.prefill > 0;
  const int32_t workers = prefill_role ? shape.prefill : shape.decode;
  const int32_t clients = kBusyClients * workers;
  const int32_t per_round = kBusyPrompts * workers;
  PD_ASSIGN_OR_RETURN(const LengthDistribution input,
                      LengthDistribution::Parse(absl::StrCat(BusyPromptTokens({}, profile))));
  PD_ASSIGN_OR_RETURN(const LengthDistribution output,
                      LengthDistribution::Parse(absl::StrCat(kBusyOutputTokens)));
  PD_ASSIGN_OR_RETURN(const Workload all,
                      MakeSyntheticWorkload({.input = input,
                                             .output = output,
                                             .num_requests = clients + kBusyRounds * per_round,
                                             .block_tokens = profile.block_size}));
  // A place in a sweep that no sweep reaches: content of its own.
  PD_ASSIGN_OR_RETURN(
      const Workload fresh,
      WorkloadAtLoad(all, {.concurrency = clients, .index = std::numeric_limits<int32_t>::max()}));
  // Requests [from, from + n) of `fresh`.
  auto slice = [&](int32_t from, int32_t n) {
    Workload part = fresh;
    part.requests.assign(fresh.requests.begin() + from, fresh.requests.begin() + from + n);
    return part;
  };
  PD_RETURN_IF_ERROR(
      RunLoad(slice(0, clients), target, {.concurrency = clients, .label = "drift check, warm-up"})
          .status());
  Drift drift;
  // Each round's end is the next one's start: nothing runs between them.
  PD_ASSIGN_OR_RETURN(EngineWork before, MeasuredEngineWork(cluster, shape));
  for (int32_t round = 0; round < kBusyRounds; ++round) {
    const Workload check = slice(clients + round * per_round, per_round);
    PD_ASSIGN_OR_RETURN(
        const LoadResult run,
        RunLoad(check, target,
                {.concurrency = clients,
                 .label = absl::StrFormat("drift check %d of %d", round + 1, kBusyRounds)}));
    PD_ASSIGN_OR_RETURN(const EngineWork after, MeasuredEngineWork(cluster, shape));
    for (const RequestRecord& r : run.records) {
      if (!r.ok()) {
        return absl::UnavailableError(absl::StrCat("the drift check's request failed: ", r.error));
      }
    }
    PD_ASSIGN_OR_RETURN(const Simulation sim,
                        Simulate(profile, shape, check, {.concurrency = clients}));
    const double predicted = prefill_role ? sim.prefill_step_s : sim.decode_step_s;
    const double measured =
        prefill_role ? after.prefill_s - before.prefill_s : after.decode_s - before.decode_s;
    if (!(predicted > 0 && measured > 0)) {
      return absl::InternalError(absl::StrFormat(
          "the drift check's engines stepped %.3f s where the profile gives %.3f s", measured,
          predicted));
    }
    drift.rounds.push_back(measured / predicted);
    before = after;
  }
  drift.median = Percentile(drift.rounds, 50);
  return drift;
}

// An earlier validate's measured engine work at one point, when it has it
// (files from before it was measured do not).
void EarlierEngineWork(const nlohmann::json& earlier, const std::string& config, double rate,
                       int32_t concurrency, std::vector<double>& prefill_s,
                       std::vector<double>& decode_s, std::vector<double>& decode_gap_s,
                       std::vector<double>& decode_steps, std::vector<double>& decode_batch,
                       std::vector<double>& decode_prefills, std::vector<double>& decode_cpu_s) {
  const nlohmann::json* row = EarlierPoint(earlier, config, rate, concurrency);
  if (row == nullptr || !row->contains("engine_work") || !(*row)["engine_work"].is_object()) {
    return;
  }
  const nlohmann::json& work = (*row)["engine_work"];
  for (auto [figure, out] :
       {std::pair{"prefill_step_s", &prefill_s}, std::pair{"decode_step_s", &decode_s},
        std::pair{"decode_gap_s", &decode_gap_s}, std::pair{"decode_steps", &decode_steps},
        std::pair{"decode_batch", &decode_batch},
        std::pair{"decode_prefills", &decode_prefills},
        std::pair{"decode_step_cpu_s", &decode_cpu_s}}) {
    if (!work.contains(figure) || !work[figure].is_object() ||
        !work[figure].contains("measured_runs") || !work[figure]["measured_runs"].is_array()) {
      continue;
    }
    for (const nlohmann::json& v : work[figure]["measured_runs"]) {
      if (v.is_number()) out->push_back(v.get<double>());
    }
  }
}

absl::Status RunValidate() {
  if (absl::GetFlag(FLAGS_repeats) < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("--repeats must be at least 1, not ", absl::GetFlag(FLAGS_repeats)));
  }
  PD_ASSIGN_OR_RETURN(Profile profile, ProfileFromFlags());
  PD_ASSIGN_OR_RETURN(Workload workload, WorkloadFromFlags());
  PD_ASSIGN_OR_RETURN(std::vector<LoadLevel> levels, LoadLevelsFromFlags());
  PD_ASSIGN_OR_RETURN(SummarySpec spec, SummarySpecFromFlags());
  PD_ASSIGN_OR_RETURN(RoutingOptions routing, RoutingFromFlag());
  const double target = spec.attainment_target;
  std::cout << absl::StrFormat("Validation on %s (profile: %s on %s, %s)\n", workload.description,
                               profile.model, profile.machine, profile.cpu_share);
  nlohmann::json json = nlohmann::json::array();
  bool all_passed = true;
  nlohmann::json earlier;
  if (const std::string path = absl::GetFlag(FLAGS_measured_json); !path.empty()) {
    std::ifstream in(path);
    earlier = nlohmann::json::parse(in, nullptr, false);
    if (!in || earlier.is_discarded() || !earlier.is_array()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--measured_json: ", path, " is not the JSON of pd-plan validate"));
    }
  }
  for (const std::string& name : absl::GetFlag(FLAGS_configs)) {
    PD_ASSIGN_OR_RETURN(ClusterShape shape, ParseShape(name));
    shape.routing = routing;
    LaunchOptions launch = LaunchOptionsFor(profile);
    launch.prefill = shape.prefill;
    launch.decode = shape.decode;
    launch.routing = absl::GetFlag(FLAGS_routing);
    launch.dir = RunDir(absl::StrCat("validate-", name));
    launch.source_dir = PDSERVE_SOURCE_DIR;
    launch.binary_dir = BinaryDir();
    std::unique_ptr<ClusterLauncher> cluster;
    std::unique_ptr<LoadTarget> load_target;
    if (earlier.is_null()) {
      Progress(absl::StrCat("validate: starting ", name));
      PD_ASSIGN_OR_RETURN(cluster, ClusterLauncher::Start(launch));
      PD_ASSIGN_OR_RETURN(load_target,
                          MakeLoadTarget("grpc", {.address = cluster->grpc_address()}));
    }
    // The profile this configuration's predictions come from: scaled by
    // the drift measured on its cluster right before its runs, or by the
    // one the earlier run measured before the runs compared with. The
    // check measures the role that prefills, and every worker is scaled by
    // it: the hour's speed is the machine's, and scaling the checked role
    // alone did worse (docs/capacity_planning.md run 27).
    Profile now = profile;
    const bool check_drift = absl::GetFlag(FLAGS_drift_check);
    Drift drift;
    if (check_drift && earlier.is_null()) {
      Progress(absl::StrCat("validate: drift check on ", name));
      PD_ASSIGN_OR_RETURN(drift, DriftNow(profile, shape, *cluster, *load_target));
    } else if (check_drift) {
      drift.median = EarlierDrift(earlier, shape.Name());
    }
    const bool applied = std::abs(drift.median - 1) > absl::GetFlag(FLAGS_drift_threshold);
    if (applied) now = WithDrift(profile, drift.median, drift.median);
    std::vector<SweepPoint> predicted_points, measured_points;
    std::cout << absl::StrFormat("\n%s\n\n", shape.Name());
    if (check_drift) {
      std::cout << absl::StrFormat(
          "Drift check%s: this cluster's %s workers, each kept busy with %d prompts%s, stepped "
          "%.2fx what the profile predicts%s; %s.\n\n",
          earlier.is_null() ? "" : " (the earlier run's)", shape.prefill > 0 ? "prefill" : "decode",
          kBusyPrompts, drift.rounds.empty() ? "" : absl::StrFormat(" %d times", kBusyRounds),
          drift.median,
          drift.rounds.empty()
              ? ""
              : absl::StrCat(" (the median of ",
                             absl::StrJoin(drift.rounds, ", ",
                                           [](std::string* out, double r) {
                                             absl::StrAppend(out, absl::StrFormat("%.2f", r));
                                           }),
                             ")"),
          applied ? "every worker's CPU costs are scaled by that"
                  : absl::StrFormat("within --drift_threshold (%.0f%%), not applied",
                                    absl::GetFlag(FLAGS_drift_threshold) * 100));
    }
    std::cout << "| load | figure | predicted | measured | error |\n|---|---|---|---|---|\n";
    for (const LoadLevel& level : levels) {
      PD_ASSIGN_OR_RETURN(Workload at, WorkloadAtLoad(workload, level));
      PD_ASSIGN_OR_RETURN(const Simulation simulation,
                          Simulate(now, shape, at, {.concurrency = level.concurrency}));
      const std::vector<RequestRecord>& predicted = simulation.records;
      const Summary p = Summarize(predicted, spec.OptionsFor(predicted));
      PD_RETURN_IF_ERROR(WriteRunRecords(shape.Name(), level, "predicted", predicted));
      const double rate = OfferedRate(at, level);
      std::vector<Summary> runs;
      // Each run's engine step time, prefill and decode workers', and its
      // prompts prefilled on a decode worker.
      std::vector<double> prefill_step_runs, decode_step_runs, decode_gap_runs,
          decode_steps_runs, decode_batch_runs, decode_prefill_runs, decode_cpu_runs;
      if (load_target != nullptr) {
        for (int32_t k = 1; k <= absl::GetFlag(FLAGS_repeats); ++k) {
          PD_ASSIGN_OR_RETURN(const EngineWork before, MeasuredEngineWork(*cluster, shape));
          // Run k's prompts are new to the cluster's prefix cache.
          LoadLevel run_level = level;
          run_level.repeat = k - 1;
          PD_ASSIGN_OR_RETURN(const Workload run_at, WorkloadAtLoad(workload, run_level));
          PD_ASSIGN_OR_RETURN(
              LoadResult measured,
              RunLoad(run_at, *load_target,
                      {.concurrency = level.concurrency,
                       .label = absl::StrCat(name, " ", level.Name(),
                                             absl::GetFlag(FLAGS_repeats) > 1
                                                 ? absl::StrCat(" (run ", k, ")")
                                                 : "")}));
          PD_ASSIGN_OR_RETURN(const EngineWork after, MeasuredEngineWork(*cluster, shape));
          prefill_step_runs.push_back(after.prefill_s - before.prefill_s);
          decode_step_runs.push_back(after.decode_s - before.decode_s);
          decode_gap_runs.push_back(after.decode_gap_s - before.decode_gap_s);
          const double steps = after.decode_steps - before.decode_steps;
          decode_steps_runs.push_back(steps);
          decode_batch_runs.push_back(
              steps > 0 ? (after.decode_step_sequences - before.decode_step_sequences) / steps
                        : 0);
          decode_prefill_runs.push_back(after.decode_prefills - before.decode_prefills);
          decode_cpu_runs.push_back(after.decode_cpu_s - before.decode_cpu_s);
          runs.push_back(Summarize(measured.records, spec.OptionsFor(measured.records)));
          PD_RETURN_IF_ERROR(
              WriteRunRecords(shape.Name(), level, MeasuredKind(k), measured.records));
        }
      } else {
        PD_ASSIGN_OR_RETURN(runs, EarlierRecords(shape.Name(), level, spec));
        if (runs.empty()) {
          PD_ASSIGN_OR_RETURN(runs, EarlierMeasurement(earlier, shape.Name(), rate,
                                                       level.concurrency));
        }
        EarlierEngineWork(earlier, shape.Name(), rate, level.concurrency, prefill_step_runs,
                          decode_step_runs, decode_gap_runs, decode_steps_runs, decode_batch_runs,
                          decode_prefill_runs, decode_cpu_runs);
      }
      const Summary m = MedianSummary(runs);
      measured_points.push_back({.rate = rate, .concurrency = level.concurrency, .summary = m});
      predicted_points.push_back({.rate = rate, .concurrency = level.concurrency, .summary = p});
      nlohmann::json figures = nlohmann::json::array();
      const std::vector<Comparison> comparisons = Compare(p, m);
      std::vector<std::vector<Comparison>> run_comparisons;  // For the runs' range.
      for (const Summary& run : runs) run_comparisons.push_back(Compare(p, run));
      for (size_t i = 0; i < comparisons.size(); ++i) {
        const Comparison& c = comparisons[i];
        all_passed &= c.passed;
        const std::string error =
            c.figure == "attainment (%)"
                ? absl::StrFormat("%+.1f points", c.error * 100)
                : absl::StrFormat("%+.1f%%", c.error * 100);
        // With several runs: the median, and the runs' range.
        double low = c.measured, high = c.measured;
        for (const std::vector<Comparison>& run : run_comparisons) {
          low = std::min(low, run[i].measured);
          high = std::max(high, run[i].measured);
        }
        std::string measured =
            runs.size() > 1 ? absl::StrFormat("%.3g (%.3g-%.3g)", c.measured, low, high)
                            : absl::StrFormat("%.3g", c.measured);
        if (!std::isnan(c.measured_low) || !std::isnan(c.measured_high)) {
          absl::StrAppendFormat(&measured, ", 90%% CI %s-%s", IntervalBound(c.measured_low),
                                IntervalBound(c.measured_high));
        }
        std::cout << absl::StrFormat("| %s | %s | %.3g | %s | %s%s |\n", level.Name(), c.figure,
                                     c.predicted, measured, error,
                                     c.passed ? "" : " **over the bound**");
        figures.push_back({{"figure", c.figure}, {"predicted", c.predicted},
                           {"measured", c.measured}, {"measured_low", low},
                           {"measured_high", high},
                           {"measured_ci", {JsonNumber(c.measured_low),
                                            JsonNumber(c.measured_high)}},
                           {"error", c.error},
                           {"checked", c.checked}, {"passed", c.passed}});
      }
      // The engines' step time, predicted and measured: how far the step
      // model (and the machine's speed) held during the runs, apart from
      // the queueing that the figures above add to it; the decode steps'
      // mean batch; the prompts the router had decode workers prefill; the
      // decode engines' time between back-to-back steps; and their CPU in
      // their steps, which the step time holds with the quota's waits. Not
      // checked.
      nlohmann::json engine_work = nlohmann::json::object();
      struct Work {
        const char* figure;
        const char* label;
        double predicted;
        const std::vector<double>* measured_runs;
      };
      const bool disaggregated = shape.prefill > 0;
      std::vector<Work> work;
      if (disaggregated) {
        work.push_back({"prefill_step_s", "prefill engine step time (s)",
                        simulation.prefill_step_s, &prefill_step_runs});
      }
      work.push_back({"decode_step_s", "decode engine step time (s)", simulation.decode_step_s,
                      &decode_step_runs});
      // The simulator takes a step's time as its CPU over the share; the
      // workers report their loop thread's, all of a step's with one
      // compute thread only.
      if (now.threads == 1) {
        work.push_back({"decode_step_cpu_s", "decode engine CPU in its steps (s)",
                        simulation.decode_step_s * StepCpus(now), &decode_cpu_runs});
      }
      work.push_back({"decode_gap_s", "decode engine time between back-to-back steps (s)",
                      simulation.decode_gap_s, &decode_gap_runs});
      work.push_back({"decode_steps", "decode steps", static_cast<double>(simulation.decode_steps),
                      &decode_steps_runs});
      work.push_back({"decode_batch", "decode steps' mean batch (sequences)",
                      simulation.decode_steps > 0
                          ? static_cast<double>(simulation.decode_step_sequences) /
                                simulation.decode_steps
                          : 0,
                      &decode_batch_runs});
      if (disaggregated) {
        work.push_back({"decode_prefills", "prompts prefilled on a decode worker",
                        static_cast<double>(simulation.decode_prefills), &decode_prefill_runs});
      }
      for (const Work& w : work) {
        engine_work[w.figure] = {{"predicted", w.predicted}};
        if (w.measured_runs->empty()) continue;  // An earlier validation's, which had none.
        const double measured = Percentile(*w.measured_runs, 50);
        std::cout << absl::StrFormat(
            "| %s | %s | %.3g | %.3g | %s |\n", level.Name(), w.label, w.predicted, measured,
            measured > 0 ? absl::StrFormat("%+.1f%%", (w.predicted / measured - 1) * 100) : "");
        engine_work[w.figure]["measured"] = measured;
        engine_work[w.figure]["measured_runs"] = *w.measured_runs;
      }
      nlohmann::json measured_runs = nlohmann::json::array();
      for (const Summary& run : runs) measured_runs.push_back(ToJson(run));
      json.push_back({{"config", shape.Name()}, {"rate", rate},
                      {"concurrency", level.concurrency}, {"drift", drift.median},
                      {"drift_rounds", drift.rounds},
                      {"drift_applied", applied}, {"figures", figures},
                      {"predicted", ToJson(p)}, {"measured", ToJson(m)},
                      {"measured_runs", std::move(measured_runs)},
                      {"engine_work", std::move(engine_work)}});
    }
    if (levels.size() > 1) {
      std::cout << absl::StrFormat("| sweep | goodput (req/s) | %.3g | %.3g | |\n",
                                   Goodput(predicted_points, target),
                                   Goodput(measured_points, target));
    }
  }
  PD_RETURN_IF_ERROR(WriteSummaryJson(json));
  if (!all_passed) {
    return absl::OutOfRangeError(absl::StrFormat(
        "a prediction is off by more than the bound (P90 TTFT/TPOT %.0f%%, attainment %.0f "
        "points): see the rows marked above",
        absl::GetFlag(FLAGS_max_error) * 100, absl::GetFlag(FLAGS_max_attainment_error) * 100));
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace pdserve::planner

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "pd-plan profile|simulate|search|validate [flags]; see docs/capacity_planning.md");
  pdserve::planner::ListPlannerFlagsInHelp();
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2) {
    std::cerr << "usage: pd-plan profile|simulate|search|validate [flags] "
                 "(pd-plan --help lists the flags; docs/capacity_planning.md walks through "
                 "a plan)\n";
    return 2;
  }
  const std::string command = args[1];
  absl::Status status;
  if (command == "profile") {
    status = pdserve::planner::RunProfile();
  } else if (command == "profile_engine") {
    status = pdserve::planner::ProfileEngine();
  } else if (command == "simulate") {
    status = pdserve::planner::RunSimulate();
  } else if (command == "search") {
    status = pdserve::planner::RunSearch();
  } else if (command == "validate") {
    status = pdserve::planner::RunValidate();
  } else {
    std::cerr << "pd-plan: unknown command '" << command
              << "'; use profile, simulate, search or validate\n";
    return 2;
  }
  if (!status.ok()) {
    std::cerr << "pd-plan " << command << ": " << status << "\n";
    return 1;
  }
  return 0;
}
