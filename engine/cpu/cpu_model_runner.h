// The "cpu" backend: fp32 activations and an fp32 KV pool in host memory.
#ifndef PDSERVE_ENGINE_CPU_CPU_MODEL_RUNNER_H_
#define PDSERVE_ENGINE_CPU_CPU_MODEL_RUNNER_H_

#include <memory>

#include "absl/status/statusor.h"
#include "engine/model_runner.h"

namespace pdserve {

absl::StatusOr<std::unique_ptr<ModelRunner>> CreateCpuModelRunner(
    std::shared_ptr<const Model> model, const ModelRunnerOptions& options);

}  // namespace pdserve

#endif  // PDSERVE_ENGINE_CPU_CPU_MODEL_RUNNER_H_
