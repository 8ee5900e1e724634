// Tokenizer unit tests: the builtin byte-level tokenizer, invalid input,
// streaming of characters split across byte-fallback tokens, and malformed
// tokenizer.json / GGUF files (errors, never crashes).
#include "engine/tokenizer.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <cstring>
#include <random>

#include "engine/model_files/gguf.h"
#include "engine/split_pattern.h"
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

// The pieces (matches and the text between them) a pattern cuts `text` into.
std::vector<std::string> SplitPieces(const SplitPattern& pattern, std::string_view text) {
  const std::vector<char32_t> cps = unicode::DecodeUtf8(text);
  std::vector<std::pair<size_t, size_t>> matches;
  pattern.FindAll(cps, matches);
  std::vector<std::string> pieces;
  size_t last = 0;
  auto append = [&](size_t b, size_t e) {
    std::string s;
    for (size_t i = b; i < e; ++i) unicode::AppendUtf8(cps[i], s);
    pieces.push_back(std::move(s));
  };
  for (auto [b, e] : matches) {
    if (b > last) append(last, b);
    append(b, e);
    last = e;
  }
  if (last < cps.size()) append(last, cps.size());
  return pieces;
}

TEST(SplitPatternTest, Gpt2PatternSplitsAsExpected) {
  auto p = SplitPattern::FromRegex(SplitPattern::kGpt2Regex);
  ASSERT_TRUE(p.ok()) << p.status();
  const std::vector<std::string> want = {"Hello", " world", "'s", " ", " 123", "!!", "\n"};
  EXPECT_EQ(SplitPieces(*p, "Hello world's  123!!\n"), want);
}

TEST(SplitPatternTest, LongWhitespaceRunsSplitInLinearTime) {
  // `\s+$` and `\s+(?!\S)` backtrack over a whole run in a regex engine; a
  // million spaces must still split at once and correctly.
  const std::string text = std::string(1'000'000, ' ') + "x" + std::string(1'000'000, ' ') + "\ny";
  auto trailing = SplitPattern::FromRegex(R"(\s+$)");
  ASSERT_TRUE(trailing.ok()) << trailing.status();
  auto pieces = SplitPieces(*trailing, text);
  ASSERT_EQ(pieces.size(), 3u);
  EXPECT_EQ(pieces[0].size(), 1'000'001u);  // Not a match: text follows.
  EXPECT_EQ(pieces[1].size(), 1'000'000u);  // Up to, not including, the '\n'.
  EXPECT_EQ(pieces[2], "\ny");
  auto gpt2 = SplitPattern::FromRegex(SplitPattern::kGpt2Regex);
  ASSERT_TRUE(gpt2.ok());
  pieces = SplitPieces(*gpt2, text);
  const std::vector<size_t> sizes = {999'999, 2, 1'000'000, 1, 1};
  ASSERT_EQ(pieces.size(), sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) EXPECT_EQ(pieces[i].size(), sizes[i]) << i;
}

TEST(SplitPatternTest, UnknownPatternsAreAnErrorNamingThem) {
  for (const char* bad : {"(?<=a)b", "a{3,1}", "[z-a]", "\\p{Greek}", "(abc", "abc)", "*a", "a++",
                          "\\d+", "[[:alpha:]]", "[^abc]+", "\\s?[a-z]+x", "[a-z]{0,2}", "",
                          // A GPT-2 pattern with one alternative changed.
                          R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+)"}) {
    auto p = SplitPattern::FromRegex(bad);
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    if (!p.ok()) EXPECT_NE(p.status().message().find(bad), std::string::npos) << p.status();
  }
}

TEST(TokenizerJsonTest, AddedTokenStripAndSingleWordOptions) {
  auto tok = Tokenizer::FromHfJson(R"j({
      "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, " ": 2, "<x>": 3, "<unk>": 4},
                "merges": [], "unk_token": "<unk>"},
      "added_tokens": [{"id": 3, "content": "<x>", "special": true, "single_word": true,
                        "lstrip": true, "rstrip": true}]})j", "");
  ASSERT_TRUE(tok.ok()) << tok.status();
  // The whitespace on both sides goes with the token, Unicode spaces too.
  EXPECT_EQ(*(*tok)->Encode("a <x> b", false), (std::vector<int32_t>{0, 3, 1}));
  EXPECT_EQ(*(*tok)->Encode("a\u3000\t<x>\u00a0b", false), (std::vector<int32_t>{0, 3, 1}));
  // Inside a word it is not the added token.
  auto inside = (*tok)->Encode("a<x>b", false);
  ASSERT_TRUE(inside.ok());
  EXPECT_EQ(std::count(inside->begin(), inside->end(), 3), 0);
  EXPECT_TRUE((*tok)->IsSpecial(3));
}

TEST(TokenizerJsonTest, LlamaConfigDecidesBosAndEos) {
  const std::string json = ReadFileOrEmpty(std::string(PDSERVE_FIXTURES_DIR) + "/tokenizers/llama2/tokenizer.json");
  if (json.empty()) GTEST_SKIP() << "no llama2 fixture";
  // transformers rebuilds a LlamaTokenizerFast's template from these flags.
  auto tok = Tokenizer::FromHfJson(json, R"j({"tokenizer_class": "LlamaTokenizer", "bos_token": "<s>",
      "eos_token": "</s>", "add_bos_token": false, "add_eos_token": true})j");
  ASSERT_TRUE(tok.ok()) << tok.status();
  auto ids = (*tok)->Encode("hi", true);
  ASSERT_TRUE(ids.ok());
  ASSERT_FALSE(ids->empty());
  EXPECT_NE(ids->front(), 1);
  EXPECT_EQ(ids->back(), 2);
  auto plain = Tokenizer::FromHfJson(json, "");
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ((*plain)->Encode("hi", true)->front(), 1);  // tokenizer.json's own template.
}

TEST(TokenizerJsonTest, PunctuationAndDigitsPreTokenizers) {
  // Characters are their own tokens; the pre-tokenizers decide which pairs
  // may merge (no merge crosses a split).
  auto tok = Tokenizer::FromHfJson(R"j({
      "model": {"type": "BPE", "vocab": {"1": 0, "2": 1, "12": 2, "!": 3, "?": 4, "!?": 5},
                "merges": ["1 2", "! ?"]},
      "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
          {"type": "Digits", "individual_digits": true},
          {"type": "Punctuation", "behavior": "Contiguous"}]}})j", "");
  ASSERT_TRUE(tok.ok()) << tok.status();
  EXPECT_EQ(*(*tok)->Encode("12!?", false), (std::vector<int32_t>{0, 1, 5}));
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
