// The flags pd-bench and pd-plan share: what workload to run, at what load,
// against what SLO — so that a simulation and a real run of "the same
// workload" are the same by construction.
//
//   workload  --input_len, --output_len (LengthDistribution specs),
//             --shared_prefix_len, --num_prefixes, --num_requests, or
//             --trace=PATH with --length_scale, --time_scale,
//             --trace_start_s, --trace_duration_s, --trace_max_requests,
//             --max_input_len, --max_output_len
//   load      --concurrency (closed loop) or --request_rate /
//             --request_rates (open loop; a trace replayed at a rate is
//             time-scaled to it), --burstiness, --seed
//   summary   --slo_ttft_ms, --slo_tpot_ms, --attainment_target,
//             --warmup_s, --cooldown_s
//
// Thread-safety: read flags, so call from main's thread after parsing.
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
// yet (WorkloadAtLoad gives them). INVALID_ARGUMENT naming the flag.
absl::StatusOr<Workload> WorkloadFromFlags();

// One load level of a run: a rate (open loop; infinity: all at once) or a
// concurrency (closed loop, rate 0).
struct LoadLevel {
  double rate = 0;
  int32_t concurrency = 0;
  std::string Name() const;  // "2 req/s", "inf req/s", "concurrency 8"
};

// The load levels the flags ask for, in order; the trace's own times
// (rate 0, concurrency 0) when a trace is given with neither.
// INVALID_ARGUMENT naming the flag.
absl::StatusOr<std::vector<LoadLevel>> LoadLevelsFromFlags();

// `workload` with the arrival times of `level`: a synthetic workload gets
// Poisson/gamma arrivals (--burstiness, --seed); a trace is time-scaled so
// that its mean rate is level.rate (kept as it is for rate 0).
absl::StatusOr<Workload> WorkloadAtLoad(const Workload& workload, const LoadLevel& level);

// The SLO and window of a run's summary: requests sent in the first
// --warmup_s and after the last send - --cooldown_s are left out.
SummaryOptions SummaryOptionsFromFlags(std::span<const RequestRecord> records);
double AttainmentTargetFromFlags();

}  // namespace pdserve::planner

#endif  // PDSERVE_PLANNER_WORKLOAD_FLAGS_H_
