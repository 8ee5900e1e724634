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
// Thread-safety: none; the engine loop thread owns a Generator.
#ifndef PDSERVE_ENGINE_GENERATOR_H_
#define PDSERVE_ENGINE_GENERATOR_H_

#include <cstdint>
#include <deque>
#include <memory>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "common/strong_id.h"
#include "engine/kv_cache.h"
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
};

struct GenerationEvent {
  RequestId id;
  bool has_token = false;  // False only for a cancellation event.
  SampledToken token;
  FinishReason finish = FinishReason::kNone;  // Not kNone: the last event.
};

struct GeneratorOptions {
  // Token budget of one step: decode tokens plus prefill chunk tokens.
  // Default: 512.
  int32_t max_batch_tokens = 512;
  // Most sequences in the running batch. Default: 64.
  int32_t max_running = 64;
  // Reuse the KV of prompt prefixes computed before. Default: true.
  bool enable_prefix_caching = true;
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

  // Runs one step and appends its events. Errors only on a backend failure.
  absl::Status Step(std::vector<GenerationEvent>& events);

  bool HasWork() const { return !waiting_.empty() || !running_.empty() || !cancelled_.empty(); }
  int32_t num_running() const { return static_cast<int32_t>(running_.size()); }
  int32_t num_waiting() const { return static_cast<int32_t>(waiting_.size()); }
  const KvBlockPool& block_pool() const { return pool_; }
  // Prompt tokens whose KV came from the prefix cache, since creation.
  int64_t prefix_cached_tokens() const { return prefix_cached_tokens_; }

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
    std::unique_ptr<Sampler> sampler;
  };

  Generator(ModelRunner* runner, const GeneratorOptions& options);
  int32_t BlocksFor(const GenerationRequest& r) const;
  void Admit();
  // Samples for sequence `s` from `logits`; true when it finished.
  bool SampleNext(Sequence& s, std::span<const float> logits,
                  std::vector<GenerationEvent>& events);
  bool IsStopToken(const Sequence& s, int32_t token) const;

  ModelRunner* const runner_;
  const GeneratorOptions options_;
  KvBlockPool pool_;
  std::deque<std::unique_ptr<Sequence>> waiting_;
  std::vector<std::unique_ptr<Sequence>> running_;
  std::vector<RequestId> cancelled_;
  // Scratch reused across steps.
  ForwardBatch batch_;
  std::vector<Sequence*> batch_seqs_;
  std::vector<float> logits_;
  int64_t prefix_cached_tokens_ = 0;
};

}  // namespace pdserve

#endif  // PDSERVE_ENGINE_GENERATOR_H_
