// libFuzzer target: any bytes as a chat template. Parsing must return a
// status (never crash, hang or leak); a template that parses is rendered
// over a small fixed conversation (with tools, a tool call and a tool
// result) under tight limits, and must again return a status.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "engine/chat/chat_template.h"
#include "nlohmann/json.hpp"

namespace {

const pdserve::ChatTemplate::RenderRequest& Request() {
  static const auto* request = [] {
    auto* r = new pdserve::ChatTemplate::RenderRequest;
    r->messages = nlohmann::ordered_json::parse(R"([
      {"role": "system", "content": "You are terse."},
      {"role": "user", "content": "Weather in Paris? 你好 🌍"},
      {"role": "assistant", "content": null, "tool_calls": [{"id": "call_0001", "type": "function",
        "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
      {"role": "tool", "tool_call_id": "call_0001", "content": "{\"temp\": 21}"},
      {"role": "assistant", "content": "21 degrees.", "reasoning_content": "Read the tool."},
      {"role": "user", "content": [{"type": "text", "text": "Thanks"}]}
    ])");
    r->tools = nlohmann::ordered_json::parse(R"([{"type": "function", "function": {
      "name": "get_weather", "description": "Current weather",
      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                     "required": ["city"]}}}])");
    r->kwargs = {{"enable_thinking", false}};
    r->now = absl::FromUnixSeconds(1700000000);
    return r;
  }();
  return *request;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 64 * 1024) return 0;
  const std::string_view source(reinterpret_cast<const char*>(data), size);
  pdserve::ChatTemplateLimits limits;
  limits.max_output_bytes = 1 << 20;
  limits.max_call_depth = 32;
  limits.max_steps = 200'000;
  auto tmpl = pdserve::ChatTemplate::Parse(source, {.bos_token = "<s>", .eos_token = "</s>"}, limits);
  if (!tmpl.ok()) return 0;
  auto out = (*tmpl)->Render(Request());
  if (out.ok() && out->size() > limits.max_output_bytes) __builtin_trap();
  return 0;
}
