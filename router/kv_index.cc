#include "router/kv_index.h"

namespace pdserve {

bool KvIndex::Apply(const std::string& worker, int32_t block_size,
                    const internal::v1::KvCacheEvents& events) {
  absl::MutexLock lock(&mu_);
  WorkerBlocks& w = workers_[worker];
  if (events.snapshot()) {
    w.hashes.clear();
    w.hashes.insert(events.stored().begin(), events.stored().end());
  } else if (events.epoch() != w.cursor.epoch ||
             events.after_seq() != w.cursor.seq || w.block_size != block_size) {
    w.hashes.clear();
    w.cursor = Cursor{};
    return false;
  } else {
    for (uint64_t h : events.evicted()) w.hashes.erase(h);
    w.hashes.insert(events.stored().begin(), events.stored().end());
  }
  w.block_size = block_size;
  w.cursor = Cursor{.epoch = events.epoch(), .seq = events.last_seq()};
  return true;
}

void KvIndex::Drop(const std::string& worker) {
  absl::MutexLock lock(&mu_);
  workers_.erase(worker);
}

KvIndex::Cursor KvIndex::CursorOf(const std::string& worker) const {
  absl::ReaderMutexLock lock(&mu_);
  auto it = workers_.find(worker);
  return it == workers_.end() ? Cursor{} : it->second.cursor;
}

int32_t KvIndex::LeadingBlocks(const std::string& worker,
                               std::span<const uint64_t> hashes,
                               int32_t block_size) const {
  absl::ReaderMutexLock lock(&mu_);
  auto it = workers_.find(worker);
  if (it == workers_.end() || it->second.block_size != block_size) return 0;
  int32_t n = 0;
  for (uint64_t h : hashes) {
    if (!it->second.hashes.contains(h)) break;
    ++n;
  }
  return n;
}

size_t KvIndex::num_hashes(const std::string& worker) const {
  absl::ReaderMutexLock lock(&mu_);
  auto it = workers_.find(worker);
  return it == workers_.end() ? 0 : it->second.hashes.size();
}

}  // namespace pdserve
