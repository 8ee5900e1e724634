// pd-bench: the load generator (planner/loadgen.h), in the conventions of
// vLLM's `bench serve`: a workload (synthetic lengths or a trace), a load
// (closed loop at a concurrency, or open loop at one rate or a sweep of
// rates), a target (pdserve's gRPC API or any OpenAI-compatible server),
// and the figures of planner/summary.h as a Markdown table, JSON, records
// and plots. The workload, load and SLO flags are planner/workload_flags.h's,
// shared with pd-plan, so that pd-plan simulates the very workload pd-bench
// sends.
//
//   pd-bench --target=grpc --address=127.0.0.1:50051
//            --input_len=uniform:64:256 --output_len=32 --num_requests=200
//            --request_rates=1,2,4,inf --slo_ttft_ms=500 --slo_tpot_ms=50
//            --summary_json=bench.json --records=records.jsonl --plot_dir=plots
//
// Exit status: 0 after the runs, 1 when a run could not be made or no
// request of a run succeeded (the outputs are still written), 2 for bad
// flags.
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"
#include "planner/cluster_launcher.h"
#include "planner/loadgen.h"
#include "planner/summary.h"
#include "planner/workload.h"
#include "planner/workload_flags.h"

// Target.
ABSL_FLAG(std::string, target, "grpc",
          "grpc (pdserve's gRPC API) or openai (an OpenAI-compatible HTTP "
          "server: POST /v1/completions, streamed)");
ABSL_FLAG(std::string, address, "",
          "The server, host:port (openai also http://host:port)");
ABSL_FLAG(std::string, model, "",
          "Model name to ask for (default: the server's)");
ABSL_FLAG(std::string, api_key, "",
          "Sent as 'Authorization: Bearer KEY' (default: $PDSERVE_API_KEY, "
          "else none)");
ABSL_FLAG(bool, per_chunk_usage, false,
          "openai: ask for stream_options.continuous_usage_stats (vLLM, "
          "SGLang) so each chunk's token count is the server's");
ABSL_FLAG(double, request_timeout_s, 600, "Each request's limit, seconds");

// Load (the workload, its load levels and the SLO are planner/workload_flags.h's).
ABSL_FLAG(double, duration_s, 0,
          "Stop sending after this many seconds per run (0: no limit)");


// Output.
ABSL_FLAG(std::string, records, "",
          "Per-request records, JSON lines, one file per run: the run's rate "
          "goes into the name (out.jsonl -> out.rate-4.jsonl)");
ABSL_FLAG(std::string, summary_json, "",
          "The summary of every run and the goodput, JSON");
ABSL_FLAG(std::string, plot_dir, "",
          "Write PNG plots here (TTFT/TPOT/ITL CDFs per run; attainment and "
          "throughput against rate) with planner/plot_bench.py (matplotlib)");
ABSL_FLAG(
    std::string, plot_script, "",
    "plot_bench.py (default: beside this binary, else in the source tree)");
ABSL_FLAG(bool, progress, true, "A progress line on stderr while a run runs");

