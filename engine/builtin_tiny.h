// builtin:tiny — a small Llama-shaped model with deterministic pseudo-random
// weights and the byte-level tokenizer, made in memory so every command and
// test runs with no files. Its output is gibberish, but a fixed function of
// the seed, which is what tests of the serving system need. The builtin
// models' configs and tokenizer are ModelInfo's (LoadModelInfo,
// TinyModelConfig, Llama110MConfig in engine/model_files/model_info.h); this
// header makes their weights.
#ifndef PDSERVE_ENGINE_BUILTIN_TINY_H_
#define PDSERVE_ENGINE_BUILTIN_TINY_H_

#include <cstdint>
#include <memory>

#include "absl/status/statusor.h"
#include "engine/model.h"
#include "engine/model_files/model_config.h"
#include "engine/model_files/model_info.h"

namespace pdserve {

// A model of any Llama shape with weights drawn from `seed` (each weight
// uniform in ±sqrt(3)·scale/sqrt(fan_in)-ish) in `dtype`; QKV biases and
// q/k norm weights too when the config has them. The tokenizer is
// the byte-level one (its ids past 257 special "<extra_ID>" padding) when the
// vocabulary can hold it, else none.
absl::StatusOr<std::shared_ptr<const Model>> MakeRandomModel(
    std::string name, const ModelConfig& config, DType dtype, uint64_t seed);

// Same, on a ModelInfo already made.
absl::StatusOr<std::shared_ptr<const Model>> MakeRandomModel(
    std::shared_ptr<const ModelInfo> info, DType dtype, uint64_t seed);

// The weights of a builtin model whose info LoadModelInfo("builtin:...")
// made: builtin:tiny seed 0 in fp32, builtin:llama-110m seed 1 in bf16.
// INVALID_ARGUMENT for another name.
absl::StatusOr<std::shared_ptr<const Model>> MakeBuiltinModel(
    std::shared_ptr<const ModelInfo> info);

// builtin:tiny itself (seed 0, fp32).
absl::StatusOr<std::shared_ptr<const Model>> MakeTinyModel();

}  // namespace pdserve

#endif  // PDSERVE_ENGINE_BUILTIN_TINY_H_
