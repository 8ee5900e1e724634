#include "planner/simulator.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <memory>
#include <queue>
#include <utility>

#include "absl/container/flat_hash_set.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "engine/kv_cache.h"
#include "engine/kv_layout.h"
#include "planner/sim/simulated_generator.h"

namespace pdserve::planner {

std::string ClusterShape::Name() const { return absl::StrCat(prefill, "P", decode, "D"); }

namespace {

// The hash chain of the prompt's full KV blocks of `block_size` tokens, as
// PromptBlockHashes would give for its tokens: entry j stands for the
// content of tokens [0, (j + 1) * block_size), which the workload's block
// ids up to the one holding token (j + 1) * block_size - 1 determine. Ids
// the request lacks make the rest of its prompt its own.
std::vector<uint64_t> KvBlockHashes(const WorkloadRequest& r, int64_t index,
                                    int32_t workload_block_tokens, int32_t block_size) {
  const int64_t full = r.input_tokens / block_size;
  std::vector<uint64_t> out(full);
  uint64_t chain = 0;
  int64_t chained = 0;  // Workload blocks in `chain`.
  for (int64_t j = 0; j < full; ++j) {
    const int64_t last_token = (j + 1) * block_size - 1;
    for (const int64_t w = last_token / workload_block_tokens; chained <= w; ++chained) {
      const uint64_t id = chained < static_cast<int64_t>(r.block_ids.size())
                              ? Mix64(r.block_ids[chained] ^ 0x2545f4914f6cdd1dull)
                              : Mix64(Mix64(static_cast<uint64_t>(index) + 0x9e3779b97f4a7c15ull) ^
                                      static_cast<uint64_t>(chained));
      chain = Mix64(chain ^ id);
    }
    out[j] = Mix64(chain + static_cast<uint64_t>(j) * 0x9e3779b97f4a7c15ull);
  }
  return out;
}

enum class EventKind : uint8_t {
  kPoll,         // The router polls every worker's load report.
  kSend,         // A request reaches the router.
  kStepEnd,      // A worker's step completes.
  kPushDone,     // A prefill worker's KV push of a request has landed.
  kDecodeStart,  // A prefilled request joins its decode worker's queue.
  kRequestEnd,   // A request's stream ended at the client.
  kStepStart,    // A worker begins a step (after every other event at the time).
};

struct Event {
  double time = 0;
  // Among events at the same time: lower phase first, then in scheduling
  // order. Step starts come last, so that whatever arrives at a step's end
  // joins the next step, as commands posted to an engine loop do.
  int phase = 0;
  uint64_t seq = 0;
  EventKind kind = EventKind::kPoll;
  int32_t worker = -1;
  int64_t request = -1;
};

struct Later {
  bool operator()(const Event& a, const Event& b) const {
    if (a.time != b.time) return a.time > b.time;
    if (a.phase != b.phase) return a.phase > b.phase;
    return a.seq > b.seq;
  }
};

struct Worker {
  Worker(int32_t index, bool is_prefill, std::string id, int32_t num_blocks, const Profile& profile)
      : index(index),
        is_prefill(is_prefill),
        id(std::move(id)),
        generator(num_blocks, profile.block_size, profile.max_batch_tokens, profile.max_running) {}

