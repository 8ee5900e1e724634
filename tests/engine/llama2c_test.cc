// The llama2.c converter: shapes, the RoPE row permutation checked against
// the raw checkpoint, and bad inputs.
#include "engine/model_files/llama2c.h"

#include <cstring>
#include <filesystem>
#include <fstream>

#include "engine/model_files/model_config.h"
#include "engine/model_files/safetensors.h"
#include "engine/tokenizer.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
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
           (std::string("llama2c-") +
            testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(out_);
  }
  fs::path out_;
};

TEST_F(Llama2cTest, ConvertedDirectoryHasHfLayoutAndPermutedQk) {
  ASSERT_TRUE(
      ConvertLlama2cToHf(kSrc / "stories260K.bin", kSrc / "tok512.bin", out_)
          .ok());
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
  auto q =
      (*ckpt)->GetWithShape("model.layers.0.self_attn.q_proj.weight", q_shape);
  ASSERT_TRUE(q.ok());
  const float* qd = reinterpret_cast<const float*>(q->bytes.data());
  const int head_dim = 8, half = 4;
  for (int h = 0; h < 8; ++h) {
    for (int i = 0; i < half; ++i) {
      for (int j = 0; j < 2; ++j) {
        // HF row h*8 + j*4 + i is llama2.c row h*8 + 2i + j.
        EXPECT_EQ(0, std::memcmp(qd + (h * head_dim + j * half + i) * 64,
                                 wq0 + (h * head_dim + 2 * i + j) * 64,
                                 64 * sizeof(float)));
      }
    }
  }
  // v_proj is copied unpermuted: layer 0's wv follows all wq and wk.
  const float* wv0 = wq0 + 5 * 64 * 64 + 5 * 32 * 64;
  const int64_t v_shape[] = {32, 64};
  auto v =
      (*ckpt)->GetWithShape("model.layers.0.self_attn.v_proj.weight", v_shape);
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(0, std::memcmp(v->bytes.data(), wv0, 32 * 64 * sizeof(float)));

  auto tok = Tokenizer::FromHfFiles(out_ / "tokenizer.json",
                                    out_ / "tokenizer_config.json");
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
  for (size_t n : {size_t{0}, size_t{10}, size_t{28}, ckpt.size() / 2,
                   ckpt.size() - 4 * 8 * 512 - 4}) {
    EXPECT_EQ(ConvertLlama2cToHf(write("c.bin", ckpt.substr(0, n)),
                                 kSrc / "tok512.bin", out_)
                  .code(),
              kInvalid)
        << "checkpoint cut to " << n;
  }
  std::string bad_header = ckpt;
  const int32_t heads = 7;  // 64 is not a multiple of 7.
  std::memcpy(bad_header.data() + 12, &heads, 4);
  EXPECT_EQ(
      ConvertLlama2cToHf(write("h.bin", bad_header), kSrc / "tok512.bin", out_)
          .code(),
      kInvalid);
  std::string negative = ckpt;
  const int32_t minus = -5;
  std::memcpy(negative.data(), &minus, 4);
  EXPECT_EQ(
      ConvertLlama2cToHf(write("n.bin", negative), kSrc / "tok512.bin", out_)
          .code(),
      kInvalid);
  for (size_t n : {size_t{0}, size_t{3}, size_t{100}, tok.size() - 1}) {
    EXPECT_EQ(ConvertLlama2cToHf(kSrc / "stories260K.bin",
                                 write("t.bin", tok.substr(0, n)), out_)
                  .code(),
              kInvalid)
        << "tokenizer cut to " << n;
  }
  EXPECT_EQ(
      ConvertLlama2cToHf(dir / "missing.bin", kSrc / "tok512.bin", out_).code(),
      absl::StatusCode::kNotFound);
  // One byte more than the header implies: the header does not describe the
  // file.
  auto s = ConvertLlama2cToHf(write("long.bin", ckpt + "x"),
                              kSrc / "tok512.bin", out_);
  EXPECT_EQ(s.code(), kInvalid);
  EXPECT_NE(s.message().find("its header implies 1056540"), std::string::npos)
      << s;
  // An unshared classifier (negative vocab_size) needs vocab * dim more floats.
  std::string unshared = ckpt;
  const int32_t minus_vocab = -512;
  std::memcpy(unshared.data() + 20, &minus_vocab, 4);
  EXPECT_EQ(
      ConvertLlama2cToHf(write("u.bin", unshared), kSrc / "tok512.bin", out_)
          .code(),
      kInvalid);
  std::string gqa = ckpt;
  const int32_t kv_heads = 3;  // 8 heads are not a multiple of 3 KV heads.
  std::memcpy(gqa.data() + 16, &kv_heads, 4);
  s = ConvertLlama2cToHf(write("g.bin", gqa), kSrc / "tok512.bin", out_);
  EXPECT_EQ(s.code(), kInvalid);
  EXPECT_NE(s.message().find("num_key_value_heads"), std::string::npos) << s;
  std::string huge = ckpt;
  const int32_t layers =
      1 << 20;  // Sizes this large would overflow the size arithmetic.
  std::memcpy(huge.data() + 8, &layers, 4);
  EXPECT_EQ(ConvertLlama2cToHf(write("l.bin", huge), kSrc / "tok512.bin", out_)
                .code(),
            kInvalid);
  // A token whose length exceeds max_token_length, and a non-UTF-8 token.
  std::string long_token = tok;
  const int32_t max_len = 1;
  std::memcpy(long_token.data(), &max_len, 4);
  s = ConvertLlama2cToHf(kSrc / "stories260K.bin", write("ml.bin", long_token),
                         out_);
  EXPECT_EQ(s.code(), kInvalid);
  EXPECT_NE(s.message().find("has length"), std::string::npos) << s;
}

