// Runs a parsed chat template (internal to engine/chat/).
//
// The semantics are those of Python jinja2 3.1 in transformers'
// ImmutableSandboxedEnvironment: default Undefined (prints empty, is false,
// fails on arithmetic, attribute access and calls), scoping of `set`
// (per loop iteration, per macro call), loop controls, the filters, tests
// and methods listed in jinja_builtins.h, and transformers' globals
// (raise_exception, strftime_now, namespace, dict) plus range.
//
// Thread-safety: RenderProgram only reads `program`; any number of renders
// of one Program may run at once.
#ifndef PDSERVE_ENGINE_CHAT_JINJA_INTERPRETER_H_
#define PDSERVE_ENGINE_CHAT_JINJA_INTERPRETER_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/chat/jinja_parser.h"
#include "engine/chat/jinja_value.h"

namespace pdserve::jinja {

struct RenderLimits {
  // Largest output (and largest string or list built on the way), in bytes.
  size_t max_output_bytes = size_t{16} << 20;
  // Deepest nesting of macro calls.
  int max_call_depth = 64;
  // Most statements, loop iterations and filter/method calls one render may
  // run, so that nested loops over large ranges end.
  int64_t max_steps = 20'000'000;
};

struct RenderInputs {
  // Template variables, in the order given (later ones win).
  std::vector<std::pair<std::string, Value>> variables;
  // strftime_now(format): the formatted current local time.
  std::function<std::string(std::string_view format)> strftime_now;
};

// Errors: InvalidArgumentError. raise_exception(msg) gives exactly `msg`;
// other errors read "chat template line N: <what>".
absl::StatusOr<std::string> RenderProgram(const Program& program, const RenderInputs& inputs,
                                          const RenderLimits& limits);

}  // namespace pdserve::jinja

#endif  // PDSERVE_ENGINE_CHAT_JINJA_INTERPRETER_H_
