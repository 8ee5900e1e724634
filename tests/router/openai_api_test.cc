// The OpenAI wire formats: every accepted parameter lands in the
// GenerateRequest field it names, bad input is a 400 naming the field, and
// responses have the shape the OpenAI reference documents (the official
// client's own checks are in tests/openai/).
#include "router/openai_api.h"

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace pdserve {
namespace {

using nlohmann::json;

OpenAiRequest ParseOk(OpenAiEndpoint endpoint, const std::string& body) {
  absl::StatusOr<OpenAiRequest> parsed = ParseOpenAiRequest(endpoint, body);
  EXPECT_TRUE(parsed.ok()) << parsed.status();
  return parsed.ok() ? *std::move(parsed) : OpenAiRequest{};
}

TEST(OpenAiApiTest, CompletionParametersMapToTheRequest) {
  const OpenAiRequest r = ParseOk(OpenAiEndpoint::kCompletions, R"({
    "model": "m", "prompt": "Hello", "max_tokens": 7, "temperature": 0.5,
    "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 42, "stop": ["a", "b"],
    "n": 3, "logprobs": 2, "echo": true, "presence_penalty": 0.5,
    "frequency_penalty": -0.5, "repetition_penalty": 1.2,
    "logit_bias": {"5": -100, "17": 2.5}, "ignore_eos": true, "user": "u",
    "stop_token_ids": [9], "skip_special_tokens": false,
    "stream": true, "stream_options": {"include_usage": true},
    "priority": -3, "some_future_field": {"ignored": true}})");
  ASSERT_EQ(r.prompts.size(), 1u);
  const v1::GenerateRequest& g = r.prompts[0];
  EXPECT_EQ(r.model, "m");
  EXPECT_EQ(g.priority(), -3);
  EXPECT_EQ(g.text(), "Hello");
  EXPECT_EQ(g.max_tokens(), 7u);
  EXPECT_FLOAT_EQ(g.sampling().temperature(), 0.5f);
  EXPECT_FLOAT_EQ(g.sampling().top_p(), 0.9f);
  EXPECT_EQ(g.sampling().top_k(), 40);
  EXPECT_FLOAT_EQ(g.sampling().min_p(), 0.05f);
  EXPECT_EQ(g.sampling().seed(), 42u);
  EXPECT_FLOAT_EQ(g.sampling().presence_penalty(), 0.5f);
  EXPECT_FLOAT_EQ(g.sampling().frequency_penalty(), -0.5f);
  EXPECT_FLOAT_EQ(g.sampling().repetition_penalty(), 1.2f);
  EXPECT_FLOAT_EQ(g.sampling().logit_bias().at(5), -100.0f);
  EXPECT_FLOAT_EQ(g.sampling().logit_bias().at(17), 2.5f);
  EXPECT_EQ(g.stop_size(), 2);
  EXPECT_EQ(g.stop_token_ids(0), 9);
  EXPECT_TRUE(g.ignore_eos());
  EXPECT_FALSE(g.skip_special_tokens());
  EXPECT_TRUE(g.add_special_tokens());
  EXPECT_EQ(g.n(), 3u);
  EXPECT_EQ(r.n, 3u);
  EXPECT_EQ(g.logprobs(), 2u);
  EXPECT_EQ(g.prompt_logprobs(), 2u);  // echo + logprobs
  EXPECT_TRUE(r.echo);
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
  EXPECT_FALSE(r.max_tokens_from_context);
}

TEST(OpenAiApiTest, PromptFormsAndDefaults) {
  OpenAiRequest r = ParseOk(OpenAiEndpoint::kCompletions,
                            R"({"prompt": ["a", "b"]})");
  ASSERT_EQ(r.prompts.size(), 2u);
  EXPECT_EQ(r.prompts[1].text(), "b");
  EXPECT_FALSE(r.prompts[0].has_max_tokens());  // The gRPC default, 16.
  EXPECT_FALSE(r.prompts[0].sampling().has_temperature());

  r = ParseOk(OpenAiEndpoint::kCompletions, R"({"prompt": [1, 2, 3]})");
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_EQ(r.prompts[0].token_ids().ids_size(), 3);

  // A token-id prompt is one prompt, longer than the 64 prompts a list may
  // hold.
  json long_prompt = {{"prompt", std::vector<int>(300, 97)}};
  r = ParseOk(OpenAiEndpoint::kCompletions, long_prompt.dump());
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_EQ(r.prompts[0].token_ids().ids_size(), 300);

  r = ParseOk(OpenAiEndpoint::kCompletions, R"({"prompt": [[1], [2, 3]]})");
  ASSERT_EQ(r.prompts.size(), 2u);
  EXPECT_EQ(r.prompts[1].token_ids().ids(1), 3);

  // vLLM's top_k -1 is "all tokens"; max_completion_tokens wins.
  r = ParseOk(OpenAiEndpoint::kCompletions,
              R"({"prompt": "x", "top_k": -1, "max_completion_tokens": 3,
                  "max_tokens": 9})");
  EXPECT_EQ(r.prompts[0].sampling().top_k(), 0);
  EXPECT_EQ(r.prompts[0].max_tokens(), 3u);
}

