#include "engine/split_pattern.h"

#include <algorithm>
#include <limits>
#include <optional>

#include "absl/strings/str_cat.h"
#include "engine/unicode.h"

namespace pdserve {
namespace {

using unicode::Category;

constexpr size_t kNone = std::numeric_limits<size_t>::max();

constexpr std::string_view kGpt2RegexNoTail =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S))";
constexpr std::string_view kLlama3Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
constexpr std::string_view kQwen2Regex =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// ASCII first: almost all text the scanners see is ASCII.
bool IsSpace(char32_t c) {
  if (c < 0x80) return c == ' ' || (c >= '\t' && c <= '\r');
  return unicode::Is(c, Category::kWhiteSpace);
}
bool IsLetter(char32_t c) {
  if (c < 0x80) return (c | 0x20) >= 'a' && (c | 0x20) <= 'z';
  return unicode::Is(c, Category::kLetter);
}
bool IsNumber(char32_t c) {
  if (c < 0x80) return c >= '0' && c <= '9';
  return unicode::Is(c, Category::kNumber);
}
// [^\s\p{L}\p{N}]
bool IsOther(char32_t c) { return !IsSpace(c) && !IsLetter(c) && !IsNumber(c); }
bool IsAsciiPunctuation(char32_t c) {
  return (c >= '!' && c <= '/') || (c >= ':' && c <= '@') ||
         (c >= '[' && c <= '`') || (c >= '{' && c <= '~');
}

template <typename Pred>
size_t RunLength(std::span<const char32_t> text, size_t pos, Pred pred) {
  size_t e = pos;
  while (e < text.size() && pred(text[e])) ++e;
  return e - pos;
}

// 's|'t|'re|'ve|'m|'ll|'d at `pos`; under (?i) Oniguruma folds case with
// Unicode rules, where U+017F LATIN SMALL LETTER LONG S is an 's'.
size_t ContractionLength(std::span<const char32_t> text, size_t pos,
                         bool ignore_case) {
  if (text[pos] != '\'' || pos + 1 >= text.size()) return 0;
  auto fold = [ignore_case](char32_t c) -> char32_t {
    if (!ignore_case) return c;
    if (c >= 'A' && c <= 'Z') return c + 32;
    return c == 0x17F ? U's' : c;
  };
  const char32_t a = fold(text[pos + 1]);
  if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
  if (pos + 2 >= text.size()) return 0;
  const char32_t b = fold(text[pos + 2]);
  if ((a == 'r' && b == 'e') || (a == 'v' && b == 'e') ||
      (a == 'l' && b == 'l'))
    return 3;
  return 0;
}

// Reads the pattern one code point at a time (patterns are valid UTF-8 from
// a JSON string or a constant).
class PatternReader {
 public:
  explicit PatternReader(std::string_view pattern)
      : cps_(unicode::IsValidUtf8(pattern) ? unicode::DecodeUtf8(pattern)
                                           : std::vector<char32_t>()) {}
  bool done() const { return i_ >= cps_.size(); }
  char32_t peek(size_t ahead = 0) const {
    return i_ + ahead < cps_.size() ? cps_[i_ + ahead] : 0;
  }
  char32_t next() { return done() ? 0 : cps_[i_++]; }
  bool Consume(std::u32string_view s) {
    if (cps_.size() - i_ < s.size()) return false;
    if (!std::equal(s.begin(), s.end(), cps_.begin() + i_)) return false;
    i_ += s.size();
    return true;
  }
  std::optional<size_t> Number() {
    size_t n = 0, digits = 0;
    while (peek() >= '0' && peek() <= '9' && digits < 6)
      n = n * 10 + (next() - '0'), ++digits;
    return digits > 0 ? std::optional(n) : std::nullopt;
  }

 private:
  std::vector<char32_t> cps_;
  size_t i_ = 0;
};

}  // namespace

bool SplitPattern::CharSet::Contains(char32_t cp) const {
  auto it =
      std::upper_bound(ranges.begin(), ranges.end(), cp,
                       [](char32_t c, const auto& r) { return c < r.first; });
  if (it != ranges.begin() && cp <= (it - 1)->second) return true;
  return (letters && IsLetter(cp)) || (numbers && IsNumber(cp)) ||
         (punctuation && unicode::Is(cp, Category::kPunctuation));
}

// The whitespace run around the scan position, so that the lookahead-style
// alternatives (`\s+(?!\S)`, `\s*[\r\n]+`, `\s+$`) cost O(1) per position
// instead of rescanning a long run of spaces at every position in it.
struct SplitPattern::State {
  size_t run_begin = 0, run_end = 0;  // [begin, end); empty until loaded.
  size_t last_lf = kNone;             // Last '\n' in the run.
  size_t last_newline = kNone;        // Last '\r' or '\n' in the run.

