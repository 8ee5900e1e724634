// StartMetricsServer: a small HTTP endpoint for a process that serves no
// other HTTP (pd-prefill, pd-decode): GET /metrics answers the registry's
// Prometheus exposition, GET /health "ok"; anything else 404 (405 for
// another method on those paths).
//
// Thread-safety: as HttpServer. Ownership: `registry` is not owned and
// must outlive the returned server (or its Stop()).
#ifndef PDSERVE_COMMON_METRICS_HTTP_H_
#define PDSERVE_COMMON_METRICS_HTTP_H_

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "common/http_server.h"
#include "common/metrics.h"

namespace pdserve {

// Serves `registry` on `listen` ("HOST:PORT", port 0 picks a free one) with
// one thread; an empty `listen` serves nothing (null). HttpServer::Start's
// errors.
absl::StatusOr<std::unique_ptr<HttpServer>> StartMetricsServer(
    const std::string& listen, const MetricsRegistry* registry);

}  // namespace pdserve

#endif  // PDSERVE_COMMON_METRICS_HTTP_H_
