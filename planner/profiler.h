// Profiler: measures what planner/profile.h's Profile holds, on this
// machine, with the real components:
//
//   MeasureEngineSteps  the engine (a Generator over the model's runner,
//                       the objects every worker runs) through designed
//                       steps: prefill chunks of 16 .. max_batch_tokens
//                       tokens at contexts up to 4 chunks, decode batches of
//                       1 .. max_running sequences at short and long
//                       contexts, and mixed steps (decodes plus a chunk);
//                       each step's composition is known by construction.
//   FitStepCost         least squares (non-negative, least_squares.h) of the step model on
//                       those samples, with its error on them.
//   MeasureTransfers    one KV transport pair in this process: writes of
//                       one block up to 4 MiB, fitted to latency + size /
//                       bandwidth.
//   MeasureServingCosts requests through a real disaggregated (1P1D) and
//                       colocated (0P1D) cluster: single requests for what
//                       TTFT and the hand-off add to the engine's steps,
//                       closed-loop batches for what streaming adds to
//                       each decode step (router, gRPC, hand-off).
//
// Under a CPU share, an engine step is timed as its CPU time over the share
// (EngineProfileOptions::cpu_share): what it takes on average under the
// quota. The transfers are timed on the wall clock in a child process
// placed in such a cgroup (deploy/local/cpu_share.sh), and the clusters
// run with cluster.sh --cpu-share.
// Thread-safety: functions; each call owns what it creates.
#ifndef PDSERVE_PLANNER_PROFILER_H_
#define PDSERVE_PLANNER_PROFILER_H_

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "planner/cluster_launcher.h"
#include "planner/profile.h"

