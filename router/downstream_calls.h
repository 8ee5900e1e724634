// DownstreamCalls: the worker calls one client request has open, so that
// the client going away (a cancelled gRPC call, a closed HTTP connection, a
// passed deadline) cancels every one of them. The gRPC and the HTTP front
// ends both keep their request's calls here.
//
// Thread-safety: every method from any thread. Cancel() runs TryCancel under
// the lock, so Remove() waits until no context of its caller is being
// cancelled and the caller may then destroy the context. Downstream calls
// are synchronous, so TryCancel runs no reaction that could take the lock.
#ifndef PDSERVE_ROUTER_DOWNSTREAM_CALLS_H_
#define PDSERVE_ROUTER_DOWNSTREAM_CALLS_H_

#include <algorithm>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "grpcpp/client_context.h"

namespace pdserve {

class DownstreamCalls {
 public:
  // Registers `context`; false (and not registered) once Cancel() ran: then
  // do not start the call.
  bool Add(grpc::ClientContext* context) {
    absl::MutexLock lock(&mu_);
    if (cancelled_) return false;
    contexts_.push_back(context);
    return true;
  }

  // Unregisters `context`; call before destroying it.
  void Remove(grpc::ClientContext* context) {
    absl::MutexLock lock(&mu_);
    contexts_.erase(std::remove(contexts_.begin(), contexts_.end(), context),
                    contexts_.end());
  }

  // Cancels every registered call and refuses new ones. Idempotent.
  void Cancel() {
    absl::MutexLock lock(&mu_);
    cancelled_ = true;
    for (grpc::ClientContext* context : contexts_) context->TryCancel();
  }

  bool cancelled() const {
    absl::MutexLock lock(&mu_);
    return cancelled_;
  }

 private:
  mutable absl::Mutex mu_;
  bool cancelled_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<grpc::ClientContext*> contexts_ ABSL_GUARDED_BY(mu_);
};

}  // namespace pdserve

#endif  // PDSERVE_ROUTER_DOWNSTREAM_CALLS_H_
