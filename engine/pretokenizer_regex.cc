#include "engine/pretokenizer_regex.h"

#include <optional>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "engine/unicode.h"

namespace pdserve {
namespace {

using unicode::Category;

// Steps one FindAll may take; far above what real text needs with the
// patterns tokenizers use, low enough to stop a pathological input.
constexpr int64_t kStepBudgetPerCodePoint = 20000;

struct ClassItem {
  bool is_category = false;
  bool negate = false;  // \S, \P{..}
  char32_t lo = 0, hi = 0;
  Category category = Category::kLetter;
};

struct CharClass {
  std::vector<ClassItem> items;
  bool negated = false;
  bool icase = false;
};

enum class Op { kChar, kClass, kAny, kSplit, kJmp, kMatch, kLook, kBol, kEol };

struct Inst {
  Op op;
  int x = 0, y = 0;       // Jump targets (kSplit prefers x; kLook: sub, next).
  char32_t ch = 0;        // kChar
  bool flag = false;      // kChar: case-insensitive; kLook: negative.
};

char32_t FoldAscii(char32_t c) { return c >= 'A' && c <= 'Z' ? c + 32 : c; }

bool ItemMatches(const ClassItem& it, char32_t c) {
  const bool m = it.is_category ? unicode::Is(c, it.category) : (c >= it.lo && c <= it.hi);
  return m != it.negate;
}

bool ClassMatches(const CharClass& cls, char32_t c) {
  bool m = false;
  for (const ClassItem& it : cls.items) {
    if (ItemMatches(it, c) ||
        (cls.icase && c < 128 &&
         (ItemMatches(it, FoldAscii(c)) ||
          (c >= 'a' && c <= 'z' && ItemMatches(it, c - 32))))) {
      m = true;
      break;
    }
  }
  return m != cls.negated;
}

// Parses the pattern and emits code directly into a Program.
class Compiler {
 public:
  explicit Compiler(std::u32string pattern) : p_(std::move(pattern)) {}

  absl::Status Compile(std::vector<Inst>& code, std::vector<CharClass>& classes) {
    code_ = &code;
    classes_ = &classes;
    PD_RETURN_IF_ERROR(Alternation(false));
    if (i_ != p_.size()) return Error("unbalanced ')'");
    Emit({Op::kMatch});
    return absl::OkStatus();
  }

 private:
  // A piece of emitted code, [begin, end) in code_.
  struct Span {
    size_t begin, end;
  };

  absl::Status Error(std::string_view what) const {
    return absl::InvalidArgumentError(absl::StrCat("pre-tokenizer regex: ", std::string(what),
                                                   " at position ", i_));
  }
  bool AtEnd() const { return i_ >= p_.size(); }
  char32_t Peek() const { return p_[i_]; }
  int Emit(Inst inst) {
    code_->push_back(inst);
    return static_cast<int>(code_->size() - 1);
  }
  int Here() const { return static_cast<int>(code_->size()); }

  absl::Status Alternation(bool icase) {
    std::vector<int> jumps_to_end;
    while (true) {
      const int split = Emit({Op::kSplit});
      (*code_)[split].x = Here();
      PD_RETURN_IF_ERROR(Sequence(icase));
      if (AtEnd() || Peek() != '|') {
        // Last alternative: its split is unnecessary; make it a no-op jump.
        (*code_)[split] = {Op::kJmp, split + 1};
        break;
      }
      ++i_;  // '|'
      jumps_to_end.push_back(Emit({Op::kJmp}));
      (*code_)[split].y = Here();
    }
    for (int j : jumps_to_end) (*code_)[j].x = Here();
    return absl::OkStatus();
  }

  absl::Status Sequence(bool icase) {
    while (!AtEnd() && Peek() != '|' && Peek() != ')') {
      const size_t atom_begin = code_->size();
      const size_t pattern_pos = i_;
      PD_RETURN_IF_ERROR(Atom(icase));
      PD_RETURN_IF_ERROR(Quantifier(atom_begin, pattern_pos, icase));
    }
    return absl::OkStatus();
  }

