#include "kv_transfer/kv_sender.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/process.h"
#include "common/status_macros.h"

namespace pdserve::kv {
namespace {

// Peers a lane keeps a connection to; past this its cache starts over
// (landings come from the router, but a bound costs nothing).
constexpr size_t kMaxConnections = 256;

// How long an offer whose connect failed is passed over while the landing
// has another left.
constexpr absl::Duration kSkipFailedConnect = absl::Seconds(10);

std::string ConnectionKey(const KvOffer& offer) {
  return absl::StrCat(offer.transport, "\n", offer.endpoint);
}

// Decode worker ids and endpoints live apart, so neither can name the
// other's lane.
std::string LaneKey(const KvLandingTarget& target) {
  if (!target.destination.empty())
    return absl::StrCat("worker\n", target.destination);
  if (target.offers.empty()) return "";
  return absl::StrCat("offer\n", ConnectionKey(target.offers.front()));
}

absl::Status ShuttingDown() {
  return absl::UnavailableError("the KV sender is shutting down");
}

}  // namespace

KvPush::KvPush(uint64_t request_id, KvLandingTarget target)
    : request_id_(request_id),
      target_(std::move(target)),
      lane_key_(LaneKey(target_)) {}

void KvPush::Abort(absl::Status why) {
  if (why.ok()) return;
  absl::MutexLock lock(&mu_);
  if (status_.ok()) status_ = std::move(why);
}

absl::Status KvPush::status() const {
  absl::MutexLock lock(&mu_);
  return status_;
}

std::vector<std::string> KvSender::NamesOf(
    const std::vector<std::unique_ptr<SenderTransport>>& transports) {
  std::vector<std::string> names;
  for (const auto& t : transports)
    names.push_back(t->transport->capabilities().name);
  return names;
}

absl::StatusOr<std::unique_ptr<KvSender>> KvSender::Create(
    std::vector<KvSenderTransport> transports, int32_t local_blocks,
    const KvBlockLayout& layout, StageCallback stage,
    FailureCallback on_failure, const KvSenderOptions& options) {
  if (transports.empty() || transports.size() > kMaxKvOffers) {
    return absl::InvalidArgumentError(
        absl::StrCat("a KV sender runs 1 to ", kMaxKvOffers,
                     " transports, not ", transports.size()));
  }
  if (options.max_lanes < 1) {
    return absl::InvalidArgumentError("a KV sender needs at least one lane");
  }
  if (options.lane_idle_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("lane_idle_timeout must be positive");
  }
  std::vector<std::unique_ptr<SenderTransport>> owned;
  for (KvSenderTransport& t : transports) {
    std::unique_ptr<KvTransport>& transport = t.transport;
    if (transport == nullptr) {
      return absl::InvalidArgumentError("a KV sender transport is null");
    }
    if (t.memory.size() <
        layout.block_bytes() * static_cast<size_t>(local_blocks)) {
      return absl::InvalidArgumentError(absl::StrCat(
          "KV memory of ", t.memory.size(), " bytes is smaller than ",
          local_blocks, " blocks of ", layout.block_bytes()));
    }
    if (t.staged && stage == nullptr) {
      return absl::InvalidArgumentError(
          "a staged KV transport needs a stage callback");
    }
    for (const auto& other : owned) {
      if (other->transport->capabilities().name ==
          transport->capabilities().name) {
        return absl::InvalidArgumentError(absl::StrCat(
            "KV transport '", transport->capabilities().name, "' given twice"));
      }
    }
    auto entry = std::make_unique<SenderTransport>();
    PD_ASSIGN_OR_RETURN(entry->local_region,
                        transport->RegisterMemory(t.memory));
    entry->staged = t.staged;
    entry->transport = std::move(transport);
    owned.push_back(std::move(entry));
  }
  return std::unique_ptr<KvSender>(
      new KvSender(std::move(owned), local_blocks, layout, std::move(stage),
                   std::move(on_failure), options));
}

KvSender::KvSender(std::vector<std::unique_ptr<SenderTransport>> transports,
                   int32_t local_blocks, const KvBlockLayout& layout,
                   StageCallback stage, FailureCallback on_failure,
                   const KvSenderOptions& options)
    : transports_(std::move(transports)),
      transport_names_(NamesOf(transports_)),
      local_blocks_(local_blocks),
      layout_(layout),
      options_(options),
      on_failure_(std::move(on_failure)),
      stage_(std::move(stage)) {}

KvSender::~KvSender() { Stop(); }

std::vector<KvTransportCounters> KvSender::counters() const {
  std::vector<KvTransportCounters> out;
  for (const auto& t : transports_) {
    out.push_back({.transport = t->transport->capabilities().name,
                   .pushes = t->pushes.load(std::memory_order_relaxed),
                   .bytes = t->bytes.load(std::memory_order_relaxed),
                   .fallbacks = t->fallbacks.load(std::memory_order_relaxed)});
  }
  return out;
}

size_t KvSender::lane_count() const {
  absl::MutexLock lock(&mu_);
  return lanes_.size();
}

KvSender::Lane& KvSender::LaneFor(
    const KvPush& push, std::vector<std::unique_ptr<Lane>>* joinable) {
  // Reaped lanes are collected here, on a path that runs often anyway.
  for (auto it = reaped_.begin(); it != reaped_.end();) {
    if ((*it)->exited.load(std::memory_order_acquire)) {
      joinable->push_back(std::move(*it));
      it = reaped_.erase(it);
    } else {
      ++it;
    }
  }
  if (auto it = lane_of_.find(push.lane_key_); it != lane_of_.end())
    return *it->second;
  Lane* lane = nullptr;
  if (lanes_.size() < options_.max_lanes) {
    lane = lanes_.emplace_back(std::make_unique<Lane>()).get();
    lane->thread = std::thread([this, lane] {
      NameThisThread("pd-kv-push");
      RunLane(lane);
    });
  } else {
    // Every lane is taken: share the least busy one. Its key stays put
    // while the lane lives, so the push's jobs keep their order.
    size_t fewest = SIZE_MAX;
    for (const auto& candidate : lanes_) {
      absl::MutexLock lane_lock(&candidate->mu);
      if (candidate->jobs.size() < fewest) {
        fewest = candidate->jobs.size();
        lane = candidate.get();
      }
    }
  }
  lane_of_[push.lane_key_] = lane;
  return *lane;
}

void KvSender::Join(std::vector<std::unique_ptr<Lane>> lanes) {
  for (const auto& lane : lanes) lane->thread.join();
}

void KvSender::PushLayer(int32_t layer, std::span<const LayerKv> kvs) {
  const int32_t bs = layout_.block_size;
  const absl::Time now = absl::Now();
  std::vector<std::unique_ptr<Lane>> joinable;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    for (const LayerKv& kv : kvs) {
      // The decode worker holds the positions before cached_tokens already.
      const int32_t begin =
          std::max(kv.begin, kv.push->target().cached_tokens);
      if (kv.end <= begin) continue;
      {
        absl::MutexLock push_lock(&kv.push->mu_);
        if (kv.push->first_layer_queued_ == absl::InfinitePast()) {
          kv.push->first_layer_queued_ = now;
        }
      }
      // Only the blocks the range touches: positions are rebased on the
      // first.
      const int32_t first = begin / bs;
      const int32_t last = (kv.end - 1) / bs;
      Job job;
      job.push = kv.push;
      job.layer = layer;
      job.blocks.assign(kv.block_table.begin() + first,
                        kv.block_table.begin() + last + 1);
      job.first_block = first;
      job.begin = begin;
      job.end = kv.end;
      Lane& lane = LaneFor(*kv.push, &joinable);
      absl::MutexLock lane_lock(&lane.mu);
      lane.jobs.push_back(std::move(job));
    }
  }
  Join(std::move(joinable));
}

