#include "prefill_worker/kv_pusher.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/log.h"
#include "common/status_macros.h"

namespace pdserve {
namespace {

// Peers a pusher keeps a connection to; past this the cache starts over
// (landings come from the router, but a bound costs nothing).
constexpr size_t kMaxConnections = 256;

// How long an offer whose connect failed is passed over while the landing
// has another left.
constexpr absl::Duration kSkipFailedConnect = absl::Seconds(10);

std::string ConnectionKey(const kv::KvOffer& offer) {
  return absl::StrCat(offer.transport, "\n", offer.endpoint);
}

}  // namespace

void KvPush::Abort(absl::Status why) {
  if (why.ok()) return;
  absl::MutexLock lock(&mu_);
  if (status_.ok()) status_ = std::move(why);
}

absl::Status KvPush::status() const {
  absl::MutexLock lock(&mu_);
  return status_;
}

std::vector<std::string> KvPusher::NamesOf(
    const std::vector<std::unique_ptr<Lane>>& lanes) {
  std::vector<std::string> names;
  for (const auto& lane : lanes)
    names.push_back(lane->transport->capabilities().name);
  return names;
}

absl::StatusOr<std::unique_ptr<KvPusher>> KvPusher::Create(
    std::vector<KvPusherTransport> transports, int32_t local_blocks,
    const KvBlockLayout& layout, StageCallback stage,
    FailureCallback on_failure) {
  if (transports.empty() || transports.size() > kv::kMaxKvOffers) {
    return absl::InvalidArgumentError(
        absl::StrCat("a KV pusher runs 1 to ", kv::kMaxKvOffers,
                     " transports, not ", transports.size()));
  }
  std::vector<std::unique_ptr<Lane>> lanes;
  for (KvPusherTransport& t : transports) {
    std::unique_ptr<kv::KvTransport>& transport = t.transport;
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
    for (const auto& lane : lanes) {
      if (lane->transport->capabilities().name ==
          transport->capabilities().name) {
        return absl::InvalidArgumentError(absl::StrCat(
            "KV transport '", transport->capabilities().name, "' given twice"));
      }
    }
    auto lane = std::make_unique<Lane>();
    PD_ASSIGN_OR_RETURN(lane->local_region,
                        transport->RegisterMemory(t.memory));
    lane->staged = t.staged;
    lane->transport = std::move(transport);
    lanes.push_back(std::move(lane));
  }
  return std::unique_ptr<KvPusher>(new KvPusher(std::move(lanes), local_blocks,
                                                layout, std::move(stage),
                                                std::move(on_failure)));
}

KvPusher::KvPusher(std::vector<std::unique_ptr<Lane>> lanes,
                   int32_t local_blocks, const KvBlockLayout& layout,
                   StageCallback stage, FailureCallback on_failure)
    : lanes_(std::move(lanes)),
      transport_names_(NamesOf(lanes_)),
      local_blocks_(local_blocks),
      layout_(layout),
      stage_(std::move(stage)),
      on_failure_(std::move(on_failure)),
      thread_([this] { Run(); }) {}

std::vector<KvTransportCounters> KvPusher::counters() const {
  std::vector<KvTransportCounters> out;
  for (const auto& lane : lanes_) {
    out.push_back(
        {.transport = lane->transport->capabilities().name,
         .pushes = lane->pushes.load(std::memory_order_relaxed),
         .bytes = lane->bytes.load(std::memory_order_relaxed),
         .fallbacks = lane->fallbacks.load(std::memory_order_relaxed)});
  }
  return out;
}

KvPusher::~KvPusher() { Stop(); }

void KvPusher::PushLayer(int32_t layer, std::span<const LayerKv> kvs) {
  const int32_t bs = layout_.block_size;
  const absl::Time now = absl::Now();
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
    // Only the blocks the range touches: positions are rebased on the first.
    const int32_t first = begin / bs;
    const int32_t last = (kv.end - 1) / bs;
    Job& job = jobs_.emplace_back();
    job.push = kv.push;
    job.layer = layer;
    job.blocks.assign(kv.block_table.begin() + first,
                      kv.block_table.begin() + last + 1);
    job.first_block = first;
    job.begin = begin;
    job.end = kv.end;
  }
}

