#include "engine/chat/jinja_parser.h"

#include <cstdlib>
#include <set>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "engine/chat/jinja_builtins.h"

namespace pdserve::jinja {
namespace {

enum class Tok {
  kData, kBlockBegin, kBlockEnd, kVarBegin, kVarEnd, kName, kString, kInt, kFloat, kOp, kEof,
};

struct Token {
  Tok type;
  std::string text;  // Data, name, decoded string, operator, or number spelling.
  int line;
};

absl::Status SyntaxError(int line, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("chat template line ", line, ": ", what));
}

bool IsSpaceAt(const std::vector<char32_t>& cps, size_t i) { return IsPyWhitespace(cps[i]); }

// Python's str.rstrip() on UTF-8 text.
std::string RStripPy(const std::string& s) {
  std::vector<char32_t> cps = DecodeUtf8(s);
  size_t end = cps.size();
  while (end > 0 && IsSpaceAt(cps, end - 1)) --end;
  if (end == cps.size()) return s;
  return EncodeUtf8(cps, 0, end);
}

bool AllPyWhitespace(std::string_view s) {
  if (s.empty()) return false;
  for (char32_t c : DecodeUtf8(s)) {
    if (!IsPyWhitespace(c) || c == '\n') return false;
  }
  return true;
}

// Length in bytes of a Python-whitespace run starting at `pos`.
size_t WhitespaceRun(std::string_view s, size_t pos) {
  size_t p = pos;
  while (p < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[p]);
    if (c < 0x80) {
      if (!IsPyWhitespace(c)) break;
      ++p;
      continue;
    }
    size_t len = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : 2;
    if (p + len > s.size()) break;
    std::vector<char32_t> cp = DecodeUtf8(s.substr(p, len));
    if (cp.size() != 1 || !IsPyWhitespace(cp[0])) break;
    p += len;
  }
  return p - pos;
}

// Decodes a string literal body with Python's unicode-escape rules (what
// jinja2's lexer applies).
absl::StatusOr<std::string> DecodeStringLiteral(std::string_view body, int line) {
  std::string out;
  for (size_t i = 0; i < body.size(); ++i) {
    const char c = body[i];
    if (c != '\\' || i + 1 >= body.size()) {
      out.push_back(c);
      continue;
    }
    const char e = body[++i];
    auto hex = [&](int n) -> absl::StatusOr<char32_t> {
      if (i + n >= body.size()) return SyntaxError(line, "truncated escape in string literal");
      char32_t v = 0;
      for (int k = 1; k <= n; ++k) {
        const char h = body[i + k];
        int d;
        if (h >= '0' && h <= '9') d = h - '0';
        else if (h >= 'a' && h <= 'f') d = h - 'a' + 10;
        else if (h >= 'A' && h <= 'F') d = h - 'A' + 10;
        else return SyntaxError(line, "bad escape in string literal");
        v = v * 16 + d;
      }
      i += n;
      if (v > 0x10ffff) return SyntaxError(line, "bad escape in string literal");
      return v;
    };
    switch (e) {
      case 'n': out.push_back('\n'); break;
      case 't': out.push_back('\t'); break;
      case 'r': out.push_back('\r'); break;
      case 'b': out.push_back('\b'); break;
      case 'f': out.push_back('\f'); break;
      case 'v': out.push_back('\v'); break;
      case 'a': out.push_back('\a'); break;
      case '\\': out.push_back('\\'); break;
      case '\'': out.push_back('\''); break;
      case '"': out.push_back('"'); break;
      case '\n': break;  // Line continuation.
      case 'x':
      case 'u':
      case 'U': {
        auto v = hex(e == 'x' ? 2 : e == 'u' ? 4 : 8);
        if (!v.ok()) return v.status();
        AppendUtf8(*v, out);
        break;
      }
      case 'N': return SyntaxError(line, "\\N{...} escapes are not supported");
      default:
        if (e >= '0' && e <= '7') {
          char32_t v = e - '0';
          for (int k = 0; k < 2 && i + 1 < body.size() && body[i + 1] >= '0' && body[i + 1] <= '7'; ++k) {
            v = v * 8 + (body[++i] - '0');
          }
          AppendUtf8(v, out);
        } else {
          out.push_back('\\');
          out.push_back(e);
        }
    }
  }
  return out;
}

class Lexer {
 public:
  explicit Lexer(std::string_view raw) {
    // Newlines normalized to \n; one trailing newline dropped
    // (keep_trailing_newline=False).
    std::string s;
    s.reserve(raw.size());
    for (size_t i = 0; i < raw.size(); ++i) {
      if (raw[i] == '\r') {
        s.push_back('\n');
        if (i + 1 < raw.size() && raw[i + 1] == '\n') ++i;
      } else {
        s.push_back(raw[i]);
      }
    }
    if (!s.empty() && s.back() == '\n') s.pop_back();
    src_ = std::move(s);
  }

