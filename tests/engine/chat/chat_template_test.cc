// The template language, construct by construct. Each expectation in the
// tables below is what Python jinja2 rendered through transformers'
// environment (transformers.utils.chat_template_utils._compile_jinja_template)
// for the same template and variables; the other tests check what only the
// C++ side defines: parse errors with lines, limits, thread safety, input
// normalization and LoadChatTemplate.
#include "engine/chat/chat_template.h"
#include "engine/chat/jinja_value.h"

#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/civil_time.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace pdserve {
namespace {

using OJson = nlohmann::ordered_json;
using testing::HasSubstr;

absl::StatusOr<std::string> RenderWith(const std::string& source, const OJson& vars,
                                       ChatTemplateLimits limits = {}) {
  auto tmpl = ChatTemplate::Parse(source, {}, limits);
  if (!tmpl.ok()) return tmpl.status();
  ChatTemplate::RenderRequest request;
  request.messages = OJson::parse(R"([{"role": "user", "content": "hi"}])");
  request.kwargs = vars;
  return (*tmpl)->Render(request);
}

struct LanguageCase {
  const char* name;
  const char* source;
  const char* vars;
  const char* python_output;
};

const LanguageCase kLanguageCases[] = {
    {"OutputLiterals", "{{ 1 }}|{{ 1.5 }}|{{ 'a' }}|{{ none }}|{{ true }}|{{ [1, 'x', none, false] }}|{{ {'k': 'v', 'n': 2} }}|{{ (1,) }}|{{ (1, 2) }}",
     "{}",
     "1|1.5|a|None|True|[1, 'x', None, False]|{'k': 'v', 'n': 2}|(1,)|(1, 2)"},
    {"FloatRepr", "{{ 1e20 }} {{ 1e16 }} {{ 1e15 }} {{ 0.0001 }} {{ 0.00001 }} {{ 10/3 }} {{ 2/1 }} {{ -0.5 }}",
     "{}",
     "1e+20 1e+16 1000000000000000.0 0.0001 1e-05 3.3333333333333335 2.0 -0.5"},
    {"Arithmetic", "{{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 7 % -3 }} {{ 2 ** 10 }} {{ 2 ** -1 }} {{ 7 / 2 }} {{ 1 + 2 * 3 - 4 }} {{ -(3) }} {{ 7.5 // 2 }} {{ 'ab' * 3 }}",
     "{}",
     "3 -4 2 -2 1024 0.5 3.5 3 -3 3.0 ababab"},
    {"Comparisons", "{{ 1 == 1.0 }} {{ true == 1 }} {{ 'a' < 'b' }} {{ [1, 2] < [1, 3] }} {{ 2 >= 2 }} {{ 'a' != 'a' }} {{ {'a': 1, 'b': 2} == {'b': 2, 'a': 1} }}",
     "{}",
     "True True True True True False True"},
    {"Logic", "{{ 0 or 'x' }}|{{ 'a' and 'b' }}|{{ '' and 'b' }}|{{ none or [] }}|{{ not 0 }}|{{ 'x' if false }}|{{ 'y' if 0 else 'z' }}",
     "{}",
     "x|b||[]|True||z"},
    {"InOperator", "{{ 'b' in 'abc' }} {{ 2 in [1, 2] }} {{ 'k' in {'k': 1} }} {{ 'z' not in 'abc' }} {{ 1 in undefined_thing }}",
     "{}",
     "True True True True False"},
    {"Concat", "{{ 'a' ~ 1 ~ none ~ undefined_thing ~ [1] }}",
     "{}",
     "a1None[1]"},
    {"StringEscapes", "{{ 'a\\nb\\t\\'c\\' \\x41\\u00e9 \\\\' }}|{{ \"it's\" }}|{{ 'x' 'y' }}",
     "{}",
     "a\nb\t'c' Aé \\|it's|xy"},
    {"Slicing", "{{ [1,2,3,4][1:3] }} {{ [1,2,3,4][::-1] }} {{ [1,2,3,4][-2:] }} {{ 'héllo'[1:4] }} {{ 'abc'[-1] }} {{ [1,2,3][::2] }} {{ 'abcdef'[5:1:-2] }}",
     "{}",
     "[2, 3] [4, 3, 2, 1] [3, 4] éll c [1, 3] fd"},
    {"Attributes", "{{ d.a }}|{{ d['a'] }}|{{ d.missing }}|{{ d.missing is defined }}|{{ d.items is defined }}|{{ d.pop is defined }}|{{ l[0] }}|{{ l[5] is defined }}|{{ l.0 }}",
     "{\"d\": {\"a\": 1}, \"l\": [7]}",
     "1|1||False|True|False|7|False|7"},
    {"IfElif", "{% for x in [1, 2, 3] %}{% if x == 1 %}one{% elif x == 2 %}two{% else %}many{% endif %},{% endfor %}",
     "{}",
     "one,two,many,"},
    {"ForLoopVariables", "{% for x in 'abc' %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.previtem }}{{ loop.nextitem }}{{ loop.cycle('o', 'e') }};{% endfor %}",
     "{}",
     "1032TrueFalse3bo;2121FalseFalse3ace;3210FalseTrue3bo;"},
    {"ForElseAndFilter", "{% for x in [] %}x{% else %}empty{% endfor %}|{% for x in [1, 2, 3, 4] if x is even %}{{ x }}{{ loop.index }}{{ loop.length }}{% endfor %}",
     "{}",
     "empty|212422"},
    {"ForUnpacking", "{% for k, v in {'a': 1, 'b': [2]}.items() %}{{ k }}={{ v }};{% endfor %}{% for k, v in {'c': 3} | items %}{{ k }}{{ v }}{% endfor %}{% for a, b in [[1, 2], (3, 4)] %}{{ a + b }}{% endfor %}",
     "{}",
     "a=1;b=[2];c337"},
    {"BreakContinue", "{% for x in range(10) %}{% if x == 2 %}{% continue %}{% endif %}{% if x > 4 %}{% break %}{% endif %}{{ x }}{% endfor %}",
     "{}",
     "0134"},
    {"SetScoping", "{% set x = 1 %}{% for i in [1, 2] %}{{ x }}{% set x = i * 10 %}{{ x }};{% endfor %}{{ x }}{% if true %}{% set x = 5 %}{% endif %}{{ x }}",
     "{}",
     "110;120;15"},
    {"NamespaceCrossesLoops", "{% set ns = namespace(total=0, seen=[]) %}{% for i in [1, 2, 3] %}{% set ns.total = ns.total + i %}{% set ns.seen = ns.seen + [i] %}{% endfor %}{{ ns.total }} {{ ns.seen }}",
     "{}",
     "6 [1, 2, 3]"},
    {"SetBlockAndTuple", "{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set block %}inner {{ a }}{% endset %}[{{ block }}]",
     "{}",
     "12[inner 1]"},
    {"Macros", "{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('A') }} {{ greet('B', '?') }} {{ greet(punct='.', name='C') }} {{ greet() }}",
     "{}",
     "Hi A! Hi B? Hi C. Hi !"},
    {"MacroRecursionAndGlobals", "{% macro count(n) %}{{ n }}{% if n > 0 %}{{ count(n - 1) }}{% endif %}{{ suffix }}{% endmacro %}{% set suffix = '.' %}{{ count(3) }}",
     "{}",
     "3210...."},
    {"MacroLocalSetDoesNotLeak", "{% macro m() %}{% set v = 'in' %}{{ v }}{% endmacro %}{% set v = 'out' %}{{ m() }}{{ v }}",
     "{}",
     "inout"},
    {"StringFilters", "{{ '  a b  ' | trim }}|{{ 'xxaxx' | trim('x') }}|{{ 'Hello World' | upper }}|{{ 'Hello' | lower }}|{{ 'hELLO wORLD' | capitalize }}|{{ 'hello big-world (x)' | title }}|{{ 'aaa' | replace('a', 'b', 2) }}|{{ 'a<b>&\"' | e }}|{{ 'x' | safe }}|{{ 5 | string }}",
     "{}",
     "a b|a|HELLO WORLD|hello|Hello world|Hello Big-World (X)|bba|a&lt;b&gt;&amp;&#34;|x|5"},
    {"ListFilters", "{{ [3, 1, 2] | sort }}|{{ ['b', 'A', 'a'] | sort }}|{{ [3, 1] | sort(reverse=true) }}|{{ ['B', 'a', 'b', 'A'] | unique | list }}|{{ [1, 2] | reverse | list }}|{{ [1, 2, 3] | first }}|{{ [1, 2, 3] | last }}|{{ [1, 2] | length }}|{{ 'abc' | count }}|{{ 'ab' | list }}|{{ [1, 2, 3] | join('-') }}|{{ [1, 2, 3] | sum }}",
     "{}",
     "[1, 2, 3]|['A', 'a', 'b']|[3, 1]|['B', 'a']|[2, 1]|1|3|2|3|['a', 'b']|1-2-3|6"},
    {"SelectMap", "{{ users | map(attribute='name') | join(',') }}|{{ users | selectattr('admin') | map(attribute='name') | list }}|{{ users | rejectattr('name', 'equalto', 'a') | map(attribute='name') | list }}|{{ [1, 2, 3, 4] | select('odd') | list }}|{{ [0, 1, '', 'x'] | select | list }}|{{ [1, 2, 3] | reject('divisibleby', 3) | list }}|{{ ['a', 'b'] | map('upper') | list }}|{{ users | map(attribute='zzz', default='-') | list }}",
     "{\"users\": [{\"name\": \"a\", \"admin\": true}, {\"name\": \"b\", \"admin\": false}]}",
     "a,b|['a']|['b']|[1, 3]|[1, 'x']|[1, 2]|['A', 'B']|['-', '-']"},
    {"NumberFilters", "{{ -3 | abs }} {{ 2.5 | round }} {{ 3.5 | round }} {{ 2.675 | round(2) }} {{ 3 | round }} {{ 2.1 | round(0, 'ceil') }} {{ '42' | int }} {{ 'x' | int }} {{ '4.7' | int }} {{ 4.7 | int }} {{ '1.5' | float }} {{ 'x' | float(1) }}",
     "{}",
     "3 2.0 4.0 2.67 3 3.0 42 0 4 4 1.5 1"},
    {"DefaultFilter", "{{ missing | default('d') }}|{{ '' | default('d') }}|{{ '' | default('d', true) }}|{{ none | d('n') }}",
     "{}",
     "d||d|None"},
    {"ToJson", "{{ v | tojson }}|{{ v | tojson(indent=2) }}|{{ {'b': 1, 'a': 2} | tojson(sort_keys=true) }}|{{ 'é\\u2028\"<' | tojson }}|{{ [1.0, 1e21, none, true] | tojson(separators=(',', ':')) }}",
     "{\"v\": {\"z\": [1, {\"y\": null}], \"e\": {}, \"l\": []}}",
     "{\"z\": [1, {\"y\": null}], \"e\": {}, \"l\": []}|{\n  \"z\": [\n    1,\n    {\n      \"y\": null\n    }\n  ],\n  \"e\": {},\n  \"l\": []\n}|{\"a\": 2, \"b\": 1}|\"é \\\"<\"|[1.0,1e+21,null,true]"},
    {"Indent", "{{ 'a\\nb\\n\\nc' | indent(2) }}|{{ 'a\\nb' | indent(2, true) }}|{{ 'a\\n\\nb' | indent('>', blank=true) }}",
     "{}",
     "a\n  b\n\n  c|  a\n  b|a\n>\n>b"},
    {"Tests", "{{ 1 is number }}{{ 1 is integer }}{{ 1.0 is float }}{{ true is boolean }}{{ 'a' is string }}{{ {} is mapping }}{{ [] is iterable }}{{ 'a' is sequence }}{{ none is none }}{{ false is false }}{{ true is true }}{{ 3 is odd }}{{ 4 is even }}{{ 9 is divisibleby 3 }}{{ 'a' is in 'abc' }}{{ 1 is eq 1 }}{{ 1 is ne 2 }}{{ missing is undefined }}{{ range is callable }}{{ 2 is gt 1 }}{{ 'ab' is lower }}{{ x is defined }}{{ true is number }}{{ true is integer }}",
     "{}",
     "TrueTrueTrueTrueTrueTrueTrueTrueTrueTrueTrueTrueTrueTrueTrueTrueTrueTrueTrueTrueTrueFalseTrueFalse"},
    {"StringMethods", "{{ '  x  '.strip() }}|{{ 'xxay'.lstrip('x') }}|{{ 'ayy'.rstrip('y') }}|{{ 'a,b,,c'.split(',') }}|{{ ' a  b '.split() }}|{{ 'a-b-c'.split('-', 1) }}|{{ 'a-b-c'.rsplit('-', 1) }}|{{ 'abc'.startswith('ab') }}|{{ 'abc'.endswith(('x', 'c')) }}|{{ 'they\\'re bill'.title() }}|{{ 'abcabc'.find('c') }}|{{ 'abcabc'.rfind('c') }}|{{ 'aaa'.count('a') }}|{{ '-'.join(['a', 'b']) }}|{{ 'ab'.replace('b', 'c') }}|{{ 'ABC'.lower() }}|{{ 'abc'.upper() }}|{{ 'a\\nb'.splitlines() }}|{{ 'héllo'.find('l') }}",
     "{}",
     "x|ay|a|['a', 'b', '', 'c']|['a', 'b']|['a', 'b-c']|['a-b', 'c']|True|True|They'Re Bill|2|5|3|a-b|ac|abc|ABC|['a', 'b']|2"},
    {"DictMethods", "{{ d.keys() | list }}|{{ d.values() | list }}|{{ d.items() | list }}|{{ d.get('a') }}|{{ d.get('zz') }}|{{ d.get('zz', 0) }}|{{ dict(x=1, y=2) }}|{{ dict(d, c=3) }}",
     "{\"d\": {\"a\": 1, \"b\": 2}}",
     "['a', 'b']|[1, 2]|[('a', 1), ('b', 2)]|1|None|0|{'x': 1, 'y': 2}|{'a': 1, 'b': 2, 'c': 3}"},
    {"Globals", "{{ range(3) | list }}|{{ range(1, 7, 2) | list }}|{{ range(3, 0, -1) | list }}|{{ namespace(a=1).a }}",
     "{}",
     "[0, 1, 2]|[1, 3, 5]|[3, 2, 1]|1"},
    {"Undefined", "[{{ missing }}]{{ missing | length }}{{ missing is defined }}{% for x in missing %}x{% endfor %}{{ missing | default('d') }}{% if not missing %}F{% endif %}",
     "{}",
     "[]0FalsedF"},
    {"WhitespaceTrimBlocks", "<ul>\n  {% for x in [1, 2] %}\n  <li>{{ x }}</li>\n  {% endfor %}\n</ul>\n",
     "{}",
     "<ul>\n  <li>1</li>\n  <li>2</li>\n</ul>"},
    {"WhitespaceMinus", "a  {%- if true -%}  b  {%- endif -%}  c\n  {{- ' d ' -}}  e {# c #} f  {#- c -#}  g",
     "{}",
     "abc d e  fg"},
    {"WhitespacePlus", "  {%+ if true %}x{% endif +%}\n  {% if true %}y{% endif %}\nz",
     "{}",
     "  x\nyz"},
    {"WhitespaceVariablesNotLstripped", "  {{ 'v' }}\n  {% if true %}\nw\n  {% endif %}\n",
     "{}",
     "  v\nw\n"},
    {"CommentsTrim", "a\n{# comment #}\nb\n  {# indented #}\nc",
     "{}",
     "a\nb\nc"},
    {"TrailingNewlineDropped", "x\n",
     "{}",
     "x"},
    {"GeneratorsAndViews", "{% set g = [1, 2, 3] | select %}{{ g | first }}{{ g | list }}{{ g | list }}|{% if [] | select %}T{% endif %}|{{ d.items() }}|{{ d.keys() }}|{{ d.values() }}|{{ range(2, 5) }}|{{ range(0, 9, 3) }}|{{ range(3)[1] }}|{{ d.keys()[0] is defined }}|{{ d.keys() | length }}|{{ 'a' in d.keys() }}|{% for x in [1, 2] | reverse %}{{ x }}{% endfor %}|{{ 2 in ([1, 2, 3] | select) }}|{{ d.items() | list }}|{{ [3, 1] | map('string') | sort }}",
     "{\"d\": {\"a\": 1, \"b\": \"x\"}}",
     "1[2, 3][]|T|dict_items([('a', 1), ('b', 'x')])|dict_keys(['a', 'b'])|dict_values([1, 'x'])|range(2, 5)|range(0, 9, 3)|1|False|2|True|21|True|[('a', 1), ('b', 'x')]|['1', '3']"},
    {"CaselessScriptsKeepTheirText", "{{ '日本語 🌍 ١٢٣' | upper }}|{{ '한국어 × ÷' | title }}",
     "{}",
     "日本語 🌍 ١٢٣|한국어 × ÷"},
    {"ChainedComparisons", "{{ 1 < x < 3 }}{{ 1 < y < 3 }}{{ 'a' == 'b' != c.d }}{{ 1 < 2 > 1 }}{{ 2 in [2] in [[2]] }}{{ 1 == 1 == 1.0 }}{{ 3 > 2 > 1 > 0 }}",
     "{\"x\": 2, \"y\": 5}",
     "TrueFalseFalseTrueTrueTrueTrue"},
    {"MarkupFromSafeAndEscape", "{{ ('<b>' | safe) + '<i>' }}|{{ '<' + ('&' | e) }}|{{ 1 | safe is string }}|{{ ('x' | safe) ~ '<' }}|{{ ('<' | e) | e }}|{{ 3.0 is odd }}{{ 2.5 is even }}{{ 7.5 is divisibleby 2.5 }}",
     "{}",
     "<b>&lt;i&gt;|&lt;&amp;|True|x<|&lt;|TrueFalseTrue"},
    {"ForElseAfterBreakOrContinue", "{% for x in [1, 2] %}{% break %}{% else %}E1{% endfor %}|{% for x in [1, 2] %}{% continue %}{% else %}E2{% endfor %}|{% for x in [1, 2] %}{% if x == 2 %}{% break %}{% endif %}{% else %}E3{% endfor %}|{% for x in [1, 2] %}{% if x == 1 %}{% continue %}{% endif %}{% else %}E4{% endfor %}",
     "{}",
     "E1|E2||"},
    {"CallableUndefinedAndLoop", "{{ missing is callable }}{{ missing | first is callable }}{% for x in [1] %}{{ loop is callable }}{% endfor %}{{ 1 is callable }}",
     "{}",
     "TrueTrueTrueFalse"},
    {"TernaryAndFiltersPrecedence", "{{ -2 | abs }} {{ 'a' ~ 'b' | upper }} {{ not true and false }} {{ 1 + 2 if true else 0 }} {{ [1, 2] | length * 2 }}",
     "{}",
     "2 aB False 3 4"},
};

class LanguageTest : public testing::TestWithParam<LanguageCase> {};

TEST_P(LanguageTest, RendersLikePythonJinja2) {
  const LanguageCase& c = GetParam();
  auto out = RenderWith(c.source, OJson::parse(c.vars));
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, c.python_output);
}

