#include "router/worker_registry.h"

#include <algorithm>
#include <filesystem>
#include <limits>
#include <tuple>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/drain.h"
#include "common/log.h"
#include "engine/kv_cache.h"
#include "engine/kv_layout.h"
#include "proto/convert.h"

namespace pdserve {
namespace {

namespace wire = ::pdserve::internal::v1;

const char* RoleName(WorkerRole role) {
  return role == WorkerRole::kDecode ? "decode" : "prefill";
}

// Reconnect quickly once a worker comes back: gRPC's default backoff grows
// to two minutes. Null `credentials`: plaintext.
std::shared_ptr<grpc::Channel> MakeChannel(
    const std::string& address,
    std::shared_ptr<grpc::ChannelCredentials> credentials) {
  grpc::ChannelArguments args;
  args.SetInt(GRPC_ARG_INITIAL_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MIN_RECONNECT_BACKOFF_MS, 100);
  args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 1000);
  if (credentials == nullptr) credentials = grpc::InsecureChannelCredentials();
  return grpc::CreateCustomChannel(address, credentials, args);
}

bool SameModel(const std::string& a, const std::string& b) {
  if (a == b) return true;
  if (a.starts_with("builtin:") || b.starts_with("builtin:")) return false;
  std::error_code ea, eb;
  const auto pa = std::filesystem::weakly_canonical(a, ea);
  const auto pb = std::filesystem::weakly_canonical(b, eb);
  return !ea && !eb && pa == pb;
}

}  // namespace

WorkerRegistry::WorkerRegistry(ExpectedWorkerModel expected,
                               const Options& options,
                               std::unique_ptr<RoutingPolicy> policy)
    : expected_(std::move(expected)),
      options_(options),
      policy_(std::move(policy)) {}

absl::StatusOr<std::unique_ptr<WorkerRegistry>> WorkerRegistry::Create(
    const wire::ClusterConfig& config, ExpectedWorkerModel expected,
    const Options& options) {
  if (options.poll_interval <= absl::ZeroDuration() ||
      options.load_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "poll_interval and load_timeout must be positive");
  }
  absl::StatusOr<RoutingOptions> routing =
      RoutingOptionsFromConfig(config.routing());
  if (!routing.ok()) return routing.status();
  absl::StatusOr<std::unique_ptr<RoutingPolicy>> policy =
      CreateRoutingPolicy(*routing);
  if (!policy.ok()) return policy.status();
  std::unique_ptr<WorkerRegistry> registry(new WorkerRegistry(
      std::move(expected), options, *std::move(policy)));
  {
    absl::MutexLock lock(&registry->mu_);
    auto add = [&](const wire::WorkerConfig& w, WorkerRole role) {
      registry->workers_.push_back(registry->NewState(role, w.id(), w.address()));
      registry->workers_.back()->configured = true;
    };
    for (const auto& w : config.prefill_workers()) add(w, WorkerRole::kPrefill);
    for (const auto& w : config.decode_workers()) add(w, WorkerRole::kDecode);
  }
  registry->poller_ = std::thread([r = registry.get()] { r->PollLoop(); });
  return registry;
}

std::unique_ptr<WorkerRegistry::WorkerState> WorkerRegistry::NewState(
    WorkerRole role, const std::string& id, const std::string& address) {
  auto endpoint = std::make_unique<WorkerEndpoint>();
  endpoint->role = role;
  endpoint->id = id;
  endpoint->address = address;
  endpoint->channel = MakeChannel(address, options_.channel_credentials);
  if (role == WorkerRole::kDecode) {
    endpoint->decode = wire::DecodeWorker::NewStub(endpoint->channel);
  } else {
    endpoint->prefill = wire::PrefillWorker::NewStub(endpoint->channel);
  }
  auto state = std::make_unique<WorkerState>();
  state->endpoint = std::move(endpoint);
  return state;
}

