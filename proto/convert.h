// The mapping between wire types (proto/pdserve/internal/v1) and engine
// types, and between absl::Status and grpc::Status. Service code converts
// here and nowhere else.
#ifndef PDSERVE_PROTO_CONVERT_H_
#define PDSERVE_PROTO_CONVERT_H_

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/engine_loop.h"
#include "engine/generator.h"
#include "engine/kv_layout.h"
#include "engine/sampler.h"
#include "grpcpp/support/status.h"
#include "pdserve/internal/v1/worker.pb.h"

namespace pdserve {

namespace wire = ::pdserve::internal::v1;

// The request as the engine sees it. Values are checked by the Generator.
GenerationRequest FromWire(const wire::EngineRequest& request);
void ToWire(const GenerationRequest& request, wire::EngineRequest* out);

SampledToken FromWire(const wire::SampledToken& token);
void ToWire(const SampledToken& token, wire::SampledToken* out);

wire::FinishReason ToWire(FinishReason finish);

// INVALID_ARGUMENT for an unknown dtype or a zero field.
absl::StatusOr<KvBlockLayout> FromWire(const wire::KvLayout& layout);
void ToWire(const KvBlockLayout& layout, wire::KvLayout* out);

// The engine's counts in a load report (block counts, running, waiting,
// reservations, pending prompt tokens).
void ToWire(const EngineLoad& load, wire::LoadReport* out);

// The prefix-cache events a LoadRequest's cursor asks for, from `log`, into
// out->kv_events.
void ToWire(const KvEventLog& log, const wire::LoadRequest& request,
            wire::LoadReport* out);

grpc::Status ToGrpcStatus(const absl::Status& status);
absl::Status FromGrpcStatus(const grpc::Status& status);

}  // namespace pdserve

#endif  // PDSERVE_PROTO_CONVERT_H_
