// ModelInfo reads a model's files but never its weights: a directory with no
// weights, or corrupt ones, gives its info (and fails as a Model); a
// llama2.c checkpoint gives its info from the header alone.
#include "engine/model_files/model_info.h"

#include <filesystem>
#include <fstream>

#include "engine/model.h"
#include "engine/model_files/llama2c.h"
#include "gtest/gtest.h"
#include "tests/engine/test_util.h"

namespace pdserve {
namespace {

namespace fs = std::filesystem;
using testing_util::ReadFileOrEmpty;

const fs::path kSrc = fs::path(PDSERVE_SHARED_DIR) / "models/stories260K";
constexpr char kChatTemplate[] =
    "{% for m in messages %}{{ m['content'] }}\n{% endfor %}";

void WriteFile(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
}

class ModelInfoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(kSrc / "stories260K.bin")) GTEST_SKIP() << "no " << kSrc;
    // ctest runs each test in its own process, in parallel: no shared paths.
    dir_ = fs::path(testing::TempDir()) /
           (std::string("model-info-") +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    ASSERT_TRUE(
        ConvertLlama2cToHf(kSrc / "stories260K.bin", kSrc / "tok512.bin", dir_)
            .ok());
    WriteFile(dir_ / "chat_template.jinja", kChatTemplate);
    WriteFile(dir_ / "generation_config.json", R"({
      "bos_token_id": 1, "eos_token_id": [2, 5], "do_sample": true,
      "temperature": 0.6, "top_p": 0.9, "top_k": 40})");
  }

  void ExpectStories260kInfo(const ModelInfo& info) {
    const ModelConfig& c = info.config();
    EXPECT_EQ(c.hidden_size, 64);
    EXPECT_EQ(c.intermediate_size, 172);
    EXPECT_EQ(c.num_layers, 5);
    EXPECT_EQ(c.num_heads, 8);
    EXPECT_EQ(c.num_kv_heads, 4);
    EXPECT_EQ(c.vocab_size, 512);
    EXPECT_EQ(c.max_position_embeddings, 512);
    ASSERT_NE(info.tokenizer(), nullptr);
    auto ids = info.tokenizer()->Encode("Once upon a time", true);
    ASSERT_TRUE(ids.ok()) << ids.status();
    EXPECT_EQ((*ids)[0], 1);
    EXPECT_EQ(*info.tokenizer()->Decode(*ids, true), "Once upon a time");
  }

  fs::path dir_;
};

TEST_F(ModelInfoTest, DirectoryWithoutWeightsGivesItsInfoButNoModel) {
  fs::remove(dir_ / "model.safetensors");
  auto info = LoadModelInfo(dir_.string());
  ASSERT_TRUE(info.ok()) << info.status();
  ExpectStories260kInfo(**info);
  EXPECT_EQ((*info)->name(), dir_.filename().string());
  // generation_config.json: its EOS ids override config.json's, its
  // sampling defaults are kept.
  EXPECT_EQ((*info)->eos_token_ids(), (std::vector<int32_t>{2, 5}));
  EXPECT_EQ((*info)->bos_token_id(), 1);
  const GenerationConfig& g = (*info)->generation_config();
  EXPECT_EQ(g.do_sample, true);
  EXPECT_EQ(g.temperature, 0.6f);
  EXPECT_EQ(g.top_p, 0.9f);
  EXPECT_EQ(g.top_k, 40);
  EXPECT_FALSE(g.min_p.has_value());
  ASSERT_TRUE((*info)->chat_template().has_value());
  EXPECT_EQ((*info)->chat_template()->source, kChatTemplate);
  EXPECT_EQ((*info)->chat_template()->tokens.eos_token, "</s>");

  EXPECT_EQ(Model::Load(dir_.string()).status().code(),
            absl::StatusCode::kNotFound);
}

TEST_F(ModelInfoTest, CorruptWeightsAreNeverRead) {
  // A safetensors file whose header claims 2^40 bytes of JSON, and a shard
  // index naming shards that do not exist: opening either fails.
  std::string corrupt(8, '\xff');
  corrupt += "not safetensors at all";
  WriteFile(dir_ / "model.safetensors", corrupt);
  auto info = LoadModelInfo(dir_.string());
  ASSERT_TRUE(info.ok()) << info.status();
  ExpectStories260kInfo(**info);
  EXPECT_FALSE(Model::Load(dir_.string()).ok());

  fs::remove(dir_ / "model.safetensors");
  WriteFile(dir_ / "model.safetensors.index.json",
            R"({"weight_map": {"model.norm.weight": "missing.safetensors"}})");
  EXPECT_TRUE(LoadModelInfo(dir_.string()).ok());
  EXPECT_FALSE(Model::Load(dir_.string()).ok());
}