  // Into ClusterSimulation::all_.
  const int32_t index;
  const bool is_prefill;
  const std::string id;
  SimulatedGenerator generator;
  bool stepping = false;
  bool start_scheduled = false;
  double step_start_s = 0;
  // The router's view: the last load report and what it sent since
  // (WorkerRegistry's report and dispatched_* counters), and the prefix
  // blocks the KV index holds for it.
  WorkerLoad load;
  absl::flat_hash_set<uint64_t> indexed_hashes;
  // Prefill workers: when the KV link is free of earlier pushes.
  double link_free_s = 0;
  // Engine time its serving threads took from its CPU share (Profile's
  // *_cpu_per_* costs) and no step has paid yet, as of serving_debt_at_s.
  // While the engine does not step, the threads have the share to
  // themselves and the debt is paid off in real time; the next step takes
  // what is left.
  double serving_debt_s = 0;
  double serving_debt_at_s = 0;
  // When its last step ended (-1: none yet); a step that starts then
  // follows it without idling.
  double last_step_end_s = -1;
};

struct RequestState {
  std::vector<uint64_t> hashes;
  int32_t decode = -1;
  int32_t prefill = -1;
  int64_t committed_blocks = 0;
  // Prompt tokens the decode worker's reservation shares from its prefix
  // cache (Landing.cached_tokens): the push skips them.
  int32_t landing_cached_tokens = 0;
  // A reservation on the decode worker not yet taken by AddPrefilled.
  bool reserved = false;
  bool ended = false;
};

class ClusterSimulation {
 public:
  ClusterSimulation(const Profile& profile, const ClusterShape& shape, const Workload& workload,
                    const SimulationOptions& options, std::unique_ptr<RoutingPolicy> policy,
                    TransferCost transfer)
      : profile_(profile),
        workload_(workload),
        options_(options),
        policy_(std::move(policy)),
        transfer_(std::move(transfer)),
        requests_(workload.requests.size()),
        records_(workload.requests.size()) {
    for (int32_t i = 0; i < shape.decode; ++i) {
      decode_.push_back(std::make_unique<Worker>(i, false, absl::StrCat("decode-", i),
                                                 static_cast<int32_t>(profile.decode_kv_blocks),
                                                 profile));
    }
    for (int32_t i = 0; i < shape.prefill; ++i) {
      prefill_.push_back(
          std::make_unique<Worker>(shape.decode + i, true, absl::StrCat("prefill-", i),
                                   static_cast<int32_t>(profile.prefill_kv_blocks), profile));
    }
    for (const auto& w : decode_) all_.push_back(w.get());
    for (const auto& w : prefill_) all_.push_back(w.get());
    committed_.assign(decode_.size(), 0);
  }

  absl::StatusOr<Simulation> Run() {
    const int64_t n = static_cast<int64_t>(workload_.requests.size());
    Schedule(0, EventKind::kPoll);
    if (options_.concurrency > 0) {
      while (next_send_ < std::min<int64_t>(n, options_.concurrency)) {
        Schedule(0, EventKind::kSend, -1, next_send_++);
      }
    } else {
      for (int64_t i = 0; i < n; ++i) {
        Schedule(workload_.requests[i].arrival_s, EventKind::kSend, -1, i);
      }
      next_send_ = n;
    }
    while (!events_.empty() && error_.ok()) {
      const Event e = events_.top();
      events_.pop();
      now_ = e.time;
      switch (e.kind) {
        case EventKind::kPoll:
          Poll();
          break;
        case EventKind::kSend:
          Send(e.request);
          break;
        case EventKind::kStepStart:
          StepStart(*all_[e.worker]);
          break;
        case EventKind::kStepEnd:
          StepEnd(*all_[e.worker]);
          break;
        case EventKind::kPushDone:
          PushDone(e.request);
          break;
        case EventKind::kDecodeStart:
          DecodeStart(e.request);
          break;
        case EventKind::kRequestEnd:
          RequestEnd(e.request);
          break;
      }
    }
    PD_RETURN_IF_ERROR(error_);
    result_.records = std::move(records_);
    return std::move(result_);
  }

 private:
  void Schedule(double time, EventKind kind, int32_t worker = -1, int64_t request = -1) {
    events_.push({.time = time,
                  .phase = kind == EventKind::kStepStart ? 1 : 0,
                  .seq = next_seq_++,
                  .kind = kind,
                  .worker = worker,
                  .request = request});
  }

  const WorkloadRequest& Spec(int64_t r) const { return workload_.requests[r]; }

