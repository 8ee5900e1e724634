#include "engine/model_files/model_config.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <limits>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace pdserve {
namespace {

using Json = nlohmann::json;

absl::Status FieldError(std::string_view field, std::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat(
      "config.json: field '", std::string(field), "' ", std::string(problem)));
}

// Reads an optional integer field; absent or null leaves `out` unchanged.
absl::Status ReadInt(const Json& j, const char* field, int& out) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_number_integer()) return FieldError(field, "must be an integer");
  const int64_t v = it->get<int64_t>();
  if (v < INT32_MIN || v > INT32_MAX)
    return FieldError(field, "is out of range");
  out = static_cast<int>(v);
  return absl::OkStatus();
}

absl::Status ReadFloat(const Json& j, const char* field, float& out) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_number()) return FieldError(field, "must be a number");
  const double v = it->get<double>();
  if (!(std::fabs(v) <= std::numeric_limits<float>::max()))
    return FieldError(field, "is out of range");
  out = static_cast<float>(v);
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
    if (!v.is_number_integer() || v.get<int64_t>() < 0 ||
        v.get<int64_t>() > INT32_MAX) {
      return FieldError(field,
                        "must be a non-negative integer or a list of them");
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
  Json j = Json::parse(text.begin(), text.end(), nullptr,
                       /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(what), " is not a valid JSON object"));
  }
  return j;
}

// RoPE scaling from `rope_scaling` (transformers 4) or `rope_parameters`
// (transformers 5, which also carries rope_theta).
absl::Status ParseRopeScaling(const Json& j, RopeScaling& out,
                              float& rope_theta) {
  auto it = j.find("rope_parameters");
  if (it != j.end() && it->is_object()) {
    PD_RETURN_IF_ERROR(ReadFloat(*it, "rope_theta", rope_theta));
  } else {
    it = j.find("rope_scaling");
  }
  if (it == j.end() || it->is_null()) return absl::OkStatus();
  if (!it->is_object())
    return FieldError("rope_scaling", "must be an object or null");
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
    PD_RETURN_IF_ERROR(ReadInt(r, "original_max_position_embeddings",
                               out.original_max_position_embeddings));
  } else {
    return FieldError("rope_scaling",
                      absl::StrCat("has unsupported type '", type,
                                   "' (supported: linear, llama3)"));
  }
  PD_RETURN_IF_ERROR(ReadFloat(r, "factor", out.factor));
  return absl::OkStatus();
}

// Qwen2 slides its window only when use_sliding_window is set, and then only
// in the layers from max_window_layers on (or those that layer_types marks
// "sliding_attention"). One window for every layer, or none, is supported;
// a mix is INVALID_ARGUMENT.
absl::Status ReadQwen2SlidingWindow(const Json& j, int num_layers,
                                    int& window) {
  bool use_sliding_window = false;
  PD_RETURN_IF_ERROR(ReadBool(j, "use_sliding_window", use_sliding_window));
  int size = 0;
  if (use_sliding_window)
    PD_RETURN_IF_ERROR(ReadInt(j, "sliding_window", size));
  if (size <= 0) {
    window = 0;
    return absl::OkStatus();
  }
  int sliding_layers = 0;
  if (auto types = j.find("layer_types");
      types != j.end() && !types->is_null()) {
    if (!types->is_array() ||
        types->size() != static_cast<size_t>(std::max(num_layers, 0))) {
      return FieldError("layer_types", "must list one type per layer");
    }
    for (const Json& t : *types) {
      if (!t.is_string())
        return FieldError("layer_types", "must be a list of strings");
      sliding_layers += t.get<std::string>() == "sliding_attention" ? 1 : 0;
    }
  } else {
    int max_window_layers = 28;  // transformers' Qwen2Config default.
    PD_RETURN_IF_ERROR(ReadInt(j, "max_window_layers", max_window_layers));
    sliding_layers = std::max(0, num_layers - std::max(0, max_window_layers));
  }
  if (sliding_layers != 0 && sliding_layers != num_layers) {
    return FieldError(
        "use_sliding_window",
        absl::StrCat("slides the window in ", sliding_layers, " of ",
                     num_layers, " layers; only all or none is supported"));
  }
  window = sliding_layers == 0 ? 0 : size;
  return absl::OkStatus();
}

