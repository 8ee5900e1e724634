// The flags pd-bench and pd-plan share: what workload to run, at what load,
// against what SLO — so that a simulation and a real run of "the same
// workload" are the same by construction. Both tools read these flags only
// through the functions below; neither defines any of them itself.
//
//   workload  --input_len, --output_len (LengthDistribution specs; default
//             256 and 64), --shared_prefix_len, --num_prefixes,
//             --num_requests (default 200), --seed; or --trace=PATH with
//             --length_scale, --time_scale, --trace_start_s,
//             --trace_duration_s (0: to the end), --trace_max_requests
//             (0: all; --num_requests is refused with a trace),
//             --max_input_len, --max_output_len
//   load      --concurrency (closed loop) or --request_rate /
//             --request_rates (open loop, Poisson or gamma arrivals with
//             --burstiness; inf: all at once; a trace replayed at a rate
//             keeps its pattern, time-scaled to it); a trace with neither
//             replays its own times
//   summary   --slo_ttft_ms, --slo_tpot_ms (0: no target), --attainment_target,
//             --warmup_s, --cooldown_s
//
// Every function checks the flags it reads and fails with
// INVALID_ARGUMENT naming the flag and what to give instead, so a tool can
// refuse bad flags (pd-bench: exit 2) before it runs anything.
// Thread-safety: reads flags, so call from main's thread after parsing.
#ifndef PDSERVE_PLANNER_WORKLOAD_FLAGS_H_
#define PDSERVE_PLANNER_WORKLOAD_FLAGS_H_

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/summary.h"
#include "planner/workload.h"

namespace pdserve::planner {

// The workload the flags describe; a synthetic one has no arrival times
// yet (WorkloadAtLoad gives them). Never empty: a trace window with no
// request is INVALID_ARGUMENT. NOT_FOUND for a missing trace file.
absl::StatusOr<Workload> WorkloadFromFlags();

// One load level of a run: a rate (open loop; infinity: all at once) or a
// concurrency (closed loop, rate 0); both 0: a trace's own times.
struct LoadLevel {
  double rate = 0;
  int32_t concurrency = 0;
  // Its place in a sweep. The prompts of every level after the first get
  // other content (the same lengths and prefix structure): a sweep sends
  // its levels to one cluster, and the same prompts again would be served
  // from the prefix cache the earlier level filled.
  int32_t index = 0;
  // Which run of the level (pd-plan validate --repeats): each later run
  // gets other content too.
  int32_t repeat = 0;
  std::string Name() const;  // "2 req/s", "inf req/s", "concurrency 8", "trace times"
};

// The load levels the flags ask for, in order; the trace's own times
// (rate 0, concurrency 0) when a trace is given with neither. Checks
// --burstiness too, which WorkloadAtLoad uses.
absl::StatusOr<std::vector<LoadLevel>> LoadLevelsFromFlags();

// `workload` with the arrival times and prompt content of `level` (see
// LoadLevel::index): a synthetic workload gets
// Poisson/gamma arrivals (--burstiness, --seed); a trace is time-scaled so
// that its mean rate is level.rate (kept as it is for rate 0; all at 0
// for an infinite rate).
absl::StatusOr<Workload> WorkloadAtLoad(const Workload& workload, const LoadLevel& level);

// The rate `level` offers with `at` (WorkloadAtLoad's result), the rate of
// its sweep point: level.rate, or for a trace's own times their mean rate
// (infinity when every request arrives at once); 0 for a closed loop.
double OfferedRate(const Workload& at, const LoadLevel& level);

// What a run's summary is judged against.
struct SummarySpec {
  // --slo_ttft_ms, --slo_tpot_ms; infinity where the flag is 0 (no target).
  SloTargets slo;
  // --attainment_target, in (0, 1]: goodput is the highest rate whose SLO
  // attainment is at least this.
  double attainment_target = 0.9;
  // --warmup_s, --cooldown_s: requests sent in the first warmup_s seconds
  // and after the run's last send - cooldown_s are left out.
  double warmup_s = 0;
  double cooldown_s = 0;

  // The options that summarise `records` (one run) by this spec.
  SummaryOptions OptionsFor(std::span<const RequestRecord> records) const;
};

absl::StatusOr<SummarySpec> SummarySpecFromFlags();

// Makes --help list every flag defined in planner/: the tool's own and the
// shared ones above. (Abseil's default lists the flags of a file named
// after the binary, pd-bench.cc or pd-plan.cc, which neither tool has.)
// Call in main before absl::ParseCommandLine.
void ListPlannerFlagsInHelp();

}  // namespace pdserve::planner

#endif  // PDSERVE_PLANNER_WORKLOAD_FLAGS_H_