INSTANTIATE_TEST_SUITE_P(Constructs, LanguageTest, testing::ValuesIn(kLanguageCases),
                         [](const testing::TestParamInfo<LanguageCase>& info) {
                           return std::string(info.param.name);
                         });

struct ErrorCase {
  const char* name;
  const char* source;
  const char* vars;
  const char* python_type;
  const char* python_message;
  bool at_parse;  // Refused when parsing (Python fails only when rendering).
};

const ErrorCase kErrorCases[] = {
    {"RaiseException", "{% if true %}{{ raise_exception('Bad role: ' ~ 'x') }}{% endif %}", "{}", "TemplateError", "Bad role: x", false},
    {"AddStrNone", "{{ 'a' + none }}", "{}", "TypeError", "can only concatenate str (not \"NoneType\") to str", false},
    {"UndefinedAttribute", "{{ missing.attr }}", "{}", "UndefinedError", "'missing' is undefined", false},
    {"UndefinedArithmetic", "{{ missing + 1 }}", "{}", "UndefinedError", "'missing' is undefined", false},
    {"IterateNone", "{% for x in none %}{% endfor %}", "{}", "TypeError", "'NoneType' object is not iterable", false},
    {"MutationIsUnsafe", "{{ [1].append(2) }}", "{}", "SecurityError", "access to attribute 'append' of 'list' object is unsafe.", true},
    {"DivisionByZero", "{{ 1 // 0 }}", "{}", "ZeroDivisionError", "integer division or modulo by zero", false},
    {"CompareMixed", "{{ 1 < 'a' }}", "{}", "TypeError", "'<' not supported between instances of 'int' and 'str'", false},
    {"TojsonUndefined", "{{ missing | tojson }}", "{}", "TypeError", "Object of type Undefined is not JSON serializable", false},
    {"InStringNeedsString", "{{ 1 in 'abc' }}", "{}", "TypeError", "'in <string>' requires string as left operand, not int", false},
    {"RangeTooBig", "{{ range(200000) | length }}", "{}", "OverflowError", "Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).", false},
    {"GeneratorHasNoLength", "{{ [1] | select | length }}", "{}", "TypeError", "object of type 'generator' has no len()", false},
    {"GeneratorIsNotJson", "{{ [1] | map('string') | tojson }}", "{}", "TypeError", "Object of type generator is not JSON serializable", false},
    {"ViewIsNotJson", "{{ {'a': 1}.items() | tojson }}", "{}", "TypeError", "Object of type dict_items is not JSON serializable", false},
    {"UnhashableKey", "{{ [1] in {} }}", "{}", "TypeError", "unhashable type: 'list'", false},
    {"SliceNone", "{{ x[1:] }}", "{\"x\": null}", "TypeError", "'NoneType' object is not subscriptable", false},
    {"SliceDict", "{{ x[1:] }}", "{\"x\": {\"a\": 1}}", "TypeError", "unhashable type: 'slice'", false},
    {"IndentNonString", "{{ 2 | indent(2) }}", "{}", "TypeError", "unsupported operand type(s) for +=: 'int' and 'str'", false},
    {"UndefinedToInt", "{{ missing | int }}", "{}", "UndefinedError", "'missing' is undefined", false},
    {"UndefinedToFloat", "{{ missing | float }}", "{}", "UndefinedError", "'missing' is undefined", false},
    {"NamespaceUnderscore", "{% set ns = namespace() %}{% set ns._x = 1 %}", "{}", "SecurityError", "Chat templates cannot store underscore-prefixed attributes on a namespace, but got '_x'. Please rename the attribute.", false},
};

