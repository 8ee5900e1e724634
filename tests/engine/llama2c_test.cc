// The llama2.c converter: shapes, the RoPE row permutation checked against
// the raw checkpoint, and bad inputs.
#include "engine/llama2c.h"

#include <cstring>
#include <filesystem>
#include <fstream>

#include "engine/model_config.h"
#include "engine/safetensors.h"
#include "engine/tokenizer.h"
#include "gtest/gtest.h"
#include "tests/engine/test_util.h"

namespace pdserve {
namespace {

namespace fs = std::filesystem;

const fs::path kSrc = fs::path(PDSERVE_SHARED_DIR) / "models/stories260K";

using testing_util::ReadFileOrEmpty;

class Llama2cTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!fs::exists(kSrc / "stories260K.bin")) GTEST_SKIP() << "no " << kSrc;
    // ctest runs each test in its own process, in parallel: no shared paths.
    out_ = fs::path(testing::TempDir()) /
           (std::string("llama2c-") + testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(out_);
  }
  fs::path out_;
};

TEST_F(Llama2cTest, ConvertedDirectoryHasHfLayoutAndPermutedQk) {
  ASSERT_TRUE(ConvertLlama2cToHf(kSrc / "stories260K.bin", kSrc / "tok512.bin", out_).ok());
  auto config = ParseHfConfig(ReadFileOrEmpty(out_ / "config.json"));
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->hidden_size, 64);
  EXPECT_EQ(config->num_layers, 5);
  EXPECT_EQ(config->num_heads, 8);
  EXPECT_EQ(config->num_kv_heads, 4);
  EXPECT_EQ(config->vocab_size, 512);
  EXPECT_EQ(config->intermediate_size, 172);
  EXPECT_TRUE(config->tie_word_embeddings);
  auto ckpt = Checkpoint::Open(out_);
  ASSERT_TRUE(ckpt.ok()) << ckpt.status();
  EXPECT_FALSE((*ckpt)->Has("lm_head.weight"));

  // Layer 0's wq in the raw file starts after the header, the embedding and
  // every layer's attention norm.
  const std::string raw = ReadFileOrEmpty(kSrc / "stories260K.bin");
  const float* f = reinterpret_cast<const float*>(raw.data() + 28);
  const float* wq0 = f + 512 * 64 + 5 * 64;
  const int64_t q_shape[] = {64, 64};
  auto q = (*ckpt)->GetWithShape("model.layers.0.self_attn.q_proj.weight", q_shape);
  ASSERT_TRUE(q.ok());
  const float* qd = reinterpret_cast<const float*>(q->bytes.data());
  const int head_dim = 8, half = 4;
  for (int h = 0; h < 8; ++h) {
    for (int i = 0; i < half; ++i) {
      for (int j = 0; j < 2; ++j) {
        // HF row h*8 + j*4 + i is llama2.c row h*8 + 2i + j.
        EXPECT_EQ(0, std::memcmp(qd + (h * head_dim + j * half + i) * 64,
                                 wq0 + (h * head_dim + 2 * i + j) * 64, 64 * sizeof(float)));
      }
    }
  }
  // v_proj is copied unpermuted: layer 0's wv follows all wq and wk.
  const float* wv0 = wq0 + 5 * 64 * 64 + 5 * 32 * 64;
  const int64_t v_shape[] = {32, 64};
  auto v = (*ckpt)->GetWithShape("model.layers.0.self_attn.v_proj.weight", v_shape);
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(0, std::memcmp(v->bytes.data(), wv0, 32 * 64 * sizeof(float)));

  auto tok = Tokenizer::FromHfFiles(out_ / "tokenizer.json", out_ / "tokenizer_config.json");
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ((*tok)->vocab_size(), 512);
  EXPECT_EQ((*tok)->bos_token_id(), 1);
  auto ids = (*tok)->Encode("Once upon a time", true);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ((*ids)[0], 1);
  EXPECT_EQ(*(*tok)->Decode(*ids, true), "Once upon a time");
}

TEST_F(Llama2cTest, TruncatedOrCorruptInputsAreRejected) {
  const std::string ckpt = ReadFileOrEmpty(kSrc / "stories260K.bin");
  const std::string tok = ReadFileOrEmpty(kSrc / "tok512.bin");
  const fs::path dir = out_.string() + "-inputs";
  fs::create_directories(dir);
  auto write = [&](const std::string& name, const std::string& bytes) {
    std::ofstream(dir / name, std::ios::binary | std::ios::trunc) << bytes;
    return dir / name;
  };
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  for (size_t n : {size_t{0}, size_t{10}, size_t{28}, ckpt.size() / 2, ckpt.size() - 4 * 8 * 512 - 4}) {
    EXPECT_EQ(ConvertLlama2cToHf(write("c.bin", ckpt.substr(0, n)), kSrc / "tok512.bin", out_).code(), kInvalid)
        << "checkpoint cut to " << n;
  }
  std::string bad_header = ckpt;
  const int32_t heads = 7;  // 64 is not a multiple of 7.
  std::memcpy(bad_header.data() + 12, &heads, 4);
  EXPECT_EQ(ConvertLlama2cToHf(write("h.bin", bad_header), kSrc / "tok512.bin", out_).code(), kInvalid);
  std::string negative = ckpt;
  const int32_t minus = -5;
  std::memcpy(negative.data(), &minus, 4);
  EXPECT_EQ(ConvertLlama2cToHf(write("n.bin", negative), kSrc / "tok512.bin", out_).code(), kInvalid);
  for (size_t n : {size_t{0}, size_t{3}, size_t{100}, tok.size() - 1}) {
    EXPECT_EQ(ConvertLlama2cToHf(kSrc / "stories260K.bin", write("t.bin", tok.substr(0, n)), out_).code(), kInvalid)
        << "tokenizer cut to " << n;
  }
  EXPECT_EQ(ConvertLlama2cToHf(dir / "missing.bin", kSrc / "tok512.bin", out_).code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace pdserve