  absl::StatusOr<std::vector<Token>> Run() {
    size_t pos = 0;
    bool line_starting = true;
    while (pos < src_.size()) {
      size_t start = src_.find('{', pos);
      while (start != std::string::npos && start + 1 < src_.size() &&
             src_[start + 1] != '{' && src_[start + 1] != '%' && src_[start + 1] != '#') {
        start = src_.find('{', start + 1);
      }
      if (start == std::string::npos || start + 1 >= src_.size()) {
        Emit(Tok::kData, src_.substr(pos));
        break;
      }
      std::string text = src_.substr(pos, start - pos);
      const char kind = src_[start + 1];
      const char sign = start + 2 < src_.size() ? src_[start + 2] : '\0';
      const int text_lines = CountNewlines(text);
      if (sign == '-') {
        text = RStripPy(text);
      } else if (sign != '+' && kind != '{') {
        const size_t nl = text.rfind('\n');
        const size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
        if ((l_pos > 0 || line_starting) && AllPyWhitespace(std::string_view(text).substr(l_pos))) {
          text.resize(l_pos);
        }
      }
      if (!text.empty()) Emit(Tok::kData, text);
      line_ += text_lines;
      pos = start + 2 + ((sign == '-' || sign == '+') ? 1 : 0);
      if (kind == '#') {
        // jinja2's lexer stops quietly at a comment opener that ends the input.
        if (pos >= src_.size()) break;
        size_t end = src_.find("#}", pos);
        if (end == std::string::npos) return SyntaxError(line_, "missing end of comment tag");
        line_ += CountNewlines(std::string_view(src_).substr(pos, end - pos));
        const char before = end > pos ? src_[end - 1] : '\0';
        pos = end + 2;
        if (before == '-') {
          pos = SkipWhitespace(pos);
        } else if (before != '+' && pos < src_.size() && src_[pos] == '\n') {
          ++pos;
          ++line_;
        }
        line_starting = pos > 0 && src_[pos - 1] == '\n';
        continue;
      }
      const bool block = kind == '%';
      if (block) {
        // {% raw %} would need its own lexing rule.
        const size_t w = pos + WhitespaceRun(src_, pos);
        if (src_.compare(w, 3, "raw") == 0 &&
            (w + 3 >= src_.size() || !(std::isalnum(static_cast<unsigned char>(src_[w + 3])) ||
                                       src_[w + 3] == '_'))) {
          return SyntaxError(line_, "unsupported statement 'raw'");
        }
      }
      Emit(block ? Tok::kBlockBegin : Tok::kVarBegin, "");
      auto end_pos = LexTag(pos, block);
      if (!end_pos.ok()) return end_pos.status();
      pos = *end_pos;
      line_starting = pos > 0 && src_[pos - 1] == '\n';
    }
    Emit(Tok::kEof, "");
    return std::move(tokens_);
  }

 private:
  static int CountNewlines(std::string_view s) {
    int n = 0;
    for (char c : s) n += c == '\n';
    return n;
  }

  size_t SkipWhitespace(size_t pos) {
    const size_t n = WhitespaceRun(src_, pos);
    line_ += CountNewlines(std::string_view(src_).substr(pos, n));
    return pos + n;
  }

  void Emit(Tok type, std::string text) { tokens_.push_back({type, std::move(text), line_}); }