  // --- The router's poll (WorkerRegistry::StartPoll / OnPollDone). ---

  void Poll() {
    for (Worker* w : all_) {
      SimulatedGenerator& g = w->generator;
      w->load.free_blocks = g.pool().num_free();
      w->load.running = g.num_running();
      w->load.waiting = g.num_waiting();
      w->load.pending_prompt_tokens = g.num_pending_prompt_tokens();
      w->load.dispatched_tokens = w->load.dispatched_blocks = w->load.dispatched_requests = 0;
      kv_events_.clear();
      g.pool().TakeEvents(kv_events_);
      for (const KvCacheEvent& ev : kv_events_) {
        if (ev.kind == KvCacheEvent::Kind::kStored) {
          w->indexed_hashes.insert(ev.hash);
        } else {
          w->indexed_hashes.erase(ev.hash);
        }
      }
    }
    if (ended_ == static_cast<int64_t>(records_.size())) return;
    ++polls_;
    if (sent_ == ended_ && !events_.empty()) {
      // Idle until the next send: the polls before it would all report
      // this; skip to the last one.
      polls_ = std::max(
          polls_, static_cast<int64_t>(std::floor(events_.top().time / profile_.poll_interval_s)));
    }
    Schedule(static_cast<double>(polls_) * profile_.poll_interval_s, EventKind::kPoll);
  }

  // KvIndex::LeadingBlocks.
  static int32_t LeadingBlocks(const Worker& w, std::span<const uint64_t> hashes) {
    int32_t n = 0;
    while (n < static_cast<int32_t>(hashes.size()) && w.indexed_hashes.contains(hashes[n])) ++n;
    return n;
  }

  // WorkerRegistry::NoteDispatched.
  void NoteDispatched(Worker& w, int64_t tokens) {
    w.load.dispatched_tokens += tokens;
    ++w.load.dispatched_requests;
    if (!w.is_prefill) w.load.dispatched_blocks += BlocksForTokens(tokens, profile_.block_size);
  }

  // --- Admission (RequestOrchestrator::Admit, PlaceLocked, AdmissionLoop). ---

  void Send(int64_t r) {
    RequestRecord& rec = records_[r];
    const WorkloadRequest& spec = Spec(r);
    ++sent_;
    rec.index = r;
    rec.send_s = now_;
    rec.input_tokens = spec.input_tokens;
    rec.token_s.reserve(spec.output_tokens);
    const int64_t total = static_cast<int64_t>(spec.input_tokens) + spec.output_tokens;
    if (profile_.max_context > 0 && total > profile_.max_context) {
      return Fail(r,
                  absl::InvalidArgumentError(absl::StrCat(
                      "prompt (", spec.input_tokens, " tokens) + max_tokens (", spec.output_tokens,
                      ") exceeds the model's context of ", profile_.max_context, " tokens")));
    }
    requests_[r].hashes = KvBlockHashes(spec, r, workload_.block_tokens, profile_.block_size);
    // A new request places at once only when none waits before it.
    if (queue_.empty()) {
      absl::Status why;
      if (const int32_t d = Place(r, &why); d >= 0) return Start(r);
      if (!why.ok()) return Fail(r, why);
    }
    if (static_cast<int64_t>(queue_.size()) >= options_.max_queued) {
      return Fail(r, absl::ResourceExhaustedError(absl::StrCat(
                         "the decode workers have no KV room for the request and ", queue_.size(),
                         " requests already wait for it (the router's max_queued); "
                         "retry later")));
    }
    queue_.push_back(r);
  }

