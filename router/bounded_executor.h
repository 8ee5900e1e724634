// BoundedExecutor: a fixed pool of threads running tasks from a bounded
// queue — the router's admission control. At most `num_threads` tasks run at
// once and at most `max_queued` wait; a task that would exceed both is
// refused at once, so an overloaded router answers RESOURCE_EXHAUSTED
// instead of growing a backlog.
//
// Thread-safety: every method may be called from any thread. Tasks may
// block (they are the router's orchestration threads), but a task must not
// wait for another task of the same executor.
#ifndef PDSERVE_ROUTER_BOUNDED_EXECUTOR_H_
#define PDSERVE_ROUTER_BOUNDED_EXECUTOR_H_

#include <cstdint>
#include <deque>
#include <optional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/functional/any_invocable.h"
#include "absl/synchronization/mutex.h"

namespace pdserve {

class BoundedExecutor {
 public:
  // Identifies a submitted task, for Remove().
  using Ticket = uint64_t;

  // Starts `num_threads` (>= 1) threads; `max_queued` >= 0.
  BoundedExecutor(int num_threads, int max_queued);
  // Stop(), then joins the threads.
  ~BoundedExecutor();

  BoundedExecutor(const BoundedExecutor&) = delete;
  BoundedExecutor& operator=(const BoundedExecutor&) = delete;

  // Queues `run` to run on a pool thread. When the task will never run
  // (Stop() comes first) `drop` is called instead, on the stopping thread.
  // Returns nullopt, calling neither, when every thread is busy and
  // max_queued tasks already wait, or after Stop().
  std::optional<Ticket> Submit(absl::AnyInvocable<void()> run,
                               absl::AnyInvocable<void()> drop);

  // Takes a task out of the queue before it starts; true when it did (then
  // neither function is called). False when it already started or ended.
  bool Remove(Ticket ticket);

  // Refuses new tasks, calls `drop` of every queued one, and waits for the
  // running ones to return. Idempotent.
  void Stop();

  // Tasks running now / waiting now.
  int running() const;
  int queued() const;

 private:
  struct Task {
    Ticket ticket;
    absl::AnyInvocable<void()> run;
    absl::AnyInvocable<void()> drop;
  };

  void WorkerLoop();

  const int num_threads_;
  const int max_queued_;
  mutable absl::Mutex mu_;
  std::deque<Task> queue_ ABSL_GUARDED_BY(mu_);
  int running_ ABSL_GUARDED_BY(mu_) = 0;
  Ticket next_ticket_ ABSL_GUARDED_BY(mu_) = 1;
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;  // Set in the constructor only.
};

}  // namespace pdserve

#endif  // PDSERVE_ROUTER_BOUNDED_EXECUTOR_H_
