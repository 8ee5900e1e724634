// The byte layout of the paged KV cache. This header is the KV wire
// contract: kv_transfer moves blocks between workers byte for byte, so a
// prefill worker and a decode worker agree on a layout iff their
// KvBlockLayout values are equal.
//
// A KV pool holds `num_blocks` blocks for every layer. It is one allocation,
// laid out layer-major so that each layer's blocks form one contiguous
// region (a prefill worker ships a layer as soon as it is computed):
//
//   pool = layer[0] | layer[1] | ... | layer[num_layers - 1]
//   layer[l] = block[0] | block[1] | ... | block[num_blocks - 1]
//   block (one layer) = K | V
//   K = V = slot[0] | ... | slot[block_size - 1]     (one slot per token)
//   slot = kv_head[0] | ... | kv_head[num_kv_heads - 1]
//   kv_head = head_dim elements of `dtype`, little-endian
//
// K is stored after RoPE. Slot s of block b holds the token at position
// p with p / block_size == (index of b in the sequence's block table) and
// p % block_size == s.
#ifndef PDSERVE_ENGINE_KV_LAYOUT_H_
#define PDSERVE_ENGINE_KV_LAYOUT_H_

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "common/strong_id.h"
#include "engine/dtype.h"

namespace pdserve {

// Blocks of `block_size` tokens it takes to hold `tokens` tokens: the one
// rounding every reservation, block table and landing check uses.
inline int64_t BlocksForTokens(int64_t tokens, int64_t block_size) {
  return (tokens + block_size - 1) / block_size;
}

using BlockId = StrongId<struct BlockIdTag, int32_t>;

struct KvBlockLayout {
  int32_t num_layers = 0;
  int32_t num_kv_heads = 0;
  int32_t head_dim = 0;
  int32_t block_size = 16;  // Tokens per block.
  DType dtype = DType::kF32;

  // Bytes of one token's K (or V) in one layer.
  size_t slot_bytes() const {
    return static_cast<size_t>(num_kv_heads) * head_dim * DTypeSize(dtype);
  }
  // Bytes of one block in one layer (K and V).
  size_t layer_block_bytes() const { return 2 * block_size * slot_bytes(); }
  // Bytes of one block across all layers.
  size_t block_bytes() const { return layer_block_bytes() * num_layers; }

  // Offsets inside one layer block.
  size_t KeyOffset(int slot, int kv_head) const {
    return slot * slot_bytes() + kv_head * head_dim * DTypeSize(dtype);
  }
  size_t ValueOffset(int slot, int kv_head) const {
    return block_size * slot_bytes() + KeyOffset(slot, kv_head);
  }

  // Offset of (layer, block) inside a pool of `num_blocks` blocks.
  size_t PoolOffset(int layer, BlockId block, int32_t num_blocks) const {
    return (static_cast<size_t>(layer) * num_blocks + block.value) *
           layer_block_bytes();
  }

  bool operator==(const KvBlockLayout&) const = default;
};

// Maps the K/V bytes that positions [begin, end) of one sequence occupy in
// `layer` of one pool (block table `src`, `src_num_blocks` blocks) onto the
// same positions in another pool with the same layout (block table `dst`,
// `dst_num_blocks` blocks): calls fn(src_offset, dst_offset, length) once
// for K and once for V of every block the range touches. Both tables must
// cover position end - 1.
template <typename Fn>
void ForEachKvRange(const KvBlockLayout& layout, int32_t layer, const BlockId* src,
                    int32_t src_num_blocks, const BlockId* dst, int32_t dst_num_blocks,
                    int32_t begin, int32_t end, Fn&& fn) {
  const int32_t bs = layout.block_size;
  for (int32_t pos = begin; pos < end;) {
    const int32_t index = pos / bs;
    const int32_t first = pos % bs;
    const int32_t last = std::min(bs, first + (end - pos));  // Slots [first, last).
    const size_t length = static_cast<size_t>(last - first) * layout.slot_bytes();
    const size_t src_block = layout.PoolOffset(layer, src[index], src_num_blocks);
    const size_t dst_block = layout.PoolOffset(layer, dst[index], dst_num_blocks);
    fn(src_block + layout.KeyOffset(first, 0), dst_block + layout.KeyOffset(first, 0), length);
    fn(src_block + layout.ValueOffset(first, 0), dst_block + layout.ValueOffset(first, 0), length);
    pos += last - first;
  }
}

}  // namespace pdserve

#endif  // PDSERVE_ENGINE_KV_LAYOUT_H_
