// RouterService: the public pdserve.v1.Generation API of pd-router, on the
// gRPC callback API.
//
// Generate hands each call to the RequestOrchestrator (which admits it by
// KV capacity, or refuses it with RESOURCE_EXHAUSTED); the call's reactor
// writes the messages the orchestrator sends, one write in flight, merging
// those that arrive meanwhile, and never blocks in a reaction. A client that
// cancels (or whose deadline passes) cancels its request, and with it every
// downstream call.
// Tokenize, ListModels and Health answer inline.
//
// API keys: when the ApiKeys set is enabled, Generate, Tokenize and
// ListModels answer UNAUTHENTICATED unless the call's `authorization`
// metadata passes ApiKeys::Check; Health stays open (load balancers and
// deploy/local/cluster.sh probe it without a key).
//
// Generate and Tokenize take their request as raw bytes and parse it
// themselves: a proto3 string field holding invalid UTF-8 (a prompt that is
// not text) fails to parse, which gRPC's generated handlers would answer
// with an empty UNIMPLEMENTED; here it is INVALID_ARGUMENT with a message.
//
// Thread-safety: gRPC calls the service from many threads; it keeps no
// mutable state of its own.
// Ownership: borrows everything; the objects passed in must outlive the
// gRPC server the service is registered with.
#ifndef PDSERVE_ROUTER_ROUTER_SERVICE_H_
#define PDSERVE_ROUTER_ROUTER_SERVICE_H_

#include <memory>

#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "pdserve/v1/generation.grpc.pb.h"
#include "router/api_keys.h"
#include "router/etcd_discovery.h"
#include "router/orchestrator.h"
#include "router/router_metrics.h"
#include "router/served_model.h"
#include "router/worker_registry.h"

namespace pdserve {

using RouterServiceBase = v1::Generation::WithRawCallbackMethod_Generate<
    v1::Generation::WithRawCallbackMethod_Tokenize<
        v1::Generation::WithCallbackMethod_ListModels<
            v1::Generation::WithCallbackMethod_Health<
                v1::Generation::Service>>>>;

class RouterService final : public RouterServiceBase {
 public:
  // `default_deadline` bounds a Generate call whose client set none.
  // `metrics` records every Generate call.
  RouterService(std::shared_ptr<const ServedModel> model,
                WorkerRegistry* registry, RequestOrchestrator* orchestrator,
                const ApiKeys* api_keys,
                absl::Duration default_deadline, RouterMetrics* metrics,
                const EtcdDiscovery* discovery = nullptr);

  // GenerateRequest in, GenerateResponse messages out.
  grpc::ServerWriteReactor<grpc::ByteBuffer>* Generate(
      grpc::CallbackServerContext* context,
      const grpc::ByteBuffer* request) override;
  // TokenizeRequest in, TokenizeResponse out.
  grpc::ServerUnaryReactor* Tokenize(grpc::CallbackServerContext* context,
                                     const grpc::ByteBuffer* request,
                                     grpc::ByteBuffer* response) override;
  grpc::ServerUnaryReactor* ListModels(
      grpc::CallbackServerContext* context,
      const v1::ListModelsRequest* request,
      v1::ListModelsResponse* response) override;
  grpc::ServerUnaryReactor* Health(grpc::CallbackServerContext* context,
                                   const v1::HealthRequest* request,
                                   v1::HealthResponse* response) override;

 private:
  const std::shared_ptr<const ServedModel> model_;
  WorkerRegistry* const registry_;
  RequestOrchestrator* const orchestrator_;
  const ApiKeys* const api_keys_;
  const absl::Duration default_deadline_;
  RouterMetrics* const metrics_;
  const EtcdDiscovery* const discovery_;  // Null: workers from the config.
};

}  // namespace pdserve

#endif  // PDSERVE_ROUTER_ROUTER_SERVICE_H_
