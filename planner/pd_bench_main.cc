// pd-bench: the load generator (planner/loadgen.h), in the conventions of
// vLLM's `bench serve`: a workload (synthetic lengths or a trace), a load
// (closed loop at a concurrency, or open loop at one rate or a sweep of
// rates), a target (pdserve's gRPC API or any OpenAI-compatible server),
// and the figures of planner/summary.h as a Markdown table, JSON, records
// and plots.
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

#include <algorithm>
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
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"
#include "planner/loadgen.h"
#include "planner/summary.h"
#include "planner/workload.h"

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

// Workload.
ABSL_FLAG(std::string, input_len, "128",
          "Prompt tokens: N, uniform:A:B, normal:MEAN:STDDEV or hist:V=W,...");
ABSL_FLAG(std::string, output_len, "32",
          "Output tokens, the same forms as --input_len");
ABSL_FLAG(int32_t, shared_prefix_len, 0,
          "Leading prompt tokens shared with other prompts (0: none)");
ABSL_FLAG(int32_t, num_prefixes, 1, "Distinct shared prefixes");
ABSL_FLAG(int32_t, num_requests, 100,
          "Requests of the workload (a trace: at most this many, 0 all)");
ABSL_FLAG(std::string, trace, "",
          "Replay a trace instead: Mooncake .jsonl or Azure .csv");
ABSL_FLAG(double, length_scale, 1.0, "Trace lengths are divided by this");
ABSL_FLAG(double, time_scale, 1.0,
          "Trace arrival times are multiplied by this");
ABSL_FLAG(double, trace_start_s, 0,
          "Start of the trace window replayed, trace seconds");
ABSL_FLAG(double, trace_duration_s, 0,
          "Length of the trace window (0: to the end)");
ABSL_FLAG(int32_t, max_input_len, 0,
          "Trace prompt lengths are clipped to this (0: no clip)");
ABSL_FLAG(int32_t, max_output_len, 0,
          "Trace output lengths are clipped to this (0: no clip)");

// Load.
ABSL_FLAG(int32_t, concurrency, 0,
          "Closed loop: this many requests in flight (arrival times ignored)");
ABSL_FLAG(std::string, request_rate, "",
          "Open loop: requests per second (or inf: all at once)");
ABSL_FLAG(
    std::vector<std::string>, request_rates, {},
    "Open-loop sweep: one run per rate on the same workload, e.g. 1,2,4,inf");
ABSL_FLAG(double, burstiness, 1.0,
          "Gamma shape of inter-arrival times: 1 Poisson, < 1 burstier, > 1 "
          "steadier");
ABSL_FLAG(double, duration_s, 0,
          "Stop sending after this many seconds per run (0: no limit)");
ABSL_FLAG(double, warmup_s, 0,
          "Requests sent before this are left out of the summary");
ABSL_FLAG(
    double, cooldown_s, 0,
    "Requests sent in the last this-many seconds of sending are left out");
ABSL_FLAG(uint64_t, seed, 0, "Seed of the lengths, prompts and arrivals");

// SLO.
ABSL_FLAG(double, slo_ttft_ms, 0, "TTFT target, ms (0: none)");
ABSL_FLAG(double, slo_tpot_ms, 0, "TPOT target, ms (0: none)");
ABSL_FLAG(double, attainment_target, 0.9,
          "Goodput: the highest rate whose SLO attainment is at least this");

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

// One run of the sweep.
struct RunSpec {
  double rate = 0;           // Open loop; inf: all at once.
  int32_t concurrency = 0;   // Closed loop.
  bool trace_times = false;  // Open loop at the trace's own times.
  std::string label;         // "rate 4/s", "concurrency 8", "trace times".
  std::string tag;           // For file names: "rate-4", "concurrency-8".
};

std::string RateText(double rate) {
  return std::isinf(rate) ? "inf" : absl::StrFormat("%g", rate);
}

