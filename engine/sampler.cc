#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <random>

#include "absl/strings/str_cat.h"
#include "common/check.h"

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

// A uniform double in [0, 1) that depends only on (seed, step): two rounds
// of the SplitMix64 finalizer over the pair, top 53 bits as the mantissa.
double UniformDraw(uint64_t seed, int64_t step) {
  auto mix = [](uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  const uint64_t bits = mix(mix(seed) ^ static_cast<uint64_t>(step));
  return static_cast<double>(bits >> 11) * 0x1.0p-53;
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
  if (p.logprobs < 0 || p.logprobs > 20) {
    return absl::InvalidArgumentError(absl::StrCat("logprobs must be in [0, 20], got ", p.logprobs));
  }
  for (int32_t id : p.stop_token_ids) {
    if (id < 0 || id >= vocab_size) {
      return absl::InvalidArgumentError(absl::StrCat(
          "stop_token_ids: token id ", id, " is outside the vocabulary [0, ", vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

Sampler::Sampler(const SamplingParams& params, int64_t first_step)
    : params_(params), seed_(SeedFor(params)), step_(first_step) {}

SampledToken Sampler::Sample(std::span<const float> logits) {
  const int32_t n = static_cast<int32_t>(logits.size());
  PD_CHECK_GT(n, 0) << "Sample() needs a row of at least one logit";
  SampledToken out;
  const int64_t step = step_++;

  float max_logit = std::numeric_limits<float>::lowest();
  int32_t argmax = 0;
  for (int32_t i = 0; i < n; ++i) {
    const float x = Sanitize(logits[i]);
    if (x > max_logit) {  // Strict: the lowest id wins ties.
      max_logit = x;
      argmax = i;
    }
  }
  // sum_i exp(logit_i - max), the normalizer of the reported logprobs; the
  // sampling pass below provides it for free when it sees the raw softmax.
  double raw_sum = -1.0;

  if (params_.temperature == 0.0f) {
    out.token = argmax;
  } else {
    // Candidates as (logit, id); top-k selects on logits, so exp rounding
    // cannot reorder tokens across the cut.
    scratch_.resize(n);
    for (int32_t i = 0; i < n; ++i) scratch_[i] = {Sanitize(logits[i]), i};
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
      const float w = std::exp((scratch_[i].first - max_logit) / t);
      scratch_[i].first = w;
      total += w;
    }
    if (t == 1.0f && keep == n) raw_sum = total;

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

  if (raw_sum < 0.0) {
    raw_sum = 0.0;
    for (int32_t i = 0; i < n; ++i) raw_sum += std::exp(Sanitize(logits[i]) - max_logit);
  }
  const float log_z = max_logit + static_cast<float>(std::log(raw_sum));
  out.logprob = Sanitize(logits[out.token]) - log_z;

  if (params_.logprobs > 0) {
    const int32_t k = std::min(params_.logprobs, n);
    scratch_.resize(n);
    for (int32_t i = 0; i < n; ++i) scratch_[i] = {Sanitize(logits[i]), i};
    std::partial_sort(scratch_.begin(), scratch_.begin() + k, scratch_.end(), Better);
    out.top_logprobs.reserve(k);
    for (int32_t i = 0; i < k; ++i) {
      out.top_logprobs.push_back({scratch_[i].second, scratch_[i].first - log_z});
    }
  }
  return out;
}

}  // namespace pdserve