namespace pdserve::planner {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

constexpr double kInf = std::numeric_limits<double>::infinity();

// Checks pd-bench's own flags (workload_flags checks the shared ones).
absl::Status CheckBenchFlags() {
  if (absl::GetFlag(FLAGS_address).empty()) {
    return absl::InvalidArgumentError(
        "--address is required: the server's host:port (pd-router's gRPC port "
        "for --target=grpc, its HTTP port for --target=openai)");
  }
  if (!(absl::GetFlag(FLAGS_request_timeout_s) > 0)) {
    return absl::InvalidArgumentError("--request_timeout_s must be positive");
  }
  if (!(absl::GetFlag(FLAGS_duration_s) >= 0)) {
    return absl::InvalidArgumentError("--duration_s must be 0 (no limit) or more");
  }
  return absl::OkStatus();
}

// A run's part of the records' file names: "rate-4", "rate-inf",
// "concurrency-8", "trace".
std::string FileTag(const LoadLevel& level) {
  if (level.concurrency > 0) return absl::StrCat("concurrency-", level.concurrency);
  if (level.rate == 0) return "trace";
  return absl::StrCat("rate-", std::isinf(level.rate) ? "inf" : absl::StrFormat("%g", level.rate));
}

// out.jsonl -> out.rate-4.jsonl (in `dir` when `path` is empty).
std::string RecordsPath(const std::string& path, const std::string& dir,
                        const std::string& tag) {
  if (path.empty())
    return (fs::path(dir) / absl::StrCat("records.", tag, ".jsonl")).string();
  fs::path p(path);
  const std::string ext = p.has_extension() ? p.extension().string() : ".jsonl";
  p.replace_extension();
  return absl::StrCat(p.string(), ".", tag, ext);
}

std::string PlotScript() {
  std::string script = absl::GetFlag(FLAGS_plot_script);
  if (!script.empty()) return script;
  std::error_code ec;
  const fs::path self = fs::read_symlink("/proc/self/exe", ec);
  if (!ec && fs::exists(self.parent_path() / "plot_bench.py")) {
    return (self.parent_path() / "plot_bench.py").string();
  }
  return PDSERVE_SOURCE_DIR "/planner/plot_bench.py";
}

// Runs plot_bench.py on the summary; the PNG files it wrote.
absl::StatusOr<std::vector<std::string>> Plot(const std::string& summary_path,
                                              const std::string& dir) {
  const std::string command =
      absl::StrCat("python3 ", ShellQuote(PlotScript()), " --summary ",
                   ShellQuote(summary_path), " --out_dir ", ShellQuote(dir));
  FILE* pipe = ::popen(command.c_str(), "r");
  if (pipe == nullptr) return absl::InternalError("cannot run " + command);
  std::string out;
  char buffer[4096];
  while (size_t n = std::fread(buffer, 1, sizeof(buffer), pipe))
    out.append(buffer, n);
  const int rc = ::pclose(pipe);
  if (rc != 0) {
    return absl::InternalError(absl::StrCat(
        "the plots failed (", command, ", exit ", rc,
        "); it needs python3 with matplotlib (deploy/install-deps.sh)"));
  }
  std::vector<std::string> files;
  for (absl::string_view line :
       absl::StrSplit(out, '\n', absl::SkipWhitespace())) {
    files.emplace_back(absl::StripAsciiWhitespace(line));
  }
  return files;
}

absl::Status WriteJson(const std::string& path, const json& value) {
  std::ofstream out(path);
  out << value.dump(2) << "\n";
  out.close();
  if (!out) return absl::UnavailableError(absl::StrCat("cannot write ", path));
  return absl::OkStatus();
}

int Fail(const absl::Status& status, int code) {
  std::cerr << "pd-bench: " << status.message() << "\n";
  return code;
}

// Exit status 2 for a bad flag, 1 for anything else.
int FailFlags(const absl::Status& status) {
  return Fail(status, status.code() == absl::StatusCode::kInvalidArgument ? 2 : 1);
}

int Main() {
  if (absl::Status s = CheckBenchFlags(); !s.ok()) return Fail(s, 2);
  auto levels = LoadLevelsFromFlags();
  if (!levels.ok()) return Fail(levels.status(), 2);
  auto spec = SummarySpecFromFlags();
  if (!spec.ok()) return Fail(spec.status(), 2);
  auto workload = WorkloadFromFlags();
  if (!workload.ok()) return FailFlags(workload.status());
  // Every run's arrivals before the first run, so that a bad level is
  // refused before anything is sent.
  std::vector<Workload> at_levels;
  for (const LoadLevel& level : *levels) {
    auto at = WorkloadAtLoad(*workload, level);
    if (!at.ok()) return FailFlags(at.status());
    at_levels.push_back(*std::move(at));
  }

  TargetOptions target_options;
  target_options.address = absl::GetFlag(FLAGS_address);
  target_options.model = absl::GetFlag(FLAGS_model);
  target_options.api_key = absl::GetFlag(FLAGS_api_key);
  if (target_options.api_key.empty()) {
    if (const char* key = std::getenv("PDSERVE_API_KEY"))
      target_options.api_key = key;
  }
  target_options.per_chunk_usage = absl::GetFlag(FLAGS_per_chunk_usage);
  target_options.request_timeout =
      absl::Seconds(absl::GetFlag(FLAGS_request_timeout_s));
  auto target = MakeLoadTarget(absl::GetFlag(FLAGS_target), target_options);
  if (!target.ok()) return FailFlags(target.status());

  const std::string plot_dir = absl::GetFlag(FLAGS_plot_dir);
  if (!plot_dir.empty()) {
    std::error_code ec;
    fs::create_directories(plot_dir, ec);
    if (ec) return Fail(absl::UnavailableError("cannot create " + plot_dir), 1);
  }
  const std::string records_flag = absl::GetFlag(FLAGS_records);
  const bool write_records = !records_flag.empty() || !plot_dir.empty();

  const double attainment_target = spec->attainment_target;

  std::cout << "pd-bench: " << absl::GetFlag(FLAGS_target) << " target at "
            << target_options.address << "; workload: " << workload->description
            << " (" << workload->requests.size() << " requests)\n";

  std::vector<SweepPoint> points;
  json runs_json = json::array();
  bool each_run_had_a_success = true;
  for (size_t i = 0; i < levels->size(); ++i) {
    const LoadLevel& level = (*levels)[i];
    const Workload& w = at_levels[i];
    const std::string label = level.Name();
    LoadOptions load;
    load.concurrency = level.concurrency;
    load.duration_s = absl::GetFlag(FLAGS_duration_s) > 0
                          ? absl::GetFlag(FLAGS_duration_s)
                          : kInf;
    load.progress = absl::GetFlag(FLAGS_progress);
    load.label = label;
    const double offered_rate = OfferedRate(w, level);
    auto result = RunLoad(w, **target, load);
    if (!result.ok()) return Fail(result.status(), 1);

    const SummaryOptions options = spec->OptionsFor(result->records);
    SweepPoint point;
    point.rate = offered_rate;
    point.concurrency = level.concurrency;
    point.summary = Summarize(result->records, options);
    points.push_back(point);

    json run_json = {{"label", label},
                     {"rate", JsonNumber(offered_rate)},
                     {"concurrency", level.concurrency},
                     {"requests_sent", result->records.size()},
                     {"wall_s", result->wall_s},
                     {"max_send_lateness_s", result->max_send_lateness_s},
                     {"window_begin_s", JsonNumber(options.window_begin_s)},
                     {"window_end_s", JsonNumber(options.window_end_s)}};
    if (write_records) {
      const std::string path = RecordsPath(records_flag, plot_dir, FileTag(level));
      if (absl::Status s = WriteRecords(path, result->records); !s.ok())
        return Fail(s, 1);
      run_json["records"] = path;
    }
    runs_json.push_back(std::move(run_json));

    int64_t ok = 0;
    const RequestRecord* first_failure = nullptr;
    for (const RequestRecord& r : result->records) {
      if (r.ok()) {
        ++ok;
      } else if (first_failure == nullptr) {
        first_failure = &r;
      }
    }
    if (first_failure != nullptr) {
      std::cerr << "pd-bench: " << label << ": "
                << result->records.size() - ok << " of "
                << result->records.size()
                << " requests failed; the first: " << first_failure->outcome
                << ": " << first_failure->error << "\n";
    }
    if (ok == 0) each_run_had_a_success = false;
  }

  std::cout << "\n" << SweepTable(points, attainment_target) << std::flush;

  json summary = SweepToJson(points, attainment_target);
  json meta = {{"target", absl::GetFlag(FLAGS_target)},
               {"address", target_options.address},
               {"model", target_options.model},
               {"workload", workload->description},
               {"workload_requests", workload->requests.size()},
               {"runs", runs_json}};
  summary["pd_bench"] = meta;

  std::string summary_path = absl::GetFlag(FLAGS_summary_json);
  if (summary_path.empty() && !plot_dir.empty()) {
    summary_path = (fs::path(plot_dir) / "summary.json").string();
  }
  if (!summary_path.empty()) {
    if (absl::Status s = WriteJson(summary_path, summary); !s.ok())
      return Fail(s, 1);
  }
  if (!plot_dir.empty()) {
    auto plots = Plot(summary_path, plot_dir);
    if (!plots.ok()) return Fail(plots.status(), 1);
    summary["pd_bench"]["plots"] = *plots;
    if (absl::Status s = WriteJson(summary_path, summary); !s.ok())
      return Fail(s, 1);
    std::cout << "plots: " << absl::StrJoin(*plots, ", ") << "\n";
  }
  if (!summary_path.empty()) std::cout << "summary: " << summary_path << "\n";
  return each_run_had_a_success ? 0 : 1;
}

}  // namespace
}  // namespace pdserve::planner

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "pd-bench --target=grpc|openai --address=HOST:PORT [workload] [load] "
      "[SLO] [output]\n"
      "  workload: --input_len/--output_len (N, uniform:A:B, normal:M:S, "
      "hist:V=W,...),\n"
      "            --num_requests, --shared_prefix_len, --num_prefixes, "
      "--seed, or --trace=PATH\n"
      "            with --length_scale, --time_scale, --trace_start_s, "
      "--trace_duration_s,\n"
      "            --trace_max_requests, --max_input_len, --max_output_len\n"
      "  load:     --concurrency=N | --request_rate=R | "
      "--request_rates=R1,R2,...\n"
      "            (--burstiness, --duration_s, --warmup_s, --cooldown_s)\n"
      "  SLO:      --slo_ttft_ms, --slo_tpot_ms, --attainment_target\n"
      "  output:   --records=F.jsonl, --summary_json=F, --plot_dir=D; a table "
      "on stdout\n"
      "The workload, load and SLO flags are pd-plan's too "
      "(planner/workload_flags.h).");
  pdserve::planner::ListPlannerFlagsInHelp();
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::cerr << "pd-bench: unexpected argument '" << rest[1]
              << "'; every option is a --flag (--help lists them)\n";
    return 2;
  }
  return pdserve::planner::Main();
}
