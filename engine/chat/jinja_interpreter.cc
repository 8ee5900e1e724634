#include "engine/chat/jinja_interpreter.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>

#include "absl/container/flat_hash_map.h"
#include "absl/container/flat_hash_set.h"
#include "absl/strings/cord.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "engine/chat/jinja_builtins.h"

namespace pdserve::jinja {

namespace {

const absl::flat_hash_set<std::string_view>& Filters() {
  static const auto* kSet = new absl::flat_hash_set<std::string_view>{
      "abs", "capitalize", "count", "d", "default", "e", "escape", "first", "float", "indent",
      "int", "items", "join", "last", "length", "list", "lower", "map", "reject", "rejectattr",
      "replace", "reverse", "round", "safe", "select", "selectattr", "sort", "string", "sum",
      "title", "tojson", "trim", "unique", "upper"};
  return *kSet;
}

const absl::flat_hash_set<std::string_view>& Tests() {
  static const auto* kSet = new absl::flat_hash_set<std::string_view>{
      "defined", "undefined", "none", "string", "mapping", "iterable", "sequence", "number",
      "integer", "float", "boolean", "true", "false", "callable", "eq", "equalto", "==", "ne",
      "!=", "lt", "lessthan", "<", "le", "<=", "gt", "greaterthan", ">", "ge", ">=", "in", "odd",
      "even", "divisibleby", "lower", "upper", "sameas"};
  return *kSet;
}

const absl::flat_hash_set<std::string_view>& StrMethods() {
  static const auto* kSet = new absl::flat_hash_set<std::string_view>{
      "strip", "lstrip", "rstrip", "split", "rsplit", "startswith", "endswith", "upper", "lower",
      "replace", "title", "capitalize", "find", "rfind", "count", "join", "splitlines",
      "isdigit", "isalpha", "isalnum", "isspace", "isupper", "islower", "removeprefix",
      "removesuffix"};
  return *kSet;
}
const absl::flat_hash_set<std::string_view>& DictMethods() {
  static const auto* kSet =
      new absl::flat_hash_set<std::string_view>{"items", "keys", "values", "get", "copy"};
  return *kSet;
}
const absl::flat_hash_set<std::string_view>& ListMethods() {
  static const auto* kSet = new absl::flat_hash_set<std::string_view>{"index", "count", "copy"};
  return *kSet;
}
// Methods that would mutate: the immutable sandbox refuses them.
const absl::flat_hash_set<std::string_view>& UnsafeMethods() {
  static const auto* kSet = new absl::flat_hash_set<std::string_view>{
      "pop", "popitem", "setdefault", "update", "clear", "append", "extend", "insert",
      "remove", "reverse", "sort", "add", "discard", "difference_update"};
  return *kSet;
}

}  // namespace

bool IsKnownFilter(std::string_view name) { return Filters().contains(name); }
bool IsKnownTest(std::string_view name) { return Tests().contains(name); }
bool IsKnownMethod(std::string_view name) {
  return StrMethods().contains(name) || DictMethods().contains(name) ||
         ListMethods().contains(name) || name == "cycle";
}
bool IsGlobalFunction(std::string_view name) {
  return name == "range" || name == "namespace" || name == "dict" ||
         name == "raise_exception" || name == "strftime_now";
}

namespace {

constexpr int64_t kMaxRange = 100000;  // jinja2's sandbox MAX_RANGE.

struct Scope {
  std::shared_ptr<Scope> parent;
  absl::flat_hash_map<std::string, Value> vars;
};
using ScopePtr = std::shared_ptr<Scope>;

enum class Flow { kNormal, kBreak, kContinue };

absl::Status Error(int line, const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("chat template line ", line, ": ", what));
}

// A raise_exception() message passes through with no prefix.
struct Raised {
  static absl::Status Make(std::string msg) {
    absl::Status s = absl::InvalidArgumentError(msg);
    s.SetPayload(kPayload, absl::Cord("1"));
    return s;
  }
  static bool Is(const absl::Status& s) { return s.GetPayload(kPayload).has_value(); }
  static constexpr char kPayload[] = "pdserve.chat/raise_exception";
};

// Adds the line to an error that has none yet.
absl::Status AtLine(const absl::Status& s, int line) {
  if (s.ok() || Raised::Is(s) || absl::StartsWith(s.message(), "chat template line")) return s;
  return Error(line, std::string(s.message()));
}

absl::Status TypeError(std::string msg) { return absl::InvalidArgumentError(std::move(msg)); }

absl::Status UndefinedError(const Value& v) { return absl::InvalidArgumentError(v.undefined_hint()); }

// Python maps the case of every cased letter; this renderer knows ASCII
// only, so a string with a non-ASCII code point that could have a case is
// refused rather than mapped differently. Scripts without case (CJK, kana,
// Hangul, Arabic, Hebrew, Indic, Thai), symbols and emoji pass.
bool IsCaseless(char32_t c) {
  return c < 0x80 || (c >= 0x80 && c <= 0xa9) || (c >= 0xab && c <= 0xb4) ||
         (c >= 0xb6 && c <= 0xb9) || (c >= 0xbb && c <= 0xbf) || c == 0xd7 || c == 0xf7 ||
         (c >= 0x0590 && c <= 0x0e7f) || (c >= 0x2000 && c <= 0x2131) ||
         (c >= 0x2133 && c <= 0x214d) || (c >= 0x214f && c <= 0x215f) ||
         (c >= 0x2190 && c <= 0x24b5) || (c >= 0x24ea && c <= 0x2bff) ||
         (c >= 0x2e00 && c <= 0x2e7f) || (c >= 0x3000 && c <= 0x9fff) ||
         (c >= 0xac00 && c <= 0xd7af) || (c >= 0xe000 && c <= 0xfaff) ||
         (c >= 0xfe00 && c <= 0xfe4f) || (c >= 0xff00 && c <= 0xff20) ||
         (c >= 0xff3b && c <= 0xff40) || (c >= 0xff5b && c <= 0xffef) ||
         (c >= 0x1f000 && c <= 0x1faff) || (c >= 0x20000 && c <= 0x3ffff);
}

absl::Status CheckCaseMappable(const std::string& s) {
  for (unsigned char b : s) {
    if (b >= 0x80) {
      for (char32_t c : DecodeUtf8(s)) {
        if (!IsCaseless(c)) {
          char buf[16];
          std::snprintf(buf, sizeof(buf), "U+%04X", static_cast<unsigned>(c));
          return absl::InvalidArgumentError(absl::StrCat(
              "changing the case of non-ASCII letters is not supported (", buf, ")"));
        }
      }
      break;
    }
  }
  return absl::OkStatus();
}

std::string AsciiLower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}
std::string AsciiUpper(std::string s) {
  for (char& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}
bool IsAsciiAlpha(char32_t c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'); }
char32_t Up(char32_t c) { return (c >= 'a' && c <= 'z') ? c - 32 : c; }
char32_t Low(char32_t c) { return (c >= 'A' && c <= 'Z') ? c + 32 : c; }

std::string Capitalize(const std::string& s) {
  std::vector<char32_t> cps = DecodeUtf8(s);
  for (size_t i = 0; i < cps.size(); ++i) cps[i] = i == 0 ? Up(cps[i]) : Low(cps[i]);
  return EncodeUtf8(cps, 0, cps.size());
}

// Python's str.title().
std::string PyTitle(const std::string& s) {
  std::vector<char32_t> cps = DecodeUtf8(s);
  bool prev_cased = false;
  for (char32_t& c : cps) {
    if (IsAsciiAlpha(c)) {
      c = prev_cased ? Low(c) : Up(c);
      prev_cased = true;
    } else {
      prev_cased = false;
    }
  }
  return EncodeUtf8(cps, 0, cps.size());
}

// jinja2's title filter: each word after [-\s({[<]+ gets a capital.
std::string JinjaTitle(const std::string& s) {
  std::vector<char32_t> cps = DecodeUtf8(s);
  bool start = true;
  for (char32_t& c : cps) {
    const bool sep = c == '-' || IsPyWhitespace(c) || c == '(' || c == '{' || c == '[' || c == '<';
    if (sep) {
      start = true;
      continue;
    }
    c = start ? Up(c) : Low(c);
    start = false;
  }
  return EncodeUtf8(cps, 0, cps.size());
}

std::string Strip(const std::string& s, const std::optional<std::string>& chars, bool left,
                  bool right) {
  std::vector<char32_t> cps = DecodeUtf8(s);
  std::vector<char32_t> set;
  if (chars) set = DecodeUtf8(*chars);
  auto strip_it = [&](char32_t c) {
    if (!chars) return IsPyWhitespace(c);
    return std::find(set.begin(), set.end(), c) != set.end();
  };
  size_t b = 0, e = cps.size();
  if (left) {
    while (b < e && strip_it(cps[b])) ++b;
  }
  if (right) {
    while (e > b && strip_it(cps[e - 1])) --e;
  }
  if (b == 0 && e == cps.size()) return s;
  return EncodeUtf8(cps, b, e);
}

std::string Replace(const std::string& s, const std::string& old, const std::string& repl,
                    int64_t count) {
  std::string out;
  if (old.empty()) {
    // Python inserts `repl` before every code point and at the end.
    std::vector<char32_t> cps = DecodeUtf8(s);
    int64_t done = 0;
    for (char32_t c : cps) {
      if (count < 0 || done < count) {
        out += repl;
        ++done;
      }
      AppendUtf8(c, out);
    }
    if (count < 0 || done < count) out += repl;
    return out;
  }
  size_t pos = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    const size_t f = s.find(old, pos);
    if (f == std::string::npos) break;
    out.append(s, pos, f - pos);
    out += repl;
    pos = f + old.size();
    ++done;
  }
  out.append(s, pos, std::string::npos);
  return out;
}

std::vector<std::string> SplitWhitespace(const std::string& s, int64_t maxsplit) {
  std::vector<char32_t> cps = DecodeUtf8(s);
  std::vector<std::string> out;
  size_t i = 0;
  while (i < cps.size()) {
    while (i < cps.size() && IsPyWhitespace(cps[i])) ++i;
    if (i >= cps.size()) break;
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) >= maxsplit) {
      size_t e = cps.size();
      while (e > i && IsPyWhitespace(cps[e - 1])) --e;
      out.push_back(EncodeUtf8(cps, i, e));
      break;
    }
    size_t j = i;
    while (j < cps.size() && !IsPyWhitespace(cps[j])) ++j;
    out.push_back(EncodeUtf8(cps, i, j));
    i = j;
  }
  return out;
}

std::vector<std::string> SplitSep(const std::string& s, const std::string& sep, int64_t maxsplit) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) {
    const size_t f = s.find(sep, pos);
    if (f == std::string::npos) break;
    out.push_back(s.substr(pos, f - pos));
    pos = f + sep.size();
  }
  out.push_back(s.substr(pos));
  return out;
}

std::vector<std::string> RSplitSep(const std::string& s, const std::string& sep, int64_t maxsplit) {
  std::vector<std::string> out;
  size_t end = s.size();
  while (maxsplit < 0 || static_cast<int64_t>(out.size()) < maxsplit) {
    if (end < sep.size()) break;
    const size_t f = s.rfind(sep, end - sep.size());
    if (f == std::string::npos) break;
    out.push_back(s.substr(f + sep.size(), end - f - sep.size()));
    end = f;
  }
  out.push_back(s.substr(0, end));
  std::reverse(out.begin(), out.end());
  return out;
}

