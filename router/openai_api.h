// The OpenAI-compatible API's wire formats: JSON request bodies of
// /v1/completions and /v1/chat/completions parsed into pdserve's public
// GenerateRequest, generated messages formatted as OpenAI response objects
// and stream chunks, and errors as OpenAI error objects.
//
// Parameters accepted, as the OpenAI reference and vLLM take them: model,
// prompt (a string, a list of strings, a list of token ids or a list of such
// lists), messages, max_tokens / max_completion_tokens, temperature, top_p,
// top_k, min_p, seed, stop (string or list), n, logprobs and top_logprobs
// (chat), logprobs (completions, 0..20 alternatives), echo (completions),
// presence_penalty, frequency_penalty, repetition_penalty, logit_bias,
// ignore_eos, skip_special_tokens, stop_token_ids, add_special_tokens, user
// (accepted, unused), stream, stream_options.include_usage, and for chat
// tools, add_generation_prompt and chat_template_kwargs (docs/openai_api.md).
// Unknown fields are ignored as OpenAI does; a known field of the wrong type
// is a 400 naming it.
//
// Thread-safety: free functions without shared state.
#ifndef PDSERVE_ROUTER_OPENAI_API_H_
#define PDSERVE_ROUTER_OPENAI_API_H_

#include <cstdint>
#include <optional>
#include <string>
#include "absl/strings/string_view.h"
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"
#include "pdserve/v1/generation.pb.h"

namespace pdserve {

class Tokenizer;

enum class OpenAiEndpoint { kCompletions, kChatCompletions };

// Most prompts one /v1/completions request may carry.
inline constexpr int kMaxOpenAiPrompts = 64;

// A parsed request body.
struct OpenAiRequest {
  OpenAiEndpoint endpoint = OpenAiEndpoint::kCompletions;
  // As the client named it; echoed in every response.
  std::string model;
  bool stream = false;
  // stream_options.include_usage: a last chunk with the usage.
  bool include_usage = false;
  // Completions: the prompt is prepended to each choice's text.
  bool echo = false;
  // Logprobs asked for: nullopt none, else the alternatives per token
  // (completions: logprobs; chat: top_logprobs when logprobs is true).
  std::optional<uint32_t> logprobs;
  // Choices per prompt.
  uint32_t n = 1;
  // One request per prompt, every field but the prompt of a chat request set
  // (the prompt comes from rendering `messages`). Choice j of prompt i is
  // OpenAI's choice index i * n + j.
  std::vector<v1::GenerateRequest> prompts;
  // Chat: what the chat template renders, in the order the client sent its
  // keys (a template's tojson prints them so, as Python does).
  nlohmann::ordered_json messages;
  nlohmann::ordered_json tools;  // Null when none.
  bool add_generation_prompt = true;
  nlohmann::ordered_json chat_template_kwargs = nlohmann::ordered_json::object();
  // Chat without max_tokens: generate up to the end of the context.
  bool max_tokens_from_context = false;
};

// Parses `body`. INVALID_ARGUMENT with the offending field named in
// OpenAiParam(status) for malformed JSON, a missing or mistyped field, or a
// value out of range (the checks of values against the model are the gRPC
// path's, made later on the GenerateRequest).
absl::StatusOr<OpenAiRequest> ParseOpenAiRequest(OpenAiEndpoint endpoint,
                                                 absl::string_view body);

// The request field a status from ParseOpenAiRequest names, or empty.
std::string OpenAiParam(const absl::Status& status);

// An OpenAI error object, {"error": {message, type, param, code}}, and the
// HTTP status that goes with a status code: INVALID_ARGUMENT 400,
// UNAUTHENTICATED 401, PERMISSION_DENIED 403, NOT_FOUND 404,
// RESOURCE_EXHAUSTED 429, UNAVAILABLE 503, DEADLINE_EXCEEDED 504,
// CANCELLED 499, everything else 500.
struct OpenAiError {
  int http_status = 500;
  std::string body;
};
OpenAiError MakeOpenAiError(const absl::Status& status);

// Serializes JSON for the wire: invalid UTF-8 (a token's partial character)
// becomes U+FFFD instead of failing.
std::string DumpJson(const nlohmann::json& value);

// Builds the response objects of one request. Not thread-safe.
class OpenAiResponseWriter {
 public:
  // `tokenizer` (may be null: no token strings) must outlive the writer.
  OpenAiResponseWriter(const OpenAiRequest& request, std::string id,
                       int64_t created, const Tokenizer* tokenizer);

  // Sets the prompt of prompt `prompt_index`, for echo: its text and, with
  // logprobs, its token ids.
  void SetPrompt(int prompt_index, std::string text,
                 std::vector<int32_t> token_ids);

  // A stream chunk for `message` of prompt `prompt_index` (the message's
  // index is the choice within the prompt); empty when there is nothing to
  // send. Records the message for the final usage.
  std::string StreamChunk(int prompt_index,
                          const v1::GenerateResponse& message);
  // The last chunk when include_usage, else empty.
  std::string UsageChunk() const;

  // Accumulates `message` for the whole (non-streamed) response.
  void Add(int prompt_index, const v1::GenerateResponse& message);
  // The whole response object.
  std::string Whole() const;

 private:
  struct Choice {
    std::string text;
    nlohmann::json logprobs_content = nlohmann::json::array();  // chat
    nlohmann::json tokens = nlohmann::json::array();            // completions
    nlohmann::json token_logprobs = nlohmann::json::array();
    nlohmann::json top_logprobs = nlohmann::json::array();
    nlohmann::json text_offset = nlohmann::json::array();
    size_t text_bytes = 0;  // For text_offset.
    std::string finish_reason;
    bool started = false;  // Chat: the role went out.
    int32_t previous_token = -1;  // For the next token's text.
    uint32_t completion_tokens = 0;
  };
  struct Prompt {
    std::string text;
    std::vector<int32_t> token_ids;
    uint32_t prompt_tokens = 0;
  };

  Choice& ChoiceOf(int prompt_index, uint32_t index);
  // The logprobs of `message`'s tokens appended to `choice` (and, when
  // `delta` is set, also into `delta` alone for a stream chunk).
  void AddLogprobs(const v1::GenerateResponse& message, Choice& choice,
                   nlohmann::json* delta);
  void AddPromptLogprobs(const Prompt& prompt,
                         const v1::GenerateResponse& message, Choice& choice,
                         nlohmann::json* delta);
  // The text `id` adds after `previous` (-1: at the start).
  std::string TokenString(int32_t previous, int32_t id) const;
  nlohmann::json Envelope() const;
  nlohmann::json UsageJson() const;

  const OpenAiRequest& request_;
  const std::string id_;
  const int64_t created_;
  const Tokenizer* const tokenizer_;
  const bool chat_;
  std::vector<Prompt> prompts_;
  std::vector<Choice> choices_;
};

}  // namespace pdserve

#endif  // PDSERVE_ROUTER_OPENAI_API_H_