  // Lexes the inside of a tag from `pos`; returns the position after its end.
  absl::StatusOr<size_t> LexTag(size_t pos, bool block) {
    int depth = 0;
    const int start_line = line_;
    while (true) {
      pos = SkipWhitespace(pos);
      if (pos >= src_.size()) {
        return SyntaxError(start_line, block ? "unexpected end of template, expected '%}'"
                                             : "unexpected end of template, expected '}}'");
      }
      std::string_view rest = std::string_view(src_).substr(pos);
      if (depth == 0) {
        if (block) {
          if (rest.starts_with("+%}")) {
            Emit(Tok::kBlockEnd, "");
            return pos + 3;
          }
          if (rest.starts_with("-%}")) {
            Emit(Tok::kBlockEnd, "");
            return SkipWhitespace(pos + 3);
          }
          if (rest.starts_with("%}")) {
            Emit(Tok::kBlockEnd, "");
            pos += 2;
            if (pos < src_.size() && src_[pos] == '\n') {
              ++pos;
              ++line_;
            }
            return pos;
          }
        } else {
          if (rest.starts_with("-}}")) {
            Emit(Tok::kVarEnd, "");
            return SkipWhitespace(pos + 3);
          }
          if (rest.starts_with("}}")) {
            Emit(Tok::kVarEnd, "");
            return pos + 2;
          }
        }
      }
      const char c = rest[0];
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t n = 1;
        while (n < rest.size() && (std::isalnum(static_cast<unsigned char>(rest[n])) || rest[n] == '_')) ++n;
        Emit(Tok::kName, std::string(rest.substr(0, n)));
        pos += n;
        continue;
      }
      if (std::isdigit(static_cast<unsigned char>(c))) {
        size_t n = 0;
        auto digits = [&]() {
          while (n < rest.size() && (std::isdigit(static_cast<unsigned char>(rest[n])) ||
                                     (rest[n] == '_' && n + 1 < rest.size() &&
                                      std::isdigit(static_cast<unsigned char>(rest[n + 1]))))) {
            ++n;
          }
        };
        digits();
        bool is_float = false;
        if (n + 1 < rest.size() && rest[n] == '.' && std::isdigit(static_cast<unsigned char>(rest[n + 1]))) {
          is_float = true;
          ++n;
          digits();
        }
        if (n < rest.size() && (rest[n] == 'e' || rest[n] == 'E')) {
          size_t m = n + 1;
          if (m < rest.size() && (rest[m] == '+' || rest[m] == '-')) ++m;
          if (m < rest.size() && std::isdigit(static_cast<unsigned char>(rest[m]))) {
            is_float = true;
            n = m;
            digits();
          }
        }
        std::string spelled;
        for (char d : rest.substr(0, n)) {
          if (d != '_') spelled.push_back(d);
        }
        Emit(is_float ? Tok::kFloat : Tok::kInt, spelled);
        pos += n;
        continue;
      }
      if (c == '\'' || c == '"') {
        size_t n = 1;
        while (n < rest.size() && rest[n] != c) {
          if (rest[n] == '\\') ++n;
          ++n;
        }
        if (n >= rest.size()) return SyntaxError(line_, "unterminated string literal");
        auto decoded = DecodeStringLiteral(rest.substr(1, n - 1), line_);
        if (!decoded.ok()) return decoded.status();
        Emit(Tok::kString, *decoded);
        line_ += CountNewlines(rest.substr(0, n));
        pos += n + 1;
        continue;
      }
      static constexpr std::string_view kTwo[] = {"//", "**", "==", "!=", ">=", "<="};
      bool matched = false;
      for (std::string_view op : kTwo) {
        if (rest.starts_with(op)) {
          Emit(Tok::kOp, std::string(op));
          pos += 2;
          matched = true;
          break;
        }
      }
      if (matched) continue;
      static constexpr std::string_view kOne = "+-/*%~[](){}><=.:|,;";
      if (kOne.find(c) == std::string_view::npos) {
        return SyntaxError(line_, absl::StrCat("unexpected character '", std::string(1, c), "'"));
      }
      if (c == '(' || c == '[' || c == '{') ++depth;
      if (c == ')' || c == ']' || c == '}') {
        if (depth == 0) return SyntaxError(line_, absl::StrCat("unexpected '", std::string(1, c), "'"));
        --depth;
      }
      Emit(Tok::kOp, std::string(1, c));
      ++pos;
    }
  }

  std::string src_;
  int line_ = 1;
  std::vector<Token> tokens_;
};

class Parser {
 public:
  explicit Parser(std::vector<Token> tokens) : t_(std::move(tokens)) {}

  absl::StatusOr<std::unique_ptr<Program>> Run() {
    auto program = std::make_unique<Program>();
    std::string end;
    if (auto s = ParseBody({}, program->body, end); !s.ok()) return s;
    for (const auto& [name, line] : called_names_) {
      if (!macro_names_.contains(name) && !IsGlobalFunction(name)) {
        return SyntaxError(line, absl::StrCat("unknown function '", name, "'"));
      }
    }
    return program;
  }

 private:
  const Token& Cur() const { return t_[i_]; }
  const Token& Peek(size_t k = 1) const { return t_[std::min(i_ + k, t_.size() - 1)]; }
  bool IsOp(std::string_view op) const { return Cur().type == Tok::kOp && Cur().text == op; }
  bool IsName(std::string_view n) const { return Cur().type == Tok::kName && Cur().text == n; }
  void Next() {
    if (i_ + 1 < t_.size()) ++i_;
  }
  absl::Status Expect(const std::string& op) {
    if (!IsOp(op)) return Unexpected(absl::StrCat("'", op, "'"));
    Next();
    return absl::OkStatus();
  }
  absl::Status Unexpected(const std::string& expected) {
    std::string got;
    switch (Cur().type) {
      case Tok::kBlockEnd: got = "end of statement block"; break;
      case Tok::kVarEnd: got = "end of print statement"; break;
      case Tok::kEof: got = "end of template"; break;
      case Tok::kString: got = "string"; break;
      default: got = absl::StrCat("'", Cur().text, "'");
    }
    return SyntaxError(Cur().line, absl::StrCat("expected ", expected, ", got ", got));
  }
  absl::StatusOr<std::string> ExpectName() {
    if (Cur().type != Tok::kName) return Unexpected("a name");
    std::string n = Cur().text;
    Next();
    return n;
  }
  absl::Status ExpectBlockEnd() {
    if (Cur().type != Tok::kBlockEnd) return Unexpected("'%}'");
    Next();
    return absl::OkStatus();
  }
  absl::Status EnterDepth() {
    if (++depth_ > kMaxParseDepth) {
      return SyntaxError(Cur().line, "template nested too deeply");
    }
    return absl::OkStatus();
  }

  // Each operator in a chain (`a + b + c`, `x.y.z`, `x | f | g`) deepens the
  // tree by one level: counted against the same bound as parentheses, so
  // that evaluating and destroying the tree cannot overflow the stack.
  class ChainDepth {
   public:
    explicit ChainDepth(Parser& p) : p_(p) {}
    ~ChainDepth() { p_.depth_ -= added_; }
    absl::Status Add() {
      ++added_;
      return p_.EnterDepth();
    }

