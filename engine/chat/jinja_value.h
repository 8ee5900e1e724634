// Values of the chat-template language, with Python's semantics.
//
// Internal to engine/chat/. Chat templates are Jinja2 run by Python, so a
// value behaves like the Python object jinja2 would hold: str() and repr()
// print what Python prints ("None", "True", "[1, 'a']", "1e+16"), `==` is
// Python equality (1 == 1.0 == True), truthiness is Python's, and tojson is
// json.dumps as transformers calls it. Strings are UTF-8; lengths, indices
// and slices count code points, as Python's str does.
//
// Lists, tuples and dicts are immutable and shared (the sandbox jinja2 runs
// chat templates in forbids mutation); a namespace() is the one mutable
// object. Undefined carries the message jinja2 would raise when it is used.
//
// Thread-safety: a Value may be read from many threads when nothing holds a
// Namespace or LoopState (those exist only inside one Render call).
#ifndef PDSERVE_ENGINE_CHAT_JINJA_VALUE_H_
#define PDSERVE_ENGINE_CHAT_JINJA_VALUE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace pdserve::jinja {

class Value;
using ValueList = std::vector<Value>;

// An insertion-ordered mapping (Python dicts keep insertion order).
struct ValueDict {
  std::vector<std::pair<Value, Value>> items;
  const Value* Find(const Value& key) const;
  const Value* Find(std::string_view key) const;
};

// namespace(): the only mutable object a template can build.
struct Namespace {
  ValueDict attrs;
};

struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

// A global function, a macro, or a bound method ("abc".strip).
struct Callable {
  std::string name;
  std::function<absl::StatusOr<Value>(CallArgs&)> fn;
};

// A Python iterator (a generator from select/map/..., reversed()): always
// true, no len(), not printable, and single-pass: iterating consumes it.
struct IteratorState {
  std::string type_name;  // "generator", "list_reverseiterator".
  ValueList items;
  size_t pos = 0;
};

// A Python view or range (dict.items()/keys()/values(), range()): has a
// length, iterates many times, prints as "dict_keys([...])"/"range(0, 3)"
// and is not JSON serializable.
struct ViewData {
  std::string type_name;  // "dict_items", "dict_keys", "dict_values", "range".
  ValueList items;
  int64_t start = 0, stop = 0, step = 1;  // range only.
};

// The `loop` variable of a for loop.
struct LoopState {
  int64_t index0 = 0;
  int64_t length = 0;
  std::shared_ptr<const ValueList> items;  // The (filtered) items iterated.
};

class Value {
 public:
  enum class Kind {
    kUndefined, kNone, kBool, kInt, kFloat, kString, kList, kTuple, kDict,
    kNamespace, kCallable, kLoop, kIterator, kView,
  };

  Value() = default;  // Undefined.
  static Value Undefined(std::string hint) {
    Value v;
    v.hint_ = std::make_shared<const std::string>(std::move(hint));
    return v;
  }
  static Value None() { return Value(Kind::kNone, std::monostate{}); }
  static Value Bool(bool b) { return Value(Kind::kBool, b); }
  static Value Int(int64_t i) { return Value(Kind::kInt, i); }
  static Value Float(double d) { return Value(Kind::kFloat, d); }
  static Value String(std::string s) { return Value(Kind::kString, std::move(s)); }
  // markupsafe.Markup (what `safe` and `escape` return): a str that escapes
  // plain strings added to it.
  static Value Markup(std::string s) {
    Value v(Kind::kString, std::move(s));
    v.markup_ = true;
    return v;
  }
  static Value List(ValueList items) {
    return Value(Kind::kList, std::make_shared<const ValueList>(std::move(items)));
  }
  static Value Tuple(ValueList items) {
    return Value(Kind::kTuple, std::make_shared<const ValueList>(std::move(items)));
  }
  static Value Dict(ValueDict dict) {
    return Value(Kind::kDict, std::make_shared<const ValueDict>(std::move(dict)));
  }
  static Value MakeNamespace(std::shared_ptr<Namespace> ns) {
    return Value(Kind::kNamespace, std::move(ns));
  }
  static Value MakeCallable(std::string name,
                            std::function<absl::StatusOr<Value>(CallArgs&)> fn) {
    return Value(Kind::kCallable,
                 std::make_shared<const Callable>(Callable{std::move(name), std::move(fn)}));
  }
  static Value MakeLoop(std::shared_ptr<LoopState> loop) {
    return Value(Kind::kLoop, std::move(loop));
  }
  static Value Iterator(std::string type_name, ValueList items) {
    auto state = std::make_shared<IteratorState>();
    state->type_name = std::move(type_name);
    state->items = std::move(items);
    return Value(Kind::kIterator, std::move(state));
  }
  static Value View(ViewData view) {
    return Value(Kind::kView, std::make_shared<const ViewData>(std::move(view)));
  }
  // JSON (ordered, so that tojson keeps the caller's key order) to Value.
  static Value FromJson(const nlohmann::ordered_json& j);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_markup() const { return markup_; }
  bool is_sequence_list() const { return kind_ == Kind::kList || kind_ == Kind::kTuple; }
  bool is_number() const {
    return kind_ == Kind::kInt || kind_ == Kind::kFloat || kind_ == Kind::kBool;
  }

