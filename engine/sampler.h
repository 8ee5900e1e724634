// Sampling of the next token from a row of logits: logit bias, repetition,
// frequency and presence penalties, greedy, temperature, top-k, top-p,
// min-p, a per-request seed, and top-n logprobs.
//
// Logit processing runs in this order (as vLLM): logit_bias is added to the
// raw logits, then repetition_penalty (tokens of the prompt or the output so
// far), then frequency_penalty and presence_penalty (output tokens only),
// then temperature, top-k, top-p and min-p choose the token. Logprobs are
// always those of the raw logits (log softmax at temperature 1, before any
// processing), as the public API promises.
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
#include <utility>
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
  // Subtracted once from the logit of every token generated so far, in
  // [-kMaxPenalty, kMaxPenalty]. Default: 0.
  float presence_penalty = 0.0f;
  // Subtracted from a token's logit once per time it was generated so far,
  // in [-kMaxPenalty, kMaxPenalty]. Default: 0.
  float frequency_penalty = 0.0f;
  // Logits of tokens in the prompt or generated so far are divided by it
  // when positive, multiplied when not; in (0, kMaxRepetitionPenalty].
  // Default: 1 (none).
  float repetition_penalty = 1.0f;
  // (token id, value added to its raw logit), distinct ids; at most
  // kMaxLogitBiasEntries, values in [-kMaxLogitBias, kMaxLogitBias].
  // Default: none.
  std::vector<std::pair<int32_t, float>> logit_bias;
  // Set: report each prompt token's logprob given the tokens before it, with
  // this many alternatives, 0..20 (the Generator computes them; the Sampler
  // ignores it). Default: unset.
  std::optional<int32_t> prompt_logprobs;
};

inline constexpr float kMaxPenalty = 2.0f;
inline constexpr float kMaxRepetitionPenalty = 10.0f;
inline constexpr float kMaxLogitBias = 100.0f;
inline constexpr int32_t kMaxLogitBiasEntries = 300;
inline constexpr int32_t kMaxLogprobsAlternatives = 20;

// INVALID_ARGUMENT naming the field for: temperature < 0 or not finite,
// top_k < 0, top_p outside (0, 1], min_p outside [0, 1], max_tokens < 1,
// logprobs or prompt_logprobs outside [0, 20], stop ids outside
// [0, vocab_size), presence_penalty or frequency_penalty outside [-2, 2],
// repetition_penalty outside (0, 10], more than 300 logit_bias entries, one
// of them for an id outside [0, vocab_size) or with a value outside
// [-100, 100].
absl::Status ValidateSamplingParams(const SamplingParams& params,
                                    int32_t vocab_size);

// The seed of choice `index` of a request with n choices: the request's
// seed for choice 0 (so that choice 0 equals the request with n = 1), a
// SplitMix64 mix of both for the others. Stable across processes.
uint64_t ChoiceSeed(uint64_t request_seed, uint32_t index);

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.0f;  // log softmax of the raw logits (temperature 1).
};

struct SampledToken {
  int32_t token = 0;
  float logprob = 0.0f;                   // Of `token`, as in TokenLogprob.
  std::vector<TokenLogprob> top_logprobs;  // Best first; params.logprobs long.
};

// `out` := the log softmax of `logits` at `token` (non-finite logits count
// as the lowest float, as in sampling) and the `top_n` most likely tokens
// with theirs, best first (lower id first on ties). `scratch` is a buffer
// the caller reuses; the prompt logprobs of a request use this, and the
// Sampler reports its tokens' logprobs through the same code.
void FillLogprobs(std::span<const float> logits, int32_t token, int32_t top_n,
                  std::vector<std::pair<float, int32_t>>& scratch,
                  SampledToken& out);

class Sampler {
 public:
  // `params` must have passed ValidateSamplingParams. The first Sample()
  // call is step `first_step` of the request (1 on a decode worker that
  // continues after a remote prefill).
  explicit Sampler(const SamplingParams& params, int64_t first_step = 0);

  // Samples from one row of logits (vocab_size floats). `prompt` and
  // `generated` are the request's prompt and the tokens generated before
  // this step, wherever they were sampled; the penalties read them (and
  // nothing else), so a request continued on another worker is penalized
  // exactly as it would have been on one. Uses internal buffers sized at the
  // first call (the penalty tables only when a penalty is set); no
  // allocation after it for a given vocab size, apart from top_logprobs.
  // Penalty cost per call: O(prompt + generated) besides the O(vocab) pass.
  SampledToken Sample(std::span<const float> logits,
                      std::span<const int32_t> prompt = {},
                      std::span<const int32_t> generated = {});

 private:
  // processed_ := logits with logit_bias and the penalties applied.
  void ProcessLogits(std::span<const float> logits,
                     std::span<const int32_t> prompt,
                     std::span<const int32_t> generated);

  const SamplingParams params_;
  const uint64_t seed_;
  // Whether ProcessLogits changes anything; otherwise it is skipped.
  const bool processes_logits_;
  const bool penalizes_;
  int64_t step_;
  std::vector<std::pair<float, int32_t>> scratch_;
  std::vector<float> processed_;
  // Per vocabulary id, all zero between calls: times generated so far, and
  // whether the id's penalty was applied in this call.
  std::vector<int32_t> generated_count_;
  std::vector<uint8_t> penalized_;
};

}  // namespace pdserve

#endif  // PDSERVE_ENGINE_SAMPLER_H_