absl::Status WorkerRegistry::AddWorker(WorkerRole role, const std::string& id,
                                       const std::string& address) {
  if (id.empty() || address.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a worker needs an id and an address, not '", id, "' at '", address, "'"));
  }
  absl::MutexLock lock(&mu_);
  WorkerState* revived = nullptr;
  for (auto& w : workers_) {
    const WorkerEndpoint& e = *w->endpoint;
    if (e.id != id) continue;
    if (w->configured) {
      return absl::FailedPreconditionError(absl::StrCat(
          "worker id '", id, "' belongs to a worker of the cluster config"));
    }
    if (e.role == role && e.address == address) {
      revived = w.get();
    } else if (w->member) {
      RemoveLocked(w.get(), absl::StrCat("replaced by the ", RoleName(role), " worker at ",
                                         address));
    }
  }
  if (revived != nullptr) {
    if (revived->member) return absl::OkStatus();
    revived->member = true;
    revived->has_report = false;
    revived->warned = false;
  } else {
    workers_.push_back(NewState(role, id, address));
  }
  PD_LOG(INFO) << RoleName(role) << " worker " << id << " at " << address
               << " joined; polling it";
  return absl::OkStatus();
}

absl::Status WorkerRegistry::RemoveWorker(const std::string& id) {
  absl::MutexLock lock(&mu_);
  for (auto& w : workers_) {
    if (w->endpoint->id != id || !w->member) continue;
    if (w->configured) {
      return absl::FailedPreconditionError(absl::StrCat(
          "worker '", id, "' is in the cluster config and cannot be removed"));
    }
    RemoveLocked(w.get(), "it left");
  }
  return absl::OkStatus();
}

void WorkerRegistry::RemoveLocked(WorkerState* w, const std::string& why) {
  w->member = false;
  w->healthy = false;
  kv_index_.Drop(w->endpoint->id);
  PD_LOG(INFO) << RoleName(w->endpoint->role) << " worker " << w->endpoint->id << " at "
               << w->endpoint->address << " removed: " << why;
}

WorkerRegistry::~WorkerRegistry() {
  std::vector<grpc::ClientContext*> in_flight;
  {
    absl::MutexLock lock(&mu_);
    stopping_ = true;
    for (auto& w : workers_) {
      if (w->poll_in_flight) in_flight.push_back(w->poll_context.get());
    }
  }
  if (poller_.joinable()) poller_.join();
  // No poll starts once stopping_ is set, so these contexts stay alive.
  for (grpc::ClientContext* context : in_flight) context->TryCancel();
  absl::MutexLock lock(&mu_);
  mu_.Await(absl::Condition(
      +[](int* n) { return *n == 0; }, &polls_in_flight_));
}

void WorkerRegistry::PollLoop() {
  absl::Time next = absl::Now();
  for (;;) {
    {
      absl::MutexLock lock(&mu_);
      mu_.AwaitWithDeadline(absl::Condition(&stopping_), next);
      if (stopping_) return;
    }
    next = absl::Now() + options_.poll_interval;
    std::vector<WorkerState*> members;
    {
      absl::MutexLock lock(&mu_);
      for (auto& w : workers_) {
        if (w->member) members.push_back(w.get());
      }
    }
    for (WorkerState* w : members) StartPoll(w);
  }
}

void WorkerRegistry::StartPoll(WorkerState* w) {
  grpc::ClientContext* context;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_ || w->poll_in_flight || !w->member) return;
    w->poll_in_flight = true;
    ++polls_in_flight_;
    ++w->polls_started;
    w->polled_tokens = w->dispatched_tokens;
    w->polled_blocks = w->dispatched_blocks;
    w->polled_requests = w->dispatched_requests;
    w->poll_context = std::make_unique<grpc::ClientContext>();
    w->poll_context->set_deadline(
        absl::ToChronoTime(absl::Now() + options_.load_timeout));
    w->poll_response.Clear();
    const KvIndex::Cursor cursor = kv_index_.CursorOf(w->endpoint->id);
    w->poll_request.set_kv_events_epoch(cursor.epoch);
    w->poll_request.set_kv_events_seq(cursor.seq);
    context = w->poll_context.get();
  }
  // The call may complete on another thread before this returns; mu_ is not
  // held so that its callback can take it.
  auto done = [this, w](grpc::Status status) { OnPollDone(w, status); };
  const WorkerEndpoint& e = *w->endpoint;
  if (e.decode) {
    e.decode->async()->GetLoad(context, &w->poll_request, &w->poll_response,
                               std::move(done));
  } else {
    e.prefill->async()->GetLoad(context, &w->poll_request, &w->poll_response,
                                std::move(done));
  }
}

