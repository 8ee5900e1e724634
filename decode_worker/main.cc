// pd-decode: the decode worker process. Serves
// pdserve.internal.v1.DecodeWorker until SIGINT or SIGTERM, which start a
// graceful drain (common/drain.h): new work is refused, its streams run to their end,
// then it exits 0 — at the latest after --drain_timeout, or at once on a
// second signal.
//
//   pd-decode --listen=127.0.0.1:0 --port_file=decode.port --model=builtin:tiny
//
// Engine flags (--model, --kv_cache_mb, ...) are in engine/engine_flags.cc.
#include <cstdint>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/time/time.h"
#include "common/drain.h"
#include "common/etcd_flags.h"
#include "common/log.h"
#include "common/process.h"
#include "common/tls_flags.h"
#include "decode_worker/decode_server.h"
#include "engine/engine_flags.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:0",
          "gRPC address to serve on (port 0: any free port)");
ABSL_FLAG(std::string, port_file, "",
          "Write the bound port to this file once serving");
ABSL_FLAG(std::string, metrics_listen, "127.0.0.1:0",
          "HTTP address of /metrics (Prometheus) and /health (port 0: any "
          "free port; empty: none)");
ABSL_FLAG(std::string, metrics_port_file, "",
          "Write the bound /metrics port to this file once serving (before "
          "--port_file)");
ABSL_FLAG(std::string, worker_id, "",
          "Name in load reports (default: decode-<port>)");
ABSL_FLAG(std::string, kv_transport, "tcp",
          "kv_transfer transports KV may arrive on, a comma list in "
          "preference order, every one offered to prefill workers (e.g. "
          "ucx:shm,tcp). Names: tcp; ucx (UCX_TLS from the environment), "
          "ucx:shm, ucx:tcp, ucx:TLS+LIST (UCX transports joined with '+'); "
          "cuda_ipc, nccl when built. The prefill worker picks the best "
          "common one by the ranking in kv_transfer/negotiation.h");
ABSL_FLAG(std::string, kv_listen, "127.0.0.1:0",
          "Address the KV transports that listen on a socket (tcp) listen "
          "on");
ABSL_FLAG(int64_t, reservation_timeout_ms, 60000,
          "A KV reservation no Decode call takes within this is freed (a "
          "safety net for a router that vanished; the router releases the "
          "ones it gives up on)");
ABSL_FLAG(int64_t, kv_quarantine_ms, 15000,
          "How long the blocks of a dropped reservation are held back when a "
          "one-sided KV transport (ucx, cuda_ipc, nccl) is offered and the "
          "prefill worker never said its push was over; must exceed the "
          "prefill workers' --transfer_timeout_ms");

ABSL_FLAG(absl::Duration, drain_timeout, absl::Seconds(30),
          "After SIGTERM/SIGINT, how long the worker goes on serving the "
          "requests it has (refusing new ones) before it exits; requests "
          "still running then are migrated by the router. 0: exit at once");

ABSL_FLAG(std::string, kv_fault, "",
          "Tests only: faults injected into the KV transports, e.g. "
          "'write:delay=200ms:p=0.2,notify:drop:p=0.1,seed=7' "
          "(kv_transfer/fault_injection.h); empty: none");

int main(int argc, char** argv) {
  pdserve::BlockTerminationSignals();
  absl::SetProgramUsageMessage("pd-decode [flags]: the pdserve decode worker");
  absl::ParseCommandLine(argc, argv);

  pdserve::DecodeServerOptions options;
  options.listen_address = absl::GetFlag(FLAGS_listen);
  options.metrics_listen = absl::GetFlag(FLAGS_metrics_listen);
  // The drain below is the grace period; after it Shutdown only lets the
  // last writes out before it cancels what is left.
  options.shutdown_grace = absl::Seconds(1);
  pdserve::DecodeWorkerOptions& w = options.worker;
  absl::StatusOr<pdserve::EngineConfig> engine =
      pdserve::EngineConfigFromFlags();
  if (!engine.ok()) {
    PD_LOG(ERROR) << "pd-decode: " << engine.status();
    return 2;
  }
  w.engine = *std::move(engine);
  w.worker_id = absl::GetFlag(FLAGS_worker_id);
  w.kv_transport = absl::GetFlag(FLAGS_kv_transport);
  w.kv_fault = absl::GetFlag(FLAGS_kv_fault);
  w.kv_listen_address = absl::GetFlag(FLAGS_kv_listen);
  w.reservation_timeout =
      absl::Milliseconds(absl::GetFlag(FLAGS_reservation_timeout_ms));
  w.kv_quarantine = absl::Milliseconds(absl::GetFlag(FLAGS_kv_quarantine_ms));

  absl::StatusOr<std::unique_ptr<pdserve::TlsCertificates>> mtls =
      pdserve::InternalTlsFromFlags();
  if (!mtls.ok()) {
    PD_LOG(ERROR) << "pd-decode: " << mtls.status();
    return 2;
  }
  absl::StatusOr<std::unique_ptr<pdserve::TlsCertificates>> etcd_tls =
      pdserve::EtcdTlsFromFlags();
  if (!etcd_tls.ok()) {
    PD_LOG(ERROR) << "pd-decode: " << etcd_tls.status();
    return 2;
  }
  if (*mtls) {
    options.credentials =
        (*mtls)->ServerCredentials(pdserve::ClientCertificates::kRequire);
  }
  auto server = pdserve::DecodeServer::Start(options);
  if (!server.ok()) {
    PD_LOG(ERROR) << "pd-decode: " << server.status();
    return 1;
  }
  if (const std::string file = absl::GetFlag(FLAGS_metrics_port_file);
      !file.empty()) {
    if (absl::Status s =
            pdserve::WritePortFile(file, (*server)->metrics_port());
        !s.ok()) {
      PD_LOG(ERROR) << "pd-decode: " << s;
      (*server)->Shutdown();
      return 1;
    }
  }
  auto registration = pdserve::RegisterWorkerFromFlags(
      {.role = "decode",
       .id = w.worker_id,
       .model = w.engine.model,
       .kv_transports = w.kv_transport,
       .kv_blocks = (*server)->worker().num_kv_blocks(),
       .block_size = w.engine.block_size,
       .listen = options.listen_address,
       .port = (*server)->port()},
      etcd_tls->get());
  if (!registration.ok()) {
    PD_LOG(ERROR) << "pd-decode: " << registration.status();
    (*server)->Shutdown();
    return 1;
  }
  const auto reload = [&] {
    pdserve::ReloadAndLog("pd-decode", {mtls->get(), etcd_tls->get()});
  };
  const bool announced = pdserve::AnnounceAndWaitForSignal(
      "pd-decode", (*server)->port(), absl::GetFlag(FLAGS_port_file), reload);
  if (announced) {
    // Drain: refuse new work (and say so in load reports) ...
    const pdserve::DrainProgress drain = pdserve::StartDrain(
        "pd-decode", (*server)->worker(), absl::GetFlag(FLAGS_drain_timeout));
    // ... leave every router's view at once (revoke the etcd lease; a
    // static cluster config has nothing to undo) ...
    registration->reset();
    // ... and serve what it holds until done, the timeout, or a 2nd signal.
    pdserve::AwaitDrain((*server)->worker(), drain, reload);
  }
  (*server)->Shutdown();
  return announced ? 0 : 1;
}
