#include "engine/chat/jinja_value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "absl/strings/str_cat.h"

namespace pdserve::jinja {

const Value* ValueDict::Find(const Value& key) const {
  for (const auto& [k, v] : items) {
    if (PyEquals(k, key)) return &v;
  }
  return nullptr;
}

const Value* ValueDict::Find(std::string_view key) const {
  for (const auto& [k, v] : items) {
    if (k.is_string() && k.as_string() == key) return &v;
  }
  return nullptr;
}

Value Value::FromJson(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return None();
    case nlohmann::ordered_json::value_t::boolean:
      return Bool(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Int(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      if (u <= static_cast<uint64_t>(INT64_MAX)) return Int(static_cast<int64_t>(u));
      return Float(static_cast<double>(u));
    }
    case nlohmann::ordered_json::value_t::number_float:
      return Float(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return String(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      ValueList items;
      items.reserve(j.size());
      for (const auto& e : j) items.push_back(FromJson(e));
      return List(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      ValueDict dict;
      dict.items.reserve(j.size());
      for (const auto& [k, v] : j.items()) dict.items.emplace_back(String(k), FromJson(v));
      return Dict(std::move(dict));
    }
    default:
      return None();  // Binary and discarded values do not come from JSON text.
  }
}

std::string Value::TypeName() const {
  switch (kind_) {
    case Kind::kUndefined: return "Undefined";
    case Kind::kNone: return "NoneType";
    case Kind::kBool: return "bool";
    case Kind::kInt: return "int";
    case Kind::kFloat: return "float";
    case Kind::kString: return "str";
    case Kind::kList: return "list";
    case Kind::kTuple: return "tuple";
    case Kind::kDict: return "dict";
    case Kind::kNamespace: return "Namespace";
    case Kind::kCallable: return "function";
    case Kind::kLoop: return "LoopContext";
    case Kind::kIterator: return as_iterator().type_name;
    case Kind::kView: return as_view().type_name;
  }
  return "object";
}

bool Truthy(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone: return false;
    case Value::Kind::kBool: return v.as_bool();
    case Value::Kind::kInt: return v.as_int() != 0;
    case Value::Kind::kFloat: return v.as_float() != 0.0;
    case Value::Kind::kString: return !v.as_string().empty();
    case Value::Kind::kList:
    case Value::Kind::kTuple: return !v.as_list().empty();
    case Value::Kind::kDict: return !v.as_dict().items.empty();
    case Value::Kind::kView: return !v.as_view().items.empty();
    default: return true;
  }
}

bool PyEquals(const Value& a, const Value& b) {
  using K = Value::Kind;
  if (a.is_number() && b.is_number()) {
    if (a.kind() != K::kFloat && b.kind() != K::kFloat) return a.as_integer() == b.as_integer();
    return a.as_double() == b.as_double();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case K::kUndefined:
    case K::kNone: return true;
    case K::kString: return a.as_string() == b.as_string();
    case K::kList:
    case K::kTuple: {
      const ValueList& x = a.as_list();
      const ValueList& y = b.as_list();
      if (x.size() != y.size()) return false;
      for (size_t i = 0; i < x.size(); ++i) {
        if (!PyEquals(x[i], y[i])) return false;
      }
      return true;
    }
    case K::kDict: {
      const ValueDict& x = a.as_dict();
      const ValueDict& y = b.as_dict();
      if (x.items.size() != y.items.size()) return false;
      for (const auto& [k, v] : x.items) {
        const Value* other = y.Find(k);
        if (other == nullptr || !PyEquals(v, *other)) return false;
      }
      return true;
    }
    case K::kNamespace: return &a.as_namespace() == &b.as_namespace();
    case K::kCallable: return &a.as_callable() == &b.as_callable();
    case K::kLoop: return &a.as_loop() == &b.as_loop();
    case K::kIterator: return &a.as_iterator() == &b.as_iterator();
    case K::kView: {
      const ViewData& x = a.as_view();
      const ViewData& y = b.as_view();
      if (&x == &y) return true;
      if (x.type_name != y.type_name || x.type_name == "dict_values") return false;
      if (x.items.size() != y.items.size()) return false;
      if (x.type_name == "range") {
        return PyEquals(Value::List(x.items), Value::List(y.items));
      }
      // dict_keys / dict_items compare as sets.
      for (const Value& e : x.items) {
        bool found = false;
        for (const Value& f : y.items) {
          if (PyEquals(e, f)) {
            found = true;
            break;
          }
        }
        if (!found) return false;
      }
      return true;
    }
    default: return false;
  }
}

absl::StatusOr<int> PyCompare(const Value& a, const Value& b) {
  using K = Value::Kind;
  if (a.is_number() && b.is_number()) {
    if (a.kind() != K::kFloat && b.kind() != K::kFloat) {
      return a.as_integer() < b.as_integer() ? -1 : (a.as_integer() > b.as_integer() ? 1 : 0);
    }
    const double x = a.as_double(), y = b.as_double();
    return x < y ? -1 : (x > y ? 1 : 0);
  }
  if (a.is_string() && b.is_string()) {
    // UTF-8 byte order is code point order.
    const int c = a.as_string().compare(b.as_string());
    return c < 0 ? -1 : (c > 0 ? 1 : 0);
  }
  if (a.kind() == b.kind() && a.is_sequence_list()) {
    const ValueList& x = a.as_list();
    const ValueList& y = b.as_list();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (PyEquals(x[i], y[i])) continue;
      return PyCompare(x[i], y[i]);
    }
    return x.size() < y.size() ? -1 : (x.size() > y.size() ? 1 : 0);
  }
  if (a.is_undefined() || b.is_undefined()) {
    return absl::InvalidArgumentError(a.is_undefined() ? a.undefined_hint() : b.undefined_hint());
  }
  return absl::InvalidArgumentError(absl::StrCat("'<' not supported between instances of '",
                                                 a.TypeName(), "' and '", b.TypeName(), "'"));
}

std::string PyFloatRepr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  // sci: [-]D[.DDD]e[+-]XX
  bool neg = false;
  if (!sci.empty() && sci[0] == '-') {
    neg = true;
    sci.erase(0, 1);
  }
  const size_t e = sci.find('e');
  std::string mant = sci.substr(0, e);
  const int exp = std::stoi(sci.substr(e + 1));
  std::string digits;
  for (char c : mant) {
    if (c != '.') digits.push_back(c);
  }
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  std::string out = neg ? "-" : "";
  if (exp >= -4 && exp < 16) {
    if (exp >= 0) {
      const size_t int_len = static_cast<size_t>(exp) + 1;
      if (digits.size() <= int_len) {
        out += digits + std::string(int_len - digits.size(), '0') + ".0";
      } else {
        out += digits.substr(0, int_len) + "." + digits.substr(int_len);
      }
    } else {
      out += "0." + std::string(static_cast<size_t>(-exp - 1), '0') + digits;
    }
    return out;
  }
  out += digits.substr(0, 1);
  if (digits.size() > 1) out += "." + digits.substr(1);
  char ebuf[16];
  std::snprintf(ebuf, sizeof(ebuf), "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
  return out + ebuf;
}

namespace {

// Python's str.isprintable, closely enough for repr(): controls, separators
// other than the space and format characters are escaped.
bool IsPyPrintable(char32_t c) {
  if (c < 0x20 || c == 0x7f) return false;
  if (c >= 0x80 && c <= 0xa0) return false;
  if (c == 0xad || c == 0x1680 || (c >= 0x2000 && c <= 0x200f) || (c >= 0x2028 && c <= 0x202f) ||
      (c >= 0x205f && c <= 0x2064) || c == 0x3000 || c == 0xfeff) {
    return false;
  }
  if (c >= 0xd800 && c <= 0xdfff) return false;
  return true;
}

void AppendHexEscape(char32_t c, std::string& out) {
  char buf[16];
  if (c < 0x100) {
    std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned>(c));
  } else if (c < 0x10000) {
    std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
  } else {
    std::snprintf(buf, sizeof(buf), "\\U%08x", static_cast<unsigned>(c));
  }
  out += buf;
}

std::string PyStringRepr(const std::string& s) {
  const bool has_single = s.find('\'') != std::string::npos;
  const bool has_double = s.find('"') != std::string::npos;
  const char quote = (has_single && !has_double) ? '"' : '\'';
  std::string out(1, quote);
  for (char32_t c : DecodeUtf8(s)) {
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (!IsPyPrintable(c)) {
      AppendHexEscape(c, out);
    } else {
      AppendUtf8(c, out);
    }
  }
  out.push_back(quote);
  return out;
}

absl::Status NotPrintable(const Value& v) {
  return absl::InvalidArgumentError(
      absl::StrCat("cannot convert a ", v.TypeName(), " object to a string"));
}

}  // namespace