class RuntimeErrorTest : public testing::TestWithParam<ErrorCase> {};

TEST_P(RuntimeErrorTest, FailsWherePythonRaises) {
  const ErrorCase& c = GetParam();
  auto tmpl = ChatTemplate::Parse(c.source, {});
  if (c.at_parse) {
    EXPECT_FALSE(tmpl.ok());
    return;
  }
  ASSERT_TRUE(tmpl.ok()) << tmpl.status();
  ChatTemplate::RenderRequest request;
  request.messages = OJson::parse(R"([{"role": "user", "content": "hi"}])");
  request.kwargs = OJson::parse(c.vars);
  auto out = (*tmpl)->Render(request);
  ASSERT_FALSE(out.ok()) << "rendered: " << *out;
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  if (std::string(c.python_type) == "TemplateError") {
    EXPECT_EQ(out.status().message(), c.python_message);  // raise_exception: verbatim.
  } else {
    EXPECT_THAT(std::string(out.status().message()), HasSubstr(c.python_message));
  }
}

INSTANTIATE_TEST_SUITE_P(Errors, RuntimeErrorTest, testing::ValuesIn(kErrorCases),
                         [](const testing::TestParamInfo<ErrorCase>& info) {
                           return std::string(info.param.name);
                         });

// Parse-time refusals: each names the construct and its line.
struct ParseErrorCase {
  const char* source;
  const char* want;
};