void KvSender::Finish(std::shared_ptr<KvPush> push, std::string notification,
                      DoneCallback done) {
  {
    absl::MutexLock push_lock(&push->mu_);
    push->finish_queued_ = absl::Now();
  }
  std::vector<std::unique_ptr<Lane>> joinable;
  bool queued = false;
  {
    absl::MutexLock lock(&mu_);
    if (!stopping_) {
      Lane& lane = LaneFor(*push, &joinable);
      Job job;
      job.push = std::move(push);
      job.notification = std::move(notification);
      job.done = std::move(done);
      absl::MutexLock lane_lock(&lane.mu);
      lane.jobs.push_back(std::move(job));
      queued = true;
    }
  }
  Join(std::move(joinable));
  if (!queued) done(ShuttingDown(), KvPushStats{});
}

void KvSender::Stop() {
  std::vector<std::unique_ptr<Lane>> lanes;
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
    for (auto& lane : lanes_) {
      absl::MutexLock lane_lock(&lane->mu);
      lane->stopping = true;
      lanes.push_back(std::move(lane));
    }
    for (auto& lane : reaped_) lanes.push_back(std::move(lane));
    lanes_.clear();
    lane_of_.clear();
    reaped_.clear();
  }
  // Each lane drains its queue, running Finish jobs with UNAVAILABLE.
  Join(std::move(lanes));
}

