// pd-decode: the decode worker process. Serves
// pdserve.internal.v1.DecodeWorker until SIGINT or SIGTERM.
//
//   pd-decode --listen=127.0.0.1:0 --port_file=decode.port --model=builtin:tiny
#include <cstdint>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/time/time.h"
#include "common/log.h"
#include "common/process.h"
#include "decode_worker/decode_server.h"

ABSL_FLAG(std::string, listen, "127.0.0.1:0",
          "gRPC address to serve on (port 0: any free port)");
ABSL_FLAG(std::string, port_file, "",
          "Write the bound port to this file once serving");
ABSL_FLAG(std::string, model, "builtin:tiny",
          "Model directory (Hugging Face layout) or builtin:tiny / "
          "builtin:llama-110m");
ABSL_FLAG(std::string, worker_id, "",
          "Name in load reports (default: decode-<port>)");
ABSL_FLAG(std::string, backend, "cpu", "Engine backend");
ABSL_FLAG(int64_t, kv_cache_mb, 256, "KV pool size in MiB");
ABSL_FLAG(int32_t, block_size, 16,
          "Tokens per KV block (must equal the prefill workers')");
ABSL_FLAG(int32_t, num_threads, 0,
          "Engine threads for the cpu backend (0: every core)");
ABSL_FLAG(int32_t, max_batch_tokens, 512, "Token budget of one engine step");
ABSL_FLAG(int32_t, max_running, 64, "Most sequences in the running batch");
ABSL_FLAG(std::string, kv_transport, "tcp",
          "kv_transfer transport KV arrives on");
ABSL_FLAG(std::string, kv_listen, "127.0.0.1:0",
          "Address the KV transport listens on");
ABSL_FLAG(int64_t, reservation_timeout_ms, 60000,
          "A KV reservation no Decode call takes within this is freed (a "
          "safety net for a "
          "router that vanished; the router releases the ones it gives up on)");

int main(int argc, char** argv) {
  pdserve::BlockTerminationSignals();
  absl::SetProgramUsageMessage("pd-decode [flags]: the pdserve decode worker");
  absl::ParseCommandLine(argc, argv);

  pdserve::DecodeServerOptions options;
  options.listen_address = absl::GetFlag(FLAGS_listen);
  pdserve::DecodeWorkerOptions& w = options.worker;
  w.model = absl::GetFlag(FLAGS_model);
  w.worker_id = absl::GetFlag(FLAGS_worker_id);
  w.backend = absl::GetFlag(FLAGS_backend);
  const int64_t kv_cache_mb = absl::GetFlag(FLAGS_kv_cache_mb);
  if (kv_cache_mb < 1 || kv_cache_mb > (int64_t{1} << 30)) {
    PD_LOG(ERROR) << "--kv_cache_mb must be in [1, 2^30]";
    return 2;
  }
  w.kv_cache_bytes = static_cast<size_t>(kv_cache_mb) << 20;
  w.block_size = absl::GetFlag(FLAGS_block_size);
  w.num_threads = absl::GetFlag(FLAGS_num_threads);
  w.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  w.max_running = absl::GetFlag(FLAGS_max_running);
  w.kv_transport = absl::GetFlag(FLAGS_kv_transport);
  w.kv_listen_address = absl::GetFlag(FLAGS_kv_listen);
  w.reservation_timeout =
      absl::Milliseconds(absl::GetFlag(FLAGS_reservation_timeout_ms));

  auto server = pdserve::DecodeServer::Start(options);
  if (!server.ok()) {
    PD_LOG(ERROR) << "pd-decode: " << server.status();
    return 1;
  }
  if (const std::string port_file = absl::GetFlag(FLAGS_port_file);
      !port_file.empty()) {
    if (absl::Status s = pdserve::WritePortFile(port_file, (*server)->port());
        !s.ok()) {
      PD_LOG(ERROR) << "pd-decode: " << s;
      return 1;
    }
  }
  const int signal = pdserve::WaitForTerminationSignal();
  PD_LOG(INFO) << "pd-decode: signal " << signal << ", shutting down";
  (*server)->Shutdown();
  return 0;
}