TEST(OpenAiApiTest, ChatParameters) {
  const OpenAiRequest r = ParseOk(OpenAiEndpoint::kChatCompletions, R"({
    "model": "m",
    "messages": [{"role": "system", "content": "s"},
                 {"role": "user", "content": [{"type": "text", "text": "u"}]}],
    "logprobs": true, "top_logprobs": 3, "tools": [{"type": "function",
    "function": {"name": "f"}}], "chat_template_kwargs": {"enable_thinking":
    false}, "add_generation_prompt": false})");
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_EQ(r.messages.size(), 2u);
  EXPECT_EQ(r.tools.size(), 1u);
  EXPECT_FALSE(r.add_generation_prompt);
  EXPECT_EQ(r.chat_template_kwargs["enable_thinking"], false);
  EXPECT_EQ(r.logprobs, 3u);
  EXPECT_EQ(r.prompts[0].logprobs(), 3u);
  EXPECT_FALSE(r.prompts[0].add_special_tokens());  // The template's job.
  EXPECT_TRUE(r.max_tokens_from_context);
}

struct BadCase {
  OpenAiEndpoint endpoint;
  std::string body;
  std::string param;
};

TEST(OpenAiApiTest, BadInputIsInvalidArgumentNamingTheField) {
  const OpenAiEndpoint c = OpenAiEndpoint::kCompletions;
  const OpenAiEndpoint chat = OpenAiEndpoint::kChatCompletions;
  const BadCase cases[] = {
      {c, "{not json", ""},
      {c, "[1, 2]", ""},
      {c, "\xff\xfe{}", ""},
      {c, R"({"prompt": "x", "max_tokens": "ten"})", "max_tokens"},
      {c, R"({"prompt": "x", "max_tokens": 0})", "max_tokens"},
      {c, R"({"prompt": "x", "max_tokens": 1.5})", "max_tokens"},
      {c, R"({"prompt": "x", "temperature": -1})", "temperature"},
      {c, R"({"prompt": "x", "temperature": "hot"})", "temperature"},
      {c, R"({"prompt": "x", "top_p": 0})", "top_p"},
      {c, R"({"prompt": "x", "top_k": -2})", "top_k"},
      {c, R"({"prompt": "x", "n": 0})", "n"},
      {c, R"({"prompt": "x", "n": 17})", "n"},
      {c, R"({"prompt": "x", "logprobs": 21})", "logprobs"},
      {c, R"({"prompt": "x", "stop": 5})", "stop"},
      {c, R"({"prompt": "x", "stop": ["a", 1]})", "stop"},
      {c, R"({"prompt": "x", "logit_bias": {"a": 1}})", "logit_bias"},
      {c, R"({"prompt": "x", "logit_bias": {"1": 101}})", "logit_bias"},
      {c, R"({"prompt": "x", "presence_penalty": 3})", "presence_penalty"},
      {c, R"({"prompt": "x", "repetition_penalty": 0})", "repetition_penalty"},
      {c, R"({"prompt": "x", "stream": "yes"})", "stream"},
      {c, R"({"prompt": "x", "model": 7})", "model"},
      {c, R"({})", "prompt"},
      {c, R"({"prompt": []})", "prompt"},
      {c, R"({"prompt": [1, -1]})", "prompt"},
      {c, R"({"prompt": ["a", [1]]})", "prompt"},
      {c, R"({"prompt": {"a": 1}})", "prompt"},
      {chat, R"({"messages": []})", "messages"},
      {chat, R"({"messages": [{"content": "no role"}]})", "messages"},
      {chat, R"({"messages": [{"role": "user", "content": 5}]})", "messages"},
      {chat,
       R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})",
       "messages"},
      {chat, R"({"messages": [{"role": "user", "content": "x"}],
                "top_logprobs": 2})",
       "top_logprobs"},
      {chat, R"({"messages": [{"role": "user", "content": "x"}],
                "chat_template_kwargs": []})",
       "chat_template_kwargs"},
  };
  for (const BadCase& bad : cases) {
    absl::StatusOr<OpenAiRequest> parsed =
        ParseOpenAiRequest(bad.endpoint, bad.body);
    ASSERT_FALSE(parsed.ok()) << bad.body;
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument)
        << bad.body;
    EXPECT_EQ(OpenAiParam(parsed.status()), bad.param) << bad.body;
    const OpenAiError error = MakeOpenAiError(parsed.status());
    EXPECT_EQ(error.http_status, 400);
    const json body = json::parse(error.body);
    EXPECT_EQ(body["error"]["type"], "invalid_request_error");
    EXPECT_FALSE(body["error"]["message"].get<std::string>().empty());
  }
}

