// Small helpers shared by the engine tests.
#ifndef PDSERVE_TESTS_ENGINE_TEST_UTIL_H_
#define PDSERVE_TESTS_ENGINE_TEST_UTIL_H_

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <optional>
#include <iterator>
#include <random>
#include <string>
#include <vector>

#include "engine/generator.h"
#include "gtest/gtest.h"

namespace pdserve::testing_util {

// Sets (or with nullopt unsets) environment variable `name` for the
// object's life, then puts back what was there, also when an assertion
// returns early.
class ScopedEnv {
 public:
  ScopedEnv(const char* name, std::optional<std::string> value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old;
    Set(value);
  }
  ~ScopedEnv() { Set(old_); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;

  void Set(const std::optional<std::string>& value) {
    if (value) {
      ::setenv(name_, value->c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }

 private:
  const char* const name_;
  std::optional<std::string> old_;
};

inline std::string ReadFileOrEmpty(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A prompt for builtin:tiny: its BOS (256), then n - 1 random byte tokens
// drawn from `seed`.
inline std::vector<int32_t> RandomPrompt(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> p = {256};
  while (static_cast<int>(p.size()) < n) p.push_back(static_cast<int32_t>(rng() % 256));
  return p;
}

// The tokens `request` generates run alone on a fresh Generator over
// `runner`: the engine's own (colocated) output.
inline std::vector<int32_t> GeneratedTokens(ModelRunner& runner, const GenerationRequest& request,
                                            const GeneratorOptions& options = {}) {
  auto g = Generator::Create(&runner, options);
  EXPECT_TRUE(g.ok()) << g.status();
  EXPECT_TRUE((*g)->Add(request).ok());
  std::vector<int32_t> out;
  std::vector<GenerationEvent> events;
  while ((*g)->HasWork()) {
    events.clear();
    EXPECT_TRUE((*g)->Step(events).ok());
    for (const auto& e : events) {
      if (e.has_token) out.push_back(e.token.token);
    }
  }
  return out;
}

// Greedy-decodes `max_tokens` tokens (EOS ignored) for one prompt.
inline std::vector<int32_t> GreedyTokens(ModelRunner& runner, const std::vector<int32_t>& prompt,
                                         int32_t max_tokens) {
  SamplingParams sp{.temperature = 0.0f, .max_tokens = max_tokens, .ignore_eos = true};
  return GeneratedTokens(runner, {RequestId(1), prompt, sp});
}

}  // namespace pdserve::testing_util

#endif  // PDSERVE_TESTS_ENGINE_TEST_UTIL_H_