   private:
    Parser& p_;
    int added_ = 0;
  };

  // Parses nodes until a block tag whose name is in `ends` (consumed up to
  // and including the name; returned in `end`), or the end of input when
  // `ends` is empty.
  absl::Status ParseBody(const std::set<std::string>& ends, NodeList& out, std::string& end) {
    if (auto s = EnterDepth(); !s.ok()) return s;
    while (true) {
      const Token& tok = Cur();
      if (tok.type == Tok::kEof) {
        if (ends.empty()) break;
        return SyntaxError(tok.line, absl::StrCat("unexpected end of template, expected '",
                                                  *ends.begin(), "'"));
      }
      if (tok.type == Tok::kData) {
        auto node = std::make_unique<Node>();
        node->kind = Node::Kind::kText;
        node->line = tok.line;
        node->text = tok.text;
        out.push_back(std::move(node));
        Next();
        continue;
      }
      if (tok.type == Tok::kVarBegin) {
        Next();
        auto node = std::make_unique<Node>();
        node->kind = Node::Kind::kOutput;
        node->line = tok.line;
        auto e = ParseTuple(true);
        if (!e.ok()) return e.status();
        node->expr = std::move(*e);
        if (Cur().type != Tok::kVarEnd) return Unexpected("'}}'");
        Next();
        out.push_back(std::move(node));
        continue;
      }
      if (tok.type != Tok::kBlockBegin) return Unexpected("a tag");
      Next();
      if (Cur().type != Tok::kName) return Unexpected("a statement name");
      const std::string name = Cur().text;
      if (ends.contains(name)) {
        end = name;
        Next();
        --depth_;
        return absl::OkStatus();
      }
      auto s = ParseStatement(out);
      if (!s.ok()) return s;
    }
    --depth_;
    return absl::OkStatus();
  }

  absl::Status ParseStatement(NodeList& out) {
    const std::string name = Cur().text;
    const int line = Cur().line;
    auto node = std::make_unique<Node>();
    node->line = line;
    Next();
    if (name == "if") {
      node->kind = Node::Kind::kIf;
      while (true) {
        auto cond = ParseTuple(false);
        if (!cond.ok()) return cond.status();
        if (auto s = ExpectBlockEnd(); !s.ok()) return s;
        node->conditions.push_back(std::move(*cond));
        node->bodies.emplace_back();
        std::string end;
        if (auto s = ParseBody({"elif", "else", "endif"}, node->bodies.back(), end); !s.ok()) return s;
        if (end == "elif") continue;
        if (end == "else") {
          if (auto s = ExpectBlockEnd(); !s.ok()) return s;
          if (auto s = ParseBody({"endif"}, node->else_body, end); !s.ok()) return s;
        }
        break;
      }
    } else if (name == "for") {
      node->kind = Node::Kind::kFor;
      while (true) {
        auto n = ExpectName();
        if (!n.ok()) return n.status();
        node->targets.push_back(*n);
        if (!IsOp(",")) break;
        Next();
      }
      if (!IsName("in")) return Unexpected("'in'");
      Next();
      auto iter = ParseTuple(false, /*stop_at_if=*/true);
      if (!iter.ok()) return iter.status();
      node->expr = std::move(*iter);
      if (IsName("if")) {
        Next();
        auto f = ParseExpression(true);
        if (!f.ok()) return f.status();
        node->filter = std::move(*f);
      }
      if (IsName("recursive")) return SyntaxError(line, "unsupported construct 'for ... recursive'");
      if (auto s = ExpectBlockEnd(); !s.ok()) return s;
      ++loop_depth_;
      std::string end;
      if (auto s = ParseBody({"else", "endfor"}, node->body, end); !s.ok()) return s;
      --loop_depth_;
      if (end == "else") {
        if (auto s = ExpectBlockEnd(); !s.ok()) return s;
        if (auto s = ParseBody({"endfor"}, node->else_body, end); !s.ok()) return s;
      }
    } else if (name == "set") {
      auto first = ExpectName();
      if (!first.ok()) return first.status();
      node->targets.push_back(*first);
      if (IsOp(".")) {
        Next();
        auto attr = ExpectName();
        if (!attr.ok()) return attr.status();
        node->targets.push_back(*attr);
        node->set_attr = true;
      } else {
        while (IsOp(",")) {
          Next();
          auto n = ExpectName();
          if (!n.ok()) return n.status();
          node->targets.push_back(*n);
        }
      }
      if (IsOp("=")) {
        Next();
        node->kind = Node::Kind::kSet;
        auto e = ParseTuple(true);
        if (!e.ok()) return e.status();
        node->expr = std::move(*e);
      } else {
        if (node->set_attr || node->targets.size() != 1) {
          return SyntaxError(line, "block set needs a single name");
        }
        if (IsOp("|")) return SyntaxError(line, "unsupported construct 'set ... | filter' block");
        node->kind = Node::Kind::kSetBlock;
        if (auto s = ExpectBlockEnd(); !s.ok()) return s;
        std::string end;
        if (auto s = ParseBody({"endset"}, node->body, end); !s.ok()) return s;
      }
    } else if (name == "macro") {
      node->kind = Node::Kind::kMacro;
      auto n = ExpectName();
      if (!n.ok()) return n.status();
      node->name = *n;
      macro_names_.insert(*n);
      if (auto s = Expect("("); !s.ok()) return s;
      while (!IsOp(")")) {
        auto p = ExpectName();
        if (!p.ok()) return p.status();
        ExprPtr def;
        if (IsOp("=")) {
          Next();
          auto d = ParseExpression(true);
          if (!d.ok()) return d.status();
          def = std::move(*d);
        }
        node->params.emplace_back(*p, std::move(def));
        if (IsOp(",")) {
          Next();
        } else if (!IsOp(")")) {
          return Unexpected("',' or ')'");
        }
      }
      Next();
      if (auto s = ExpectBlockEnd(); !s.ok()) return s;
      const int saved_loops = loop_depth_;
      loop_depth_ = 0;
      ++macro_depth_;
      std::string end;
      if (auto s = ParseBody({"endmacro"}, node->body, end); !s.ok()) return s;
      --macro_depth_;
      loop_depth_ = saved_loops;
      if (Cur().type == Tok::kName && Cur().text == node->name) Next();
    } else if (name == "break" || name == "continue") {
      if (loop_depth_ == 0) return SyntaxError(line, absl::StrCat("'", name, "' outside a for loop"));
      node->kind = name == "break" ? Node::Kind::kBreak : Node::Kind::kContinue;
    } else if (name == "generation") {
      // transformers' AssistantTracker: renders its body unchanged.
      node->kind = Node::Kind::kScope;
      if (auto s = ExpectBlockEnd(); !s.ok()) return s;
      std::string end;
      if (auto s = ParseBody({"endgeneration"}, node->body, end); !s.ok()) return s;
    } else {
      static const absl::flat_hash_set<std::string> kKnown = {
          "call", "filter", "with", "include", "import", "from", "extends", "block",
          "autoescape", "raw", "do", "trans"};
      if (kKnown.contains(name)) {
        return SyntaxError(line, absl::StrCat("unsupported statement '", name, "'"));
      }
      return SyntaxError(line, absl::StrCat("unknown statement '", name, "'"));
    }
    if (auto s = ExpectBlockEnd(); !s.ok()) return s;
    out.push_back(std::move(node));
    return absl::OkStatus();
  }