TEST(OpenAiApiTest, ErrorStatusesFollowTheCode) {
  EXPECT_EQ(MakeOpenAiError(absl::UnauthenticatedError("k")).http_status, 401);
  EXPECT_EQ(MakeOpenAiError(absl::NotFoundError("m")).http_status, 404);
  EXPECT_EQ(json::parse(MakeOpenAiError(absl::NotFoundError("m")).body)
                ["error"]["code"],
            "model_not_found");
  EXPECT_EQ(MakeOpenAiError(absl::ResourceExhaustedError("q")).http_status,
            429);
  EXPECT_EQ(MakeOpenAiError(absl::UnavailableError("w")).http_status, 503);
  EXPECT_EQ(MakeOpenAiError(absl::InternalError("x")).http_status, 500);
}

v1::GenerateResponse Message(uint32_t index, std::string text,
                             std::vector<int32_t> ids,
                             v1::FinishReason finish = v1::FINISH_REASON_UNSPECIFIED,
                             uint32_t completion_tokens = 0) {
  v1::GenerateResponse m;
  m.set_index(index);
  m.set_text(std::move(text));
  for (int32_t id : ids) {
    m.add_token_ids(id);
    v1::TokenLogprobs* lp = m.add_logprobs();
    lp->set_token_id(id);
    lp->set_logprob(-0.5f);
    v1::TokenLogprob* top = lp->add_top();
    top->set_token_id(id);
    top->set_logprob(-0.5f);
  }
  m.set_finish_reason(finish);
  if (finish != v1::FINISH_REASON_UNSPECIFIED) {
    m.mutable_usage()->set_prompt_tokens(4);
    m.mutable_usage()->set_completion_tokens(completion_tokens);
  }
  return m;
}

