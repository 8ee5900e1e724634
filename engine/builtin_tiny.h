// builtin:tiny — a small Llama-shaped model with deterministic pseudo-random
// weights and the byte-level tokenizer, made in memory so every command and
// test runs with no files. Its output is gibberish, but a fixed function of
// the seed, which is what tests of the serving system need.
#ifndef PDSERVE_ENGINE_BUILTIN_TINY_H_
#define PDSERVE_ENGINE_BUILTIN_TINY_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "engine/model.h"
#include "engine/model_config.h"

namespace pdserve {

// The shape of builtin:tiny: vocab 258 (the byte-level tokenizer), hidden
// 128, 4 layers, 4 heads, 2 KV heads, FFN 384, context 4096.
ModelConfig TinyModelConfig();

// A model of any Llama shape with weights drawn from `seed` (each weight
// uniform in ±sqrt(3)·scale/sqrt(fan_in)-ish) in `dtype`; QKV biases and
// q/k norm weights too when the config has them. The tokenizer is
// the byte-level one (its ids past 257 special "<extra_ID>" padding) when the
// vocabulary can hold it, else none.
absl::StatusOr<std::shared_ptr<const Model>> MakeRandomModel(
    std::string name, const ModelConfig& config, DType dtype, uint64_t seed);

// The shape of builtin:llama-110m: Llama 2 110M-like (vocab 32000, hidden
// 768, 12 layers, 12 heads, 4 KV heads, FFN 2048, context 16384); its
// tokenizer is the byte-level one (ids 0..257 of the vocabulary).
ModelConfig Llama110MConfig();

// builtin:tiny itself (seed 0, fp32).
absl::StatusOr<std::shared_ptr<const Model>> MakeTinyModel();

}  // namespace pdserve

#endif  // PDSERVE_ENGINE_BUILTIN_TINY_H_
