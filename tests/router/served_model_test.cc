// Request validation: every bad request the public API lists is
// INVALID_ARGUMENT with a message naming the problem; good requests come out
// tokenized with their defaults.
#include "router/served_model.h"

#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "engine/model_files/llama2c.h"
#include "engine/model_files/model_info.h"
#include "gtest/gtest.h"

namespace pdserve {
namespace {

std::shared_ptr<const ServedModel> Tiny() {
  static auto* model = new std::shared_ptr<const ServedModel>(
      ServedModel::FromInfo("tiny", *LoadModelInfo("builtin:tiny")));
  return *model;
}

v1::GenerateRequest Base() {
  v1::GenerateRequest r;
  r.set_text("hello");
  r.set_max_tokens(4);
  return r;
}

TEST(ServedModelTest, LoadsFromClusterConfig) {
  internal::v1::ClusterConfig config;
  config.set_model("builtin:tiny");
  auto model = ServedModel::Load(config);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ((*model)->name(), "builtin:tiny");
  EXPECT_EQ((*model)->context_length(), 4096);
  EXPECT_EQ((*model)->vocab_size(), 258);
  config.set_served_model_name("my-model");
  EXPECT_EQ((*ServedModel::Load(config))->name(), "my-model");
  config.set_model("/no/such/model/dir");
  EXPECT_FALSE(ServedModel::Load(config).ok());
}

// The router reads a model's files but not its weights: a directory that
// has none (or only corrupt ones) serves as well as a whole one.
TEST(ServedModelTest, LoadsWithoutReadingWeights) {
  namespace fs = std::filesystem;
  const fs::path src = fs::path(PDSERVE_MODELS_DIR) / "stories260K";
  const fs::path dir = fs::path(testing::TempDir()) / "served-no-weights";
  fs::remove_all(dir);
  ASSERT_TRUE(
      ConvertLlama2cToHf(src / "stories260K.bin", src / "tok512.bin", dir)
          .ok());
  fs::copy_file(src / "chat_template.jinja", dir / "chat_template.jinja");
  internal::v1::ClusterConfig config;
  config.set_model(dir.string());
  for (const char* weights : {"", "garbage"}) {
    fs::remove(dir / "model.safetensors");
    if (*weights != '\0') {
      std::ofstream(dir / "model.safetensors", std::ios::binary) << weights;
    }
    auto model = ServedModel::Load(config);
    ASSERT_TRUE(model.ok()) << model.status();
    EXPECT_EQ((*model)->name(), "served-no-weights");
    EXPECT_EQ((*model)->context_length(), 512);
    EXPECT_EQ((*model)->vocab_size(), 512);
    EXPECT_TRUE((*model)->has_chat_template());
    v1::GenerateRequest r = Base();
    auto v = ValidateGenerateRequest(r, **model);
    ASSERT_TRUE(v.ok()) << v.status();
    EXPECT_EQ(v->engine.prompt.front(), 1);  // BOS of the model's tokenizer.
    auto chat = (*model)->RenderChat(
        nlohmann::ordered_json::parse(R"([{"role": "user", "content": "Hi"}])"),
        nullptr, true, nlohmann::ordered_json::object());
    EXPECT_TRUE(chat.ok()) << chat.status();
  }
}

TEST(ValidateGenerateRequestTest, TextIsTokenizedWithBosAndDefaults) {
  v1::GenerateRequest r;
  r.set_text("hi");
  auto v = ValidateGenerateRequest(r, *Tiny());
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->engine.prompt, (std::vector<int32_t>{256, 'h', 'i'}));
  EXPECT_EQ(v->engine.sampling.max_tokens, 16);
  EXPECT_EQ(v->engine.sampling.temperature, 1.0f);
  EXPECT_EQ(v->engine.sampling.top_p, 1.0f);
  EXPECT_FALSE(v->engine.sampling.seed.has_value());
  EXPECT_TRUE(v->skip_special_tokens);

  r.set_add_special_tokens(false);
  r.set_model("tiny");
  r.mutable_sampling()->set_temperature(0);
  r.mutable_sampling()->set_seed(7);
  r.add_stop("\n");
  r.set_skip_special_tokens(false);
  v = ValidateGenerateRequest(r, *Tiny());
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->engine.prompt, (std::vector<int32_t>{'h', 'i'}));
  EXPECT_EQ(v->engine.sampling.temperature, 0.0f);
  EXPECT_EQ(v->engine.sampling.seed, 7u);
  EXPECT_EQ(v->stop_strings, std::vector<std::string>{"\n"});
  EXPECT_FALSE(v->skip_special_tokens);
}