// PyRepr without the depth guard; its nested values go through PyRepr.
static absl::StatusOr<std::string> ReprOf(const Value& v) {
  using K = Value::Kind;
  switch (v.kind()) {
    case K::kString: return PyStringRepr(v.as_string());
    case K::kList:
    case K::kTuple: {
      const bool tuple = v.kind() == K::kTuple;
      std::string out = tuple ? "(" : "[";
      const ValueList& items = v.as_list();
      for (size_t i = 0; i < items.size(); ++i) {
        if (i > 0) out += ", ";
        auto r = PyRepr(items[i]);
        if (!r.ok()) return r.status();
        out += *r;
      }
      if (tuple && items.size() == 1) out += ",";
      out += tuple ? ")" : "]";
      return out;
    }
    case K::kDict: {
      std::string out = "{";
      bool first = true;
      for (const auto& [k, val] : v.as_dict().items) {
        if (!first) out += ", ";
        first = false;
        auto kr = PyRepr(k);
        if (!kr.ok()) return kr.status();
        auto vr = PyRepr(val);
        if (!vr.ok()) return vr.status();
        absl::StrAppend(&out, *kr, ": ", *vr);
      }
      return out + "}";
    }
    case K::kUndefined: return std::string("Undefined");
    default: return PyStr(v);
  }
}