absl::StatusOr<double> ParseRate(std::string text) {
  absl::StripAsciiWhitespace(&text);
  double rate = 0;
  if (absl::AsciiStrToLower(text) == "inf") return kInf;
  if (!absl::SimpleAtod(text, &rate) || !(rate > 0) || std::isinf(rate)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "request rate '", text, "' is not a positive number or inf"));
  }
  return rate;
}

// The runs the load flags ask for.
absl::StatusOr<std::vector<RunSpec>> PlanRuns(bool trace) {
  const int32_t concurrency = absl::GetFlag(FLAGS_concurrency);
  std::vector<std::string> rates = absl::GetFlag(FLAGS_request_rates);
  const std::string rate = absl::GetFlag(FLAGS_request_rate);
  if (!rate.empty()) {
    if (!rates.empty()) {
      return absl::InvalidArgumentError(
          "give --request_rate (one run) or --request_rates (a sweep), not "
          "both");
    }
    rates.push_back(rate);
  }
  if (concurrency < 0) {
    return absl::InvalidArgumentError(
        "--concurrency must be positive (closed loop)");
  }
  if (concurrency > 0 && !rates.empty()) {
    return absl::InvalidArgumentError(
        "--concurrency (closed loop) and --request_rate(s) (open loop) exclude "
        "each "
        "other: give one");
  }
  std::vector<RunSpec> runs;
  if (concurrency > 0) {
    runs.push_back({0, concurrency, false,
                    absl::StrCat("concurrency ", concurrency),
                    absl::StrCat("concurrency-", concurrency)});
    return runs;
  }
  for (const std::string& r : rates) {
    auto parsed = ParseRate(r);
    if (!parsed.ok()) return parsed.status();
    runs.push_back({*parsed, 0, false,
                    absl::StrCat("rate ", RateText(*parsed), "/s"),
                    absl::StrCat("rate-", RateText(*parsed))});
  }
  if (runs.empty()) {
    if (!trace) {
      return absl::InvalidArgumentError(
          "give a load: --concurrency=N (closed loop), --request_rate=R or "
          "--request_rates=R1,R2,... (open loop; inf: all at once)");
    }
    runs.push_back({0, 0, true, "trace times", "trace"});
  }
  return runs;
}

absl::StatusOr<Workload> MakeWorkload() {
  const std::string trace = absl::GetFlag(FLAGS_trace);
  if (!trace.empty()) {
    TraceOptions options;
    options.path = trace;
    options.length_scale = absl::GetFlag(FLAGS_length_scale);
    options.time_scale = absl::GetFlag(FLAGS_time_scale);
    options.start_s = absl::GetFlag(FLAGS_trace_start_s);
    if (absl::GetFlag(FLAGS_trace_duration_s) > 0) {
      options.duration_s = absl::GetFlag(FLAGS_trace_duration_s);
    }
    options.max_requests = absl::GetFlag(FLAGS_num_requests);
    options.max_input_tokens = absl::GetFlag(FLAGS_max_input_len);
    options.max_output_tokens = absl::GetFlag(FLAGS_max_output_len);
    return LoadTraceWorkload(options);
  }
  SyntheticOptions options;
  auto input = LengthDistribution::Parse(absl::GetFlag(FLAGS_input_len));
  if (!input.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--input_len: ", input.status().message()));
  }
  auto output = LengthDistribution::Parse(absl::GetFlag(FLAGS_output_len));
  if (!output.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--output_len: ", output.status().message()));
  }
  options.input = *std::move(input);
  options.output = *std::move(output);
  options.num_requests = absl::GetFlag(FLAGS_num_requests);
  options.shared_prefix_tokens = absl::GetFlag(FLAGS_shared_prefix_len);
  options.num_prefixes = absl::GetFlag(FLAGS_num_prefixes);
  options.seed = absl::GetFlag(FLAGS_seed);
  if (options.num_requests <= 0) {
    return absl::InvalidArgumentError("--num_requests must be positive");
  }
  if (options.shared_prefix_tokens < 0 || options.num_prefixes <= 0) {
    return absl::InvalidArgumentError(
        "--shared_prefix_len must be 0 or more and --num_prefixes positive");
  }
  return MakeSyntheticWorkload(options);
}