TEST_F(ModelInfoTest, ModelLoadsTheSameInfo) {
  auto info = LoadModelInfo(dir_.string());
  auto model = Model::Load(dir_.string());
  ASSERT_TRUE(info.ok()) << info.status();
  ASSERT_TRUE(model.ok()) << model.status();
  const ModelInfo& from_model = *(*model)->info();
  EXPECT_EQ(from_model.name(), (*info)->name());
  EXPECT_EQ(ToHfConfigJson(from_model.config()),
            ToHfConfigJson((*info)->config()));
  EXPECT_EQ(from_model.eos_token_ids(), (*info)->eos_token_ids());
  EXPECT_EQ((*model)->eos_token_ids(), (*info)->eos_token_ids());
  EXPECT_EQ(from_model.generation_config().top_k, 40);
  EXPECT_TRUE(from_model.chat_template().has_value());
}

TEST_F(ModelInfoTest, BadGenerationConfigNamesTheFile) {
  WriteFile(dir_ / "generation_config.json", R"({"temperature": "hot"})");
  auto info = LoadModelInfo(dir_.string());
  EXPECT_EQ(info.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(info.status().message().find("generation_config.json: field "
                                         "'temperature'"),
            std::string::npos)
      << info.status();
  WriteFile(dir_ / "generation_config.json", R"({"eos_token_id": 512})");
  EXPECT_EQ(LoadModelInfo(dir_.string()).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_F(ModelInfoTest, Llama2cInfoReadsTheHeaderOnly) {
  auto info =
      LoadLlama2cModelInfo(kSrc / "stories260K.bin", kSrc / "tok512.bin");
  ASSERT_TRUE(info.ok()) << info.status();
  ExpectStories260kInfo(**info);
  EXPECT_EQ((*info)->name(), "stories260K");
  EXPECT_EQ((*info)->eos_token_ids(), (std::vector<int32_t>{2}));
  EXPECT_FALSE((*info)->chat_template().has_value());
  // The same facts as the converted directory (less the files added here).
  fs::remove(dir_ / "generation_config.json");
  fs::remove(dir_ / "chat_template.jinja");
  auto converted = LoadModelInfo(dir_.string());
  ASSERT_TRUE(converted.ok()) << converted.status();
  EXPECT_EQ(ToHfConfigJson((*info)->config()),
            ToHfConfigJson((*converted)->config()));
  EXPECT_EQ((*info)->eos_token_ids(), (*converted)->eos_token_ids());
  auto a = (*info)->tokenizer()->Encode("A dog ran to the park.", true);
  auto b = (*converted)->tokenizer()->Encode("A dog ran to the park.", true);
  ASSERT_TRUE(a.ok() && b.ok());
  EXPECT_EQ(*a, *b);

  // Truncated right after its 28-byte header: the info loads, the weights
  // do not.
  const std::string ckpt = ReadFileOrEmpty(kSrc / "stories260K.bin");
  const fs::path header_only = dir_.string() + "-header.bin";
  WriteFile(header_only, ckpt.substr(0, 28));
  auto from_header = LoadLlama2cModelInfo(header_only, kSrc / "tok512.bin");
  ASSERT_TRUE(from_header.ok()) << from_header.status();
  ExpectStories260kInfo(**from_header);
  EXPECT_EQ(ConvertLlama2cToHf(header_only, kSrc / "tok512.bin",
                               dir_.string() + "-converted")
                .code(),
            absl::StatusCode::kInvalidArgument);
  // Shorter than the header, or missing: no info either.
  WriteFile(header_only, ckpt.substr(0, 27));
  EXPECT_EQ(
      LoadLlama2cModelInfo(header_only, kSrc / "tok512.bin").status().code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LoadLlama2cModelInfo(dir_ / "missing.bin", kSrc / "tok512.bin")
                .status()
                .code(),
            absl::StatusCode::kNotFound);
}

TEST(ModelInfoBuiltinTest, BuiltinsAndMissingDirectories) {
  auto tiny = LoadModelInfo("builtin:tiny");
  ASSERT_TRUE(tiny.ok()) << tiny.status();
  EXPECT_EQ((*tiny)->name(), "builtin:tiny");
  EXPECT_EQ((*tiny)->config().vocab_size, 258);
  EXPECT_EQ((*tiny)->eos_token_ids(), (std::vector<int32_t>{257}));
  EXPECT_EQ((*tiny)->bos_token_id(), 256);
  ASSERT_NE((*tiny)->tokenizer(), nullptr);
  EXPECT_FALSE((*tiny)->chat_template().has_value());
  auto big = LoadModelInfo("builtin:llama-110m");
  ASSERT_TRUE(big.ok()) << big.status();
  EXPECT_EQ((*big)->config().vocab_size, 32000);
  EXPECT_EQ(LoadModelInfo("builtin:nope").status().code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(LoadModelInfo("/no/such/model").status().code(),
            absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace pdserve
