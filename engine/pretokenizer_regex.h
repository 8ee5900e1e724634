// PretokenizerRegex: the regular expressions that tokenizers use to split
// text before BPE (GPT-2, Llama 3, Qwen2, DeepSeek, ... `Split` patterns),
// matched over Unicode code points with Oniguruma's leftmost-first
// semantics, which is what Hugging Face `tokenizers` uses.
//
// Supported syntax: literals and escapes (\r \n \t \f \v, escaped
// punctuation), classes [...] with ranges, negation and \s \S \p{X} \P{X}
// (X in L N P M S), \s \S \p{X} \P{X} outside classes, groups (...) (?:...)
// (?i:...), lookahead (?=...) (?!...), alternation, greedy and lazy
// * + ? {n} {n,} {n,m}, anchors ^ $ (line anchors, as in Oniguruma). Case
// folding under (?i) is ASCII-only. Anything else fails to compile with a
// message naming it.
//
// Thread-safety: immutable after Compile(); FindAll may run concurrently.
#ifndef PDSERVE_ENGINE_PRETOKENIZER_REGEX_H_
#define PDSERVE_ENGINE_PRETOKENIZER_REGEX_H_

#include <cstddef>
#include <memory>
#include <span>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace pdserve {

class PretokenizerRegex {
 public:
  static absl::StatusOr<std::unique_ptr<PretokenizerRegex>> Compile(std::string_view pattern);
  ~PretokenizerRegex();

  // Appends the successive non-overlapping leftmost matches in `text` as
  // [begin, end) code point index pairs. INVALID_ARGUMENT if matching
  // needs more than a fixed number of steps (a pathological input).
  absl::Status FindAll(std::span<const char32_t> text,
                       std::vector<std::pair<size_t, size_t>>& matches) const;

  struct Program;

 private:
  explicit PretokenizerRegex(std::unique_ptr<Program> program);
  std::unique_ptr<Program> program_;
};

}  // namespace pdserve

#endif  // PDSERVE_ENGINE_PRETOKENIZER_REGEX_H_