absl::StatusOr<std::string> PyRepr(const Value& v) {
  // A list that holds itself (`x.append(x)`), or nesting this deep, would
  // overflow the stack: refused instead.
  constexpr int kMaxDepth = 200;
  static thread_local int depth = 0;
  if (depth >= kMaxDepth) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot print a value nested more than ", kMaxDepth, " deep (does a list contain itself?)"));
  }
  ++depth;
  absl::StatusOr<std::string> out = ReprOf(v);
  --depth;
  return out;
}

absl::StatusOr<std::string> PyStr(const Value& v) {
  using K = Value::Kind;
  switch (v.kind()) {
    case K::kUndefined: return std::string();
    case K::kNone: return std::string("None");
    case K::kBool: return std::string(v.as_bool() ? "True" : "False");
    case K::kInt: return std::to_string(v.as_int());
    case K::kFloat: return PyFloatRepr(v.as_float());
    case K::kString: return v.as_string();
    case K::kList:
    case K::kTuple:
    case K::kDict: return PyRepr(v);
    case K::kView: {
      const ViewData& view = v.as_view();
      if (view.type_name == "range") {
        if (view.step == 1) return absl::StrCat("range(", view.start, ", ", view.stop, ")");
        return absl::StrCat("range(", view.start, ", ", view.stop, ", ", view.step, ")");
      }
      auto r = PyRepr(Value::List(view.items));
      if (!r.ok()) return r.status();
      return absl::StrCat(view.type_name, "(", *r, ")");
    }
    case K::kNamespace: {
      auto r = PyRepr(Value::Dict(v.as_namespace().attrs));
      if (!r.ok()) return r.status();
      return absl::StrCat("<Namespace ", *r, ">");
    }
    default: return NotPrintable(v);
  }
}