  // Places request `r` on a decode worker with room in the ledger and
  // commits its blocks there; -1 when it must wait (why OK) or fail (why).
  int32_t Place(int64_t r, absl::Status* why) {
    const WorkloadRequest& spec = Spec(r);
    RequestState& state = requests_[r];
    const int64_t reserve_tokens = static_cast<int64_t>(spec.input_tokens) + spec.output_tokens;
    const int64_t blocks = BlocksForTokens(reserve_tokens, profile_.block_size);
    if (reserve_tokens > profile_.decode_kv_blocks * profile_.block_size) {
      *why = absl::ResourceExhaustedError(
          absl::StrCat("the request needs KV for ", reserve_tokens,
                       " tokens (prompt + max_tokens) and the largest decode worker's pool holds ",
                       profile_.decode_kv_blocks * profile_.block_size,
                       "; lower max_tokens or shorten the prompt"));
      return -1;
    }
    decode_loads_.clear();
    decode_ids_.clear();
    for (size_t d = 0; d < decode_.size(); ++d) {
      if (committed_[d] + blocks > profile_.decode_kv_blocks) continue;
      WorkerLoad load = decode_[d]->load;
      load.id = decode_[d]->id;
      load.cached_blocks = LeadingBlocks(*decode_[d], state.hashes);
      decode_loads_.push_back(std::move(load));
      decode_ids_.push_back(static_cast<int32_t>(d));
    }
    prefill_loads_.clear();
    for (const auto& p : prefill_) {
      WorkerLoad load = p->load;
      load.id = p->id;
      load.cached_blocks = LeadingBlocks(*p, state.hashes);
      prefill_loads_.push_back(std::move(load));
    }
    const RoutingChoice choice = policy_->Choose({.prompt_tokens = spec.input_tokens,
                                                  .max_tokens = spec.output_tokens,
                                                  .block_size = profile_.block_size,
                                                  .decode = decode_loads_,
                                                  .prefill = prefill_loads_});
    if (choice.decode < 0) return -1;
    state.decode = decode_ids_[choice.decode];
    state.prefill = choice.prefill;
    state.committed_blocks = blocks;
    committed_[state.decode] += blocks;
    return state.decode;
  }

  // Choice::Run: local prefill (Decode without a first token) or Reserve
  // on D, then Prefill on P.
  void Start(int64_t r) {
    const WorkloadRequest& spec = Spec(r);
    RequestState& state = requests_[r];
    Worker& d = *decode_[state.decode];
    const int64_t reserve_tokens = static_cast<int64_t>(spec.input_tokens) + spec.output_tokens;
    NoteDispatched(d, reserve_tokens);
    if (state.prefill < 0) {
      ++result_.decode_prefills;
      d.generator.Add({.id = r,
                       .prompt_tokens = spec.input_tokens,
                       .max_tokens = spec.output_tokens,
                       .block_hashes = state.hashes});
      return Kick(d);
    }
    absl::StatusOr<int32_t> cached = d.generator.Reserve(r, static_cast<int32_t>(reserve_tokens),
                                                         spec.input_tokens, state.hashes);
    if (!cached.ok()) {
      // The ledger counts every block a request can hold on D (a shared
      // prefix block twice), so a Reserve never finds the pool short.
      error_ = absl::InternalError(absl::StrCat(
          "simulated request ", r,
          ": Reserve failed although the ledger had room: ", cached.status().message()));
      return;
    }
    state.landing_cached_tokens = *cached;
    state.reserved = true;
    Worker& p = *prefill_[state.prefill];
    // The prefill engine's copy holds prompt + 1 token (max_tokens 1).
    if (BlocksForTokens(static_cast<int64_t>(spec.input_tokens) + 1, profile_.block_size) >
        profile_.prefill_kv_blocks) {
      // Every prefill worker refuses it (RESOURCE_EXHAUSTED), and the
      // router gives up after its retries.
      return Fail(
          r, absl::UnavailableError(absl::StrCat(
                 "prefill failed on every worker; last error: the request needs ",
                 BlocksForTokens(static_cast<int64_t>(spec.input_tokens) + 1, profile_.block_size),
                 " KV blocks; the pool has ", profile_.prefill_kv_blocks)));
    }
    NoteDispatched(p, spec.input_tokens);
    ChargeServing(p, profile_.prefill_cpu_per_request_s);
    p.generator.Add({.id = r,
                     .prompt_tokens = spec.input_tokens,
                     .max_tokens = 1,
                     .hold_kv = true,
                     .block_hashes = state.hashes});
    Kick(p);
  }