TEST(ParseErrorTest, UnsupportedConstructsFailAtParseWithTheirLine) {
  const ParseErrorCase cases[] = {
      {"a\nb\n{{ x | wordwrap(3) }}", "line 3: unknown filter 'wordwrap'"},
      {"{% if x is prime %}{% endif %}", "line 1: unknown test 'prime'"},
      {"\n{{ '{}'.format(1) }}", "line 2: unsupported method 'format'"},
      {"{{ lipsum(2) }}", "line 1: unknown function 'lipsum'"},
      {"\n\n{% call m() %}x{% endcall %}", "line 3: unsupported statement 'call'"},
      {"{% include 'other.jinja' %}", "unsupported statement 'include'"},
      {"{% extends 'base' %}", "unsupported statement 'extends'"},
      {"{% raw %}{{ x }}{% endraw %}", "unsupported statement 'raw'"},
      {"{% filter upper %}x{% endfilter %}", "unsupported statement 'filter'"},
      {"{% for x in y recursive %}{% endfor %}", "'for ... recursive'"},
      {"{{ '%s' % x }}", "printf-style"},
      {"{{ f(*args) }}", "*args"},
      {"{% frobnicate %}", "unknown statement 'frobnicate'"},
      {"{% if x %}\n{% endfor %}", "line 2: unknown statement 'endfor'"},
      {"{% if x %}", "unexpected end of template, expected"},
      {"{{ 'abc }}", "unterminated string literal"},
      {"{{ x ", "expected '}}'"},
      {"{# open comment", "missing end of comment tag"},
      {"{{ (1 }}", "expected"},
      {"{% break %}", "'break' outside a for loop"},
      {"{{ x ) }}", "unexpected ')'"},
  };
  for (const auto& c : cases) {
    auto tmpl = ChatTemplate::Parse(c.source, {});
    ASSERT_FALSE(tmpl.ok()) << c.source;
    EXPECT_EQ(tmpl.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(std::string(tmpl.status().message()), HasSubstr(c.want)) << c.source;
  }
}

TEST(ParseErrorTest, DeepNestingIsRefusedNotOverflowed) {
  const std::string deep = "{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}";
  auto tmpl = ChatTemplate::Parse(deep, {});
  ASSERT_FALSE(tmpl.ok());
  EXPECT_THAT(std::string(tmpl.status().message()), HasSubstr("nested too deeply"));
  std::string blocks;
  for (int i = 0; i < 1000; ++i) blocks += "{% if true %}";
  EXPECT_FALSE(ChatTemplate::Parse(blocks, {}).ok());
  // Long operator chains build deep trees too.
  for (const char* op : {" + ", " ~ ", " and ", " or ", " * ", " ** ", " if 1 else "}) {
    std::string chain = "{{ 1";
    for (int i = 0; i < 20000; ++i) chain += std::string(op) + "1";
    auto deep_chain = ChatTemplate::Parse(chain + " }}", {});
    ASSERT_FALSE(deep_chain.ok()) << op;
    EXPECT_THAT(std::string(deep_chain.status().message()), HasSubstr("nested too deeply")) << op;
  }
  std::string attrs = "{{ x";
  for (int i = 0; i < 20000; ++i) attrs += ".a | trim";
  EXPECT_FALSE(ChatTemplate::Parse(attrs + " }}", {}).ok());
  // A chain within the bound renders.
  std::string sum = "{{ 0";
  for (int i = 0; i < 100; ++i) sum += " + 1";
  auto out = RenderWith(sum + " }}", OJson::object());
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, "100");
}

