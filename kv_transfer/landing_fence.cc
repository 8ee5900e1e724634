#include "kv_transfer/landing_fence.h"

#include "absl/random/random.h"

namespace pdserve::kv {

LandingFence::LandingFence(bool every_write_fenced, absl::Duration quarantine)
    : every_write_fenced_(every_write_fenced), quarantine_(quarantine) {
  absl::BitGen random;
  next_id_ = absl::Uniform<uint64_t>(random, 1, uint64_t{1} << 62);
}

uint64_t LandingFence::Open() {
  absl::MutexLock lock(&mu_);
  const uint64_t id = next_id_++;
  landings_[id] = Landing{};
  return id;
}

void LandingFence::SenderDone(uint64_t landing) {
  absl::MutexLock lock(&mu_);
  if (auto it = landings_.find(landing); it != landings_.end()) {
    it->second.sender_done = true;
  }
}

bool LandingFence::Close(uint64_t landing, absl::Time now) {
  absl::MutexLock lock(&mu_);
  if (auto it = landings_.find(landing); it != landings_.end() && it->second.open) {
    it->second.open = false;
    it->second.closed = now;
  }
  return FencedLocked(landing, now);
}

bool LandingFence::Fenced(uint64_t landing, absl::Time now) {
  absl::MutexLock lock(&mu_);
  return FencedLocked(landing, now);
}

bool LandingFence::FencedLocked(uint64_t landing, absl::Time now) {
  auto it = landings_.find(landing);
  if (it == landings_.end()) return true;
  const Landing& l = it->second;
  if (l.open) return false;
  const bool fenced = l.sender_done ||
                      (every_write_fenced_ && l.writes_in_progress == 0) ||
                      now - l.closed >= quarantine_;
  if (fenced) landings_.erase(it);
  return fenced;
}

bool LandingFence::BeginWrite(uint64_t landing) {
  absl::MutexLock lock(&mu_);
  auto it = landings_.find(landing);
  if (it == landings_.end() || !it->second.open) {
    ++dropped_writes_;
    return false;
  }
  ++it->second.writes_in_progress;
  return true;
}

void LandingFence::EndWrite(uint64_t landing) {
  absl::MutexLock lock(&mu_);
  if (auto it = landings_.find(landing); it != landings_.end()) {
    --it->second.writes_in_progress;
  }
}

uint64_t LandingFence::dropped_writes() const {
  absl::MutexLock lock(&mu_);
  return dropped_writes_;
}

size_t LandingFence::tracked() const {
  absl::MutexLock lock(&mu_);
  return landings_.size();
}

}  // namespace pdserve::kv