TEST(ValidateGenerateRequestTest, TokenIdsAreUsedAsGiven) {
  v1::GenerateRequest r;
  for (int id : {1, 2, 257}) r.mutable_token_ids()->add_ids(id);
  auto v = ValidateGenerateRequest(r, *Tiny());
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->engine.prompt, (std::vector<int32_t>{1, 2, 257}));
}

TEST(ValidateGenerateRequestTest, ContextLimitIsExact) {
  v1::GenerateRequest r;
  for (int i = 0; i < 4000; ++i) r.mutable_token_ids()->add_ids(65);
  r.set_max_tokens(96);
  EXPECT_TRUE(ValidateGenerateRequest(r, *Tiny()).ok());
  r.set_max_tokens(97);
  EXPECT_FALSE(ValidateGenerateRequest(r, *Tiny()).ok());
}

struct BadCase {
  std::string name;
  std::function<void(v1::GenerateRequest&)> edit;
  std::string message_part;
};

TEST(ValidateGenerateRequestTest, EveryBadInputIsInvalidArgumentWithAMessage) {
  const std::vector<BadCase> cases = {
      {"no prompt", [](auto& r) { r.clear_text(); }, "no prompt"},
      {"empty text",
       [](auto& r) {
         r.set_text("");
         r.set_add_special_tokens(false);
       },
       "empty"},
      {"empty ids", [](auto& r) { r.mutable_token_ids(); }, "empty"},
      {"invalid UTF-8",
       [](auto& r) { r.set_text(std::string("ab\xff\xfe", 4)); }, "UTF-8"},
      {"truncated UTF-8", [](auto& r) { r.set_text("caf\xC3"); }, "UTF-8"},
      {"id too large", [](auto& r) { r.mutable_token_ids()->add_ids(258); },
       "token_ids[0] = 258"},
      {"negative id",
       [](auto& r) {
         r.mutable_token_ids()->add_ids(5);
         r.mutable_token_ids()->add_ids(-1);
       },
       "token_ids[1] = -1"},
      {"unknown model", [](auto& r) { r.set_model("gpt-17"); },
       "unknown model 'gpt-17'"},
      {"max_tokens 0", [](auto& r) { r.set_max_tokens(0); }, "max_tokens"},
      {"max_tokens huge", [](auto& r) { r.set_max_tokens(4000000000u); },
       "context"},
      {"prompt too long", [](auto& r) { r.set_text(std::string(5000, 'a')); },
       "context of 4096"},
      {"temperature < 0",
       [](auto& r) { r.mutable_sampling()->set_temperature(-1); },
       "temperature"},
      {"temperature NaN",
       [](auto& r) { r.mutable_sampling()->set_temperature(NAN); },
       "temperature"},
      {"top_p 0", [](auto& r) { r.mutable_sampling()->set_top_p(0); }, "top_p"},
      {"top_p > 1", [](auto& r) { r.mutable_sampling()->set_top_p(1.5f); },
       "top_p"},
      {"top_k < 0", [](auto& r) { r.mutable_sampling()->set_top_k(-3); },
       "top_k"},
      {"min_p > 1", [](auto& r) { r.mutable_sampling()->set_min_p(2); },
       "min_p"},
      {"logprobs 21", [](auto& r) { r.set_logprobs(21); }, "logprobs"},
      {"stop id outside vocab", [](auto& r) { r.add_stop_token_ids(99999); },
       "stop_token_ids"},
      {"17 stop strings",
       [](auto& r) {
         for (int i = 0; i < 17; ++i) r.add_stop("s");
       },
       "at most 16"},
      {"empty stop string",
       [](auto& r) {
         r.add_stop("ok");
         r.add_stop("");
       },
       "stop[1] is empty"},
      {"long stop string", [](auto& r) { r.add_stop(std::string(257, 'x')); },
       "257 bytes"},
      {"stop not UTF-8", [](auto& r) { r.add_stop("\xC3"); },
       "stop[0] is not valid UTF-8"},
      {"n 0", [](auto& r) { r.set_n(0); }, "n must be in [1, 16], got 0"},
      {"n 17", [](auto& r) { r.set_n(17); }, "n must be in [1, 16], got 17"},
      {"prompt_logprobs 21", [](auto& r) { r.set_prompt_logprobs(21); },
       "prompt_logprobs must be in [0, 20], got 21"},
      {"presence_penalty 3",
       [](auto& r) { r.mutable_sampling()->set_presence_penalty(3); },
       "presence_penalty must be in [-2, 2], got 3"},
      {"frequency_penalty NaN",
       [](auto& r) { r.mutable_sampling()->set_frequency_penalty(NAN); },
       "frequency_penalty"},
      {"repetition_penalty 0",
       [](auto& r) { r.mutable_sampling()->set_repetition_penalty(0); },
       "repetition_penalty must be in (0, 10], got 0"},
      {"repetition_penalty 11",
       [](auto& r) { r.mutable_sampling()->set_repetition_penalty(11); },
       "repetition_penalty"},
      {"logit_bias id outside vocab",
       [](auto& r) { (*r.mutable_sampling()->mutable_logit_bias())[258] = 1; },
       "logit_bias: token id 258 is outside the vocabulary [0, 258)"},
      {"logit_bias value 101",
       [](auto& r) { (*r.mutable_sampling()->mutable_logit_bias())[3] = 101; },
       "logit_bias of token 3 must be in [-100, 100], got 101"},
      {"301 logit_bias entries",
       [](auto& r) {
         for (int i = 0; i < 301; ++i) {
           (*r.mutable_sampling()
                 ->mutable_logit_bias())[i % 258 - (i / 258) * 1000] = 1;
         }
       },
       "logit_bias has 301 entries; at most 300"},
  };
  for (const BadCase& c : cases) {
    v1::GenerateRequest r = Base();
    c.edit(r);
    auto v = ValidateGenerateRequest(r, *Tiny());
    ASSERT_FALSE(v.ok()) << c.name;
    EXPECT_EQ(v.status().code(), absl::StatusCode::kInvalidArgument) << c.name;
    EXPECT_NE(v.status().message().find(c.message_part), std::string::npos)
        << c.name << ": '" << v.status().message() << "' lacks '"
        << c.message_part << "'";
  }
}

