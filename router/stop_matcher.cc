#include "router/stop_matcher.h"

#include <algorithm>

namespace pdserve {

StopStringMatcher::StopStringMatcher(std::vector<std::string> stops)
    : stops_(std::move(stops)) {}

std::string StopStringMatcher::Append(std::string_view text) {
  if (stopped_) return {};
  if (stops_.empty()) return std::string(text);
  held_.append(text);

  // The earliest match of any stop string wins.
  size_t match = std::string::npos;
  for (const std::string& stop : stops_) {
    const size_t at = held_.find(stop);
    if (at < match) match = at;
  }
  if (match != std::string::npos) {
    stopped_ = true;
    std::string out = held_.substr(0, match);
    held_.clear();
    return out;
  }

  // Hold back the longest tail that is a proper prefix of a stop string
  // (a whole one would have matched above).
  size_t keep = 0;
  for (const std::string& stop : stops_) {
    const size_t longest = std::min(stop.size() - 1, held_.size());
    for (size_t n = longest; n > keep; --n) {
      if (std::string_view(held_).substr(held_.size() - n) ==
          std::string_view(stop).substr(0, n)) {
        keep = n;
        break;
      }
    }
  }
  std::string out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

std::string StopStringMatcher::Flush() {
  std::string out;
  out.swap(held_);
  return out;
}

}  // namespace pdserve
