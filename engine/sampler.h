// Sampling of the next token from a row of logits: greedy, temperature,
// top-k, top-p, min-p, a per-request seed, and top-n logprobs.
//
// A Sampler belongs to one request and is used by one thread at a time. With
// a seed, the token sampled at step n depends only on the seed, n and the
// logits (the draw is a hash of seed and step, not a stream), so a request
// is reproducible wherever it runs and a decode worker can continue a
// request whose first token a prefill worker sampled.
#ifndef PDSERVE_ENGINE_SAMPLER_H_
#define PDSERVE_ENGINE_SAMPLER_H_

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"

namespace pdserve {

struct SamplingParams {
  // 0 means greedy (argmax; ties go to the lowest id). Default: 1.0.
  float temperature = 1.0f;
  // Keep only the k most likely tokens; 0 disables. Default: 0.
  int32_t top_k = 0;
  // Keep the smallest set whose probability mass reaches top_p. Default: 1.0.
  float top_p = 1.0f;
  // Drop tokens whose probability is below min_p * max probability. Default: 0.
  float min_p = 0.0f;
  // Seed of the request's random stream; unset draws one at random.
  std::optional<uint64_t> seed;
  // Generation stops after this many tokens. Default: 16.
  int32_t max_tokens = 16;
  // Extra ids that end generation (the model's EOS ids always do unless
  // ignore_eos). Default: none.
  std::vector<int32_t> stop_token_ids;
  bool ignore_eos = false;
  // Number of most likely alternatives to report per token, 0..20. Default: 0.
  int32_t logprobs = 0;
};

// INVALID_ARGUMENT naming the field for: temperature < 0 or not finite,
// top_k < 0, top_p outside (0, 1], min_p outside [0, 1], max_tokens < 1,
// logprobs outside [0, 20], stop ids outside [0, vocab_size).
absl::Status ValidateSamplingParams(const SamplingParams& params,
                                    int32_t vocab_size);

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.0f;  // log softmax of the raw logits (temperature 1).
};

struct SampledToken {
  int32_t token = 0;
  float logprob = 0.0f;                   // Of `token`, as in TokenLogprob.
  std::vector<TokenLogprob> top_logprobs;  // Best first; params.logprobs long.
};

class Sampler {
 public:
  // `params` must have passed ValidateSamplingParams. The first Sample()
  // call is step `first_step` of the request (1 on a decode worker that
  // continues after a remote prefill).
  explicit Sampler(const SamplingParams& params, int64_t first_step = 0);

  // Samples from one row of logits (vocab_size floats). Uses an internal
  // scratch buffer sized once; no allocation after the first call for a given
  // vocab size, apart from top_logprobs.
  SampledToken Sample(std::span<const float> logits);

 private:
  const SamplingParams params_;
  const uint64_t seed_;
  int64_t step_;
  std::vector<std::pair<float, int32_t>> scratch_;
};

}  // namespace pdserve

#endif  // PDSERVE_ENGINE_SAMPLER_H_
