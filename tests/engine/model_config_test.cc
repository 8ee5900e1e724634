// config.json as published for real model families, and the errors for
// configs pdserve cannot serve.
#include "engine/model_files/model_config.h"

#include <filesystem>
#include <fstream>
#include <iterator>

#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace pdserve {
namespace {

// Abridged from the published config.json files.
constexpr char kLlama2_7b[] = R"({
  "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
  "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
  "intermediate_size": 11008, "max_position_embeddings": 4096, "model_type": "llama",
  "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 32,
  "pretraining_tp": 1, "rms_norm_eps": 1e-05, "rope_scaling": null,
  "tie_word_embeddings": false, "torch_dtype": "float16", "vocab_size": 32000})";

constexpr char kLlama31_8b[] = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "bos_token_id": 128000,
  "eos_token_id": [128001, 128008, 128009], "hidden_size": 4096, "intermediate_size": 14336,
  "max_position_embeddings": 131072, "model_type": "llama", "num_attention_heads": 32,
  "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "vocab_size": 128256})";

constexpr char kMistral7b[] = R"({
  "architectures": ["MistralForCausalLM"], "bos_token_id": 1, "eos_token_id": 2,
  "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 32768,
  "model_type": "mistral", "num_attention_heads": 32, "num_hidden_layers": 32,
  "num_key_value_heads": 8, "rms_norm_eps": 1e-05, "rope_theta": 10000.0,
  "sliding_window": 4096, "tie_word_embeddings": false, "torch_dtype": "bfloat16",
  "vocab_size": 32000})";

constexpr char kQwen2_0_5b[] = R"({
  "architectures": ["Qwen2ForCausalLM"], "bos_token_id": 151643, "eos_token_id": 151643,
  "hidden_size": 896, "intermediate_size": 4864, "max_position_embeddings": 32768,
  "max_window_layers": 24, "model_type": "qwen2", "num_attention_heads": 14,
  "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
  "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": true,
  "torch_dtype": "bfloat16", "use_sliding_window": false, "vocab_size": 151936})";

constexpr char kQwen3_0_6b[] = R"({
  "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
  "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
  "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
  "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
  "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null,
  "tie_word_embeddings": true, "torch_dtype": "bfloat16", "use_cache": true,
  "use_sliding_window": false, "vocab_size": 151936})";

TEST(ModelConfigTest, Llama2) {
  auto c = ParseHfConfig(kLlama2_7b);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->architecture, "LlamaForCausalLM");
  EXPECT_EQ(c->num_kv_heads, 32);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kNone);
  EXPECT_FLOAT_EQ(c->rope_theta, 10000.0f);
  EXPECT_EQ(c->torch_dtype, DType::kF16);
  EXPECT_FALSE(c->qkv_bias);
  EXPECT_EQ(c->bos_token_id, 1);
  EXPECT_EQ(c->eos_token_ids, std::vector<int32_t>{2});
}

TEST(ModelConfigTest, Llama31WithLlama3RopeScalingAndSeveralEos) {
  auto c = ParseHfConfig(kLlama31_8b);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->num_kv_heads, 8);
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kLlama3);
  EXPECT_FLOAT_EQ(c->rope_scaling.factor, 8.0f);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_FLOAT_EQ(c->rope_theta, 500000.0f);
  EXPECT_EQ(c->eos_token_ids, (std::vector<int32_t>{128001, 128008, 128009}));
  EXPECT_EQ(c->torch_dtype, DType::kBF16);
}

TEST(ModelConfigTest, MistralSlidingWindowAndQwen2Bias) {
  auto m = ParseHfConfig(kMistral7b);
  ASSERT_TRUE(m.ok()) << m.status();
  EXPECT_EQ(m->sliding_window, 4096);
  EXPECT_FALSE(m->qkv_bias);
  auto q = ParseHfConfig(kQwen2_0_5b);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_TRUE(q->qkv_bias);
  EXPECT_TRUE(q->tie_word_embeddings);
  EXPECT_EQ(q->sliding_window, 0);  // use_sliding_window is false.
  EXPECT_EQ(q->head_dim, 64);
}