  ExprPtr Make(Expr::Kind kind, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line;
    return e;
  }

  // An expression or a bare tuple (`a, b`).
  absl::StatusOr<ExprPtr> ParseTuple(bool with_condexpr, bool stop_at_if = false) {
    const int line = Cur().line;
    auto first = ParseExpression(with_condexpr);
    if (!first.ok()) return first.status();
    if (!IsOp(",")) return first;
    auto tuple = Make(Expr::Kind::kTuple, line);
    tuple->children.push_back(std::move(*first));
    while (IsOp(",")) {
      Next();
      if (Cur().type == Tok::kBlockEnd || Cur().type == Tok::kVarEnd || IsOp(")") ||
          (stop_at_if && IsName("if"))) {
        break;
      }
      auto e = ParseExpression(with_condexpr);
      if (!e.ok()) return e.status();
      tuple->children.push_back(std::move(*e));
    }
    return tuple;
  }

  absl::StatusOr<ExprPtr> ParseExpression(bool with_condexpr) {
    if (auto s = EnterDepth(); !s.ok()) return s;
    auto r = with_condexpr ? ParseCondExpr() : ParseOr();
    --depth_;
    return r;
  }

  absl::StatusOr<ExprPtr> ParseCondExpr() {
    const int line = Cur().line;
    auto expr = ParseOr();
    if (!expr.ok()) return expr;
    ChainDepth chain(*this);
    while (IsName("if")) {
      if (auto s = chain.Add(); !s.ok()) return s;
      Next();
      auto cond = ParseOr();
      if (!cond.ok()) return cond;
      ExprPtr else_expr;
      if (IsName("else")) {
        Next();
        auto e = ParseCondExpr();
        if (!e.ok()) return e;
        else_expr = std::move(*e);
      }
      auto node = Make(Expr::Kind::kCond, line);
      node->children.push_back(std::move(*cond));
      node->children.push_back(std::move(*expr));
      node->children.push_back(std::move(else_expr));
      expr = std::move(node);
    }
    return expr;
  }