TEST(RuntimeErrorLineTest, TypeErrorsNameTheLine) {
  auto out = RenderWith("line one\n{% set x = 1 %}\n{{ 'a' + none }}", OJson::object());
  ASSERT_FALSE(out.ok());
  EXPECT_THAT(std::string(out.status().message()), HasSubstr("chat template line 3: can only concatenate"));
}

TEST(LimitsTest, OutputLargerThanTheLimitFails) {
  ChatTemplateLimits limits;
  limits.max_output_bytes = 1 << 20;
  auto out = RenderWith("{% for i in range(2000) %}{{ 'x' * 1000 }}{% endfor %}", OJson::object(), limits);
  ASSERT_FALSE(out.ok());
  EXPECT_THAT(std::string(out.status().message()), HasSubstr("output larger than 1048576 bytes"));
  auto big = RenderWith("{{ 'x' * 100000000 }}", OJson::object(), limits);
  ASSERT_FALSE(big.ok());
  // Under the limit, the same template renders.
  auto small = RenderWith("{% for i in range(100) %}{{ 'x' * 1000 }}{% endfor %}", OJson::object(), limits);
  ASSERT_TRUE(small.ok()) << small.status();
  EXPECT_EQ(small->size(), 100000u);
}

TEST(LimitsTest, UnboundedMacroRecursionFails) {
  auto out = RenderWith("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", OJson::object());
  ASSERT_FALSE(out.ok());
  EXPECT_THAT(std::string(out.status().message()), HasSubstr("macro calls nested deeper than 64"));
}