TEST(ModelConfigTest, Qwen3HeadNormExplicitHeadDimNoBias) {
  auto c = ParseHfConfig(kQwen3_0_6b);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->architecture, "Qwen3ForCausalLM");
  EXPECT_TRUE(c->qk_norm);
  EXPECT_FALSE(c->qkv_bias);
  EXPECT_EQ(c->head_dim, 128);  // hidden / heads would be 64.
  EXPECT_EQ(c->num_kv_heads, 8);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_FLOAT_EQ(c->rope_theta, 1e6f);
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kNone);
  EXPECT_EQ(c->sliding_window, 0);
  EXPECT_FLOAT_EQ(c->rms_norm_eps, 1e-6f);
  EXPECT_EQ(c->bos_token_id, 151643);
  EXPECT_EQ(c->eos_token_ids, std::vector<int32_t>{151645});
  EXPECT_EQ(c->torch_dtype, DType::kBF16);
  // Llama, Mistral and Qwen2 have no head norm.
  for (const char* other : {kLlama2_7b, kMistral7b, kQwen2_0_5b}) {
    auto o = ParseHfConfig(other);
    ASSERT_TRUE(o.ok()) << o.status();
    EXPECT_FALSE(o->qk_norm) << o->architecture;
  }
}

TEST(ModelConfigTest, Qwen3DefaultsAsTransformersAndHonoursAttentionBias) {
  // model_type only, no head_dim (Qwen3Config's default is 128, whatever
  // hidden / heads is), attention_bias set, a linear rope scaling.
  auto c = ParseHfConfig(
      R"({"model_type": "qwen3", "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "attention_bias": true,
    "rope_scaling": {"rope_type": "linear", "factor": 2.0}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->architecture, "Qwen3ForCausalLM");
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_TRUE(c->qkv_bias);
  EXPECT_TRUE(c->qk_norm);
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kLinear);
  auto again = ParseHfConfig(ToHfConfigJson(*c));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_TRUE(again->qkv_bias);
  EXPECT_EQ(again->head_dim, 128);
}

TEST(ModelConfigTest, HeadNormBelongsToQwen3Only) {
  auto llama = ParseHfConfig(kLlama2_7b);
  ASSERT_TRUE(llama.ok());
  llama->qk_norm = true;  // ToHfConfigJson could not say so.
  EXPECT_EQ(llama->Validate().code(), absl::StatusCode::kInvalidArgument);
  auto qwen3 = ParseHfConfig(kQwen3_0_6b);
  ASSERT_TRUE(qwen3.ok());
  qwen3->qk_norm = false;
  EXPECT_EQ(qwen3->Validate().code(), absl::StatusCode::kInvalidArgument);
  qwen3->qk_norm = true;
  qwen3->sliding_window = 4096;
  const absl::Status s = qwen3->Validate();
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("sliding_window"), std::string::npos) << s;
}

TEST(ModelConfigTest, Transformers5SpellingWithRopeParameters) {
  auto c = ParseHfConfig(
      R"({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
    "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "dtype": "bfloat16",
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
      "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->head_dim, 32);  // Explicit, not hidden / heads.
  EXPECT_EQ(c->torch_dtype, DType::kBF16);
  EXPECT_FLOAT_EQ(c->rope_theta, 500000.0f);
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kLlama3);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 32);
}

TEST(ModelConfigTest, RoundTripsThroughToHfConfigJson) {
  for (const char* text :
       {kLlama2_7b, kLlama31_8b, kMistral7b, kQwen2_0_5b, kQwen3_0_6b}) {
    auto c = ParseHfConfig(text);
    ASSERT_TRUE(c.ok());
    auto again = ParseHfConfig(ToHfConfigJson(*c));
    ASSERT_TRUE(again.ok()) << again.status();
    EXPECT_EQ(ToHfConfigJson(*again), ToHfConfigJson(*c));
  }
}

