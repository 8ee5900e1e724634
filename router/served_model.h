// ServedModel: what the router knows of the model its workers serve — the
// name clients use, the context length, the vocabulary, the tokenizer and
// the chat template, from the model's ModelInfo (its files but never its
// weights: the router loads no weights) — and the checks of a public
// GenerateRequest against it.
//
// Thread-safety: immutable after Load(); share freely. ValidateGenerateRequest
// has no shared state.
#ifndef PDSERVE_ROUTER_SERVED_MODEL_H_
#define PDSERVE_ROUTER_SERVED_MODEL_H_

#include <cstdint>
#include <memory>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/statusor.h"
#include "engine/generator.h"
#include "engine/chat/chat_template.h"
#include "engine/model_files/model_info.h"
#include "engine/tokenizer.h"
#include "nlohmann/json.hpp"
#include "pdserve/internal/v1/cluster_config.pb.h"
#include "pdserve/v1/generation.pb.h"

namespace pdserve {

// Limits of GenerateRequest (proto/pdserve/v1/generation.proto).
inline constexpr int kMaxStopStrings = 16;
inline constexpr int kMaxStopStringBytes = 256;
inline constexpr int kMaxLogprobs = 20;
inline constexpr uint32_t kDefaultMaxTokens = 16;
// Choices per request (GenerateRequest.n).
inline constexpr uint32_t kMaxChoices = 16;

class ServedModel {
 public:
  // Loads the ModelInfo of config.model (a Hugging Face directory or
  // "builtin:..."; LoadModelInfo, no weights) for its tokenizer, shape and
  // chat template; the name is served_model_name, else
  // DefaultServedModelName. A chat template that does not parse (or uses
  // what engine/chat does not implement) fails the load, naming its line.
  static absl::StatusOr<std::shared_ptr<const ServedModel>> Load(
      const internal::v1::ClusterConfig& config);
  // From an already loaded ModelInfo (tests). `chat_template` may be null:
  // chat requests are then refused.
  static std::shared_ptr<const ServedModel> FromInfo(
      std::string name, std::shared_ptr<const ModelInfo> info,
      std::shared_ptr<const ChatTemplate> chat_template = nullptr);

  const std::string& name() const { return name_; }
  // The model's name as the workers report it (ModelInfo::name():
  // "builtin:tiny", or the directory's base name).
  const std::string& spec() const { return info_->name(); }
  int32_t context_length() const { return context_length_; }
  int32_t vocab_size() const { return vocab_size_; }
  // Null when the model directory has no tokenizer.json: then only token id
  // prompts are accepted and responses carry no text.
  const Tokenizer* tokenizer() const { return info_->tokenizer(); }
  const ModelConfig& config() const { return info_->config(); }

  // INVALID_ARGUMENT unless `requested` is empty or this model's name.
  absl::Status CheckName(const std::string& requested) const;

  // The prompt of a chat conversation, rendered by the model's chat
  // template: `messages` (OpenAI messages), `tools` (null or a list),
  // `kwargs` (an object of extra template variables, e.g. enable_thinking).
  // FAILED_PRECONDITION when the model has none; INVALID_ARGUMENT when the
  // template rejects the conversation (its raise_exception message).
  absl::StatusOr<std::string> RenderChat(
      const nlohmann::ordered_json& messages,
      const nlohmann::ordered_json& tools, bool add_generation_prompt,
      const nlohmann::ordered_json& kwargs) const;
  bool has_chat_template() const { return chat_template_ != nullptr; }

 private:
  ServedModel(std::string name, std::shared_ptr<const ModelInfo> info,
              std::shared_ptr<const ChatTemplate> chat_template);

  const std::string name_;
  const std::shared_ptr<const ModelInfo> info_;
  const int32_t context_length_;
  const int32_t vocab_size_;
  const std::shared_ptr<const ChatTemplate> chat_template_;  // May be null.
};

// A GenerateRequest that passed every check, tokenized, with its defaults
// filled in. The router still assigns `engine.id` and, when unset, the seed.
struct ValidatedRequest {
  GenerationRequest engine;
  std::vector<std::string> stop_strings;
  bool skip_special_tokens = true;
  // Choices to generate, 1..kMaxChoices.
  uint32_t n = 1;
};

// The name a model is served under by default: "builtin:..." as is, a
// directory's base name ("/models/Llama-3.1-8B/" -> "Llama-3.1-8B").
std::string DefaultServedModelName(absl::string_view spec);

// Checks `request` against `model` and tokenizes a text prompt.
// INVALID_ARGUMENT with a message naming the field for: no prompt, an empty
// prompt, text that is not UTF-8, token ids outside the vocabulary, an
// unknown model name, max_tokens 0, prompt + max_tokens beyond the context,
// sampling values out of range, more than kMaxStopStrings stop strings or one
// empty, longer than kMaxStopStringBytes or not UTF-8, logprobs above
// kMaxLogprobs, a text prompt or stop strings for a model without tokenizer,
// n outside [1, kMaxChoices], prompt_logprobs above kMaxLogprobs, penalties
// or logit_bias out of range (ValidateSamplingParams).
absl::StatusOr<ValidatedRequest> ValidateGenerateRequest(
    const v1::GenerateRequest& request, const ServedModel& model);

}  // namespace pdserve

#endif  // PDSERVE_ROUTER_SERVED_MODEL_H_
