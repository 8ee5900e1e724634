// Workload: the requests of one load test or one simulation, the same
// input for pd-bench (which sends them to a real endpoint) and pd-plan
// simulate (which runs them through a model of the cluster), so that the
// two summaries can be compared line by line.
//
// A request is an arrival time, a prompt length, an output length and the
// prompt's content as a chain of blocks: block_ids[i] names the content of
// prompt tokens [i * block_tokens, (i + 1) * block_tokens), and equal ids
// mean equal content. Two prompts whose first k ids are equal share a
// k-block prefix, which is what prefix caching and KV-aware routing
// exploit (the Mooncake traces' `hash_ids`, one per 512-token block).
//
// Sources:
//   - synthetic: lengths from a LengthDistribution, optionally a shared
//     prefix drawn from a pool of num_prefixes prefixes;
//   - traces (../shared/traces/README.md): Mooncake JSONL (timestamp ms,
//     input_length, output_length, hash_ids) and Azure LLM inference CSV
//     (TIMESTAMP, ContextTokens, GeneratedTokens), scaled for small
//     machines: lengths divided by length_scale (a 512-token block becomes
//     512 / length_scale tokens), arrival times multiplied by time_scale.
// Arrivals: a trace keeps its own (scaled) times unless AssignArrivals
// overwrites them; synthetic workloads get them from AssignArrivals:
// Poisson (burstiness 1) or gamma inter-arrival times with shape
// `burstiness` and mean 1 / rate (smaller burstiness: burstier), or all at
// 0 for an infinite rate. A closed-loop run ignores arrival times.
//
// Everything is a pure function of its options and seed.
// Thread-safety: values; no shared state.
#ifndef PDSERVE_PLANNER_WORKLOAD_H_
#define PDSERVE_PLANNER_WORKLOAD_H_

#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace pdserve::planner {

// A distribution of token counts, parsed from a spec:
//   "512"                       fixed
//   "uniform:128:1024"          uniform integers in [128, 1024]
//   "normal:512:64"             normal with mean 512, stddev 64, rounded,
//                               clipped to [1, mean + 6 * stddev]
//   "hist:128=0.5,512=0.3,2048=0.2"
//                               these values with these weights (weights
//                               need not sum to 1)
// Every sample is at least 1.
class LengthDistribution {
 public:
  // INVALID_ARGUMENT with the spec and what is wrong with it.
  static absl::StatusOr<LengthDistribution> Parse(std::string_view spec);
  // Same rng state, same sample, on every machine (no std distribution).
  int32_t Sample(std::mt19937_64& rng) const;
  // The spec's mean (normal: MEAN, before rounding and clipping).
  double Mean() const;
  // The spec, normalised (for reports).
  const std::string& spec() const { return spec_; }

 private:
  enum class Kind { kFixed, kUniform, kNormal, kHistogram };
  Kind kind_ = Kind::kFixed;
  std::string spec_ = "1";
  double a_ = 1, b_ = 1;  // fixed: a; uniform: [a, b]; normal: mean a, stddev b
  std::vector<int32_t> values_;
  std::vector<double> weights_;  // Normalised to sum to 1.
};

struct WorkloadRequest {
  // Seconds from the start of the run at which it is sent (open loop).
  double arrival_s = 0;
  int32_t input_tokens = 0;
  int32_t output_tokens = 0;
  // ceil(input_tokens / Workload::block_tokens) ids; see the file comment.
  std::vector<uint64_t> block_ids;
};

struct Workload {
  // Tokens per block id. Default: 16.
  int32_t block_tokens = 16;
  // In arrival order.
  std::vector<WorkloadRequest> requests;
  // What it is, with its scaling, for every report: e.g.
  // "mooncake_conversation_trace.jsonl, lengths / 16, time x 1, 600 s".
  std::string description;
};

struct SyntheticOptions {
  LengthDistribution input;   // Prompt tokens (the shared prefix included).
  LengthDistribution output;  // Output tokens.
  // Default: 1000.
  int32_t num_requests = 1000;
  // Leading prompt tokens taken from one of num_prefixes shared prefixes
  // (chosen uniformly); 0: every prompt is unique. Prompts shorter than
  // the prefix are all prefix. A block is shared only when all of its
  // tokens in the prompt are prefix tokens (so a prefix that ends inside a
  // block shares its whole blocks only, unless the prompt ends there too).
  // Shared-prefix ids and the ids of unique blocks never collide.
  // Default: 0.
  int32_t shared_prefix_tokens = 0;
  // Default: 1.
  int32_t num_prefixes = 1;
  // Default: 16.
  int32_t block_tokens = 16;
  // Default: 0.
  uint64_t seed = 0;
};

// INVALID_ARGUMENT for a non-positive count or block size.
absl::StatusOr<Workload> MakeSyntheticWorkload(const SyntheticOptions& options);

struct TraceOptions {
  // A .jsonl (Mooncake; hash_ids may be left out) or .csv (Azure: header
  // TIMESTAMP,ContextTokens,GeneratedTokens; arrival = seconds since the
  // earliest TIMESTAMP, read as UTC) file.
  std::string path;
  // Lengths are divided by this (rounded up, at least 1). The workload's
  // block_tokens is max(1, round(512 / length_scale)) for both formats;
  // a Mooncake prompt keeps its first ceil(input / block_tokens) hash_ids
  // and, when rounding leaves it more blocks than it has ids, gets fresh
  // unique ids for the rest; an Azure prompt's ids are all unique.
  // Trace hash_ids must be below 2^62. Default: 1.
  double length_scale = 1.0;
  // Arrival times are multiplied by this (2: half the rate). Default: 1.
  double time_scale = 1.0;
  // The window of the trace replayed, in trace seconds before scaling;
  // arrivals are shifted so that the window starts at 0.
  // Default: the whole trace.
  double start_s = 0;
  double duration_s = std::numeric_limits<double>::infinity();
  // At most this many requests (0: no limit). Default: 0.
  int32_t max_requests = 0;
  // Scaled lengths are clipped to these (0: no clip), e.g. to the model's
  // context. Default: 0.
  int32_t max_input_tokens = 0;
  int32_t max_output_tokens = 0;
};

// NOT_FOUND for a missing file; INVALID_ARGUMENT naming the file and line
// for a malformed one or bad options.
absl::StatusOr<Workload> LoadTraceWorkload(const TraceOptions& options);

struct ArrivalOptions {
  // Requests per second; infinity: every request at 0. Default: 1.
  double rate = 1.0;
  // Gamma shape of the inter-arrival times; 1: Poisson. Default: 1.
  double burstiness = 1.0;
  // Default: 0.
  uint64_t seed = 0;
};

// Overwrites every request's arrival_s, in workload order: the first at 0,
// each next one a drawn inter-arrival time later. INVALID_ARGUMENT for a
// rate or burstiness that is not positive (or a burstiness that is
// infinite).
absl::Status AssignArrivals(const ArrivalOptions& options, Workload& workload);

// The prompt's token ids: block id b's content is block_tokens ids drawn
// from [min_token, max_token] by a generator seeded with b, the prompt the
// concatenation of its blocks cut to input_tokens. Printable ASCII by
// default, so a byte-level tokenizer sees them as text too (PromptText).
struct PromptOptions {
  // Default: 'a' (97).
  int32_t min_token = 'a';
  // Default: 'z' (122).
  int32_t max_token = 'z';
};
std::vector<int32_t> PromptTokens(const Workload& workload, const WorkloadRequest& request,
                                  const PromptOptions& options = {});

}  // namespace pdserve::planner

#endif  // PDSERVE_PLANNER_WORKLOAD_H_
