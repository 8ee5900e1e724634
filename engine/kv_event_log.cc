#include "engine/kv_event_log.h"

#include <algorithm>
#include <random>

#include "absl/container/flat_hash_map.h"

namespace pdserve {
namespace {

uint64_t RandomEpoch() {
  std::random_device rd;
  uint64_t e = 0;
  while (e == 0) e = (uint64_t{rd()} << 32) ^ rd();
  return e;
}

}  // namespace

KvEventLog::KvEventLog(const Options& options)
    : options_{.capacity = std::max<size_t>(options.capacity, 1),
               .max_report_hashes = std::max<size_t>(options.max_report_hashes, 1)},
      epoch_(RandomEpoch()) {}

void KvEventLog::Append(std::span<const KvCacheEvent> events) {
  if (events.empty()) return;
  absl::MutexLock lock(&mu_);
  for (const KvCacheEvent& e : events) {
    if (e.kind == KvCacheEvent::Kind::kStored) {
      held_.insert(e.hash);
    } else {
      held_.erase(e.hash);
    }
    events_.push_back(e);
    ++last_seq_;
  }
  while (events_.size() > options_.capacity) {
    events_.pop_front();
    ++first_seq_;
  }
}

KvEventsReport KvEventLog::ReportSince(uint64_t epoch, uint64_t seq) const {
  KvEventsReport report;
  report.epoch = epoch_;
  absl::MutexLock lock(&mu_);
  // The cursor is usable when it is ours and no event after it was dropped.
  if (epoch != epoch_ || seq > last_seq_ || seq + 1 < first_seq_) {
    report.snapshot = true;
    report.last_seq = last_seq_;
    report.stored.reserve(std::min(held_.size(), options_.max_report_hashes));
    for (uint64_t h : held_) {
      if (report.stored.size() == options_.max_report_hashes) {
        report.truncated = true;
        break;
      }
      report.stored.push_back(h);
    }
    return report;
  }
  report.after_seq = seq;
  const uint64_t n = std::min<uint64_t>(last_seq_ - seq, options_.max_report_hashes);
  report.last_seq = seq + n;
  // Net effect per hash: its last event wins.
  absl::flat_hash_map<uint64_t, KvCacheEvent::Kind> last;
  const size_t begin = static_cast<size_t>(seq + 1 - first_seq_);
  for (size_t i = begin; i < begin + n; ++i) last[events_[i].hash] = events_[i].kind;
  for (const auto& [hash, kind] : last) {
    (kind == KvCacheEvent::Kind::kStored ? report.stored : report.evicted).push_back(hash);
  }
  return report;
}

}  // namespace pdserve
