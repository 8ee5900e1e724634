#include "engine/model_config.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace pdserve {
namespace {

using Json = nlohmann::json;

absl::Status FieldError(std::string_view field, std::string_view problem) {
  return absl::InvalidArgumentError(
      absl::StrCat("config.json: field '", std::string(field), "' ", std::string(problem)));
}

// Reads an optional integer field; absent or null leaves `out` unchanged.
absl::Status ReadInt(const Json& j, const char* field, int& out) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_number_integer()) return FieldError(field, "must be an integer");
  const int64_t v = it->get<int64_t>();
  if (v < INT32_MIN || v > INT32_MAX) return FieldError(field, "is out of range");
  out = static_cast<int>(v);
  return absl::OkStatus();
}

absl::Status ReadFloat(const Json& j, const char* field, float& out) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_number()) return FieldError(field, "must be a number");
  out = it->get<float>();
  return absl::OkStatus();
}

absl::Status ReadBool(const Json& j, const char* field, bool& out) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_boolean()) return FieldError(field, "must be true or false");
  out = it->get<bool>();
  return absl::OkStatus();
}

// An id or a list of ids (eos_token_id may be either).
absl::StatusOr<std::vector<int32_t>> ReadIds(const Json& j, const char* field) {
  std::vector<int32_t> ids;
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return ids;
  auto one = [&](const Json& v) -> absl::Status {
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX) {
      return FieldError(field, "must be a non-negative integer or a list of them");
    }
    ids.push_back(static_cast<int32_t>(v.get<int64_t>()));
    return absl::OkStatus();
  };
  if (it->is_array()) {
    for (const Json& v : *it) PD_RETURN_IF_ERROR(one(v));
  } else {
    PD_RETURN_IF_ERROR(one(*it));
  }
  return ids;
}

absl::StatusOr<Json> ParseObject(std::string_view text, std::string_view what) {
  Json j = Json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(what), " is not a valid JSON object"));
  }
  return j;
}

// RoPE scaling from `rope_scaling` (transformers 4) or `rope_parameters`
// (transformers 5, which also carries rope_theta).
absl::Status ParseRopeScaling(const Json& j, RopeScaling& out, float& rope_theta) {
  auto it = j.find("rope_parameters");
  if (it != j.end() && it->is_object()) {
    PD_RETURN_IF_ERROR(ReadFloat(*it, "rope_theta", rope_theta));
  } else {
    it = j.find("rope_scaling");
  }
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_object()) return FieldError("rope_scaling", "must be an object or null");
  const Json& r = *it;
  std::string type;
  for (const char* key : {"rope_type", "type"}) {
    if (auto t = r.find(key); t != r.end() && t->is_string()) {
      type = t->get<std::string>();
      break;
    }
  }
  if (type == "default") return absl::OkStatus();
  if (type == "linear") {
    out.type = RopeScaling::Type::kLinear;
  } else if (type == "llama3") {
    out.type = RopeScaling::Type::kLlama3;
    PD_RETURN_IF_ERROR(ReadFloat(r, "low_freq_factor", out.low_freq_factor));
    PD_RETURN_IF_ERROR(ReadFloat(r, "high_freq_factor", out.high_freq_factor));
    PD_RETURN_IF_ERROR(
        ReadInt(r, "original_max_position_embeddings", out.original_max_position_embeddings));
  } else {
    return FieldError("rope_scaling",
                      absl::StrCat("has unsupported type '", type, "' (supported: linear, llama3)"));
  }
  PD_RETURN_IF_ERROR(ReadFloat(r, "factor", out.factor));
  return absl::OkStatus();
}

}  // namespace