namespace {

void JsonString(const std::string& s, bool ensure_ascii, std::string& out) {
  out.push_back('"');
  for (char32_t c : DecodeUtf8(s)) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default: {
        char buf[16];
        if (c < 0x20 || (ensure_ascii && c > 0x7e)) {
          if (c >= 0x10000) {
            const char32_t v = c - 0x10000;
            std::snprintf(buf, sizeof(buf), "\\u%04x\\u%04x", static_cast<unsigned>(0xd800 + (v >> 10)),
                          static_cast<unsigned>(0xdc00 + (v & 0x3ff)));
          } else {
            std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
          }
          out += buf;
        } else {
          AppendUtf8(c, out);
        }
      }
    }
  }
  out.push_back('"');
}

absl::Status JsonDumpsInto(const Value& v, const JsonDumpsOptions& o, int depth, std::string& out) {
  using K = Value::Kind;
  if (depth > 512) return absl::InvalidArgumentError("tojson: value nested too deeply");
  const bool pretty = o.indent >= 0 || o.indent_str.has_value();
  const std::string item_sep = o.separators ? o.separators->first : (pretty ? "," : ", ");
  const std::string key_sep = o.separators ? o.separators->second : ": ";
  auto newline = [&](int level) {
    out.push_back('\n');
    for (int i = 0; i < level; ++i) {
      if (o.indent_str) {
        out += *o.indent_str;
      } else {
        out.append(static_cast<size_t>(o.indent), ' ');
      }
    }
  };
  switch (v.kind()) {
    case K::kNone: out += "null"; return absl::OkStatus();
    case K::kBool: out += v.as_bool() ? "true" : "false"; return absl::OkStatus();
    case K::kInt: out += std::to_string(v.as_int()); return absl::OkStatus();
    case K::kFloat: {
      const double d = v.as_float();
      if (std::isnan(d)) {
        out += "NaN";
      } else if (std::isinf(d)) {
        out += d > 0 ? "Infinity" : "-Infinity";
      } else {
        out += PyFloatRepr(d);
      }
      return absl::OkStatus();
    }
    case K::kString: JsonString(v.as_string(), o.ensure_ascii, out); return absl::OkStatus();
    case K::kList:
    case K::kTuple: {
      const ValueList& items = v.as_list();
      if (items.empty()) {
        out += "[]";
        return absl::OkStatus();
      }
      out.push_back('[');
      for (size_t i = 0; i < items.size(); ++i) {
        if (i > 0) out += item_sep;
        if (pretty) newline(depth + 1);
        if (auto s = JsonDumpsInto(items[i], o, depth + 1, out); !s.ok()) return s;
      }
      if (pretty) newline(depth);
      out.push_back(']');
      return absl::OkStatus();
    }
    case K::kDict: {
      std::vector<const std::pair<Value, Value>*> entries;
      for (const auto& kv : v.as_dict().items) entries.push_back(&kv);
      if (entries.empty()) {
        out += "{}";
        return absl::OkStatus();
      }
      if (o.sort_keys) {
        absl::Status status;
        std::stable_sort(entries.begin(), entries.end(), [&](const auto* a, const auto* b) {
          auto c = PyCompare(a->first, b->first);
          if (!c.ok()) {
            status = c.status();
            return false;
          }
          return *c < 0;
        });
        if (!status.ok()) return status;
      }
      out.push_back('{');
      bool first = true;
      for (const auto* kv : entries) {
        if (!first) out += item_sep;
        first = false;
        if (pretty) newline(depth + 1);
        const Value& key = kv->first;
        if (key.is_string()) {
          JsonString(key.as_string(), o.ensure_ascii, out);
        } else if (key.is_number() || key.is_none()) {
          std::string k;
          if (key.kind() == K::kBool) {
            k = key.as_bool() ? "true" : "false";
          } else if (key.is_none()) {
            k = "null";
          } else {
            k = *PyStr(key);
          }
          JsonString(k, o.ensure_ascii, out);
        } else {
          return absl::InvalidArgumentError(absl::StrCat(
              "keys must be str, int, float, bool or None, not ", key.TypeName()));
        }
        out += key_sep;
        if (auto s = JsonDumpsInto(kv->second, o, depth + 1, out); !s.ok()) return s;
      }
      if (pretty) newline(depth);
      out.push_back('}');
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError(
          absl::StrCat("Object of type ", v.TypeName(), " is not JSON serializable"));
  }
}

}  // namespace

