// KvCanary: proof that nothing writes into free KV blocks. Every block that
// becomes free without content worth keeping is filled with a canary
// pattern, and the pattern is checked when the block is handed out again;
// a block whose pattern changed meanwhile was written while nobody owned it
// (a late KV write into a released landing, say) and counts as a
// violation. For tests and fault drills (--kv_canary): the fill and the
// check cost a pass over the block's bytes each.
//
// Host pools only. Thread-safety: the listener calls come from the pool's
// owner (the engine loop); violations() from any thread.
#ifndef PDSERVE_ENGINE_KV_CANARY_H_
#define PDSERVE_ENGINE_KV_CANARY_H_

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "engine/kv_cache.h"
#include "engine/kv_layout.h"

namespace pdserve {

class KvCanary final : public KvBlockListener {
 public:
  // `pool`: num_blocks blocks laid out as `layout`, in host memory.
  KvCanary(std::span<std::byte> pool, const KvBlockLayout& layout,
           int32_t num_blocks);

  void OnFreedEmpty(BlockId block) override;
  void OnHandedOut(BlockId block) override;

  // Blocks found written while free, since the start.
  int64_t violations() const {
    return violations_.load(std::memory_order_relaxed);
  }

 private:
  // The pattern byte at `offset` of the pool: varies with the offset, so a
  // write of the same constant everywhere or a block copied onto another
  // is caught too.
  static std::byte Pattern(size_t offset) {
    return static_cast<std::byte>((offset * 0x9Du + 0x5Bu) >> 3);
  }

  const std::span<std::byte> pool_;
  const KvBlockLayout layout_;
  const int32_t num_blocks_;
  // Blocks holding the pattern now.
  std::vector<bool> filled_;
  std::atomic<int64_t> violations_ = 0;
};

}  // namespace pdserve

#endif  // PDSERVE_ENGINE_KV_CANARY_H_