// Python's str.splitlines line boundaries.
bool IsLineBreak(char32_t c) {
  return c == '\n' || c == '\r' || c == 0x0b || c == 0x0c || c == 0x1c || c == 0x1d ||
         c == 0x1e || c == 0x85 || c == 0x2028 || c == 0x2029;
}

std::vector<std::string> SplitLines(const std::string& s, bool keepends) {
  std::vector<char32_t> cps = DecodeUtf8(s);
  std::vector<std::string> out;
  size_t i = 0;
  while (i < cps.size()) {
    size_t j = i;
    while (j < cps.size() && !IsLineBreak(cps[j])) ++j;
    size_t eol = j;
    if (j < cps.size()) {
      eol = (cps[j] == '\r' && j + 1 < cps.size() && cps[j + 1] == '\n') ? j + 2 : j + 1;
    }
    out.push_back(EncodeUtf8(cps, i, keepends ? eol : j));
    i = eol;
  }
  return out;
}

std::string HtmlEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out.push_back(c);
    }
  }
  return out;
}

// Python's slice.indices + gather.
template <typename Seq>
absl::StatusOr<Seq> PySlice(const Seq& seq, std::optional<int64_t> start, std::optional<int64_t> stop,
                            std::optional<int64_t> step_opt) {
  const int64_t n = static_cast<int64_t>(seq.size());
  const int64_t step = step_opt.value_or(1);
  if (step == 0) return TypeError("slice step cannot be zero");
  auto clamp = [&](std::optional<int64_t> v, int64_t def_pos, int64_t def_neg) -> int64_t {
    if (!v) return step > 0 ? def_pos : def_neg;
    int64_t x = *v;
    if (x < 0) {
      x += n;
      if (x < 0) x = step > 0 ? 0 : -1;
    } else if (x >= n) {
      x = step > 0 ? n : n - 1;
    }
    return x;
  };
  const int64_t b = clamp(start, 0, n - 1);
  const int64_t e = clamp(stop, n, -1);
  Seq out;
  if (step > 0) {
    for (int64_t i = b; i < e; i += step) out.push_back(seq[static_cast<size_t>(i)]);
  } else {
    for (int64_t i = b; i > e; i += step) out.push_back(seq[static_cast<size_t>(i)]);
  }
  return out;
}

// Python's int(str).
std::optional<int64_t> ParsePyInt(const std::string& s) {
  std::string t = Strip(s, std::nullopt, true, true);
  std::string digits;
  for (size_t i = 0; i < t.size(); ++i) {
    const char c = t[i];
    if (c == '_' && i > 0 && i + 1 < t.size() && std::isdigit(static_cast<unsigned char>(t[i - 1])) &&
        std::isdigit(static_cast<unsigned char>(t[i + 1]))) {
      continue;
    }
    digits.push_back(c);
  }
  if (digits.empty()) return std::nullopt;
  size_t i = (digits[0] == '+' || digits[0] == '-') ? 1 : 0;
  if (i >= digits.size()) return std::nullopt;
  for (size_t k = i; k < digits.size(); ++k) {
    if (!std::isdigit(static_cast<unsigned char>(digits[k]))) return std::nullopt;
  }
  errno = 0;
  const long long v = std::strtoll(digits.c_str(), nullptr, 10);
  if (errno == ERANGE) return std::nullopt;
  return v;
}

std::optional<double> ParsePyFloat(const std::string& s) {
  std::string t = Strip(s, std::nullopt, true, true);
  if (t.empty()) return std::nullopt;
  std::string lower = AsciiLower(t);
  std::string body = lower;
  if (!body.empty() && (body[0] == '+' || body[0] == '-')) body = body.substr(1);
  if (body == "inf" || body == "infinity" || body == "nan") {
    double v = body == "nan" ? NAN : INFINITY;
    return lower[0] == '-' ? -v : v;
  }
  for (char c : lower) {
    if (!(std::isdigit(static_cast<unsigned char>(c)) || c == '.' || c == 'e' || c == '+' || c == '-')) {
      return std::nullopt;
    }
  }
  char* end = nullptr;
  const double v = std::strtod(t.c_str(), &end);
  if (end != t.c_str() + t.size()) return std::nullopt;
  return v;
}

// Parameter names of each filter, in order (jinja2 3.1's signatures, and
// transformers' tojson). Filters taking *args (map, select, ...) are absent.
const absl::flat_hash_map<std::string_view, std::vector<std::string_view>>& FilterParams() {
  static const auto* kParams = new absl::flat_hash_map<std::string_view, std::vector<std::string_view>>{
      {"abs", {}}, {"capitalize", {}}, {"count", {}}, {"length", {}}, {"e", {}}, {"escape", {}},
      {"first", {}}, {"last", {}}, {"items", {}}, {"list", {}}, {"lower", {}}, {"upper", {}},
      {"reverse", {}}, {"safe", {}}, {"string", {}}, {"title", {}},
      {"d", {"default_value", "boolean"}}, {"default", {"default_value", "boolean"}},
      {"float", {"default"}}, {"int", {"default", "base"}},
      {"indent", {"width", "first", "blank"}}, {"join", {"d", "attribute"}},
      {"replace", {"old", "new", "count"}}, {"round", {"precision", "method"}},
      {"sort", {"reverse", "case_sensitive", "attribute"}}, {"sum", {"attribute", "start"}},
      {"tojson", {"ensure_ascii", "indent", "separators", "sort_keys"}}, {"trim", {"chars"}},
      {"unique", {"case_sensitive", "attribute"}}};
  return *kParams;
}

// Python's argument binding errors for a call of `name` with `params`.
absl::Status CheckArgs(std::string_view name, const std::vector<std::string_view>& params,
                       const CallArgs& args) {
  if (args.positional.size() > params.size()) {
    return TypeError(absl::StrCat(std::string(name), "() takes at most ", params.size(),
                                  " argument(s) (", args.positional.size(), " given)"));
  }
  for (const auto& [key, value] : args.keyword) {
    auto it = std::find(params.begin(), params.end(), std::string_view(key));
    if (it == params.end()) {
      return TypeError(absl::StrCat(std::string(name), "() got an unexpected keyword argument '", key, "'"));
    }
    if (static_cast<size_t>(it - params.begin()) < args.positional.size()) {
      return TypeError(absl::StrCat(std::string(name), "() got multiple values for argument '", key, "'"));
    }
  }
  return absl::OkStatus();
}

class Interpreter {
 public:
  Interpreter(const RenderInputs& inputs, const RenderLimits& limits)
      : inputs_(inputs), limits_(limits) {}

  absl::StatusOr<std::string> Run(const Program& program) {
    auto root = std::make_shared<Scope>();
    for (const auto& [name, value] : inputs_.variables) root->vars[name] = value;
    std::string out;
    Flow flow = Flow::kNormal;
    absl::Status status = Exec(program.body, root, out, flow);
    // A namespace can hold itself (`set ns.x = ns`): break such cycles.
    for (const auto& weak : namespaces_) {
      if (auto ns = weak.lock()) ns->attrs.items.clear();
    }
    if (!status.ok()) return status;
    return out;
  }

 private:
  absl::Status Step(int line) {
    if (++steps_ > limits_.max_steps) {
      return Error(line, absl::StrCat("template ran more than ", limits_.max_steps, " steps"));
    }
    return absl::OkStatus();
  }

  absl::Status CheckSize(size_t bytes, int line) {
    if (bytes > limits_.max_output_bytes) {
      return Error(line, absl::StrCat("output larger than ", limits_.max_output_bytes, " bytes"));
    }
    return absl::OkStatus();
  }

  absl::Status Exec(const NodeList& nodes, const ScopePtr& scope, std::string& out, Flow& flow) {
    for (const auto& node : nodes) {
      if (auto s = Step(node->line); !s.ok()) return s;
      if (auto s = ExecNode(*node, scope, out, flow); !s.ok()) return AtLine(s, node->line);
      if (flow != Flow::kNormal) return absl::OkStatus();
    }
    return absl::OkStatus();
  }

  absl::Status ExecNode(const Node& node, const ScopePtr& scope, std::string& out, Flow& flow) {
    switch (node.kind) {
      case Node::Kind::kText:
        out += node.text;
        return CheckSize(out.size(), node.line);
      case Node::Kind::kOutput: {
        auto v = Eval(*node.expr, scope);
        if (!v.ok()) return v.status();
        auto str = PyStr(*v);
        if (!str.ok()) return str.status();
        out += *str;
        return CheckSize(out.size(), node.line);
      }
      case Node::Kind::kIf:
        for (size_t i = 0; i < node.conditions.size(); ++i) {
          auto c = Eval(*node.conditions[i], scope);
          if (!c.ok()) return c.status();
          if (Truthy(*c)) return Exec(node.bodies[i], scope, out, flow);
        }
        return Exec(node.else_body, scope, out, flow);
      case Node::Kind::kFor:
        return ExecFor(node, scope, out);
      case Node::Kind::kSet: {
        auto v = Eval(*node.expr, scope);
        if (!v.ok()) return v.status();
        return Assign(node, *v, scope);
      }
      case Node::Kind::kSetBlock: {
        std::string body;
        Flow inner = Flow::kNormal;
        if (auto s = Exec(node.body, scope, body, inner); !s.ok()) return s;
        scope->vars[node.targets[0]] = Value::String(std::move(body));
        return absl::OkStatus();
      }
      case Node::Kind::kMacro:
        scope->vars[node.name] = MakeMacro(node, scope);
        return absl::OkStatus();
      case Node::Kind::kBreak:
        flow = Flow::kBreak;
        return absl::OkStatus();
      case Node::Kind::kContinue:
        flow = Flow::kContinue;
        return absl::OkStatus();
      case Node::Kind::kScope:
        return Exec(node.body, scope, out, flow);
    }
    return absl::OkStatus();
  }

  absl::Status Assign(const Node& node, const Value& v, const ScopePtr& scope) {
    if (node.set_attr) {
      Value target = Lookup(node.targets[0], scope);
      if (target.kind() != Value::Kind::kNamespace) {
        return TypeError("can only assign attributes of a namespace() object");
      }
      const std::string& attr = node.targets[1];
      if (attr.starts_with("_")) {
        return TypeError(absl::StrCat(
            "Chat templates cannot store underscore-prefixed attributes on a namespace, but got '",
            attr, "'. Please rename the attribute."));
      }
      auto& items = target.as_namespace().attrs.items;
      for (auto& [k, val] : items) {
        if (k.is_string() && k.as_string() == attr) {
          val = v;
          return absl::OkStatus();
        }
      }
      items.emplace_back(Value::String(attr), v);
      return absl::OkStatus();
    }
    if (node.targets.size() == 1) {
      scope->vars[node.targets[0]] = v;
      return absl::OkStatus();
    }
    auto items = Iterate(v);
    if (!items.ok()) return items.status();
    if (items->size() != node.targets.size()) {
      return TypeError(absl::StrCat("cannot unpack ", items->size(), " values into ",
                                    node.targets.size(), " names"));
    }
    for (size_t i = 0; i < items->size(); ++i) scope->vars[node.targets[i]] = (*items)[i];
    return absl::OkStatus();
  }

