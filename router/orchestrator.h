// RequestOrchestrator: runs one Generate request across the cluster, on the
// calling thread (a BoundedExecutor thread), following DESIGN.md's request
// flow "decode reserves, prefill pushes":
//
//   validate and tokenize -> pick a decode worker D -> Reserve on D ->
//   Prefill on the least-loaded prefill worker P with D's landing (retried
//   on other P with the same reservation) -> stream the first token ->
//   Decode on D from the first token -> stream tokens until a finish.
//
// Prompts of at most short_prompt_tokens, and every prompt when no prefill
// worker is healthy, skip Reserve/Prefill: D prefills them itself. A full D
// (RESOURCE_EXHAUSTED) sends the request to the next one; when all are full
// the request fails with RESOURCE_EXHAUSTED. A D that fails before any token
// reached the client is retried once on another D; after that the stream
// ends with UNAVAILABLE and the tokens sent stand. A worker answering
// INVALID_ARGUMENT to a request the router checked is INTERNAL to the
// client (the cluster's fault, not the request's). Every downstream call
// carries the client's deadline and is cancelled when the client cancels;
// a reservation that will not be decoded is released.
//
// n > 1 choices share the prompt's KV through the prefix caches rather than
// an engine-level fork (vLLM V1's fan-out, chosen as the smaller change to
// this synchronous orchestrator; issue 14 rewrites it non-blocking): choice
// 0 runs as a request of its own. As soon as its prompt's KV is in a
// worker's prefix cache — its first Decode message came back, so decode
// worker D holds the prompt (landed KV joins D's cache when D takes the
// Decode call; a local prefill registers its blocks as it computes them) —
// choices 1..n-1 start, each on a thread of its own, on D and prefilled there
// (D computes only the tail past the prompt's last full block, which each
// choice needs for its own first logits). When choice 0 ends with its first
// token on a prefill worker (its KV never reaches D's engine), the other
// choices go the usual way and their prefill worker serves the prompt from
// its own cache. A choice that fails ends the call with its status and
// cancels the others. All of this is in RunChoices().
//
// Thread-safety: Run() may be called from many threads at once.
// Ownership: the orchestrator shares the model and borrows the registry,
// which must outlive it.
#ifndef PDSERVE_ROUTER_ORCHESTRATOR_H_
#define PDSERVE_ROUTER_ORCHESTRATOR_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "grpcpp/client_context.h"
#include "pdserve/v1/generation.pb.h"
#include "router/served_model.h"
#include "router/worker_registry.h"

namespace pdserve {

// The client side of one Generate call, as the orchestrator sees it.
// Implementations are thread-safe: cancellation comes from another thread.
class GenerateStream {
 public:
  virtual ~GenerateStream() = default;
  // When the client's call ends (its deadline, or the router's default).
  virtual absl::Time deadline() const = 0;
  // Registers a downstream call's context, to be TryCancel()ed when the
  // client cancels. False (and not registered) if it already has: then do
  // not start the call. Unregister before destroying the context.
  virtual bool AddDownstream(grpc::ClientContext* context) = 0;
  virtual void RemoveDownstream(grpc::ClientContext* context) = 0;
  // True once the client cancelled or its deadline passed.
  virtual bool cancelled() const = 0;
  // Queues `message` for the client; never blocks (messages of a choice
  // not yet written are merged). Called from several threads for n > 1.
  virtual void Send(v1::GenerateResponse message) = 0;
};

class RequestOrchestrator {
 public:
  struct Options {
    // Further prefill workers to try after the first fails. Default: 2.
    int32_t prefill_retries = 2;
    // Prompts of at most this many tokens are prefilled on the decode
    // worker; 0: every prompt goes to a prefill worker when one is
    // healthy. Default: 0.
    int32_t short_prompt_tokens = 0;
    // Deadline of Reserve and Release calls (capped by the client's).
    // Default: 5 s.
    absl::Duration control_timeout = absl::Seconds(5);
  };

  RequestOrchestrator(std::shared_ptr<const ServedModel> model,
                      WorkerRegistry* registry, const Options& options);

  // Runs `request` to its end, sending its messages to `stream`; returns the
  // status to end the call with (OK after the last message was sent).
  absl::Status Run(const v1::GenerateRequest& request, GenerateStream& stream);

 private:
  struct Request;
  struct Attempt;
  // How a choice runs besides its request.
  struct ChoiceHooks {
    // Tried first, and prefilled there: it holds the prompt's KV. Null: the
    // usual choice of worker and of where to prefill.
    const WorkerEndpoint* prefix_holder = nullptr;
    // Called once, when the prompt's KV is in decode worker `decode`'s
    // prefix cache (the choice's first Decode message came back). Not
    // called when the choice ends before that.
    std::function<void(const WorkerEndpoint* decode)> on_prompt_cached;
  };

  // Runs choice `index` of `validated` to its end.
  absl::Status RunChoice(const ValidatedRequest& validated, uint32_t index,
                         const std::string& request_id, GenerateStream& stream,
                         ChoiceHooks hooks);
  // Runs n > 1 choices (see the file comment).
  absl::Status RunChoices(const ValidatedRequest& validated,
                          const std::string& request_id,
                          GenerateStream& stream);
  Attempt RunOnDecode(const WorkerEndpoint* decode, Request& r);
  absl::StatusOr<internal::v1::PrefillResponse> Prefill(
      const internal::v1::Landing& landing, Request& r);
  Attempt Decode(const WorkerEndpoint* decode,
                 const internal::v1::DecodeRequest& decode_request,
                 bool disaggregated, Request& r);
  // Frees `request_id`'s reservation on `decode`, even when the client has
  // cancelled. Failures are logged and returned.
  absl::Status Release(const WorkerEndpoint* decode, uint64_t request_id);
  // CANCELLED or DEADLINE_EXCEEDED when the client's call is over.
  absl::Status ClientEnded(const Request& r) const;

  const std::shared_ptr<const ServedModel> model_;
  WorkerRegistry* const registry_;
  const Options options_;
  std::atomic<uint64_t> next_id_;
};

}  // namespace pdserve

#endif  // PDSERVE_ROUTER_ORCHESTRATOR_H_
