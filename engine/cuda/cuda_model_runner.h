// The "cuda" backend: bf16 weights and activations on the current CUDA
// device (fp32 residual stream and accumulation), cuBLAS GEMMs, the
// kernels of cuda_kernels.h, and a bf16 KV pool in device memory allocated
// once (kv_memory_kind() is kCudaDevice).
//
// Forward enqueues the whole pass on the runner's own stream and waits only
// to copy the logits back (and, when the batch asks for it, after each
// layer's K/V write so that on_layer_kv_written sees the cache complete).
#ifndef PDSERVE_ENGINE_CUDA_CUDA_MODEL_RUNNER_H_
#define PDSERVE_ENGINE_CUDA_CUDA_MODEL_RUNNER_H_

#include <memory>

#include "absl/status/statusor.h"
#include "engine/model_runner.h"

namespace pdserve {

// FAILED_PRECONDITION when no CUDA device is visible; INVALID_ARGUMENT for
// a head_dim the kernels do not support (odd or above 256) or a bad
// block_size; RESOURCE_EXHAUSTED when weights or the KV pool do not fit.
absl::StatusOr<std::unique_ptr<ModelRunner>> CreateCudaModelRunner(
    std::shared_ptr<const Model> model, const ModelRunnerOptions& options);

// Number of CUDA devices visible to this process (0 when the driver is
// missing or no device is present).
int CudaDeviceCount();

}  // namespace pdserve

#endif  // PDSERVE_ENGINE_CUDA_CUDA_MODEL_RUNNER_H_