// Rewrites tok512.bin with token `dst`'s text replaced by token `src`'s.
std::string CopyToken(const std::string& tok, int src, int dst) {
  std::vector<std::pair<std::string, std::string>>
      tokens;  // (score bytes, text)
  size_t pos = 4;
  for (int i = 0; i < 512; ++i) {
    int32_t len;
    std::memcpy(&len, tok.data() + pos + 4, 4);
    tokens.push_back({tok.substr(pos, 4), tok.substr(pos + 8, len)});
    pos += 8 + len;
  }
  tokens[dst].second = tokens[src].second;
  std::string out = tok.substr(0, 4);
  for (const auto& [score, text] : tokens) {
    const int32_t len = static_cast<int32_t>(text.size());
    out += score;
    out.append(reinterpret_cast<const char*>(&len), 4);
    out += text;
  }
  return out;
}

TEST_F(Llama2cTest, RepeatedOrBadVocabularyPiecesAreRejected) {
  const std::string tok = ReadFileOrEmpty(kSrc / "tok512.bin");
  const fs::path dir = out_.string() + "-inputs";
  fs::create_directories(dir);
  std::ofstream(dir / "dup.bin", std::ios::binary) << CopyToken(tok, 300, 301);
  auto s = ConvertLlama2cToHf(kSrc / "stories260K.bin", dir / "dup.bin", out_);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("token 301 repeats the piece"), std::string::npos)
      << s;
  std::string bad_utf8 = CopyToken(tok, 300, 300);
  // Token 3 is "<0x00>": make it an invalid UTF-8 byte of the same length.
  const size_t at = bad_utf8.find("<0x00>");
  ASSERT_NE(at, std::string::npos);
  bad_utf8[at] = '\xff';
  std::ofstream(dir / "utf8.bin", std::ios::binary) << bad_utf8;
  s = ConvertLlama2cToHf(kSrc / "stories260K.bin", dir / "utf8.bin", out_);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("token 3 is not UTF-8"), std::string::npos) << s;
}