  // Ends request `r` now, unsuccessfully.
  void Fail(int64_t r, const absl::Status& status) {
    RequestRecord& rec = records_[r];
    rec.outcome = absl::StatusCodeToString(status.code());
    rec.error = std::string(status.message());
    rec.end_s = now_;
    Schedule(now_, EventKind::kRequestEnd, -1, r);
  }

  void RequestEnd(int64_t r) {
    RequestState& state = requests_[r];
    if (state.ended) return;
    state.ended = true;
    ++ended_;
    state.hashes = {};
    state.hashes.shrink_to_fit();
    if (state.reserved) {  // ReleaseLanding: a reservation not decoded.
      Worker& d = *decode_[state.decode];
      d.generator.ReleaseReservation(r);
      state.reserved = false;
      Kick(d);
    }
    if (state.decode >= 0) committed_[state.decode] -= state.committed_blocks;
    state.committed_blocks = 0;
    PlaceQueued();
    if (next_send_ < static_cast<int64_t>(records_.size())) {  // Closed loop.
      Schedule(now_, EventKind::kSend, -1, next_send_++);
    }
  }

  // The admission loop: strictly in order, the first that cannot be placed
  // holds back those behind it.
  void PlaceQueued() {
    while (!queue_.empty()) {
      const int64_t r = queue_.front();
      absl::Status why;
      const int32_t d = Place(r, &why);
      if (d < 0 && why.ok()) return;
      queue_.pop_front();
      if (d >= 0) {
        Start(r);
      } else {
        Fail(r, why);
      }
    }
  }

  // --- Workers. ---

  void Kick(Worker& w) {
    if (w.stepping || w.start_scheduled || !w.generator.HasWork()) return;
    w.start_scheduled = true;
    Schedule(now_, EventKind::kStepStart, w.index);
  }

  // Worker `w`'s serving threads take `seconds` of its CPU share now.
  void ChargeServing(Worker& w, double seconds) {
    if (seconds <= 0) return;
    SettleServingDebt(w);
    w.serving_debt_s += seconds;
  }

  // Brings w's serving debt to now: paid off by the time the engine has
  // been idle since it was last settled.
  void SettleServingDebt(Worker& w) {
    if (!w.stepping) {
      w.serving_debt_s = std::max(0.0, w.serving_debt_s - (now_ - w.serving_debt_at_s));
    }
    w.serving_debt_at_s = now_;
  }

  void StepStart(Worker& w) {
    w.start_scheduled = false;
    StepShape shape;
    // Nothing admitted (no blocks free): the next event that frees some
    // kicks the worker again.
    if (!w.generator.BeginStep(shape)) return;
    SettleServingDebt(w);
    const double serving = w.serving_debt_s;
    w.serving_debt_s = 0;
    w.stepping = true;
    w.step_start_s = now_;
    // The forward pass, and on a prefill worker its push: the push lane
    // sends each layer's KV while the engine computes the next (the
    // layer-wise push), so its CPU comes out of the step's share. That is
    // the engine's timed step (pdserve_*_seconds).
    double step = profile_.step.Seconds(shape.tokens, shape.sequences, shape.attention,
                                        shape.decode_attention);
    if (w.is_prefill) {
      step *= profile_.prefill_engine_scale;
      step += StepPushBytes(w) * profile_.prefill_cpu_per_kv_byte_s;
      result_.prefill_step_s += step;
    } else {
      // A prefill chunk has attention pairs; a decode batch has none.
      step *= shape.attention > 0 ? profile_.decode_engine_scale : profile_.decode_batch_scale;
      result_.decode_step_s += step;
      ++result_.decode_steps;
      result_.decode_step_sequences += shape.sequences;
    }
    // A serving decode worker also streams its tokens between steps
    // (Profile::decode_step_overhead_s); a prefill worker does not.
    const double streaming =
        w.is_prefill ? 0
                     : profile_.decode_step_overhead_s +
                           profile_.decode_sequence_overhead_s * shape.sequences;
    if (!w.is_prefill && w.last_step_end_s == now_) {
      result_.decode_gap_s += streaming + serving;
    }
    const double seconds = step + streaming + serving;
    Schedule(now_ + seconds, EventKind::kStepEnd, w.index);
  }