  absl::Status Atom(bool icase) {
    const char32_t c = p_[i_++];
    switch (c) {
      case '(':
        return Group(icase);
      case '[':
        return Class(icase);
      case '.': {
        // Oniguruma's '.' excludes newline.
        CharClass cls;
        cls.negated = true;
        cls.items.push_back({.lo = '\n', .hi = '\n'});
        Emit({Op::kClass, static_cast<int>(AddClass(std::move(cls)))});
        return absl::OkStatus();
      }
      case '^':
        Emit({Op::kBol});
        return absl::OkStatus();
      case '$':
        Emit({Op::kEol});
        return absl::OkStatus();
      case '\\': {
        std::optional<ClassItem> item;
        char32_t literal = 0;
        PD_RETURN_IF_ERROR(Escape(item, literal));
        if (item) {
          CharClass cls;
          cls.items.push_back(*item);
          Emit({Op::kClass, static_cast<int>(AddClass(std::move(cls)))});
        } else {
          Emit({Op::kChar, 0, 0, literal, icase});
        }
        return absl::OkStatus();
      }
      case '*':
      case '+':
      case '?':
      case '{':
        return Error("quantifier with nothing to repeat");
      default:
        Emit({Op::kChar, 0, 0, c, icase});
        return absl::OkStatus();
    }
  }

  absl::Status Group(bool icase) {
    bool look = false, negative = false;
    if (!AtEnd() && Peek() == '?') {
      ++i_;
      if (AtEnd()) return Error("unterminated group");
      const char32_t k = p_[i_++];
      if (k == ':') {
      } else if (k == '=' || k == '!') {
        look = true;
        negative = k == '!';
      } else if (k == 'i' && !AtEnd() && Peek() == ':') {
        ++i_;
        icase = true;
      } else {
        return Error("unsupported group kind (lookbehind, inline flags, named groups)");
      }
    }
    int look_inst = -1;
    if (look) look_inst = Emit({Op::kLook, 0, 0, 0, negative});
    if (look) (*code_)[look_inst].x = Here();
    PD_RETURN_IF_ERROR(Alternation(icase));
    if (AtEnd() || Peek() != ')') return Error("missing ')'");
    ++i_;
    if (look) {
      Emit({Op::kMatch});
      (*code_)[look_inst].y = Here();
    }
    return absl::OkStatus();
  }

