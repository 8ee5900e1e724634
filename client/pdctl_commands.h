// The commands of `pdctl`, as functions so tests can call them. Each writes
// its normal output to `out` and returns a Status; main() prints errors.
#ifndef PDSERVE_CLIENT_PDCTL_COMMANDS_H_
#define PDSERVE_CLIENT_PDCTL_COMMANDS_H_

#include <ostream>
#include <string>

#include "absl/status/status.h"
#include "client/pdserve_client.h"
#include "engine/sampler.h"
#include "pdserve/v1/generation.pb.h"

namespace pdserve {

struct LocalGenerateOptions {
  std::string model = "builtin:tiny";  // Directory or builtin:tiny.
  std::string backend = "cpu";
  int32_t num_threads = 0;   // 0: every core.
  bool add_bos = true;       // Prepend BOS as the tokenizer says.
  bool print_stats = false;  // Timing line on stderr at the end.
  SamplingParams sampling;
};

// Loads the model in this process and streams the completion of `prompt`
// to `out` as tokens arrive.
absl::Status GenerateLocal(const LocalGenerateOptions& options,
                           const std::string& prompt, std::ostream& out,
                           std::ostream& err);

// Prints the token ids of `text` (and their pieces) under `model`'s tokenizer.
absl::Status Tokenize(const std::string& model, const std::string& text,
                      bool add_special_tokens, std::ostream& out);

// Remote commands, through GenerationClient to a pd-router at `server`
// ("host:port") with `client` options (API key, TLS, deadlines, retries).

// Streams the completion of `request` to `out`: the prompt text first (as
// GenerateLocal does), then the text as it arrives, then a newline; a line
// "[finish: stop|length, prompt_tokens: N, completion_tokens: M]" goes to
// `err`. Returns the call's status (the text streamed before an error
// stays on `out`).
absl::Status GenerateRemote(
    const std::string& server, const v1::GenerateRequest& request,
    std::ostream& out, std::ostream& err,
    const GenerationClient::Options& client = GenerationClient::Options());

// Prints the token ids of `text` under the server's tokenizer, one a line.
absl::Status TokenizeRemote(
    const std::string& server, const std::string& text, bool add_special_tokens,
    std::ostream& out,
    const GenerationClient::Options& client = GenerationClient::Options());

// Prints the server's health, workers (with the KV pushed per transport by
// prefill workers) and models:
//   serving: true prefill_workers: 1 decode_workers: 2
//   worker: prefill-0 role: prefill healthy: true
//     kv_transport: ucx:shm pushes: 12 bytes: 3145728 fallbacks: 0
//   worker: decode-0 role: decode healthy: true
//   model: NAME context_length: 4096 vocab_size: 258
// The health and worker lines come first, whatever ListModels answers (a
// router with API keys answers Health without a key).
absl::Status ServerStatus(
    const std::string& server, std::ostream& out,
    const GenerationClient::Options& client = GenerationClient::Options());

}  // namespace pdserve

#endif  // PDSERVE_CLIENT_PDCTL_COMMANDS_H_
