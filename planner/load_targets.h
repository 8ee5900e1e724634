// The targets of loadgen.h, each in its own file; MakeLoadTarget chooses
// among them by name. Internal to pdserve_loadgen.
#ifndef PDSERVE_PLANNER_LOAD_TARGETS_H_
#define PDSERVE_PLANNER_LOAD_TARGETS_H_

#include <memory>

#include "absl/status/statusor.h"
#include "planner/loadgen.h"

namespace pdserve::planner {

// grpc_target.cc: GenerationClient, a thread per request in flight.
absl::StatusOr<std::unique_ptr<LoadTarget>> MakeGrpcTarget(
    const TargetOptions& options);

// openai_target.cc: Boost.Beast, one I/O thread for every stream.
absl::StatusOr<std::unique_ptr<LoadTarget>> MakeOpenAiTarget(
    const TargetOptions& options);

}  // namespace pdserve::planner

#endif  // PDSERVE_PLANNER_LOAD_TARGETS_H_