TEST(LimitsTest, PrintingAValueNestedTooDeepFails) {
  // chat_template_fuzzer found a template whose value recursed in PyRepr
  // until the stack overflowed; printing now stops at 200 levels.
  jinja::Value deep = jinja::Value::List({});
  for (int i = 0; i < 1000; ++i) deep = jinja::Value::List({deep});
  auto out = jinja::PyRepr(deep);
  ASSERT_FALSE(out.ok());
  EXPECT_THAT(std::string(out.status().message()), HasSubstr("nested more than 200 deep"));
  jinja::Value shallow = jinja::Value::List({});
  for (int i = 0; i < 3; ++i) shallow = jinja::Value::List({shallow});
  auto fine = jinja::PyStr(shallow);
  ASSERT_TRUE(fine.ok()) << fine.status();
  EXPECT_EQ(*fine, "[[[[]]]]");
}

TEST(LimitsTest, NestedLoopsOverLargeRangesStop) {
  ChatTemplateLimits limits;
  limits.max_steps = 100000;
  auto out = RenderWith(
      "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
      OJson::object(), limits);
  ASSERT_FALSE(out.ok());
  EXPECT_THAT(std::string(out.status().message()), HasSubstr("more than 100000 steps"));
}

TEST(LimitsTest, SelfReferentialNamespaceDoesNotLeak) {
  // Runs under LeakSanitizer in the sanitizer build.
  auto out = RenderWith("{% set ns = namespace(x=1) %}{% set ns.me = ns %}{{ ns.me.x }}", OJson::object());
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, "1");
}

TEST(RenderTest, ConcurrentRendersAgree) {
  auto tmpl = ChatTemplate::Parse(
      "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
      "<{{ m.role }}>{{ m.content }}{% endfor %}{{ ns.n }}{{ bos_token }}",
      {.bos_token = "<s>"});
  ASSERT_TRUE(tmpl.ok()) << tmpl.status();
  std::vector<std::string> results(8);
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 200; ++i) {
        ChatTemplate::RenderRequest request;
        request.messages = OJson::array({{{"role", "user"}, {"content", absl::StrCat("q", t)}},
                                         {{"role", "assistant"}, {"content", "a"}}});
        auto out = (*tmpl)->Render(request);
        results[t] = out.ok() ? *out : out.status().ToString();
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < 8; ++t) EXPECT_EQ(results[t], absl::StrCat("<user>q", t, "<assistant>a2<s>"));
}

