// Generator: continuous batching over one ModelRunner. Requests join and
// leave at every step; each step runs one forward over the decode token of
// every running sequence plus prefill chunks of admitted prompts, up to a
// token budget (chunked prefill), then samples and reports new tokens.
//
// KV blocks for a request's whole budget (prompt + max_tokens) are reserved
// when it is admitted, so a running request never stalls for memory; a
// request waits in the queue until its blocks are free. Finished and
// cancelled requests return their blocks at once.
//
// Prefix caching: every full block of a prompt is registered in the pool
// under the hash of the tokens up to its end once its KV is computed. A
// later prompt with the same prefix shares those blocks (ref-counted)
// instead of computing them again; freed blocks keep their content until
// the pool hands them out anew. The block holding a prompt's last token is
// never shared, so shared blocks are only ever read.
//
// A request that asks for prompt logprobs (SamplingParams.prompt_logprobs)
// is prefilled in full, never from the prefix cache: its forward returns
// logits at every prompt position (chunk by chunk), and its first event
// carries the logprob of every prompt token after the first. Its computed
// blocks are registered for later requests as usual.
//
// Disaggregation. A decode worker Reserve()s blocks for a request whose
// prompt a prefill worker computes, lets the KV land in them, then
// AddPrefilled() continues the request from its first token. A prefill
// worker adds requests with `hold_kv`: they end after their first token and
// keep their blocks until ReleaseKv(), while a KvLayerObserver reports each
// layer's freshly written KV so it can be shipped during the forward pass.
//
// Thread-safety: none; the engine loop thread owns a Generator.
#ifndef PDSERVE_ENGINE_GENERATOR_H_
#define PDSERVE_ENGINE_GENERATOR_H_

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "common/strong_id.h"
#include "engine/kv_cache.h"
#include "engine/kv_canary.h"
#include "engine/model_runner.h"
#include "engine/sampler.h"

namespace pdserve {

using RequestId = StrongId<struct RequestIdTag, uint64_t>;

enum class FinishReason {
  kNone,       // Still running.
  kStop,       // An EOS id or a stop token id was sampled.
  kLength,     // max_tokens reached.
  kCancelled,  // Cancel() was called.
};

struct GenerationRequest {
  RequestId id;
  std::vector<int32_t> prompt;  // Token ids, BOS included if wanted.
  SamplingParams sampling;
  // Prefill only: the request ends after its first token, and its KV blocks
  // stay held until ReleaseKv(id). Default: false.
  bool hold_kv = false;
};

// Positions [begin, end) of a sequence whose K/V in the reported layer are
// now in the cache, in the blocks of `block_table` (position p in block
// p / block_size, slot p % block_size). The first report of a sequence
// starts at 0, so prefix-cache hits are included.
struct ComputedKv {
  RequestId id;
  std::span<const BlockId> block_table;
  int32_t begin = 0;
  int32_t end = 0;
};

// Called on the engine thread inside Step(), once per layer, as soon as the
// step's K/V of that layer is written. Must not block.
using KvLayerObserver =
    std::function<void(int32_t layer, std::span<const ComputedKv> computed)>;

struct GenerationEvent {
  RequestId id;
  bool has_token = false;  // False only for a cancellation event.
  SampledToken token;
  // Not kNone: the last event. A hold_kv request has one event, its first
  // token; kNone there means the request goes on elsewhere.
  FinishReason finish = FinishReason::kNone;
  // On the first token's event of a request with prompt_logprobs set:
  // prompt positions 1..len-1 in order, each the prompt token's logprob
  // given the tokens before it (log softmax of the raw logits at the
  // position before) with prompt_logprobs alternatives. Empty otherwise.
  std::vector<SampledToken> prompt_logprobs;
};

// What Reserve holds for a request.
struct KvReservation {
  // The blocks in sequence order; valid until AddPrefilled or
  // ReleaseReservation.
  std::span<const BlockId> blocks;
  // Leading prompt tokens whose KV is in `blocks` already: shared, read-only
  // prefix-cache blocks (a multiple of the block size). Their KV must not be
  // written; the rest is to be written from outside.
  int32_t cached_tokens = 0;
};

struct GeneratorOptions {
  // Token budget of one step: decode tokens plus prefill chunk tokens.
  // Default: 512.
  int32_t max_batch_tokens = 512;
  // Most sequences in the running batch. Default: 64.
  int32_t max_running = 64;
  // Reuse the KV of prompt prefixes computed before. Default: true.
  bool enable_prefix_caching = true;
  // Fill blocks freed empty with a canary and check it when they are
  // handed out again (engine/kv_canary.h): for tests and fault drills.
  // Host KV pools only. Default: false.
  bool kv_canary = false;
};

class Generator {
 public:
  // `runner` must outlive the Generator.
  static absl::StatusOr<std::unique_ptr<Generator>> Create(ModelRunner* runner,
                                                           const GeneratorOptions& options);

