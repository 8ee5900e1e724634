#include "engine/chat/chat_template.h"

#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "engine/chat/jinja_interpreter.h"
#include "engine/chat/jinja_parser.h"
#include "engine/chat/jinja_value.h"

namespace pdserve {

namespace {

using jinja::Value;
using OJson = nlohmann::ordered_json;

// Python's datetime.now().strftime(fmt) for `now` in the local time zone.
std::string StrftimeLocal(absl::Time now, std::string_view format) {
  const std::tm tm = absl::ToTM(now, absl::LocalTimeZone());
  const std::string fmt(format);
  if (fmt.empty()) return "";
  std::vector<char> buf(256 + fmt.size() * 8);
  for (int attempt = 0; attempt < 4; ++attempt) {
    const size_t n = std::strftime(buf.data(), buf.size(), fmt.c_str(), &tm);
    if (n > 0) return std::string(buf.data(), n);
    buf.resize(buf.size() * 4);
  }
  return "";
}

// apply_chat_template's normalization: null-valued keys dropped, then
// _alias_reasoning_fields: {"thinking": r, **message, "reasoning_content": r}
// where r is the first non-null of reasoning_content, thinking, reasoning.
absl::StatusOr<Value> NormalizeMessages(const OJson& messages) {
  if (!messages.is_array()) return absl::InvalidArgumentError("messages must be an array");
  if (messages.empty()) {
    return absl::InvalidArgumentError(
        "Cannot apply chat template to an empty conversation. Provide at least one message.");
  }
  jinja::ValueList out;
  for (const OJson& m : messages) {
    if (!m.is_object()) {
      return absl::InvalidArgumentError("Chat messages should be dicts (JSON objects)");
    }
    OJson msg = OJson::object();
    for (const auto& [k, v] : m.items()) {
      if (!v.is_null()) msg[k] = v;
    }
    const OJson* reasoning = nullptr;
    for (const char* key : {"reasoning_content", "thinking", "reasoning"}) {
      auto it = msg.find(key);
      if (it != msg.end() && !it->is_null()) {
        reasoning = &*it;
        break;
      }
    }
    if (reasoning != nullptr) {
      const OJson r = *reasoning;
      OJson aliased = OJson::object();
      aliased["thinking"] = r;
      for (const auto& [k, v] : msg.items()) aliased[k] = v;
      aliased["reasoning_content"] = r;
      msg = std::move(aliased);
    }
    out.push_back(Value::FromJson(msg));
  }
  return Value::List(std::move(out));
}

absl::StatusOr<std::string> ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", path.string()));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

absl::StatusOr<std::optional<std::string>> TokenString(const OJson& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end() || it->is_null()) return std::optional<std::string>();
  if (it->is_string()) return std::optional<std::string>(it->get<std::string>());
  if (it->is_object()) {
    auto c = it->find("content");
    if (c != it->end() && c->is_string()) return std::optional<std::string>(c->get<std::string>());
  }
  return absl::InvalidArgumentError(
      absl::StrCat("tokenizer_config.json: '", key, "' must be a string or {\"content\": ...}"));
}

absl::StatusOr<std::optional<std::string>> TemplateField(const OJson& config, const std::string& file) {
  auto it = config.find("chat_template");
  if (it == config.end() || it->is_null()) return std::optional<std::string>();
  if (it->is_string()) return std::optional<std::string>(it->get<std::string>());
  if (it->is_array()) {
    for (const OJson& entry : *it) {
      if (!entry.is_object() || !entry.contains("name") || !entry.contains("template") ||
          !entry["name"].is_string() || !entry["template"].is_string()) {
        return absl::InvalidArgumentError(
            absl::StrCat(file, ": chat_template list entries must be {name, template} strings"));
      }
      if (entry["name"] == "default") return std::optional<std::string>(entry["template"].get<std::string>());
    }
    return absl::InvalidArgumentError(absl::StrCat(file, ": chat_template list has no \"default\""));
  }
  return absl::InvalidArgumentError(absl::StrCat(file, ": chat_template must be a string or a list"));
}

}  // namespace

ChatTemplate::ChatTemplate(std::string source, ChatTemplateTokens tokens, ChatTemplateLimits limits,
                           std::unique_ptr<jinja::Program> program)
    : source_(std::move(source)),
      tokens_(std::move(tokens)),
      limits_(limits),
      program_(std::move(program)) {}

ChatTemplate::~ChatTemplate() = default;

absl::StatusOr<std::unique_ptr<ChatTemplate>> ChatTemplate::Parse(std::string_view source,
                                                                 ChatTemplateTokens tokens,
                                                                 ChatTemplateLimits limits) {
  if (!jinja::IsValidUtf8(source)) {
    return absl::InvalidArgumentError("chat template is not valid UTF-8");
  }
  auto program = jinja::ParseTemplate(source);
  if (!program.ok()) return program.status();
  return std::unique_ptr<ChatTemplate>(
      new ChatTemplate(std::string(source), std::move(tokens), limits, std::move(*program)));
}

