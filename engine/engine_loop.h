// EngineLoop: the one thread that owns a Generator, and through it the
// model runner and its KV cache (STYLE.md habit 4). RPC handlers never touch
// the Generator: they Post() commands, which the loop runs between steps,
// and receive their request's events through a sink the loop calls.
//
// Thread-safety: Post() and load() from any thread. Commands, sinks and the
// tick run on the loop thread and must not block.
#ifndef PDSERVE_ENGINE_ENGINE_LOOP_H_
#define PDSERVE_ENGINE_ENGINE_LOOP_H_

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/functional/any_invocable.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "engine/generator.h"
#include "engine/kv_event_log.h"
#include "engine/model_runner.h"

namespace pdserve {

// A consistent snapshot of the loop's load, refreshed after every command
// batch and step.
struct EngineLoad {
  int32_t total_blocks = 0;
  int32_t free_blocks = 0;
  int32_t running = 0;
  int32_t waiting = 0;
  int32_t reserved = 0;
  int64_t pending_prompt_tokens = 0;
  // Since the loop started: prompt tokens run through a forward pass, and
  // those taken from the prefix cache instead.
  int64_t computed_prompt_tokens = 0;
  int64_t prefix_cached_tokens = 0;
  // Free KV blocks found written (EngineConfig::kv_canary).
  int64_t kv_canary_violations = 0;
};

// What one engine step did, for metrics (EngineLoop::Options::on_step).
struct EngineStepStats {
  // Generator::Step's wall time.
  absl::Duration duration;
  // The loop thread's CPU time inside Generator::Step
  // (CLOCK_THREAD_CPUTIME_ID): with one compute thread (--num_threads=1)
  // the step's whole CPU, with more the loop thread's part only. Under a
  // CPU share the wall time holds the quota's waits too; this does not.
  absl::Duration cpu;
  // Sequences in the step's batch: the most of those running before it,
  // after it, and those it sampled a token for (a prefill admitted and
  // finished within one step is counted by its token).
  int32_t running = 0;
  // Tokens the step generated (token events).
  int32_t generated_tokens = 0;
  // Prompt tokens the step ran through the forward pass.
  int64_t prompt_tokens = 0;
  // Wall time from the end of the previous step to this one's start when
  // the engine had work all along (back to back): the loop's own work
  // between steps (handing the events to their sinks, commands, load
  // reports) and any time the thread waited for a CPU. None after the loop
  // slept for lack of work.
  std::optional<absl::Duration> gap;
};

// What a worker's engine is built from; pd-prefill and pd-decode share it.
struct EngineConfig {
  // Model directory (Hugging Face layout) or a builtin model name.
  // Default: "builtin:tiny".
  std::string model = "builtin:tiny";
  // ModelRunner backend. Default: "cpu".
  std::string backend = "cpu";
  // Memory of the KV pool. Default: 256 MiB.
  size_t kv_cache_bytes = size_t{256} << 20;
  // Blocks of the KV pool; 0 sizes it from kv_cache_bytes. Default: 0.
  int32_t num_kv_blocks = 0;
  // Tokens per KV block; prefill and decode workers must agree. Default: 16.
  int32_t block_size = 16;
  // Engine threads for the cpu backend; 0 uses every core. Default: 0.
  int32_t num_threads = 0;
  // See ModelRunnerOptions. Default: false.
  bool bf16_activations = false;
  // See ModelRunnerOptions. Default: false.
  bool int8_weights = false;
  // Token budget of one engine step; longer prompts are prefilled in
  // chunks. Default: 512.
  int32_t max_batch_tokens = 512;
  // Most sequences in the running batch. Default: 64.
  int32_t max_running = 64;
  // Keep full prompt blocks for reuse by later prompts. Default: true.
  bool enable_prefix_caching = true;
  // Check that nothing writes into free KV blocks (engine/kv_canary.h).
  // Default: false.
  bool kv_canary = false;
  // See EngineLoop::Options. Default: 50 ms.
  absl::Duration tick_period = absl::Milliseconds(50);
};

class EngineLoop {
 public:
  // Runs on the loop thread with the Generator.
  using Command = absl::AnyInvocable<void(Generator&)>;
  // Receives one request's events in order; returns true once it has seen
  // the last one it wants (the loop then drops it).
  using EventSink = absl::AnyInvocable<bool(const GenerationEvent&)>;

  struct Options {
    GeneratorOptions generator;
    // Period of the tick when idle, and the longest gap between ticks.
    // Default: 50 ms.
    absl::Duration tick_period = absl::Milliseconds(50);
    // Runs on the loop thread after every step; must be cheap (record into
    // metrics and return). Default: none.
    std::function<void(const EngineStepStats&)> on_step;
  };