  // `pos` must be whitespace.
  void Load(std::span<const char32_t> text, size_t pos) {
    if (pos >= run_begin && pos < run_end) return;
    run_begin = pos;
    last_lf = last_newline = kNone;
    size_t e = pos;
    for (; e < text.size() && IsSpace(text[e]); ++e) {
      if (text[e] == '\n') last_lf = e;
      if (text[e] == '\n' || text[e] == '\r') last_newline = e;
    }
    run_end = e;
  }
  // `\s+(?!\S)` at `pos` (whitespace): the run, less its last character
  // when text follows it.
  size_t SpaceNotBeforeText(std::span<const char32_t> text, size_t pos) {
    Load(text, pos);
    if (run_end == text.size()) return run_end - pos;
    return run_end - pos >= 2 ? run_end - pos - 1 : 0;
  }
  // `\s*[\r\n]+` at `pos`: backtracking ends the match just after the last
  // newline character of the run.
  size_t SpaceThroughNewline(std::span<const char32_t> text, size_t pos) {
    Load(text, pos);
    return last_newline != kNone && last_newline >= pos ? last_newline + 1 - pos
                                                        : 0;
  }
  // `\s+$` at `pos`, `$` being Oniguruma's end of line (before a '\n', or
  // the end of the text).
  size_t SpaceToLineEnd(std::span<const char32_t> text, size_t pos) {
    Load(text, pos);
    if (run_end == text.size()) return run_end - pos;
    return last_lf != kNone && last_lf > pos ? last_lf - pos : 0;
  }
};

absl::StatusOr<SplitPattern> SplitPattern::FromRegex(std::string_view regex) {
  SplitPattern p;
  if (regex == kGpt2Regex || regex == kGpt2RegexNoTail) {
    p.kind_ = Kind::kGpt2;
    p.gpt2_space_tail_ = regex == kGpt2Regex;
    return p;
  }
  if (regex == kLlama3Regex || regex == kQwen2Regex) {
    p.kind_ = Kind::kLlama3;
    p.max_digits_ = regex == kLlama3Regex ? 3 : 1;
    return p;
  }
  if (regex == R"(\s+$)") {
    p.kind_ = Kind::kTrailingSpace;
    return p;
  }
  if (regex == R"(\s+(?!\S))") {
    p.kind_ = Kind::kSpaceNotBeforeText;
    return p;
  }
  if (regex == "[0-9][0-9][0-9]") {
    p.kind_ = Kind::kClassRun;
    p.set_.ranges = {{'0', '9'}};
    p.min_count_ = p.max_count_ = 3;
    return p;
  }

  // A character-class run: [\s?] (\p{X} | [...]) [+ | {n} | {n,m}].
  auto unsupported = [regex](std::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("tokenizer: unsupported Split regex '", std::string(regex),
                     "' (", std::string(why), ")"));
  };
  if (!unicode::IsValidUtf8(regex)) return unsupported("not UTF-8");
  PatternReader r(regex);
  p.kind_ = Kind::kClassRun;
  p.leading_space_ = r.Consume(U"\\s?");
  // \p{L} / \p{N} / \p{P}, shared by classes and bare atoms.
  auto category = [&](CharSet& set) -> bool {
    if (r.Consume(U"\\p{L}")) return set.letters = true;
    if (r.Consume(U"\\p{N}")) return set.numbers = true;
    if (r.Consume(U"\\p{P}")) return set.punctuation = true;
    return false;
  };
  // One literal code point inside a class, escapes resolved.
  auto literal = [&]() -> std::optional<char32_t> {
    const char32_t c = r.next();
    if (c != '\\') return c == 0 || c == ']' ? std::nullopt : std::optional(c);
    const char32_t e = r.next();
    switch (e) {
      case 'r':
        return U'\r';
      case 'n':
        return U'\n';
      case 't':
        return U'\t';
      case 'f':
        return U'\f';
      case 'v':
        return U'\v';
      default:
        if (e < 0x80 && IsAsciiPunctuation(e)) return e;
        return std::nullopt;  // \s, \d, \w, \u... are not implemented.
    }
  };
  if (r.peek() == '[') {
    r.next();
    if (r.peek() == '^') return unsupported("negated class");
    while (r.peek() != ']') {
      if (r.done()) return unsupported("unterminated class");
      if (category(p.set_)) continue;
      const std::optional<char32_t> lo = literal();
      if (!lo) return unsupported("class item");
      char32_t hi = *lo;
      if (r.peek() == '-' && r.peek(1) != ']') {
        r.next();
        const std::optional<char32_t> h = literal();
        if (!h || *h < *lo) return unsupported("class range");
        hi = *h;
      }
      p.set_.ranges.push_back({*lo, hi});
    }
    r.next();
  } else if (!category(p.set_)) {
    return unsupported("not a known pattern");
  }
  if (r.Consume(U"+")) {
    p.min_count_ = 1;
    p.max_count_ = kNone;
  } else if (r.Consume(U"{")) {
    const std::optional<size_t> lo = r.Number();
    std::optional<size_t> hi = lo;
    if (r.Consume(U",")) hi = r.Number();
    if (!lo || !hi || *lo == 0 || *hi < *lo || !r.Consume(U"}"))
      return unsupported("repetition");
    p.min_count_ = *lo;
    p.max_count_ = *hi;
  }
  if (!r.done()) return unsupported("not a known pattern");
  // Sort and merge the ranges for binary search.
  auto& ranges = p.set_.ranges;
  std::sort(ranges.begin(), ranges.end());
  std::vector<std::pair<char32_t, char32_t>> merged;
  for (const auto& range : ranges) {
    if (!merged.empty() && range.first <= merged.back().second + 1) {
      merged.back().second = std::max(merged.back().second, range.second);
    } else {
      merged.push_back(range);
    }
  }
  ranges = std::move(merged);
  return p;
}