  absl::Status Bind(const std::vector<std::string>& targets, const Value& item, Scope& scope) {
    if (targets.size() == 1) {
      scope.vars[targets[0]] = item;
      return absl::OkStatus();
    }
    auto parts = Iterate(item);
    if (!parts.ok()) return parts.status();
    if (parts->size() != targets.size()) {
      return TypeError(absl::StrCat(parts->size() < targets.size() ? "not enough" : "too many",
                                    " values to unpack (expected ", targets.size(), ", got ",
                                    parts->size(), ")"));
    }
    for (size_t i = 0; i < targets.size(); ++i) scope.vars[targets[i]] = (*parts)[i];
    return absl::OkStatus();
  }

  absl::Status ExecFor(const Node& node, const ScopePtr& scope, std::string& out) {
    auto iterable = Eval(*node.expr, scope);
    if (!iterable.ok()) return iterable.status();
    auto all = Iterate(*iterable);
    if (!all.ok()) return all.status();
    ValueList items;
    if (node.filter) {
      for (const Value& item : *all) {
        auto probe = std::make_shared<Scope>();
        probe->parent = scope;
        if (auto s = Bind(node.targets, item, *probe); !s.ok()) return s;
        auto keep = Eval(*node.filter, probe);
        if (!keep.ok()) return keep.status();
        if (Truthy(*keep)) items.push_back(item);
      }
    } else {
      items = std::move(*all);
    }
    auto loop = std::make_shared<LoopState>();
    loop->length = static_cast<int64_t>(items.size());
    loop->items = std::make_shared<const ValueList>(std::move(items));
    const Value loop_value = Value::MakeLoop(loop);
    // jinja2 runs `else` unless an iteration reached the end of the body:
    // one left by break or continue does not count.
    bool completed = false;
    for (size_t i = 0; i < loop->items->size(); ++i) {
      if (auto s = Step(node.line); !s.ok()) return s;
      loop->index0 = static_cast<int64_t>(i);
      auto inner = std::make_shared<Scope>();
      inner->parent = scope;
      if (auto s = Bind(node.targets, (*loop->items)[i], *inner); !s.ok()) return s;
      inner->vars["loop"] = loop_value;
      Flow flow = Flow::kNormal;
      if (auto s = Exec(node.body, inner, out, flow); !s.ok()) return s;
      if (flow == Flow::kBreak) break;
      if (flow == Flow::kNormal) completed = true;
    }
    if (!completed && !node.else_body.empty()) {
      auto inner = std::make_shared<Scope>();
      inner->parent = scope;
      Flow flow = Flow::kNormal;
      return Exec(node.else_body, inner, out, flow);
    }
    return absl::OkStatus();
  }

  Value MakeMacro(const Node& node, const ScopePtr& defining) {
    const Node* macro = &node;
    std::weak_ptr<Scope> weak = defining;
    // The macro holds its defining scope weakly (the scope holds the macro),
    // so the two do not keep each other alive.
    return Value::MakeCallable(node.name, [this, macro, weak](CallArgs& args) -> absl::StatusOr<Value> {
      ScopePtr parent = weak.lock();
      if (parent == nullptr) return TypeError("macro called after its scope ended");
      return CallMacro(*macro, parent, args);
    });
  }

  absl::StatusOr<Value> CallMacro(const Node& macro, const ScopePtr& parent, CallArgs& args) {
    if (depth_ >= limits_.max_call_depth) {
      return Error(macro.line, absl::StrCat("macro calls nested deeper than ", limits_.max_call_depth));
    }
    if (args.positional.size() > macro.params.size()) {
      return TypeError(absl::StrCat("macro '", macro.name, "' takes not more than ",
                                    macro.params.size(), " argument(s)"));
    }
    auto scope = std::make_shared<Scope>();
    scope->parent = parent;
    for (const auto& [key, value] : args.keyword) {
      bool found = false;
      for (size_t i = 0; i < macro.params.size(); ++i) {
        if (macro.params[i].first == key) {
          found = i >= args.positional.size();
          break;
        }
      }
      if (!found) {
        return TypeError(absl::StrCat("macro '", macro.name, "' got an unexpected keyword argument '",
                                      key, "'"));
      }
    }
    for (size_t i = 0; i < macro.params.size(); ++i) {
      const auto& [pname, def] = macro.params[i];
      if (i < args.positional.size()) {
        scope->vars[pname] = args.positional[i];
        continue;
      }
      bool bound = false;
      for (const auto& [key, value] : args.keyword) {
        if (key == pname) {
          scope->vars[pname] = value;
          bound = true;
        }
      }
      if (bound) continue;
      if (def) {
        auto v = Eval(*def, scope);
        if (!v.ok()) return v.status();
        scope->vars[pname] = *v;
      } else {
        scope->vars[pname] = Value::Undefined(absl::StrCat("parameter '", pname, "' was not provided"));
      }
    }
    ++depth_;
    std::string out;
    Flow flow = Flow::kNormal;
    absl::Status s = Exec(macro.body, scope, out, flow);
    --depth_;
    if (!s.ok()) return s;
    return Value::String(std::move(out));
  }

  Value Lookup(const std::string& name, const ScopePtr& scope) {
    for (const Scope* s = scope.get(); s != nullptr; s = s->parent.get()) {
      auto it = s->vars.find(name);
      if (it != s->vars.end()) return it->second;
    }
    if (IsGlobalFunction(name)) return GlobalFunction(name);
    return Value::Undefined(absl::StrCat("'", name, "' is undefined"));
  }

  Value GlobalFunction(const std::string& name) {
    if (name == "raise_exception") {
      return Value::MakeCallable(name, [](CallArgs& args) -> absl::StatusOr<Value> {
        std::string msg;
        if (!args.positional.empty()) {
          auto s = PyStr(args.positional[0]);
          if (!s.ok()) return s.status();
          msg = *s;
        }
        return Raised::Make(msg);
      });
    }
    if (name == "strftime_now") {
      return Value::MakeCallable(name, [this](CallArgs& args) -> absl::StatusOr<Value> {
        if (args.positional.size() != 1 || !args.positional[0].is_string()) {
          return TypeError("strftime_now() takes one format string");
        }
        if (!inputs_.strftime_now) return TypeError("strftime_now() is not available");
        return Value::String(inputs_.strftime_now(args.positional[0].as_string()));
      });
    }
    if (name == "namespace") {
      return Value::MakeCallable(name, [this](CallArgs& args) -> absl::StatusOr<Value> {
        auto ns = std::make_shared<Namespace>();
        namespaces_.push_back(ns);
        auto put = [&](const Value& k, const Value& v) -> absl::Status {
          if (k.is_string() && k.as_string().starts_with("_")) {
            return TypeError(absl::StrCat(
                "Chat templates cannot store underscore-prefixed attributes on a namespace, but got '",
                k.as_string(), "'. Please rename the attribute."));
          }
          for (auto& [ek, ev] : ns->attrs.items) {
            if (PyEquals(ek, k)) {
              ev = v;
              return absl::OkStatus();
            }
          }
          ns->attrs.items.emplace_back(k, v);
          return absl::OkStatus();
        };
        if (args.positional.size() > 1) return TypeError("namespace() takes at most one mapping");
        if (!args.positional.empty()) {
          if (args.positional[0].kind() != Value::Kind::kDict) {
            return TypeError("namespace() argument must be a mapping");
          }
          for (const auto& [k, v] : args.positional[0].as_dict().items) {
            if (auto s = put(k, v); !s.ok()) return s;
          }
        }
        for (const auto& [k, v] : args.keyword) {
          if (auto s = put(Value::String(k), v); !s.ok()) return s;
        }
        return Value::MakeNamespace(std::move(ns));
      });
    }
    if (name == "dict") {
      return Value::MakeCallable(name, [](CallArgs& args) -> absl::StatusOr<Value> {
        ValueDict d;
        if (args.positional.size() > 1) return TypeError("dict expected at most 1 argument");
        if (!args.positional.empty()) {
          if (args.positional[0].kind() != Value::Kind::kDict) {
            return TypeError("dict() argument must be a mapping");
          }
          d = args.positional[0].as_dict();
        }
        for (const auto& [k, v] : args.keyword) {
          bool replaced = false;
          for (auto& [ek, ev] : d.items) {
            if (ek.is_string() && ek.as_string() == k) {
              ev = v;
              replaced = true;
            }
          }
          if (!replaced) d.items.emplace_back(Value::String(k), v);
        }
        return Value::Dict(std::move(d));
      });
    }
    // range
    return Value::MakeCallable(name, [](CallArgs& args) -> absl::StatusOr<Value> {
      if (!args.keyword.empty() || args.positional.empty() || args.positional.size() > 3) {
        return TypeError("range() takes 1 to 3 integer arguments");
      }
      int64_t v[3] = {0, 0, 0};
      for (size_t i = 0; i < args.positional.size(); ++i) {
        const Value& a = args.positional[i];
        if (a.kind() != Value::Kind::kInt && a.kind() != Value::Kind::kBool) {
          return TypeError(absl::StrCat("'", a.TypeName(), "' object cannot be interpreted as an integer"));
        }
        v[i] = a.as_integer();
      }
      int64_t start = 0, stop, step = 1;
      if (args.positional.size() == 1) {
        stop = v[0];
      } else {
        start = v[0];
        stop = v[1];
        if (args.positional.size() == 3) step = v[2];
      }
      if (step == 0) return TypeError("range() arg 3 must not be zero");
      ViewData view;
      view.type_name = "range";
      view.start = start;
      view.stop = stop;
      view.step = step;
      for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
        if (static_cast<int64_t>(view.items.size()) >= kMaxRange) {
          return TypeError("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
        }
        view.items.push_back(Value::Int(i));
        if ((step > 0 && i > INT64_MAX - step) || (step < 0 && i < INT64_MIN - step)) break;
      }
      return Value::View(std::move(view));
    });
  }

  // The items a for loop (or list()) sees.
  absl::StatusOr<ValueList> Iterate(const Value& v) {
    switch (v.kind()) {
      case Value::Kind::kUndefined: return ValueList{};
      case Value::Kind::kList:
      case Value::Kind::kTuple: return v.as_list();
      case Value::Kind::kView: return v.as_view().items;
      case Value::Kind::kIterator: {
        IteratorState& it = v.as_iterator();
        ValueList rest(it.items.begin() + static_cast<std::ptrdiff_t>(it.pos), it.items.end());
        it.pos = it.items.size();
        return rest;
      }
      case Value::Kind::kDict: {
        ValueList keys;
        for (const auto& [k, val] : v.as_dict().items) keys.push_back(k);
        return keys;
      }
      case Value::Kind::kString: {
        ValueList chars;
        std::vector<char32_t> cps = DecodeUtf8(v.as_string());
        for (char32_t c : cps) {
          std::string s;
          AppendUtf8(c, s);
          chars.push_back(Value::String(std::move(s)));
        }
        return chars;
      }
      default:
        return TypeError(absl::StrCat("'", v.TypeName(), "' object is not iterable"));
    }
  }

