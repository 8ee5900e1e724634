#include "engine/engine_loop.h"

#include <time.h>

#include <algorithm>
#include <optional>
#include <utility>

#include "common/log.h"
#include "common/process.h"
#include "common/status_macros.h"

namespace pdserve {
namespace {

// The calling thread's CPU time so far.
absl::Duration ThreadCpuTime() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return absl::DurationFromTimespec(ts);
}

}  // namespace

absl::StatusOr<std::unique_ptr<EngineLoop>> EngineLoop::Start(
    const EngineConfig& config, absl::AnyInvocable<void(Generator&)> tick,
    std::function<void(const EngineStepStats&)> on_step) {
  if (config.kv_cache_bytes == 0 || config.block_size < 1) {
    return absl::InvalidArgumentError(
        "kv_cache_bytes and block_size must be positive");
  }
  if (config.num_threads < 0) {
    return absl::InvalidArgumentError("num_threads must not be negative");
  }
  if (config.tick_period <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("tick_period must be positive");
  }
  PD_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model,
                      Model::Load(config.model));
  PD_ASSIGN_OR_RETURN(
      std::unique_ptr<ModelRunner> runner,
      CreateModelRunner(model, {.backend = config.backend,
                                .num_kv_blocks = config.num_kv_blocks,
                                .kv_cache_bytes = config.kv_cache_bytes,
                                .block_size = config.block_size,
                                .num_threads = config.num_threads,
                                .bf16_activations = config.bf16_activations,
                                .int8_weights = config.int8_weights}));
  Options options;
  options.generator = {.max_batch_tokens = config.max_batch_tokens,
                       .max_running = config.max_running,
                       .enable_prefix_caching = config.enable_prefix_caching,
                       .kv_canary = config.kv_canary};
  options.tick_period = config.tick_period;
  options.on_step = std::move(on_step);
  return Create(std::move(runner), options, std::move(tick));
}

absl::StatusOr<std::unique_ptr<EngineLoop>> EngineLoop::Create(
    std::unique_ptr<ModelRunner> runner, const Options& options,
    absl::AnyInvocable<void(Generator&)> tick) {
  auto generator = Generator::Create(runner.get(), options.generator);
  if (!generator.ok()) return generator.status();
  return std::unique_ptr<EngineLoop>(new EngineLoop(
      std::move(runner), *std::move(generator), options, std::move(tick)));
}

EngineLoop::EngineLoop(std::unique_ptr<ModelRunner> runner,
                       std::unique_ptr<Generator> generator,
                       const Options& options,
                       absl::AnyInvocable<void(Generator&)> tick)
    : runner_(std::move(runner)),
      generator_(std::move(generator)),
      options_(options),
      tick_(std::move(tick)) {
  generator_->set_record_kv_events(true);
  PublishLoad();
  thread_ = std::thread([this] { Run(); });
}

EngineLoop::~EngineLoop() {
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
  }
  thread_.join();
  for (auto& [id, sink] : sinks_) {
    sink(GenerationEvent{
        .id = id, .has_token = false, .finish = FinishReason::kCancelled});
  }
}

absl::StatusOr<std::span<std::byte>> EngineLoop::KvMemoryForTransport(
    bool takes_host_memory, bool takes_device_memory, bool* staged) {
  *staged = false;
  if (runner_->kv_memory_kind() == KvMemoryKind::kHost) {
    if (!takes_host_memory) {
      return absl::FailedPreconditionError(
          "the transport moves device memory only, and this backend's KV "
          "pool is in host memory (run the cuda backend, or a host-memory "
          "transport)");
    }
    return runner_->kv_memory();
  }
  if (takes_device_memory) return runner_->kv_memory();
  *staged = true;
  return runner_->KvHostStaging();
}

void EngineLoop::Post(Command command) {
  absl::MutexLock lock(&mu_);
  commands_.push_back(std::move(command));
}