  absl::StatusOr<ExprPtr> ParseOr() {
    auto left = ParseAnd();
    if (!left.ok()) return left;
    ChainDepth chain(*this);
    while (IsName("or")) {
      if (auto s = chain.Add(); !s.ok()) return s;
      const int line = Cur().line;
      Next();
      auto right = ParseAnd();
      if (!right.ok()) return right;
      auto node = Make(Expr::Kind::kOr, line);
      node->children.push_back(std::move(*left));
      node->children.push_back(std::move(*right));
      left = std::move(node);
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseAnd() {
    auto left = ParseNot();
    if (!left.ok()) return left;
    ChainDepth chain(*this);
    while (IsName("and")) {
      if (auto s = chain.Add(); !s.ok()) return s;
      const int line = Cur().line;
      Next();
      auto right = ParseNot();
      if (!right.ok()) return right;
      auto node = Make(Expr::Kind::kAnd, line);
      node->children.push_back(std::move(*left));
      node->children.push_back(std::move(*right));
      left = std::move(node);
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseNot() {
    if (IsName("not")) {
      const int line = Cur().line;
      Next();
      if (auto s = EnterDepth(); !s.ok()) return s;
      auto operand = ParseNot();
      --depth_;
      if (!operand.ok()) return operand;
      auto node = Make(Expr::Kind::kUnary, line);
      node->name = "not";
      node->children.push_back(std::move(*operand));
      return node;
    }
    return ParseCompare();
  }

  absl::StatusOr<ExprPtr> Binary(std::string op, ExprPtr l, ExprPtr r, int line) {
    auto node = Make(Expr::Kind::kBinary, line);
    node->name = std::move(op);
    node->children.push_back(std::move(l));
    node->children.push_back(std::move(r));
    return node;
  }

  // `a < b < c` is Python's chain (a < b and b < c, short-circuit), as in
  // jinja2's Compare node.
  absl::StatusOr<ExprPtr> ParseCompare() {
    auto left = ParseMath1();
    if (!left.ok()) return left;
    ExprPtr chain;
    while (true) {
      const int line = Cur().line;
      std::string op;
      if (Cur().type == Tok::kOp &&
          (Cur().text == "==" || Cur().text == "!=" || Cur().text == "<" || Cur().text == ">" ||
           Cur().text == "<=" || Cur().text == ">=")) {
        op = Cur().text;
        Next();
      } else if (IsName("in")) {
        op = "in";
        Next();
      } else if (IsName("not") && Peek().type == Tok::kName && Peek().text == "in") {
        op = "not in";
        Next();
        Next();
      } else {
        break;
      }
      auto right = ParseMath1();
      if (!right.ok()) return right;
      if (chain == nullptr) {
        chain = Make(Expr::Kind::kCompare, line);
        chain->children.push_back(std::move(*left));
      }
      chain->ops.push_back(op);
      chain->children.push_back(std::move(*right));
    }
    if (chain != nullptr) return chain;
    return left;
  }

  absl::StatusOr<ExprPtr> ParseMath1() {
    auto left = ParseConcat();
    if (!left.ok()) return left;
    ChainDepth chain(*this);
    while (IsOp("+") || IsOp("-")) {
      if (auto s = chain.Add(); !s.ok()) return s;
      const std::string op = Cur().text;
      const int line = Cur().line;
      Next();
      auto right = ParseConcat();
      if (!right.ok()) return right;
      left = Binary(op, std::move(*left), std::move(*right), line);
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseConcat() {
    auto left = ParseMath2();
    if (!left.ok()) return left;
    ChainDepth chain(*this);
    while (IsOp("~")) {
      if (auto s = chain.Add(); !s.ok()) return s;
      const int line = Cur().line;
      Next();
      auto right = ParseMath2();
      if (!right.ok()) return right;
      left = Binary("~", std::move(*left), std::move(*right), line);
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseMath2() {
    auto left = ParsePow();
    if (!left.ok()) return left;
    ChainDepth chain(*this);
    while (IsOp("*") || IsOp("/") || IsOp("//") || IsOp("%")) {
      if (auto s = chain.Add(); !s.ok()) return s;
      const std::string op = Cur().text;
      const int line = Cur().line;
      Next();
      auto right = ParsePow();
      if (!right.ok()) return right;
      if (op == "%" && (*left)->kind == Expr::Kind::kLiteral && (*left)->literal.is_string()) {
        return SyntaxError(line, "unsupported construct: printf-style string formatting with '%'");
      }
      left = Binary(op, std::move(*left), std::move(*right), line);
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParsePow() {
    auto left = ParseUnary(true);
    if (!left.ok()) return left;
    ChainDepth chain(*this);
    while (IsOp("**")) {
      if (auto s = chain.Add(); !s.ok()) return s;
      const int line = Cur().line;
      Next();
      auto right = ParseUnary(true);
      if (!right.ok()) return right;
      left = Binary("**", std::move(*left), std::move(*right), line);
    }
    return left;
  }

  absl::StatusOr<ExprPtr> ParseUnary(bool with_filter) {
    const int line = Cur().line;
    absl::StatusOr<ExprPtr> node;
    if (IsOp("-") || IsOp("+")) {
      const std::string op = Cur().text;
      Next();
      if (auto s = EnterDepth(); !s.ok()) return s;
      auto operand = ParseUnary(false);
      --depth_;
      if (!operand.ok()) return operand;
      auto n = Make(Expr::Kind::kUnary, line);
      n->name = op;
      n->children.push_back(std::move(*operand));
      node = std::move(n);
    } else {
      node = ParsePrimary();
      if (!node.ok()) return node;
    }
    node = ParsePostfix(std::move(*node));
    if (!node.ok() || !with_filter) return node;
    return ParseFilterExpr(std::move(*node));
  }

  absl::StatusOr<ExprPtr> ParsePrimary() {
    const Token tok = Cur();
    if (tok.type == Tok::kName) {
      Next();
      if (tok.text == "true" || tok.text == "True") return Literal(Value::Bool(true), tok.line);
      if (tok.text == "false" || tok.text == "False") return Literal(Value::Bool(false), tok.line);
      if (tok.text == "none" || tok.text == "None") return Literal(Value::None(), tok.line);
      if (tok.text == "caller" && macro_depth_ > 0) {
        return SyntaxError(tok.line, "unsupported construct 'caller' ({% call %} blocks)");
      }
      auto e = Make(Expr::Kind::kName, tok.line);
      e->name = tok.text;
      return e;
    }
    if (tok.type == Tok::kString) {
      std::string s = tok.text;
      Next();
      while (Cur().type == Tok::kString) {
        s += Cur().text;
        Next();
      }
      return Literal(Value::String(std::move(s)), tok.line);
    }
    if (tok.type == Tok::kInt) {
      Next();
      errno = 0;
      char* end = nullptr;
      const long long v = std::strtoll(tok.text.c_str(), &end, 10);
      if (errno == ERANGE) return SyntaxError(tok.line, "integer literal out of range");
      return Literal(Value::Int(v), tok.line);
    }
    if (tok.type == Tok::kFloat) {
      Next();
      return Literal(Value::Float(std::strtod(tok.text.c_str(), nullptr)), tok.line);
    }
    if (IsOp("(")) {
      Next();
      if (IsOp(")")) {
        Next();
        return Make(Expr::Kind::kTuple, tok.line);
      }
      auto first = ParseExpression(true);
      if (!first.ok()) return first;
      if (IsOp(")")) {
        Next();
        return first;
      }
      auto tuple = Make(Expr::Kind::kTuple, tok.line);
      tuple->children.push_back(std::move(*first));
      while (IsOp(",")) {
        Next();
        if (IsOp(")")) break;
        auto e = ParseExpression(true);
        if (!e.ok()) return e;
        tuple->children.push_back(std::move(*e));
      }
      if (auto s = Expect(")"); !s.ok()) return s;
      return tuple;
    }
    if (IsOp("[")) {
      Next();
      auto list = Make(Expr::Kind::kList, tok.line);
      while (!IsOp("]")) {
        auto e = ParseExpression(true);
        if (!e.ok()) return e;
        list->children.push_back(std::move(*e));
        if (IsOp(",")) {
          Next();
        } else if (!IsOp("]")) {
          return Unexpected("',' or ']'");
        }
      }
      Next();
      return list;
    }
    if (IsOp("{")) {
      Next();
      auto dict = Make(Expr::Kind::kDict, tok.line);
      while (!IsOp("}")) {
        auto k = ParseExpression(true);
        if (!k.ok()) return k;
        if (auto s = Expect(":"); !s.ok()) return s;
        auto v = ParseExpression(true);
        if (!v.ok()) return v;
        dict->children.push_back(std::move(*k));
        dict->children.push_back(std::move(*v));
        if (IsOp(",")) {
          Next();
        } else if (!IsOp("}")) {
          return Unexpected("',' or '}'");
        }
      }
      Next();
      return dict;
    }
    return Unexpected("an expression");
  }

  ExprPtr Literal(Value v, int line) {
    auto e = Make(Expr::Kind::kLiteral, line);
    e->literal = std::move(v);
    return e;
  }

  absl::Status ParseCallArgs(Expr& call) {
    // At '('.
    Next();
    while (!IsOp(")")) {
      if (IsOp("*") || IsOp("**")) {
        return SyntaxError(Cur().line, "unsupported construct: *args / **kwargs in a call");
      }
      if (Cur().type == Tok::kName && Peek().type == Tok::kOp && Peek().text == "=") {
        std::string key = Cur().text;
        Next();
        Next();
        auto v = ParseExpression(true);
        if (!v.ok()) return v.status();
        call.kwargs.emplace_back(std::move(key), std::move(*v));
      } else {
        if (!call.kwargs.empty()) {
          return SyntaxError(Cur().line, "positional argument follows keyword argument");
        }
        auto v = ParseExpression(true);
        if (!v.ok()) return v.status();
        call.children.push_back(std::move(*v));
      }
      if (IsOp(",")) {
        Next();
      } else if (!IsOp(")")) {
        return Unexpected("',' or ')'");
      }
    }
    Next();
    return absl::OkStatus();
  }

  absl::StatusOr<ExprPtr> ParseCall(ExprPtr callee) {
    const int line = Cur().line;
    if (callee->kind == Expr::Kind::kName) {
      called_names_.emplace_back(callee->name, line);
    } else if (callee->kind == Expr::Kind::kAttr) {
      if (!IsKnownMethod(callee->name)) {
        return SyntaxError(line, absl::StrCat("unsupported method '", callee->name, "'"));
      }
    }
    auto call = Make(Expr::Kind::kCall, line);
    call->children.push_back(std::move(callee));
    if (auto s = ParseCallArgs(*call); !s.ok()) return s;
    return call;
  }

  absl::StatusOr<ExprPtr> ParsePostfix(ExprPtr node) {
    ChainDepth chain(*this);
    while (true) {
      if (auto s = chain.Add(); !s.ok()) return s;
      const int line = Cur().line;
      if (IsOp(".")) {
        Next();
        if (Cur().type == Tok::kName) {
          auto attr = Make(Expr::Kind::kAttr, line);
          attr->name = Cur().text;
          attr->children.push_back(std::move(node));
          Next();
          node = std::move(attr);
        } else if (Cur().type == Tok::kInt) {
          auto item = Make(Expr::Kind::kItem, line);
          item->children.push_back(std::move(node));
          item->children.push_back(Literal(Value::Int(std::strtoll(Cur().text.c_str(), nullptr, 10)), line));
          Next();
          node = std::move(item);
        } else {
          return Unexpected("an attribute name");
        }
      } else if (IsOp("[")) {
        Next();
        auto r = ParseSubscript(std::move(node), line);
        if (!r.ok()) return r;
        node = std::move(*r);
      } else if (IsOp("(")) {
        auto r = ParseCall(std::move(node));
        if (!r.ok()) return r;
        node = std::move(*r);
      } else {
        return node;
      }
    }
  }

  absl::StatusOr<ExprPtr> ParseSubscript(ExprPtr target, int line) {
    ExprPtr parts[3];
    int part = 0;
    bool is_slice = false;
    while (true) {
      if (IsOp(":")) {
        is_slice = true;
        if (++part > 2) return Unexpected("']'");
        Next();
        continue;
      }
      if (IsOp("]")) break;
      if (parts[part]) return Unexpected("':' or ']'");
      auto e = ParseExpression(true);
      if (!e.ok()) return e;
      parts[part] = std::move(*e);
    }
    Next();
    if (!is_slice) {
      if (!parts[0]) return SyntaxError(line, "empty subscript");
      auto item = Make(Expr::Kind::kItem, line);
      item->children.push_back(std::move(target));
      item->children.push_back(std::move(parts[0]));
      return item;
    }
    auto slice = Make(Expr::Kind::kSlice, line);
    slice->children.push_back(std::move(target));
    for (auto& p : parts) slice->children.push_back(std::move(p));
    return slice;
  }

  absl::StatusOr<ExprPtr> ParseFilterExpr(ExprPtr node) {
    ChainDepth chain(*this);
    while (true) {
      if (auto s = chain.Add(); !s.ok()) return s;
      const int line = Cur().line;
      if (IsOp("|")) {
        Next();
        auto name = ExpectName();
        if (!name.ok()) return name.status();
        if (!IsKnownFilter(*name)) {
          return SyntaxError(line, absl::StrCat("unknown filter '", *name, "'"));
        }
        auto f = Make(Expr::Kind::kFilter, line);
        f->name = *name;
        f->children.push_back(std::move(node));
        if (IsOp("(")) {
          if (auto s = ParseCallArgs(*f); !s.ok()) return s;
        }
        node = std::move(f);
      } else if (IsName("is")) {
        Next();
        auto t = Make(Expr::Kind::kTest, line);
        if (IsName("not")) {
          t->negated = true;
          Next();
        }
        std::string name;
        if (Cur().type == Tok::kName) {
          name = Cur().text;
        } else if (Cur().type == Tok::kOp &&
                   (Cur().text == "==" || Cur().text == "!=" || Cur().text == "<" ||
                    Cur().text == ">" || Cur().text == "<=" || Cur().text == ">=")) {
          name = Cur().text;
        } else {
          return Unexpected("a test name");
        }
        // `none`, `true`, `false` are test names here, not literals.
        Next();
        if (!IsKnownTest(name)) return SyntaxError(line, absl::StrCat("unknown test '", name, "'"));
        t->name = name;
        t->children.push_back(std::move(node));
        if (IsOp("(")) {
          if (auto s = ParseCallArgs(*t); !s.ok()) return s;
        } else if ((Cur().type == Tok::kName || Cur().type == Tok::kString ||
                    Cur().type == Tok::kInt || Cur().type == Tok::kFloat || IsOp("[") ||
                    IsOp("{")) &&
                   !IsName("else") && !IsName("or") && !IsName("and")) {
          if (IsName("is")) return Unexpected("a test argument");
          auto arg = ParsePrimary();
          if (!arg.ok()) return arg;
          auto post = ParsePostfix(std::move(*arg));
          if (!post.ok()) return post;
          t->children.push_back(std::move(*post));
        }
        node = std::move(t);
      } else if (IsOp("(")) {
        auto r = ParseCall(std::move(node));
        if (!r.ok()) return r;
        node = std::move(*r);
      } else {
        return node;
      }
    }
  }

  std::vector<Token> t_;
  size_t i_ = 0;
  int depth_ = 0;
  int loop_depth_ = 0;
  int macro_depth_ = 0;
  absl::flat_hash_set<std::string> macro_names_;
  std::vector<std::pair<std::string, int>> called_names_;
};

}  // namespace

absl::StatusOr<std::unique_ptr<Program>> ParseTemplate(std::string_view source) {
  Lexer lexer(source);
  auto tokens = lexer.Run();
  if (!tokens.ok()) return tokens.status();
  Parser parser(std::move(*tokens));
  return parser.Run();
}

}  // namespace pdserve::jinja
