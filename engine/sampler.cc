#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <random>

#include "absl/strings/str_cat.h"
#include "common/check.h"
#include "common/status_macros.h"

namespace pdserve {
namespace {

// Non-finite logits (a broken model or backend) never win and never poison
// the softmax: NaN and +inf are treated as the lowest score.
inline float Sanitize(float x) {
  return std::isfinite(x) ? x : std::numeric_limits<float>::lowest();
}

// Orders (score, id) candidates best first; the lower id wins ties.
bool Better(const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// Below this many candidates the nucleus search sorts instead of selecting.
constexpr ptrdiff_t kNucleusSortBelow = 64;
// The nucleus search first tries the best this many candidates: a peaked
// distribution's nucleus fits, and then one selection pass is all it costs.
constexpr ptrdiff_t kNucleusFirstGuess = 256;

// Reorders (weight, id) candidates so that the nucleus comes first and
// returns its size: the smallest best-first prefix whose weight reaches
// `target` (at least 1; all candidates if rounding keeps the total short).
// A weighted quickselect, O(n) expected: each round splits the undecided
// range (after the first guess, at its median) and keeps the part that
// holds the crossing point, so even a nucleus of most of the vocabulary
// costs no full sort.
int32_t NucleusSize(std::span<std::pair<float, int32_t>> c, double target) {
  ptrdiff_t lo = 0, hi = static_cast<ptrdiff_t>(c.size());
  double mass_before = 0.0;  // Weight of [0, lo), all better than [lo, hi).
  bool first_round = true;
  while (hi - lo > kNucleusSortBelow) {
    const ptrdiff_t mid =
        first_round && hi > 2 * kNucleusFirstGuess ? kNucleusFirstGuess - 1 : lo + (hi - lo) / 2;
    first_round = false;
    std::nth_element(c.begin() + lo, c.begin() + mid, c.begin() + hi, Better);
    double mass = mass_before;
    for (ptrdiff_t i = lo; i <= mid; ++i) mass += c[i].first;
    if (mass >= target) {
      hi = mid + 1;  // Crossing at or before mid.
    } else {
      mass_before = mass;
      lo = mid + 1;
    }
  }
  std::sort(c.begin() + lo, c.begin() + hi, Better);
  for (ptrdiff_t i = lo; i < hi; ++i) {
    mass_before += c[i].first;
    if (mass_before >= target) return static_cast<int32_t>(i + 1);
  }
  // Not reached, by rounding: the range ends at a point known to reach the
  // target (or at the end of the candidates).
  return static_cast<int32_t>(std::max<ptrdiff_t>(hi, 1));
}

// Seeds from the request, or with 64 bits of fresh entropy.
uint64_t SeedFor(const SamplingParams& params) {
  if (params.seed) return *params.seed;
  std::random_device rd;
  return (static_cast<uint64_t>(rd()) << 32) ^ rd();
}

// The SplitMix64 finalizer.
uint64_t Mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// A uniform double in [0, 1) that depends only on (seed, step): two rounds
// of the SplitMix64 finalizer over the pair, top 53 bits as the mantissa.
double UniformDraw(uint64_t seed, int64_t step) {
  const uint64_t bits = Mix(Mix(seed) ^ static_cast<uint64_t>(step));
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
}

// FillLogprobs with the normalizer known: `max_logit` is the largest
// sanitized logit and `sum` the sum of exp(logit - max_logit), or negative
// to compute it here.
void FillLogprobsWith(std::span<const float> logits, float max_logit, double sum, int32_t token,
                      int32_t top_n, std::vector<std::pair<float, int32_t>>& scratch,
                      SampledToken& out) {
  const int32_t n = static_cast<int32_t>(logits.size());
  if (sum < 0.0) {
    sum = 0.0;
    for (int32_t i = 0; i < n; ++i) sum += std::exp(Sanitize(logits[i]) - max_logit);
  }
  const float log_z = max_logit + static_cast<float>(std::log(sum));
  out.token = token;
  out.logprob = Sanitize(logits[token]) - log_z;
  out.top_logprobs.clear();
  if (top_n <= 0) return;
  const int32_t k = std::min(top_n, n);
  scratch.resize(n);
  for (int32_t i = 0; i < n; ++i) scratch[i] = {Sanitize(logits[i]), i};
  std::partial_sort(scratch.begin(), scratch.begin() + k, scratch.end(), Better);
  out.top_logprobs.reserve(k);
  for (int32_t i = 0; i < k; ++i) {
    out.top_logprobs.push_back({scratch[i].second, scratch[i].first - log_z});
  }
}

// The largest sanitized value of `x` and its first index.
std::pair<float, int32_t> MaxAndArgmax(std::span<const float> x) {
  float max = std::numeric_limits<float>::lowest();
  int32_t argmax = 0;
  for (int32_t i = 0; i < static_cast<int32_t>(x.size()); ++i) {
    const float v = Sanitize(x[i]);
    if (v > max) {  // Strict: the lowest id wins ties.
      max = v;
      argmax = i;
    }
  }
  return {max, argmax};
}

// "name must be in [lo, hi], got v" unless it is (NaN is not).
absl::Status CheckRange(const char* name, float v, float lo, float hi) {
  if (v >= lo && v <= hi) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(name, " must be in [", lo, ", ", hi, "], got ", v));
}

}  // namespace

absl::Status ValidateSamplingParams(const SamplingParams& p, int32_t vocab_size) {
  if (!std::isfinite(p.temperature) || p.temperature < 0.0f) {
    return absl::InvalidArgumentError(
        absl::StrCat("temperature must be a finite number >= 0, got ", p.temperature));
  }
  if (p.top_k < 0) {
    return absl::InvalidArgumentError(absl::StrCat("top_k must be >= 0 (0: off), got ", p.top_k));
  }
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("top_p must be in (0, 1], got ", p.top_p));
  }
  if (!(p.min_p >= 0.0f && p.min_p <= 1.0f)) {
    return absl::InvalidArgumentError(absl::StrCat("min_p must be in [0, 1], got ", p.min_p));
  }
  if (p.max_tokens < 1) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens must be >= 1, got ", p.max_tokens));
  }
  if (p.logprobs < 0 || p.logprobs > kMaxLogprobsAlternatives) {
    return absl::InvalidArgumentError(absl::StrCat("logprobs must be in [0, ",
                                                   kMaxLogprobsAlternatives, "], got ", p.logprobs));
  }
  if (p.prompt_logprobs &&
      (*p.prompt_logprobs < 0 || *p.prompt_logprobs > kMaxLogprobsAlternatives)) {
    return absl::InvalidArgumentError(absl::StrCat("prompt_logprobs must be in [0, ",
                                                   kMaxLogprobsAlternatives, "], got ",
                                                   *p.prompt_logprobs));
  }
  PD_RETURN_IF_ERROR(CheckRange("presence_penalty", p.presence_penalty, -kMaxPenalty, kMaxPenalty));
  PD_RETURN_IF_ERROR(
      CheckRange("frequency_penalty", p.frequency_penalty, -kMaxPenalty, kMaxPenalty));
  if (!(p.repetition_penalty > 0.0f && p.repetition_penalty <= kMaxRepetitionPenalty)) {
    return absl::InvalidArgumentError(absl::StrCat("repetition_penalty must be in (0, ",
                                                   kMaxRepetitionPenalty, "], got ",
                                                   p.repetition_penalty));
  }
  if (p.logit_bias.size() > static_cast<size_t>(kMaxLogitBiasEntries)) {
    return absl::InvalidArgumentError(absl::StrCat("logit_bias has ", p.logit_bias.size(),
                                                   " entries; at most ", kMaxLogitBiasEntries));
  }
  for (const auto& [id, bias] : p.logit_bias) {
    if (id < 0 || id >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "logit_bias: token id ", id, " is outside the vocabulary [0, ", vocab_size, ")"));
    }
    if (!(bias >= -kMaxLogitBias && bias <= kMaxLogitBias)) {
      return absl::InvalidArgumentError(absl::StrCat("logit_bias of token ", id, " must be in [",
                                                     -kMaxLogitBias, ", ", kMaxLogitBias,
                                                     "], got ", bias));
    }
  }
  for (int32_t id : p.stop_token_ids) {
    if (id < 0 || id >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "stop_token_ids: token id ", id, " is outside the vocabulary [0, ", vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

uint64_t ChoiceSeed(uint64_t request_seed, uint32_t index) {
  if (index == 0) return request_seed;
  // Distinct from the draws' Mix(seed) ^ step by the extra round.
  return Mix(Mix(Mix(request_seed) ^ index));
}

void FillLogprobs(std::span<const float> logits, int32_t token, int32_t top_n,
                  std::vector<std::pair<float, int32_t>>& scratch, SampledToken& out) {
  PD_CHECK_GT(logits.size(), 0u) << "FillLogprobs needs a row of at least one logit";
  FillLogprobsWith(logits, MaxAndArgmax(logits).first, -1.0, token, top_n, scratch, out);
}

Sampler::Sampler(const SamplingParams& params, int64_t first_step)
    : params_(params),
      seed_(SeedFor(params)),
      processes_logits_(!params.logit_bias.empty() || params.presence_penalty != 0.0f ||
                        params.frequency_penalty != 0.0f || params.repetition_penalty != 1.0f),
      penalizes_(params.presence_penalty != 0.0f || params.frequency_penalty != 0.0f ||
                 params.repetition_penalty != 1.0f),
      step_(first_step) {}

void Sampler::ProcessLogits(std::span<const float> logits, std::span<const int32_t> prompt,
                            std::span<const int32_t> generated) {
  const int32_t n = static_cast<int32_t>(logits.size());
  processed_.resize(n);
  for (int32_t i = 0; i < n; ++i) processed_[i] = Sanitize(logits[i]);
  for (const auto& [id, bias] : params_.logit_bias) {
    if (id >= 0 && id < n) processed_[id] += bias;  // Validated; checked anyway.
  }
  if (!penalizes_) return;
  generated_count_.resize(n, 0);
  penalized_.resize(n, 0);
  auto valid = [n](int32_t t) { return t >= 0 && t < n; };
  for (int32_t t : generated) {
    if (valid(t)) ++generated_count_[t];
  }
  // Each distinct token once: repetition over prompt and output, then
  // frequency and presence over the output.
  const float rep = params_.repetition_penalty;
  auto penalize = [&](int32_t t) {
    if (!valid(t) || penalized_[t]) return;
    penalized_[t] = 1;
    float& x = processed_[t];
    if (rep != 1.0f) x = x > 0.0f ? x / rep : x * rep;
    if (const int32_t c = generated_count_[t]; c > 0) {
      x -= params_.frequency_penalty * static_cast<float>(c) + params_.presence_penalty;
    }
  };
  for (int32_t t : prompt) penalize(t);
  for (int32_t t : generated) penalize(t);
  // Back to all zero for the next call.
  for (std::span<const int32_t> tokens : {prompt, generated}) {
    for (int32_t t : tokens) {
      if (!valid(t)) continue;
      generated_count_[t] = 0;
      penalized_[t] = 0;
    }
  }
}

SampledToken Sampler::Sample(std::span<const float> logits, std::span<const int32_t> prompt,
                             std::span<const int32_t> generated) {
  const int32_t n = static_cast<int32_t>(logits.size());
  PD_CHECK_GT(n, 0) << "Sample() needs a row of at least one logit";
  SampledToken out;
  const int64_t step = step_++;

  // The token is chosen from the processed scores; logprobs come from the
  // raw logits.
  std::span<const float> scores = logits;
  if (processes_logits_) {
    ProcessLogits(logits, prompt, generated);
    scores = processed_;
  }
  const auto [max_score, argmax] = MaxAndArgmax(scores);
  // sum_i exp(logit_i - max), the normalizer of the reported logprobs; the
  // sampling pass below provides it for free when it sees the raw softmax.
  double raw_sum = -1.0;

  if (params_.temperature == 0.0f) {
    out.token = argmax;
  } else {
    // Candidates as (score, id); top-k selects on scores, so exp rounding
    // cannot reorder tokens across the cut.
    scratch_.resize(n);
    for (int32_t i = 0; i < n; ++i) scratch_[i] = {Sanitize(scores[i]), i};
    int32_t keep = n;
    if (params_.top_k > 0 && params_.top_k < n) {
      keep = params_.top_k;
      std::nth_element(scratch_.begin(), scratch_.begin() + (keep - 1), scratch_.end(), Better);
    }

    // Unnormalized probabilities exp((x - max) / T): the best is exactly 1,
    // nothing overflows, and dividing (not multiplying by 1/T) keeps
    // 0 / T == 0 even for a subnormal T.
    const float t = params_.temperature;
    double total = 0.0;
    for (int32_t i = 0; i < keep; ++i) {
      const float w = std::exp((scratch_[i].first - max_score) / t);
      scratch_[i].first = w;
      total += w;
    }
    if (t == 1.0f && keep == n && !processes_logits_) raw_sum = total;

    if (params_.top_p < 1.0f) {
      keep = NucleusSize(std::span(scratch_).first(keep), static_cast<double>(params_.top_p) * total);
    }

    // min-p relative to the most likely token, whose weight is exactly 1
    // (top-k and top-p always keep it; renormalizing keeps the ratios).
    const float min_w = params_.min_p;
    double kept_total = 0.0;
    for (int32_t i = 0; i < keep; ++i) {
      if (scratch_[i].first >= min_w) kept_total += scratch_[i].first;
    }
    const double u = UniformDraw(seed_, step) * kept_total;
    // Summing in the same order as kept_total reaches u before the end, except
    // when the draw lands on the upper bound by rounding: then the last
    // candidate with weight wins.
    double acc = 0.0;
    out.token = argmax;
    for (int32_t i = 0; i < keep; ++i) {
      const float w = scratch_[i].first;
      if (w < min_w || w <= 0.0f) continue;
      out.token = scratch_[i].second;
      acc += w;
      if (u < acc) break;
    }
  }

  const float max_logit = processes_logits_ ? MaxAndArgmax(logits).first : max_score;
  FillLogprobsWith(logits, max_logit, raw_sum, out.token, params_.logprobs, scratch_, out);
  return out;
}

}  // namespace pdserve