TEST(RenderTest, MessagesAreNormalizedLikeApplyChatTemplate) {
  auto tmpl = ChatTemplate::Parse(
      "{% for m in messages %}{{ m | tojson }}|{{ m.name is defined }}\n{% endfor %}", {});
  ASSERT_TRUE(tmpl.ok());
  ChatTemplate::RenderRequest request;
  request.messages = OJson::parse(R"([
    {"role": "user", "content": "x", "name": null},
    {"role": "assistant", "content": "y", "reasoning": "r1"},
    {"role": "assistant", "thinking": "t", "content": "z", "reasoning_content": "rc"}])");
  auto out = (*tmpl)->Render(request);
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out,
            "{\"role\": \"user\", \"content\": \"x\"}|False\n"
            "{\"thinking\": \"r1\", \"role\": \"assistant\", \"content\": \"y\", \"reasoning\": \"r1\", "
            "\"reasoning_content\": \"r1\"}|False\n"
            "{\"thinking\": \"t\", \"role\": \"assistant\", \"content\": \"z\", \"reasoning_content\": \"rc\"}|False\n");
}

TEST(RenderTest, TojsonKeepsTheCallersKeyOrder) {
  auto out = RenderWith("{{ v | tojson }}", OJson::parse(R"({"v": {"zeta": 1, "alpha": {"b": 2, "a": 3}}})"));
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(*out, R"({"zeta": 1, "alpha": {"b": 2, "a": 3}})");
}

TEST(RenderTest, KwargsOverrideTokensButNotRenderArguments) {
  auto tmpl = ChatTemplate::Parse("{{ bos_token }}|{{ eos_token }}|{{ unk_token is defined }}",
                                  {.bos_token = "<s>", .eos_token = "</s>"});
  ASSERT_TRUE(tmpl.ok());
  ChatTemplate::RenderRequest request;
  request.messages = OJson::parse(R"([{"role": "user", "content": "x"}])");
  request.kwargs = {{"eos_token", "<end>"}};
  auto out = (*tmpl)->Render(request);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(*out, "<s>|<end>|False");
  request.kwargs = {{"messages", OJson::array()}};
  EXPECT_FALSE((*tmpl)->Render(request).ok());
}

TEST(RenderTest, RejectsMalformedRequests) {
  auto tmpl = ChatTemplate::Parse("x", {});
  ASSERT_TRUE(tmpl.ok());
  ChatTemplate::RenderRequest request;
  request.messages = OJson::array();
  auto empty = (*tmpl)->Render(request);
  ASSERT_FALSE(empty.ok());
  EXPECT_THAT(std::string(empty.status().message()), HasSubstr("empty conversation"));
  request.messages = OJson::parse(R"(["not an object"])");
  EXPECT_FALSE((*tmpl)->Render(request).ok());
  request.messages = OJson::parse(R"([{"role": "user", "content": "x"}])");
  request.tools = OJson::parse(R"({"type": "function"})");
  EXPECT_FALSE((*tmpl)->Render(request).ok());
}

TEST(RenderTest, StrftimeNowReadsTheInjectedClockInLocalTime) {
  auto tmpl = ChatTemplate::Parse("{{ strftime_now('%Y-%m-%d %H:%M:%S|%d %b %Y') }}", {});
  ASSERT_TRUE(tmpl.ok());
  ChatTemplate::RenderRequest request;
  request.messages = OJson::parse(R"([{"role": "user", "content": "x"}])");
  request.now = absl::FromCivil(absl::CivilSecond(2024, 7, 26, 9, 30, 0), absl::LocalTimeZone());
  auto out = (*tmpl)->Render(request);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(*out, "2024-07-26 09:30:00|26 Jul 2024");
  request.now.reset();  // The real clock: today's date.
  auto today = (*tmpl)->Render(request);
  ASSERT_TRUE(today.ok());
  EXPECT_EQ(today->substr(0, 10), absl::FormatTime("%Y-%m-%d", absl::Now(), absl::LocalTimeZone()));
}

TEST(RenderTest, BadFilterAndTestArgumentsFailLikePython) {
  const char* cases[][2] = {
      {"{{ 1 | tojson(mndent=2) }}", "tojson() got an unexpected keyword argument 'mndent'"},
      {"{{ 'a' | trim('x', 'y') }}", "trim() takes at most 1 argument(s) (2 given)"},
      {"{{ 'a' | replace('a', 'b', old='c') }}", "got multiple values for argument 'old'"},
      {"{{ none is none(1) }}", "test 'none' takes 0 argument(s) (1 given)"},
      {"{{ [1] | map('round', 1, 2, 3) | list }}", "round() takes at most 2 argument(s)"},
  };
  for (const auto& c : cases) {
    auto out = RenderWith(c[0], OJson::object());
    ASSERT_FALSE(out.ok()) << c[0] << " rendered " << *out;
    EXPECT_THAT(std::string(out.status().message()), HasSubstr(c[1])) << c[0];
  }
}

TEST(ParseErrorTest, CommentOpenerAtTheEndIsIgnoredLikeJinja2) {
  auto out = RenderWith("text{#", OJson::object());
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, "text");
}

TEST(ParseErrorTest, InvalidUtf8IsRefused) {
  auto tmpl = ChatTemplate::Parse("abc\xff\xfe", {});
  ASSERT_FALSE(tmpl.ok());
  EXPECT_THAT(std::string(tmpl.status().message()), HasSubstr("not valid UTF-8"));
}