bool KvSender::Reap(Lane* lane) {
  absl::MutexLock lock(&mu_);
  {
    absl::MutexLock lane_lock(&lane->mu);
    if (stopping_ || lane->stopping || !lane->jobs.empty()) return false;
  }
  for (auto it = lane_of_.begin(); it != lane_of_.end();) {
    // absl::flat_hash_map::erase(it) returns void; advance first.
    auto here = it++;
    if (here->second == lane) lane_of_.erase(here);
  }
  auto owned = std::find_if(lanes_.begin(), lanes_.end(),
                            [lane](const auto& l) { return l.get() == lane; });
  reaped_.push_back(std::move(*owned));
  lanes_.erase(owned);
  return true;
}

void KvSender::RunLane(Lane* lane) {
  while (true) {
    Job job;
    bool stopping = false;
    bool idle = false;
    {
      absl::MutexLock lock(&lane->mu);
      auto ready = [lane]() ABSL_SHARED_LOCKS_REQUIRED(lane->mu) {
        return lane->stopping || !lane->jobs.empty();
      };
      if (!lane->mu.AwaitWithTimeout(absl::Condition(&ready),
                                     options_.lane_idle_timeout)) {
        idle = true;
      } else {
        if (lane->jobs.empty()) return;  // Stopping, nothing left.
        job = std::move(lane->jobs.front());
        lane->jobs.pop_front();
        stopping = lane->stopping;
      }
    }
    if (idle) {
      if (!Reap(lane)) continue;
      // Nothing routes to the lane any more: close its connections here,
      // not on the thread that joins it.
      lane->connections.clear();
      lane->exited.store(true, std::memory_order_release);
      return;
    }
    if (stopping) {
      if (job.layer < 0) job.done(ShuttingDown(), KvPushStats{});
      continue;
    }
    if (job.layer >= 0) {
      RunLayer(*lane, job);
    } else {
      RunFinish(*lane, job);
    }
  }
}

KvSender::SenderTransport* KvSender::TransportOf(const KvOffer& offer) const {
  for (const auto& t : transports_) {
    if (t->transport->capabilities().name == offer.transport) return t.get();
  }
  return nullptr;
}

absl::StatusOr<KvSender::LaneConnection*> KvSender::ConnectionTo(
    Lane& lane, const std::string& key, const KvOffer& offer,
    SenderTransport& transport, bool* is_new) {
  *is_new = false;
  if (auto it = lane.connections.find(key); it != lane.connections.end())
    return &it->second;
  PD_ASSIGN_OR_RETURN(std::unique_ptr<KvConnection> connection,
                      transport.transport->Connect(offer.endpoint));
  if (lane.connections.size() >= kMaxConnections) lane.connections.clear();
  *is_new = true;
  LaneConnection& entry = lane.connections[key];
  entry.connection = std::move(connection);
  entry.serial = next_connection_serial_.fetch_add(1, std::memory_order_relaxed);
  return &entry;
}