  void StepEnd(Worker& w) {
    SettleServingDebt(w);
    w.stepping = false;
    w.last_step_end_s = now_;
    if (w.is_prefill) PushStep(w);
    step_events_.clear();
    w.generator.EndStep(step_events_);
    // A decode worker's serving threads stream the step's tokens.
    if (!w.is_prefill) {
      ChargeServing(w, profile_.decode_cpu_per_token_s * static_cast<double>(step_events_.size()));
    }
    for (const SimEvent& ev : step_events_) {
      if (w.is_prefill) {
        // The first token: the push of the prompt ends after this step's
        // KV, which PushStep put last on the link.
        Schedule(std::max(w.link_free_s, now_) + transfer_.latency_s, EventKind::kPushDone, -1,
                 ev.id);
        continue;
      }
      double delivery = profile_.token_delivery_s;
      if (ev.generated == 1) {
        delivery = profile_.colocated_first_token_s;
      } else if (requests_[ev.id].prefill >= 0) {
        delivery = profile_.disaggregated_token_delivery_s;
      }
      Deliver(ev.id, now_ + delivery, ev.finished);
    }
    Kick(w);
  }

  // The layer-wise push of the step that just ended on prefill worker `w`:
  // its KV is written during the step and sent as written, over the
  // worker's one link, behind earlier pushes; only what the decode worker
  // does not share from its cache moves. The link finishes this step's
  // bytes no earlier than the step's end.
  void PushStep(Worker& w) {
    const double bytes = StepPushBytes(w);
    if (bytes <= 0) return;
    w.link_free_s =
        std::max(now_, std::max(w.link_free_s, w.step_start_s) + bytes / transfer_.bytes_per_s);
  }

  // The KV bytes prefill worker `w`'s current step pushes: only what the
  // decode worker does not share from its cache moves.
  double StepPushBytes(Worker& w) {
    double bytes = 0;
    for (const StepEntry& e : w.generator.batch()) {
      const int32_t from = std::max(e.reported_from, requests_[e.id].landing_cached_tokens);
      const int32_t to = e.start + e.tokens;
      if (to > from) bytes += static_cast<double>(to - from) * profile_.kv_bytes_per_token;
    }
    return bytes;
  }

  // A token of request `r` reaches the client at `time` (never before the
  // token before it: the stream is in order).
  void Deliver(int64_t r, double time, bool last) {
    RequestRecord& rec = records_[r];
    if (!rec.token_s.empty()) time = std::max(time, rec.token_s.back());
    rec.token_s.push_back(time);
    rec.output_tokens = static_cast<int32_t>(rec.token_s.size());
    if (last) {
      rec.end_s = time;
      Schedule(time, EventKind::kRequestEnd, -1, r);
    }
  }

  void PushDone(int64_t r) {
    RequestState& state = requests_[r];
    Worker& p = *prefill_[state.prefill];
    p.generator.ReleaseKv(r);
    Kick(p);
    const bool last = Spec(r).output_tokens == 1;
    Deliver(r, now_ + profile_.disaggregated_first_token_s, last);
    if (!last) Schedule(now_, EventKind::kDecodeStart, -1, r);
  }

