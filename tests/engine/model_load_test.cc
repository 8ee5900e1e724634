// Loading model directories: what loads, and a precise error (never a crash)
// for every way a directory can be wrong.
#include <filesystem>
#include <fstream>

#include "engine/builtin_tiny.h"
#include "engine/model.h"
#include "engine/model_files/safetensors.h"
#include "engine/model_runner.h"
#include "gtest/gtest.h"

namespace pdserve {
namespace {

namespace fs = std::filesystem;

ModelConfig SmallConfig() {
  ModelConfig c;
  c.architecture = "LlamaForCausalLM";
  c.vocab_size = 300;
  c.hidden_size = 32;
  c.intermediate_size = 48;
  c.num_layers = 2;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 8;
  c.max_position_embeddings = 128;
  c.rms_norm_eps = 1e-5f;
  c.bos_token_id = 1;
  c.eos_token_ids = {2};
  return c;
}

void WriteFile(const fs::path& p, const std::string& text) {
  std::ofstream(p, std::ios::binary) << text;
}

std::vector<float> ToFloats(const WeightMatrix& m) {
  std::vector<float> v(static_cast<size_t>(m.rows) * m.cols);
  for (size_t i = 0; i < v.size(); ++i) v[i] = LoadAsFloat(m.data, m.dtype, i);
  return v;
}

// Writes `model` as a Hugging Face directory, leaving out `skip`, and with
// `reshape` written as a [1, n] tensor.
fs::path WriteDir(const std::string& name, const Model& model, const std::string& skip = "",
                  const std::string& reshape = "") {
  const fs::path dir = fs::path(testing::TempDir()) / name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  WriteFile(dir / "config.json", ToHfConfigJson(model.config()));
  std::vector<std::vector<float>> storage;
  std::vector<TensorToWrite> tensors;
  auto add = [&](const std::string& n, std::vector<float> v, std::vector<int64_t> shape) {
    if (n == skip) return;
    if (n == reshape) shape = {1, static_cast<int64_t>(v.size())};
    storage.push_back(std::move(v));
    const auto& s = storage.back();
    tensors.push_back({n, DType::kF32, shape,
                       std::as_bytes(std::span(s.data(), s.size()))});
  };
  storage.reserve(64);
  const ModelWeights& w = model.weights();
  auto mat = [&](const std::string& n, const WeightMatrix& m) {
    add(n, ToFloats(m), {m.rows, m.cols});
  };
  auto vec = [&](const std::string& n, const std::vector<float>& v) {
    add(n, v, {static_cast<int64_t>(v.size())});
  };
  mat("model.embed_tokens.weight", w.embed);
  for (size_t l = 0; l < w.layers.size(); ++l) {
    const LayerWeights& L = w.layers[l];
    const std::string p = "model.layers." + std::to_string(l) + ".";
    vec(p + "input_layernorm.weight", L.attn_norm);
    mat(p + "self_attn.q_proj.weight", L.wq);
    mat(p + "self_attn.k_proj.weight", L.wk);
    mat(p + "self_attn.v_proj.weight", L.wv);
    mat(p + "self_attn.o_proj.weight", L.wo);
    if (!L.q_norm.empty()) vec(p + "self_attn.q_norm.weight", L.q_norm);
    if (!L.k_norm.empty()) vec(p + "self_attn.k_norm.weight", L.k_norm);
    vec(p + "post_attention_layernorm.weight", L.ffn_norm);
    mat(p + "mlp.gate_proj.weight", L.w_gate);
    mat(p + "mlp.up_proj.weight", L.w_up);
    mat(p + "mlp.down_proj.weight", L.w_down);
  }
  vec("model.norm.weight", w.final_norm);
  if (!model.config().tie_word_embeddings) mat("lm_head.weight", w.lm_head);
  EXPECT_TRUE(WriteSafetensors(dir / "model.safetensors", tensors).ok());
  return dir;
}

std::vector<float> LastLogits(std::shared_ptr<const Model> model, const std::vector<int32_t>& ids) {
  auto runner = CreateModelRunner(model, {.num_kv_blocks = 8, .block_size = 16, .num_threads = 1});
  EXPECT_TRUE(runner.ok());
  std::vector<BlockId> table = {BlockId(0), BlockId(1)};
  ForwardBatch b;
  b.sequences.push_back({.tokens = ids, .start_pos = 0, .block_table = table});
  std::vector<float> logits(model->config().vocab_size);
  EXPECT_TRUE((*runner)->Forward(b, logits).ok());
  return logits;
}

TEST(ModelLoadTest, BuiltinTinyLoadsAndUnknownBuiltinIsRejected) {
  auto tiny = Model::Load("builtin:tiny");
  ASSERT_TRUE(tiny.ok()) << tiny.status();
  EXPECT_NE((*tiny)->tokenizer(), nullptr);
  EXPECT_EQ((*tiny)->eos_token_ids(), std::vector<int32_t>{257});
  EXPECT_EQ(Model::Load("builtin:huge").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Model::Load("/no/such/dir").status().code(), absl::StatusCode::kNotFound);
}

TEST(ModelLoadTest, DirectoryRoundTripGivesTheSameLogits) {
  for (bool tied : {false, true}) {
    ModelConfig c = SmallConfig();
    c.tie_word_embeddings = tied;
    auto model = MakeRandomModel("m", c, DType::kF32, 9);
    ASSERT_TRUE(model.ok()) << model.status();
    const fs::path dir = WriteDir(tied ? "tied" : "untied", **model);
    auto loaded = Model::Load(dir.string());
    ASSERT_TRUE(loaded.ok()) << loaded.status();
    EXPECT_EQ((*loaded)->tokenizer(), nullptr);  // No tokenizer.json: ids only.
    EXPECT_EQ((*loaded)->config().tie_word_embeddings, tied);
    EXPECT_EQ(LastLogits(*loaded, {1, 5, 9, 200}), LastLogits(*model, {1, 5, 9, 200}));
  }
}

ModelConfig SmallQwen3Config() {
  ModelConfig c = SmallConfig();
  c.architecture = "Qwen3ForCausalLM";
  c.qk_norm = true;
  c.head_dim = 16;  // Not hidden / heads.
  c.rope_theta = 1e6f;
  c.tie_word_embeddings = true;
  return c;
}

TEST(ModelLoadTest, Qwen3DirectoryRoundTripsWithItsHeadNorms) {
  auto model = MakeRandomModel("q3", SmallQwen3Config(), DType::kF32, 9);
  ASSERT_TRUE(model.ok()) << model.status();
  auto loaded = Model::Load(WriteDir("qwen3", **model).string());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  EXPECT_TRUE((*loaded)->config().qk_norm);
  EXPECT_EQ((*loaded)->weights().layers[1].k_norm, (*model)->weights().layers[1].k_norm);
  EXPECT_EQ(LastLogits(*loaded, {1, 5, 9, 200}), LastLogits(*model, {1, 5, 9, 200}));
}

TEST(ModelLoadTest, Qwen3HeadNormWeightsAreRequiredInTheirShape) {
  auto model = MakeRandomModel("q3", SmallQwen3Config(), DType::kF32, 9);
  ASSERT_TRUE(model.ok()) << model.status();
  const std::string k_norm = "model.layers.1.self_attn.k_norm.weight";
  auto missing = Model::Load(WriteDir("q3missing", **model, k_norm).string());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound) << missing.status();
  EXPECT_NE(missing.status().message().find(k_norm), std::string::npos) << missing.status();
  const std::string q_norm = "model.layers.0.self_attn.q_norm.weight";
  auto shape = Model::Load(WriteDir("q3shape", **model, "", q_norm).string());
  EXPECT_EQ(shape.status().code(), absl::StatusCode::kInvalidArgument) << shape.status();
  EXPECT_NE(shape.status().message().find(q_norm), std::string::npos) << shape.status();

