#include "router/bounded_executor.h"

#include <algorithm>
#include <utility>

namespace pdserve {

BoundedExecutor::BoundedExecutor(int num_threads, int max_queued)
    : num_threads_(std::max(1, num_threads)),
      max_queued_(std::max(0, max_queued)) {
  threads_.reserve(num_threads_);
  for (int i = 0; i < num_threads_; ++i) {
    threads_.emplace_back([this] { WorkerLoop(); });
  }
}

BoundedExecutor::~BoundedExecutor() {
  Stop();
  for (std::thread& t : threads_) t.join();
}

std::optional<BoundedExecutor::Ticket> BoundedExecutor::Submit(
    absl::AnyInvocable<void()> run, absl::AnyInvocable<void()> drop) {
  absl::MutexLock lock(&mu_);
  if (stopping_) return std::nullopt;
  // Idle threads take queued tasks at once, so they add to the room.
  const int idle = num_threads_ - running_;
  if (static_cast<int>(queue_.size()) >= max_queued_ + std::max(0, idle)) {
    return std::nullopt;
  }
  const Ticket ticket = next_ticket_++;
  queue_.push_back(Task{ticket, std::move(run), std::move(drop)});
  return ticket;
}

bool BoundedExecutor::Remove(Ticket ticket) {
  absl::MutexLock lock(&mu_);
  auto it = std::find_if(queue_.begin(), queue_.end(),
                         [&](const Task& t) { return t.ticket == ticket; });
  if (it == queue_.end()) return false;
  queue_.erase(it);
  return true;
}

void BoundedExecutor::Stop() {
  std::deque<Task> dropped;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    dropped.swap(queue_);
  }
  for (Task& task : dropped) {
    if (task.drop) task.drop();
  }
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](int* running) { return *running == 0; }, &running_));
}

int BoundedExecutor::running() const {
  absl::MutexLock lock(&mu_);
  return running_;
}

int BoundedExecutor::queued() const {
  absl::MutexLock lock(&mu_);
  return static_cast<int>(queue_.size());
}

void BoundedExecutor::WorkerLoop() {
  for (;;) {
    Task task;
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](BoundedExecutor* self) ABSL_NO_THREAD_SAFETY_ANALYSIS {
            return self->stopping_ || !self->queue_.empty();
          },
          this));
      if (queue_.empty()) return;  // Stopping.
      task = std::move(queue_.front());
      queue_.pop_front();
      ++running_;
    }
    task.run();
    task = Task{};  // Release what the task holds before counting it done.
    absl::MutexLock lock(&mu_);
    --running_;
  }
}

}  // namespace pdserve