  Value BoundMethod(const Value& self, const std::string& name) {
    return Value::MakeCallable(name, [this, self, name](CallArgs& args) -> absl::StatusOr<Value> {
      return CallMethod(self, name, args);
    });
  }

  Value UnsafeAttr(const Value& obj, const std::string& name) {
    return Value::Undefined(absl::StrCat("access to attribute '", name, "' of '", obj.TypeName(),
                                         "' object is unsafe."));
  }

  Value NoAttr(const Value& obj, const std::string& name) {
    return Value::Undefined(absl::StrCat("'", obj.TypeName(), " object' has no attribute '", name, "'"));
  }

  // obj.name: Python attribute first (methods), then item.
  absl::StatusOr<Value> GetAttr(const Value& obj, const std::string& name) {
    using K = Value::Kind;
    if (obj.is_undefined()) return UndefinedError(obj);
    if (name.starts_with("_")) return UnsafeAttr(obj, name);
    switch (obj.kind()) {
      case K::kDict: {
        if (DictMethods().contains(name)) return BoundMethod(obj, name);
        if (UnsafeMethods().contains(name)) return UnsafeAttr(obj, name);
        if (const Value* v = obj.as_dict().Find(name)) return *v;
        return NoAttr(obj, name);
      }
      case K::kString:
        if (StrMethods().contains(name)) return BoundMethod(obj, name);
        return NoAttr(obj, name);
      case K::kList:
      case K::kTuple:
        if (ListMethods().contains(name) && !(obj.kind() == K::kTuple && name == "copy")) {
          return BoundMethod(obj, name);
        }
        if (UnsafeMethods().contains(name) && obj.kind() == K::kList) return UnsafeAttr(obj, name);
        return NoAttr(obj, name);
      case K::kNamespace:
        if (const Value* v = obj.as_namespace().attrs.Find(name)) return *v;
        return NoAttr(obj, name);
      case K::kLoop: {
        const LoopState& l = obj.as_loop();
        if (name == "index") return Value::Int(l.index0 + 1);
        if (name == "index0") return Value::Int(l.index0);
        if (name == "revindex") return Value::Int(l.length - l.index0);
        if (name == "revindex0") return Value::Int(l.length - l.index0 - 1);
        if (name == "first") return Value::Bool(l.index0 == 0);
        if (name == "last") return Value::Bool(l.index0 == l.length - 1);
        if (name == "length") return Value::Int(l.length);
        if (name == "depth") return Value::Int(1);
        if (name == "depth0") return Value::Int(0);
        if (name == "previtem") {
          if (l.index0 == 0) return Value::Undefined("there is no previous item");
          return (*l.items)[static_cast<size_t>(l.index0 - 1)];
        }
        if (name == "nextitem") {
          if (l.index0 + 1 >= l.length) return Value::Undefined("there is no next item");
          return (*l.items)[static_cast<size_t>(l.index0 + 1)];
        }
        if (name == "cycle") return BoundMethod(obj, name);
        return NoAttr(obj, name);
      }
      default:
        return NoAttr(obj, name);
    }
  }

  // obj[key]: item first, then attribute.
  absl::StatusOr<Value> GetItem(const Value& obj, const Value& key) {
    using K = Value::Kind;
    if (obj.is_undefined()) return UndefinedError(obj);
    switch (obj.kind()) {
      case K::kDict:
        if (const Value* v = obj.as_dict().Find(key)) return *v;
        break;
      case K::kView:
        if (obj.as_view().type_name == "range" && (key.kind() == K::kInt || key.kind() == K::kBool)) {
          const ValueList& items = obj.as_view().items;
          int64_t i = key.as_integer();
          const int64_t n = static_cast<int64_t>(items.size());
          if (i < 0) i += n;
          if (i >= 0 && i < n) return items[static_cast<size_t>(i)];
        }
        break;
      case K::kList:
      case K::kTuple:
      case K::kString:
        if (key.kind() == K::kInt || key.kind() == K::kBool) {
          int64_t i = key.as_integer();
          if (obj.is_string()) {
            std::vector<char32_t> cps = DecodeUtf8(obj.as_string());
            const int64_t n = static_cast<int64_t>(cps.size());
            if (i < 0) i += n;
            if (i < 0 || i >= n) break;
            return Value::String(EncodeUtf8(cps, static_cast<size_t>(i), static_cast<size_t>(i) + 1));
          }
          const ValueList& items = obj.as_list();
          const int64_t n = static_cast<int64_t>(items.size());
          if (i < 0) i += n;
          if (i < 0 || i >= n) break;
          return items[static_cast<size_t>(i)];
        }
        break;
      default:
        break;
    }
    if (key.is_string()) {
      auto attr = GetAttr(obj, key.as_string());
      if (!attr.ok()) return attr;
      return *attr;
    }
    auto repr = PyRepr(key);
    return Value::Undefined(absl::StrCat("'", obj.TypeName(), " object' has no attribute ",
                                         repr.ok() ? *repr : "?"));
  }

  absl::StatusOr<std::optional<int64_t>> SliceIndex(const Expr* e, const ScopePtr& scope) {
    if (e == nullptr) return std::optional<int64_t>();
    auto v = Eval(*e, scope);
    if (!v.ok()) return v.status();
    if (v->is_none()) return std::optional<int64_t>();
    if (v->kind() != Value::Kind::kInt && v->kind() != Value::Kind::kBool) {
      if (v->is_undefined()) return UndefinedError(*v);
      return TypeError("slice indices must be integers or None");
    }
    return std::optional<int64_t>(v->as_integer());
  }

  absl::StatusOr<CallArgs> EvalArgs(const Expr& e, size_t first, const ScopePtr& scope) {
    CallArgs args;
    for (size_t i = first; i < e.children.size(); ++i) {
      auto v = Eval(*e.children[i], scope);
      if (!v.ok()) return v.status();
      args.positional.push_back(std::move(*v));
    }
    for (const auto& [k, ex] : e.kwargs) {
      auto v = Eval(*ex, scope);
      if (!v.ok()) return v.status();
      args.keyword.emplace_back(k, std::move(*v));
    }
    return args;
  }

  absl::StatusOr<Value> Eval(const Expr& e, const ScopePtr& scope) {
    auto v = EvalInner(e, scope);
    if (!v.ok()) return AtLine(v.status(), e.line);
    return v;
  }

  absl::StatusOr<Value> EvalInner(const Expr& e, const ScopePtr& scope) {
    using EK = Expr::Kind;
    switch (e.kind) {
      case EK::kLiteral: return e.literal;
      case EK::kName: return Lookup(e.name, scope);
      case EK::kList:
      case EK::kTuple: {
        ValueList items;
        for (const auto& c : e.children) {
          auto v = Eval(*c, scope);
          if (!v.ok()) return v;
          items.push_back(std::move(*v));
        }
        return e.kind == EK::kList ? Value::List(std::move(items)) : Value::Tuple(std::move(items));
      }
      case EK::kDict: {
        ValueDict d;
        for (size_t i = 0; i + 1 < e.children.size(); i += 2) {
          auto k = Eval(*e.children[i], scope);
          if (!k.ok()) return k;
          auto v = Eval(*e.children[i + 1], scope);
          if (!v.ok()) return v;
          bool replaced = false;
          for (auto& [ek, ev] : d.items) {
            if (PyEquals(ek, *k)) {
              ev = *v;
              replaced = true;
            }
          }
          if (!replaced) d.items.emplace_back(std::move(*k), std::move(*v));
        }
        return Value::Dict(std::move(d));
      }
      case EK::kAttr: {
        auto obj = Eval(*e.children[0], scope);
        if (!obj.ok()) return obj;
        return GetAttr(*obj, e.name);
      }
      case EK::kItem: {
        auto obj = Eval(*e.children[0], scope);
        if (!obj.ok()) return obj;
        auto key = Eval(*e.children[1], scope);
        if (!key.ok()) return key;
        return GetItem(*obj, *key);
      }
      case EK::kSlice: {
        auto obj = Eval(*e.children[0], scope);
        if (!obj.ok()) return obj;
        auto a = SliceIndex(e.children[1].get(), scope);
        if (!a.ok()) return a.status();
        auto b = SliceIndex(e.children[2].get(), scope);
        if (!b.ok()) return b.status();
        auto c = SliceIndex(e.children[3].get(), scope);
        if (!c.ok()) return c.status();
        if (obj->is_undefined()) return UndefinedError(*obj);
        if (obj->is_string()) {
          auto cps = PySlice(DecodeUtf8(obj->as_string()), *a, *b, *c);
          if (!cps.ok()) return cps.status();
          return Value::String(EncodeUtf8(*cps, 0, cps->size()));
        }
        if (obj->is_sequence_list()) {
          auto items = PySlice(obj->as_list(), *a, *b, *c);
          if (!items.ok()) return items.status();
          return obj->kind() == Value::Kind::kList ? Value::List(std::move(*items))
                                                   : Value::Tuple(std::move(*items));
        }
        if (obj->kind() == Value::Kind::kView && obj->as_view().type_name == "range") {
          return TypeError("slicing a range() is not supported");
        }
        // jinja2 compiles slices to a plain Python subscript (no getitem
        // fallback), so this is Python's TypeError.
        if (obj->kind() == Value::Kind::kDict) return TypeError("unhashable type: 'slice'");
        return TypeError(absl::StrCat("'", obj->TypeName(), "' object is not subscriptable"));
      }
      case EK::kCall: return EvalCall(e, scope);
      case EK::kFilter: {
        auto operand = Eval(*e.children[0], scope);
        if (!operand.ok()) return operand;
        auto args = EvalArgs(e, 1, scope);
        if (!args.ok()) return args.status();
        if (auto s = Step(e.line); !s.ok()) return s;
        return ApplyFilter(e.name, *operand, *args, e.line);
      }
      case EK::kTest: {
        auto operand = Eval(*e.children[0], scope);
        if (!operand.ok()) return operand;
        auto args = EvalArgs(e, 1, scope);
        if (!args.ok()) return args.status();
        auto r = ApplyTest(e.name, *operand, *args);
        if (!r.ok()) return r.status();
        return Value::Bool(*r != e.negated);
      }
      case EK::kUnary: {
        auto v = Eval(*e.children[0], scope);
        if (!v.ok()) return v;
        if (e.name == "not") return Value::Bool(!Truthy(*v));
        if (v->is_undefined()) return UndefinedError(*v);
        if (v->kind() == Value::Kind::kFloat) {
          return Value::Float(e.name == "-" ? -v->as_float() : v->as_float());
        }
        if (v->kind() == Value::Kind::kInt || v->kind() == Value::Kind::kBool) {
          const int64_t i = v->as_integer();
          if (e.name == "-" && i == INT64_MIN) return TypeError("integer overflow");
          return Value::Int(e.name == "-" ? -i : i);
        }
        return TypeError(absl::StrCat("bad operand type for unary ", e.name, ": '", v->TypeName(), "'"));
      }
      case EK::kAnd:
      case EK::kOr: {
        auto l = Eval(*e.children[0], scope);
        if (!l.ok()) return l;
        const bool t = Truthy(*l);
        if ((e.kind == EK::kAnd) ? !t : t) return l;
        return Eval(*e.children[1], scope);
      }
      case EK::kCond: {
        auto c = Eval(*e.children[0], scope);
        if (!c.ok()) return c;
        if (Truthy(*c)) return Eval(*e.children[1], scope);
        if (e.children[2]) return Eval(*e.children[2], scope);
        return Value::Undefined(absl::StrCat("the inline if-expression on line ", e.line,
                                             " evaluated to false and no else section was defined."));
      }
      case EK::kCompare: {
        auto left = Eval(*e.children[0], scope);
        if (!left.ok()) return left;
        Value result;
        for (size_t i = 0; i < e.ops.size(); ++i) {
          auto right = Eval(*e.children[i + 1], scope);
          if (!right.ok()) return right;
          auto r = BinaryOp(e.ops[i], *left, *right, e.line);
          if (!r.ok()) return r;
          result = std::move(*r);
          if (!Truthy(result)) break;
          left = std::move(right);
        }
        return result;
      }
      case EK::kBinary: {
        auto l = Eval(*e.children[0], scope);
        if (!l.ok()) return l;
        auto r = Eval(*e.children[1], scope);
        if (!r.ok()) return r;
        return BinaryOp(e.name, *l, *r, e.line);
      }
    }
    return TypeError("unknown expression");
  }

