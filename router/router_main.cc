// pd-router: the front door of a pdserve cluster. Serves pdserve.v1.Generation
// over gRPC and routes each request to a prefill and a decode worker of the
// cluster config.
//
//   pd-router --config=cluster.json [--listen=127.0.0.1:0] [--port_file=F]
//             [--http_listen=127.0.0.1:8000] [--http_port_file=F]
//             [--api_key=K1,K2] [--api_key_file=PATH]
//             [--etcd=http://HOST:2379 [--etcd_prefix=/pdserve/]]
//
// With --etcd the workers are also discovered in etcd, where they register
// themselves (router/etcd_discovery.h); the config then gives the model and
// the routing, and its worker lists may be empty.
//
// API keys: the keys of --api_key (a comma-separated list) and of
// --api_key_file (one per line) together; with any, every call but Health
// needs `authorization: Bearer <key>`. Prefer the file: a command line is
// visible to every user of the machine (ps).
//
// TLS (docs/security.md): --tls_cert_file and --tls_key_file serve the
// public gRPC and HTTP APIs over TLS (--tls_client_ca_file: clients must
// present a certificate it signs); --mtls_* (common/tls_flags.h): mTLS to
// the workers. SIGHUP re-reads every certificate file.
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/synchronization/mutex.h"
#include "absl/flags/usage.h"
#include "absl/time/time.h"
#include "common/etcd_flags.h"
#include "common/log.h"
#include "common/process.h"
#include "common/tls_flags.h"
#include "router/api_keys.h"
#include "router/cluster_config.h"
#include "router/router.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:0",
          "gRPC address to serve on (port 0: any free port)");
ABSL_FLAG(std::string, port_file, "",
          "Write the bound port to this file once serving");
ABSL_FLAG(std::string, config, "",
          "Cluster config (JSON of pdserve.internal.v1.ClusterConfig)");
ABSL_FLAG(int32_t, max_queued, 4096,
          "Requests waiting for KV room on the decode workers (admission is "
          "by KV capacity); more are refused with RESOURCE_EXHAUSTED");
ABSL_FLAG(int32_t, poll_interval_ms, 100,
          "Period of the workers' load reports, in milliseconds");
ABSL_FLAG(int32_t, prefill_retries, 2,
          "Other prefill workers to try when a prefill fails");
ABSL_FLAG(int32_t, migration_limit, 3,
          "Times one request (choice) may move to another decode worker when "
          "its own fails or stalls, continuing its stream from the tokens "
          "sent; 0: never (the stream ends UNAVAILABLE)");
ABSL_FLAG(absl::Duration, decode_stall_timeout, absl::Seconds(10),
          "A running decode stream that sends no token for this long is a "
          "stalled decode worker: the router cancels it there and migrates "
          "the request (e.g. 10s, 1500ms; positive)");
ABSL_FLAG(std::string, served_model_name, "",
          "Name clients use for the model (overrides the config's; default: "
          "the model directory's base name)");
ABSL_FLAG(std::string, http_listen, "127.0.0.1:0",
          "Address of the OpenAI-compatible HTTP API (port 0: any free port; "
          "empty: no HTTP)");
ABSL_FLAG(std::string, http_port_file, "",
          "Write the bound HTTP port to this file once serving");
ABSL_FLAG(int32_t, http_threads, 2, "Threads serving HTTP connections");
ABSL_FLAG(std::vector<std::string>, api_key, {},
          "API keys, comma-separated: every call but Health must then send "
          "'authorization: Bearer <key>' with one of them (visible in ps: "
          "prefer --api_key_file)");
ABSL_FLAG(std::string, api_key_file, "",
          "File of API keys, one per line (blank lines and #comments "
          "ignored), added to --api_key");
ABSL_FLAG(std::string, tls_cert_file, "",
          "Public TLS: PEM certificate chain of the gRPC and HTTP APIs (with "
          "--tls_key_file; none: plaintext). Re-read on SIGHUP");
ABSL_FLAG(std::string, tls_key_file, "",
          "Public TLS: PEM private key of --tls_cert_file");
ABSL_FLAG(std::string, tls_client_ca_file, "",
          "Public TLS: clients must present a certificate signed by a CA of "
          "this PEM bundle (none: any client; API keys still apply)");

namespace {

// The certificates of the --tls_* flags; null when none is set.
absl::StatusOr<std::unique_ptr<pdserve::TlsCertificates>> PublicTlsFromFlags() {
  return pdserve::TlsCertificatesFromFlags(
      "tls", absl::GetFlag(FLAGS_tls_cert_file), absl::GetFlag(FLAGS_tls_key_file),
      absl::GetFlag(FLAGS_tls_client_ca_file), /*ca_required=*/false);
}

}  // namespace