  bool as_bool() const { return std::get<bool>(data_); }
  int64_t as_int() const { return std::get<int64_t>(data_); }
  double as_float() const { return std::get<double>(data_); }
  // Int or bool as an integer (Python's bool is an int).
  int64_t as_integer() const { return kind_ == Kind::kBool ? as_bool() : as_int(); }
  double as_double() const { return kind_ == Kind::kFloat ? as_float() : as_integer(); }
  const std::string& as_string() const { return std::get<std::string>(data_); }
  const ValueList& as_list() const { return *std::get<std::shared_ptr<const ValueList>>(data_); }
  const ValueDict& as_dict() const { return *std::get<std::shared_ptr<const ValueDict>>(data_); }
  Namespace& as_namespace() const { return *std::get<std::shared_ptr<Namespace>>(data_); }
  const Callable& as_callable() const { return *std::get<std::shared_ptr<const Callable>>(data_); }
  LoopState& as_loop() const { return *std::get<std::shared_ptr<LoopState>>(data_); }
  IteratorState& as_iterator() const { return *std::get<std::shared_ptr<IteratorState>>(data_); }
  const ViewData& as_view() const { return *std::get<std::shared_ptr<const ViewData>>(data_); }
  // The message jinja2 raises when this undefined value is used.
  std::string undefined_hint() const { return hint_ ? *hint_ : "value is undefined"; }

  // Python's "type object" name used in jinja2's messages ('dict object').
  std::string TypeName() const;

 private:
  using Data = std::variant<std::monostate, bool, int64_t, double, std::string,
                            std::shared_ptr<const ValueList>, std::shared_ptr<const ValueDict>,
                            std::shared_ptr<Namespace>, std::shared_ptr<const Callable>,
                            std::shared_ptr<LoopState>, std::shared_ptr<IteratorState>,
                            std::shared_ptr<const ViewData>>;
  template <typename T>
  Value(Kind kind, T data) : kind_(kind), data_(std::move(data)) {}

  Kind kind_ = Kind::kUndefined;
  Data data_;
  std::shared_ptr<const std::string> hint_;
  bool markup_ = false;
};

// Python truthiness (undefined is false).
bool Truthy(const Value& v);
// Python ==.
bool PyEquals(const Value& a, const Value& b);
// Python <, as -1/0/1; TypeError (InvalidArgument) for unorderable types.
absl::StatusOr<int> PyCompare(const Value& a, const Value& b);
// str(v) (undefined prints ""). Fails for objects whose str() Python would
// print with a memory address (functions, methods, loop).
absl::StatusOr<std::string> PyStr(const Value& v);
absl::StatusOr<std::string> PyRepr(const Value& v);
// Python's repr(float).
std::string PyFloatRepr(double d);

// json.dumps(v, ensure_ascii, indent, separators, sort_keys): `indent` < 0
// means None; `indent_str` (when set) is a string indent.
struct JsonDumpsOptions {
  bool ensure_ascii = false;
  int indent = -1;
  std::optional<std::string> indent_str;
  std::optional<std::pair<std::string, std::string>> separators;
  bool sort_keys = false;
};
absl::StatusOr<std::string> JsonDumps(const Value& v, const JsonDumpsOptions& options);

// UTF-8 helpers: code points of a string, and back.
std::vector<char32_t> DecodeUtf8(std::string_view s);
void AppendUtf8(char32_t c, std::string& out);
std::string EncodeUtf8(const std::vector<char32_t>& cps, size_t begin, size_t end);
// Python's str.isspace for one code point.
bool IsPyWhitespace(char32_t c);
// Strict UTF-8 (no overlongs, surrogates or code points past U+10FFFF).
bool IsValidUtf8(std::string_view s);
// Number of code points.
size_t Utf8Length(std::string_view s);

}  // namespace pdserve::jinja

#endif  // PDSERVE_ENGINE_CHAT_JINJA_VALUE_H_