absl::Status ModelConfig::Validate() const {
  auto positive = [](int v, const char* name) -> absl::Status {
    if (v <= 0) return FieldError(name, absl::StrCat("must be positive, got ", v));
    return absl::OkStatus();
  };
  PD_RETURN_IF_ERROR(positive(vocab_size, "vocab_size"));
  PD_RETURN_IF_ERROR(positive(hidden_size, "hidden_size"));
  PD_RETURN_IF_ERROR(positive(intermediate_size, "intermediate_size"));
  PD_RETURN_IF_ERROR(positive(num_layers, "num_hidden_layers"));
  PD_RETURN_IF_ERROR(positive(num_heads, "num_attention_heads"));
  PD_RETURN_IF_ERROR(positive(num_kv_heads, "num_key_value_heads"));
  PD_RETURN_IF_ERROR(positive(head_dim, "head_dim"));
  PD_RETURN_IF_ERROR(positive(max_position_embeddings, "max_position_embeddings"));
  if (num_heads % num_kv_heads != 0) {
    return FieldError("num_key_value_heads",
                      absl::StrCat("(", num_kv_heads, ") must divide num_attention_heads (",
                                   num_heads, ")"));
  }
  if (head_dim % 2 != 0) return FieldError("head_dim", "must be even for RoPE");
  // Bounds that keep every size product far from overflow.
  if (vocab_size > (1 << 22) || hidden_size > (1 << 16) || intermediate_size > (1 << 18) ||
      num_layers > 1024 || num_heads > 1024 || head_dim > 1024 ||
      max_position_embeddings > (1 << 24)) {
    return absl::InvalidArgumentError("config.json: a model dimension is implausibly large");
  }
  if (!(rms_norm_eps > 0.0f) || !std::isfinite(rms_norm_eps)) {
    return FieldError("rms_norm_eps", "must be a positive number");
  }
  if (!(rope_theta > 0.0f) || !std::isfinite(rope_theta)) {
    return FieldError("rope_theta", "must be a positive number");
  }
  if (rope_scaling.type != RopeScaling::Type::kNone && !(rope_scaling.factor > 0.0f)) {
    return FieldError("rope_scaling.factor", "must be positive");
  }
  if (rope_scaling.type == RopeScaling::Type::kLlama3 &&
      (!(rope_scaling.high_freq_factor > rope_scaling.low_freq_factor) ||
       !(rope_scaling.low_freq_factor > 0.0f) ||
       rope_scaling.original_max_position_embeddings <= 0)) {
    return FieldError("rope_scaling",
                      "llama3 needs high_freq_factor > low_freq_factor > 0 and a positive "
                      "original_max_position_embeddings");
  }
  if (sliding_window < 0) return FieldError("sliding_window", "must not be negative");
  for (int32_t id : eos_token_ids) {
    if (id >= vocab_size) return FieldError("eos_token_id", "is outside the vocabulary");
  }
  if (bos_token_id && *bos_token_id >= vocab_size) {
    return FieldError("bos_token_id", "is outside the vocabulary");
  }
  return absl::OkStatus();
}

absl::StatusOr<ModelConfig> ParseHfConfig(std::string_view config_json) {
  PD_ASSIGN_OR_RETURN(Json j, ParseObject(config_json, "config.json"));
  ModelConfig c;
  std::string model_type;
  if (auto it = j.find("model_type"); it != j.end() && it->is_string()) {
    model_type = it->get<std::string>();
  }
  if (auto it = j.find("architectures"); it != j.end() && it->is_array() && !it->empty() &&
                                         (*it)[0].is_string()) {
    c.architecture = (*it)[0].get<std::string>();
  }
  const bool llama = model_type == "llama" || c.architecture == "LlamaForCausalLM";
  const bool mistral = model_type == "mistral" || c.architecture == "MistralForCausalLM";
  const bool qwen2 = model_type == "qwen2" || c.architecture == "Qwen2ForCausalLM";
  if (!llama && !mistral && !qwen2) {
    return absl::InvalidArgumentError(absl::StrCat(
        "config.json: unsupported architecture '", c.architecture, "' (model_type '", model_type,
        "'); supported: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM"));
  }
  if (c.architecture.empty()) {
    c.architecture = llama ? "LlamaForCausalLM" : mistral ? "MistralForCausalLM" : "Qwen2ForCausalLM";
  }
  PD_RETURN_IF_ERROR(ReadInt(j, "vocab_size", c.vocab_size));
  PD_RETURN_IF_ERROR(ReadInt(j, "hidden_size", c.hidden_size));
  PD_RETURN_IF_ERROR(ReadInt(j, "intermediate_size", c.intermediate_size));
  PD_RETURN_IF_ERROR(ReadInt(j, "num_hidden_layers", c.num_layers));
  PD_RETURN_IF_ERROR(ReadInt(j, "num_attention_heads", c.num_heads));
  c.num_kv_heads = c.num_heads;
  PD_RETURN_IF_ERROR(ReadInt(j, "num_key_value_heads", c.num_kv_heads));
  if (c.num_heads > 0) c.head_dim = c.hidden_size / c.num_heads;
  PD_RETURN_IF_ERROR(ReadInt(j, "head_dim", c.head_dim));
  PD_RETURN_IF_ERROR(ReadInt(j, "max_position_embeddings", c.max_position_embeddings));
  PD_RETURN_IF_ERROR(ReadFloat(j, "rms_norm_eps", c.rms_norm_eps));
  PD_RETURN_IF_ERROR(ReadFloat(j, "rope_theta", c.rope_theta));
  PD_RETURN_IF_ERROR(ParseRopeScaling(j, c.rope_scaling, c.rope_theta));
  PD_RETURN_IF_ERROR(ReadBool(j, "tie_word_embeddings", c.tie_word_embeddings));
  if (qwen2) {
    c.qkv_bias = true;
    bool use_sliding_window = false;
    PD_RETURN_IF_ERROR(ReadBool(j, "use_sliding_window", use_sliding_window));
    if (use_sliding_window) PD_RETURN_IF_ERROR(ReadInt(j, "sliding_window", c.sliding_window));
  } else {
    PD_RETURN_IF_ERROR(ReadBool(j, "attention_bias", c.qkv_bias));
    if (mistral) PD_RETURN_IF_ERROR(ReadInt(j, "sliding_window", c.sliding_window));
  }
  for (const char* key : {"torch_dtype", "dtype"}) {  // transformers 4 / 5.
    if (auto it = j.find(key); it != j.end() && it->is_string()) {
      PD_ASSIGN_OR_RETURN(c.torch_dtype, ParseDType(it->get<std::string>()));
    }
  }
  if (auto it = j.find("mlp_bias"); it != j.end() && it->is_boolean() && it->get<bool>()) {
    return FieldError("mlp_bias", "true is not supported");
  }
  PD_ASSIGN_OR_RETURN(std::vector<int32_t> bos, ReadIds(j, "bos_token_id"));
  if (!bos.empty()) c.bos_token_id = bos[0];
  PD_ASSIGN_OR_RETURN(c.eos_token_ids, ReadIds(j, "eos_token_id"));
  PD_RETURN_IF_ERROR(c.Validate());
  return c;
}

