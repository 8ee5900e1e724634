// OpenAiService: pd-router's OpenAI-compatible HTTP API, the handler of its
// HttpServer (docs/openai_api.md).
//
//   POST /v1/completions, POST /v1/chat/completions   generation, streamed
//                                                      (SSE) or whole
//   GET  /v1/models                                    the served model
//   GET  /health                                       200 serving, 503 not
//   GET  /metrics                                      Prometheus text
//
// A generation request runs like a gRPC Generate call: each of its prompts
// is one RequestOrchestrator request (refused admission is 429 with
// Retry-After), with the same validation and the same messages. Chat requests are rendered through the model's chat template
// first. A client that disconnects cancels every downstream call of its
// request, so the decode workers free its KV blocks at once.
//
// Thread-safety: Handle() from the HTTP server's threads; it never blocks.
// Ownership: borrows everything; what it borrows must outlive the HTTP
// server that calls it and the requests it starts.
#ifndef PDSERVE_ROUTER_OPENAI_SERVICE_H_
#define PDSERVE_ROUTER_OPENAI_SERVICE_H_

#include <functional>
#include <memory>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "common/http_server.h"

namespace pdserve {

class ApiKeys;
class EtcdDiscovery;
class RequestOrchestrator;
class RouterMetrics;
class ServedModel;
class WorkerRegistry;

class OpenAiService {
 public:
  struct Deps {
    std::shared_ptr<const ServedModel> model;
    WorkerRegistry* registry = nullptr;
    RequestOrchestrator* orchestrator = nullptr;
    RouterMetrics* metrics = nullptr;
    // Null or empty: no key required.
    const ApiKeys* api_keys = nullptr;
    // Null: the workers come from the cluster config.
    const EtcdDiscovery* discovery = nullptr;
    // Deadline of a generation request. Default: 10 min.
    absl::Duration request_deadline = absl::Minutes(10);
  };

  explicit OpenAiService(Deps deps);

  void Handle(HttpRequest request, std::shared_ptr<HttpExchange> exchange);

 private:
  void Generate(bool chat, HttpRequest request,
                std::shared_ptr<HttpExchange> exchange);
  // UNAUTHENTICATED unless the request carries a key when keys are set.
  absl::Status CheckApiKey(const HttpRequest& request) const;

  const Deps deps_;
  const int64_t created_;  // /v1/models' "created": the router's start.
};

}  // namespace pdserve

#endif  // PDSERVE_ROUTER_OPENAI_SERVICE_H_