  void DecodeStart(int64_t r) {
    RequestState& state = requests_[r];
    const WorkloadRequest& spec = Spec(r);
    Worker& d = *decode_[state.decode];
    absl::Status s = d.generator.AddPrefilled({.id = r,
                                               .prompt_tokens = spec.input_tokens,
                                               .max_tokens = spec.output_tokens,
                                               .block_hashes = state.hashes});
    if (!s.ok()) {
      error_ = absl::InternalError(
          absl::StrCat("simulated request ", r, ": AddPrefilled failed: ", s.message()));
      return;
    }
    state.reserved = false;
    Kick(d);
  }

  const Profile& profile_;
  const Workload& workload_;
  const SimulationOptions options_;
  const std::unique_ptr<RoutingPolicy> policy_;
  const TransferCost transfer_;

  std::vector<std::unique_ptr<Worker>> prefill_;
  std::vector<std::unique_ptr<Worker>> decode_;
  std::vector<Worker*> all_;  // Decode workers, then prefill workers.
  // The router's ledger: KV blocks committed per decode worker.
  std::vector<int64_t> committed_;
  std::deque<int64_t> queue_;

  std::vector<RequestState> requests_;
  std::vector<RequestRecord> records_;
  Simulation result_;  // Its step times as they add up; records_ at the end.
  int64_t next_send_ = 0;
  int64_t sent_ = 0;
  int64_t ended_ = 0;
  int64_t polls_ = 0;

  std::priority_queue<Event, std::vector<Event>, Later> events_;
  uint64_t next_seq_ = 0;
  double now_ = 0;
  absl::Status error_;

  // Scratch reused across events.
  std::vector<SimEvent> step_events_;
  std::vector<KvCacheEvent> kv_events_;
  std::vector<WorkerLoad> decode_loads_;
  std::vector<int32_t> decode_ids_;
  std::vector<WorkerLoad> prefill_loads_;
};

}  // namespace

absl::StatusOr<Simulation> Simulate(const Profile& profile, const ClusterShape& shape,
                                    const Workload& workload, const SimulationOptions& options) {
  PD_RETURN_IF_ERROR(ValidateProfile(profile));
  if (shape.decode < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("cluster shape ", shape.Name(), " has no decode worker"));
  }
  if (shape.prefill < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("cluster shape ", shape.Name(), ": negative prefill workers"));
  }
  TransferCost transfer;
  if (shape.prefill > 0) {
    auto it = std::find_if(profile.transfers.begin(), profile.transfers.end(),
                           [&](const TransferCost& t) { return t.transport == shape.transport; });
    if (it == profile.transfers.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("the profile has no transfer cost for transport '", shape.transport, "'"));
    }
    transfer = *it;
  }
  absl::StatusOr<std::unique_ptr<RoutingPolicy>> policy = CreateRoutingPolicy(shape.routing);
  if (!policy.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("routing: ", policy.status().message()));
  }
  if (options.concurrency < 0 || options.max_queued < 0) {
    return absl::InvalidArgumentError("concurrency and max_queued must not be negative");
  }
  if (workload.block_tokens < 1) {
    return absl::InvalidArgumentError("the workload's block_tokens must be positive");
  }
  for (size_t i = 0; i < workload.requests.size(); ++i) {
    const WorkloadRequest& r = workload.requests[i];
    if (r.input_tokens < 1 || r.output_tokens < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("workload request ", i, " has ", r.input_tokens, " prompt and ",
                       r.output_tokens, " output tokens; both must be at least 1"));
    }
    if (options.concurrency == 0 && !(std::isfinite(r.arrival_s) && r.arrival_s >= 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("workload request ", i, " arrives at ", r.arrival_s, " s"));
    }
  }
  ClusterSimulation simulation(profile, shape, workload, options, *std::move(policy), transfer);
  return simulation.Run();
}

}  // namespace pdserve::planner
