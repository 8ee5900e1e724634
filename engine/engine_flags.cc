#include "engine/engine_flags.h"

#include <cstdint>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"

ABSL_FLAG(std::string, model, "builtin:tiny",
          "Model directory (Hugging Face layout) or builtin:tiny / "
          "builtin:llama-110m");
ABSL_FLAG(std::string, backend, "cpu", "Engine backend");
ABSL_FLAG(int64_t, kv_cache_mb, 256, "KV pool size in MiB");
ABSL_FLAG(int32_t, kv_blocks, 0,
          "KV pool size in blocks; overrides --kv_cache_mb when set (e.g. to "
          "give a worker exactly the room a test or a benchmark needs)");
ABSL_FLAG(int32_t, block_size, 16,
          "Tokens per KV block (prefill and decode workers must agree)");
ABSL_FLAG(int32_t, num_threads, 0,
          "Engine threads for the cpu backend (0: every core)");
ABSL_FLAG(bool, bf16_activations, false,
          "cpu backend: multiply bf16 weights by activations rounded to bf16, "
          "as PyTorch bf16 models and llama.cpp do (faster prefill with "
          "AVX512_BF16; logits move by up to ~3%). PDSERVE_CPU_ISA caps the "
          "instruction set the kernels use");
ABSL_FLAG(bool, int8_weights, false,
          "cpu backend: quantize the weight matrices to int8 at load (one "
          "fp16 scale per 32 weights, as llama.cpp's Q8_0) and multiply them "
          "by int8 activations: half the bytes of bf16 to read per token; "
          "logits move by ~1-3%");
ABSL_FLAG(int32_t, max_batch_tokens, 512,
          "Token budget of one engine step; longer prompts are prefilled in "
          "chunks");
ABSL_FLAG(int32_t, max_running, 64, "Most sequences in the running batch");
ABSL_FLAG(bool, kv_canary, false,
          "Fill freed KV blocks with a canary pattern and check it when they "
          "are handed out again; violations count in "
          "pdserve_kv_canary_violations_total (tests and fault drills; cpu "
          "backend)");

namespace pdserve {

absl::StatusOr<EngineConfig> EngineConfigFromFlags() {
  EngineConfig config;
  config.model = absl::GetFlag(FLAGS_model);
  config.backend = absl::GetFlag(FLAGS_backend);
  const int64_t kv_cache_mb = absl::GetFlag(FLAGS_kv_cache_mb);
  if (kv_cache_mb < 1 || kv_cache_mb > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(
        absl::StrCat("--kv_cache_mb must be in [1, 2^30]; got ", kv_cache_mb));
  }
  config.kv_cache_bytes = static_cast<size_t>(kv_cache_mb) << 20;
  config.num_kv_blocks = absl::GetFlag(FLAGS_kv_blocks);
  if (config.num_kv_blocks < 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--kv_blocks must be >= 0 (0: size by --kv_cache_mb); got ",
        config.num_kv_blocks));
  }
  config.block_size = absl::GetFlag(FLAGS_block_size);
  config.num_threads = absl::GetFlag(FLAGS_num_threads);
  config.bf16_activations = absl::GetFlag(FLAGS_bf16_activations);
  config.int8_weights = absl::GetFlag(FLAGS_int8_weights);
  config.max_batch_tokens = absl::GetFlag(FLAGS_max_batch_tokens);
  config.max_running = absl::GetFlag(FLAGS_max_running);
  config.kv_canary = absl::GetFlag(FLAGS_kv_canary);
  return config;
}

}  // namespace pdserve
