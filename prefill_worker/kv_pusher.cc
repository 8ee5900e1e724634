#include "prefill_worker/kv_pusher.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/status_macros.h"

namespace pdserve {
namespace {

// Peers a pusher keeps a connection to; past this the cache starts over
// (landings come from the router, but a bound costs nothing).
constexpr size_t kMaxConnections = 256;

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

absl::StatusOr<std::unique_ptr<KvPusher>> KvPusher::Create(
    std::unique_ptr<kv::KvTransport> transport,
    std::span<std::byte> local_memory, int32_t local_blocks,
    const KvBlockLayout& layout, FailureCallback on_failure) {
  if (local_memory.size() <
      layout.block_bytes() * static_cast<size_t>(local_blocks)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV memory of ", local_memory.size(), " bytes is smaller than ",
        local_blocks, " blocks of ", layout.block_bytes()));
  }
  PD_ASSIGN_OR_RETURN(kv::RegionId region,
                      transport->RegisterMemory(local_memory));
  return std::unique_ptr<KvPusher>(new KvPusher(std::move(transport), region,
                                                local_blocks, layout,
                                                std::move(on_failure)));
}

KvPusher::KvPusher(std::unique_ptr<kv::KvTransport> transport,
                   kv::RegionId local_region, int32_t local_blocks,
                   const KvBlockLayout& layout, FailureCallback on_failure)
    : transport_(std::move(transport)),
      local_region_(local_region),
      local_blocks_(local_blocks),
      layout_(layout),
      on_failure_(std::move(on_failure)),
      thread_([this] { Run(); }) {}

KvPusher::~KvPusher() { Stop(); }

void KvPusher::PushLayer(int32_t layer, std::span<const LayerKv> kvs) {
  const int32_t bs = layout_.block_size;
  const absl::Time now = absl::Now();
  absl::MutexLock lock(&mu_);
  if (stopping_) return;
  for (const LayerKv& kv : kvs) {
    if (kv.end <= kv.begin) continue;
    {
      absl::MutexLock push_lock(&kv.push->mu_);
      if (kv.push->first_layer_queued_ == absl::InfinitePast()) {
        kv.push->first_layer_queued_ = now;
      }
      kv.push->last_layer_queued_ = now;
    }
    // Only the blocks the range touches: positions are rebased on the first.
    const int32_t first = kv.begin / bs;
    const int32_t last = (kv.end - 1) / bs;
    Job& job = jobs_.emplace_back();
    job.push = kv.push;
    job.layer = layer;
    job.blocks.assign(kv.block_table.begin() + first,
                      kv.block_table.begin() + last + 1);
    job.first_block = first;
    job.begin = kv.begin;
    job.end = kv.end;
  }
}

void KvPusher::Finish(std::shared_ptr<KvPush> push, std::string notification,
                      DoneCallback done) {
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

absl::StatusOr<kv::KvConnection*> KvPusher::ConnectionTo(
    const std::string& endpoint) {
  if (auto it = connections_.find(endpoint); it != connections_.end())
    return it->second.get();
  PD_ASSIGN_OR_RETURN(std::unique_ptr<kv::KvConnection> connection,
                      transport_->Connect(endpoint));
  if (connections_.size() >= kMaxConnections) connections_.clear();
  return (connections_[endpoint] = std::move(connection)).get();
}

void KvPusher::Fail(const std::shared_ptr<KvPush>& push,
                    const std::string& endpoint, absl::Status why) {
  // A connection is unusable after a transport error (kv_transfer closes
  // it); a local-range error is a bug here, not the peer's doing.
  if (absl::IsInvalidArgument(why)) {
    why = absl::InternalError(
        absl::StrCat("KV push to ", endpoint, ": ", why.message()));
  } else {
    connections_.erase(endpoint);
    why = absl::Status(
        why.code(), absl::StrCat("KV push to ", endpoint, ": ", why.message()));
  }
  PD_LOG(WARNING) << "request " << push->id().value << ": " << why;
  push->Abort(std::move(why));
  if (on_failure_) on_failure_(push);
}

void KvPusher::RunLayer(Job& job) {
  KvPush& push = *job.push;
  if (push.aborted()) return;  // Its blocks may already be gone.
  const KvLandingTarget& target = push.target();
  const int32_t base = job.first_block * layout_.block_size;
  ops_.clear();
  uint64_t bytes = 0;
  ForEachKvRange(layout_, job.layer, job.blocks.data(), local_blocks_,
                 target.block_ids.data() + job.first_block,
                 target.remote_pool_blocks, job.begin - base, job.end - base,
                 [&](size_t src, size_t dst, size_t length) {
                   ops_.push_back({.local_region = local_region_,
                                   .local_offset = src,
                                   .remote_region = target.remote_region,
                                   .remote_offset = dst,
                                   .length = length});
                   bytes += length;
                 });
  absl::StatusOr<kv::KvConnection*> connection = ConnectionTo(target.endpoint);
  if (!connection.ok())
    return Fail(job.push, target.endpoint, connection.status());
  if (absl::Status s = (*connection)->Write(ops_); !s.ok()) {
    return Fail(job.push, target.endpoint, std::move(s));
  }
  push.kv_bytes_ += bytes;
}

void KvPusher::RunFinish(Job& job) {
  KvPush& push = *job.push;
  KvPushStats stats;
  if (!push.aborted()) {
    absl::StatusOr<kv::KvConnection*> connection =
        ConnectionTo(push.target().endpoint);
    absl::Status s = connection.status();
    if (s.ok()) s = (*connection)->Notify(job.notification);
    if (s.ok()) {
      const absl::Time now = absl::Now();
      absl::MutexLock lock(&push.mu_);
      if (push.first_layer_queued_ != absl::InfinitePast()) {
        stats.transfer = now - push.first_layer_queued_;
        stats.transfer_tail = now - push.last_layer_queued_;
      }
    } else {
      Fail(job.push, push.target().endpoint, std::move(s));
    }
  }
  stats.kv_bytes = push.kv_bytes_;
  job.done(push.status(), stats);
}

}  // namespace pdserve