absl::StatusOr<KvSender::Link> KvSender::LinkFor(Lane& lane, KvPush& push) {
  const std::vector<KvOffer>& offers = push.target().offers;
  bool is_new = false;
  if (push.offer_ >= 0) {  // Chosen by an earlier job of the push.
    const KvOffer& offer = offers[push.offer_];
    SenderTransport* transport = TransportOf(offer);
    PD_ASSIGN_OR_RETURN(
        LaneConnection * connection,
        ConnectionTo(lane, push.connection_key_, offer, *transport, &is_new));
    push.connection_serial_ = connection->serial;
    return Link{connection->connection.get(), transport, &offer};
  }
  const absl::Time now = absl::Now();
  std::vector<std::string> fallbacks;
  absl::Status last = absl::FailedPreconditionError(
      "the landing has no offer this prefill worker runs");
  for (size_t i = 0; i < offers.size(); ++i) {
    const KvOffer& offer = offers[i];
    SenderTransport* transport = TransportOf(offer);
    if (transport == nullptr) continue;  // ChooseKvOffers left none such.
    const bool is_last = i + 1 == offers.size();
    std::string key = ConnectionKey(offer);
    // An offer whose connect failed lately is not tried again while
    // another is left: a dead or black-holed endpoint would cost every
    // push a connect (up to the transfer timeout).
    auto failed = lane.failed_connects.find(key);
    if (failed != lane.failed_connects.end() && failed->second <= now) {
      lane.failed_connects.erase(failed);
      failed = lane.failed_connects.end();
    }
    if (failed != lane.failed_connects.end() && !is_last) {
      transport->fallbacks.fetch_add(1, std::memory_order_relaxed);
      fallbacks.push_back(absl::StrCat(offer.transport, " ", offer.endpoint,
                                       " (failed lately, skipped)"));
      continue;
    }
    absl::StatusOr<LaneConnection*> connection =
        ConnectionTo(lane, key, offer, *transport, &is_new);
    if (connection.ok()) {
      lane.failed_connects.erase(key);
      push.offer_ = static_cast<int>(i);
      push.connection_key_ = std::move(key);
      push.connection_serial_ = (*connection)->serial;
      if (is_new) {
        PD_LOG(INFO) << "KV connection over " << offer.transport << " to "
                     << offer.endpoint << "; fallbacks tried: "
                     << (fallbacks.empty() ? std::string("none")
                                           : absl::StrJoin(fallbacks, ", "));
      }
      return Link{(*connection)->connection.get(), transport, &offer};
    }
    last = connection.status();
    if (lane.failed_connects.size() >= kMaxConnections)
      lane.failed_connects.clear();
    lane.failed_connects[key] = now + kSkipFailedConnect;
    fallbacks.push_back(absl::StrCat(offer.transport, " ", offer.endpoint, " (",
                                     last.ToString(), ")"));
    if (!is_last) {
      transport->fallbacks.fetch_add(1, std::memory_order_relaxed);
      PD_LOG(WARNING) << "KV connect over " << offer.transport << " to "
                      << offer.endpoint << " failed (" << last
                      << "); trying the landing's next offer";
    }
  }
  if (fallbacks.size() <= 1) return last;
  return absl::Status(last.code(),
                      absl::StrCat("no KV offer of the landing connected: ",
                                   absl::StrJoin(fallbacks, ", ")));
}

