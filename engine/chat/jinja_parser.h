// Lexer and parser for the Jinja2 subset chat templates use.
//
// Internal to engine/chat/. Lexing follows jinja2's lexer with the settings
// transformers uses (trim_blocks=True, lstrip_blocks=True,
// keep_trailing_newline=False, `-`/`+` whitespace control). Anything the
// interpreter cannot run (an unknown filter, test, statement, global
// function or method) is an InvalidArgumentError here, naming the construct
// and its line, so that an unsupported template never renders a wrong prompt.
//
// The tree is immutable after parsing and is shared by concurrent renders.
#ifndef PDSERVE_ENGINE_CHAT_JINJA_PARSER_H_
#define PDSERVE_ENGINE_CHAT_JINJA_PARSER_H_

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/chat/jinja_value.h"

namespace pdserve::jinja {

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    kLiteral,   // literal
    kName,      // name
    kList,      // children
    kTuple,     // children
    kDict,      // children: key, value, key, value...
    kAttr,      // children[0] . name
    kItem,      // children[0] [ children[1] ]
    kSlice,     // children[0] [ children[1] : children[2] : children[3] ] (null = omitted)
    kCall,      // children[0] ( children[1..], kwargs )
    kFilter,    // children[0] | name ( children[1..], kwargs )
    kTest,      // children[0] is [not] name ( children[1..] )
    kUnary,     // op children[0]: "not", "-", "+"
    kBinary,    // children[0] op children[1]
    kCompare,   // children[0] ops[0] children[1] ops[1] ... (Python's chained comparison)
    kAnd,
    kOr,
    kCond,      // children[1] if children[0] else children[2] (null: undefined)
  };
  Kind kind;
  int line = 0;
  Value literal;
  std::string name;  // Name, attribute, filter, test, or operator.
  bool negated = false;
  std::vector<ExprPtr> children;
  std::vector<std::pair<std::string, ExprPtr>> kwargs;
  std::vector<std::string> ops;  // kCompare.
};

struct Node;
using NodeList = std::vector<std::unique_ptr<Node>>;

struct Node {
  enum class Kind {
    kText,      // text
    kOutput,    // {{ expr }}
    kIf,        // conditions[i] -> bodies[i]; else_body
    kFor,       // targets in expr [if filter]: body; else_body
    kSet,       // targets (or ns.attr) = expr
    kSetBlock,  // {% set name %}body{% endset %}
    kMacro,     // name(params) body
    kBreak,
    kContinue,
    kScope,     // body run as is ({% generation %}).
  };
  Kind kind;
  int line = 0;
  std::string text;
  ExprPtr expr;
  ExprPtr filter;
  std::vector<std::string> targets;  // Names; for kSet with attr: {ns, attr}.
  bool set_attr = false;
  std::vector<ExprPtr> conditions;
  std::vector<NodeList> bodies;
  NodeList body;
  NodeList else_body;
  std::string name;
  std::vector<std::pair<std::string, ExprPtr>> params;  // Macro params, default may be null.
};

struct Program {
  NodeList body;
};

// Parses `source`; errors name the line ("line 12: unknown filter 'wordwrap'").
absl::StatusOr<std::unique_ptr<Program>> ParseTemplate(std::string_view source);

// Parse-time bound on nesting (expressions and blocks), so that hostile
// templates cannot overflow the stack.
inline constexpr int kMaxParseDepth = 200;

}  // namespace pdserve::jinja

#endif  // PDSERVE_ENGINE_CHAT_JINJA_PARSER_H_
