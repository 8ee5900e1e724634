#include "router/openai_api.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "absl/strings/cord.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace pdserve {
namespace {

using json = nlohmann::ordered_json;

constexpr absl::string_view kParamPayload = "type.pdserve/openai-param";

absl::Status Bad(absl::string_view param, absl::string_view message) {
  absl::Status status = absl::InvalidArgumentError(message);
  status.SetPayload(kParamPayload, absl::Cord(param));
  return status;
}

absl::string_view TypeName(const json& value) { return value.type_name(); }

// Field readers: absent or null gives nullopt; a wrong type is a 400.
absl::StatusOr<std::optional<double>> Number(const json& body,
                                             absl::string_view key) {
  const auto it = body.find(key);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_number()) {
    return Bad(key, absl::StrCat("'", key, "' must be a number, not ",
                                 TypeName(*it)));
  }
  const double value = it->get<double>();
  if (!std::isfinite(value)) {
    return Bad(key, absl::StrCat("'", key, "' must be finite"));
  }
  return value;
}

absl::StatusOr<std::optional<int64_t>> Integer(const json& body,
                                               absl::string_view key) {
  const auto it = body.find(key);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (it->is_number_integer()) return it->get<int64_t>();
  // 3.0 is accepted as 3, as Python clients send what they hold.
  if (it->is_number_float()) {
    const double value = it->get<double>();
    if (std::isfinite(value) && value == std::floor(value) &&
        std::abs(value) < 9e15) {
      return static_cast<int64_t>(value);
    }
  }
  return Bad(key, absl::StrCat("'", key, "' must be an integer, not ",
                               it->is_number() ? "a fraction" : TypeName(*it)));
}

absl::StatusOr<std::optional<bool>> Bool(const json& body,
                                         absl::string_view key) {
  const auto it = body.find(key);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_boolean()) {
    return Bad(key, absl::StrCat("'", key, "' must be a boolean, not ",
                                 TypeName(*it)));
  }
  return it->get<bool>();
}

absl::StatusOr<std::optional<std::string>> String(const json& body,
                                                  absl::string_view key) {
  const auto it = body.find(key);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_string()) {
    return Bad(key, absl::StrCat("'", key, "' must be a string, not ",
                                 TypeName(*it)));
  }
  return it->get<std::string>();
}

absl::Status InRange(absl::string_view key, double value, double low,
                     double high) {
  if (value < low || value > high) {
    return Bad(key, absl::StrCat("'", key, "' must be in [", low, ", ", high,
                                 "], not ", value));
  }
  return absl::OkStatus();
}

// Token ids from a JSON array of integers.
absl::StatusOr<std::vector<int32_t>> TokenIds(const json& array,
                                              absl::string_view key) {
  std::vector<int32_t> ids;
  ids.reserve(array.size());
  for (const json& id : array) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 ||
        id.get<int64_t>() > std::numeric_limits<int32_t>::max()) {
      return Bad(key, absl::StrCat("'", key,
                                   "' token ids must be non-negative integers"));
    }
    ids.push_back(static_cast<int32_t>(id.get<int64_t>()));
  }
  return ids;
}

// The prompts of a completions request: a string, a list of strings, a
// list of token ids, or a list of lists of token ids.
absl::StatusOr<std::vector<v1::GenerateRequest>> ParsePrompts(
    const json& body) {
  const auto it = body.find("prompt");
  if (it == body.end() || it->is_null()) {
    return Bad("prompt", "'prompt' is required");
  }
  std::vector<v1::GenerateRequest> prompts;
  auto add_text = [&](const json& text) {
    prompts.emplace_back().set_text(text.get<std::string>());
  };
  if (it->is_string()) {
    add_text(*it);
    return prompts;
  }
  if (!it->is_array() || it->empty()) {
    return Bad("prompt",
               "'prompt' must be a string, a non-empty list of strings, a list "
               "of token ids or a list of lists of token ids");
  }
  const json& first = it->front();
  if (first.is_number()) {  // One prompt of token ids, however long.
    PD_ASSIGN_OR_RETURN(std::vector<int32_t> ids, TokenIds(*it, "prompt"));
    *prompts.emplace_back().mutable_token_ids()->mutable_ids() = {ids.begin(),
                                                                  ids.end()};
    return prompts;
  }
  if (it->size() > kMaxOpenAiPrompts) {
    return Bad("prompt", absl::StrCat("at most ", kMaxOpenAiPrompts,
                                      " prompts per request"));
  }
  for (const json& element : *it) {
    if (element.is_string() && first.is_string()) {
      add_text(element);
    } else if (element.is_array() && first.is_array()) {
      PD_ASSIGN_OR_RETURN(std::vector<int32_t> ids, TokenIds(element, "prompt"));
      *prompts.emplace_back().mutable_token_ids()->mutable_ids() = {
          ids.begin(), ids.end()};
    } else {
      return Bad("prompt",
                 "'prompt' lists must hold only strings or only lists of "
                 "token ids");
    }
  }
  return prompts;
}