void KvSender::Fail(Lane& lane, const std::shared_ptr<KvPush>& push,
                    const KvOffer* offer, absl::Status why) {
  // A connection is unusable after a transport error (kv_transfer closes
  // it); a local-range error is a bug here, not the peer's doing, and
  // leaves the connection open.
  const std::string where =
      offer == nullptr ? std::string("KV push")
                       : absl::StrCat("KV push over ", offer->transport, " to ",
                                      offer->endpoint);
  if (absl::IsInvalidArgument(why)) {
    why = absl::InternalError(absl::StrCat(where, ": ", why.message()));
  } else {
    if (offer != nullptr) lane.connections.erase(push->connection_key_);
    why = absl::Status(why.code(), absl::StrCat(where, ": ", why.message()));
  }
  PD_LOG(WARNING) << "request " << push->request_id() << ": " << why;
  push->Abort(std::move(why));
  if (on_failure_) on_failure_(push);
}

void KvSender::RunLayer(Lane& lane, Job& job) {
  KvPush& push = *job.push;
  if (push.aborted()) return;  // Its blocks may already be gone.
  absl::StatusOr<Link> link = LinkFor(lane, push);
  if (!link.ok()) return Fail(lane, job.push, nullptr, link.status());
  const KvLandingTarget& target = push.target();
  const int32_t base = job.first_block * layout_.block_size;
  lane.ops.clear();
  uint64_t bytes = 0;
  ForEachKvRange(layout_, job.layer, job.blocks.data(), local_blocks_,
                 target.block_ids.data() + job.first_block,
                 target.remote_pool_blocks, job.begin - base, job.end - base,
                 [&](size_t src, size_t dst, size_t length) {
                   lane.ops.push_back(
                       {.local_region = link->transport->local_region,
                        .local_offset = src,
                        .remote_region = link->offer->region,
                        .remote_offset = dst,
                        .length = length,
                        .landing = target.landing_id});
                   bytes += length;
                 });
  if (link->transport->staged) {
    absl::Status staged;
    {
      absl::MutexLock lock(&stage_mu_);
      staged = stage_(lane.ops);
    }
    if (!staged.ok()) {
      return Fail(lane, job.push, nullptr,
                  absl::InternalError(absl::StrCat(
                      "staging KV in host memory: ", staged.ToString())));
    }
  }
  if (absl::Status s = link->connection->Write(lane.ops); !s.ok()) {
    return Fail(lane, job.push, link->offer, std::move(s));
  }
  push.kv_bytes_ += bytes;
  link->transport->bytes.fetch_add(bytes, std::memory_order_relaxed);
}

void KvSender::NotifyAborted(Lane& lane, KvPush& push) {
  const std::string& message = push.target().abort_notification;
  if (message.empty() || push.connection_serial_ == 0) return;
  // Only on the very connection the push wrote on: when an error closed
  // it, the receiver sees it go and fences the landing by itself.
  auto it = lane.connections.find(push.connection_key_);
  if (it == lane.connections.end() ||
      it->second.serial != push.connection_serial_) {
    return;
  }
  if (absl::Status s = it->second.connection->Notify(message); !s.ok()) {
    PD_LOG(WARNING) << "request " << push.request_id()
                    << ": the abort notification was not delivered: " << s;
    lane.connections.erase(it);
  }
}

void KvSender::RunFinish(Lane& lane, Job& job) {
  KvPush& push = *job.push;
  KvPushStats stats;
  if (push.aborted()) {
    NotifyAborted(lane, push);
  } else {
    absl::StatusOr<Link> link = LinkFor(lane, push);
    absl::Status s = link.status();
    if (s.ok()) s = link->connection->Notify(job.notification);
    if (s.ok()) {
      link->transport->pushes.fetch_add(1, std::memory_order_relaxed);
      const absl::Time now = absl::Now();
      absl::MutexLock lock(&push.mu_);
      if (push.first_layer_queued_ != absl::InfinitePast()) {
        stats.transfer = now - push.first_layer_queued_;
        stats.transfer_tail = now - push.finish_queued_;
      }
    } else {
      Fail(lane, job.push, link.ok() ? link->offer : nullptr, std::move(s));
    }
  }
  stats.kv_bytes = push.kv_bytes_;
  job.done(push.status(), stats);
}

}  // namespace pdserve::kv