TEST(ModelConfigTest, GenerationConfigOverridesEos) {
  auto c = ParseHfConfig(kLlama2_7b);
  ASSERT_TRUE(c.ok());
  ASSERT_TRUE(ApplyGenerationConfig(
                  R"({"eos_token_id": [2, 7], "bos_token_id": 1})", *c)
                  .ok());
  EXPECT_EQ(c->eos_token_ids, (std::vector<int32_t>{2, 7}));
  EXPECT_EQ(ApplyGenerationConfig(R"({"eos_token_id": 99999})", *c).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(c->eos_token_ids,
            (std::vector<int32_t>{2, 7}));  // Unchanged on error.
  EXPECT_EQ(ApplyGenerationConfig("[", *c).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(ModelConfigTest, Qwen2SlidingWindowOnlyWhenEveryLayerSlides) {
  const std::string base =
      R"({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 100,
    "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
    "sliding_window": 256)";
  auto on = ParseHfConfig(
      base + R"(, "use_sliding_window": true, "max_window_layers": 0})");
  ASSERT_TRUE(on.ok()) << on.status();
  EXPECT_EQ(on->sliding_window, 256);
  // transformers slides only from layer max_window_layers (default 28) on.
  auto none = ParseHfConfig(base + R"(, "use_sliding_window": true})");
  ASSERT_TRUE(none.ok()) << none.status();
  EXPECT_EQ(none->sliding_window, 0);
  auto listed =
      ParseHfConfig(base + R"(, "use_sliding_window": true, "layer_types":
    ["sliding_attention", "sliding_attention", "sliding_attention", "sliding_attention"]})");
  ASSERT_TRUE(listed.ok()) << listed.status();
  EXPECT_EQ(listed->sliding_window, 256);
  auto mixed = ParseHfConfig(
      base + R"(, "use_sliding_window": true, "max_window_layers": 2})");
  EXPECT_EQ(mixed.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(mixed.status().message().find("2 of 4 layers"), std::string::npos)
      << mixed.status();
  auto off = ParseHfConfig(
      base + R"(, "use_sliding_window": false, "max_window_layers": 0})");
  ASSERT_TRUE(off.ok());
  EXPECT_EQ(off->sliding_window, 0);
  // Written back, transformers must read the same window (not its defaults).
  auto again = ParseHfConfig(ToHfConfigJson(*on));
  ASSERT_TRUE(again.ok()) << again.status();
  EXPECT_EQ(again->sliding_window, 256);
}

TEST(ModelConfigTest, ToHfConfigJsonSpellsOutWhatTransformersWouldDefault) {
  auto m = ParseHfConfig(kMistral7b);
  ASSERT_TRUE(m.ok());
  m->sliding_window = 0;
  const auto j = nlohmann::json::parse(ToHfConfigJson(*m));
  ASSERT_TRUE(j.contains("sliding_window"));
  EXPECT_TRUE(j["sliding_window"]
                  .is_null());  // Absent would mean 4096 to transformers.
  EXPECT_EQ(j["rms_norm_eps"].get<double>(),
            1e-5);  // Not the float's 9.99999974e-06.
  EXPECT_EQ(j["model_type"], "mistral");
}

TEST(ModelConfigTest, LinearRopeScalingAndDefaultRopeParameters) {
  auto c = ParseHfConfig(
      R"({"model_type": "llama", "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "rope_scaling": {"type": "linear", "factor": 2.0}})");
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->architecture, "LlamaForCausalLM");  // From model_type.
  EXPECT_EQ(c->rope_scaling.type, RopeScaling::Type::kLinear);
  EXPECT_FLOAT_EQ(c->rope_scaling.factor, 2.0f);
  auto again = ParseHfConfig(ToHfConfigJson(*c));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(again->rope_scaling.type, RopeScaling::Type::kLinear);
  auto d = ParseHfConfig(
      R"({"model_type": "mistral", "vocab_size": 100, "hidden_size": 64,
    "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "sliding_window": null, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})");
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_EQ(d->rope_scaling.type, RopeScaling::Type::kNone);
  EXPECT_FLOAT_EQ(d->rope_theta, 1e6f);
  EXPECT_EQ(d->sliding_window, 0);
}

