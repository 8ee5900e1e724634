// Tokenizer unit tests: the builtin byte-level tokenizer, invalid input,
// streaming of characters split across byte-fallback tokens, and malformed
// tokenizer.json / GGUF files (errors, never crashes).
#include "engine/tokenizer.h"

#include <filesystem>
#include <fstream>
#include <cstring>
#include <random>

#include "engine/gguf.h"
#include "engine/pretokenizer_regex.h"
#include "engine/unicode.h"
#include "gtest/gtest.h"
#include "tests/engine/test_util.h"

namespace pdserve {
namespace {

namespace fs = std::filesystem;

using testing_util::ReadFileOrEmpty;

TEST(ByteLevelTokenizerTest, RoundTripsAnyUtf8AndAddsBos) {
  auto tok = Tokenizer::MakeByteLevel();
  EXPECT_EQ(tok->vocab_size(), 258);
  EXPECT_EQ(tok->bos_token_id(), 256);
  EXPECT_EQ(tok->eos_token_ids(), std::vector<int32_t>{257});
  const std::string text = "héllo 🦙 世界\n";
  auto ids = tok->Encode(text, true);
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(ids->size(), text.size() + 1);
  EXPECT_EQ((*ids)[0], 256);
  EXPECT_EQ((*ids)[1], 'h');
  EXPECT_EQ(*tok->Decode(*ids, true), text);
  EXPECT_EQ(*tok->Decode(*ids, false), "<s>" + text);
  EXPECT_TRUE(tok->IsSpecial(257));
  EXPECT_FALSE(tok->IsSpecial('a'));
}

TEST(TokenizerTest, InvalidUtf8AndBadIdsAreRejected) {
  auto tok = Tokenizer::MakeByteLevel();
  for (std::string bad : {std::string("\xff"), std::string("abc\xc3"), std::string("\xed\xa0\x80"),
                          std::string("\xc0\xaf"), std::string("\xf4\x90\x80\x80")}) {
    EXPECT_EQ(tok->Encode(bad, true).status().code(), absl::StatusCode::kInvalidArgument);
  }
  const int32_t bad_ids[] = {1, 258};
  EXPECT_EQ(tok->Decode(bad_ids, false).status().code(), absl::StatusCode::kInvalidArgument);
  const int32_t negative[] = {-1};
  EXPECT_EQ(tok->Decode(negative, false).status().code(), absl::StatusCode::kInvalidArgument);
  IncrementalDetokenizer d(*tok, true);
  EXPECT_FALSE(d.Append(9999).ok());
}

TEST(IncrementalDetokenizerTest, NeverEmitsHalfACharacter) {
  auto tok = Tokenizer::MakeByteLevel();
  const std::string text = "a🦙é世";  // 1 + 4 + 2 + 3 bytes, one token each byte.
  auto ids = tok->Encode(text, false);
  ASSERT_TRUE(ids.ok());
  IncrementalDetokenizer d(*tok, true);
  std::vector<std::string> deltas;
  for (int32_t id : *ids) deltas.push_back(*d.Append(id));
  const std::vector<std::string> want = {"a", "", "", "", "🦙", "", "é", "", "", "世"};
  EXPECT_EQ(deltas, want);
  EXPECT_EQ(d.Flush(), "");
}

TEST(IncrementalDetokenizerTest, IncompleteTailIsReplacedAtFlush) {
  auto tok = Tokenizer::MakeByteLevel();
  IncrementalDetokenizer d(*tok, true);
  EXPECT_EQ(*d.Append('x'), "x");
  EXPECT_EQ(*d.Append(0xE4), "");
  EXPECT_EQ(*d.Append(0xB8), "");
  EXPECT_EQ(d.Flush(), "\xEF\xBF\xBD");  // U+FFFD for the cut character.
  const int32_t ids[] = {'x', 0xE4, 0xB8};
  EXPECT_EQ(*tok->Decode(ids, true), "x\xEF\xBF\xBD");
}

TEST(IncrementalDetokenizerTest, InvalidBytesMidStreamDoNotStallTheStream) {
  auto tok = Tokenizer::MakeByteLevel();
  IncrementalDetokenizer d(*tok, true);
  std::string out = *d.Append(0xFF);  // Never valid UTF-8.
  out += *d.Append('o');
  out += *d.Append('k');
  out += d.Flush();
  EXPECT_EQ(out, "\xEF\xBF\xBDok");
}

TEST(Utf8Test, ValidationAndReplacementFollowTheStandard) {
  EXPECT_TRUE(unicode::IsValidUtf8("plain ascii"));
  EXPECT_TRUE(unicode::IsValidUtf8("\xF0\x9F\xA6\x99"));
  EXPECT_FALSE(unicode::IsValidUtf8("\xF0\x9F\xA6"));
  // Maximal subparts, as Python's errors="replace".
  EXPECT_EQ(unicode::ToValidUtf8("a\xF0\x9F\xA6z"), "a\xEF\xBF\xBDz");
  EXPECT_EQ(unicode::ToValidUtf8("\xC0\xAF"), "\xEF\xBF\xBD\xEF\xBF\xBD");
  EXPECT_EQ(unicode::CompleteUtf8Prefix("ab\xE4\xB8"), 2u);
  EXPECT_EQ(unicode::CompleteUtf8Prefix("ab\xFF"), 3u);
}

TEST(PretokenizerRegexTest, Gpt2PatternSplitsAsExpected) {
  auto re = PretokenizerRegex::Compile(
      R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)");
  ASSERT_TRUE(re.ok()) << re.status();
  const std::string text = "Hello world's  123!!\n";
  const auto cps = unicode::DecodeUtf8(text);
  std::vector<std::pair<size_t, size_t>> m;
  ASSERT_TRUE((*re)->FindAll(cps, m).ok());
  std::vector<std::string> pieces;
  for (auto [b, e] : m) {
    std::string s;
    for (size_t i = b; i < e; ++i) unicode::AppendUtf8(cps[i], s);
    pieces.push_back(s);
  }
  const std::vector<std::string> want = {"Hello", " world", "'s", " ", " 123", "!!", "\n"};
  EXPECT_EQ(pieces, want);
}

TEST(PretokenizerRegexTest, UnsupportedSyntaxIsAnErrorNotAWrongSplit) {
  for (const char* bad : {"(?<=a)b", "a{3,1}", "[z-a]", "\\p{Greek}", "(abc", "abc)", "*a",
                          "a++", "\\d+", "[[:alpha:]]"}) {
    EXPECT_EQ(PretokenizerRegex::Compile(bad).status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
}

TEST(TokenizerJsonTest, MalformedFilesGiveErrors) {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(Tokenizer::FromHfJson("{", "").status().code(), kInvalid);
  EXPECT_EQ(Tokenizer::FromHfJson("[]", "").status().code(), kInvalid);
  EXPECT_EQ(Tokenizer::FromHfJson(R"j({"model": {"type": "WordPiece", "vocab": {}}})j", "").status().code(), kInvalid);
  EXPECT_EQ(Tokenizer::FromHfJson(R"j({"model": {"type": "Unigram", "vocab": []}})j", "").status().code(), kInvalid);
  EXPECT_EQ(Tokenizer::FromHfJson(R"j({"model": {"type": "BPE", "vocab": {"a": -1}}})j", "").status().code(), kInvalid);
  EXPECT_EQ(Tokenizer::FromHfJson(R"j({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": ["a c"]}})j", "").status().code(), kInvalid);
  EXPECT_EQ(Tokenizer::FromHfJson(R"j({"model": {"type": "BPE", "vocab": {"a": 0}},
      "normalizer": {"type": "NFKC"}})j", "").status().code(), kInvalid);
  auto split = Tokenizer::FromHfJson(R"j({"model": {"type": "BPE", "vocab": {"a": 0}},
      "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "(?<=x)"}, "behavior": "Isolated"}})j", "");
  EXPECT_EQ(split.status().code(), kInvalid);
  EXPECT_NE(split.status().message().find("regex"), std::string::npos) << split.status();
  EXPECT_EQ(Tokenizer::FromHfJson(R"j({"model": {"type": "BPE", "vocab": {"a": 0}}})j", "{bad").status().code(), kInvalid);
  // Fields of the wrong type or missing where a structure is expected.
  for (const char* bad : {
           R"j({"model": {"type": "BPE", "vocab": {"a": 0}}, "decoder": {"type": "Replace", "pattern": 5}})j",
           R"j({"model": {"type": "BPE", "vocab": {"a": 0}}, "decoder": {"type": "Replace"}})j",
           R"j({"model": {"type": "BPE", "vocab": {"a": 0}}, "normalizer": {"type": "Replace", "pattern": {"String": 1}}})j",
           R"j({"model": {"type": "BPE", "vocab": {"a": 0}}, "pre_tokenizer": {"type": "Split"}})j",
           R"j({"model": {"type": "BPE", "vocab": {"a": 0}}, "post_processor": {"type": "TemplateProcessing"}})j",
           R"j({"model": {"type": "BPE", "vocab": {"a": 0}}, "post_processor": {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<s>"}}], "special_tokens": {"<s>": {"ids": "x"}}}})j",
           R"j({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [["a"]]}})j",
           R"j({"model": {"type": "BPE", "vocab": {"a": 0}}, "added_tokens": [{"id": "x", "content": "b"}]})j"}) {
    EXPECT_EQ(Tokenizer::FromHfJson(bad, "").status().code(), kInvalid) << bad;
  }
  auto ok = Tokenizer::FromHfJson(R"j({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]}})j", "");
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(*(*ok)->Encode("abab", false), (std::vector<int32_t>{2, 2}));
}

