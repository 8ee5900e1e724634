#include "router/openai_api.h"

#include <algorithm>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "engine/tokenizer.h"

namespace pdserve {
namespace {

using nlohmann::json;

absl::string_view FinishReasonName(v1::FinishReason reason) {
  switch (reason) {
    case v1::FINISH_REASON_STOP:
      return "stop";
    case v1::FINISH_REASON_LENGTH:
      return "length";
    default:
      return "";
  }
}

json Bytes(absl::string_view text) {
  json bytes = json::array();
  for (unsigned char c : text) bytes.push_back(static_cast<int>(c));
  return bytes;
}


}  // namespace

OpenAiResponseWriter::OpenAiResponseWriter(const OpenAiRequest& request,
                                           std::string id, int64_t created,
                                           const Tokenizer* tokenizer)
    : request_(request),
      id_(std::move(id)),
      created_(created),
      tokenizer_(tokenizer),
      chat_(request.endpoint == OpenAiEndpoint::kChatCompletions),
      prompts_(request.prompts.size()),
      choices_(request.prompts.size() * request.n) {}

void OpenAiResponseWriter::SetPrompt(int prompt_index, std::string text,
                                     std::vector<int32_t> token_ids) {
  prompts_[prompt_index].text = std::move(text);
  prompts_[prompt_index].token_ids = std::move(token_ids);
}

OpenAiResponseWriter::Choice& OpenAiResponseWriter::ChoiceOf(int prompt_index,
                                                             uint32_t index) {
  return choices_[prompt_index * request_.n +
                  std::min(index, request_.n - 1)];
}

std::string OpenAiResponseWriter::TokenString(int32_t previous,
                                              int32_t id) const {
  if (tokenizer_ == nullptr || id < 0 || id >= tokenizer_->vocab_size()) {
    return absl::StrCat("token_id:", id);
  }
  // A token's text depends on what precedes it (SentencePiece drops the
  // leading space of a text's first piece): decode it after its
  // predecessor and keep what it added.
  if (previous >= 0 && previous < tokenizer_->vocab_size()) {
    const int32_t pair[] = {previous, id};
    const int32_t one[] = {previous};
    absl::StatusOr<std::string> both =
        tokenizer_->Decode(pair, /*skip_special_tokens=*/false);
    absl::StatusOr<std::string> before =
        tokenizer_->Decode(one, /*skip_special_tokens=*/false);
    if (both.ok() && before.ok() && absl::StartsWith(*both, *before)) {
      return both->substr(before->size());
    }
  }
  const int32_t ids[] = {id};
  absl::StatusOr<std::string> text =
      tokenizer_->Decode(ids, /*skip_special_tokens=*/false);
  return text.ok() ? *std::move(text) : absl::StrCat("token_id:", id);
}

void OpenAiResponseWriter::AddLogprobs(const v1::GenerateResponse& message,
                                       Choice& choice, json* delta) {
  for (const v1::TokenLogprobs& lp : message.logprobs()) {
    const int32_t previous = choice.previous_token;
    choice.previous_token = lp.token_id();
    const std::string token = TokenString(previous, lp.token_id());
    if (chat_) {
      json top = json::array();
      for (const v1::TokenLogprob& alt : lp.top()) {
        const std::string alt_token = TokenString(previous, alt.token_id());
        top.push_back({{"token", alt_token},
                       {"logprob", alt.logprob()},
                       {"bytes", Bytes(alt_token)}});
      }
      json entry = {{"token", token},
                    {"logprob", lp.logprob()},
                    {"bytes", Bytes(token)},
                    {"top_logprobs", std::move(top)}};
      if (delta) (*delta)["content"].push_back(entry);
      choice.logprobs_content.push_back(std::move(entry));
    } else {
      json top = json::object();
      for (const v1::TokenLogprob& alt : lp.top()) {
        top[TokenString(previous, alt.token_id())] = alt.logprob();
      }
      const size_t offset = choice.text_bytes;
      choice.text_bytes += token.size();
      if (delta) {
        (*delta)["tokens"].push_back(token);
        (*delta)["token_logprobs"].push_back(lp.logprob());
        (*delta)["top_logprobs"].push_back(top);
        (*delta)["text_offset"].push_back(offset);
      }
      choice.tokens.push_back(token);
      choice.token_logprobs.push_back(lp.logprob());
      choice.top_logprobs.push_back(std::move(top));
      choice.text_offset.push_back(offset);
    }
  }
}

void OpenAiResponseWriter::AddPromptLogprobs(
    const Prompt& prompt, const v1::GenerateResponse& message, Choice& choice,
    json* delta) {
  // Echo with logprobs (completions only): the prompt's tokens first, the
  // first of them without a logprob (nothing precedes it).
  if (prompt.token_ids.empty()) return;
  auto push = [&](const std::string& token, json logprob, json top) {
    const size_t offset = choice.text_bytes;
    choice.text_bytes += token.size();
    if (delta) {
      (*delta)["tokens"].push_back(token);
      (*delta)["token_logprobs"].push_back(logprob);
      (*delta)["top_logprobs"].push_back(top);
      (*delta)["text_offset"].push_back(offset);
    }
    choice.tokens.push_back(token);
    choice.token_logprobs.push_back(std::move(logprob));
    choice.top_logprobs.push_back(std::move(top));
    choice.text_offset.push_back(offset);
  };
  push(TokenString(-1, prompt.token_ids[0]), nullptr, nullptr);
  for (int i = 1; i < static_cast<int>(prompt.token_ids.size()); ++i) {
    const int32_t id = prompt.token_ids[i];
    const int32_t previous = prompt.token_ids[i - 1];
    json logprob = nullptr;
    json top = nullptr;
    if (i - 1 < message.prompt_logprobs_size()) {
      const v1::TokenLogprobs& lp = message.prompt_logprobs(i - 1);
      logprob = lp.logprob();
      top = json::object();
      for (const v1::TokenLogprob& alt : lp.top()) {
        top[TokenString(previous, alt.token_id())] = alt.logprob();
      }
    }
    push(TokenString(previous, id), std::move(logprob), std::move(top));
  }
}

json OpenAiResponseWriter::Envelope() const {
  return {{"id", id_},
          {"object", chat_ ? (request_.stream ? "chat.completion.chunk"
                                              : "chat.completion")
                           : "text_completion"},
          {"created", created_},
          {"model", request_.model}};
}

json OpenAiResponseWriter::UsageJson() const {
  uint64_t prompt_tokens = 0;
  uint64_t completion_tokens = 0;
  for (const Prompt& prompt : prompts_) prompt_tokens += prompt.prompt_tokens;
  for (const Choice& choice : choices_) {
    completion_tokens += choice.completion_tokens;
  }
  return {{"prompt_tokens", prompt_tokens},
          {"completion_tokens", completion_tokens},
          {"total_tokens", prompt_tokens + completion_tokens}};
}

std::string OpenAiResponseWriter::StreamChunk(
    int prompt_index, const v1::GenerateResponse& message) {
  Prompt& prompt = prompts_[prompt_index];
  Choice& choice = ChoiceOf(prompt_index, message.index());
  const bool first = !choice.started;
  choice.started = true;
  if (first && !prompt.token_ids.empty()) {
    choice.previous_token = prompt.token_ids.back();
  }
  std::string text = message.text();
  json logprobs = nullptr;
  if (request_.logprobs) {
    logprobs = chat_ ? json{{"content", json::array()}}
                     : json{{"tokens", json::array()},
                            {"token_logprobs", json::array()},
                            {"top_logprobs", json::array()},
                            {"text_offset", json::array()}};
  }
  if (first && request_.echo) {
    text = prompt.text + text;
    if (request_.logprobs) {
      AddPromptLogprobs(prompt, message, choice, &logprobs);
    }
    choice.text_bytes = prompt.text.size();
  }
  if (request_.logprobs) AddLogprobs(message, choice, &logprobs);
  if (message.has_usage()) {
    prompt.prompt_tokens = message.usage().prompt_tokens();
    choice.completion_tokens = message.usage().completion_tokens();
  }
  const absl::string_view finish = FinishReasonName(message.finish_reason());
  if (text.empty() && finish.empty() && !first &&
      (logprobs.is_null() || message.logprobs_size() == 0)) {
    return {};
  }
  json out_choice = {{"index", prompt_index * request_.n +
                                   std::min(message.index(), request_.n - 1)},
                     {"logprobs", std::move(logprobs)},
                     {"finish_reason",
                      finish.empty() ? json(nullptr) : json(finish)}};
  if (chat_) {
    json delta = {{"content", text}};
    if (first) delta["role"] = "assistant";
    out_choice["delta"] = std::move(delta);
  } else {
    out_choice["text"] = text;
  }
  json chunk = Envelope();
  chunk["choices"] = json::array({std::move(out_choice)});
  if (request_.include_usage) chunk["usage"] = nullptr;
  return DumpJson(chunk);
}

std::string OpenAiResponseWriter::UsageChunk() const {
  if (!request_.include_usage) return {};
  json chunk = Envelope();
  chunk["choices"] = json::array();
  chunk["usage"] = UsageJson();
  return DumpJson(chunk);
}

void OpenAiResponseWriter::Add(int prompt_index,
                               const v1::GenerateResponse& message) {
  Prompt& prompt = prompts_[prompt_index];
  Choice& choice = ChoiceOf(prompt_index, message.index());
  if (!choice.started) {
    choice.started = true;
    if (!prompt.token_ids.empty()) {
      choice.previous_token = prompt.token_ids.back();
    }
    if (request_.echo) {
      if (request_.logprobs) {
        AddPromptLogprobs(prompt, message, choice, nullptr);
      }
      choice.text = prompt.text;
      choice.text_bytes = prompt.text.size();
    }
  }
  choice.text += message.text();
  if (request_.logprobs) AddLogprobs(message, choice, nullptr);
  if (message.has_usage()) {
    prompt.prompt_tokens = message.usage().prompt_tokens();
    choice.completion_tokens = message.usage().completion_tokens();
  }
  const absl::string_view finish = FinishReasonName(message.finish_reason());
  if (!finish.empty()) choice.finish_reason = std::string(finish);
}

std::string OpenAiResponseWriter::Whole() const {
  json choices = json::array();
  for (size_t i = 0; i < choices_.size(); ++i) {
    const Choice& choice = choices_[i];
    json logprobs = nullptr;
    if (request_.logprobs) {
      logprobs = chat_ ? json{{"content", choice.logprobs_content}}
                       : json{{"tokens", choice.tokens},
                              {"token_logprobs", choice.token_logprobs},
                              {"top_logprobs", choice.top_logprobs},
                              {"text_offset", choice.text_offset}};
    }
    json out = {{"index", i},
                {"logprobs", std::move(logprobs)},
                {"finish_reason", choice.finish_reason.empty()
                                      ? json(nullptr)
                                      : json(choice.finish_reason)}};
    if (chat_) {
      out["message"] = {{"role", "assistant"}, {"content", choice.text}};
    } else {
      out["text"] = choice.text;
    }
    choices.push_back(std::move(out));
  }
  json response = Envelope();
  response["choices"] = std::move(choices);
  response["usage"] = UsageJson();
  return DumpJson(response);
}

}  // namespace pdserve