void KvPusher::Finish(std::shared_ptr<KvPush> push, std::string notification,
                      DoneCallback done) {
  {
    absl::MutexLock push_lock(&push->mu_);
    push->finish_queued_ = absl::Now();
  }
  {
    absl::MutexLock lock(&mu_);
    if (!stopping_) {
      Job& job = jobs_.emplace_back();
      job.push = std::move(push);
      job.notification = std::move(notification);
      job.done = std::move(done);
      return;
    }
  }
  done(absl::UnavailableError("the prefill worker is shutting down"),
       KvPushStats{});
}

void KvPusher::Stop() {
  {
    absl::MutexLock lock(&mu_);
    if (stopping_) return;
    stopping_ = true;
  }
  thread_.join();
}

void KvPusher::Run() {
  while (true) {
    Job job;
    bool stopping = false;
    {
      absl::MutexLock lock(&mu_);
      auto ready = [this]() ABSL_SHARED_LOCKS_REQUIRED(mu_) {
        return stopping_ || !jobs_.empty();
      };
      mu_.Await(absl::Condition(&ready));
      if (jobs_.empty()) return;  // Stopping, nothing left.
      job = std::move(jobs_.front());
      jobs_.pop_front();
      stopping = stopping_;
    }
    if (stopping) {
      if (job.layer < 0) {
        job.done(absl::UnavailableError("the prefill worker is shutting down"),
                 KvPushStats{});
      }
      continue;
    }
    if (job.layer >= 0) {
      RunLayer(job);
    } else {
      RunFinish(job);
    }
  }
}

KvPusher::Lane* KvPusher::LaneOf(const kv::KvOffer& offer) const {
  for (const auto& lane : lanes_) {
    if (lane->transport->capabilities().name == offer.transport)
      return lane.get();
  }
  return nullptr;
}

absl::StatusOr<kv::KvConnection*> KvPusher::ConnectionTo(
    const std::string& key, const kv::KvOffer& offer, Lane& lane,
    bool* is_new) {
  *is_new = false;
  if (auto it = connections_.find(key); it != connections_.end())
    return it->second.get();
  PD_ASSIGN_OR_RETURN(std::unique_ptr<kv::KvConnection> connection,
                      lane.transport->Connect(offer.endpoint));
  if (connections_.size() >= kMaxConnections) connections_.clear();
  *is_new = true;
  return (connections_[key] = std::move(connection)).get();
}