namespace pdserve::planner {

// One measured engine step.
struct StepSample {
  int64_t tokens = 0;
  int64_t sequences = 0;
  // Prefill chunks' and decode tokens' attention terms (profile.h).
  double attention = 0;
  double decode_attention = 0;
  double seconds = 0;
  // "prefill", "decode" or "mixed".
  std::string kind;
  // The step right after the prefill steps that computed its batch's
  // prompts (a batch's first decode step, and every mixed step): its KV
  // was last touched by those, and what is not in this core's cache is
  // read from memory. Later decode steps of one batch re-read the same KV,
  // which a machine without other work keeps in its last-level cache.
  bool after_prefill = false;
};

struct EngineProfileOptions {
  // Default: "builtin:tiny".
  std::string model = "builtin:tiny";
  // Engine threads (--num_threads of the workers). Default: 1.
  int32_t threads = 1;
  // Default: 16.
  int32_t block_size = 16;
  // Default: 512.
  int32_t max_batch_tokens = 512;
  // Default: 64.
  int32_t max_running = 64;
  // Largest context the decode steps are measured at. Default: 1024.
  int32_t max_context = 1024;
  // Repetitions of each designed step. Default: 5.
  int32_t reps = 5;
  // > 0: a step's time is the CPU time it took divided by this (the
  // workers' CPU share); 0: wall-clock. Default: 0.
  double cpu_share = 0;
  // The drift probe's short design instead of the full one: prefill chunks
  // of 64 and max_batch_tokens tokens, decode batches of 1 and 8 at context
  // max_context / 4, no mixed steps; a few seconds. Default: false.
  bool probe = false;
  // Called with a line of progress now and then. Default: none.
  std::function<void(std::string_view)> progress;
};

absl::StatusOr<std::vector<StepSample>> MeasureEngineSteps(const EngineProfileOptions& options);

struct StepFit {
  StepCost cost;
  // Median and 90th percentile of |predicted - measured| / measured over
  // the design points (the mean of the steps of one kind, tokens,
  // sequences and attention within 5%, right after its prefill or not),
  // per kind: "prefill", "mixed", "decode" and "decode, right after its
  // prefill" (its KV and weights last touched by the prefill steps).
  std::vector<std::pair<std::string, std::pair<double, double>>> relative_error;
};
// The step model of profile.h, by non-negative relative least squares on
// every design point at once: the dense table at the row counts of the
// prefill and decode steps (non-decreasing: more tokens never cost less),
// the two attention costs, and (with
// decode_cache_tokens > 0: CoreCacheBytes() / KV bytes per token) the
// extra cost of decode KV beyond the cache. The base, per-token and
// per-sequence costs stay 0 (the table has them). Every decode step
// counts, the steady ones and those right after their prefill alike:
// a serving worker's batch has both, with other workers on its cores.
// (Until run 14 of docs/capacity_planning.md one line, base + per token +
// per sequence, stood for the table, and the cost beyond the cache was
// fitted on the steps right after their prefill alone; on an AVX2 EPYC
// that put decode steps 25% off at the median design point.)
// INVALID_ARGUMENT with fewer design points than coefficients, fewer than
// two row counts, or a step of no tokens or no time.
absl::StatusOr<StepFit> FitStepCost(const std::vector<StepSample>& samples,
                                    double decode_cache_tokens = 0);

// The cache of one core that a decode step's KV stays in between steps
// under load: its L2 (sysconf), in bytes; 0 when the system does not say.
int64_t CoreCacheBytes();

// The KV bytes of one token of `model` (K and V of every layer, in the
// cache's dtype). NOT_FOUND / INVALID_ARGUMENT as Model::Load.
absl::StatusOr<double> KvBytesPerToken(const std::string& model);

// One transport per name (kv_transfer registry), `reps` posts per size.
absl::StatusOr<std::vector<TransferCost>> MeasureTransfers(const std::vector<std::string>& names,
                                                           int32_t reps);

// The drift probe (EngineProfileOptions::probe, 3 reps) with the
// engine options `profile` was measured with: model, threads, block size,
// batch limits, CPU share; it decodes at a quarter of the model's context,
// 256 at most.
EngineProfileOptions DriftProbeOptions(const Profile& profile);

// The median over `samples` of measured step time / the step time
// `profile` predicts for it: of the probe run right after the profile's
// fit, the profile's probe_ratio. INVALID_ARGUMENT without samples.
absl::StatusOr<double> ProbeRatio(const Profile& profile, const std::vector<StepSample>& samples);

// How a cluster of `profile`'s workers is launched: the model, the engine
// flags it was profiled with, each role's KV pool (--kv_blocks), its CPU
// share. The caller sets the counts and the directories.
LaunchOptions LaunchOptionsFor(const Profile& profile);

struct ServingCostOptions {
  // Prompt tokens and output tokens of each request. Default: 256, 32.
  int32_t prompt_tokens = 256;
  int32_t output_tokens = 32;
  // Single requests per cluster (the first is a warm-up). Default: 12.
  int32_t requests = 12;
  // Closed-loop batch sizes on the disaggregated cluster, for the decode step
  // overheads. Default: 1, 4, 16.
  std::vector<int32_t> batches = {1, 4, 16};
  // How the clusters are started (LaunchOptionsFor, with the
  // directories); the counts and routing are set here (0P1D, then 1P1D).
  LaunchOptions launch;
  std::function<void(std::string_view)> progress;
};

// How MeasureServingCosts keeps an engine busy for its engine scales:
// kBusyClients clients send kBusyPrompts prompts of BusyPromptTokens
// tokens (several quota periods each), 2 output tokens each, each client
// its next prompt as soon as the last is answered. pd-plan validate's
// drift check sends that load to each worker of the role it checks. The
// profile's scale is the median of kBusyRounds such loads, new prompts
// each time: the scale multiplies every step of its role, and one of
// three loads can be off (a prefill worker's x1.142, x1.006 and x1.010
// in one profile; docs/capacity_planning.md run 22).
inline constexpr int32_t kBusyClients = 2;
inline constexpr int32_t kBusyPrompts = 16;
inline constexpr int32_t kBusyOutputTokens = 2;
inline constexpr int32_t kBusyRounds = 3;
int32_t BusyPromptTokens(const ServingCostOptions& options, const Profile& profile);

// What `step` gives for `steps` decode steps that computed `tokens` tokens
// reading `attention` KV tokens in all: as many steps at their mean batch
// (the model taken linearly between the whole batches around it) and
// context. 0 unless steps > 0 and tokens >= steps.
double MeanDecodeSteps(const StepCost& step, double steps, double tokens, double attention);

// Fills profile's colocated_first_token_s, disaggregated_first_token_s,
// token_delivery_s, disaggregated_token_delivery_s (medians), the decode
// step overheads (least squares) and, under a CPU share, the prefill
// worker's serving threads' CPU (prefill_cpu_per_*: their CPU time over
// `requests` prompts of prompt_tokens and as many up to 4x as long) and its
// engine's CPU over the step cost's when kept busy with the longer prompts
// (prefill_engine_scale), and the same of a colocated decode worker
// (decode_engine_scale, measured first: the first-token constants are
// fitted against its scaled prefill) and of the 1P1D cluster's decode
// worker over its decode steps under the closed-loop batches
// (decode_batch_scale, from its pdserve_decode_step_cpu_seconds: the later
// tokens' delivery constants are fitted against its scaled steps; all 1
// without a share), given
// its engine fields, step cost, kv_bytes_per_token, max_context and
// transfers (the first is the clusters' transport, tcp).
absl::Status MeasureServingCosts(const ServingCostOptions& options, Profile& profile);

}  // namespace pdserve::planner

#endif  // PDSERVE_PLANNER_PROFILER_H_
