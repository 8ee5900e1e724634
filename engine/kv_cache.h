// KvBlockPool: the metadata of a paged KV cache — which blocks are free,
// their reference counts, and content hashes for prefix reuse. The bytes
// live elsewhere (a backend's KV storage, laid out as in kv_layout.h); this
// class never touches them, so one pool type serves host and device memory.
//
// A block is either in use (ref count > 0) or free. A free block that still
// carries a content hash keeps its KV and can be revived by LookupPrefix
// until it is handed out again; free blocks are reused least recently freed
// first, so cached prefixes survive as long as possible.
//
// Prefix-cache events: with set_record_events(true) the pool records every
// change to the set of hashes it holds (free blocks included, since they
// can be revived): kStored when a block gets a hash no other block holds,
// kEvicted when a block carrying a hash is handed out anew or given another
// hash. The owner drains them with TakeEvents (KvEventLog publishes them to
// the router). A hash is held by at most one block, so the events of one
// hash alternate stored, evicted, stored, ...
//
// Thread-safety: none. One thread (the engine loop) owns a pool.
#ifndef PDSERVE_ENGINE_KV_CACHE_H_
#define PDSERVE_ENGINE_KV_CACHE_H_

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "engine/kv_layout.h"

namespace pdserve {

// The splitmix64 finalizer: a bijection of 64-bit values that spreads every
// input bit over the output. The mixing step of the block hashes below.
uint64_t Mix64(uint64_t x);

// Content hash of a full block: a function of the hash of the block before
// it in the sequence (0 for the first) and the block's tokens. Stable across
// processes and machines, so routers and workers agree on prefix hashes.
uint64_t HashBlockTokens(uint64_t parent_hash, std::span<const int32_t> tokens);

// The hash chain of `tokens`' full blocks of `block_size` tokens: entry i is
// the hash of the tokens up to the end of block i (a partial last block has
// none). What the Generator registers prompts under and the router matches
// prompts against.
std::vector<uint64_t> PromptBlockHashes(std::span<const int32_t> tokens, int32_t block_size);

// A change to the set of content hashes a KvBlockPool holds.
struct KvCacheEvent {
  enum class Kind : uint8_t { kStored, kEvicted };
  Kind kind = Kind::kStored;
  uint64_t hash = 0;
  friend bool operator==(const KvCacheEvent&, const KvCacheEvent&) = default;
};

// Told when a block becomes free with no content worth keeping (no
// content hash) and when a free block is handed out anew (KvCanary).
class KvBlockListener {
 public:
  virtual ~KvBlockListener() = default;
  virtual void OnFreedEmpty(BlockId block) = 0;
  virtual void OnHandedOut(BlockId block) = 0;
};

class KvBlockPool {
 public:
  explicit KvBlockPool(int32_t num_blocks);

  int32_t num_blocks() const { return static_cast<int32_t>(ref_counts_.size()); }
  int32_t num_free() const { return num_free_; }

  // Hands out `n` blocks with ref count 1, all or nothing.
  // RESOURCE_EXHAUSTED when fewer than `n` are free.
  absl::StatusOr<std::vector<BlockId>> Allocate(int32_t n);
  // Adds a reference to an in-use block (a sequence sharing a prefix).
  void AddRef(BlockId block);
  // Drops a reference; at zero the block becomes free (keeping its hash).
  void Release(BlockId block);
  void Release(std::span<const BlockId> blocks);

  // Marks a full, in-use block as holding the content `hash`.
  void SetHash(BlockId block, uint64_t hash);
  // Returns the block holding `hash` with one more reference (reviving it if
  // it was free), or nullopt.
  std::optional<BlockId> LookupPrefix(uint64_t hash);

  int32_t ref_count(BlockId block) const { return ref_counts_[block.value]; }

  // Tells `listener` (which must outlive the pool; null: nobody) of blocks
  // freed empty and handed out from now on, after an OnFreedEmpty for every
  // block that is free and empty now.
  void set_listener(KvBlockListener* listener);

  // Starts or stops recording prefix-cache events. Default: off (nothing
  // is kept for an owner that never drains them).
  void set_record_events(bool on) { record_events_ = on; }
  // Appends the events recorded since the last call to `out`, in order.
  void TakeEvents(std::vector<KvCacheEvent>& out);
  // Every hash the pool holds now, in no particular order.
  std::vector<uint64_t> HeldHashes() const;

 private:
  static constexpr int32_t kNone = -1;
  void Unlink(int32_t b);
  void PushBackFree(int32_t b);
  // Drops block b's hash (which it holds), recording kEvicted.
  void DropHash(int32_t b);

  KvBlockListener* listener_ = nullptr;

  std::vector<int32_t> ref_counts_;
  std::vector<uint64_t> hashes_;
  std::vector<bool> has_hash_;
  // Free blocks as an intrusive doubly-linked list, oldest first.
  std::vector<int32_t> prev_, next_;
  int32_t head_ = kNone, tail_ = kNone;
  int32_t num_free_ = 0;
  absl::flat_hash_map<uint64_t, int32_t> block_by_hash_;
  bool record_events_ = false;
  std::vector<KvCacheEvent> events_;
};

}  // namespace pdserve

#endif  // PDSERVE_ENGINE_KV_CACHE_H_