TEST(RenderTest, StringOperationsOnMarkupAreRefused) {
  // Python keeps a Markup through upper()/trim and escapes what is added to
  // it later; only `+`, `~`, output and comparisons are modelled.
  for (const char* source : {"{{ ('a' | safe) | upper }}", "{{ ('a' | e).strip() }}"}) {
    auto out = RenderWith(source, OJson::object());
    ASSERT_FALSE(out.ok()) << source << " rendered " << *out;
    EXPECT_THAT(std::string(out.status().message()), HasSubstr("Markup")) << source;
  }
}

TEST(RenderTest, PrintingAnIteratorFails) {
  // Python prints "<generator object ... at 0x...>", an address: refused.
  auto out = RenderWith("{{ [1, 2] | select }}", OJson::object());
  ASSERT_FALSE(out.ok());
  EXPECT_THAT(std::string(out.status().message()), HasSubstr("cannot convert a generator"));
}

TEST(RenderTest, CaseMappingOfNonAsciiLettersIsRefused) {
  // Python would print "CAFÉ"; this renderer maps ASCII only, so it fails
  // instead of printing "CAFé".
  for (const char* source : {"{{ 'café' | upper }}", "{{ 'Ωmega'.lower() }}", "{{ ['É', 'a'] | sort }}"}) {
    auto out = RenderWith(source, OJson::object());
    ASSERT_FALSE(out.ok()) << source << " rendered " << *out;
    EXPECT_THAT(std::string(out.status().message()), HasSubstr("non-ASCII letters")) << source;
  }
}

TEST(RenderTest, GenerationBlockRendersItsBody) {
  // transformers' AssistantTracker tag, used by templates for training masks.
  auto out = RenderWith("a{% generation %}b{{ 1 }}{% endgeneration %}c", OJson::object());
  ASSERT_TRUE(out.ok()) << out.status();
  EXPECT_EQ(*out, "ab1c");
}

class LoadChatTemplateTest : public testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::path(testing::TempDir()) /
           ("chat_template_load_" + std::string(testing::UnitTest::GetInstance()->current_test_info()->name()));
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void Write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name, std::ios::binary) << text;
  }
  std::filesystem::path dir_;
};

TEST_F(LoadChatTemplateTest, StringTemplateAndTokensFromTokenizerConfig) {
  Write("tokenizer_config.json",
        R"({"bos_token": {"content": "<s>", "lstrip": false}, "eos_token": "</s>", "pad_token": null,
            "chat_template": "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"})");
  auto loaded = LoadChatTemplate(dir_.string());
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_TRUE(loaded->has_value());
  EXPECT_EQ((*loaded)->tokens.bos_token, "<s>");
  EXPECT_EQ((*loaded)->tokens.eos_token, "</s>");
  EXPECT_FALSE((*loaded)->tokens.pad_token.has_value());
  auto tmpl = ChatTemplate::Parse((*loaded)->source, (*loaded)->tokens);
  ASSERT_TRUE(tmpl.ok());
  ChatTemplate::RenderRequest request;
  request.messages = OJson::parse(R"([{"role": "user", "content": "hey"}])");
  auto out = (*tmpl)->Render(request);
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(*out, "<s>hey</s>");
}

TEST_F(LoadChatTemplateTest, NamedTemplateListTakesDefault) {
  Write("tokenizer_config.json",
        R"({"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]})");
  auto loaded = LoadChatTemplate(dir_.string());
  ASSERT_TRUE(loaded.ok() && loaded->has_value());
  EXPECT_EQ((*loaded)->source, "D");
}

TEST_F(LoadChatTemplateTest, ChatTemplateJinjaFileWins) {
  Write("tokenizer_config.json", R"({"eos_token": "E", "chat_template": "from config"})");
  Write("chat_template.jinja", "from file\n");
  auto loaded = LoadChatTemplate(dir_.string());
  ASSERT_TRUE(loaded.ok() && loaded->has_value());
  EXPECT_EQ((*loaded)->source, "from file\n");
  EXPECT_EQ((*loaded)->tokens.eos_token, "E");
  EXPECT_THAT((*loaded)->origin, HasSubstr("chat_template.jinja"));
}

TEST_F(LoadChatTemplateTest, NoTemplateIsNullopt) {
  Write("tokenizer_config.json", R"({"eos_token": "E"})");
  auto loaded = LoadChatTemplate(dir_.string());
  ASSERT_TRUE(loaded.ok());
  EXPECT_FALSE(loaded->has_value());
}

TEST_F(LoadChatTemplateTest, MalformedFilesAreErrors) {
  Write("tokenizer_config.json", "{not json");
  EXPECT_EQ(LoadChatTemplate(dir_.string()).status().code(), absl::StatusCode::kInvalidArgument);
  Write("tokenizer_config.json", R"({"chat_template": [{"name": "tool_use", "template": "T"}]})");
  auto no_default = LoadChatTemplate(dir_.string());
  ASSERT_FALSE(no_default.ok());
  EXPECT_THAT(std::string(no_default.status().message()), HasSubstr("no \"default\""));
  Write("tokenizer_config.json", R"({"chat_template": 42})");
  EXPECT_FALSE(LoadChatTemplate(dir_.string()).ok());
  Write("tokenizer_config.json", R"({"bos_token": 7})");
  EXPECT_FALSE(LoadChatTemplate(dir_.string()).ok());
  EXPECT_EQ(LoadChatTemplate((dir_ / "missing").string()).status().code(), absl::StatusCode::kNotFound);
}

}  // namespace
}  // namespace pdserve
