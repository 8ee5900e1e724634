// Every tokenizer case that llama.cpp ships with its vocabulary files
// (../shared/tokenizers/llama.cpp-vocab): each .inp case must encode to the
// ids on the matching line of the .out file, exactly. The vocabularies are
// read straight from the GGUF files.
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "engine/tokenizer.h"
#include "gtest/gtest.h"
#include "tests/engine/test_util.h"

namespace pdserve {
namespace {

namespace fs = std::filesystem;

const fs::path kVocabDir = fs::path(PDSERVE_SHARED_DIR) / "tokenizers/llama.cpp-vocab";

using testing_util::ReadFileOrEmpty;

class LlamaCppVocabTest : public ::testing::TestWithParam<std::string> {};

TEST_P(LlamaCppVocabTest, EveryCaseEncodesToTheExpectedIds) {
  const fs::path gguf = kVocabDir / ("ggml-vocab-" + GetParam() + ".gguf");
  if (!fs::exists(gguf)) GTEST_SKIP() << "no " << gguf;
  auto tok = Tokenizer::FromGguf(gguf);
  ASSERT_TRUE(tok.ok()) << tok.status();

  std::vector<std::string> cases =
      absl::StrSplit(ReadFileOrEmpty(gguf.string() + ".inp"), "\n__ggml_vocab_test__\n");
  std::vector<std::string> expected = absl::StrSplit(ReadFileOrEmpty(gguf.string() + ".out"), '\n');
  ASSERT_FALSE(cases.empty());
  if (cases.back().empty()) cases.pop_back();  // After the last separator.
  ASSERT_GE(expected.size(), cases.size());
  int passed = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    auto ids = (*tok)->Encode(cases[i], /*add_special_tokens=*/false);
    ASSERT_TRUE(ids.ok()) << ids.status();
    const std::string got = ids->empty() ? "" : " " + absl::StrJoin(*ids, " ");
    std::string want = expected[i];
    if (!want.empty() && want[0] != ' ') want = " " + want;
    EXPECT_EQ(got, want) << "case " << i << ": '" << cases[i] << "'";
    passed += got == want;
  }
  std::cout << GetParam() << ": " << passed << "/" << cases.size() << " cases\n";
}

INSTANTIATE_TEST_SUITE_P(Vocabularies, LlamaCppVocabTest,
                         ::testing::Values("llama-spm", "phi-3", "gpt-2", "falcon", "mpt",
                                           "refact", "deepseek-llm"),
                         [](const auto& info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), '-', '_');
                           return name;
                         });

}  // namespace
}  // namespace pdserve
