// The command-line flags of a worker's engine (--model, --backend,
// --kv_cache_mb, --block_size, --num_threads, --max_batch_tokens,
// --max_running), shared by pd-prefill and pd-decode.
#ifndef PDSERVE_ENGINE_ENGINE_FLAGS_H_
#define PDSERVE_ENGINE_ENGINE_FLAGS_H_

#include "absl/status/statusor.h"
#include "engine/engine_loop.h"

namespace pdserve {

// The EngineConfig the flags describe (after absl::ParseCommandLine).
// INVALID_ARGUMENT naming the flag for a value out of range.
absl::StatusOr<EngineConfig> EngineConfigFromFlags();

}  // namespace pdserve

#endif  // PDSERVE_ENGINE_ENGINE_FLAGS_H_
