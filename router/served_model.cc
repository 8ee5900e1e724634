#include "router/served_model.h"

#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "engine/sampler.h"
#include "engine/unicode.h"

namespace pdserve {

ServedModel::ServedModel(std::string name,
                         std::shared_ptr<const ModelInfo> info,
                         std::shared_ptr<const ChatTemplate> chat_template)
    : name_(std::move(name)),
      info_(std::move(info)),
      context_length_(info_->config().max_position_embeddings),
      vocab_size_(info_->config().vocab_size),
      chat_template_(std::move(chat_template)) {}

absl::StatusOr<std::shared_ptr<const ServedModel>> ServedModel::Load(
    const internal::v1::ClusterConfig& config) {
  const std::string spec =
      config.model().empty() ? "builtin:tiny" : config.model();
  absl::StatusOr<std::shared_ptr<const ModelInfo>> info = LoadModelInfo(spec);
  if (!info.ok()) {
    return absl::Status(
        info.status().code(),
        absl::StrCat("loading model '", spec, "': ", info.status().message()));
  }
  std::string name = config.served_model_name().empty()
                         ? DefaultServedModelName(spec)
                         : config.served_model_name();
  std::shared_ptr<const ChatTemplate> chat_template;
  if (const std::optional<ChatTemplateSource>& source =
          (*info)->chat_template();
      source.has_value()) {
    absl::StatusOr<std::unique_ptr<ChatTemplate>> parsed =
        ChatTemplate::Parse(source->source, source->tokens);
    if (!parsed.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("the chat template in ", source->origin,
                       " cannot be served: ", parsed.status().message()));
    }
    chat_template = *std::move(parsed);
  }
  return FromInfo(std::move(name), *std::move(info), std::move(chat_template));
}

std::string DefaultServedModelName(absl::string_view spec) {
  if (absl::StartsWith(spec, "builtin:")) return std::string(spec);
  while (spec.size() > 1 && spec.back() == '/') spec.remove_suffix(1);
  const size_t slash = spec.rfind('/');
  return std::string(slash == absl::string_view::npos ? spec
                                                     : spec.substr(slash + 1));
}

absl::StatusOr<std::string> ServedModel::RenderChat(
    const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
    bool add_generation_prompt, const nlohmann::ordered_json& kwargs) const {
  if (chat_template_ == nullptr) {
    return absl::FailedPreconditionError(absl::StrCat(
        "model '", name_,
        "' has no chat template (tokenizer_config.json 'chat_template' or "
        "chat_template.jinja); use /v1/completions"));
  }
  ChatTemplate::RenderRequest request;
  request.messages = messages;
  request.tools = tools;
  request.add_generation_prompt = add_generation_prompt;
  request.kwargs = kwargs;
  return chat_template_->Render(request);
}

std::shared_ptr<const ServedModel> ServedModel::FromInfo(
    std::string name, std::shared_ptr<const ModelInfo> info,
    std::shared_ptr<const ChatTemplate> chat_template) {
  return std::shared_ptr<const ServedModel>(new ServedModel(
      std::move(name), std::move(info), std::move(chat_template)));
}

absl::Status ServedModel::CheckName(const std::string& requested) const {
  if (requested.empty() || requested == name_) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(
      "unknown model '", requested, "'; this server serves '", name_, "'"));
}