// The configs transformers itself wrote for the reference fixtures.
TEST(ModelConfigTest, ParsesTheTransformersFixtures) {
  const std::filesystem::path hf =
      std::filesystem::path(PDSERVE_FIXTURES_DIR) / "hf";
  auto read = [&](const char* name) {
    std::ifstream in(hf / name / "config.json", std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  if (read("llama_gqa_rope3").empty()) GTEST_SKIP() << "no " << hf;
  auto llama = ParseHfConfig(read("llama_gqa_rope3"));
  ASSERT_TRUE(llama.ok()) << llama.status();
  EXPECT_EQ(llama->rope_scaling.type, RopeScaling::Type::kLlama3);
  EXPECT_EQ(llama->rope_scaling.original_max_position_embeddings, 64);
  EXPECT_FLOAT_EQ(llama->rope_theta, 500000.0f);
  EXPECT_EQ(llama->num_kv_heads, 2);
  EXPECT_FALSE(llama->tie_word_embeddings);
  auto qwen = ParseHfConfig(read("qwen2_bias_tied"));
  ASSERT_TRUE(qwen.ok()) << qwen.status();
  EXPECT_TRUE(qwen->qkv_bias);
  EXPECT_TRUE(qwen->tie_word_embeddings);
  EXPECT_EQ(qwen->sliding_window, 0);
  auto mistral = ParseHfConfig(read("mistral"));
  ASSERT_TRUE(mistral.ok()) << mistral.status();
  EXPECT_EQ(mistral->head_dim, 32);
  EXPECT_EQ(mistral->torch_dtype, DType::kBF16);
  EXPECT_EQ(mistral->sliding_window, 4096);
  auto qwen3 = ParseHfConfig(read("qwen3_qk_norm_tied"));
  ASSERT_TRUE(qwen3.ok()) << qwen3.status();
  EXPECT_TRUE(qwen3->qk_norm);
  EXPECT_FALSE(qwen3->qkv_bias);
  EXPECT_EQ(qwen3->head_dim, 32);  // Not hidden / heads (16).
  EXPECT_TRUE(qwen3->tie_word_embeddings);
  EXPECT_FLOAT_EQ(qwen3->rope_theta, 1e6f);
  EXPECT_EQ(qwen3->sliding_window, 0);
}

struct BadCase {
  const char* what;
  std::string json;
  const char* message;  // Must appear in the error.
};

TEST(ModelConfigTest, BadConfigsNameTheProblem) {
  const std::string base =
      R"("vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4)";
  const std::vector<BadCase> cases = {
      {"not json", "{", "not a valid JSON"},
      {"array", "[]", "not a valid JSON object"},
      {"unknown arch",
       R"({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", )" +
           base + "}",
       "GPT2LMHeadModel"},
      {"no arch", "{" + base + "}", "unsupported architecture"},
      {"string size",
       R"({"model_type": "llama", "vocab_size": "100", "hidden_size": 64})",
       "vocab_size"},
      {"zero layers",
       R"({"model_type": "llama", "vocab_size": 100, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 0, "num_attention_heads": 4})",
       "num_hidden_layers"},
      {"gqa",
       R"({"model_type": "llama", )" + base + R"(, "num_key_value_heads": 3})",
       "num_key_value_heads"},
      {"odd head",
       R"({"model_type": "llama", )" + base + R"(, "head_dim": 15})",
       "head_dim"},
      {"yarn",
       R"({"model_type": "llama", )" + base +
           R"(, "rope_scaling": {"type": "yarn", "factor": 4}})",
       "yarn"},
      {"huge",
       R"({"model_type": "llama", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 99999999999})",
       "range"},
      {"eps", R"({"model_type": "llama", )" + base + R"(, "rms_norm_eps": -1})",
       "rms_norm_eps"},
      {"dtype",
       R"({"model_type": "llama", )" + base + R"(, "torch_dtype": "int8"})",
       "int8"},
      {"eos",
       R"({"model_type": "llama", )" + base + R"(, "eos_token_id": 100})",
       "eos_token_id"},
      {"eos type",
       R"({"model_type": "llama", )" + base + R"(, "eos_token_id": "x"})",
       "eos_token_id"},
      {"other head",
       R"({"architectures": ["LlamaForSequenceClassification"], "model_type": "llama", )" +
           base + "}",
       "LlamaForSequenceClassification"},
      {"dynamic",
       R"({"model_type": "llama", )" + base +
           R"(, "rope_scaling": {"rope_type": "dynamic", "factor": 2}})",
       "dynamic"},
      {"rope params yarn",
       R"({"model_type": "qwen2", )" + base +
           R"(, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4}})",
       "yarn"},
      {"gelu",
       R"({"model_type": "llama", )" + base + R"(, "hidden_act": "gelu"})",
       "hidden_act"},
      {"uneven heads",
       R"({"model_type": "llama", "vocab_size": 100, "hidden_size": 66,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4})",
       "hidden_size"},
      {"float size",
       R"({"model_type": "llama", )" + base +
           R"(, "max_position_embeddings": 4096.5})",
       "max_position_embeddings"},
      {"huge theta",
       R"({"model_type": "llama", )" + base + R"(, "rope_theta": 1e300})",
       "rope_theta"},
      {"bias type",
       R"({"model_type": "llama", )" + base + R"(, "attention_bias": 1})",
       "attention_bias"},
      {"qwen3 sliding window",
       R"({"model_type": "qwen3", )" + base +
           R"(, "use_sliding_window": true, "sliding_window": 4096, "max_window_layers": 0})",
       "use_sliding_window"},
      {"qwen3 yarn",
       R"({"architectures": ["Qwen3ForCausalLM"], )" + base +
           R"(, "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
             "original_max_position_embeddings": 32768}})",
       "yarn"},
      {"qwen3 odd head_dim",
       R"({"model_type": "qwen3", )" + base + R"(, "head_dim": 33})",
       "head_dim"},
      {"qwen3 moe",
       R"({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", )" +
           base + "}",
       "Qwen3MoeForCausalLM"},
      {"llama3 factors",
       R"({"model_type": "llama", )" + base +
           R"(, "rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 4, "high_freq_factor": 1}})",
       "high_freq_factor"},
  };
  for (const BadCase& c : cases) {
    auto r = ParseHfConfig(c.json);
    ASSERT_FALSE(r.ok()) << c.what;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << c.what;
    EXPECT_NE(r.status().message().find(c.message), std::string::npos)
        << c.what << ": " << r.status();
  }
}

}  // namespace
}  // namespace pdserve