// The double nearest the shortest decimal that reads back as `f`, so that
// config.json says 1e-05 rather than 9.999999747378752e-06.
double ShortestDouble(float f) {
  char buf[64];
  const auto [end, ec] = std::to_chars(buf, buf + sizeof(buf) - 1, f);
  if (ec != std::errc()) return f;
  *end = '\0';
  return std::strtod(buf, nullptr);
}

}  // namespace

absl::Status ModelConfig::Validate() const {
  auto positive = [](int v, const char* name) -> absl::Status {
    if (v <= 0)
      return FieldError(name, absl::StrCat("must be positive, got ", v));
    return absl::OkStatus();
  };
  PD_RETURN_IF_ERROR(positive(vocab_size, "vocab_size"));
  PD_RETURN_IF_ERROR(positive(hidden_size, "hidden_size"));
  PD_RETURN_IF_ERROR(positive(intermediate_size, "intermediate_size"));
  PD_RETURN_IF_ERROR(positive(num_layers, "num_hidden_layers"));
  PD_RETURN_IF_ERROR(positive(num_heads, "num_attention_heads"));
  PD_RETURN_IF_ERROR(positive(num_kv_heads, "num_key_value_heads"));
  PD_RETURN_IF_ERROR(positive(head_dim, "head_dim"));
  PD_RETURN_IF_ERROR(
      positive(max_position_embeddings, "max_position_embeddings"));
  if (num_heads % num_kv_heads != 0) {
    return FieldError(
        "num_key_value_heads",
        absl::StrCat("(", num_kv_heads, ") must divide num_attention_heads (",
                     num_heads, ")"));
  }
  if (head_dim % 2 != 0) return FieldError("head_dim", "must be even for RoPE");
  // Bounds that keep every size product far from overflow.
  if (vocab_size > (1 << 22) || hidden_size > (1 << 16) ||
      intermediate_size > (1 << 18) || num_layers > 1024 || num_heads > 1024 ||
      head_dim > 1024 || max_position_embeddings > (1 << 24)) {
    return absl::InvalidArgumentError(
        "config.json: a model dimension is implausibly large");
  }
  if (!(rms_norm_eps > 0.0f) || !std::isfinite(rms_norm_eps)) {
    return FieldError("rms_norm_eps", "must be a positive number");
  }
  if (!(rope_theta > 0.0f) || !std::isfinite(rope_theta)) {
    return FieldError("rope_theta", "must be a positive number");
  }
  if (rope_scaling.type != RopeScaling::Type::kNone &&
      !(rope_scaling.factor > 0.0f)) {
    return FieldError("rope_scaling.factor", "must be positive");
  }
  if (rope_scaling.type == RopeScaling::Type::kLlama3 &&
      (!(rope_scaling.high_freq_factor > rope_scaling.low_freq_factor) ||
       !(rope_scaling.low_freq_factor > 0.0f) ||
       rope_scaling.original_max_position_embeddings <= 0)) {
    return FieldError(
        "rope_scaling",
        "llama3 needs high_freq_factor > low_freq_factor > 0 and a positive "
        "original_max_position_embeddings");
  }
  if (sliding_window < 0)
    return FieldError("sliding_window", "must not be negative");
  // Qwen3's q/k norm is what its architecture name tells transformers (and
  // ToHfConfigJson) about; a window is not written back for it either.
  const bool qwen3 = architecture == "Qwen3ForCausalLM";
  if (qk_norm != qwen3) {
    return FieldError(
        "architectures",
        absl::StrCat("'", architecture, "' ", qwen3 ? "needs" : "does not take",
                     " the per-head q/k norm"));
  }
  if (qwen3 && sliding_window != 0) {
    return FieldError("sliding_window",
                      "is not supported for Qwen3ForCausalLM");
  }
  for (int32_t id : eos_token_ids) {
    if (id >= vocab_size)
      return FieldError("eos_token_id", "is outside the vocabulary");
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
  if (auto it = j.find("architectures");
      it != j.end() && it->is_array() && !it->empty() && (*it)[0].is_string()) {
    c.architecture = (*it)[0].get<std::string>();
  }
  // The architecture decides when it is given (it names the weights' layout,
  // e.g. a LlamaForSequenceClassification has no lm_head); model_type only
  // when it is not.
  const std::string_view family = !c.architecture.empty()
                                      ? std::string_view(c.architecture)
                                      : std::string_view(model_type);
  const bool llama = family == "LlamaForCausalLM" || family == "llama";
  const bool mistral = family == "MistralForCausalLM" || family == "mistral";
  const bool qwen2 = family == "Qwen2ForCausalLM" || family == "qwen2";
  const bool qwen3 = family == "Qwen3ForCausalLM" || family == "qwen3";
  if (!llama && !mistral && !qwen2 && !qwen3) {
    return absl::InvalidArgumentError(
        absl::StrCat("config.json: unsupported architecture '", c.architecture,
                     "' (model_type '", model_type,
                     "'); supported: LlamaForCausalLM, MistralForCausalLM, "
                     "Qwen2ForCausalLM, Qwen3ForCausalLM"));
  }
  if (c.architecture.empty()) {
    c.architecture = llama     ? "LlamaForCausalLM"
                     : mistral ? "MistralForCausalLM"
                     : qwen2   ? "Qwen2ForCausalLM"
                               : "Qwen3ForCausalLM";
  }
  PD_RETURN_IF_ERROR(ReadInt(j, "vocab_size", c.vocab_size));
  PD_RETURN_IF_ERROR(ReadInt(j, "hidden_size", c.hidden_size));
  PD_RETURN_IF_ERROR(ReadInt(j, "intermediate_size", c.intermediate_size));
  PD_RETURN_IF_ERROR(ReadInt(j, "num_hidden_layers", c.num_layers));
  PD_RETURN_IF_ERROR(ReadInt(j, "num_attention_heads", c.num_heads));
  c.num_kv_heads = c.num_heads;
  PD_RETURN_IF_ERROR(ReadInt(j, "num_key_value_heads", c.num_kv_heads));
  // transformers' Qwen3Config defaults head_dim to 128 whatever the hidden
  // size; the others derive it.
  if (qwen3) {
    c.head_dim = 128;
  } else if (c.num_heads > 0) {
    c.head_dim = c.hidden_size / c.num_heads;
  }
  PD_RETURN_IF_ERROR(ReadInt(j, "head_dim", c.head_dim));
  if (auto it = j.find("head_dim");
      !qwen3 && (it == j.end() || it->is_null()) && c.num_heads > 0 &&
      c.hidden_size % c.num_heads != 0) {
    return FieldError(
        "hidden_size",
        absl::StrCat("(", c.hidden_size,
                     ") is not a multiple of num_attention_heads (",
                     c.num_heads, ") and head_dim is not given"));
  }
  PD_RETURN_IF_ERROR(
      ReadInt(j, "max_position_embeddings", c.max_position_embeddings));
  PD_RETURN_IF_ERROR(ReadFloat(j, "rms_norm_eps", c.rms_norm_eps));
  PD_RETURN_IF_ERROR(ReadFloat(j, "rope_theta", c.rope_theta));
  PD_RETURN_IF_ERROR(ParseRopeScaling(j, c.rope_scaling, c.rope_theta));
  PD_RETURN_IF_ERROR(ReadBool(j, "tie_word_embeddings", c.tie_word_embeddings));
  if (auto it = j.find("hidden_act");
      it != j.end() && !it->is_null() &&
      !(it->is_string() && it->get<std::string>() == "silu")) {
    return FieldError(
        "hidden_act",
        absl::StrCat(it->dump(), " is not supported (only silu)"));
  }
  if (qwen2) {
    c.qkv_bias = true;
    PD_RETURN_IF_ERROR(
        ReadQwen2SlidingWindow(j, c.num_layers, c.sliding_window));
  } else if (qwen3) {
    c.qk_norm = true;
    PD_RETURN_IF_ERROR(ReadBool(j, "attention_bias", c.qkv_bias));
    // Released Qwen3 checkpoints attend to the full context; a sliding
    // window (in the layers from max_window_layers on) is not implemented.
    bool use_sliding_window = false;
    PD_RETURN_IF_ERROR(ReadBool(j, "use_sliding_window", use_sliding_window));
    if (use_sliding_window) {
      return FieldError("use_sliding_window",
                        "true is not supported for Qwen3ForCausalLM");
    }
  } else {
    PD_RETURN_IF_ERROR(ReadBool(j, "attention_bias", c.qkv_bias));
    if (mistral)
      PD_RETURN_IF_ERROR(ReadInt(j, "sliding_window", c.sliding_window));
  }
  for (const char* key : {"torch_dtype", "dtype"}) {  // transformers 4 / 5.
    if (auto it = j.find(key); it != j.end() && it->is_string()) {
      PD_ASSIGN_OR_RETURN(c.torch_dtype, ParseDType(it->get<std::string>()));
    }
  }
  if (auto it = j.find("mlp_bias");
      it != j.end() && it->is_boolean() && it->get<bool>()) {
    return FieldError("mlp_bias", "true is not supported");
  }
  PD_ASSIGN_OR_RETURN(std::vector<int32_t> bos, ReadIds(j, "bos_token_id"));
  if (!bos.empty()) c.bos_token_id = bos[0];
  PD_ASSIGN_OR_RETURN(c.eos_token_ids, ReadIds(j, "eos_token_id"));
  PD_RETURN_IF_ERROR(c.Validate());
  return c;
}

absl::StatusOr<GenerationConfig> ParseGenerationConfig(
    std::string_view generation_config_json) {
  PD_ASSIGN_OR_RETURN(
      Json j, ParseObject(generation_config_json, "generation_config.json"));
  GenerationConfig g;
  auto read = [&]() -> absl::Status {
    PD_ASSIGN_OR_RETURN(std::vector<int32_t> bos, ReadIds(j, "bos_token_id"));
    if (!bos.empty()) g.bos_token_id = bos[0];
    PD_ASSIGN_OR_RETURN(g.eos_token_ids, ReadIds(j, "eos_token_id"));
    auto present = [&j](const char* field) {
      auto it = j.find(field);
      return it != j.end() && !it->is_null();
    };
    for (auto [field, out] : {std::pair{"temperature", &g.temperature},
                              {"top_p", &g.top_p},
                              {"min_p", &g.min_p},
                              {"repetition_penalty", &g.repetition_penalty}}) {
      if (!present(field)) continue;
      float v = 0.0f;
      PD_RETURN_IF_ERROR(ReadFloat(j, field, v));
      *out = v;
    }
    if (present("top_k")) {
      int top_k = 0;
      PD_RETURN_IF_ERROR(ReadInt(j, "top_k", top_k));
      g.top_k = top_k;
    }
    if (present("do_sample")) {
      bool do_sample = false;
      PD_RETURN_IF_ERROR(ReadBool(j, "do_sample", do_sample));
      g.do_sample = do_sample;
    }
    return absl::OkStatus();
  };
  if (absl::Status s = read(); !s.ok()) {
    // The field readers speak of config.json; say which file it is.
    constexpr absl::string_view kPrefix = "config.json";
    absl::string_view message = s.message();
    if (absl::StartsWith(message, kPrefix))
      message.remove_prefix(kPrefix.size());
    return absl::Status(s.code(),
                        absl::StrCat("generation_config.json", message));
  }
  return g;
}

absl::Status ApplyGenerationConfig(const GenerationConfig& generation_config,
                                   ModelConfig& config) {
  ModelConfig updated = config;
  if (generation_config.bos_token_id) {
    updated.bos_token_id = generation_config.bos_token_id;
  }
  if (!generation_config.eos_token_ids.empty()) {
    updated.eos_token_ids = generation_config.eos_token_ids;
  }
  PD_RETURN_IF_ERROR(updated.Validate());
  config = std::move(updated);
  return absl::OkStatus();
}

absl::Status ApplyGenerationConfig(std::string_view generation_config_json,
                                   ModelConfig& config) {
  PD_ASSIGN_OR_RETURN(GenerationConfig g,
                      ParseGenerationConfig(generation_config_json));
  return ApplyGenerationConfig(g, config);
}

std::string ToHfConfigJson(const ModelConfig& c) {
  Json j;
  j["architectures"] = {c.architecture};
  j["model_type"] = c.architecture == "MistralForCausalLM" ? "mistral"
                    : c.architecture == "Qwen2ForCausalLM" ? "qwen2"
                    : c.architecture == "Qwen3ForCausalLM" ? "qwen3"
                                                           : "llama";
  j["vocab_size"] = c.vocab_size;
  j["hidden_size"] = c.hidden_size;
  j["intermediate_size"] = c.intermediate_size;
  j["num_hidden_layers"] = c.num_layers;
  j["num_attention_heads"] = c.num_heads;
  j["num_key_value_heads"] = c.num_kv_heads;
  j["head_dim"] = c.head_dim;
  j["max_position_embeddings"] = c.max_position_embeddings;
  j["rms_norm_eps"] = ShortestDouble(c.rms_norm_eps);
  j["rope_theta"] = ShortestDouble(c.rope_theta);
  j["hidden_act"] = "silu";
  j["tie_word_embeddings"] = c.tie_word_embeddings;
  j["torch_dtype"] = c.torch_dtype == DType::kBF16  ? "bfloat16"
                     : c.torch_dtype == DType::kF16 ? "float16"
                                                    : "float32";
  if (c.architecture == "LlamaForCausalLM" ||
      c.architecture == "Qwen3ForCausalLM") {
    j["attention_bias"] = c.qkv_bias;
  }
  if (c.architecture == "Qwen3ForCausalLM") j["use_sliding_window"] = false;
  // transformers' defaults would slide a 4096 window in Mistral when the key
  // is absent, and in Qwen2 only from layer 28 on: spell both out.
  if (c.architecture == "Qwen2ForCausalLM") {
    j["use_sliding_window"] = c.sliding_window > 0;
    if (c.sliding_window > 0) {
      j["sliding_window"] = c.sliding_window;
      j["max_window_layers"] = 0;
    }
  } else if (c.architecture == "MistralForCausalLM") {
    j["sliding_window"] =
        c.sliding_window > 0 ? Json(c.sliding_window) : Json(nullptr);
  }
  switch (c.rope_scaling.type) {
    case RopeScaling::Type::kNone:
      j["rope_scaling"] = nullptr;
      break;
    case RopeScaling::Type::kLinear:
      j["rope_scaling"] = {{"rope_type", "linear"},
                           {"factor", ShortestDouble(c.rope_scaling.factor)}};
      break;
    case RopeScaling::Type::kLlama3:
      j["rope_scaling"] = {
          {"rope_type", "llama3"},
          {"factor", ShortestDouble(c.rope_scaling.factor)},
          {"low_freq_factor", ShortestDouble(c.rope_scaling.low_freq_factor)},
          {"high_freq_factor", ShortestDouble(c.rope_scaling.high_freq_factor)},
          {"original_max_position_embeddings",
           c.rope_scaling.original_max_position_embeddings}};
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