int main(int argc, char** argv) {
  pdserve::BlockTerminationSignals();
  // Debian's Abseil is built without NDEBUG, so every absl::Mutex lock also
  // runs the deadlock detector's graph update: 232 -> 202 us of router CPU
  // per request when off (docs/benchmarks.md, "Router at 10,000 streams").
  // The tests keep it on (they run without this main).
  absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  absl::SetProgramUsageMessage(
      "pd-router --config=cluster.json [--listen=HOST:PORT] [--port_file=F]");
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_config).empty()) {
    std::cerr << "pd-router: --config is required\n";
    return 2;
  }
  const std::vector<std::string> etcd = pdserve::EtcdEndpointsFromFlags();
  auto cluster = pdserve::LoadClusterConfig(absl::GetFlag(FLAGS_config), !etcd.empty());
  if (!cluster.ok()) {
    std::cerr << "pd-router: " << cluster.status() << "\n";
    return 1;
  }
  pdserve::RouterOptions options;
  options.listen = absl::GetFlag(FLAGS_listen);
  options.cluster = *std::move(cluster);
  if (const std::string name = absl::GetFlag(FLAGS_served_model_name);
      !name.empty()) {
    options.cluster.set_served_model_name(name);
  }
  options.max_queued = absl::GetFlag(FLAGS_max_queued);
  options.poll_interval =
      absl::Milliseconds(absl::GetFlag(FLAGS_poll_interval_ms));
  options.prefill_retries = absl::GetFlag(FLAGS_prefill_retries);
  options.migration_limit = absl::GetFlag(FLAGS_migration_limit);
  options.decode_stall_timeout = absl::GetFlag(FLAGS_decode_stall_timeout);
  options.http_listen = absl::GetFlag(FLAGS_http_listen);
  options.http.threads = absl::GetFlag(FLAGS_http_threads);
  options.api_keys = absl::GetFlag(FLAGS_api_key);
  options.etcd_endpoints = etcd;
  options.etcd_prefix = pdserve::EtcdPrefixFromFlags();
  if (const std::string file = absl::GetFlag(FLAGS_api_key_file);
      !file.empty()) {
    auto keys = pdserve::ReadApiKeyFile(file);
    if (!keys.ok()) {
      std::cerr << "pd-router: --api_key_file: " << keys.status() << "\n";
      return 1;
    }
    options.api_keys.insert(options.api_keys.end(), keys->begin(),
                            keys->end());
  }
  absl::StatusOr<std::unique_ptr<pdserve::TlsCertificates>> public_tls =
      PublicTlsFromFlags();
  if (!public_tls.ok()) {
    std::cerr << "pd-router: " << public_tls.status() << "\n";
    return 2;
  }
  if (*public_tls) {
    options.credentials = (*public_tls)->ServerCredentials(
        (*public_tls)->files().ca_file.empty()
            ? pdserve::ClientCertificates::kNone
            : pdserve::ClientCertificates::kRequire);
    options.http.tls = public_tls->get();
  }
  absl::StatusOr<std::unique_ptr<pdserve::TlsCertificates>> mtls =
      pdserve::InternalTlsFromFlags();
  if (!mtls.ok()) {
    std::cerr << "pd-router: " << mtls.status() << "\n";
    return 2;
  }
  if (*mtls) options.worker_credentials = (*mtls)->ChannelCredentials();
  absl::StatusOr<std::unique_ptr<pdserve::TlsCertificates>> etcd_tls =
      pdserve::EtcdTlsFromFlags();
  if (!etcd_tls.ok()) {
    std::cerr << "pd-router: " << etcd_tls.status() << "\n";
    return 2;
  }
  if (*etcd_tls) options.etcd_tls = (*etcd_tls)->ChannelCredentials();
  auto router = pdserve::Router::Start(options);
  if (!router.ok()) {
    std::cerr << "pd-router: " << router.status() << "\n";
    return 1;
  }
  if (const std::string file = absl::GetFlag(FLAGS_http_port_file);
      !file.empty()) {
    if (absl::Status s = pdserve::WritePortFile(file, (*router)->http_port());
        !s.ok()) {
      std::cerr << "pd-router: " << s << "\n";
      return 1;
    }
  }
  const bool announced = pdserve::AnnounceAndWaitForSignal(
      "pd-router", (*router)->port(), absl::GetFlag(FLAGS_port_file), [&] {
        pdserve::ReloadAndLog("pd-router",
                              {public_tls->get(), mtls->get(), etcd_tls->get()});
      });
  (*router)->Shutdown();
  return announced ? 0 : 1;
}