absl::Status ApplyGenerationConfig(std::string_view generation_config_json, ModelConfig& config) {
  PD_ASSIGN_OR_RETURN(Json j, ParseObject(generation_config_json, "generation_config.json"));
  PD_ASSIGN_OR_RETURN(std::vector<int32_t> bos, ReadIds(j, "bos_token_id"));
  PD_ASSIGN_OR_RETURN(std::vector<int32_t> eos, ReadIds(j, "eos_token_id"));
  ModelConfig updated = config;
  if (!bos.empty()) updated.bos_token_id = bos[0];
  if (!eos.empty()) updated.eos_token_ids = eos;
  PD_RETURN_IF_ERROR(updated.Validate());
  config = std::move(updated);
  return absl::OkStatus();
}

std::string ToHfConfigJson(const ModelConfig& c) {
  Json j;
  j["architectures"] = {c.architecture};
  j["model_type"] = c.architecture == "MistralForCausalLM" ? "mistral"
                    : c.architecture == "Qwen2ForCausalLM" ? "qwen2"
                                                           : "llama";
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_layers;
  j["num_attention_heads"] = c.num_heads;
  j["num_key_value_heads"] = c.num_kv_heads;
  j["head_dim"] = c.head_dim;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = c.rms_norm_eps;
  j["rope_theta"] = c.rope_theta;
  j["hidden_act"] = "silu";
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["torch_dtype"] = c.torch_dtype == DType::kBF16  ? "bfloat16"
                     : c.torch_dtype == DType::kF16 ? "float16"
                                                    : "float32";
  if (c.architecture == "LlamaForCausalLM") j["attention_bias"] = c.qkv_bias;
  if (c.sliding_window > 0) {
    j["sliding_window"] = c.sliding_window;
    if (c.architecture == "Qwen2ForCausalLM") j["use_sliding_window"] = true;
  }
  switch (c.rope_scaling.type) {
    case RopeScaling::Type::kNone:
      j["rope_scaling"] = nullptr;
      break;
    case RopeScaling::Type::kLinear:
      j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", c.rope_scaling.factor}};
      break;
    case RopeScaling::Type::kLlama3:
      j["rope_scaling"] = {
          {"rope_type", "llama3"},
          {"factor", c.rope_scaling.factor},
          {"low_freq_factor", c.rope_scaling.low_freq_factor},
          {"high_freq_factor", c.rope_scaling.high_freq_factor},
          {"original_max_position_embeddings", c.rope_scaling.original_max_position_embeddings}};
      break;
  }
  if (c.bos_token_id) j["bos_token_id"] = *c.bos_token_id;
  if (c.eos_token_ids.size() == 1) {
    j["eos_token_id"] = c.eos_token_ids[0];
  } else if (!c.eos_token_ids.empty()) {
    j["eos_token_id"] = c.eos_token_ids;
  }
  return j.dump(2) + "\n";
}

}  // namespace pdserve