absl::Status ParseMessages(const json& body, OpenAiRequest& out) {
  const auto it = body.find("messages");
  if (it == body.end() || !it->is_array() || it->empty()) {
    return Bad("messages", "'messages' must be a non-empty list of messages");
  }
  for (const json& message : *it) {
    if (!message.is_object()) {
      return Bad("messages", "each message must be an object");
    }
    const auto role = message.find("role");
    if (role == message.end() || !role->is_string()) {
      return Bad("messages", "each message needs a 'role' string");
    }
    const auto content = message.find("content");
    if (content != message.end() && !content->is_null() &&
        !content->is_string() && !content->is_array()) {
      return Bad("messages",
                 "a message's 'content' must be a string, a list of content "
                 "parts or null");
    }
    if (content != message.end() && content->is_array()) {
      for (const json& part : *content) {
        if (!part.is_object() || part.value("type", "") != "text" ||
            !part.contains("text") || !part["text"].is_string()) {
          return Bad("messages",
                     "only content parts of type 'text' are supported");
        }
      }
    }
  }
  out.messages = *it;
  if (const auto tools = body.find("tools");
      tools != body.end() && !tools->is_null()) {
    if (!tools->is_array()) return Bad("tools", "'tools' must be a list");
    out.tools = *tools;
  }
  PD_ASSIGN_OR_RETURN(std::optional<bool> add_generation_prompt,
                      Bool(body, "add_generation_prompt"));
  out.add_generation_prompt = add_generation_prompt.value_or(true);
  if (const auto kwargs = body.find("chat_template_kwargs");
      kwargs != body.end() && !kwargs->is_null()) {
    if (!kwargs->is_object()) {
      return Bad("chat_template_kwargs",
                 "'chat_template_kwargs' must be an object");
    }
    out.chat_template_kwargs = *kwargs;
  }
  return absl::OkStatus();
}

