#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"

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
      return absl::InvalidArgumentError(
          absl::StrCat("stop token id ", id, " is outside [0, ", vocab_size, ")"));
    }
  }
  return absl::OkStatus();
}

Sampler::Sampler(const SamplingParams& params)
    : params_(params), rng_(params.seed ? *params.seed : std::random_device{}()) {}

SampledToken Sampler::Sample(std::span<const float> logits) {
  const int32_t n = static_cast<int32_t>(logits.size());
  SampledToken out;

  // Log-softmax normalizer of the raw logits, for reported logprobs.
  float max_logit = std::numeric_limits<float>::lowest();
  int32_t argmax = 0;
  for (int32_t i = 0; i < n; ++i) {
    const float x = Sanitize(logits[i]);
    if (x > max_logit) {
      max_logit = x;
      argmax = i;
    }
  }
  double sum = 0.0;
  for (int32_t i = 0; i < n; ++i) sum += std::exp(static_cast<double>(Sanitize(logits[i])) - max_logit);
  const float log_z = max_logit + static_cast<float>(std::log(sum));
  auto logprob = [&](int32_t id) { return Sanitize(logits[id]) - log_z; };

  if (params_.temperature == 0.0f) {
    out.token = argmax;  // Strict '>' above: the lowest id wins ties.
  } else {
    // Candidates as (scaled logit, id), best first after filtering.
    scratch_.resize(n);
    const float inv_t = 1.0f / params_.temperature;
    for (int32_t i = 0; i < n; ++i) scratch_[i] = {Sanitize(logits[i]) * inv_t, i};
    int32_t keep = n;
    if (params_.top_k > 0 && params_.top_k < n) {
      keep = params_.top_k;
      std::nth_element(scratch_.begin(), scratch_.begin() + keep - 1, scratch_.end(), Better);
    }
    // Sorting only what survived top-k keeps the common case cheap.
    std::sort(scratch_.begin(), scratch_.begin() + keep, Better);
    const float top = scratch_[0].first;
    double total = 0.0;
    for (int32_t i = 0; i < keep; ++i) {
      scratch_[i].first = static_cast<float>(std::exp(static_cast<double>(scratch_[i].first) - top));
      total += scratch_[i].first;
    }
    if (params_.top_p < 1.0f) {
      // Smallest prefix whose mass reaches top_p; at least one token.
      double mass = 0.0;
      int32_t i = 0;
      while (i < keep) {
        mass += scratch_[i].first / total;
        ++i;
        if (mass >= params_.top_p) break;
      }
      keep = std::max(1, i);
    }
    if (params_.min_p > 0.0f) {
      // Probabilities relative to the best: p_i / p_max = w_i / w_0 = w_i.
      int32_t i = 1;
      while (i < keep && scratch_[i].first >= params_.min_p) ++i;
      keep = i;
    }
    total = 0.0;
    for (int32_t i = 0; i < keep; ++i) total += scratch_[i].first;
    const double u = std::uniform_real_distribution<double>(0.0, total)(rng_);
    double acc = 0.0;
    out.token = scratch_[keep - 1].second;
    for (int32_t i = 0; i < keep; ++i) {
      acc += scratch_[i].first;
      if (u < acc) {
        out.token = scratch_[i].second;
        break;
      }
    }
  }
  out.logprob = logprob(out.token);

  if (params_.logprobs > 0) {
    const int32_t k = std::min(params_.logprobs, n);
    scratch_.resize(n);
    for (int32_t i = 0; i < n; ++i) scratch_[i] = {Sanitize(logits[i]), i};
    std::partial_sort(scratch_.begin(), scratch_.begin() + k, scratch_.end(), Better);
    out.top_logprobs.reserve(k);
    for (int32_t i = 0; i < k; ++i) out.top_logprobs.push_back({scratch_[i].second, scratch_[i].first - log_z});
  }
  return out;
}

}  // namespace pdserve