void WorkerRegistry::OnPollDone(WorkerState* w, const grpc::Status& status) {
  absl::MutexLock lock(&mu_);
  w->poll_in_flight = false;
  --polls_in_flight_;
  const WorkerEndpoint& e = *w->endpoint;
  if (!w->member) return;  // Removed while the poll was in flight.
  if (!status.ok()) {
    if (w->healthy) {
      MarkUnhealthy(
          w, absl::StrCat("load report failed: ", status.error_message()));
    } else if (!w->has_report && !w->warned && !stopping_) {
      // Not up yet (or misconfigured): say so once.
      w->warned = true;
      PD_LOG(WARNING) << RoleName(e.role) << " worker " << e.id << " at "
                      << e.address
                      << " does not answer yet: " << status.error_message();
    }
    return;
  }
  if (!w->healthy) {
    w->compatible = CheckCompatible(*w, w->poll_response);
    w->healthy = true;
    if (w->compatible) {
      PD_LOG(INFO) << RoleName(e.role) << " worker " << e.id << " at "
                   << e.address << " is healthy ("
                   << w->poll_response.ShortDebugString() << ")";
    }
  }
  w->has_report = true;
  SetDraining(w, w->poll_response.draining() ||
                     (w->draining && w->polls_started <= w->drain_refused_poll));
  if (w->poll_response.has_kv_events()) {
    kv_index_.Apply(e.id,
                    static_cast<int32_t>(w->poll_response.layout().block_size()),
                    w->poll_response.kv_events());
    w->poll_response.clear_kv_events();  // Not kept in the snapshot.
  }
  w->report.Swap(&w->poll_response);
  w->dispatched_tokens -= w->polled_tokens;
  w->dispatched_blocks -= w->polled_blocks;
  w->dispatched_requests -= w->polled_requests;
  w->polled_tokens = w->polled_blocks = w->polled_requests = 0;
}

bool WorkerRegistry::CheckCompatible(const WorkerState& w,
                                     const wire::LoadReport& report) {
  const WorkerEndpoint& e = *w.endpoint;
  const std::string who =
      absl::StrCat(RoleName(e.role), " worker ", e.id, " at ", e.address);
  bool usable = true;
  if (report.role() != RoleName(e.role)) {
    PD_LOG(ERROR) << "MISCONFIGURED: " << who << " reports role '"
                  << report.role() << "'; it will not be used";
    usable = false;
  }
  if (!SameModel(report.model(), expected_.model)) {
    PD_LOG(ERROR) << "MISCONFIGURED: " << who << " serves model '"
                  << report.model() << "' but the cluster serves '"
                  << expected_.model << "'";
  }
  const wire::KvLayout& layout = report.layout();
  if (static_cast<int32_t>(layout.num_layers()) != expected_.num_layers ||
      static_cast<int32_t>(layout.num_kv_heads()) != expected_.num_kv_heads ||
      static_cast<int32_t>(layout.head_dim()) != expected_.head_dim) {
    PD_LOG(ERROR) << "MISCONFIGURED: " << who << " has KV layout {"
                  << layout.ShortDebugString() << "} but the model has "
                  << expected_.num_layers << " layers, "
                  << expected_.num_kv_heads << " KV heads of dim "
                  << expected_.head_dim << "; it will not be used";
    usable = false;
  }
  if (!usable) return false;
  if (!have_reference_layout_) {
    have_reference_layout_ = true;
    reference_layout_ = layout;
    reference_worker_ = e.id;
  } else if (layout.block_size() != reference_layout_.block_size() ||
             layout.dtype() != reference_layout_.dtype()) {
    PD_LOG(ERROR) << "MISCONFIGURED: " << who << " has KV layout {"
                  << layout.ShortDebugString() << "} but worker "
                  << reference_worker_ << " has {"
                  << reference_layout_.ShortDebugString()
                  << "}; KV cannot move between them";
  }
  return true;
}

void WorkerRegistry::SetDraining(WorkerState* w, bool draining) {
  if (w->draining == draining) return;
  w->draining = draining;
  const WorkerEndpoint& e = *w->endpoint;
  PD_LOG(INFO) << RoleName(e.role) << " worker " << e.id << " at "
               << e.address
               << (draining ? " is draining: no new work goes to it"
                            : " is no longer draining");
}

void WorkerRegistry::MarkUnhealthy(WorkerState* w, const std::string& why) {
  if (!w->healthy) return;
  w->healthy = false;
  const WorkerEndpoint& e = *w->endpoint;
  kv_index_.Drop(e.id);  // Its pool may be gone; a snapshot starts it over.
  PD_LOG(WARNING) << RoleName(e.role) << " worker " << e.id << " at "
                  << e.address << " is unhealthy: " << why;
}

