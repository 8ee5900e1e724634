// The load generator under pd-bench: runs a Workload (planner/workload.h)
// against a serving endpoint and returns one RequestRecord
// (planner/summary.h) per request sent, which Summarize turns into the
// figures that pd-plan's simulator predicts.
//
// Targets, chosen by name (MakeLoadTarget):
//   grpc    pdserve's public API (proto/pdserve/v1/generation.proto)
//           through the C++ SDK, GenerationClient: a token-id prompt,
//           max_tokens = the request's output tokens, ignore_eos,
//           temperature 0. Every response message names its token ids: a
//           message of k tokens gives k equal arrival times. The SDK's
//           retries are off (one attempt): a load test records refusals,
//           it does not hide them.
//   openai  any OpenAI-compatible server (pd-router, vLLM, SGLang, ...):
//           POST /v1/completions with `prompt` as a token-id array,
//           max_tokens, ignore_eos, temperature 0, stream, and
//           stream_options.include_usage; read as Server-Sent Events.
//           Tokens per chunk (OpenAiStreamReader, openai_stream.h): the
//           server's own count where it gives one per chunk
//           (continuous_usage_stats), else one token per chunk with text;
//           tokens the final usage counts beyond those arrive with the last
//           text chunk. vLLM, SGLang and pd-router are measured by the same
//           rule.
//
// Loads:
//   closed loop (concurrency > 0): `concurrency` requests in flight, the
//     next workload request sent as soon as one ends; arrival times are
//     ignored.
//   open loop (concurrency 0): request i sent at its arrival_s. The calling
//     thread sleeps until each arrival on the steady clock from the run's
//     start (absolute times: a late send does not delay the next), and the
//     targets run streams concurrently, so a slow stream never delays a
//     send.
//   Both stop sending at duration_s or after max_requests, then wait for
//   the requests in flight (each bounded by the target's request_timeout).
//
// How the targets hold many concurrent streams, and why:
//   openai  Boost.Beast on Asio, one I/O thread for every stream: a
//           stream is a chain of asynchronous operations, so hundreds or
//           thousands in flight cost sockets and buffers, not threads,
//           and each read completion is stamped with the steady clock
//           before its bytes are parsed (SSE events that came in one read
//           share that time, as they arrived together). cpp-httplib's
//           client is blocking (a thread per stream) and hands body bytes
//           to a callback after its own buffering; Beast is already what
//           the router serves HTTP with (common/http_server.h). Keep-alive
//           connections are pooled and reused, as vLLM's and AIPerf's
//           clients do, so TTFT holds no TCP handshake after the first
//           requests.
//   grpc    a thread per request in flight: the SDK's Generate is
//           synchronous, and what pd-bench measures is what an SDK user
//           sees. Hundreds of threads blocked in reads cost little CPU at
//           the concurrencies a 2-core machine drives.
//
// Times: seconds from the run's start on the steady clock.
// Thread-safety: RunLoad may be called from one thread at a time per
// target; a LoadTarget's Start may be called from any thread.
#ifndef PDSERVE_PLANNER_LOADGEN_H_
#define PDSERVE_PLANNER_LOADGEN_H_

#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "planner/summary.h"
#include "planner/workload.h"

namespace pdserve::planner {

using SteadyTime = std::chrono::steady_clock::time_point;

// One request as a target sends it.
struct TargetRequest {
  std::vector<int32_t> prompt;  // Token ids.
  int32_t max_tokens = 1;
  // The run's start: every time in the record is seconds since it.
  SteadyTime origin;
};

// A serving endpoint that streams completions.
class LoadTarget {
 public:
  virtual ~LoadTarget() = default;

  // Sends `request` and returns at once. The target fills `record`'s
  // token_s, output_tokens, end_s, outcome and error (the caller set the
  // other fields and does not touch it until `done`), then calls `done`
  // once, from one of its own threads, when the stream ended. The
  // destructor waits for every stream started.
  virtual void Start(TargetRequest request, RequestRecord* record,
                     std::function<void()> done) = 0;
};

struct TargetOptions {
  // "host:port" of the server.
  std::string address;
  // The model to ask for (openai: the `model` field, grpc:
  // GenerateRequest.model). Default: empty, the server's only model (the
  // field is left out).
  std::string model;
  // Sent as `Authorization: Bearer <key>` (gRPC metadata `authorization`).
  // Default: empty, none.
  std::string api_key;
  // openai: ask for stream_options.continuous_usage_stats, the server's
  // token count on every chunk (vLLM, SGLang; strict OpenAI refuses it).
  // Default: false.
  bool per_chunk_usage = false;
  // Each request's limit from its send; passed: DEADLINE_EXCEEDED.
  // Default: 10 min.
  absl::Duration request_timeout = absl::Minutes(10);
};

// Target names MakeLoadTarget knows.
std::vector<std::string> LoadTargetNames();

// INVALID_ARGUMENT for an unknown name, an address that is not host:port
// (openai also takes http://host:port) or a timeout that is not positive;
// UNAVAILABLE when the host cannot be resolved. An unreachable
// server is no error here: its requests end UNAVAILABLE.
absl::StatusOr<std::unique_ptr<LoadTarget>> MakeLoadTarget(
    std::string_view name, const TargetOptions& options);

struct LoadOptions {
  // > 0: closed loop with this many requests in flight; 0: open loop at
  // the workload's arrival times. Default: 0.
  int32_t concurrency = 0;
  // No request is sent after this many seconds from the start.
  // Default: no limit.
  double duration_s = std::numeric_limits<double>::infinity();
  // At most this many requests, the workload's first (0: all of them).
  // Default: 0.
  int64_t max_requests = 0;
  // A progress line on stderr, updated in place about once a second
  // (sent, completed, failed, in flight, elapsed, completions per second
  // over the last second); a new line every 10 s when stderr is not a
  // terminal. Default: true.
  bool progress = true;
  // Opens the progress line, e.g. "rate 4/s". Default: empty.
  std::string label;
};

struct LoadResult {
  // One per request sent, in workload order (record.index).
  std::vector<RequestRecord> records;
  // Open loop: the latest send after its arrival time, seconds.
  double max_send_lateness_s = 0;
  // From the start until the last request ended.
  double wall_s = 0;
};

// INVALID_ARGUMENT for a negative concurrency or max_requests, or a
// duration that is not positive.
absl::StatusOr<LoadResult> RunLoad(const Workload& workload, LoadTarget& target,
                                   const LoadOptions& options);

}  // namespace pdserve::planner

#endif  // PDSERVE_PLANNER_LOADGEN_H_
