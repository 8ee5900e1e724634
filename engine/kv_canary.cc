#include "engine/kv_canary.h"

#include "common/log.h"

namespace pdserve {

KvCanary::KvCanary(std::span<std::byte> pool, const KvBlockLayout& layout,
                   int32_t num_blocks)
    : pool_(pool), layout_(layout), num_blocks_(num_blocks),
      filled_(num_blocks, false) {}

void KvCanary::OnFreedEmpty(BlockId block) {
  const size_t length = layout_.layer_block_bytes();
  for (int32_t layer = 0; layer < layout_.num_layers; ++layer) {
    const size_t begin = layout_.PoolOffset(layer, block, num_blocks_);
    for (size_t i = begin; i < begin + length; ++i) pool_[i] = Pattern(i);
  }
  filled_[block.value] = true;
}

void KvCanary::OnHandedOut(BlockId block) {
  if (!filled_[block.value]) return;
  filled_[block.value] = false;
  const size_t length = layout_.layer_block_bytes();
  for (int32_t layer = 0; layer < layout_.num_layers; ++layer) {
    const size_t begin = layout_.PoolOffset(layer, block, num_blocks_);
    for (size_t i = begin; i < begin + length; ++i) {
      if (pool_[i] != Pattern(i)) {
        violations_.fetch_add(1, std::memory_order_relaxed);
        PD_LOG(ERROR) << "KV canary: free block " << block.value
                      << " was written while nobody owned it (layer " << layer
                      << ", byte " << i - begin << ")";
        return;
      }
    }
  }
}

}  // namespace pdserve