  // Queues a request. INVALID_ARGUMENT for an empty prompt, an id outside
  // the vocabulary, bad sampling parameters, a duplicate id, or
  // prompt + max_tokens beyond the model's context; RESOURCE_EXHAUSTED when
  // it could never fit in the KV pool.
  absl::Status Add(GenerationRequest request);

  // Ends a queued or running request; its final event (kCancelled) comes
  // from the next Step(). Unknown ids are ignored.
  void Cancel(RequestId id);

  // Holds ceil(num_tokens / block_size) blocks for request `id`, whose
  // prompt KV is to be written into them from outside. The span stays valid
  // until AddPrefilled or ReleaseReservation. INVALID_ARGUMENT for a
  // duplicate id or num_tokens outside [1, context]; RESOURCE_EXHAUSTED when
  // the blocks are not free now.
  absl::StatusOr<std::span<const BlockId>> Reserve(RequestId id, int32_t num_tokens);
  // As above, for a request whose prompt of `prompt_tokens` tokens has the
  // block hash chain `prompt_block_hashes` (PromptBlockHashes): the longest
  // prefix of those blocks the prefix cache holds is shared (never the
  // block of the prompt's last token, none with prefix caching off), the
  // rest allocated. AddPrefilled checks the chain against the prompt.
  // Also INVALID_ARGUMENT when prompt_tokens exceeds num_tokens.
  absl::StatusOr<KvReservation> Reserve(RequestId id, int32_t num_tokens, int32_t prompt_tokens,
                                        std::span<const uint64_t> prompt_block_hashes);
  // Frees a reservation not yet added. Unknown ids are ignored.
  void ReleaseReservation(RequestId id);
  // Ends a reservation not yet added but keeps its blocks out of the pool:
  // the caller hands them back with ReleaseBlocks once nothing can write
  // into them any more (a KV push may still be landing). Empty for an
  // unknown id.
  std::vector<BlockId> TakeReservation(RequestId id);
  // Drops the references TakeReservation handed over.
  void ReleaseBlocks(std::span<const BlockId> blocks);
  // Continues `request` from `first_token` (sampled elsewhere at step 0),
  // its prompt KV being in the blocks reserved under its id. Validated as
  // Add(); also INVALID_ARGUMENT when max_tokens < 2 (nothing left to
  // decode), the reservation is smaller than prompt + max_tokens, or its
  // shared prefix blocks are not the prompt's (another hash chain, or the
  // block of the last token), and NOT_FOUND without a reservation. Its
  // events start at the second token.
  absl::Status AddPrefilled(GenerationRequest request, int32_t first_token);

  // Frees the blocks a finished `hold_kv` request kept. Unknown ids are
  // ignored.
  void ReleaseKv(RequestId id);

  void set_kv_layer_observer(KvLayerObserver observer) { kv_observer_ = std::move(observer); }

  // Runs one step and appends its events. Errors only on a backend failure.
  absl::Status Step(std::vector<GenerationEvent>& events);

