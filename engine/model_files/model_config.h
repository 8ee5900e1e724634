// ModelConfig: the architecture of a Llama-family model, parsed from a
// Hugging Face `config.json`; GenerationConfig: its `generation_config.json`
// (BOS/EOS ids, which override the config's, and the sampling defaults its
// authors recommend).
//
// Supported: LlamaForCausalLM (Llama 2/3/3.1, rope_scaling "llama3" and
// "linear"), MistralForCausalLM (sliding_window), Qwen2ForCausalLM (QKV bias,
// optional sliding window), Qwen3ForCausalLM (per-head RMSNorm of q and k,
// no sliding window), GQA, explicit head_dim, tie_word_embeddings.
#ifndef PDSERVE_ENGINE_MODEL_FILES_MODEL_CONFIG_H_
#define PDSERVE_ENGINE_MODEL_FILES_MODEL_CONFIG_H_

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/dtype.h"

namespace pdserve {

struct RopeScaling {
  enum class Type { kNone, kLinear, kLlama3 };
  Type type = Type::kNone;
  float factor = 1.0f;            // kLinear and kLlama3.
  float low_freq_factor = 1.0f;   // kLlama3.
  float high_freq_factor = 4.0f;  // kLlama3.
  int original_max_position_embeddings = 8192;  // kLlama3.
};

struct ModelConfig {
  std::string architecture;  // e.g. "LlamaForCausalLM".
  int vocab_size = 0;
  int hidden_size = 0;
  int intermediate_size = 0;
  int num_layers = 0;
  int num_heads = 0;
  int num_kv_heads = 0;  // Defaults to num_heads when absent.
  int head_dim = 0;      // When absent: hidden_size / num_heads (Qwen3: 128,
                         // as transformers' Qwen3Config).
  int max_position_embeddings = 2048;
  float rms_norm_eps = 1e-6f;
  float rope_theta = 10000.0f;
  RopeScaling rope_scaling;
  bool qkv_bias = false;  // Qwen2: always; Llama, Qwen3: `attention_bias`.
  // Qwen3: RMSNorm (weights q_norm / k_norm, [head_dim], rms_norm_eps) of
  // every q and k head after the projection (and bias), before RoPE.
  bool qk_norm = false;
  bool tie_word_embeddings = false;
  int sliding_window = 0;         // 0: full attention.
  DType torch_dtype = DType::kF32;
  std::optional<int32_t> bos_token_id;
  std::vector<int32_t> eos_token_ids;

  // INVALID_ARGUMENT naming the first inconsistent field (non-positive
  // sizes, num_heads not a multiple of num_kv_heads, odd head_dim, ...).
  absl::Status Validate() const;
};

// Parses config.json. Unknown architectures and model types are
// INVALID_ARGUMENT naming them; the result has passed Validate().
absl::StatusOr<ModelConfig> ParseHfConfig(std::string_view config_json);

// What pdserve reads of generation_config.json. Every field is unset (or
// empty) when the file does not give it.
struct GenerationConfig {
  std::optional<int32_t> bos_token_id;
  std::vector<int32_t> eos_token_ids;
  // Sampling defaults as transformers names them. Read and checked for type
  // so that a model's recommendation is at hand; requests do not take them
  // as their defaults yet (the API's defaults are temperature 1, top_p 1).
  std::optional<bool> do_sample;
  std::optional<float> temperature;
  std::optional<int32_t> top_k;
  std::optional<float> top_p;
  std::optional<float> min_p;
  std::optional<float> repetition_penalty;
};

// Parses generation_config.json: INVALID_ARGUMENT for text that is not a
// JSON object or a field of the wrong type (ids must be non-negative
// integers, an id or a list of them); unknown fields are ignored.
absl::StatusOr<GenerationConfig> ParseGenerationConfig(
    std::string_view generation_config_json);

// Its bos/eos ids, when given, override the config's. On error (an id
// outside the vocabulary: INVALID_ARGUMENT) `config` is unchanged.
absl::Status ApplyGenerationConfig(const GenerationConfig& generation_config,
                                   ModelConfig& config);
// Parse, then apply.
absl::Status ApplyGenerationConfig(std::string_view generation_config_json,
                                   ModelConfig& config);

// Serializes the fields above back to a config.json that ParseHfConfig and
// transformers both accept (used by the llama2.c converter and builtin:tiny).
std::string ToHfConfigJson(const ModelConfig& config);

}  // namespace pdserve

#endif  // PDSERVE_ENGINE_MODEL_FILES_MODEL_CONFIG_H_