  // Assembled in memory: a q norm of the wrong length is named too.
  ModelWeights w = (*model)->weights();
  w.layers[0].q_norm.pop_back();
  const absl::Status s = ValidateWeights((*model)->config(), w);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find("q_norm"), std::string::npos) << s;
}

TEST(ModelLoadTest, BrokenDirectoriesGivePreciseErrors) {
  auto model = MakeRandomModel("m", SmallConfig(), DType::kF32, 9);
  ASSERT_TRUE(model.ok());
  {  // Missing tensor.
    auto s = Model::Load(WriteDir("missing", **model, "model.layers.1.mlp.up_proj.weight").string());
    EXPECT_EQ(s.status().code(), absl::StatusCode::kNotFound) << s.status();
    EXPECT_NE(s.status().message().find("model.layers.1.mlp.up_proj.weight"), std::string::npos);
  }
  {  // Wrong shape.
    auto s = Model::Load(WriteDir("shape", **model, "", "model.layers.0.self_attn.k_proj.weight").string());
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << s.status();
    EXPECT_NE(s.status().message().find("k_proj"), std::string::npos);
  }
  {  // Unknown architecture.
    const fs::path dir = WriteDir("arch", **model);
    WriteFile(dir / "config.json", R"({"architectures": ["GPTNeoXForCausalLM"], "model_type": "gpt_neox",
      "vocab_size": 300, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
      "intermediate_size": 48})");
    auto s = Model::Load(dir.string());
    EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument) << s.status();
    EXPECT_NE(s.status().message().find("GPTNeoX"), std::string::npos) << s.status();
  }
  {  // Truncated weights file.
    const fs::path dir = WriteDir("truncated", **model);
    fs::resize_file(dir / "model.safetensors", fs::file_size(dir / "model.safetensors") / 2);
    EXPECT_FALSE(Model::Load(dir.string()).ok());
  }
  {  // No config.json; no weights.
    const fs::path dir = WriteDir("noconfig", **model);
    fs::remove(dir / "config.json");
    EXPECT_EQ(Model::Load(dir.string()).status().code(), absl::StatusCode::kNotFound);
    const fs::path dir2 = WriteDir("noweights", **model);
    fs::remove(dir2 / "model.safetensors");
    EXPECT_FALSE(Model::Load(dir2.string()).ok());
  }
  {  // Bad JSON in config.json.
    const fs::path dir = WriteDir("badjson", **model);
    WriteFile(dir / "config.json", "{\"vocab_size\": 300, ");
    EXPECT_EQ(Model::Load(dir.string()).status().code(), absl::StatusCode::kInvalidArgument);
  }
}

}  // namespace
}  // namespace pdserve