  bool HasWork() const { return !waiting_.empty() || !running_.empty() || !cancelled_.empty(); }
  int32_t num_running() const { return static_cast<int32_t>(running_.size()); }
  int32_t num_waiting() const { return static_cast<int32_t>(waiting_.size()); }
  int32_t num_reserved() const { return static_cast<int32_t>(reservations_.size()); }
  // Prompt tokens of queued and running requests not computed yet.
  int64_t num_pending_prompt_tokens() const;
  const KvBlockPool& block_pool() const { return pool_; }
  // Prefix-cache events of the pool (KvBlockPool::set_record_events /
  // TakeEvents). Default: not recorded.
  void set_record_kv_events(bool on) { pool_.set_record_events(on); }
  void TakeKvCacheEvents(std::vector<KvCacheEvent>& out) { pool_.TakeEvents(out); }
  // Prompt tokens whose KV came from the prefix cache, since creation.
  int64_t prefix_cached_tokens() const { return prefix_cached_tokens_; }
  // Free blocks found written by nobody's request (options.kv_canary; 0
  // without it).
  int64_t kv_canary_violations() const {
    return canary_ == nullptr ? 0 : canary_->violations();
  }
  // Prompt tokens run through a forward pass, since creation.
  int64_t computed_prompt_tokens() const { return computed_prompt_tokens_; }

 private:
  struct Sequence {
    GenerationRequest request;
    std::vector<int32_t> tokens;  // Prompt then generated; reserved up front.
    int32_t num_computed = 0;     // Tokens whose KV is in the cache.
    std::vector<BlockId> blocks;
    // Hash chain of the prompt's full blocks; the first num_hashed of
    // `blocks` are registered in the pool under them.
    std::vector<uint64_t> block_hashes;
    size_t num_hashed = 0;
    // Tokens already reported to the KvLayerObserver.
    int32_t num_reported = 0;
    std::unique_ptr<Sampler> sampler;
    // Prompt logprobs computed so far (SamplingParams.prompt_logprobs).
    std::vector<SampledToken> prompt_logprobs;
  };

  Generator(ModelRunner* runner, const GeneratorOptions& options);
  int32_t BlocksFor(const GenerationRequest& r) const;
  // The checks Add and AddPrefilled share.
  absl::Status Validate(const GenerationRequest& r) const;
  std::unique_ptr<Sequence> NewSequence(GenerationRequest request, int64_t first_step);
  bool Known(RequestId id) const;
  void ReportLayer(int32_t layer);
  void Admit();
  // Samples for sequence `s` from `logits`; true when it finished.
  bool SampleNext(Sequence& s, std::span<const float> logits,
                  std::vector<GenerationEvent>& events);
  // Registers the prompt's blocks whose KV is computed (the first
  // num_computed tokens) in the prefix cache.
  void HashComputedBlocks(Sequence& s);
  // Appends the prompt logprobs that the `rows` logits rows of a prefill
  // chunk starting at `start` give (row j predicts position start + j + 1).
  void AddPromptLogprobs(Sequence& s, int32_t start, std::span<const float> rows);
  bool IsStopToken(const Sequence& s, int32_t token) const;
  // Returns a finished or cancelled sequence's blocks to the pool, or holds
  // them for ReleaseKv when the request asked for hold_kv.
  void FreeBlocks(Sequence& s);

  ModelRunner* const runner_;
  const GeneratorOptions options_;
  KvBlockPool pool_;
  std::unique_ptr<KvCanary> canary_;  // options.kv_canary.
  std::deque<std::unique_ptr<Sequence>> waiting_;
  std::vector<std::unique_ptr<Sequence>> running_;
  std::vector<RequestId> cancelled_;
  struct Reserved {
    std::vector<BlockId> blocks;
    // The hashes of the leading blocks shared from the prefix cache.
    std::vector<uint64_t> shared_hashes;
  };
  absl::flat_hash_map<RequestId, Reserved> reservations_;
  absl::flat_hash_map<RequestId, std::vector<BlockId>> held_kv_;
  KvLayerObserver kv_observer_;
  std::vector<ComputedKv> computed_;  // Scratch for the observer.
  // Scratch reused across steps.
  ForwardBatch batch_;
  std::vector<Sequence*> batch_seqs_;
  std::vector<float> logits_;
  std::vector<std::pair<float, int32_t>> logprob_scratch_;
  int64_t prefix_cached_tokens_ = 0;
  int64_t computed_prompt_tokens_ = 0;
};

}  // namespace pdserve

#endif  // PDSERVE_ENGINE_GENERATOR_H_
