// The real trained stories260K model, converted from llama2.c to Hugging
// Face layout, greedy from BOS: the published text, and token for token the
// greedy output of transformers on the same converted directory
// (tests/fixtures/stories260k_greedy.json, from
// tools/check_llama2c_with_transformers.py).
#include <filesystem>
#include <fstream>

#include "engine/cpu/cpu_kernels.h"
#include "engine/generator.h"
#include "engine/model.h"
#include "engine/model_files/llama2c.h"
#include "engine/model_runner.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/engine/test_util.h"

namespace pdserve {
namespace {

namespace fs = std::filesystem;

constexpr char kPublished[] =
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park.";

TEST(Stories260kTest, GreedyFromBosIsThePublishedText) {
  // The copy shipped in the repository (deploy/models/stories260K).
  const fs::path src = fs::path(PDSERVE_MODELS_DIR) / "stories260K";
  const fs::path dir = fs::path(PDSERVE_BINARY_DIR) / "test-models/stories260K";
  ASSERT_TRUE(ConvertLlama2cToHf(src / "stories260K.bin", src / "tok512.bin", dir).ok());
  auto model = Model::Load(dir.string());
  ASSERT_TRUE(model.ok()) << model.status();
  ASSERT_NE((*model)->tokenizer(), nullptr);

  const std::string fixture =
      testing_util::ReadFileOrEmpty(std::string(PDSERVE_FIXTURES_DIR) + "/stories260k_greedy.json");
  ASSERT_FALSE(fixture.empty());
  const nlohmann::json ref = nlohmann::json::parse(fixture);
  const auto want = ref["tokens"].get<std::vector<int32_t>>();
  ASSERT_GE(want.size(), 100u);

  auto runner = CreateModelRunner(*model, {.num_kv_blocks = 32, .block_size = 16, .num_threads = 2});
  ASSERT_TRUE(runner.ok());
  const std::vector<int32_t> got = testing_util::GreedyTokens(
      **runner, ref["prompt_ids"].get<std::vector<int32_t>>(), static_cast<int32_t>(want.size()));
  EXPECT_EQ(got, want);

  auto text = (*model)->tokenizer()->Decode(got, /*skip_special_tokens=*/true);
  ASSERT_TRUE(text.ok());
  EXPECT_TRUE(text->starts_with(kPublished)) << *text;
  // Streaming gives the same text.
  IncrementalDetokenizer detok(*(*model)->tokenizer(), true);
  std::string streamed;
  for (int32_t id : got) streamed += *detok.Append(id);
  streamed += detok.Flush();
  EXPECT_EQ(streamed, *text);
}

// Int8 weights (ModelRunnerOptions::int8_weights) on every kernel set this
// CPU runs: greedy from BOS is still the published text, and how far it
// follows transformers' fp32 tokens is printed.
TEST(Stories260kTest, Int8WeightsKeepThePublishedTextOnEveryKernelSet) {
  const fs::path src = fs::path(PDSERVE_MODELS_DIR) / "stories260K";
  const fs::path dir = fs::path(PDSERVE_BINARY_DIR) / "test-models/stories260K-int8";
  ASSERT_TRUE(ConvertLlama2cToHf(src / "stories260K.bin", src / "tok512.bin", dir).ok());
  auto model = Model::Load(dir.string());
  ASSERT_TRUE(model.ok()) << model.status();
  const nlohmann::json ref = nlohmann::json::parse(
      testing_util::ReadFileOrEmpty(std::string(PDSERVE_FIXTURES_DIR) + "/stories260k_greedy.json"));
  const auto want = ref["tokens"].get<std::vector<int32_t>>();
  testing_util::ScopedEnv env("PDSERVE_CPU_ISA", std::nullopt);
  for (cpu::CpuIsa isa : cpu::kAllCpuIsas) {
    if (!cpu::CpuRuns(isa)) {
      std::cout << "int8 weights: this CPU has no " << cpu::CpuIsaName(isa) << "\n";
      continue;
    }
    SCOPED_TRACE(cpu::CpuIsaName(isa));
    env.Set(std::string(cpu::CpuIsaName(isa)));
    auto runner = CreateModelRunner(
        *model, {.num_kv_blocks = 32, .block_size = 16, .num_threads = 2, .int8_weights = true});
    ASSERT_TRUE(runner.ok()) << runner.status();
    const std::vector<int32_t> got = testing_util::GreedyTokens(
        **runner, ref["prompt_ids"].get<std::vector<int32_t>>(), static_cast<int32_t>(want.size()));
    auto text = (*model)->tokenizer()->Decode(got, /*skip_special_tokens=*/true);
    ASSERT_TRUE(text.ok());
    EXPECT_TRUE(text->starts_with(kPublished)) << *text;
    size_t same = 0;
    while (same < got.size() && got[same] == want[same]) ++same;
    std::cout << "int8 weights, " << cpu::CpuIsaName(isa) << " kernels: the first " << same
              << " of " << want.size() << " greedy tokens are transformers' fp32 ones\n";
  }
}

}  // namespace
}  // namespace pdserve