// The sampling fields, the same for every prompt of the request.
absl::Status ParseSampling(const json& body, bool chat,
                           v1::GenerateRequest& g, OpenAiRequest& out) {
  v1::SamplingParams& s = *g.mutable_sampling();
  PD_ASSIGN_OR_RETURN(std::optional<double> temperature,
                      Number(body, "temperature"));
  if (temperature) {
    PD_RETURN_IF_ERROR(InRange("temperature", *temperature, 0, 2));
    s.set_temperature(static_cast<float>(*temperature));
  }
  PD_ASSIGN_OR_RETURN(std::optional<double> top_p, Number(body, "top_p"));
  if (top_p) {
    if (*top_p <= 0 || *top_p > 1) {
      return Bad("top_p", "'top_p' must be in (0, 1]");
    }
    s.set_top_p(static_cast<float>(*top_p));
  }
  PD_ASSIGN_OR_RETURN(std::optional<int64_t> top_k, Integer(body, "top_k"));
  if (top_k) {
    // vLLM's -1 means "all tokens", as 0 does here.
    if (*top_k < -1 || *top_k > std::numeric_limits<int32_t>::max()) {
      return Bad("top_k", "'top_k' must be -1, 0 (all tokens) or positive");
    }
    s.set_top_k(*top_k < 0 ? 0 : static_cast<int32_t>(*top_k));
  }
  PD_ASSIGN_OR_RETURN(std::optional<double> min_p, Number(body, "min_p"));
  if (min_p) {
    PD_RETURN_IF_ERROR(InRange("min_p", *min_p, 0, 1));
    s.set_min_p(static_cast<float>(*min_p));
  }
  PD_ASSIGN_OR_RETURN(std::optional<int64_t> seed, Integer(body, "seed"));
  if (seed) s.set_seed(static_cast<uint64_t>(*seed));
  PD_ASSIGN_OR_RETURN(std::optional<double> presence,
                      Number(body, "presence_penalty"));
  if (presence) {
    PD_RETURN_IF_ERROR(InRange("presence_penalty", *presence, -2, 2));
    s.set_presence_penalty(static_cast<float>(*presence));
  }
  PD_ASSIGN_OR_RETURN(std::optional<double> frequency,
                      Number(body, "frequency_penalty"));
  if (frequency) {
    PD_RETURN_IF_ERROR(InRange("frequency_penalty", *frequency, -2, 2));
    s.set_frequency_penalty(static_cast<float>(*frequency));
  }
  PD_ASSIGN_OR_RETURN(std::optional<double> repetition,
                      Number(body, "repetition_penalty"));
  if (repetition) {
    if (*repetition <= 0) {
      return Bad("repetition_penalty", "'repetition_penalty' must be > 0");
    }
    s.set_repetition_penalty(static_cast<float>(*repetition));
  }
  if (const auto bias = body.find("logit_bias");
      bias != body.end() && !bias->is_null()) {
    if (!bias->is_object()) {
      return Bad("logit_bias",
                 "'logit_bias' must be an object of token id to bias");
    }
    for (const auto& [key, value] : bias->items()) {
      int32_t id = 0;
      if (!absl::SimpleAtoi(key, &id) || id < 0) {
        return Bad("logit_bias", absl::StrCat("'logit_bias' key '", key,
                                              "' is not a token id"));
      }
      if (!value.is_number()) {
        return Bad("logit_bias", "'logit_bias' values must be numbers");
      }
      PD_RETURN_IF_ERROR(
          InRange("logit_bias", value.get<double>(), -100, 100));
      (*s.mutable_logit_bias())[id] = value.get<float>();
    }
  }

  // max_completion_tokens is the newer name; either may be sent.
  PD_ASSIGN_OR_RETURN(std::optional<int64_t> max_tokens,
                      Integer(body, "max_completion_tokens"));
  const char* max_tokens_name = "max_completion_tokens";
  if (!max_tokens) {
    PD_ASSIGN_OR_RETURN(max_tokens, Integer(body, "max_tokens"));
    max_tokens_name = "max_tokens";
  }
  if (max_tokens) {
    if (*max_tokens < 1 || *max_tokens > std::numeric_limits<int32_t>::max()) {
      return Bad(max_tokens_name,
                 absl::StrCat("'", max_tokens_name, "' must be at least 1"));
    }
    g.set_max_tokens(static_cast<uint32_t>(*max_tokens));
  } else {
    // OpenAI's completions default to 16 tokens; chat (like vLLM) to the
    // rest of the context.
    out.max_tokens_from_context = chat;
  }

  if (const auto stop = body.find("stop"); stop != body.end() && !stop->is_null()) {
    if (stop->is_string()) {
      g.add_stop(stop->get<std::string>());
    } else if (stop->is_array()) {
      for (const json& one : *stop) {
        if (!one.is_string()) {
          return Bad("stop", "'stop' must be a string or a list of strings");
        }
        g.add_stop(one.get<std::string>());
      }
    } else {
      return Bad("stop", "'stop' must be a string or a list of strings");
    }
  }
  if (const auto ids = body.find("stop_token_ids");
      ids != body.end() && !ids->is_null()) {
    if (!ids->is_array()) {
      return Bad("stop_token_ids", "'stop_token_ids' must be a list of ids");
    }
    PD_ASSIGN_OR_RETURN(std::vector<int32_t> stop_ids,
                        TokenIds(*ids, "stop_token_ids"));
    for (int32_t id : stop_ids) g.add_stop_token_ids(id);
  }
  PD_ASSIGN_OR_RETURN(std::optional<bool> ignore_eos, Bool(body, "ignore_eos"));
  g.set_ignore_eos(ignore_eos.value_or(false));
  PD_ASSIGN_OR_RETURN(std::optional<bool> skip_special,
                      Bool(body, "skip_special_tokens"));
  if (skip_special) g.set_skip_special_tokens(*skip_special);
  PD_ASSIGN_OR_RETURN(std::optional<bool> add_special,
                      Bool(body, "add_special_tokens"));
  // A chat template writes the special tokens itself (vLLM's default too).
  g.set_add_special_tokens(add_special.value_or(!chat));

  // vLLM's extension: lower is served first while requests wait for KV.
  PD_ASSIGN_OR_RETURN(std::optional<int64_t> priority,
                      Integer(body, "priority"));
  if (priority) {
    if (*priority < std::numeric_limits<int32_t>::min() ||
        *priority > std::numeric_limits<int32_t>::max()) {
      return Bad("priority", "'priority' must be a 32-bit integer");
    }
    g.set_priority(static_cast<int32_t>(*priority));
  }

  PD_ASSIGN_OR_RETURN(std::optional<int64_t> n, Integer(body, "n"));
  if (n) {
    if (*n < 1 || *n > 16) return Bad("n", "'n' must be in [1, 16]");
    out.n = static_cast<uint32_t>(*n);
    g.set_n(out.n);
  }

  // Logprobs: chat has a boolean and top_logprobs, completions a count.
  if (chat) {
    PD_ASSIGN_OR_RETURN(std::optional<bool> logprobs, Bool(body, "logprobs"));
    PD_ASSIGN_OR_RETURN(std::optional<int64_t> top,
                        Integer(body, "top_logprobs"));
    if (top && (*top < 0 || *top > 20)) {
      return Bad("top_logprobs", "'top_logprobs' must be in [0, 20]");
    }
    if (top && !logprobs.value_or(false)) {
      return Bad("top_logprobs",
                 "'top_logprobs' needs 'logprobs' set to true");
    }
    if (logprobs.value_or(false)) out.logprobs = top.value_or(0);
  } else {
    PD_ASSIGN_OR_RETURN(std::optional<int64_t> logprobs,
                        Integer(body, "logprobs"));
    if (logprobs) {
      if (*logprobs < 0 || *logprobs > 20) {
        return Bad("logprobs", "'logprobs' must be in [0, 20]");
      }
      out.logprobs = static_cast<uint32_t>(*logprobs);
    }
    PD_ASSIGN_OR_RETURN(std::optional<bool> echo, Bool(body, "echo"));
    out.echo = echo.value_or(false);
    if (out.echo && out.logprobs) g.set_prompt_logprobs(*out.logprobs);
  }
  if (out.logprobs) g.set_logprobs(*out.logprobs);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<OpenAiRequest> ParseOpenAiRequest(OpenAiEndpoint endpoint,
                                                 absl::string_view body) {
  json parsed = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_discarded()) {
    return Bad("", "the request body is not valid JSON");
  }
  if (!parsed.is_object()) {
    return Bad("", "the request body must be a JSON object");
  }
  OpenAiRequest out;
  out.endpoint = endpoint;
  const bool chat = endpoint == OpenAiEndpoint::kChatCompletions;
  PD_ASSIGN_OR_RETURN(std::optional<std::string> model,
                      String(parsed, "model"));
  out.model = model.value_or("");
  PD_ASSIGN_OR_RETURN(std::optional<bool> stream, Bool(parsed, "stream"));
  out.stream = stream.value_or(false);
  if (const auto options = parsed.find("stream_options");
      options != parsed.end() && !options->is_null()) {
    if (!options->is_object()) {
      return Bad("stream_options", "'stream_options' must be an object");
    }
    PD_ASSIGN_OR_RETURN(std::optional<bool> include_usage,
                        Bool(*options, "include_usage"));
    out.include_usage = include_usage.value_or(false);
  }
  PD_ASSIGN_OR_RETURN(std::optional<std::string> user, String(parsed, "user"));
  (void)user;  // Accepted as OpenAI does; pdserve keeps no per-user state.

  v1::GenerateRequest common;
  common.set_model(out.model);
  PD_RETURN_IF_ERROR(ParseSampling(parsed, chat, common, out));
  if (chat) {
    PD_RETURN_IF_ERROR(ParseMessages(parsed, out));
    out.prompts.push_back(std::move(common));
  } else {
    PD_ASSIGN_OR_RETURN(std::vector<v1::GenerateRequest> prompts,
                        ParsePrompts(parsed));
    for (v1::GenerateRequest& prompt : prompts) {
      v1::GenerateRequest full = common;
      if (prompt.has_text()) {
        full.set_text(prompt.text());
      } else {
        *full.mutable_token_ids() = prompt.token_ids();
      }
      out.prompts.push_back(std::move(full));
    }
  }
  return out;
}