absl::StatusOr<KvPusher::Link> KvPusher::LinkFor(KvPush& push) {
  const std::vector<kv::KvOffer>& offers = push.target().offers;
  bool is_new = false;
  if (push.offer_ >= 0) {  // Chosen by an earlier job of the push.
    const kv::KvOffer& offer = offers[push.offer_];
    Lane* lane = LaneOf(offer);
    PD_ASSIGN_OR_RETURN(
        kv::KvConnection * connection,
        ConnectionTo(push.connection_key_, offer, *lane, &is_new));
    return Link{connection, lane, &offer};
  }
  const absl::Time now = absl::Now();
  std::vector<std::string> fallbacks;
  absl::Status last = absl::FailedPreconditionError(
      "the landing has no offer this prefill worker runs");
  for (size_t i = 0; i < offers.size(); ++i) {
    const kv::KvOffer& offer = offers[i];
    Lane* lane = LaneOf(offer);
    if (lane == nullptr) continue;  // ChooseKvOffers left none such.
    const bool is_last = i + 1 == offers.size();
    std::string key = ConnectionKey(offer);
    // An offer whose connect failed lately is not tried again while
    // another is left: a dead or black-holed endpoint would cost every
    // push a connect (up to the transfer timeout).
    auto failed = failed_connects_.find(key);
    if (failed != failed_connects_.end() && failed->second <= now) {
      failed_connects_.erase(failed);
      failed = failed_connects_.end();
    }
    if (failed != failed_connects_.end() && !is_last) {
      lane->fallbacks.fetch_add(1, std::memory_order_relaxed);
      fallbacks.push_back(absl::StrCat(offer.transport, " ", offer.endpoint,
                                       " (failed lately, skipped)"));
      continue;
    }
    absl::StatusOr<kv::KvConnection*> connection =
        ConnectionTo(key, offer, *lane, &is_new);
    if (connection.ok()) {
      failed_connects_.erase(key);
      push.offer_ = static_cast<int>(i);
      push.connection_key_ = std::move(key);
      if (is_new) {
        PD_LOG(INFO) << "KV connection over " << offer.transport << " to "
                     << offer.endpoint << "; fallbacks tried: "
                     << (fallbacks.empty() ? std::string("none")
                                           : absl::StrJoin(fallbacks, ", "));
      }
      return Link{*connection, lane, &offer};
    }
    last = connection.status();
    if (failed_connects_.size() >= kMaxConnections) failed_connects_.clear();
    failed_connects_[key] = now + kSkipFailedConnect;
    fallbacks.push_back(absl::StrCat(offer.transport, " ", offer.endpoint, " (",
                                     last.ToString(), ")"));
    if (!is_last) {
      lane->fallbacks.fetch_add(1, std::memory_order_relaxed);
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

void KvPusher::Fail(const std::shared_ptr<KvPush>& push,
                    const kv::KvOffer* offer, absl::Status why) {
  // A connection is unusable after a transport error (kv_transfer closes
  // it); a local-range error is a bug here, not the peer's doing.
  const std::string where =
      offer == nullptr ? std::string("KV push")
                       : absl::StrCat("KV push over ", offer->transport, " to ",
                                      offer->endpoint);
  if (absl::IsInvalidArgument(why)) {
    why = absl::InternalError(absl::StrCat(where, ": ", why.message()));
  } else {
    if (offer != nullptr) connections_.erase(push->connection_key_);
    why = absl::Status(why.code(), absl::StrCat(where, ": ", why.message()));
  }
  PD_LOG(WARNING) << "request " << push->id().value << ": " << why;
  push->Abort(std::move(why));
  if (on_failure_) on_failure_(push);
}

void KvPusher::RunLayer(Job& job) {
  KvPush& push = *job.push;
  if (push.aborted()) return;  // Its blocks may already be gone.
  absl::StatusOr<Link> link = LinkFor(push);
  if (!link.ok()) return Fail(job.push, nullptr, link.status());
  const KvLandingTarget& target = push.target();
  const int32_t base = job.first_block * layout_.block_size;
  ops_.clear();
  uint64_t bytes = 0;
  ForEachKvRange(layout_, job.layer, job.blocks.data(), local_blocks_,
                 target.block_ids.data() + job.first_block,
                 target.remote_pool_blocks, job.begin - base, job.end - base,
                 [&](size_t src, size_t dst, size_t length) {
                   ops_.push_back({.local_region = link->lane->local_region,
                                   .local_offset = src,
                                   .remote_region = link->offer->region,
                                   .remote_offset = dst,
                                   .length = length,
                                   .landing = target.landing_id});
                   bytes += length;
                 });
  if (link->lane->staged) {
    staged_.clear();
    for (const kv::WriteOp& op : ops_)
      staged_.push_back({.offset = op.local_offset, .length = op.length});
    if (absl::Status s = stage_(staged_); !s.ok()) {
      return Fail(job.push, nullptr,
                  absl::InternalError(absl::StrCat(
                      "staging KV in host memory: ", s.ToString())));
    }
  }
  if (absl::Status s = link->connection->Write(ops_); !s.ok()) {
    return Fail(job.push, link->offer, std::move(s));
  }
  push.kv_bytes_ += bytes;
  link->lane->bytes.fetch_add(bytes, std::memory_order_relaxed);
}

void KvPusher::RunFinish(Job& job) {
  KvPush& push = *job.push;
  KvPushStats stats;
  if (!push.aborted()) {
    absl::StatusOr<Link> link = LinkFor(push);
    absl::Status s = link.status();
    if (s.ok()) s = link->connection->Notify(job.notification);
    if (s.ok()) {
      link->lane->pushes.fetch_add(1, std::memory_order_relaxed);
      const absl::Time now = absl::Now();
      absl::MutexLock lock(&push.mu_);
      if (push.first_layer_queued_ != absl::InfinitePast()) {
        stats.transfer = now - push.first_layer_queued_;
        stats.transfer_tail = now - push.finish_queued_;
      }
    } else {
      Fail(job.push, link.ok() ? link->offer : nullptr, std::move(s));
    }
  }
  stats.kv_bytes = push.kv_bytes_;
  job.done(push.status(), stats);
}

}  // namespace pdserve
