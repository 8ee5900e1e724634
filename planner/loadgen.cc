#include "planner/loadgen.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/synchronization/mutex.h"
#include "planner/load_targets.h"

namespace pdserve::planner {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(SteadyTime origin, SteadyTime t) {
  return std::chrono::duration<double>(t - origin).count();
}

// What the sender, the streams' `done` callbacks and the progress line
// share. Owned by a shared_ptr: a callback may still be leaving the mutex
// when RunLoad, woken by it, returns.
struct RunState {
  absl::Mutex mu;
  int64_t in_flight ABSL_GUARDED_BY(mu) = 0;
  bool stop_progress ABSL_GUARDED_BY(mu) = false;
  std::atomic<int64_t> sent{0}, completed{0}, failed{0};
};

// `*value < limit`, for Mutex::Await.
struct Below {
  const int64_t* value;
  int64_t limit;
  bool operator()() const { return *value < limit; }
};

// The progress line on stderr, about once a second (see LoadOptions).
void ShowProgress(RunState& state, const std::string& label,
                  SteadyTime origin) {
  const bool tty = ::isatty(STDERR_FILENO) == 1;
  const std::string prefix = label.empty() ? "" : absl::StrCat(label, ": ");
  int64_t last_done = 0;
  SteadyTime last = origin;
  int64_t ticks = 0;
  // The rate: completions over the last second, or over the whole run in
  // the final line.
  auto line = [&](SteadyTime now, bool final) {
    const int64_t done = state.completed.load() + state.failed.load();
    const double dt = SecondsSince(final ? origin : last, now);
    const double rate = dt > 0 ? (done - (final ? 0 : last_done)) / dt : 0;
    last_done = done;
    last = now;
    int64_t in_flight;
    {
      absl::MutexLock lock(&state.mu);
      in_flight = state.in_flight;
    }
    return absl::StrFormat(
        "%ssent %d, completed %d, failed %d, in flight %d, %.1f s, %.1f "
        "req/s%s",
        prefix, state.sent.load(), state.completed.load(), state.failed.load(),
        in_flight, SecondsSince(origin, now), rate, final ? " overall" : "");
  };
  absl::MutexLock lock(&state.mu);
  while (true) {
    const bool stopped = state.mu.AwaitWithTimeout(
        absl::Condition(
            +[](bool* stop) { return *stop; }, &state.stop_progress),
        absl::Seconds(1));
    state.mu.Unlock();
    const std::string text = line(Clock::now(), stopped);
    if (tty) {
      std::fprintf(stderr, "\r%s\x1b[K%s", text.c_str(), stopped ? "\n" : "");
    } else if (stopped || ++ticks % 10 == 0) {
      std::fprintf(stderr, "%s\n", text.c_str());
    }
    std::fflush(stderr);
    state.mu.Lock();
    if (stopped) return;
  }
}

}  // namespace

std::vector<std::string> LoadTargetNames() { return {"grpc", "openai"}; }

absl::StatusOr<std::unique_ptr<LoadTarget>> MakeLoadTarget(
    std::string_view name, const TargetOptions& options) {
  if (options.request_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("the request timeout must be positive");
  }
  if (name == "grpc") return MakeGrpcTarget(options);
  if (name == "openai") return MakeOpenAiTarget(options);
  return absl::InvalidArgumentError(
      absl::StrCat("unknown target '", std::string(name), "'; the targets are ",
                   absl::StrJoin(LoadTargetNames(), ", ")));
}

absl::StatusOr<LoadResult> RunLoad(const Workload& workload, LoadTarget& target,
                                   const LoadOptions& options) {
  if (options.concurrency < 0) {
    return absl::InvalidArgumentError(
        "concurrency must be 0 (open loop) or more");
  }
  if (options.max_requests < 0) {
    return absl::InvalidArgumentError("max_requests must be 0 (all) or more");
  }
  if (!(options.duration_s > 0)) {
    return absl::InvalidArgumentError("the duration must be positive");
  }
  int64_t n = static_cast<int64_t>(workload.requests.size());
  if (options.max_requests > 0) n = std::min(n, options.max_requests);
  const bool closed = options.concurrency > 0;

  LoadResult result;
  result.records.resize(n);
  auto state = std::make_shared<RunState>();
  const SteadyTime origin = Clock::now();
  std::thread progress;
  if (options.progress) {
    progress = std::thread([state, label = options.label, origin] {
      ShowProgress(*state, label, origin);
    });
  }

  int64_t sent = 0;
  for (int64_t i = 0; i < n; ++i) {
    const WorkloadRequest& request = workload.requests[i];
    if (!closed && request.arrival_s >= options.duration_s) break;
    // Made before the wait, so that the send is on time.
    TargetRequest target_request{PromptTokens(workload, request),
                                 request.output_tokens, origin};
    if (closed) {
      absl::MutexLock lock(&state->mu);
      const Below below{&state->in_flight, options.concurrency};
      state->mu.Await(absl::Condition(&below, &Below::operator()));
    } else {
      std::this_thread::sleep_until(
          origin + std::chrono::duration_cast<Clock::duration>(
                       std::chrono::duration<double>(request.arrival_s)));
    }
    const SteadyTime now = Clock::now();
    const double send_s = SecondsSince(origin, now);
    if (send_s >= options.duration_s) break;
    if (!closed) {
      result.max_send_lateness_s =
          std::max(result.max_send_lateness_s, send_s - request.arrival_s);
    }
    RequestRecord& record = result.records[i];
    record.index = i;
    record.send_s = send_s;
    record.input_tokens = request.input_tokens;
    record.token_s.reserve(request.output_tokens);
    {
      absl::MutexLock lock(&state->mu);
      ++state->in_flight;
    }
    state->sent.fetch_add(1);
    ++sent;
    target.Start(std::move(target_request), &record, [state, &record] {
      (record.ok() ? state->completed : state->failed).fetch_add(1);
      absl::MutexLock lock(&state->mu);
      --state->in_flight;
    });
  }
  {
    absl::MutexLock lock(&state->mu);
    state->mu.Await(absl::Condition(
        +[](int64_t* in_flight) { return *in_flight == 0; },
        &state->in_flight));
    state->stop_progress = true;
  }
  result.wall_s = SecondsSince(origin, Clock::now());
  if (progress.joinable()) progress.join();
  result.records.resize(sent);
  return result;
}

}  // namespace pdserve::planner