  // After a backslash: a class shortcut (item set) or a literal.
  absl::Status Escape(std::optional<ClassItem>& item, char32_t& literal) {
    if (AtEnd()) return Error("trailing backslash");
    const char32_t c = p_[i_++];
    switch (c) {
      case 's':
      case 'S':
        item = ClassItem{.is_category = true, .negate = c == 'S', .category = Category::kWhiteSpace};
        return absl::OkStatus();
      case 'p':
      case 'P': {
        if (AtEnd() || Peek() != '{') return Error("expected '{' after \\p");
        const size_t close = p_.find('}', i_);
        if (close == std::u32string::npos) return Error("unterminated \\p{");
        const std::u32string name = p_.substr(i_ + 1, close - i_ - 1);
        i_ = close + 1;
        Category cat;
        if (name == U"L") cat = Category::kLetter;
        else if (name == U"N") cat = Category::kNumber;
        else if (name == U"P") cat = Category::kPunctuation;
        else if (name == U"M") cat = Category::kMark;
        else if (name == U"S") cat = Category::kSymbol;
        else return Error("unsupported Unicode property (supported: L, N, P, M, S)");
        item = ClassItem{.is_category = true, .negate = c == 'P', .category = cat};
        return absl::OkStatus();
      }
      case 'r': literal = '\r'; return absl::OkStatus();
      case 'n': literal = '\n'; return absl::OkStatus();
      case 't': literal = '\t'; return absl::OkStatus();
      case 'f': literal = '\f'; return absl::OkStatus();
      case 'v': literal = '\v'; return absl::OkStatus();
      default:
        if ((c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) {
          return Error(absl::StrCat("unsupported escape \\", std::string(1, static_cast<char>(c))));
        }
        literal = c;  // Escaped punctuation or any other symbol.
        return absl::OkStatus();
    }
  }

  absl::Status Class(bool icase) {
    CharClass cls;
    cls.icase = icase;
    if (!AtEnd() && Peek() == '^') {
      cls.negated = true;
      ++i_;
    }
    bool first = true;
    while (true) {
      if (AtEnd()) return Error("unterminated character class");
      char32_t c = p_[i_++];
      if (c == ']' && !first) break;
      first = false;
      if (c == '[') return Error("nested character classes are not supported");
      if (c == '\\') {
        std::optional<ClassItem> item;
        PD_RETURN_IF_ERROR(Escape(item, c));
        if (item) {
          cls.items.push_back(*item);
          continue;
        }
      }
      char32_t hi = c;
      if (i_ + 1 < p_.size() && Peek() == '-' && p_[i_ + 1] != ']') {
        i_ += 1;
        hi = p_[i_++];
        if (hi == '\\') {
          std::optional<ClassItem> item;
          PD_RETURN_IF_ERROR(Escape(item, hi));
          if (item) return Error("class shortcut as a range end");
        }
        if (hi < c) return Error("reversed range in character class");
      }
      cls.items.push_back({.lo = c, .hi = hi});
    }
    Emit({Op::kClass, static_cast<int>(AddClass(std::move(cls)))});
    return absl::OkStatus();
  }

  size_t AddClass(CharClass cls) {
    classes_->push_back(std::move(cls));
    return classes_->size() - 1;
  }

  absl::StatusOr<int> Number() {
    int v = 0;
    bool any = false;
    while (!AtEnd() && Peek() >= '0' && Peek() <= '9') {
      v = v * 10 + static_cast<int>(Peek() - '0');
      if (v > 1000) return Error("repeat count too large");
      ++i_;
      any = true;
    }
    if (!any) return -1;
    return v;
  }

  // Applies a quantifier (if any) to the atom just emitted at
  // [atom_begin, end), re-parsing the atom's pattern text for each copy.
  absl::Status Quantifier(size_t atom_begin, size_t pattern_pos, bool icase) {
    if (AtEnd()) return absl::OkStatus();
    int min, max;
    const char32_t q = Peek();
    if (q == '*') { min = 0; max = -1; ++i_; }
    else if (q == '+') { min = 1; max = -1; ++i_; }
    else if (q == '?') { min = 0; max = 1; ++i_; }
    else if (q == '{') {
      const size_t save = i_;
      ++i_;
      PD_ASSIGN_OR_RETURN(min, Number());
      if (min < 0) { i_ = save; return Error("malformed {n,m}"); }
      max = min;
      if (!AtEnd() && Peek() == ',') {
        ++i_;
        PD_ASSIGN_OR_RETURN(max, Number());
      }
      if (AtEnd() || Peek() != '}') return Error("malformed {n,m}");
      ++i_;
      if (max != -1 && max < min) return Error("{n,m} with m < n");
    } else {
      return absl::OkStatus();
    }
    bool greedy = true;
    if (!AtEnd() && Peek() == '?') { greedy = false; ++i_; }
    else if (!AtEnd() && Peek() == '+') return Error("possessive quantifiers are not supported");
    if (!AtEnd() && (Peek() == '*' || Peek() == '+' || Peek() == '{')) return Error("nested quantifier");
    const size_t after_quantifier = i_;

    // Emit: min mandatory copies, then optional ones (or a loop).
    code_->resize(atom_begin);
    auto emit_atom = [&]() -> absl::Status {
      i_ = pattern_pos;
      return Atom(icase);
    };
    for (int k = 0; k < min; ++k) PD_RETURN_IF_ERROR(emit_atom());
    if (max == -1) {
      const int loop = Emit({Op::kSplit});
      PD_RETURN_IF_ERROR(emit_atom());
      Emit({Op::kJmp, loop});
      SetSplit(loop, loop + 1, Here(), greedy);
    } else {
      std::vector<int> splits;
      for (int k = min; k < max; ++k) {
        splits.push_back(Emit({Op::kSplit}));
        PD_RETURN_IF_ERROR(emit_atom());
      }
      for (int s : splits) SetSplit(s, s + 1, Here(), greedy);
    }
    i_ = after_quantifier;
    return absl::OkStatus();
  }

  void SetSplit(int at, int body, int out, bool greedy) {
    (*code_)[at].x = greedy ? body : out;
    (*code_)[at].y = greedy ? out : body;
  }

  std::u32string p_;
  size_t i_ = 0;
  std::vector<Inst>* code_ = nullptr;
  std::vector<CharClass>* classes_ = nullptr;
};

}  // namespace

struct PretokenizerRegex::Program {
  std::vector<Inst> code;
  std::vector<CharClass> classes;

