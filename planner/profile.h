// Profile: what pd-plan knows about the workers of one machine, measured by
// `pd-plan profile` (planner/profiler.h) and read by the simulator. Saved as
// JSON; every field below by name.
//
// The engine's cost is one model of a Generator step (engine/generator.h:
// the decode token of every running sequence, then prefill chunks, up to
// max_batch_tokens), fitted by least squares to steps of the real engine:
//
//   step seconds = dense(tokens)
//                  + base_s + per_token_s * tokens + per_sequence_s * sequences
//                  + per_attention_s * sum over prefill chunks of
//                    AttentionPairs(its start, its tokens)
//                  + per_decode_attention_s * sum over decode tokens of
//                    AttentionPairs(their start, 1)
//                  + per_decode_kv_beyond_cache_s * max(0, that sum
//                    - decode_cache_tokens)
//
// `tokens` counts prompt and decode tokens alike: they are the rows of the
// step's matrix products. dense(tokens) is what those products cost, as
// measured: dense_s at the row counts dense_tokens (decode batches and
// prefill chunk sizes), linear in between. It is a table, not a line,
// because the kernels change with the rows: few rows stream the weights
// once (memory-bound), more rows take packed panels (compute-bound), and a
// step of 4 decode tokens costs a third of one of 8 on an AVX2 EPYC
// (docs/capacity_planning.md run 14). A fitted profile has the table and
// no base, per-token or per-sequence cost; those describe a machine by
// hand (tests, what-ifs), and the two add up.
// The attention terms are the (query, key) pairs the step's causal
// attention computes: each new token attends to every token before it and
// to itself. They are apart for prefill and decode because a decode token
// reads its whole context for one query (memory-bound: builtin:tiny's
// measured ~2x the cost per pair of a prefill chunk's, whose queries share
// what they read).
// A decode token's pairs are the KV tokens it reads, so their sum is the
// step's KV working set; beyond what one core's cache holds
// (decode_cache_tokens: its L2 over kv_bytes_per_token) every KV token
// costs per_decode_kv_beyond_cache_s more, read from memory.
// Thread-safety: values.
#ifndef PDSERVE_PLANNER_PROFILE_H_
#define PDSERVE_PLANNER_PROFILE_H_

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace pdserve::planner {

// The causal attention pairs of `tokens` new tokens after `start` computed
// ones: tokens * start + tokens * (tokens + 1) / 2.
inline double AttentionPairs(int64_t start, int64_t tokens) {
  return static_cast<double>(tokens) * static_cast<double>(start) +
         static_cast<double>(tokens) * static_cast<double>(tokens + 1) / 2;
}

struct StepCost {
  double base_s = 0;
  double per_token_s = 0;
  double per_sequence_s = 0;
  double per_attention_s = 0;
  double per_decode_attention_s = 0;
  double decode_cache_tokens = 0;
  double per_decode_kv_beyond_cache_s = 0;
  // The dense table: ascending row counts (at least 1) and what a step of
  // that many tokens costs at each; empty: none.
  std::vector<int32_t> dense_tokens;
  std::vector<double> dense_s;

  // dense(tokens): linear between the table's two nearest row counts, along
  // its first or last segment outside them (a one-row table: constant), never
  // below 0.
  double Dense(int64_t tokens) const;
  // Where `tokens` falls in a table of two rows or more: the segment's upper
  // end i (from 1) and the weight f of dense_s[i], 1 - f that of
  // dense_s[i - 1] (f < 0 or > 1 outside the table).
  std::pair<size_t, double> DenseSegment(int64_t tokens) const;
  double Seconds(int64_t tokens, int64_t sequences, double attention,
                 double decode_attention = 0) const {
    return Dense(tokens) + base_s + per_token_s * tokens + per_sequence_s * sequences +
           per_attention_s * attention + per_decode_attention_s * decode_attention +
           per_decode_kv_beyond_cache_s * std::max(0.0, decode_attention - decode_cache_tokens);
  }
};

// One KV transport: moving n bytes takes latency_s + n / bytes_per_s.
struct TransferCost {
  std::string transport;
  double latency_s = 0;
  double bytes_per_s = 0;
};

struct Profile {
  // What was measured, for every report: model spec, CPU model and flags,
  // how each worker's CPU share was set, the date.
  std::string model;
  std::string machine;
  std::string cpu_share;
  // CPUs of time each worker was held to (deploy/local/cpu_share.sh); 0:
  // no limit. Validation runs its clusters under the same.
  double worker_cpus = 0;
  // Each worker's engine, as profiled (engine/engine_flags.h).
  int32_t threads = 1;
  int32_t block_size = 16;
  int32_t max_batch_tokens = 512;
  int32_t max_running = 64;
  // KV pool of each prefill and each decode worker, in blocks.
  int64_t prefill_kv_blocks = 0;
  int64_t decode_kv_blocks = 0;
  // The largest prompt + output the model takes.
  int32_t max_context = 0;
  StepCost step;
  // KV bytes of one token (all layers, K and V).
  double kv_bytes_per_token = 0;
  std::vector<TransferCost> transfers;
  // Costs of the serving path beyond Generator::Step, measured through a
  // real cluster (planner/profiler.h MeasureServingCosts):
  //  - colocated_first_token_s: what a colocated request's TTFT adds to
  //    its prefill steps (router, gRPC, tokenizing, streaming);
  //  - disaggregated_first_token_s: what a disaggregated one's adds to its
  //    prefill steps and the push's tail (Reserve, Prefill, KvComplete:
  //    the prefill worker answers the first token once its push is done);
  //  - token_delivery_s: from the end of the step that computed a later
  //    token of a colocated request to its arrival at the client;
  //  - disaggregated_token_delivery_s: see the field;
  //  - decode_step_overhead_s + decode_sequence_overhead_s * sequences:
  //    what each step of a serving worker takes beyond Generator::Step
  //    (its loop, and streaming each token through gRPC, which under a
  //    CPU share spends the same quota): the decode worker's own time
  //    between back-to-back steps (pdserve_decode_step_gap_seconds) under
  //    closed-loop batches, per step.
  double colocated_first_token_s = 0;
  double disaggregated_first_token_s = 0;
  double token_delivery_s = 0;
  // From the end of the decode step that computed a later token of a
  // disaggregated request to its arrival at the client, the hand-off
  // included: the request joins the decode worker's queue when its KV has
  // landed, and whatever its Decode call takes before that is in here (a
  // client's timings do not tell the two apart). Apart from
  // token_delivery_s because it sets the gap between a disaggregated
  // request's first token (from the prefill worker) and its second (from
  // the decode worker); the colocated constant made that gap up to 4 ms
  // too long (docs/capacity_planning.md run 7).
  double disaggregated_token_delivery_s = 0;
  double decode_step_overhead_s = 0;
  double decode_sequence_overhead_s = 0;
  // Engine time a prefill worker loses to its own serving threads (gRPC,
  // the KV push), which spend its CPU share too: their CPU time on a 1P1D
  // cluster (MeasureServingCosts) over worker_cpus, per request and per KV
  // byte pushed; 0 without a share. The push runs while the step that
  // computed its KV does, so the simulator adds its cost to that step; the
  // cost per request is paid by the next step or by idle time (simulator.h).
  double prefill_cpu_per_request_s = 0;
  double prefill_cpu_per_kv_byte_s = 0;
  // A decode worker's serving threads' CPU per token it streams (gRPC's
  // writes of the stream), over worker_cpus; 0 without a share. They run
  // beside the engine thread on the same quota, so a busy worker's steps
  // wait for what they spend: 51-60 us of CPU a token on run 19's machine
  // under load (bench/decode_serving_cpu.sh), 130-150 us of the quota's
  // time at 0.4 CPU, where the decode step overheads above (the engine
  // thread's own time between steps) came to 2-77 us a sequence.
  // MeasureServingCosts takes it from four concurrent streams. The simulator charges it with
  // each decode step's tokens, paid by the next step or by idle time, as a
  // prefill worker's serving threads. (Their cost per request, 0.9 ms and
  // 6 us a prompt token landed there, is left out: charged the same way it
  // made run 19's predictions no better.)
  double decode_cpu_per_token_s = 0;
  // A serving prefill worker's engine CPU per prompt over what the step
  // cost gives for it, measured on the 1P1D cluster right after the fit
  // with its prefill worker kept busy (MeasureServingCosts); the simulator
  // multiplies a prefill worker's step cost by it. The step cost is fitted
  // to steps run back to back in the profiler's own process; a worker's
  // engine, between gRPC calls and KV pushes, ran 1.11x that in run 10 of
  // docs/capacity_planning.md, and the same prompts on one worker took
  // 2.09-2.30 CPU-s in runs that day, with or without a CPU share
  // (bench/prefill_engine_cpu.sh). 1 without a share.
  double prefill_engine_scale = 1;
  // The same of a decode worker's engine, kept busy with colocated prompts
  // on a 0P1D cluster; the simulator multiplies the cost of a decode
  // worker's steps that compute prompt tokens by it, and the colocated
  // first-token constant is fitted against the scaled prefill. 1 without
  // a share.
  double decode_engine_scale = 1;
  // The same of a disaggregated decode worker's engine over its decode
  // batches alone (MeasureServingCosts: closed-loop streams on a 1P1D
  // cluster); the simulator multiplies the cost of a decode worker's steps
  // that compute no prompt token by it. Apart from decode_engine_scale
  // since run 23 of docs/capacity_planning.md: run 22's decode-only
  // workers stepped 33-120% faster than the colocated scale predicted,
  // and run 23's profile read x1.043 here against x1.195 there. 1 without
  // a share; decode_engine_scale with more than one compute thread (the
  // step CPU it is measured from is the loop thread's alone).
  double decode_batch_scale = 1;
  // The router's load-report poll (router --poll_interval_ms).
  double poll_interval_s = 0.1;
  // The drift probe (profiler.h DriftProbeOptions) run right after the
  // fit: its ProbeRatio against this profile, i.e. the fitted step model's
  // own bias at the probe's steps and how far the machine's speed moved
  // while it was profiled (ProfileSpeedWarning).
  double probe_ratio = 1;
};

// `profile` with what each role's worker CPU does scaled (pd-plan
// validate's drift check, --engine_scale): a prefill worker's by `prefill`
// (prefill_engine_scale, its serving threads' prefill_cpu_per_*), a decode
// worker's by `decode` (decode_engine_scale, the decode step overheads, its
// serving threads' decode_cpu_per_token_s).
// The first-token, hand-off and delivery costs and the transfers stay:
// they are mostly waiting (network, polls), not the CPU the drift check
// measures.
Profile WithDrift(Profile profile, double prefill, double decode);

// The CPUs a step of the model's takes its time over: worker_cpus, or all
// of one CPU without a share. A step's CPU is its model time times this.
inline double StepCpus(const Profile& profile) {
  return profile.worker_cpus > 0 ? profile.worker_cpus : 1;
}

// What a profile's user should be told when its drift probe, run right
// after the fit, says the machine's speed changed while it was profiled:
// |probe_ratio - 1| beyond 0.25 (the ratio also holds the fit's own bias at
// the probe's steps, hence the wide bound; run 11 of
// docs/capacity_planning.md: 0.70, and its prefill predictions 21% long).
// Empty when there is nothing to say.
std::string ProfileSpeedWarning(const Profile& profile);

// The bounds every reader of a profile relies on: counts at least 1
// (max_batch_tokens at least max_running, as the engine demands; prefill
// pool at least 0), costs finite and non-negative, transfer bandwidths and
// the poll interval positive, transports named once each.
// INVALID_ARGUMENT naming the bad field.
absl::Status ValidateProfile(const Profile& profile);

// JSON: an object with every field above by name; `step` an object of its
// four coefficients, `transfers` an array of {transport, latency_s,
// bytes_per_s}.
nlohmann::json ToJson(const Profile& profile);
// INVALID_ARGUMENT naming the missing or bad field (every field is
// required, and the result must pass ValidateProfile).
absl::StatusOr<Profile> ProfileFromJson(const nlohmann::json& json);
// NOT_FOUND / INVALID_ARGUMENT.
absl::StatusOr<Profile> ReadProfile(const std::string& path);
absl::Status WriteProfile(const std::string& path, const Profile& profile);

}  // namespace pdserve::planner

#endif  // PDSERVE_PLANNER_PROFILE_H_