absl::StatusOr<std::string> ChatTemplate::Render(const RenderRequest& request) const {
  auto messages = NormalizeMessages(request.messages);
  if (!messages.ok()) return messages.status();
  if (!request.tools.is_null()) {
    if (!request.tools.is_array()) return absl::InvalidArgumentError("tools must be null or an array");
    for (const OJson& t : request.tools) {
      if (!t.is_object()) return absl::InvalidArgumentError("Tools should be JSON objects (schemas)");
    }
  }
  if (!request.documents.is_null()) {
    if (!request.documents.is_array()) {
      return absl::InvalidArgumentError("documents must be null or an array");
    }
    for (const OJson& d : request.documents) {
      if (!d.is_object()) {
        return absl::InvalidArgumentError("Documents should be a list of dicts with 'title' and 'text' keys!");
      }
    }
  }
  if (!request.kwargs.is_null() && !request.kwargs.is_object()) {
    return absl::InvalidArgumentError("chat template kwargs must be null or an object");
  }

  jinja::RenderInputs inputs;
  auto& vars = inputs.variables;
  vars.emplace_back("messages", *messages);
  vars.emplace_back("tools", Value::FromJson(request.tools));
  vars.emplace_back("documents", Value::FromJson(request.documents));
  vars.emplace_back("add_generation_prompt", Value::Bool(request.add_generation_prompt));
  const std::pair<const char*, const std::optional<std::string>*> tokens[] = {
      {"bos_token", &tokens_.bos_token},
      {"eos_token", &tokens_.eos_token},
      {"unk_token", &tokens_.unk_token},
      {"pad_token", &tokens_.pad_token}};
  for (const auto& [name, value] : tokens) {
    if (value->has_value()) vars.emplace_back(name, Value::String(**value));
  }
  if (request.kwargs.is_object()) {
    for (const auto& [k, v] : request.kwargs.items()) {
      if (k == "messages" || k == "tools" || k == "documents" || k == "add_generation_prompt") {
        return absl::InvalidArgumentError(
            absl::StrCat("chat template kwargs may not set '", k, "' (a render argument)"));
      }
      vars.emplace_back(k, Value::FromJson(v));
    }
  }
  const absl::Time now = request.now.value_or(absl::Now());
  inputs.strftime_now = [now](std::string_view format) { return StrftimeLocal(now, format); };

  jinja::RenderLimits limits;
  limits.max_output_bytes = limits_.max_output_bytes;
  limits.max_call_depth = limits_.max_call_depth;
  limits.max_steps = limits_.max_steps;
  return jinja::RenderProgram(*program_, inputs, limits);
}

absl::StatusOr<std::optional<ChatTemplateSource>> LoadChatTemplate(const std::string& model_dir) {
  namespace fs = std::filesystem;
  const fs::path dir(model_dir);
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return absl::NotFoundError(absl::StrCat("no directory ", model_dir));

  ChatTemplateSource out;
  bool have_config = false;
  OJson config;
  const fs::path config_path = dir / "tokenizer_config.json";
  if (fs::exists(config_path, ec)) {
    auto text = ReadFile(config_path);
    if (!text.ok()) return text.status();
    config = OJson::parse(*text, nullptr, /*allow_exceptions=*/false);
    if (config.is_discarded() || !config.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(config_path.string(), ": not a JSON object"));
    }
    have_config = true;
    const std::pair<const char*, std::optional<std::string>*> fields[] = {
        {"bos_token", &out.tokens.bos_token},
        {"eos_token", &out.tokens.eos_token},
        {"unk_token", &out.tokens.unk_token},
        {"pad_token", &out.tokens.pad_token}};
    for (const auto& [key, slot] : fields) {
      auto t = TokenString(config, key);
      if (!t.ok()) return t.status();
      *slot = std::move(*t);
    }
  }

  const fs::path jinja_path = dir / "chat_template.jinja";
  if (fs::exists(jinja_path, ec)) {
    auto text = ReadFile(jinja_path);
    if (!text.ok()) return text.status();
    out.source = std::move(*text);
    out.origin = jinja_path.string();
    return std::optional<ChatTemplateSource>(std::move(out));
  }
  const fs::path json_path = dir / "chat_template.json";
  if (fs::exists(json_path, ec)) {
    auto text = ReadFile(json_path);
    if (!text.ok()) return text.status();
    OJson j = OJson::parse(*text, nullptr, false);
    if (j.is_discarded() || !j.is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(json_path.string(), ": not a JSON object"));
    }
    auto t = TemplateField(j, json_path.string());
    if (!t.ok()) return t.status();
    if (t->has_value()) {
      out.source = std::move(**t);
      out.origin = json_path.string();
      return std::optional<ChatTemplateSource>(std::move(out));
    }
  }
  if (have_config) {
    auto t = TemplateField(config, config_path.string());
    if (!t.ok()) return t.status();
    if (t->has_value()) {
      out.source = std::move(**t);
      out.origin = config_path.string();
      return std::optional<ChatTemplateSource>(std::move(out));
    }
  }
  return std::optional<ChatTemplateSource>();
}

}  // namespace pdserve