TEST(GgufTest, TruncatedAndCorruptFilesGiveErrorsNotCrashes) {
  const fs::path gguf = fs::path(PDSERVE_SHARED_DIR) / "tokenizers/llama.cpp-vocab/ggml-vocab-llama-spm.gguf";
  if (!fs::exists(gguf)) GTEST_SKIP() << "no " << gguf;
  const std::string bytes = ReadFileOrEmpty(gguf);
  ASSERT_TRUE(ParseGgufMetadata(bytes).ok());
  for (size_t n = 0; n < bytes.size(); n += bytes.size() / 97 + 1) {
    EXPECT_FALSE(ParseGgufMetadata(std::string_view(bytes).substr(0, n)).ok()) << "cut at " << n;
  }
  std::mt19937 rng(5);
  int parsed = 0;
  for (int trial = 0; trial < 300; ++trial) {
    std::string corrupt = bytes.substr(0, 4096);
    for (int k = 0; k < 8; ++k) corrupt[rng() % corrupt.size()] = static_cast<char>(rng());
    parsed += ParseGgufMetadata(corrupt).ok();  // Must return, never crash or over-allocate.
  }
  EXPECT_LT(parsed, 300);
  // A huge array count cannot make the reader allocate: it is bounded by the file.
  std::string huge = bytes.substr(0, 24);
  const uint64_t one = 1;
  std::memcpy(huge.data() + 16, &one, 8);  // One key...
  huge += std::string("\x03\0\0\0\0\0\0\0key", 11) + std::string("\x09\0\0\0\x08\0\0\0", 8) +
          std::string("\xff\xff\xff\xff\xff\xff\xff\x0f", 8);  // ...an array of 2^60 strings.
  EXPECT_EQ(ParseGgufMetadata(huge).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseGgufMetadata("GGUF").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseGgufMetadata("NOPE0000000000000000000000").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(Tokenizer::FromGguf("/no/such.gguf").status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace pdserve