// The parts of tokenizer.json that transformers' own conversion of the same
// vocabulary (as a SentencePiece model) decides; the full file was checked
// equal to it with tools/check_llama2c_with_transformers.py's setup.
TEST_F(Llama2cTest, TokenizerJsonFollowsTransformersConversion) {
  ASSERT_TRUE(
      ConvertLlama2cToHf(kSrc / "stories260K.bin", kSrc / "tok512.bin", out_)
          .ok());
  const auto j =
      nlohmann::json::parse(ReadFileOrEmpty(out_ / "tokenizer.json"));
  const auto& model = j["model"];
  EXPECT_EQ(model["type"], "BPE");
  EXPECT_TRUE(model["byte_fallback"].get<bool>());
  EXPECT_EQ(model["vocab"].size(), 512u);
  EXPECT_EQ(model["vocab"]["\xE2\x96\x81t"],
            259);  // " t" with its space as U+2581.
  EXPECT_EQ(model["vocab"]["<0x0A>"], 13);
  const auto& merges = model["merges"];
  ASSERT_EQ(merges.size(), 165u);
  // Highest-scoring merged piece first; splits of one piece left to right.
  EXPECT_EQ(merges[0], nlohmann::json::array({"\xE2\x96\x81", "t"}));
  EXPECT_EQ(merges[1], nlohmann::json::array({"h", "e"}));
  EXPECT_EQ(merges[23], nlohmann::json::array({"\xE2\x96\x81", "he"}));
  EXPECT_EQ(merges[24], nlohmann::json::array({"\xE2\x96\x81h", "e"}));
  EXPECT_EQ(j["added_tokens"].size(), 3u);
  EXPECT_EQ(j["added_tokens"][1]["content"], "<s>");
  EXPECT_EQ(j["pre_tokenizer"]["type"], "Metaspace");
  const auto config =
      nlohmann::json::parse(ReadFileOrEmpty(out_ / "tokenizer_config.json"));
  EXPECT_EQ(config["tokenizer_class"], "LlamaTokenizer");
  EXPECT_TRUE(config["add_bos_token"].get<bool>());
}

// Llama 2's own 32000-piece vocabulary in llama2.c's format, with a tiny
// all-zero model of that vocabulary: its whitespace runs ("▁▁" is id 259 but
// scores -1e9) must merge last, as SentencePiece merges them.
TEST_F(Llama2cTest, Llama2VocabularyEncodesWhitespaceRunsAsSentencePiece) {
  const fs::path tok_bin =
      fs::path(PDSERVE_SHARED_DIR) / "tokenizers/llama2/tokenizer.bin";
  if (!fs::exists(tok_bin)) GTEST_SKIP() << "no " << tok_bin;
  const int32_t header[7] = {8, 8, 1, 2, 2, 32000, 4};  // dim 8, 2 heads.
  const size_t floats =
      32000 * 8 + (2 * 8 + 2 * 64 + 2 * 64 + 3 * 64) + 8 + 2 * 4 * 2;
  std::string ckpt(reinterpret_cast<const char*>(header), sizeof(header));
  ckpt.append(floats * sizeof(float), '\0');
  const fs::path bin = out_.string() + "-32k.bin";
  std::ofstream(bin, std::ios::binary | std::ios::trunc) << ckpt;
  ASSERT_TRUE(ConvertLlama2cToHf(bin, tok_bin, out_).ok());
  auto tok = Tokenizer::FromHfFiles(out_ / "tokenizer.json",
                                    out_ / "tokenizer_config.json");
  ASSERT_TRUE(tok.ok()) << tok.status();
  // Expected ids from sentencepiece with tokenizer.model.
  const std::vector<std::pair<std::string, std::vector<int32_t>>> cases = {
      {"a  b", {263, 29871, 289}},
      {"hello    world", {22172, 1678, 3186}},
      {"def f():\n        return 1",
       {822, 285, 7295, 13, 4706, 736, 29871, 29896}},
  };
  for (const auto& [text, want] : cases) {
    auto ids = (*tok)->Encode(text, false);
    ASSERT_TRUE(ids.ok()) << ids.status();
    EXPECT_EQ(*ids, want) << text;
  }
}

}  // namespace
}  // namespace pdserve