std::string OpenAiParam(const absl::Status& status) {
  const auto param = status.GetPayload(kParamPayload);
  return param ? std::string(*param) : std::string();
}

using PlainJson = nlohmann::json;

OpenAiError MakeOpenAiError(const absl::Status& status) {
  OpenAiError out;
  absl::string_view type = "server_error";
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kFailedPrecondition:
    case absl::StatusCode::kOutOfRange:
      out.http_status = 400;
      type = "invalid_request_error";
      break;
    case absl::StatusCode::kUnauthenticated:
      out.http_status = 401;
      type = "authentication_error";
      break;
    case absl::StatusCode::kPermissionDenied:
      out.http_status = 403;
      type = "permission_error";
      break;
    case absl::StatusCode::kNotFound:
      out.http_status = 404;
      type = "not_found_error";
      break;
    case absl::StatusCode::kResourceExhausted:
      out.http_status = 429;
      type = "rate_limit_error";
      break;
    case absl::StatusCode::kUnavailable:
      out.http_status = 503;
      type = "service_unavailable";
      break;
    case absl::StatusCode::kDeadlineExceeded:
      out.http_status = 504;
      type = "timeout";
      break;
    case absl::StatusCode::kCancelled:
      out.http_status = 499;
      type = "cancelled";
      break;
    default:
      out.http_status = 500;
      break;
  }
  const std::string param = OpenAiParam(status);
  PlainJson error = {{"message", std::string(status.message())},
                {"type", type},
                {"param", param.empty() ? PlainJson(nullptr) : PlainJson(param)},
                {"code", status.code() == absl::StatusCode::kNotFound
                             ? PlainJson("model_not_found")
                             : PlainJson(nullptr)}};
  out.body = DumpJson({{"error", std::move(error)}});
  return out;
}

std::string DumpJson(const PlainJson& value) {
  return value.dump(-1, ' ', false, PlainJson::error_handler_t::replace);
}

}  // namespace pdserve