  absl::StatusOr<Value> EvalCall(const Expr& e, const ScopePtr& scope) {
    const Expr& callee = *e.children[0];
    if (auto s = Step(e.line); !s.ok()) return s;
    if (callee.kind == Expr::Kind::kAttr) {
      auto obj = Eval(*callee.children[0], scope);
      if (!obj.ok()) return obj;
      auto args = EvalArgs(e, 1, scope);
      if (!args.ok()) return args.status();
      auto fn = GetAttr(*obj, callee.name);
      if (!fn.ok()) return fn;
      if (fn->kind() != Value::Kind::kCallable) {
        if (fn->is_undefined()) return UndefinedError(*fn);
        return TypeError(absl::StrCat("'", fn->TypeName(), "' object is not callable"));
      }
      return fn->as_callable().fn(*args);
    }
    auto fn = Eval(callee, scope);
    if (!fn.ok()) return fn;
    auto args = EvalArgs(e, 1, scope);
    if (!args.ok()) return args.status();
    if (fn->is_undefined()) return UndefinedError(*fn);
    if (fn->kind() != Value::Kind::kCallable) {
      return TypeError(absl::StrCat("'", fn->TypeName(), "' object is not callable"));
    }
    return fn->as_callable().fn(*args);
  }

  static absl::Status ArgCount(const CallArgs& args, size_t max, const std::string& what) {
    if (args.positional.size() + args.keyword.size() > max) {
      return TypeError(absl::StrCat(what, "() got too many arguments"));
    }
    return absl::OkStatus();
  }

  // Positional `index` or keyword `name`.
  static const Value* Arg(const CallArgs& args, size_t index, std::string_view name) {
    if (index < args.positional.size()) return &args.positional[index];
    for (const auto& [k, v] : args.keyword) {
      if (k == name) return &v;
    }
    return nullptr;
  }

  static absl::StatusOr<std::string> StrArg(const Value* v, const std::string& what) {
    if (v == nullptr || !v->is_string()) {
      return TypeError(absl::StrCat(what, " must be a string"));
    }
    return v->as_string();
  }

  static absl::StatusOr<std::optional<std::string>> OptStrArg(const Value* v, const std::string& what) {
    if (v == nullptr || v->is_none()) return std::optional<std::string>();
    if (!v->is_string()) return TypeError(absl::StrCat(what, " must be a string or None"));
    return std::optional<std::string>(v->as_string());
  }

  static absl::StatusOr<int64_t> IntArg(const Value* v, int64_t def, const std::string& what) {
    if (v == nullptr) return def;
    if (v->kind() != Value::Kind::kInt && v->kind() != Value::Kind::kBool) {
      return TypeError(absl::StrCat(what, " must be an integer"));
    }
    return v->as_integer();
  }

  absl::StatusOr<Value> CallMethod(const Value& self, const std::string& name, CallArgs& args) {
    using K = Value::Kind;
    if (self.kind() == K::kString) {
      if (self.is_markup()) {
        return TypeError(absl::StrCat("method '", name, "' of a safe/escaped (Markup) string is not supported"));
      }
      return CallStrMethod(self.as_string(), name, args);
    }
    if (self.kind() == K::kDict) {
      const ValueDict& d = self.as_dict();
      if (name == "items" || name == "keys" || name == "values") {
        ViewData view;
        view.type_name = "dict_" + name;
        for (const auto& [k, v] : d.items) {
          view.items.push_back(name == "items" ? Value::Tuple({k, v}) : name == "keys" ? k : v);
        }
        return Value::View(std::move(view));
      }
      if (name == "get") {
        if (args.positional.empty() || args.positional.size() > 2 || !args.keyword.empty()) {
          return TypeError("get() takes a key and an optional default");
        }
        if (const Value* v = d.Find(args.positional[0])) return *v;
        return args.positional.size() > 1 ? args.positional[1] : Value::None();
      }
      if (name == "copy") return self;
    }
    if (self.kind() == K::kList || self.kind() == K::kTuple) {
      const ValueList& items = self.as_list();
      if (name == "copy") return self;
      if (args.positional.size() != 1) return TypeError(absl::StrCat(name, "() takes one argument"));
      int64_t count = 0;
      for (size_t i = 0; i < items.size(); ++i) {
        if (PyEquals(items[i], args.positional[0])) {
          if (name == "index") return Value::Int(static_cast<int64_t>(i));
          ++count;
        }
      }
      if (name == "index") return TypeError("list.index(x): x not in list");
      return Value::Int(count);
    }
    if (self.kind() == K::kLoop && name == "cycle") {
      if (args.positional.empty()) return TypeError("no items for cycling given");
      const LoopState& l = self.as_loop();
      return args.positional[static_cast<size_t>(l.index0) % args.positional.size()];
    }
    return TypeError(absl::StrCat("'", self.TypeName(), "' object has no method '", name, "'"));
  }

