// SplitPattern: the text-splitting rules tokenizers apply before BPE (the
// `Split` pre-tokenizer's regex, ByteLevel's GPT-2 regex, Digits,
// Punctuation, and the rules llama.cpp names in `tokenizer.ggml.pre`).
//
// There is no general regex engine here on purpose: each known pattern is a
// small hand-written scanner that reproduces Oniguruma's leftmost-first
// backtracking result (what Hugging Face `tokenizers` runs) in linear time.
// FromRegex recognizes
//   - GPT-2's pattern (with or without the trailing `|\s+`),
//   - Llama 3's and Qwen2's patterns (digits in runs of 1..3, or singly),
//   - `\s+$`, `\s+(?!\S)`,
//   - character-class runs: an optional leading `\s?`, then `\p{X}` or a
//     bracket class of literal characters, ranges, escapes and \p{L|N|P},
//     then `+`, `{n}`, `{n,m}` or nothing (e.g. DeepSeek's letter and CJK
//     classes, `\p{N}+`, Falcon's punctuation, `[\r\n]`, `[0-9]{3}`),
//   - `[0-9][0-9][0-9]`,
// and answers INVALID_ARGUMENT naming any other pattern.
//
// Thread-safety: immutable after construction; FindAll may run concurrently.
#ifndef PDSERVE_ENGINE_SPLIT_PATTERN_H_
#define PDSERVE_ENGINE_SPLIT_PATTERN_H_

#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace pdserve {

class SplitPattern {
 public:
  // The pattern ByteLevel uses when `use_regex` is true.
  static constexpr std::string_view kGpt2Regex =
      R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

  // Recognizes one of the patterns listed above.
  static absl::StatusOr<SplitPattern> FromRegex(std::string_view regex);
  // A `{"String": ...}` pattern: every occurrence of `literal` (not empty).
  static SplitPattern FromLiteral(std::u32string literal);
  // Hugging Face's Punctuation pre-tokenizer: ASCII punctuation or \p{P};
  // one character per match, or whole runs when `contiguous`.
  static SplitPattern Punctuation(bool contiguous);
  // Hugging Face's Digits pre-tokenizer (\p{N}): singly or in runs.
  static SplitPattern Digits(bool individual);

  // Appends the successive non-overlapping leftmost matches in `text` as
  // [begin, end) code point index pairs. No pattern matches the empty string.
  void FindAll(std::span<const char32_t> text,
               std::vector<std::pair<size_t, size_t>>& matches) const;

 private:
  enum class Kind {
    kGpt2,
    kLlama3,
    kTrailingSpace,
    kSpaceNotBeforeText,
    kClassRun,
    kLiteral
  };

  // A set of code points: ranges plus whole general categories.
  struct CharSet {
    std::vector<std::pair<char32_t, char32_t>> ranges;  // Sorted, disjoint.
    bool letters = false, numbers = false, punctuation = false;
    bool Contains(char32_t cp) const;
  };

  struct State;  // Per-FindAll cache of the current whitespace run.

  SplitPattern() = default;
  // Length of the match starting exactly at `pos`, 0 for none.
  size_t MatchAt(std::span<const char32_t> text, size_t pos,
                 State& state) const;

  Kind kind_ = Kind::kLiteral;
  bool gpt2_space_tail_ = true;  // kGpt2: the pattern ends in `|\s+`.
  size_t max_digits_ = 3;        // kLlama3: \p{N}{1,3} (3) or \p{N} (1).
  CharSet set_;                  // kClassRun.
  bool leading_space_ = false;   // kClassRun: `\s?` before the class.
  size_t min_count_ = 1, max_count_ = 1;  // kClassRun repetition.
  std::u32string literal_;                // kLiteral.
};

}  // namespace pdserve

#endif  // PDSERVE_ENGINE_SPLIT_PATTERN_H_