  // Runs from `pc` at `pos`; the end of the first match in priority order,
  // or -1. `budget` counts down steps; -2 when it runs out.
  int64_t Run(int pc, size_t pos, std::span<const char32_t> text, int64_t& budget,
              std::vector<std::pair<int, size_t>>& stack) const {
    const size_t base = stack.size();
    const size_t n = text.size();
    while (true) {
      if (--budget < 0) {
        stack.resize(base);
        return -2;
      }
      const Inst& in = code[pc];
      bool ok = true;
      switch (in.op) {
        case Op::kChar:
          ok = pos < n && (in.flag ? FoldAscii(text[pos]) == FoldAscii(in.ch) : text[pos] == in.ch);
          if (ok) { ++pos; ++pc; }
          break;
        case Op::kClass:
          ok = pos < n && ClassMatches(classes[in.x], text[pos]);
          if (ok) { ++pos; ++pc; }
          break;
        case Op::kAny:
          ok = pos < n;
          if (ok) { ++pos; ++pc; }
          break;
        case Op::kSplit:
          stack.push_back({in.y, pos});
          pc = in.x;
          break;
        case Op::kJmp:
          pc = in.x;
          break;
        case Op::kMatch:
          stack.resize(base);
          return static_cast<int64_t>(pos);
        case Op::kLook: {
          const int64_t r = Run(in.x, pos, text, budget, stack);
          if (r == -2) {
            stack.resize(base);
            return -2;
          }
          ok = (r >= 0) != in.flag;
          if (ok) pc = in.y;
          break;
        }
        case Op::kBol:
          ok = pos == 0 || text[pos - 1] == '\n';
          if (ok) ++pc;
          break;
        case Op::kEol:
          ok = pos == n || text[pos] == '\n';
          if (ok) ++pc;
          break;
      }
      if (!ok) {
        if (stack.size() == base) return -1;
        std::tie(pc, pos) = stack.back();
        stack.pop_back();
      }
    }
  }
};

PretokenizerRegex::PretokenizerRegex(std::unique_ptr<Program> program)
    : program_(std::move(program)) {}
PretokenizerRegex::~PretokenizerRegex() = default;

absl::StatusOr<std::unique_ptr<PretokenizerRegex>> PretokenizerRegex::Compile(
    std::string_view pattern) {
  if (!unicode::IsValidUtf8(pattern)) {
    return absl::InvalidArgumentError("pre-tokenizer regex is not valid UTF-8");
  }
  const std::vector<char32_t> cps = unicode::DecodeUtf8(pattern);
  auto program = std::make_unique<Program>();
  Compiler compiler(std::u32string(cps.begin(), cps.end()));
  PD_RETURN_IF_ERROR(compiler.Compile(program->code, program->classes));
  return std::unique_ptr<PretokenizerRegex>(new PretokenizerRegex(std::move(program)));
}

absl::Status PretokenizerRegex::FindAll(std::span<const char32_t> text,
                                        std::vector<std::pair<size_t, size_t>>& matches) const {
  std::vector<std::pair<int, size_t>> stack;
  int64_t budget = kStepBudgetPerCodePoint * static_cast<int64_t>(text.size() + 1);
  size_t pos = 0;
  while (pos < text.size()) {
    const int64_t end = program_->Run(0, pos, text, budget, stack);
    if (end == -2) {
      return absl::InvalidArgumentError("text too expensive to pre-tokenize");
    }
    if (end > static_cast<int64_t>(pos)) {
      matches.push_back({pos, static_cast<size_t>(end)});
      pos = static_cast<size_t>(end);
    } else {
      ++pos;  // No match here (or an empty one): try the next position.
    }
  }
  return absl::OkStatus();
}

}  // namespace pdserve