WorkerRegistry::WorkerState* WorkerRegistry::StateOf(
    const WorkerEndpoint* endpoint) {
  for (auto& w : workers_) {
    if (w->endpoint.get() == endpoint) return w.get();
  }
  return nullptr;
}

const WorkerEndpoint* WorkerRegistry::Pick(
    WorkerRole role, std::span<const WorkerEndpoint* const> exclude) {
  absl::MutexLock lock(&mu_);
  const size_t n = workers_.size();
  const size_t start = rotation_++;
  const WorkerEndpoint* best = nullptr;
  std::tuple<int64_t, int64_t> best_key;
  for (size_t k = 0; k < n; ++k) {
    const WorkerState& w = *workers_[(start + k) % n];
    const WorkerEndpoint* e = w.endpoint.get();
    if (e->role != role || !w.member || !w.healthy || !w.compatible || w.draining) {
      continue;
    }
    if (std::find(exclude.begin(), exclude.end(), e) != exclude.end()) {
      continue;
    }
    const int64_t busy = static_cast<int64_t>(w.report.running()) +
                         w.report.waiting() + w.dispatched_requests;
    // Lower is better.
    const std::tuple<int64_t, int64_t> key =
        role == WorkerRole::kDecode
            ? std::make_tuple(-(static_cast<int64_t>(w.report.free_blocks()) -
                                w.dispatched_blocks),
                              busy)
            : std::make_tuple(
                  static_cast<int64_t>(w.report.pending_prompt_tokens()) +
                      w.dispatched_tokens,
                  busy);
    if (best == nullptr || key < best_key) {
      best = e;
      best_key = key;
    }
  }
  return best;
}

const WorkerEndpoint* WorkerRegistry::PickDecode(
    std::span<const WorkerEndpoint* const> exclude) {
  return Pick(WorkerRole::kDecode, exclude);
}

const WorkerEndpoint* WorkerRegistry::PickPrefill(
    std::span<const WorkerEndpoint* const> exclude) {
  return Pick(WorkerRole::kPrefill, exclude);
}

RouteDecision WorkerRegistry::Route(
    const RouteQuery& query, std::span<const WorkerEndpoint* const> exclude_decode,
    std::span<const WorkerEndpoint* const> exclude_prefill) {
  RouteDecision decision;
  std::vector<WorkerLoad> decode, prefill;
  std::vector<const WorkerEndpoint*> decode_endpoints, prefill_endpoints;
  {
    absl::MutexLock lock(&mu_);
    decision.block_size = have_reference_layout_ && reference_layout_.block_size() > 0
                              ? static_cast<int32_t>(reference_layout_.block_size())
                              : 16;
    for (const auto& w : workers_) {
      const WorkerEndpoint* e = w->endpoint.get();
      if (!w->member || !w->healthy || !w->compatible || w->draining) continue;
      const auto exclude = e->role == WorkerRole::kDecode ? exclude_decode
                                                          : exclude_prefill;
      if (std::find(exclude.begin(), exclude.end(), e) != exclude.end()) {
        continue;
      }
      const wire::LoadReport& r = w->report;
      WorkerLoad load{.id = e->id,
                      .free_blocks = r.free_blocks(),
                      .running = r.running(),
                      .waiting = r.waiting(),
                      .pending_prompt_tokens =
                          static_cast<int64_t>(r.pending_prompt_tokens()),
                      .dispatched_tokens = w->dispatched_tokens,
                      .dispatched_blocks = w->dispatched_blocks,
                      .dispatched_requests = w->dispatched_requests};
      if (e->role == WorkerRole::kDecode) {
        decode.push_back(std::move(load));
        decode_endpoints.push_back(e);
      } else {
        prefill.push_back(std::move(load));
        prefill_endpoints.push_back(e);
      }
    }
  }
  decision.prompt_block_hashes =
      PromptBlockHashes(query.prompt, decision.block_size);
  for (WorkerLoad& w : decode) {
    w.cached_blocks = kv_index_.LeadingBlocks(
        w.id, decision.prompt_block_hashes, decision.block_size);
  }
  for (WorkerLoad& w : prefill) {
    w.cached_blocks = kv_index_.LeadingBlocks(
        w.id, decision.prompt_block_hashes, decision.block_size);
  }
  const RoutingChoice choice = policy_->Choose(
      {.prompt_tokens = static_cast<int32_t>(query.prompt.size()),
       .max_tokens = query.max_tokens,
       .block_size = decision.block_size,
       .decode = decode,
       .prefill = prefill});
  // Tokens of the shareable cached prefix (never the last token's block).
  const int32_t shareable =
      query.prompt.empty()
          ? 0
          : (static_cast<int32_t>(query.prompt.size()) - 1) / decision.block_size;
  auto cached_tokens = [&](const WorkerLoad& w) {
    return std::min(w.cached_blocks, shareable) * decision.block_size;
  };
  if (choice.decode >= 0) {
    decision.decode = decode_endpoints[choice.decode];
    decision.decode_cached_tokens = cached_tokens(decode[choice.decode]);
  }
  if (choice.decode >= 0 && choice.prefill >= 0) {
    decision.prefill = prefill_endpoints[choice.prefill];
    decision.prefill_cached_tokens = cached_tokens(prefill[choice.prefill]);
  }
  return decision;
}