void EngineLoop::Subscribe(RequestId id, EventSink sink) {
  sinks_[id] = std::move(sink);
}

void EngineLoop::Unsubscribe(RequestId id) { sinks_.erase(id); }

EngineLoad EngineLoop::load() const {
  absl::MutexLock lock(&mu_);
  return load_;
}

void EngineLoop::PublishLoad() {
  const KvBlockPool& pool = generator_->block_pool();
  EngineLoad load{
      .total_blocks = pool.num_blocks(),
      .free_blocks = pool.num_free(),
      .running = generator_->num_running(),
      .waiting = generator_->num_waiting(),
      .reserved = generator_->num_reserved(),
      .pending_prompt_tokens = generator_->num_pending_prompt_tokens(),
      .computed_prompt_tokens = generator_->computed_prompt_tokens(),
      .prefix_cached_tokens = generator_->prefix_cached_tokens(),
      .kv_canary_violations = generator_->kv_canary_violations()};
  generator_->TakeKvCacheEvents(event_scratch_);
  kv_events_.Append(event_scratch_);
  event_scratch_.clear();
  absl::MutexLock lock(&mu_);
  load_ = load;
}

void EngineLoop::Dispatch(const GenerationEvent& event) {
  auto it = sinks_.find(event.id);
  if (it == sinks_.end()) return;
  if (it->second(event)) sinks_.erase(it);
}

void EngineLoop::Run() {
  NameThisThread("pd-engine");
  std::vector<Command> commands;
  std::vector<GenerationEvent> events;
  absl::Time next_tick = absl::Now();
  // When the last step ended, while the engine still had work after it.
  std::optional<absl::Time> busy_since_step;
  while (true) {
    {
      absl::MutexLock lock(&mu_);
      // Sleep only when there is nothing to step.
      if (!generator_->HasWork()) {
        auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
          return stopping_ || !commands_.empty();
        };
        mu_.AwaitWithDeadline(absl::Condition(&ready), next_tick);
      }
      if (stopping_) return;
      commands.swap(commands_);
    }
    for (Command& command : commands) command(*generator_);
    commands.clear();
    if (absl::Now() >= next_tick) {
      if (tick_) tick_(*generator_);
      next_tick = absl::Now() + options_.tick_period;
    }
    if (generator_->HasWork()) {
      events.clear();
      const int32_t running = generator_->num_running();
      const int64_t computed = generator_->computed_prompt_tokens();
      const absl::Time step_start = absl::Now();
      const absl::Duration cpu_start = ThreadCpuTime();
      const absl::Status s = generator_->Step(events);
      const absl::Duration cpu = ThreadCpuTime() - cpu_start;
      const absl::Time step_end = absl::Now();
      if (options_.on_step) {
        EngineStepStats stats{
            .duration = step_end - step_start,
            .cpu = cpu,
            .running = running,
            .prompt_tokens = generator_->computed_prompt_tokens() - computed,
            .gap = busy_since_step ? std::optional(step_start - *busy_since_step)
                                   : std::nullopt};
        for (const GenerationEvent& e : events) {
          stats.generated_tokens += e.has_token ? 1 : 0;
        }
        stats.running = std::max({running, generator_->num_running(),
                                  stats.generated_tokens});
        options_.on_step(stats);
      }
      if (!s.ok()) {
        // A backend failure: nothing in flight can be trusted; end it all.
        PD_LOG(ERROR) << "engine step failed, cancelling every request: " << s;
        for (auto& [id, sink] : sinks_) generator_->Cancel(id);
      }
      busy_since_step.reset();
      if (generator_->HasWork()) busy_since_step = step_end;
      // The load first: whoever has seen one of the step's tokens then
      // reads a load report no older than the step (a client that cancels
      // on its first token and asks for the load does not find the one
      // from before its request started).
      PublishLoad();
      for (const GenerationEvent& e : events) Dispatch(e);
    } else {
      PublishLoad();
    }
  }
}

}  // namespace pdserve