  absl::StatusOr<Value> CallStrMethod(const std::string& s, const std::string& name, CallArgs& args) {
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      if (auto st = ArgCount(args, 1, name); !st.ok()) return st;
      auto chars = OptStrArg(Arg(args, 0, "chars"), "strip argument");
      if (!chars.ok()) return chars.status();
      return Value::String(Strip(s, *chars, name != "rstrip", name != "lstrip"));
    }
    if (name == "split" || name == "rsplit") {
      if (auto st = ArgCount(args, 2, name); !st.ok()) return st;
      auto sep = OptStrArg(Arg(args, 0, "sep"), "separator");
      if (!sep.ok()) return sep.status();
      auto maxsplit = IntArg(Arg(args, 1, "maxsplit"), -1, "maxsplit");
      if (!maxsplit.ok()) return maxsplit.status();
      std::vector<std::string> parts;
      if (!sep->has_value()) {
        if (name == "rsplit" && *maxsplit >= 0) return TypeError("rsplit(None, maxsplit) is not supported");
        parts = SplitWhitespace(s, *maxsplit);
      } else {
        if ((*sep)->empty()) return TypeError("empty separator");
        parts = name == "split" ? SplitSep(s, **sep, *maxsplit) : RSplitSep(s, **sep, *maxsplit);
      }
      ValueList out;
      for (auto& p : parts) out.push_back(Value::String(std::move(p)));
      return Value::List(std::move(out));
    }
    if (name == "startswith" || name == "endswith") {
      if (args.positional.size() != 1 || !args.keyword.empty()) {
        return TypeError(absl::StrCat(name, "() takes one argument"));
      }
      std::vector<std::string> candidates;
      const Value& a = args.positional[0];
      if (a.is_string()) {
        candidates.push_back(a.as_string());
      } else if (a.kind() == Value::Kind::kTuple) {
        for (const Value& c : a.as_list()) {
          if (!c.is_string()) return TypeError("tuple for startswith must only contain str");
          candidates.push_back(c.as_string());
        }
      } else {
        return TypeError(absl::StrCat(name, " first arg must be str or a tuple of str, not ", a.TypeName()));
      }
      for (const auto& c : candidates) {
        if (name == "startswith" ? s.starts_with(c) : s.ends_with(c)) return Value::Bool(true);
      }
      return Value::Bool(false);
    }
    if (name == "upper" || name == "lower" || name == "title" || name == "capitalize") {
      if (!args.positional.empty() || !args.keyword.empty()) return TypeError(absl::StrCat(name, "() takes no arguments"));
      if (auto st = CheckCaseMappable(s); !st.ok()) return st;
      if (name == "upper") return Value::String(AsciiUpper(s));
      if (name == "lower") return Value::String(AsciiLower(s));
      if (name == "title") return Value::String(PyTitle(s));
      return Value::String(Capitalize(s));
    }
    if (name == "replace") {
      auto old = StrArg(Arg(args, 0, "old"), "replace() old");
      if (!old.ok()) return old.status();
      auto repl = StrArg(Arg(args, 1, "new"), "replace() new");
      if (!repl.ok()) return repl.status();
      auto count = IntArg(Arg(args, 2, "count"), -1, "count");
      if (!count.ok()) return count.status();
      std::string r = Replace(s, *old, *repl, *count);
      if (auto st = CheckSize(r.size(), 0); !st.ok()) return st;
      return Value::String(std::move(r));
    }
    if (name == "find" || name == "rfind" || name == "count") {
      if (args.positional.size() != 1 || !args.keyword.empty() || !args.positional[0].is_string()) {
        return TypeError(absl::StrCat(name, "() takes one string argument"));
      }
      const std::string& sub = args.positional[0].as_string();
      if (name == "count") {
        if (sub.empty()) return Value::Int(static_cast<int64_t>(Utf8Length(s)) + 1);
        int64_t n = 0;
        for (size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size())) ++n;
        return Value::Int(n);
      }
      const size_t p = name == "find" ? s.find(sub) : s.rfind(sub);
      if (p == std::string::npos) return Value::Int(-1);
      return Value::Int(static_cast<int64_t>(Utf8Length(std::string_view(s).substr(0, p))));
    }
    if (name == "join") {
      if (args.positional.size() != 1) return TypeError("join() takes one argument");
      auto items = Iterate(args.positional[0]);
      if (!items.ok()) return items.status();
      std::string out;
      for (size_t i = 0; i < items->size(); ++i) {
        const Value& it = (*items)[i];
        if (!it.is_string()) {
          return TypeError(absl::StrCat("sequence item ", i, ": expected str instance, ", it.TypeName(), " found"));
        }
        if (i > 0) out += s;
        out += it.as_string();
        if (auto st = CheckSize(out.size(), 0); !st.ok()) return st;
      }
      return Value::String(std::move(out));
    }
    if (name == "splitlines") {
      auto keep = Arg(args, 0, "keepends");
      ValueList out;
      for (auto& l : SplitLines(s, keep != nullptr && Truthy(*keep))) out.push_back(Value::String(std::move(l)));
      return Value::List(std::move(out));
    }
    if (name == "removeprefix" || name == "removesuffix") {
      auto a = StrArg(Arg(args, 0, "prefix"), name);
      if (!a.ok()) return a.status();
      if (name == "removeprefix" && s.starts_with(*a)) return Value::String(s.substr(a->size()));
      if (name == "removesuffix" && !a->empty() && s.ends_with(*a)) {
        return Value::String(s.substr(0, s.size() - a->size()));
      }
      return Value::String(s);
    }
    // is* predicates.
    std::vector<char32_t> cps = DecodeUtf8(s);
    if (name == "isspace") {
      return Value::Bool(!cps.empty() && std::all_of(cps.begin(), cps.end(), IsPyWhitespace));
    }
    if (name == "isdigit" || name == "isalpha" || name == "isalnum") {
      if (cps.empty()) return Value::Bool(false);
      for (char32_t c : cps) {
        if (c >= 0x80) return TypeError(absl::StrCat("str.", name, "() on non-ASCII text is not supported"));
        const bool d = c >= '0' && c <= '9';
        const bool a = IsAsciiAlpha(c);
        if (name == "isdigit" ? !d : name == "isalpha" ? !a : !(a || d)) return Value::Bool(false);
      }
      return Value::Bool(true);
    }
    if (name == "isupper" || name == "islower") {
      bool cased = false;
      for (char32_t c : cps) {
        if (c >= 0x80 && !IsPyWhitespace(c)) {
          return TypeError(absl::StrCat("str.", name, "() on non-ASCII text is not supported"));
        }
        if (IsAsciiAlpha(c)) {
          cased = true;
          const bool up = c >= 'A' && c <= 'Z';
          if (up != (name == "isupper")) return Value::Bool(false);
        }
      }
      return Value::Bool(cased);
    }
    return TypeError(absl::StrCat("'str' object has no method '", name, "'"));
  }

  absl::StatusOr<Value> BinaryOp(const std::string& op, const Value& l, const Value& r, int line) {
    using K = Value::Kind;
    if (op == "==") return Value::Bool(PyEquals(l, r));
    if (op == "!=") return Value::Bool(!PyEquals(l, r));
    if (op == "<" || op == ">" || op == "<=" || op == ">=") {
      auto c = PyCompare(l, r);
      if (!c.ok()) return c.status();
      if (op == "<") return Value::Bool(*c < 0);
      if (op == ">") return Value::Bool(*c > 0);
      if (op == "<=") return Value::Bool(*c <= 0);
      return Value::Bool(*c >= 0);
    }
    if (op == "in" || op == "not in") {
      auto c = Contains(r, l);
      if (!c.ok()) return c.status();
      return Value::Bool(*c == (op == "in"));
    }
    if (op == "~") {
      auto a = PyStr(l);
      if (!a.ok()) return a.status();
      auto b = PyStr(r);
      if (!b.ok()) return b.status();
      if (auto s = CheckSize(a->size() + b->size(), line); !s.ok()) return s;
      return Value::String(*a + *b);
    }
    if (l.is_undefined()) return UndefinedError(l);
    if (r.is_undefined()) return UndefinedError(r);
    auto unsupported = [&]() {
      return TypeError(absl::StrCat("unsupported operand type(s) for ", op, ": '", l.TypeName(),
                                    "' and '", r.TypeName(), "'"));
    };
    if (op == "+") {
      if (l.is_string() && (l.is_markup() || r.is_markup())) {
        // Markup + x escapes x (str(x) for any type); str + Markup escapes the str.
        std::string a, b;
        if (l.is_markup()) {
          a = l.as_string();
          if (r.is_markup()) {
            b = r.as_string();
          } else {
            auto rs = PyStr(r);
            if (!rs.ok()) return rs.status();
            b = HtmlEscape(*rs);
          }
        } else {
          a = HtmlEscape(l.as_string());
          b = r.as_string();
        }
        if (auto s = CheckSize(a.size() + b.size(), line); !s.ok()) return s;
        return Value::Markup(a + b);
      }
      if (l.is_string()) {
        if (!r.is_string()) {
          return TypeError(absl::StrCat("can only concatenate str (not \"", r.TypeName(), "\") to str"));
        }
        if (auto s = CheckSize(l.as_string().size() + r.as_string().size(), line); !s.ok()) return s;
        return Value::String(l.as_string() + r.as_string());
      }
      if (l.is_sequence_list()) {
        if (r.kind() != l.kind()) {
          return TypeError(absl::StrCat("can only concatenate ", l.TypeName(), " (not \"", r.TypeName(),
                                        "\") to ", l.TypeName()));
        }
        if (auto s = CheckSize((l.as_list().size() + r.as_list().size()) * sizeof(Value), line); !s.ok()) return s;
        ValueList items = l.as_list();
        items.insert(items.end(), r.as_list().begin(), r.as_list().end());
        return l.kind() == K::kList ? Value::List(std::move(items)) : Value::Tuple(std::move(items));
      }
    }
    if (op == "*") {
      const Value* seq = l.is_string() || l.is_sequence_list() ? &l : (r.is_string() || r.is_sequence_list() ? &r : nullptr);
      if (seq != nullptr) {
        const Value& n = seq == &l ? r : l;
        if (n.kind() != K::kInt && n.kind() != K::kBool) {
          return TypeError(absl::StrCat("can't multiply sequence by non-int of type '", n.TypeName(), "'"));
        }
        const int64_t times = std::max<int64_t>(0, n.as_integer());
        if (seq->is_string()) {
          const size_t unit = seq->as_string().size();
          if (unit > 0 && static_cast<uint64_t>(times) > limits_.max_output_bytes / unit) {
            return CheckSize(limits_.max_output_bytes + 1, line);
          }
          std::string out;
          for (int64_t i = 0; i < times; ++i) out += seq->as_string();
          return Value::String(std::move(out));
        }
        const size_t unit = seq->as_list().size() * sizeof(Value);
        if (unit > 0 && static_cast<uint64_t>(times) > limits_.max_output_bytes / unit) {
          return CheckSize(limits_.max_output_bytes + 1, line);
        }
        ValueList items;
        for (int64_t i = 0; i < times; ++i) items.insert(items.end(), seq->as_list().begin(), seq->as_list().end());
        return seq->kind() == K::kList ? Value::List(std::move(items)) : Value::Tuple(std::move(items));
      }
    }
    if (!l.is_number() || !r.is_number()) return unsupported();
    const bool ints = l.kind() != K::kFloat && r.kind() != K::kFloat;
    if (op == "/") {
      if (r.as_double() == 0) return TypeError("division by zero");
      return Value::Float(l.as_double() / r.as_double());
    }
    if (ints) {
      const int64_t a = l.as_integer(), b = r.as_integer();
      int64_t out = 0;
      if (op == "+") {
        if (__builtin_add_overflow(a, b, &out)) return TypeError("integer overflow");
        return Value::Int(out);
      }
      if (op == "-") {
        if (__builtin_sub_overflow(a, b, &out)) return TypeError("integer overflow");
        return Value::Int(out);
      }
      if (op == "*") {
        if (__builtin_mul_overflow(a, b, &out)) return TypeError("integer overflow");
        return Value::Int(out);
      }
      if (op == "//" || op == "%") {
        if (b == 0) return TypeError("integer division or modulo by zero");
        if (a == INT64_MIN && b == -1) return TypeError("integer overflow");
        int64_t q = a / b, m = a % b;
        if (m != 0 && ((m < 0) != (b < 0))) {
          q -= 1;
          m += b;
        }
        return Value::Int(op == "//" ? q : m);
      }
      if (op == "**") {
        if (b < 0) return Value::Float(std::pow(static_cast<double>(a), static_cast<double>(b)));
        int64_t result = 1;
        for (int64_t i = 0; i < b; ++i) {
          if (__builtin_mul_overflow(result, a, &result)) return TypeError("integer overflow");
          if (result == 0 || result == 1) break;
          if (result == -1) {
            result = ((b - i - 1) % 2 == 0) ? -1 : 1;
            break;
          }
        }
        return Value::Int(result);
      }
    }
    const double a = l.as_double(), b = r.as_double();
    if (op == "+") return Value::Float(a + b);
    if (op == "-") return Value::Float(a - b);
    if (op == "*") return Value::Float(a * b);
    if (op == "//" || op == "%") {
      if (b == 0) return TypeError("float division or modulo by zero");
      double m = std::fmod(a, b);
      if (m != 0 && ((m < 0) != (b < 0))) m += b;
      if (op == "%") return Value::Float(m);
      return Value::Float(std::floor(a / b));
    }
    if (op == "**") {
      if (a == 0 && b < 0) return TypeError("0.0 cannot be raised to a negative power");
      return Value::Float(std::pow(a, b));
    }
    return unsupported();
  }

  absl::StatusOr<bool> Contains(const Value& container, const Value& item) {
    using K = Value::Kind;
    switch (container.kind()) {
      case K::kUndefined: return false;
      case K::kString:
        if (!item.is_string()) {
          return TypeError(absl::StrCat("'in <string>' requires string as left operand, not ", item.TypeName()));
        }
        return container.as_string().find(item.as_string()) != std::string::npos;
      case K::kList:
      case K::kTuple:
        for (const Value& v : container.as_list()) {
          if (PyEquals(v, item)) return true;
        }
        return false;
      case K::kDict:
        if (item.is_sequence_list() && item.kind() == K::kList) return TypeError("unhashable type: 'list'");
        if (item.kind() == K::kDict) return TypeError("unhashable type: 'dict'");
        return container.as_dict().Find(item) != nullptr;
      case K::kView:
        for (const Value& v : container.as_view().items) {
          if (PyEquals(v, item)) return true;
        }
        return false;
      case K::kIterator: {
        // `in` consumes a Python iterator up to the match.
        IteratorState& it = container.as_iterator();
        while (it.pos < it.items.size()) {
          if (PyEquals(it.items[it.pos++], item)) return true;
        }
        return false;
      }
      default:
        return TypeError(absl::StrCat("argument of type '", container.TypeName(), "' is not iterable"));
    }
  }

  absl::StatusOr<bool> ApplyTest(const std::string& name, const Value& v, const CallArgs& args) {
    using K = Value::Kind;
    static const absl::flat_hash_set<std::string_view> kOneArg = {
        "eq", "equalto", "==", "ne", "!=", "lt", "lessthan", "<", "le", "<=", "gt",
        "greaterthan", ">", "ge", ">=", "in", "sameas", "divisibleby"};
    const size_t want = kOneArg.contains(name) ? 1 : 0;
    if (!args.keyword.empty() || args.positional.size() != want) {
      return TypeError(absl::StrCat("test '", name, "' takes ", want, " argument(s) (",
                                    args.positional.size() + args.keyword.size(), " given)"));
    }
    const Value* arg = args.positional.empty() ? nullptr : &args.positional[0];
    auto need_arg = [&]() -> absl::Status {
      if (arg == nullptr) return TypeError(absl::StrCat("test '", name, "' needs an argument"));
      return absl::OkStatus();
    };
    if (name == "defined") return !v.is_undefined();
    if (name == "undefined") return v.is_undefined();
    if (name == "none") return v.is_none();
    if (name == "string") return v.is_string();
    if (name == "mapping") return v.kind() == K::kDict;
    if (name == "iterable") {
      return v.is_undefined() || v.is_string() || v.is_sequence_list() || v.kind() == K::kDict ||
             v.kind() == K::kIterator || v.kind() == K::kView;
    }
    if (name == "sequence") {
      return v.is_undefined() || v.is_string() || v.is_sequence_list() || v.kind() == K::kDict ||
             (v.kind() == K::kView && v.as_view().type_name == "range");
    }
    if (name == "number") return v.is_number();
    if (name == "integer") return v.kind() == K::kInt;
    if (name == "float") return v.kind() == K::kFloat;
    if (name == "boolean") return v.kind() == K::kBool;
    if (name == "true") return v.kind() == K::kBool && v.as_bool();
    if (name == "false") return v.kind() == K::kBool && !v.as_bool();
    // Undefined and LoopContext define __call__ too.
    if (name == "callable") {
      return v.kind() == K::kCallable || v.is_undefined() || v.kind() == K::kLoop;
    }
    if (name == "lower" || name == "upper") {
      if (!v.is_string()) return false;
      CallArgs none;
      auto r = CallStrMethod(v.as_string(), name == "lower" ? "islower" : "isupper", none);
      if (!r.ok()) return r.status();
      return r->as_bool();
    }
    if (name == "odd" || name == "even" || name == "divisibleby") {
      if (v.is_undefined()) return UndefinedError(v);
      // Python: value % 2 == 1, value % 2 == 0, value % num == 0.
      const Value divisor = name == "divisibleby" ? *arg : Value::Int(2);
      auto m = BinaryOp("%", v, divisor, 0);
      if (!m.ok()) return m.status();
      return PyEquals(*m, Value::Int(name == "odd" ? 1 : 0));
    }
    if (auto s = need_arg(); !s.ok()) return s;
    if (name == "eq" || name == "equalto" || name == "==") return PyEquals(v, *arg);
    if (name == "ne" || name == "!=") return !PyEquals(v, *arg);
    if (name == "in") return Contains(*arg, v);
    if (name == "sameas") {
      if (v.kind() != arg->kind()) return false;
      if (v.is_none() || v.is_undefined()) return true;
      if (v.kind() == K::kBool) return v.as_bool() == arg->as_bool();
      return PyEquals(v, *arg) && !v.is_sequence_list() && v.kind() != K::kDict;
    }
    auto c = PyCompare(v, *arg);
    if (!c.ok()) return c.status();
    if (name == "lt" || name == "lessthan" || name == "<") return *c < 0;
    if (name == "le" || name == "<=") return *c <= 0;
    if (name == "gt" || name == "greaterthan" || name == ">") return *c > 0;
    return *c >= 0;
  }

  // Attribute path for map/selectattr/sort/join(attribute=...): "a.b", with
  // integer parts as indices (jinja2's make_attrgetter).
  absl::StatusOr<Value> GetAttrPath(const Value& v, const Value& attr) {
    if (!attr.is_string()) return GetItem(v, attr);
    Value cur = v;
    const std::string& path = attr.as_string();
    size_t start = 0;
    while (true) {
      const size_t dot = path.find('.', start);
      const std::string part = path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
      Value key = Value::String(part);
      if (auto i = ParsePyInt(part); i.has_value() && !part.empty() && std::isdigit(static_cast<unsigned char>(part[0]))) {
        key = Value::Int(*i);
      }
      auto next = GetItem(cur, key);
      if (!next.ok()) return next;
      cur = std::move(*next);
      if (dot == std::string::npos) break;
      start = dot + 1;
    }
    return cur;
  }

  absl::StatusOr<Value> ApplyFilter(const std::string& name, const Value& v, CallArgs& args, int line) {
    using K = Value::Kind;
    if (auto it = FilterParams().find(name); it != FilterParams().end()) {
      if (auto s = CheckArgs(name, it->second, args); !s.ok()) return s;
    }
    if (name == "safe") {
      if (v.is_markup()) return v;
      auto str = PyStr(v);
      if (!str.ok()) return str.status();
      return Value::Markup(std::move(*str));
    }
    if ((name == "e" || name == "escape") && v.is_markup()) return v;
    // Filters keep a Markup a Markup in Python (and later `+` then escapes);
    // only `string`, `length` and the escapes are modelled for one.
    if (v.is_markup() && name != "string" && name != "length" && name != "count" &&
        name != "e" && name != "escape" && name != "default" && name != "d") {
      return Error(line, absl::StrCat("filter '", name, "' on a safe/escaped (Markup) string is not supported"));
    }
    if (name == "string" && v.is_markup()) return v;
    if (name == "default" || name == "d") {
      const Value* def = Arg(args, 0, "default_value");
      const Value* boolean = Arg(args, 1, "boolean");
      const bool use_default = v.is_undefined() || (boolean != nullptr && Truthy(*boolean) && !Truthy(v));
      if (!use_default) return v;
      return def != nullptr ? *def : Value::String("");
    }
    if (name == "tojson") {
      JsonDumpsOptions o;
      if (const Value* a = Arg(args, 0, "ensure_ascii")) o.ensure_ascii = Truthy(*a);
      if (const Value* a = Arg(args, 1, "indent")) {
        if (a->kind() == K::kInt) {
          o.indent = static_cast<int>(std::clamp<int64_t>(a->as_int(), 0, 64));
          if (a->as_int() < 0) o.indent = 0;
        } else if (a->is_string()) {
          o.indent_str = a->as_string();
        } else if (!a->is_none()) {
          return TypeError("tojson indent must be an integer, a string or None");
        }
      }
      if (const Value* a = Arg(args, 2, "separators"); a != nullptr && !a->is_none()) {
        if (!a->is_sequence_list() || a->as_list().size() != 2 || !a->as_list()[0].is_string() ||
            !a->as_list()[1].is_string()) {
          return TypeError("tojson separators must be a pair of strings");
        }
        o.separators = std::make_pair(a->as_list()[0].as_string(), a->as_list()[1].as_string());
      }
      if (const Value* a = Arg(args, 3, "sort_keys")) o.sort_keys = Truthy(*a);
      auto s = JsonDumps(v, o);
      if (!s.ok()) return s.status();
      if (auto st = CheckSize(s->size(), line); !st.ok()) return st;
      return Value::String(std::move(*s));
    }
    if (name == "length" || name == "count") {
      switch (v.kind()) {
        case K::kUndefined: return Value::Int(0);
        case K::kString: return Value::Int(static_cast<int64_t>(DecodeUtf8(v.as_string()).size()));
        case K::kList:
        case K::kTuple: return Value::Int(static_cast<int64_t>(v.as_list().size()));
        case K::kDict: return Value::Int(static_cast<int64_t>(v.as_dict().items.size()));
        case K::kView: return Value::Int(static_cast<int64_t>(v.as_view().items.size()));
        default: return TypeError(absl::StrCat("object of type '", v.TypeName(), "' has no len()"));
      }
    }
    if (name == "items") {
      if (v.is_undefined()) return Value::Iterator("generator", {});
      if (v.kind() != K::kDict) return TypeError("Can only get item pairs from a mapping.");
      ValueList pairs;
      for (const auto& [k, val] : v.as_dict().items) pairs.push_back(Value::Tuple({k, val}));
      return Value::Iterator("generator", std::move(pairs));
    }
    if (name == "list") {
      auto items = Iterate(v);
      if (!items.ok()) return items.status();
      return Value::List(std::move(*items));
    }
    if (name == "first" || name == "last") {
      if (v.is_undefined()) return Value::Undefined("No first item, sequence was empty.");
      if (v.kind() == K::kIterator) {
        IteratorState& it = v.as_iterator();
        if (name == "last") return TypeError(absl::StrCat("'", it.type_name, "' object is not reversible"));
        if (it.pos >= it.items.size()) return Value::Undefined("No first item, sequence was empty.");
        return it.items[it.pos++];
      }
      auto items = Iterate(v);
      if (!items.ok()) return items.status();
      if (items->empty()) {
        return Value::Undefined(absl::StrCat("No ", name, " item, sequence was empty."));
      }
      return name == "first" ? items->front() : items->back();
    }
    if (name == "reverse") {
      if (v.is_string()) {
        std::vector<char32_t> cps = DecodeUtf8(v.as_string());
        std::reverse(cps.begin(), cps.end());
        return Value::String(EncodeUtf8(cps, 0, cps.size()));
      }
      const bool was_iterator = v.kind() == K::kIterator;
      auto items = Iterate(v);
      if (!items.ok()) return items.status();
      std::reverse(items->begin(), items->end());
      // reversed() of a sequence is an iterator; a generator cannot be
      // reversed, so jinja2 falls back to a reversed list.
      if (was_iterator) return Value::List(std::move(*items));
      return Value::Iterator("list_reverseiterator", std::move(*items));
    }
    if (name == "join") {
      auto items = Iterate(v);
      if (!items.ok()) return items.status();
      std::string sep;
      if (const Value* d = Arg(args, 0, "d")) {
        auto s = PyStr(*d);
        if (!s.ok()) return s.status();
        sep = *s;
      }
      const Value* attribute = Arg(args, 1, "attribute");
      std::string out;
      for (size_t i = 0; i < items->size(); ++i) {
        Value item = (*items)[i];
        if (attribute != nullptr && !attribute->is_none()) {
          auto a = GetAttrPath(item, *attribute);
          if (!a.ok()) return a.status();
          item = *a;
        }
        auto s = PyStr(item);
        if (!s.ok()) return s.status();
        if (i > 0) out += sep;
        out += *s;
        if (auto st = CheckSize(out.size(), line); !st.ok()) return st;
      }
      return Value::String(std::move(out));
    }
    if (name == "map") {
      auto items = Iterate(v);
      if (!items.ok()) return items.status();
      ValueList out;
      if (args.positional.empty()) {
        const Value* attribute = Arg(args, 99, "attribute");
        if (attribute == nullptr) return TypeError("map() needs a filter name or attribute=");
        const Value* def = Arg(args, 99, "default");
        for (const Value& item : *items) {
          auto a = GetAttrPath(item, *attribute);
          if (!a.ok()) return a.status();
          out.push_back(a->is_undefined() && def != nullptr ? *def : *a);
        }
        return Value::Iterator("generator", std::move(out));
      }
      if (!args.positional[0].is_string() || !IsKnownFilter(args.positional[0].as_string())) {
        return TypeError("map() needs the name of a supported filter");
      }
      const std::string filter = args.positional[0].as_string();
      CallArgs rest;
      rest.positional.assign(args.positional.begin() + 1, args.positional.end());
      rest.keyword = args.keyword;
      for (const Value& item : *items) {
        if (auto s = Step(line); !s.ok()) return s;
        auto r = ApplyFilter(filter, item, rest, line);
        if (!r.ok()) return r;
        out.push_back(std::move(*r));
      }
      return Value::Iterator("generator", std::move(out));
    }
    if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
      auto items = Iterate(v);
      if (!items.ok()) return items.status();
      const bool by_attr = name.ends_with("attr");
      const bool want = name.starts_with("select");
      size_t next = 0;
      const Value* attribute = nullptr;
      if (by_attr) {
        if (args.positional.empty()) return TypeError(absl::StrCat(name, "() needs an attribute"));
        attribute = &args.positional[next++];
      }
      std::string test;
      if (next < args.positional.size()) {
        if (!args.positional[next].is_string() || !IsKnownTest(args.positional[next].as_string())) {
          return TypeError(absl::StrCat(name, "() needs the name of a supported test"));
        }
        test = args.positional[next++].as_string();
      }
      CallArgs test_args;
      test_args.positional.assign(args.positional.begin() + static_cast<std::ptrdiff_t>(next), args.positional.end());
      ValueList out;
      for (const Value& item : *items) {
        if (auto s = Step(line); !s.ok()) return s;
        Value probe = item;
        if (attribute != nullptr) {
          auto a = GetAttrPath(item, *attribute);
          if (!a.ok()) return a.status();
          probe = *a;
        }
        bool ok;
        if (test.empty()) {
          ok = Truthy(probe);
        } else {
          auto r = ApplyTest(test, probe, test_args);
          if (!r.ok()) return r.status();
          ok = *r;
        }
        if (ok == want) out.push_back(item);
      }
      return Value::Iterator("generator", std::move(out));
    }
    if (name == "unique" || name == "sort") {
      auto items = Iterate(v);
      if (!items.ok()) return items.status();
      const bool sort = name == "sort";
      const Value* reverse = sort ? Arg(args, 0, "reverse") : nullptr;
      const Value* case_sensitive = Arg(args, sort ? 1 : 0, "case_sensitive");
      const Value* attribute = Arg(args, sort ? 2 : 1, "attribute");
      const bool cs = case_sensitive != nullptr && Truthy(*case_sensitive);
      std::vector<Value> keys;
      for (const Value& item : *items) {
        Value k = item;
        if (attribute != nullptr && !attribute->is_none()) {
          auto a = GetAttrPath(item, *attribute);
          if (!a.ok()) return a.status();
          k = *a;
        }
        if (!cs && k.is_string()) {
          if (auto st = CheckCaseMappable(k.as_string()); !st.ok()) return st;
          k = Value::String(AsciiLower(k.as_string()));
        }
        keys.push_back(std::move(k));
      }
      if (!sort) {
        ValueList out;
        std::vector<Value> seen;
        for (size_t i = 0; i < items->size(); ++i) {
          bool dup = false;
          for (const Value& s : seen) {
            if (PyEquals(s, keys[i])) {
              dup = true;
              break;
            }
          }
          if (!dup) {
            seen.push_back(keys[i]);
            out.push_back((*items)[i]);
          }
        }
        return Value::Iterator("generator", std::move(out));
      }
      std::vector<size_t> order(items->size());
      for (size_t i = 0; i < order.size(); ++i) order[i] = i;
      absl::Status status;
      const bool rev = reverse != nullptr && Truthy(*reverse);
      std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
        auto c = PyCompare(keys[a], keys[b]);
        if (!c.ok()) {
          status = c.status();
          return false;
        }
        return rev ? *c > 0 : *c < 0;
      });
      if (!status.ok()) return status;
      ValueList out;
      for (size_t i : order) out.push_back((*items)[i]);
      return Value::List(std::move(out));
    }
    if (name == "sum") {
      auto items = Iterate(v);
      if (!items.ok()) return items.status();
      const Value* attribute = Arg(args, 0, "attribute");
      Value total = Value::Int(0);
      if (const Value* start = Arg(args, 1, "start")) total = *start;
      for (const Value& item : *items) {
        Value x = item;
        if (attribute != nullptr && !attribute->is_none()) {
          auto a = GetAttrPath(item, *attribute);
          if (!a.ok()) return a.status();
          x = *a;
        }
        auto r = BinaryOp("+", total, x, line);
        if (!r.ok()) return r;
        total = std::move(*r);
      }
      return total;
    }
    if (name == "abs") {
      if (v.kind() == K::kFloat) return Value::Float(std::fabs(v.as_float()));
      if (v.kind() == K::kInt || v.kind() == K::kBool) {
        if (v.as_integer() == INT64_MIN) return TypeError("integer overflow");
        return Value::Int(std::llabs(v.as_integer()));
      }
      if (v.is_undefined()) return UndefinedError(v);
      return TypeError(absl::StrCat("bad operand type for abs(): '", v.TypeName(), "'"));
    }
    if ((name == "int" || name == "float") && v.is_undefined()) {
      return UndefinedError(v);  // Undefined.__int__/__float__ raise.
    }
    if (name == "int") {
      const Value* def = Arg(args, 0, "default");
      const Value fallback = def != nullptr ? *def : Value::Int(0);
      if (const Value* base = Arg(args, 1, "base"); base != nullptr && !(base->kind() == K::kInt && base->as_int() == 10)) {
        return TypeError("int filter: only base 10 is supported");
      }
      if (v.kind() == K::kInt || v.kind() == K::kBool) return Value::Int(v.as_integer());
      if (v.kind() == K::kFloat) {
        const double d = v.as_float();
        if (!std::isfinite(d) || std::fabs(d) > 9.2e18) return fallback;
        return Value::Int(static_cast<int64_t>(d));
      }
      if (v.is_string()) {
        if (auto i = ParsePyInt(v.as_string())) return Value::Int(*i);
        if (auto f = ParsePyFloat(v.as_string()); f && std::isfinite(*f) && std::fabs(*f) < 9.2e18) {
          return Value::Int(static_cast<int64_t>(*f));
        }
      }
      return fallback;
    }
    if (name == "float") {
      const Value* def = Arg(args, 0, "default");
      const Value fallback = def != nullptr ? *def : Value::Float(0.0);
      if (v.is_number()) return Value::Float(v.as_double());
      if (v.is_string()) {
        if (auto f = ParsePyFloat(v.as_string())) return Value::Float(*f);
      }
      return fallback;
    }
    if (name == "round") {
      auto precision = IntArg(Arg(args, 0, "precision"), 0, "precision");
      if (!precision.ok()) return precision.status();
      std::string method = "common";
      if (const Value* m = Arg(args, 1, "method")) {
        if (!m->is_string()) return TypeError("round method must be a string");
        method = m->as_string();
      }
      if (method != "common" && method != "ceil" && method != "floor") {
        return TypeError("method must be common, ceil or floor");
      }
      if (!v.is_number()) {
        if (v.is_undefined()) return UndefinedError(v);
        return TypeError(absl::StrCat("type ", v.TypeName(), " doesn't define __round__ method"));
      }
      const int64_t p = std::clamp<int64_t>(*precision, -300, 300);
      if (method == "common") {
        if (v.kind() != K::kFloat) {
          if (p >= 0) return Value::Int(v.as_integer());
          return TypeError("round() with negative precision on an integer is not supported");
        }
        const double d = v.as_float();
        if (!std::isfinite(d)) return Value::Float(d);
        if (p == 0) return Value::Float(std::nearbyint(d));
        if (p < 0) return TypeError("round() with negative precision is not supported");
        char buf[512];
        std::snprintf(buf, sizeof(buf), "%.*f", static_cast<int>(std::min<int64_t>(p, 100)), d);
        return Value::Float(std::strtod(buf, nullptr));
      }
      const double scale = std::pow(10.0, static_cast<double>(p));
      const double x = v.as_double() * scale;
      return Value::Float((method == "ceil" ? std::ceil(x) : std::floor(x)) / scale);
    }
    // String filters.
    auto str = PyStr(v);
    if (!str.ok()) return str.status();
    if (name == "string") return Value::String(*str);
    if (name == "trim") {
      auto chars = OptStrArg(Arg(args, 0, "chars"), "trim chars");
      if (!chars.ok()) return chars.status();
      return Value::String(Strip(*str, *chars, true, true));
    }
    if (name == "upper" || name == "lower" || name == "capitalize" || name == "title") {
      if (auto st = CheckCaseMappable(*str); !st.ok()) return st;
      if (name == "upper") return Value::String(AsciiUpper(*str));
      if (name == "lower") return Value::String(AsciiLower(*str));
      if (name == "capitalize") return Value::String(Capitalize(*str));
      return Value::String(JinjaTitle(*str));
    }
    if (name == "e" || name == "escape") return Value::Markup(HtmlEscape(*str));
    if (name == "replace") {
      auto old = Arg(args, 0, "old");
      auto repl = Arg(args, 1, "new");
      if (old == nullptr || repl == nullptr) return TypeError("replace needs old and new");
      auto o = PyStr(*old);
      if (!o.ok()) return o.status();
      auto n = PyStr(*repl);
      if (!n.ok()) return n.status();
      int64_t count = -1;
      if (const Value* c = Arg(args, 2, "count"); c != nullptr && !c->is_none()) {
        auto ci = IntArg(c, -1, "count");
        if (!ci.ok()) return ci.status();
        count = *ci;
      }
      std::string r = Replace(*str, *o, *n, count);
      if (auto st = CheckSize(r.size(), line); !st.ok()) return st;
      return Value::String(std::move(r));
    }
    if (name == "indent") {
      // do_indent appends "\n" to its argument without str(): only strings.
      if (!v.is_string()) {
        if (v.is_undefined()) return UndefinedError(v);
        return TypeError(absl::StrCat("unsupported operand type(s) for +=: '", v.TypeName(), "' and 'str'"));
      }
      std::string indention = "    ";
      if (const Value* w = Arg(args, 0, "width")) {
        if (w->is_string()) {
          indention = w->as_string();
        } else if (w->kind() == K::kInt) {
          indention = std::string(static_cast<size_t>(std::clamp<int64_t>(w->as_int(), 0, 1024)), ' ');
        } else {
          return TypeError("indent width must be an integer or a string");
        }
      }
      const Value* first = Arg(args, 1, "first");
      const Value* blank = Arg(args, 2, "blank");
      std::vector<std::string> lines = SplitLines(*str + "\n", false);
      std::string rv;
      if (blank != nullptr && Truthy(*blank)) {
        for (size_t i = 0; i < lines.size(); ++i) {
          if (i > 0) rv += "\n" + indention;
          rv += lines[i];
        }
      } else if (!lines.empty()) {
        rv = lines[0];
        for (size_t i = 1; i < lines.size(); ++i) {
          rv += "\n";
          if (!lines[i].empty()) rv += indention;
          rv += lines[i];
        }
      }
      if (first != nullptr && Truthy(*first)) rv = indention + rv;
      if (auto st = CheckSize(rv.size(), line); !st.ok()) return st;
      return Value::String(std::move(rv));
    }
    return Error(line, absl::StrCat("filter '", name, "' is not implemented"));
  }

  const RenderInputs& inputs_;
  const RenderLimits& limits_;
  int64_t steps_ = 0;
  int depth_ = 0;
  std::vector<std::weak_ptr<Namespace>> namespaces_;
};

}  // namespace

absl::StatusOr<std::string> RenderProgram(const Program& program, const RenderInputs& inputs,
                                          const RenderLimits& limits) {
  Interpreter interpreter(inputs, limits);
  return interpreter.Run(program);
}

}  // namespace pdserve::jinja