void WorkerRegistry::NoteDispatched(const WorkerEndpoint* worker,
                                    int64_t tokens) {
  absl::MutexLock lock(&mu_);
  WorkerState* w = StateOf(worker);
  if (w == nullptr) return;
  w->dispatched_tokens += tokens;
  ++w->dispatched_requests;
  if (worker->role == WorkerRole::kDecode) {
    const int64_t block_size = w->report.layout().block_size() > 0
                                   ? w->report.layout().block_size()
                                   : 16;
    w->dispatched_blocks += BlocksForTokens(tokens, block_size);
  }
}

void WorkerRegistry::ReportCallFailure(const WorkerEndpoint* worker,
                                       const absl::Status& status) {
  WorkerState* w;
  {
    absl::MutexLock lock(&mu_);
    w = StateOf(worker);
  }
  if (w == nullptr) return;
  if (IsDrainingRefusal(status)) {
    {
      absl::MutexLock lock(&mu_);
      SetDraining(w, true);
      w->drain_refused_poll = w->polls_started;
    }
    StartPoll(w);
    return;
  }
  const absl::StatusCode code = status.code();
  if (code != absl::StatusCode::kUnavailable &&
      code != absl::StatusCode::kInternal &&
      code != absl::StatusCode::kUnknown) {
    return;
  }
  if (code == absl::StatusCode::kUnavailable) {
    const bool channel_down =
        worker->channel->GetState(/*try_to_connect=*/false) !=
        GRPC_CHANNEL_READY;
    if (worker->role == WorkerRole::kDecode || channel_down) {
      absl::MutexLock lock(&mu_);
      MarkUnhealthy(w, absl::StrCat("a call failed: ", status.message()));
    }
  }
  StartPoll(w);
}

std::vector<WorkerRegistry::KvCapacity> WorkerRegistry::DecodeCapacities() const {
  absl::MutexLock lock(&mu_);
  std::vector<KvCapacity> out;
  for (const auto& w : workers_) {
    if (!w->member || w->endpoint->role != WorkerRole::kDecode) continue;
    out.push_back(
        {.worker = w->endpoint.get(),
         .usable = w->healthy && w->compatible && !w->draining,
         .total_blocks = w->report.total_blocks(),
         .block_size = static_cast<int32_t>(w->report.layout().block_size())});
  }
  return out;
}

int WorkerRegistry::healthy_prefill() const {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (const auto& w : workers_) {
    n += w->member && w->endpoint->role == WorkerRole::kPrefill && w->healthy &&
         w->compatible && !w->draining;
  }
  return n;
}

int WorkerRegistry::healthy_decode() const {
  absl::MutexLock lock(&mu_);
  int n = 0;
  for (const auto& w : workers_) {
    n += w->member && w->endpoint->role == WorkerRole::kDecode && w->healthy &&
         w->compatible && !w->draining;
  }
  return n;
}

std::vector<WorkerSnapshot> WorkerRegistry::Snapshot() const {
  absl::MutexLock lock(&mu_);
  std::vector<WorkerSnapshot> out;
  for (const auto& w : workers_) {
    if (!w->member) continue;
    out.push_back({w->endpoint->id, w->endpoint->role,
                   w->healthy && w->compatible, w->report});
  }
  return out;
}

}  // namespace pdserve