absl::StatusOr<ValidatedRequest> ValidateGenerateRequest(
    const v1::GenerateRequest& request, const ServedModel& model) {
  PD_RETURN_IF_ERROR(model.CheckName(request.model()));
  ValidatedRequest out;
  std::vector<int32_t>& prompt = out.engine.prompt;
  switch (request.prompt_case()) {
    case v1::GenerateRequest::kText: {
      if (model.tokenizer() == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat("model '", model.name(),
                         "' has no tokenizer; send the prompt as token_ids"));
      }
      if (!unicode::IsValidUtf8(request.text())) {
        return absl::InvalidArgumentError("prompt text is not valid UTF-8");
      }
      const bool add_special =
          !request.has_add_special_tokens() || request.add_special_tokens();
      absl::StatusOr<std::vector<int32_t>> ids =
          model.tokenizer()->Encode(request.text(), add_special);
      if (!ids.ok()) {
        return absl::InvalidArgumentError(
            absl::StrCat("prompt text: ", ids.status().message()));
      }
      prompt = *std::move(ids);
      break;
    }
    case v1::GenerateRequest::kTokenIds:
      prompt.assign(request.token_ids().ids().begin(),
                    request.token_ids().ids().end());
      for (size_t i = 0; i < prompt.size(); ++i) {
        if (prompt[i] < 0 || prompt[i] >= model.vocab_size()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "token_ids[", i, "] = ", prompt[i],
              " is outside the vocabulary [0, ", model.vocab_size(), ")"));
        }
      }
      break;
    case v1::GenerateRequest::PROMPT_NOT_SET:
      return absl::InvalidArgumentError(
          "the request has no prompt; set text or token_ids");
  }
  if (prompt.empty()) {
    return absl::InvalidArgumentError("the prompt is empty (no tokens)");
  }

  const uint64_t max_tokens =
      request.has_max_tokens() ? request.max_tokens() : kDefaultMaxTokens;
  if (max_tokens == 0) {
    return absl::InvalidArgumentError("max_tokens must be at least 1, got 0");
  }
  if (prompt.size() + max_tokens >
      static_cast<uint64_t>(model.context_length())) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt (", prompt.size(), " tokens) + max_tokens (",
                     max_tokens, ") exceeds the model's context of ",
                     model.context_length(), " tokens"));
  }
  if (request.logprobs() > kMaxLogprobs) {
    return absl::InvalidArgumentError(absl::StrCat("logprobs must be in [0, ",
                                                   kMaxLogprobs, "], got ",
                                                   request.logprobs()));
  }

  if (request.has_n() && (request.n() < 1 || request.n() > kMaxChoices)) {
    return absl::InvalidArgumentError(
        absl::StrCat("n must be in [1, ", kMaxChoices, "], got ", request.n()));
  }
  out.n = request.has_n() ? request.n() : 1;
  if (request.has_prompt_logprobs() &&
      request.prompt_logprobs() > static_cast<uint32_t>(kMaxLogprobs)) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt_logprobs must be in [0, ", kMaxLogprobs, "], got ",
                     request.prompt_logprobs()));
  }

  SamplingParams& s = out.engine.sampling;
  const v1::SamplingParams& in = request.sampling();
  s.temperature = in.has_temperature() ? in.temperature() : 1.0f;
  s.top_k = in.top_k();
  s.top_p = in.has_top_p() ? in.top_p() : 1.0f;
  s.min_p = in.min_p();
  if (in.has_seed()) s.seed = in.seed();
  s.max_tokens = static_cast<int32_t>(max_tokens);
  s.stop_token_ids.assign(request.stop_token_ids().begin(),
                          request.stop_token_ids().end());
  s.ignore_eos = request.ignore_eos();
  s.logprobs = static_cast<int32_t>(request.logprobs());
  if (request.has_prompt_logprobs()) {
    s.prompt_logprobs = static_cast<int32_t>(request.prompt_logprobs());
  }
  s.presence_penalty = in.presence_penalty();
  s.frequency_penalty = in.frequency_penalty();
  s.repetition_penalty =
      in.has_repetition_penalty() ? in.repetition_penalty() : 1.0f;
  // In the map's order: the ids are distinct, so any order biases alike.
  s.logit_bias.assign(in.logit_bias().begin(), in.logit_bias().end());
  PD_RETURN_IF_ERROR(ValidateSamplingParams(s, model.vocab_size()));

  if (request.stop_size() > kMaxStopStrings) {
    return absl::InvalidArgumentError(absl::StrCat("at most ", kMaxStopStrings,
                                                   " stop strings, got ",
                                                   request.stop_size()));
  }
  for (int i = 0; i < request.stop_size(); ++i) {
    const std::string& stop = request.stop(i);
    if (stop.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("stop[", i, "] is empty"));
    }
    if (stop.size() > kMaxStopStringBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat("stop[", i, "] is ", stop.size(),
                       " bytes long; at most ", kMaxStopStringBytes));
    }
    if (!unicode::IsValidUtf8(stop)) {
      return absl::InvalidArgumentError(
          absl::StrCat("stop[", i, "] is not valid UTF-8"));
    }
  }
  if (request.stop_size() > 0 && model.tokenizer() == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("model '", model.name(),
                     "' has no tokenizer; stop strings cannot be matched"));
  }
  out.stop_strings.assign(request.stop().begin(), request.stop().end());
  out.skip_special_tokens =
      !request.has_skip_special_tokens() || request.skip_special_tokens();
  return out;
}

}  // namespace pdserve