// Checks what the workload and runs do not.
absl::Status CheckOtherFlags() {
  if (absl::GetFlag(FLAGS_address).empty()) {
    return absl::InvalidArgumentError(
        "--address is required: the server's host:port (pd-router's gRPC port "
        "for "
        "--target=grpc, its HTTP port for --target=openai)");
  }
  if (!(absl::GetFlag(FLAGS_request_timeout_s) > 0)) {
    return absl::InvalidArgumentError("--request_timeout_s must be positive");
  }
  if (absl::GetFlag(FLAGS_duration_s) < 0 ||
      absl::GetFlag(FLAGS_warmup_s) < 0 ||
      absl::GetFlag(FLAGS_cooldown_s) < 0) {
    return absl::InvalidArgumentError(
        "--duration_s, --warmup_s and --cooldown_s must be 0 or more");
  }
  if (!(absl::GetFlag(FLAGS_burstiness) > 0)) {
    return absl::InvalidArgumentError(
        "--burstiness must be positive (1: Poisson)");
  }
  if (absl::GetFlag(FLAGS_slo_ttft_ms) < 0 ||
      absl::GetFlag(FLAGS_slo_tpot_ms) < 0) {
    return absl::InvalidArgumentError(
        "--slo_ttft_ms and --slo_tpot_ms must be 0 (none) or more");
  }
  const double target = absl::GetFlag(FLAGS_attainment_target);
  if (!(target > 0 && target <= 1)) {
    return absl::InvalidArgumentError("--attainment_target must be in (0, 1]");
  }
  return absl::OkStatus();
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

std::string Quote(const std::string& s) {
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

// Runs plot_bench.py on the summary; the PNG files it wrote.
absl::StatusOr<std::vector<std::string>> Plot(const std::string& summary_path,
                                              const std::string& dir) {
  const std::string command =
      absl::StrCat("python3 ", Quote(PlotScript()), " --summary ",
                   Quote(summary_path), " --out_dir ", Quote(dir));
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

int Main() {
  if (absl::Status s = CheckOtherFlags(); !s.ok()) return Fail(s, 2);
  const bool trace = !absl::GetFlag(FLAGS_trace).empty();
  auto runs = PlanRuns(trace);
  if (!runs.ok()) return Fail(runs.status(), 2);
  auto workload = MakeWorkload();
  if (!workload.ok()) {
    return Fail(
        workload.status(),
        workload.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1);
  }
  if (workload->requests.empty()) {
    return Fail(absl::InvalidArgumentError(
                    "the workload has no request (check the trace "
                    "window and --num_requests)"),
                2);
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
  if (!target.ok()) {
    return Fail(
        target.status(),
        target.status().code() == absl::StatusCode::kInvalidArgument ? 2 : 1);
  }

  const std::string plot_dir = absl::GetFlag(FLAGS_plot_dir);
  if (!plot_dir.empty()) {
    std::error_code ec;
    fs::create_directories(plot_dir, ec);
    if (ec) return Fail(absl::UnavailableError("cannot create " + plot_dir), 1);
  }
  const std::string records_flag = absl::GetFlag(FLAGS_records);
  const bool write_records = !records_flag.empty() || !plot_dir.empty();

  SummaryOptions summary_options;
  if (absl::GetFlag(FLAGS_slo_ttft_ms) > 0) {
    summary_options.slo.ttft_s = absl::GetFlag(FLAGS_slo_ttft_ms) / 1e3;
  }
  if (absl::GetFlag(FLAGS_slo_tpot_ms) > 0) {
    summary_options.slo.tpot_s = absl::GetFlag(FLAGS_slo_tpot_ms) / 1e3;
  }
  const double attainment_target = absl::GetFlag(FLAGS_attainment_target);

  std::cout << "pd-bench: " << absl::GetFlag(FLAGS_target) << " target at "
            << target_options.address << "; workload: " << workload->description
            << " (" << workload->requests.size() << " requests)\n";

  std::vector<SweepPoint> points;
  json runs_json = json::array();
  bool each_run_had_a_success = true;
  for (const RunSpec& run : *runs) {
    Workload w = *workload;
    LoadOptions load;
    load.concurrency = run.concurrency;
    load.duration_s = absl::GetFlag(FLAGS_duration_s) > 0
                          ? absl::GetFlag(FLAGS_duration_s)
                          : kInf;
    load.progress = absl::GetFlag(FLAGS_progress);
    load.label = run.label;
    double offered_rate = run.rate;
    if (run.concurrency == 0 && !run.trace_times) {
      ArrivalOptions arrivals;
      arrivals.rate = run.rate;
      arrivals.burstiness = absl::GetFlag(FLAGS_burstiness);
      arrivals.seed = absl::GetFlag(FLAGS_seed);
      if (absl::Status s = AssignArrivals(arrivals, w); !s.ok())
        return Fail(s, 2);
    }
    if (run.trace_times) {
      const double span =
          w.requests.back().arrival_s - w.requests.front().arrival_s;
      offered_rate = span > 0 ? (w.requests.size() - 1) / span : kInf;
    }
    auto result = RunLoad(w, **target, load);
    if (!result.ok()) return Fail(result.status(), 1);

    double last_send = 0;
    for (const RequestRecord& r : result->records)
      last_send = std::max(last_send, r.send_s);
    SummaryOptions options = summary_options;
    options.window_begin_s = absl::GetFlag(FLAGS_warmup_s);
    if (absl::GetFlag(FLAGS_cooldown_s) > 0) {
      options.window_end_s = last_send - absl::GetFlag(FLAGS_cooldown_s);
    }
    SweepPoint point;
    point.rate = offered_rate;
    point.concurrency = run.concurrency;
    point.summary = Summarize(result->records, options);
    points.push_back(point);

    // JSON has no infinity: null, as in SweepToJson.
    auto number = [](double v) {
      return std::isfinite(v) ? json(v) : json(nullptr);
    };
    json run_json = {{"label", run.label},
                     {"rate", number(offered_rate)},
                     {"concurrency", run.concurrency},
                     {"requests_sent", result->records.size()},
                     {"wall_s", result->wall_s},
                     {"max_send_lateness_s", result->max_send_lateness_s},
                     {"window_begin_s", number(options.window_begin_s)},
                     {"window_end_s", number(options.window_end_s)}};
    if (write_records) {
      const std::string path = RecordsPath(records_flag, plot_dir, run.tag);
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
      std::cerr << "pd-bench: " << run.label << ": "
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
      "            --num_requests, --shared_prefix_len, --num_prefixes, or "
      "--trace=PATH\n"
      "            with --length_scale, --time_scale, --trace_start_s, "
      "--trace_duration_s\n"
      "  load:     --concurrency=N | --request_rate=R | "
      "--request_rates=R1,R2,...\n"
      "            (--burstiness, --duration_s, --warmup_s, --cooldown_s, "
      "--seed)\n"
      "  SLO:      --slo_ttft_ms, --slo_tpot_ms, --attainment_target\n"
      "  output:   --records=F.jsonl, --summary_json=F, --plot_dir=D; a table "
      "on stdout");
  std::vector<char*> rest = absl::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::cerr << "pd-bench: unexpected argument '" << rest[1]
              << "'; every option is a --flag (--help lists them)\n";
    return 2;
  }
  return pdserve::planner::Main();
}