TEST(ValidateGenerateRequestTest, LimitsThemselvesAreAccepted) {
  v1::GenerateRequest r = Base();
  for (int i = 0; i < 16; ++i) r.add_stop(std::string(256, 'a' + i));
  r.set_logprobs(20);
  r.set_n(16);
  r.set_prompt_logprobs(20);
  v1::SamplingParams* s = r.mutable_sampling();
  s->set_presence_penalty(-2);
  s->set_frequency_penalty(2);
  s->set_repetition_penalty(10);
  for (int i = 0; i < 258; ++i)
    (*s->mutable_logit_bias())[i] = i % 2 ? 100 : -100;
  auto v = ValidateGenerateRequest(r, *Tiny());
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->n, 16u);
  EXPECT_EQ(v->engine.sampling.prompt_logprobs, 20);
  EXPECT_EQ(v->engine.sampling.repetition_penalty, 10.0f);
  ASSERT_EQ(v->engine.sampling.logit_bias.size(), 258u);
  for (const auto& [id, bias] : v->engine.sampling.logit_bias) {
    EXPECT_EQ(bias, id % 2 ? 100.0f : -100.0f) << id;
  }
}

TEST(ValidateGenerateRequestTest, NewFieldsDefaultToNoEffect) {
  auto v = ValidateGenerateRequest(Base(), *Tiny());
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->n, 1u);
  EXPECT_FALSE(v->engine.sampling.prompt_logprobs.has_value());
  EXPECT_EQ(v->engine.sampling.presence_penalty, 0.0f);
  EXPECT_EQ(v->engine.sampling.frequency_penalty, 0.0f);
  EXPECT_EQ(v->engine.sampling.repetition_penalty, 1.0f);
  EXPECT_TRUE(v->engine.sampling.logit_bias.empty());
}

TEST(DefaultServedModelNameTest, IsTheDirectorysBaseName) {
  EXPECT_EQ(DefaultServedModelName("/models/Llama-3.1-8B-Instruct"),
            "Llama-3.1-8B-Instruct");
  EXPECT_EQ(DefaultServedModelName("/models/Qwen3-0.6B/"), "Qwen3-0.6B");
  EXPECT_EQ(DefaultServedModelName("build/models/stories260K"), "stories260K");
  EXPECT_EQ(DefaultServedModelName("stories260K"), "stories260K");
  EXPECT_EQ(DefaultServedModelName("builtin:tiny"), "builtin:tiny");
}

}  // namespace
}  // namespace pdserve