TEST(OpenAiApiTest, WholeCompletionWithTwoChoicesAndEcho) {
  const OpenAiRequest r = ParseOk(
      OpenAiEndpoint::kCompletions,
      R"({"model": "m", "prompt": "Hi", "n": 2, "echo": true, "logprobs": 1})");
  OpenAiResponseWriter writer(r, "cmpl-1", 1700000000, nullptr);
  writer.SetPrompt(0, "Hi", {7, 8});
  v1::GenerateResponse first = Message(0, " a", {65});
  v1::TokenLogprobs* p = first.add_prompt_logprobs();
  p->set_token_id(8);
  p->set_logprob(-1.25f);
  writer.Add(0, first);
  writer.Add(0, Message(1, " b", {66}, v1::FINISH_REASON_LENGTH, 1));
  writer.Add(0, Message(0, "c", {67}, v1::FINISH_REASON_STOP, 2));
  const json whole = json::parse(writer.Whole());
  EXPECT_EQ(whole["object"], "text_completion");
  EXPECT_EQ(whole["id"], "cmpl-1");
  EXPECT_EQ(whole["model"], "m");
  ASSERT_EQ(whole["choices"].size(), 2u);
  EXPECT_EQ(whole["choices"][0]["text"], "Hi ac");
  EXPECT_EQ(whole["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(whole["choices"][1]["text"], "Hi b");
  EXPECT_EQ(whole["choices"][1]["finish_reason"], "length");
  // Echo with logprobs: the prompt's tokens come first, the first without.
  const json& lp = whole["choices"][0]["logprobs"];
  ASSERT_EQ(lp["token_logprobs"].size(), 4u);
  EXPECT_TRUE(lp["token_logprobs"][0].is_null());
  EXPECT_FLOAT_EQ(lp["token_logprobs"][1].get<float>(), -1.25f);
  EXPECT_FLOAT_EQ(lp["token_logprobs"][2].get<float>(), -0.5f);
  EXPECT_EQ(lp["tokens"][2], "token_id:65");
  EXPECT_EQ(whole["usage"]["prompt_tokens"], 4);
  EXPECT_EQ(whole["usage"]["completion_tokens"], 3);
  EXPECT_EQ(whole["usage"]["total_tokens"], 7);
}

TEST(OpenAiApiTest, ChatStreamChunks) {
  const OpenAiRequest r = ParseOk(OpenAiEndpoint::kChatCompletions, R"({
      "model": "m", "messages": [{"role": "user", "content": "x"}],
      "stream": true, "stream_options": {"include_usage": true},
      "logprobs": true})");
  OpenAiResponseWriter writer(r, "chatcmpl-1", 1, nullptr);
  const json first = json::parse(writer.StreamChunk(0, Message(0, "He", {1})));
  EXPECT_EQ(first["object"], "chat.completion.chunk");
  EXPECT_EQ(first["choices"][0]["delta"]["role"], "assistant");
  EXPECT_EQ(first["choices"][0]["delta"]["content"], "He");
  EXPECT_EQ(first["choices"][0]["logprobs"]["content"][0]["logprob"], -0.5);
  EXPECT_TRUE(first["choices"][0]["finish_reason"].is_null());
  const json last = json::parse(
      writer.StreamChunk(0, Message(0, "y", {2}, v1::FINISH_REASON_STOP, 2)));
  EXPECT_FALSE(last["choices"][0]["delta"].contains("role"));
  EXPECT_EQ(last["choices"][0]["finish_reason"], "stop");
  const json usage = json::parse(writer.UsageChunk());
  EXPECT_TRUE(usage["choices"].empty());
  EXPECT_EQ(usage["usage"]["completion_tokens"], 2);
  EXPECT_EQ(usage["usage"]["total_tokens"], 6);
}

TEST(OpenAiApiTest, InvalidUtf8InOutputIsReplacedNotFatal) {
  EXPECT_EQ(DumpJson(json{{"t", std::string("a\xff")}}), "{\"t\":\"a\xEF\xBF\xBD\"}");
}

}  // namespace
}  // namespace pdserve
