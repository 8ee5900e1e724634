// ResponseAssembler: turns the tokens sampled for one request into the
// public GenerateResponse messages — token ids, incremental text (never an
// incomplete UTF-8 character, never a possible stop string), logprobs, and
// on the last message the finish reason and usage.
//
// Thread-safety: none; one per request, used by the thread running it.
#ifndef PDSERVE_ROUTER_RESPONSE_ASSEMBLER_H_
#define PDSERVE_ROUTER_RESPONSE_ASSEMBLER_H_

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "engine/tokenizer.h"
#include "pdserve/internal/v1/worker.pb.h"
#include "pdserve/v1/generation.pb.h"
#include "router/stop_matcher.h"

namespace pdserve {

class ResponseAssembler {
 public:
  struct Options {
    // Null: messages carry token ids only (no text, no stop strings).
    // Not owned; must outlive the assembler.
    const Tokenizer* tokenizer = nullptr;
    // Leave special tokens out of the text. Default: true.
    bool skip_special_tokens = true;
    // Generation ends at the first of these in the text. Default: none.
    std::vector<std::string> stop_strings;
    // Report each token's logprob and alternatives. Default: false.
    bool logprobs = false;
    // Echoed in every message.
    std::string request_id;
    // For the final usage.
    uint32_t prompt_tokens = 0;
    // The choice (GenerateResponse.index) every message belongs to.
    // Default: 0.
    uint32_t index = 0;
  };

  explicit ResponseAssembler(Options options);

  // A message with the request id and the choice index, to add tokens to.
  v1::GenerateResponse NewMessage() const;

  // Appends `token` to `out`. Ignored once stopped(). INTERNAL when the id
  // is outside the tokenizer's vocabulary (a worker bug).
  absl::Status AddToken(const internal::v1::SampledToken& token,
                        v1::GenerateResponse* out);

  // Appends the prompt's logprobs (a worker's PrefillResponse or first
  // DecodeResponse) to `out`, which must be the choice's first message.
  void AddPromptLogprobs(const google::protobuf::RepeatedPtrField<
                             internal::v1::SampledToken>& prompt_logprobs,
                         v1::GenerateResponse* out) const;

  // True once the text reached a stop string: the generation is over.
  bool stopped() const { return stop_.stopped(); }
  // Tokens added so far (those completing a stop string included).
  uint32_t completion_tokens() const { return completion_tokens_; }

  // Completes `out` as the last message: the text held back, then the finish
  // reason (STOP when a stop string matched, else `reason`) and the usage.
  void Finish(v1::FinishReason reason, v1::GenerateResponse* out);

 private:
  const Options options_;
  std::optional<IncrementalDetokenizer> detokenizer_;
  StopStringMatcher stop_;
  uint32_t completion_tokens_ = 0;
};

// Appends `from` to `into`: token ids, text, logprobs, prompt logprobs; the
// finish reason and usage when `from` has them. Both are messages of the
// same choice of the same request, `from` the later one.
void MergeResponse(v1::GenerateResponse&& from, v1::GenerateResponse* into);

}  // namespace pdserve

#endif  // PDSERVE_ROUTER_RESPONSE_ASSEMBLER_H_