absl::StatusOr<std::string> JsonDumps(const Value& v, const JsonDumpsOptions& options) {
  std::string out;
  if (auto s = JsonDumpsInto(v, options, 0, out); !s.ok()) return s;
  return out;
}

std::vector<char32_t> DecodeUtf8(std::string_view s) {
  std::vector<char32_t> out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    int len = 1;
    char32_t cp = c;
    if (c >= 0xf0 && c < 0xf8) {
      len = 4;
      cp = c & 0x07;
    } else if (c >= 0xe0) {
      len = c < 0xf0 ? 3 : 1;
      cp = c & 0x0f;
    } else if (c >= 0xc0) {
      len = 2;
      cp = c & 0x1f;
    }
    bool ok = len > 1 || c < 0x80;
    if (len > 1 && i + len <= s.size()) {
      for (int k = 1; k < len; ++k) {
        const unsigned char cc = static_cast<unsigned char>(s[i + k]);
        if ((cc & 0xc0) != 0x80) {
          ok = false;
          break;
        }
        cp = (cp << 6) | (cc & 0x3f);
      }
    } else if (len > 1) {
      ok = false;
    }
    if (!ok) {
      // Invalid UTF-8: keep the byte as U+FFFD so that lengths stay sane.
      out.push_back(0xfffd);
      i += 1;
      continue;
    }
    out.push_back(cp);
    i += len;
  }
  return out;
}

void AppendUtf8(char32_t c, std::string& out) {
  if (c < 0x80) {
    out.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out.push_back(static_cast<char>(0xc0 | (c >> 6)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3f)));
  } else if (c < 0x10000) {
    out.push_back(static_cast<char>(0xe0 | (c >> 12)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3f)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3f)));
  } else {
    out.push_back(static_cast<char>(0xf0 | (c >> 18)));
    out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3f)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3f)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3f)));
  }
}

std::string EncodeUtf8(const std::vector<char32_t>& cps, size_t begin, size_t end) {
  std::string out;
  for (size_t i = begin; i < end && i < cps.size(); ++i) AppendUtf8(cps[i], out);
  return out;
}

bool IsPyWhitespace(char32_t c) {
  return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 ||
         c == 0x202f || c == 0x205f || c == 0x3000;
}

bool IsValidUtf8(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len;
    char32_t cp;
    if (c >= 0xc2 && c <= 0xdf) {
      len = 2;
      cp = c & 0x1f;
    } else if (c >= 0xe0 && c <= 0xef) {
      len = 3;
      cp = c & 0x0f;
    } else if (c >= 0xf0 && c <= 0xf4) {
      len = 4;
      cp = c & 0x07;
    } else {
      return false;
    }
    if (i + len > s.size()) return false;
    for (size_t k = 1; k < len; ++k) {
      const unsigned char cc = static_cast<unsigned char>(s[i + k]);
      if ((cc & 0xc0) != 0x80) return false;
      cp = (cp << 6) | (cc & 0x3f);
    }
    if ((len == 3 && cp < 0x800) || (len == 4 && (cp < 0x10000 || cp > 0x10ffff)) ||
        (cp >= 0xd800 && cp <= 0xdfff)) {
      return false;
    }
    i += len;
  }
  return true;
}

size_t Utf8Length(std::string_view s) {
  size_t n = 0;
  for (char c : s) {
    if ((static_cast<unsigned char>(c) & 0xc0) != 0x80) ++n;
  }
  return n;
}

}  // namespace pdserve::jinja
