// OpenAiStreamReader: turns the body of a streamed OpenAI-compatible
// completion (Server-Sent Events: `data: {chunk}` events, then
// `data: [DONE]`) into a RequestRecord's token arrival times and outcome,
// whatever the transport that delivered its bytes. The openai target of
// the load generator (loadgen.h) feeds it each read as it arrives.
//
// Tokens per chunk, the one rule for every server:
//   1. A chunk with choices and usage.completion_tokens (the server counts
//      every chunk: vLLM's and SGLang's stream_options.
//      continuous_usage_stats) brings completion_tokens minus the tokens
//      counted so far.
//   2. Else a chunk whose choice has non-empty `text` (chat:
//      `delta.content`) brings one token. vLLM and SGLang stream a chunk per
//      token (unless their stream interval is above 1); pd-router a chunk
//      per token, except that a token whose text is empty (half of a UTF-8
//      character) goes out with the next.
//   3. The final usage chunk (empty choices, stream_options.include_usage)
//      has the true count: tokens it counts beyond those of 1 and 2 (rule 2
//      merged them) are given the arrival time of the last chunk with text
//      (or of the usage chunk when none had text). So output_tokens and
//      TPOT are exact, and ITL holds a zero gap for each merged token, as
//      the arrival of several tokens in one message does for gRPC.
//   Without usage, output_tokens is the count of rules 1 and 2.
//
// Outcome: OK once `[DONE]` arrived after no error event. An error event
// (`data: {"error": {...}}`, which servers send after a stream started) is
// its code: a numeric `code` read as an HTTP status (vLLM), else its
// `type` (pd-router, OpenAI); a body that ends before `[DONE]` is
// UNAVAILABLE.
//
// Thread-safety: none; one reader per stream.
#ifndef PDSERVE_PLANNER_OPENAI_STREAM_H_
#define PDSERVE_PLANNER_OPENAI_STREAM_H_

#include <cstdint>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "planner/loadgen.h"
#include "planner/summary.h"

namespace pdserve::planner {

class OpenAiStreamReader {
 public:
  // Appends to `record`'s token_s, times in seconds since `origin`.
  OpenAiStreamReader(RequestRecord* record, SteadyTime origin);

  // Bytes of the body (after any chunked transfer coding) that arrived at
  // `when`; any split into pieces.
  void Feed(std::string_view bytes, SteadyTime when);

  // After the body's end: applies rule 3, sets record->output_tokens and
  // returns the outcome (see above).
  absl::Status Finish();

  // `data: [DONE]` arrived.
  bool done() const { return done_; }

 private:
  void OnLine(std::string_view line, SteadyTime when);
  void OnEvent(std::string_view data, SteadyTime when);
  void AddTokens(int64_t count, SteadyTime when);

  RequestRecord* const record_;
  const SteadyTime origin_;
  std::string line_;   // A line not yet ended.
  std::string event_;  // The data lines of the event being read.
  bool in_event_ = false;
  SteadyTime last_feed_;
  bool done_ = false;
  absl::Status error_;
  int64_t final_tokens_ = -1;  // From the final usage chunk.
  double last_text_s_ = -1;    // The last chunk with text.
  double usage_s_ = -1;        // The final usage chunk.
};

// The status an HTTP error status stands for (as gRPC's HTTP mapping and
// pd-router's OpenAI API: 400 INVALID_ARGUMENT, 401 UNAUTHENTICATED, 403
// PERMISSION_DENIED, 404 NOT_FOUND, 408/504 DEADLINE_EXCEEDED, 429
// RESOURCE_EXHAUSTED, 499 CANCELLED, 501 UNIMPLEMENTED, 502/503
// UNAVAILABLE, other 5xx INTERNAL, other 4xx FAILED_PRECONDITION), with the
// message of an OpenAI error body when `body` is one, else the body.
absl::Status HttpErrorStatus(int http_status, std::string_view body);

}  // namespace pdserve::planner

#endif  // PDSERVE_PLANNER_OPENAI_STREAM_H_
