// ModelInfo: everything about a model except its weights — its name, its
// architecture (ModelConfig), its generation_config.json, its tokenizer and
// its chat template's source. The router knows the model served by this
// alone; the engine's Model is a ModelInfo plus weights (engine/model.h), so
// both read these facts through the one loading path below.
//
// LoadModelInfo reads no weight bytes: for a model directory it reads
// config.json, generation_config.json, tokenizer.json, tokenizer_config.json
// and the chat template files, and never opens a *.safetensors file (a
// directory without weights, or with corrupt ones, loads); builtin models
// build their config and byte-level tokenizer and no weights. A llama2.c
// checkpoint's info (LoadLlama2cModelInfo in llama2c.h) reads only its
// header.
//
// Thread-safety: immutable once made; share it with shared_ptr<const>, and
// call its const methods (and the Tokenizer's) from any thread.
#ifndef PDSERVE_ENGINE_MODEL_FILES_MODEL_INFO_H_
#define PDSERVE_ENGINE_MODEL_FILES_MODEL_INFO_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/chat/chat_template.h"
#include "engine/model_files/model_config.h"
#include "engine/tokenizer.h"

namespace pdserve {

class ModelInfo {
 public:
  // What a ModelInfo is made of, as read from files or built in memory.
  struct Parts {
    // "builtin:tiny", or a directory's base name.
    std::string name;
    // As config.json gives it; `generation_config`'s ids are applied to it.
    ModelConfig config;
    GenerationConfig generation_config;
    // Null when the model has none (then only token ids can be used).
    std::unique_ptr<Tokenizer> tokenizer;
    // Unset when the model has none.
    std::optional<ChatTemplateSource> chat_template;
  };

  // Checks the parts against each other: INVALID_ARGUMENT when the config
  // does not Validate(), the generation config's ids or the tokenizer's EOS
  // ids lie outside the vocabulary, or the tokenizer has more tokens than
  // the model.
  static absl::StatusOr<std::shared_ptr<const ModelInfo>> FromParts(
      Parts parts);

  ModelInfo(const ModelInfo&) = delete;
  ModelInfo& operator=(const ModelInfo&) = delete;

  const std::string& name() const { return name_; }
  // With generation_config.json's BOS/EOS applied, and BOS taken from the
  // tokenizer when neither file names one.
  const ModelConfig& config() const { return config_; }
  const GenerationConfig& generation_config() const {
    return generation_config_;
  }
  // Null when the model has no tokenizer.json.
  const Tokenizer* tokenizer() const { return tokenizer_.get(); }
  // EOS ids from config.json, generation_config.json and the tokenizer, in
  // that order, each once.
  const std::vector<int32_t>& eos_token_ids() const { return eos_token_ids_; }
  std::optional<int32_t> bos_token_id() const { return config_.bos_token_id; }
  // The chat template's text, origin and special tokens, not parsed: the
  // router parses it (engine/chat); workers have no use for it.
  const std::optional<ChatTemplateSource>& chat_template() const {
    return chat_template_;
  }

 private:
  explicit ModelInfo(Parts parts);

  const std::string name_;
  ModelConfig config_;
  const GenerationConfig generation_config_;
  const std::unique_ptr<const Tokenizer> tokenizer_;
  const std::optional<ChatTemplateSource> chat_template_;
  std::vector<int32_t> eos_token_ids_;
};

// The builtin models (their weights are made from a seed by the engine,
// engine/builtin_tiny.h).
//
// builtin:tiny: vocab 258 (the byte-level tokenizer), hidden 128, 4 layers,
// 4 heads, 2 KV heads, FFN 384, context 4096, fp32.
ModelConfig TinyModelConfig();
// builtin:llama-110m: Llama 2 110M-like (vocab 32000, hidden 768, 12
// layers, 12 heads, 4 KV heads, FFN 2048, context 16384), bf16; its
// tokenizer is the byte-level one (ids 0..257 of the vocabulary).
ModelConfig Llama110MConfig();

// `spec` is "builtin:tiny", "builtin:llama-110m" or a Hugging Face model
// directory (config.json required; generation_config.json, tokenizer.json,
// tokenizer_config.json and a chat template optional). NOT_FOUND when the
// directory or its config.json is missing; INVALID_ARGUMENT for an unknown
// builtin name or a malformed file, naming it. Reads no weights.
absl::StatusOr<std::shared_ptr<const ModelInfo>> LoadModelInfo(
    std::string_view spec);

}  // namespace pdserve

#endif  // PDSERVE_ENGINE_MODEL_FILES_MODEL_INFO_H_