  // Loads config.model, creates its runner and Create()s a loop over it.
  // INVALID_ARGUMENT for a config out of range; the model's and runner's
  // errors as they come.
  static absl::StatusOr<std::unique_ptr<EngineLoop>> Start(
      const EngineConfig& config,
      absl::AnyInvocable<void(Generator&)> tick = nullptr,
      std::function<void(const EngineStepStats&)> on_step = nullptr);

  // Starts the loop thread. `tick`, when set, runs on it at least every
  // tick_period (for expiring reservations and the like).
  static absl::StatusOr<std::unique_ptr<EngineLoop>> Create(
      std::unique_ptr<ModelRunner> runner, const Options& options,
      absl::AnyInvocable<void(Generator&)> tick = nullptr);

  // Stops the thread. Commands not run yet are dropped; sinks still
  // subscribed receive a kCancelled event first.
  ~EngineLoop();

  // Queues `command` to run on the loop thread before its next step.
  void Post(Command command);

  // Loop thread only (inside a command): routes `id`'s events to `sink`.
  void Subscribe(RequestId id, EventSink sink);
  // Loop thread only: drops `id`'s sink without calling it again.
  void Unsubscribe(RequestId id);

  // The load as of the loop's last pass (its step, before the step's events
  // reach their sinks: a sink's event is never newer than load()), or of
  // the last PublishLoad().
  EngineLoad load() const;
  // Loop thread only (inside a command): publishes the load now, so that a
  // command that changed it (a reservation made or released) answers its
  // caller only once load() shows the change. The loop also publishes once
  // every pass.
  void PublishLoad();

  // The pool's prefix-cache events, published with the load: what a
  // worker's LoadReport carries to the router's KV index.
  const KvEventLog& kv_events() const { return kv_events_; }

  // Fixed at creation; safe from any thread.
  const Model& model() const { return runner_->model(); }
  const KvBlockLayout& kv_layout() const { return runner_->kv_layout(); }
  int32_t num_kv_blocks() const { return runner_->num_kv_blocks(); }
  // The KV pool's memory, for registering with a transport. Only the loop
  // thread's forward pass writes it; readers must synchronize through the
  // loop (e.g. read blocks only between the layer report and their release).
  std::span<std::byte> kv_memory() const { return runner_->kv_memory(); }

  // The memory a KV transport registers to move the pool: kv_memory() when
  // the transport takes memory where the pool lives; pinned host memory
  // laid out like it (ModelRunner::KvHostStaging) when the pool is in
  // device memory and the transport takes host memory only — then
  // `*staged` is set and the bytes pass through CopyKv{To,From}HostStaging.
  // FAILED_PRECONDITION for a transport of device memory only over a host
  // pool. Call before serving (not thread-safe against itself).
  absl::StatusOr<std::span<std::byte>> KvMemoryForTransport(
      bool takes_host_memory, bool takes_device_memory, bool* staged);
  // ModelRunner::CopyKvToHostStaging: any thread, for ranges that no step
  // writes meanwhile (a request's KV between its layer report and its
  // release).
  absl::Status CopyKvToHostStaging(std::span<const KvByteRange> ranges) {
    return runner_->CopyKvToHostStaging(ranges);
  }
  // ModelRunner::CopyKvFromHostStaging: loop thread only (inside a
  // command), for blocks no running sequence reads yet.
  absl::Status CopyKvFromHostStaging(std::span<const KvByteRange> ranges) {
    return runner_->CopyKvFromHostStaging(ranges);
  }

 private:
  EngineLoop(std::unique_ptr<ModelRunner> runner,
             std::unique_ptr<Generator> generator, const Options& options,
             absl::AnyInvocable<void(Generator&)> tick);
  void Run();
  void Dispatch(const GenerationEvent& event);

  const std::unique_ptr<ModelRunner> runner_;
  const std::unique_ptr<Generator> generator_;  // Loop thread only.
  const Options options_;
  absl::AnyInvocable<void(Generator&)> tick_;        // Loop thread only.
  absl::flat_hash_map<RequestId, EventSink> sinks_;  // Loop thread only.

  mutable absl::Mutex mu_;
  std::vector<Command> commands_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  EngineLoad load_ ABSL_GUARDED_BY(mu_);
  KvEventLog kv_events_;                      // Thread-safe.
  std::vector<KvCacheEvent> event_scratch_;  // Loop thread only.

  std::thread thread_;
};

}  // namespace pdserve

#endif  // PDSERVE_ENGINE_ENGINE_LOOP_H_
