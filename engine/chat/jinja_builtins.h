// Names of the filters, tests, methods and global functions the chat
// template interpreter implements (internal to engine/chat/). The parser
// rejects any other name, so the two cannot drift apart: both read these.
#ifndef PDSERVE_ENGINE_CHAT_JINJA_BUILTINS_H_
#define PDSERVE_ENGINE_CHAT_JINJA_BUILTINS_H_

#include <string_view>

namespace pdserve::jinja {

bool IsKnownFilter(std::string_view name);
bool IsKnownTest(std::string_view name);
// Methods of str, dict, list and loop that `x.name(...)` may call.
bool IsKnownMethod(std::string_view name);
// range, namespace, dict, raise_exception, strftime_now.
bool IsGlobalFunction(std::string_view name);

}  // namespace pdserve::jinja

#endif  // PDSERVE_ENGINE_CHAT_JINJA_BUILTINS_H_
