// SimulatedGenerator: engine/generator.h's Generator without a model, for
// the cluster simulator (planner/simulator.h). Same policy, line for line
// (engine/generator.cc Admit, Step, Reserve, AddPrefilled):
//   - admission in arrival order, at most max_running sequences, a request
//     waiting (and every one behind it) until the blocks of its whole budget
//     (prompt + max_tokens) are free;
//   - each step one decode token for every running sequence past its
//     prompt, then prefill chunks oldest first up to max_batch_tokens;
//   - the prefix cache of the real KvBlockPool (engine/kv_cache.h): full
//     prompt blocks registered as computed, the leading ones shared at
//     admission and Reserve (never the block of the prompt's last token),
//     freed blocks reused least recently freed first;
//   - hold_kv (a prefill worker's request ends after its first token and
//     keeps its blocks until ReleaseKv), Reserve / AddPrefilled (a decode
//     worker's request continues from a first token sampled elsewhere).
// A request is only its lengths and its prompt's block hash chain; a step
// is its composition (what the forward pass would get), whose cost is the
// caller's. No stop tokens: a request ends at max_tokens.
//
// Not modelled: cancellation, prompt_logprobs, resumed requests.
// Thread-safety: none.
#ifndef PDSERVE_PLANNER_SIM_SIMULATED_GENERATOR_H_
#define PDSERVE_PLANNER_SIM_SIMULATED_GENERATOR_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "engine/kv_cache.h"

namespace pdserve::planner {

struct SimRequest {
  int64_t id = 0;
  int32_t prompt_tokens = 1;
  // Tokens sampled in all, the first included wherever it was sampled.
  int32_t max_tokens = 1;
  bool hold_kv = false;
  // The prompt's hash chain, one per full block (PromptBlockHashes); must
  // stay valid while the request is on the generator.
  std::span<const uint64_t> block_hashes;
};

// What one step computes: the terms of planner::StepCost.
struct StepShape {
  int64_t tokens = 0;
  int64_t sequences = 0;
  // Sum over prefill chunks of (their tokens * context after the step).
  double attention = 0;
  // Sum over decode tokens of their context after the step.
  double decode_attention = 0;
};

// One sequence's part of a step, as the forward pass and the
// KvLayerObserver (ComputedKv) see it.
struct StepEntry {
  int64_t id = 0;
  // Position of the first new token, and how many.
  int32_t start = 0;
  int32_t tokens = 0;
  // First position this step reports to the KV observer: 0 the first time
  // (prefix-cache hits included), else where the last report ended.
  int32_t reported_from = 0;
};

// A token sampled in a step.
struct SimEvent {
  int64_t id = 0;
  // Tokens the request has sampled, this one included (1: the first).
  int32_t generated = 0;
  // The request's last event here (max_tokens reached, or hold_kv).
  bool finished = false;
};

class SimulatedGenerator {
 public:
  // As GeneratorOptions: max_batch_tokens >= max_running >= 1.
  SimulatedGenerator(int32_t num_blocks, int32_t block_size, int32_t max_batch_tokens,
                     int32_t max_running);

  int32_t block_size() const { return block_size_; }
  int64_t BlocksForTokens(int64_t tokens) const;

  // Queues a request. The caller checked that prompt + max_tokens fits the
  // pool (the Generator's RESOURCE_EXHAUSTED) and that ids are unique.
  void Add(const SimRequest& request);
  // Holds the blocks of `num_tokens` tokens for `id`, sharing the leading
  // prompt blocks the prefix cache holds; returns the prompt tokens shared
  // (Landing.cached_tokens). RESOURCE_EXHAUSTED when the blocks are not
  // free now.
  absl::StatusOr<int32_t> Reserve(int64_t id, int32_t num_tokens, int32_t prompt_tokens,
                                  std::span<const uint64_t> block_hashes);
  void ReleaseReservation(int64_t id);
  // Continues `request` (whose first token was sampled elsewhere) in the
  // blocks reserved under its id. NOT_FOUND without a reservation.
  absl::Status AddPrefilled(const SimRequest& request);
  // Frees the blocks a finished hold_kv request kept.
  void ReleaseKv(int64_t id);

  // Admits and composes the next step; false when no sequence runs (then
  // there is no step). Between BeginStep and EndStep nothing else may be
  // called but batch().
  bool BeginStep(StepShape& shape);
  std::span<const StepEntry> batch() const { return batch_; }
  // Completes the step: appends its sampled tokens to `events`.
  void EndStep(std::vector<SimEvent>& events);

  bool HasWork() const { return !waiting_.empty() || !running_.empty(); }
  int32_t num_running() const { return static_cast<int32_t>(running_.size()); }
  int32_t num_waiting() const { return static_cast<int32_t>(waiting_.size()); }
  // Prompt tokens of queued and running requests not computed yet.
  int64_t num_pending_prompt_tokens() const;
  KvBlockPool& pool() { return pool_; }
  const KvBlockPool& pool() const { return pool_; }

 private:
  struct Sequence {
    SimRequest request;
    int32_t num_computed = 0;
    int32_t num_reported = 0;
    int32_t generated = 0;
    std::vector<BlockId> blocks;
    size_t num_hashed = 0;
  };
  struct Reserved {
    std::vector<BlockId> blocks;
    size_t shared = 0;
  };

  void Admit();
  void HashComputedBlocks(Sequence& s);
  void FreeBlocks(Sequence& s);

  const int32_t block_size_;
  const int32_t max_batch_tokens_;
  const int32_t max_running_;
  KvBlockPool pool_;
  std::deque<std::unique_ptr<Sequence>> waiting_;
  std::vector<std::unique_ptr<Sequence>> running_;
  absl::flat_hash_map<int64_t, Reserved> reservations_;
  absl::flat_hash_map<int64_t, std::vector<BlockId>> held_kv_;
  // The step begun: its entries and their sequences, in the same order.
  std::vector<StepEntry> batch_;
  std::vector<Sequence*> batch_seqs_;
};

}  // namespace pdserve::planner

#endif  // PDSERVE_PLANNER_SIM_SIMULATED_GENERATOR_H_
