#include "common/metrics_http.h"

#include <utility>

namespace pdserve {

absl::StatusOr<std::unique_ptr<HttpServer>> StartMetricsServer(
    const std::string& listen, const MetricsRegistry* registry) {
  if (listen.empty()) return nullptr;
  HttpServer::Options options;
  options.listen = listen;
  options.threads = 1;
  // Scrapers and probes only: a few connections, small requests.
  options.max_connections = 64;
  options.max_body_bytes = 4 << 10;
  return HttpServer::Start(
      options, [registry](HttpRequest request,
                          std::shared_ptr<HttpExchange> exchange) {
        const bool known =
            request.path == "/metrics" || request.path == "/health";
        if (!known) {
          exchange->Respond(404, "text/plain", "not found: /metrics, /health\n");
        } else if (request.method != "GET") {
          exchange->Respond(405, "text/plain", "GET only\n",
                            {{"Allow", "GET"}});
        } else if (request.path == "/metrics") {
          exchange->Respond(200, std::string(MetricsRegistry::kContentType),
                            registry->Exposition());
        } else {
          exchange->Respond(200, "text/plain", "ok\n");
        }
      });
}

}  // namespace pdserve
