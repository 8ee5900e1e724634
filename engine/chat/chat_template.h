// Hugging Face chat templates, rendered in C++ exactly as transformers does.
//
// A model's `chat_template` is a Jinja2 program that turns an OpenAI-style
// list of messages (plus tools, documents and extra variables) into the
// prompt text. ChatTemplate implements the part of Jinja2 that real
// templates use (docs/chat_templates.md lists it) with the semantics of
// Python jinja2 3.1 as transformers 5.x `apply_chat_template` runs it:
// ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
// loopcontrols), its tojson (json.dumps, ensure_ascii=False, key order kept),
// raise_exception, strftime_now, namespace, dict, and its input
// normalization (message keys whose value is null are dropped; reasoning is
// aliased under `reasoning_content` and `thinking`). The output is byte for
// byte what Python renders, which tests/engine/chat/ checks over every
// template in ../shared/chat_templates.
//
// Errors:
//  - Parse: InvalidArgumentError naming the line and the construct for a
//    syntax error or anything not implemented (a filter, test, method,
//    function or statement): an unsupported template fails here, never
//    renders a wrong prompt.
//  - Render: InvalidArgumentError. A template's raise_exception(msg) gives
//    exactly `msg` (e.g. "Conversation roles must alternate ..."); type and
//    undefined errors read "chat template line N: <what>"; exceeding a limit
//    (ChatTemplateLimits) names the limit.
//
// Thread-safety: a ChatTemplate is immutable after Parse; Render is const
// and may run on many threads at once.
#ifndef PDSERVE_ENGINE_CHAT_CHAT_TEMPLATE_H_
#define PDSERVE_ENGINE_CHAT_CHAT_TEMPLATE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "nlohmann/json.hpp"

namespace pdserve {

namespace jinja {
struct Program;
}  // namespace jinja

// The special-token strings transformers passes to every render (its
// `special_tokens_map`). An unset token is undefined in the template.
struct ChatTemplateTokens {
  std::optional<std::string> bos_token;
  std::optional<std::string> eos_token;
  std::optional<std::string> unk_token;
  std::optional<std::string> pad_token;
};

// Bounds on one render, so that a hostile template cannot exhaust the
// process.
struct ChatTemplateLimits {
  // Largest prompt (and largest string built on the way). Default 16 MiB.
  size_t max_output_bytes = size_t{16} << 20;
  // Deepest macro recursion. Default 64.
  int max_call_depth = 64;
  // Most statements + loop iterations + calls in one render. Default 20M
  // (the templates in ../shared take a few thousand).
  int64_t max_steps = 20'000'000;
};

class ChatTemplate {
 public:
  static absl::StatusOr<std::unique_ptr<ChatTemplate>> Parse(std::string_view source,
                                                             ChatTemplateTokens tokens,
                                                             ChatTemplateLimits limits = {});

  struct RenderRequest {
    // Array of message objects (role, content as a string or a list of
    // {type, text} parts, name, tool_calls, tool_call_id, reasoning_content,
    // ...), passed to the template as given after transformers'
    // normalization. Ordered JSON: tojson prints keys in the caller's order,
    // as Python does, so parse request bodies into nlohmann::ordered_json.
    nlohmann::ordered_json messages;
    // Null or an array of tool objects ({"type": "function", "function": {...}}).
    nlohmann::ordered_json tools;
    // Null or an array of document objects (RAG templates such as Command R).
    nlohmann::ordered_json documents;
    bool add_generation_prompt = true;
    // Null or an object: extra template variables (chat_template_kwargs,
    // e.g. {"enable_thinking": false}); they override the special tokens.
    nlohmann::ordered_json kwargs;
    // The clock strftime_now() reads, formatted in the local time zone;
    // unset: the current time (tests set it for reproducible output).
    std::optional<absl::Time> now;
  };

  // The prompt text. Thread-safe.
  absl::StatusOr<std::string> Render(const RenderRequest& request) const;

  const std::string& source() const { return source_; }
  const ChatTemplateTokens& tokens() const { return tokens_; }

  ~ChatTemplate();

 private:
  ChatTemplate(std::string source, ChatTemplateTokens tokens, ChatTemplateLimits limits,
               std::unique_ptr<jinja::Program> program);

  const std::string source_;
  const ChatTemplateTokens tokens_;
  const ChatTemplateLimits limits_;
  const std::unique_ptr<const jinja::Program> program_;
};

// A model directory's chat template as transformers finds it.
struct ChatTemplateSource {
  std::string source;          // The Jinja text.
  std::string origin;          // The file it came from.
  ChatTemplateTokens tokens;   // From tokenizer_config.json (unset if absent).
};

// Reads `model_dir`: chat_template.jinja if present, else chat_template.json's
// "chat_template", else tokenizer_config.json's "chat_template" (a string, or
// a list of {name, template}: the one named "default"). Special tokens come
// from tokenizer_config.json (strings or {"content": ...} objects).
// Returns nullopt when the model has no template; InvalidArgumentError for a
// malformed file (bad JSON, wrong types, a list with no "default"),
// NotFoundError when `model_dir` does not exist.
absl::StatusOr<std::optional<ChatTemplateSource>> LoadChatTemplate(const std::string& model_dir);

}  // namespace pdserve

#endif  // PDSERVE_ENGINE_CHAT_CHAT_TEMPLATE_H_
