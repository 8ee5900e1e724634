#include "engine/kv_cache.h"

#include "common/check.h"
#include "absl/strings/str_cat.h"

namespace pdserve {

uint64_t Mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

uint64_t HashBlockTokens(uint64_t parent_hash, std::span<const int32_t> tokens) {
  uint64_t h = Mix64(parent_hash ^ 0x9e3779b97f4a7c15ull);
  for (int32_t t : tokens) h = Mix64(h ^ static_cast<uint32_t>(t));
  return Mix64(h ^ tokens.size());
}

std::vector<uint64_t> PromptBlockHashes(std::span<const int32_t> tokens, int32_t block_size) {
  std::vector<uint64_t> hashes;
  if (block_size <= 0) return hashes;
  const size_t bs = static_cast<size_t>(block_size);
  hashes.reserve(tokens.size() / bs);
  uint64_t parent = 0;
  for (size_t end = bs; end <= tokens.size(); end += bs) {
    parent = HashBlockTokens(parent, tokens.subspan(end - bs, bs));
    hashes.push_back(parent);
  }
  return hashes;
}

KvBlockPool::KvBlockPool(int32_t num_blocks)
    : ref_counts_(num_blocks, 0),
      hashes_(num_blocks, 0),
      has_hash_(num_blocks, false),
      prev_(num_blocks, kNone),
      next_(num_blocks, kNone) {
  PD_CHECK_GE(num_blocks, 0);
  for (int32_t b = 0; b < num_blocks; ++b) PushBackFree(b);
}

void KvBlockPool::Unlink(int32_t b) {
  if (prev_[b] != kNone) next_[prev_[b]] = next_[b]; else head_ = next_[b];
  if (next_[b] != kNone) prev_[next_[b]] = prev_[b]; else tail_ = prev_[b];
  prev_[b] = next_[b] = kNone;
  --num_free_;
}

void KvBlockPool::PushBackFree(int32_t b) {
  prev_[b] = tail_;
  next_[b] = kNone;
  if (tail_ != kNone) next_[tail_] = b; else head_ = b;
  tail_ = b;
  ++num_free_;
}

absl::StatusOr<std::vector<BlockId>> KvBlockPool::Allocate(int32_t n) {
  if (n < 0 || n > num_free_) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "KV cache: ", n, " blocks requested, ", num_free_, " of ",
        num_blocks(), " free"));
  }
  std::vector<BlockId> out;
  out.reserve(n);
  for (int32_t i = 0; i < n; ++i) {
    const int32_t b = head_;
    Unlink(b);
    if (has_hash_[b]) DropHash(b);
    ref_counts_[b] = 1;
    if (listener_ != nullptr) listener_->OnHandedOut(BlockId(b));
    out.push_back(BlockId(b));
  }
  return out;
}

void KvBlockPool::AddRef(BlockId block) {
  PD_CHECK_GT(ref_counts_[block.value], 0) << "AddRef on a free block";
  ++ref_counts_[block.value];
}

void KvBlockPool::Release(BlockId block) {
  const int32_t b = block.value;
  PD_CHECK_GT(ref_counts_[b], 0) << "double release of KV block " << b;
  if (--ref_counts_[b] == 0) {
    PushBackFree(b);
    if (listener_ != nullptr && !has_hash_[b]) listener_->OnFreedEmpty(block);
  }
}

void KvBlockPool::set_listener(KvBlockListener* listener) {
  listener_ = listener;
  if (listener_ == nullptr) return;
  for (int32_t b = head_; b != kNone; b = next_[b]) {
    if (!has_hash_[b]) listener_->OnFreedEmpty(BlockId(b));
  }
}

void KvBlockPool::Release(std::span<const BlockId> blocks) {
  for (BlockId b : blocks) Release(b);
}

void KvBlockPool::SetHash(BlockId block, uint64_t hash) {
  const int32_t b = block.value;
  PD_CHECK_GT(ref_counts_[b], 0);
  if (has_hash_[b]) {
    if (hashes_[b] == hash) return;
    DropHash(b);
  }
  auto [it, inserted] = block_by_hash_.try_emplace(hash, b);
  // A second block with the same content stays unhashed; the first serves.
  has_hash_[b] = inserted;
  if (inserted) {
    hashes_[b] = hash;
    if (record_events_) events_.push_back({KvCacheEvent::Kind::kStored, hash});
  }
}

void KvBlockPool::DropHash(int32_t b) {
  block_by_hash_.erase(hashes_[b]);
  has_hash_[b] = false;
  if (record_events_) events_.push_back({KvCacheEvent::Kind::kEvicted, hashes_[b]});
}

void KvBlockPool::TakeEvents(std::vector<KvCacheEvent>& out) {
  out.insert(out.end(), events_.begin(), events_.end());
  events_.clear();
}

std::vector<uint64_t> KvBlockPool::HeldHashes() const {
  std::vector<uint64_t> out;
  out.reserve(block_by_hash_.size());
  for (const auto& [hash, block] : block_by_hash_) out.push_back(hash);
  return out;
}

std::optional<BlockId> KvBlockPool::LookupPrefix(uint64_t hash) {
  auto it = block_by_hash_.find(hash);
  if (it == block_by_hash_.end()) return std::nullopt;
  const int32_t b = it->second;
  if (ref_counts_[b]++ == 0) Unlink(b);
  return BlockId(b);
}

}  // namespace pdserve
