// ModelRunner: runs the forward pass of a Model on one backend ("cpu",
// "cuda" when built) over a ragged batch, reading and writing a paged KV
// cache that the runner owns (host memory for cpu, device memory for cuda).
//
// One forward call takes any mix of sequences: each brings its new tokens (a
// prefill chunk or one decode token), the position of the first of them,
// and its block table. The runner writes the new tokens' K/V into the cache
// slots their positions map to, attends over everything before them, and
// returns logits for the rows asked for.
//
// Thread-safety: none; one thread (the engine loop) owns a runner. Forward
// may use a pool of worker threads internally.
#ifndef PDSERVE_ENGINE_MODEL_RUNNER_H_
#define PDSERVE_ENGINE_MODEL_RUNNER_H_

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/kv_layout.h"
#include "engine/model.h"

namespace pdserve {

struct SequenceInput {
  std::span<const int32_t> tokens;  // New tokens; at least one.
  int32_t start_pos = 0;            // Position of tokens[0].
  // Blocks holding positions [0, start_pos + tokens.size()), in order.
  std::span<const BlockId> block_table;
  // Logits for every new token (true) or only the last one (false).
  bool all_logits = false;
};

struct ForwardBatch {
  std::vector<SequenceInput> sequences;
  // When set, called on the forward's thread as soon as layer `layer`'s K/V
  // for every new token is in the cache (a prefill worker ships the layer
  // while the next one computes). Must not block. Default: unset.
  std::function<void(int32_t layer)> on_layer_kv_written;
};

// Where a runner's KV pool lives. Host memory can be read and written by
// any code in the process; device memory only through the CUDA runtime (a
// transport must stage it through host memory or move it GPU to GPU).
enum class KvMemoryKind { kHost, kCudaDevice };

// Bytes [offset, offset + length) of a KV pool.
struct KvByteRange {
  size_t offset = 0;
  size_t length = 0;
};

struct ModelRunnerOptions {
  // Backend name: "cpu" (always built) or "cuda". Default: "cpu".
  std::string backend = "cpu";
  // Size of the KV pool in blocks; 0 sizes it from kv_cache_bytes. Default: 0.
  int32_t num_kv_blocks = 0;
  // Memory for the KV pool when num_kv_blocks is 0. Default: 256 MiB.
  size_t kv_cache_bytes = size_t{256} << 20;
  // Tokens per KV block. Default: 16.
  int32_t block_size = 16;
  // Worker threads for the cpu backend; 0 uses every core. Default: 0.
  int32_t num_threads = 0;
  // cpu backend: bf16 weights multiply activations rounded to bf16, as a
  // PyTorch bf16 model, llama.cpp's BF16 weights and the cuda backend do
  // (cpu::MatMulOptions): faster prefill where the CPU has AVX512_BF16,
  // logits up to ~3% of the largest from the fp32 ones. Default: false.
  bool bf16_activations = false;
  // cpu backend: quantize the weight matrices (not the embedding table) to
  // int8 at load, one fp16 scale per 32 weights of a row (DType::kQ8,
  // cpu::QuantizeToQ8), and multiply them by activations quantized alike,
  // as llama.cpp's Q8_0: a quarter of fp32's bytes to read per token, half
  // of bf16's. The cuda backend refuses it. Default: false.
  bool int8_weights = false;
  // cuda backend: replay decode steps (one token per sequence) through
  // CUDA graphs captured per padded batch size. Default: true.
  bool cuda_graphs = true;
};

class ModelRunner {
 public:
  virtual ~ModelRunner() = default;

  virtual const Model& model() const = 0;
  virtual const KvBlockLayout& kv_layout() const = 0;
  virtual int32_t num_kv_blocks() const = 0;
  // The KV pool: num_kv_blocks() blocks laid out as kv_layout() says. Host
  // memory for cpu, device memory for cuda (see kv_memory_kind()).
  // Transports register it to move blocks between workers.
  virtual std::span<std::byte> kv_memory() = 0;
  // Where kv_memory() lives; callers that dereference it on the host must
  // check for kHost first.
  virtual KvMemoryKind kv_memory_kind() const { return KvMemoryKind::kHost; }

  // Host memory laid out like kv_memory() (same size, same offsets), for
  // moving a device pool with a transport that reads and writes host
  // memory only: a worker registers this instead of kv_memory() and copies
  // ranges through it with the two calls below. For a host pool it is
  // kv_memory() itself and the copies only check their ranges; for cuda it
  // is pinned memory, allocated on the first call (RESOURCE_EXHAUSTED when
  // the host cannot pin that much). Call it from the runner's owner before
  // any copy.
  virtual absl::StatusOr<std::span<std::byte>> KvHostStaging();
  // Copy `ranges` of kv_memory() to the same offsets of KvHostStaging(), or
  // back, and return once the bytes are there. Unlike Forward, either may
  // run on one other thread while Forward runs, for ranges that Forward
  // neither writes nor (CopyKvFromHostStaging) reads. INVALID_ARGUMENT for
  // a range outside the pool; FAILED_PRECONDITION before KvHostStaging.
  virtual absl::Status CopyKvToHostStaging(std::span<const KvByteRange> ranges);
  virtual absl::Status CopyKvFromHostStaging(
      std::span<const KvByteRange> ranges);

  // Number of logits rows Forward produces for `batch`.
  static size_t NumLogitsRows(const ForwardBatch& batch);

  // Runs the batch. `logits` receives NumLogitsRows(batch) rows of
  // vocab_size floats, sequences in order. INVALID_ARGUMENT (and nothing
  // written to the cache) for an ill-formed batch: empty sequence, token id
  // outside the vocabulary, positions beyond the model's context, a block
  // table too short or naming a block outside the pool, a logits span of the
  // wrong size.
  virtual absl::Status Forward(const ForwardBatch& batch, std::span<float> logits) = 0;

 protected:
  // The checks every backend shares; backends call it first.
  absl::Status ValidateBatch(const ForwardBatch& batch, std::span<const float> logits) const;
  // INVALID_ARGUMENT unless every range lies inside kv_memory().
  absl::Status ValidateKvRanges(std::span<const KvByteRange> ranges);
};

// Creates a runner for `options.backend`. NOT_FOUND for a backend that is
// not built into this binary; RESOURCE_EXHAUSTED when the KV pool cannot be
// allocated.
absl::StatusOr<std::unique_ptr<ModelRunner>> CreateModelRunner(
    std::shared_ptr<const Model> model, const ModelRunnerOptions& options);

// Names of the backends built into this binary.
std::vector<std::string> AvailableBackends();

}  // namespace pdserve

#endif  // PDSERVE_ENGINE_MODEL_RUNNER_H_