SplitPattern SplitPattern::FromLiteral(std::u32string literal) {
  SplitPattern p;
  p.kind_ = Kind::kLiteral;
  p.literal_ = std::move(literal);
  return p;
}

SplitPattern SplitPattern::Punctuation(bool contiguous) {
  SplitPattern p;
  p.kind_ = Kind::kClassRun;
  p.set_.punctuation = true;
  // ASCII punctuation that Unicode files under symbols: $ + < = > ^ ` | ~.
  p.set_.ranges = {{'$', '$'}, {'+', '+'}, {'<', '>'}, {'^', '^'},
                   {'`', '`'}, {'|', '|'}, {'~', '~'}};
  p.max_count_ = contiguous ? kNone : 1;
  return p;
}

SplitPattern SplitPattern::Digits(bool individual) {
  SplitPattern p;
  p.kind_ = Kind::kClassRun;
  p.set_.numbers = true;
  p.max_count_ = individual ? 1 : kNone;
  return p;
}

size_t SplitPattern::MatchAt(std::span<const char32_t> text, size_t pos,
                             State& state) const {
  const size_t n = text.size();
  const char32_t c = text[pos];
  const bool space_then =
      c == ' ' && pos + 1 < n;  // For the ` ?X+` alternatives.
  switch (kind_) {
    case Kind::kGpt2: {
      // 's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+|
      // ?[^\s\p{L}\p{N}]+|\s+(?!\S)[|\s+]
      if (size_t len = ContractionLength(text, pos, /*ignore_case=*/false))
        return len;
      for (bool (*is)(char32_t) : {IsLetter, IsNumber, IsOther}) {
        if (space_then && is(text[pos + 1]))
          return 1 + RunLength(text, pos + 1, is);
        if (is(c)) return RunLength(text, pos, is);
      }
      if (!IsSpace(c)) return 0;
      if (size_t len = state.SpaceNotBeforeText(text, pos)) return len;
      return gpt2_space_tail_ ? state.run_end - pos : 0;
    }
    case Kind::kLlama3: {
      // (?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}|
      //  ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+
      if (size_t len = ContractionLength(text, pos, /*ignore_case=*/true))
        return len;
      if (IsLetter(c)) return RunLength(text, pos, IsLetter);
      if (c != '\r' && c != '\n' && !IsNumber(c) && pos + 1 < n &&
          IsLetter(text[pos + 1])) {
        return 1 + RunLength(text, pos + 1, IsLetter);
      }
      if (IsNumber(c))
        return std::min(RunLength(text, pos, IsNumber), max_digits_);
      const size_t start = space_then && IsOther(text[pos + 1]) ? pos + 1 : pos;
      if (IsOther(text[start])) {
        size_t e = start + RunLength(text, start, IsOther);
        e += RunLength(text, e,
                       [](char32_t x) { return x == '\r' || x == '\n'; });
        return e - pos;
      }
      if (!IsSpace(c)) return 0;
      if (size_t len = state.SpaceThroughNewline(text, pos)) return len;
      if (size_t len = state.SpaceNotBeforeText(text, pos)) return len;
      return state.run_end - pos;
    }
    case Kind::kTrailingSpace:
      return IsSpace(c) ? state.SpaceToLineEnd(text, pos) : 0;
    case Kind::kSpaceNotBeforeText:
      return IsSpace(c) ? state.SpaceNotBeforeText(text, pos) : 0;
    case Kind::kClassRun: {
      auto run = [&](size_t from) {
        size_t e = from;
        while (e < n && e - from < max_count_ && set_.Contains(text[e])) ++e;
        return e - from;
      };
      // `\s?` is greedy: it takes the space when the class can follow it.
      if (leading_space_ && pos + 1 < n && IsSpace(c)) {
        if (size_t len = run(pos + 1); len >= min_count_) return 1 + len;
      }
      const size_t len = run(pos);
      return len >= min_count_ ? len : 0;
    }
    case Kind::kLiteral:
      if (literal_.empty() || n - pos < literal_.size()) return 0;
      return std::equal(literal_.begin(), literal_.end(), text.begin() + pos)
                 ? literal_.size()
                 : 0;
  }
  return 0;
}

void SplitPattern::FindAll(
    std::span<const char32_t> text,
    std::vector<std::pair<size_t, size_t>>& matches) const {
  State state;
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t len = MatchAt(text, pos, state);
    if (len == 0) {
      ++pos;
      continue;
    }
    matches.emplace_back(pos, pos + len);
    pos += len;
  }
}

}  // namespace pdserve
