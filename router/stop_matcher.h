// StopStringMatcher: finds the first stop string in streamed text.
//
// Text arrives in pieces (one detokenized delta at a time). The matcher
// passes on what can no longer be part of a stop string and holds back the
// longest tail that is still the beginning of one, so a stop string split
// across pieces is found and none of it is ever sent. On a match the text
// before the stop string is released and everything from it on is dropped.
//
// Byte-wise: the input must be valid UTF-8 pieces (as the incremental
// detokenizer gives) and stop strings valid, non-empty UTF-8; then every
// released piece ends on a character boundary, because a match or a held
// tail starts where a stop string starts.
//
// Thread-safety: none; one per stream.
#ifndef PDSERVE_ROUTER_STOP_MATCHER_H_
#define PDSERVE_ROUTER_STOP_MATCHER_H_

#include <string>
#include <string_view>
#include <vector>

namespace pdserve {

class StopStringMatcher {
 public:
  // `stops` are non-empty; an empty list makes a pass-through matcher.
  explicit StopStringMatcher(std::vector<std::string> stops);

  // Appends `text`; returns the text that is now safe to send. After it
  // returns with stopped() true, further calls return nothing.
  std::string Append(std::string_view text);

  // True once a stop string was seen.
  bool stopped() const { return stopped_; }

  // The end of the stream: releases the held-back tail (it did not become a
  // stop string). Empty after a match.
  std::string Flush();

 private:
  const std::vector<std::string> stops_;
  std::string held_;  // Tail that may still grow into a stop string.
  bool stopped_ = false;
};

}  // namespace pdserve

#endif  // PDSERVE_ROUTER_STOP_MATCHER_H_
