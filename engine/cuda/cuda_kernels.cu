// The CUDA backend's kernels (see cuda_kernels.h). One translation unit on
// purpose: CI compiles it on two cores, so the kernels take the head size
// at run time instead of being instantiated per shape.
#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>

#include "engine/cuda/cuda_kernels.h"

// The kernels also compile as plain C++ against a CPU emulation of the CUDA
// execution model (tests/engine/cuda/cuda_emulation.h, included first), so
// that CI without a GPU runs them; launches and shared memory go through
// these macros for that.
#ifndef PDSERVE_CUDA_EMULATION
#define PD_LAUNCH(kernel, grid, block, smem, stream, ...) \
  kernel<<<grid, block, smem, stream>>>(__VA_ARGS__)
#define PD_LAUNCH_ERROR() cudaGetLastError()
#define PD_SHARED_ARRAY(type, name, n) __shared__ type name[n]
#define PD_DYNAMIC_SHARED(type, name) \
  extern __shared__ __align__(128) type name[]
#endif

namespace pdserve::cuda {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ float Bf16Bits(uint32_t bits16) {
  return __uint_as_float(bits16 << 16);
}

__device__ __forceinline__ uint16_t ToBf16(float f) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}

// The tensor-core and asynchronous-copy instructions of the prefill
// attention (sm_80 and newer), as the PTX ISA documents them; the
// emulation has its own with the same register layouts.
#ifdef PDSERVE_CUDA_EMULATION
using emu::CpAsync16;
using emu::CpAsyncCommit;
using emu::CpAsyncWaitAll;
using emu::LdMatrixX4;
using emu::LdMatrixX4Trans;
using emu::MmaM16n8k16;
#else
// d += a b for a 16x16 bf16 A (row-major), a 16x8 bf16 B (column-major)
// and a 16x8 fp32 D; which lane holds which element: cuda_emulation.h.
__device__ __forceinline__ void MmaM16n8k16(float (&d)[4],
                                            const uint32_t (&a)[4],
                                            const uint32_t (&b)[2]) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Four 8x8 bf16 matrices from shared memory; lanes 8i..8i+7 give the
// addresses of matrix i's rows (16 bytes each, 16-byte aligned).
__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const void* row) {
  const auto addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile(
      "ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
      : "r"(addr));
}

// The same, transposed.
__device__ __forceinline__ void LdMatrixX4Trans(uint32_t (&r)[4],
                                                const void* row) {
  const auto addr = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile(
      "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, "
      "[%4];\n"
      : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
      : "r"(addr));
}

// 16 bytes from global to shared memory without the registers, zeros when
// !valid (global is then not read).
__device__ __forceinline__ void CpAsync16(void* shared, const void* global,
                                          bool valid) {
  const auto addr = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(addr),
               "l"(global), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void CpAsyncCommit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
__device__ __forceinline__ void CpAsyncWaitAll() {
  asm volatile("cp.async.wait_all;\n" ::: "memory");
}
#endif

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

__device__ __forceinline__ float WarpMax(float v) {
  for (int o = 16; o > 0; o >>= 1) {
    v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  }
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every
// thread gets the result. `scratch` holds 32 floats.
__device__ float BlockSum(float v, float* scratch) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  v = WarpSum(v);
  __syncthreads();  // scratch may still be read from a previous call.
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  const int warps = blockDim.x / 32;
  v = lane < warps ? scratch[lane] : 0.0f;
  return WarpSum(v);
}

__global__ void EmbeddingKernel(const uint16_t* table, int64_t hidden,
                                const int32_t* ids, float* out) {
  const int64_t t = blockIdx.x;
  const uint16_t* row = table + static_cast<int64_t>(ids[t]) * hidden;
  for (int64_t i = threadIdx.x; i < hidden; i += blockDim.x) {
    out[t * hidden + i] = Bf16Bits(row[i]);
  }
}

__global__ void RmsNormKernel(const float* x, const int32_t* rows, int64_t n,
                              const float* weight, float eps, uint16_t* out) {
  PD_SHARED_ARRAY(float, scratch, 32);
  const int64_t r = rows != nullptr ? rows[blockIdx.x] : blockIdx.x;
  const float* xr = x + r * n;
  float ss = 0.0f;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) ss += xr[i] * xr[i];
  ss = BlockSum(ss, scratch);
  const float inv = rsqrtf(ss / static_cast<float>(n) + eps);
  uint16_t* o = out + static_cast<int64_t>(blockIdx.x) * n;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    o[i] = ToBf16(weight[i] * (xr[i] * inv));
  }
}

// Row blockIdx.y, elements blockIdx.x * blockDim.x + threadIdx.x: no
// 64-bit division per element (it made this kernel compute-bound).
__global__ void SiluMulKernel(const float* gate_up, int64_t n, uint16_t* out) {
  const int64_t r = blockIdx.y;
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const float g = gate_up[r * 2 * n + i];
  const float u = gate_up[r * 2 * n + n + i];
  out[r * n + i] = ToBf16(g / (1.0f + expf(-g)) * u);
}

// One warp per head of one token (blockIdx.x), kRopeHeadsPerBlock heads
// per block along blockIdx.y, over the q, k and v heads of the row: a
// warp adds the head's bias, then for q and k heads normalizes it (with a
// head norm, fp32 in place, as RmsNormKernel does a hidden row: RoPE and
// the attention's q read fp32) and rotates it. Everything a warp does is
// within its head, so a decode step of one token still spreads over
// several multiprocessors.
constexpr int kRopeHeadsPerBlock = 4;

__global__ void BiasRopeKernel(float* qkv, int64_t row_stride,
                               const int32_t* positions, const float* inv_freq,
                               int num_heads, int rotated_heads, int all_heads,
                               int head_dim, const float* bias, HeadNorm norm,
                               bool adjacent_pairs) {
  const int lane = threadIdx.x % 32;
  const int h = blockIdx.y * kRopeHeadsPerBlock + threadIdx.x / 32;
  if (h >= all_heads) return;  // Warp-uniform; no block barrier below.
  float* v = qkv + static_cast<int64_t>(blockIdx.x) * row_stride +
             static_cast<int64_t>(h) * head_dim;
  if (bias != nullptr) {
    const float* b = bias + static_cast<int64_t>(h) * head_dim;
    for (int i = lane; i < head_dim; i += 32) v[i] += b[i];
    __syncwarp();
  }
  if (h >= rotated_heads) return;  // A v head: bias only.
  if (norm.q_weight != nullptr) {
    const float* weight = h < num_heads ? norm.q_weight : norm.k_weight;
    float ss = 0.0f;
    for (int i = lane; i < head_dim; i += 32) ss += v[i] * v[i];
    ss = WarpSum(ss);
    const float inv = rsqrtf(ss / static_cast<float>(head_dim) + norm.eps);
    for (int i = lane; i < head_dim; i += 32) v[i] = weight[i] * (v[i] * inv);
    __syncwarp();
  }
  const int half = head_dim / 2;
  const float pos = static_cast<float>(positions[blockIdx.x]);
  for (int i = lane; i < half; i += 32) {
    const int a = adjacent_pairs ? 2 * i : i;
    const int b = adjacent_pairs ? 2 * i + 1 : i + half;
    const float angle = pos * inv_freq[i];  // fp32, as the CPU backend.
    double s, c;
    sincos(static_cast<double>(angle), &s, &c);
    const float cs = static_cast<float>(c), sn = static_cast<float>(s);
    const float x0 = v[a], x1 = v[b];
    v[a] = x0 * cs - x1 * sn;
    v[b] = x1 * cs + x0 * sn;
  }
}

__global__ void WriteKvKernel(const float* qkv, int64_t row_stride,
                              int64_t k_offset, int64_t v_offset,
                              const int64_t* slots, PagedKvLayer kv) {
  const int64_t kv_dim = static_cast<int64_t>(kv.num_kv_heads) * kv.head_dim;
  const int64_t slot = slots[blockIdx.x];
  if (slot < 0) return;  // Padding of a captured batch: store nothing.
  const int64_t first = static_cast<int64_t>(blockIdx.y) * blockDim.x;
  const int64_t block = slot / kv.block_size, s = slot % kv.block_size;
  uint16_t* k = kv.base + block * 2 * kv.block_size * kv_dim + s * kv_dim;
  uint16_t* v = k + kv.block_size * kv_dim;
  const float* row = qkv + static_cast<int64_t>(blockIdx.x) * row_stride;
  for (int64_t i = first + threadIdx.x; i < kv_dim;
       i += static_cast<int64_t>(gridDim.y) * blockDim.x) {
    k[i] = ToBf16(row[k_offset + i]);
    v[i] = ToBf16(row[v_offset + i]);
  }
}

// How far a key's value is from the key in the paged pool: a block holds
// block_size keys, then their values (engine/kv_layout.h).
__device__ __forceinline__ int64_t ValueOffset(const PagedKvLayer& kv) {
  return static_cast<int64_t>(kv.block_size) * kv.num_kv_heads * kv.head_dim;
}

// Element d of kv head `kvh` of key `pos` in the layer's paged pool (the
// sequence's block table `table`); its value is ValueOffset further.
__device__ __forceinline__ const uint16_t* KeyAt(const AttentionParams& p,
                                                 const int32_t* table, int kvh,
                                                 int pos, int d) {
  const int64_t kv_dim =
      static_cast<int64_t>(p.kv.num_kv_heads) * p.kv.head_dim;
  const int bs = p.kv.block_size;
  return p.kv.base + table[pos / bs] * 2 * ValueOffset(p.kv) +
         static_cast<int64_t>(pos % bs) * kv_dim +
         static_cast<int64_t>(kvh) * p.kv.head_dim + d;
}

// The first key a query at position `pos` sees: 0, or the start of its
// sliding window.
__device__ __forceinline__ int WindowStart(const AttentionParams& p, int pos) {
  return p.sliding_window > 0 ? max(0, pos - p.sliding_window + 1) : 0;
}

// The keys [lo, hi] that any row of `tile` may see within context split
// `split`: causal, the sliding window of its first row, the split's share.
struct KeyRange {
  int lo, hi;
};
__device__ __forceinline__ KeyRange TileKeys(const AttentionParams& p,
                                             const AttentionTile& tile,
                                             const AttentionSequence& seq,
                                             int group, int split) {
  const int first_pos = seq.start_pos + tile.first_row / group;
  const int last_pos =
      seq.start_pos + (tile.first_row + tile.num_rows - 1) / group;
  KeyRange keys{WindowStart(p, first_pos), last_pos};
  if (p.num_splits > 1) {
    // Each sequence's context is split evenly, by its own length.
    const int split_len =
        (seq.start_pos + seq.num_tokens + p.num_splits - 1) / p.num_splits;
    keys.lo = max(keys.lo, split * split_len);
    keys.hi = min(keys.hi, (split + 1) * split_len - 1);
  }
  return keys;
}

// Loads the K and V rows of keys k0 .. k0 + kKeys - 1 of kv head `kvh`
// (zero past key_hi) as 16-byte vectors, kVecs per thread of a
// kThreads-thread block: vector i of this thread is element
// e = threadIdx.x + i * kThreads, key e / (D / 8), dims (e % (D / 8)) * 8.
// Every load is issued before any is used, so that the block has the whole
// tile in flight. D % 8 == 0.
template <int kKeys, int kThreads, int kVecs>
__device__ __forceinline__ void LoadKvVectors(const AttentionParams& p,
                                              const int32_t* table, int kvh,
                                              int k0, int key_hi,
                                              uint4 (&kb)[kVecs],
                                              uint4 (&vb)[kVecs]) {
  const int chunks = p.kv.head_dim / 8;
  const int64_t v_offset = ValueOffset(p.kv);
#pragma unroll
  for (int i = 0; i < kVecs; ++i) {
    const int e = threadIdx.x + i * kThreads;
    const int j = e / chunks, d = (e % chunks) * 8;
    const int pos = k0 + j;
    kb[i] = make_uint4(0, 0, 0, 0);
    vb[i] = make_uint4(0, 0, 0, 0);
    if (j < kKeys && pos <= key_hi) {
      const uint16_t* kp = KeyAt(p, table, kvh, pos, d);
      kb[i] = *reinterpret_cast<const uint4*>(kp);
      vb[i] = *reinterpret_cast<const uint4*>(kp + v_offset);
    }
  }
}

// Paged attention. A block takes one tile (up to kAttentionTileRows
// (token, head) rows of one sequence that share kv head blockIdx.y) and
// one context split (blockIdx.z). It walks the split's keys in tiles of
// kAttentionKeyTile: the tile's K and V are staged in shared memory as
// fp32, lane j of a warp scores key j against one row, and the warp keeps
// that row's running max, sum and output (lane owns dims lane + 32 i).
constexpr int kAttentionWarps = 4;
constexpr int kRowsPerWarp = kAttentionTileRows / kAttentionWarps;
constexpr int kDimsPerLane = kMaxHeadDim / 32;
constexpr float kLog2e = 1.4426950408889634f;
// 16-byte K (and V) loads per thread for a key tile at the largest head.
constexpr int kStageVecs =
    kAttentionKeyTile * kMaxHeadDim / 8 / (kAttentionWarps * 32);

__global__ void __launch_bounds__(kAttentionWarps * 32)
    PagedAttentionKernel(AttentionParams p) {
  PD_DYNAMIC_SHARED(float, smem);
  const int D = p.kv.head_dim;
  constexpr int R = kAttentionTileRows, BK = kAttentionKeyTile;
  float* qs = smem;               // [R][D], pre-scaled by scale * log2(e).
  float* ks = qs + R * D;         // [BK][D + 1]; the pad avoids conflicts.
  float* vs = ks + BK * (D + 1);  // [BK][D]
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;

  const AttentionTile tile = p.tiles[blockIdx.x];
  const AttentionSequence seq = p.sequences[tile.seq];
  const int kvh = blockIdx.y;
  const int split = blockIdx.z;
  const int group = p.num_heads / p.kv.num_kv_heads;
  const int32_t* table = p.block_tables + seq.block_offset;
  const KeyRange keys = TileKeys(p, tile, seq, group, split);
  const int key_lo = keys.lo, key_hi = keys.hi;

  const float qscale = p.scale * kLog2e;
  for (int e = threadIdx.x; e < R * D; e += blockDim.x) {
    const int r = e / D, d = e % D;
    float v = 0.0f;
    if (r < tile.num_rows) {
      const int row = tile.first_row + r;
      const int64_t t = seq.token_offset + row / group;
      const int h = kvh * group + row % group;
      v = p.q[t * p.q_row_stride + static_cast<int64_t>(h) * D + d] * qscale;
    }
    qs[e] = v;
  }

  float m[kRowsPerWarp], l[kRowsPerWarp], acc[kRowsPerWarp][kDimsPerLane];
#pragma unroll
  for (int j = 0; j < kRowsPerWarp; ++j) {
    m[j] = -INFINITY;
    l[j] = 0.0f;
#pragma unroll
    for (int i = 0; i < kDimsPerLane; ++i) acc[j][i] = 0.0f;
  }

  const int half_d = D / 2;
  for (int k0 = key_lo; k0 <= key_hi; k0 += BK) {
    __syncthreads();  // Previous tile consumed (and qs written).
    if (D % 8 == 0) {
      // 16-byte loads, every one of a thread's issued before the first is
      // used, so that the block has its whole tile in flight at once (a
      // decode step is bound by these reads).
      const int chunks = D / 8;
      uint4 kb[kStageVecs], vb[kStageVecs];
      LoadKvVectors<kAttentionKeyTile, kAttentionWarps * 32>(p, table, kvh, k0,
                                                             key_hi, kb, vb);
#pragma unroll
      for (int i = 0; i < kStageVecs; ++i) {
        const int e = threadIdx.x + i * kAttentionWarps * 32;
        const int j = e / chunks, d = (e % chunks) * 8;
        if (j >= BK) continue;
        const uint32_t kw[4] = {kb[i].x, kb[i].y, kb[i].z, kb[i].w};
        const uint32_t vw[4] = {vb[i].x, vb[i].y, vb[i].z, vb[i].w};
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          ks[j * (D + 1) + d + 2 * w] = Bf16Bits(kw[w] & 0xffffu);
          ks[j * (D + 1) + d + 2 * w + 1] =
              __uint_as_float(kw[w] & 0xffff0000u);
          vs[j * D + d + 2 * w] = Bf16Bits(vw[w] & 0xffffu);
          vs[j * D + d + 2 * w + 1] = __uint_as_float(vw[w] & 0xffff0000u);
        }
      }
    } else {
      for (int e = threadIdx.x; e < BK * half_d; e += blockDim.x) {
        const int j = e / half_d, d = (e % half_d) * 2;
        const int pos = k0 + j;
        uint32_t kb = 0, vb = 0;
        if (pos <= key_hi) {
          const uint16_t* kp = KeyAt(p, table, kvh, pos, d);
          kb = *reinterpret_cast<const uint32_t*>(kp);
          vb = *reinterpret_cast<const uint32_t*>(kp + ValueOffset(p.kv));
        }
        ks[j * (D + 1) + d] = Bf16Bits(kb & 0xffffu);
        ks[j * (D + 1) + d + 1] = __uint_as_float(kb & 0xffff0000u);
        vs[j * D + d] = Bf16Bits(vb & 0xffffu);
        vs[j * D + d + 1] = __uint_as_float(vb & 0xffff0000u);
      }
    }
    __syncthreads();
#pragma unroll
    for (int j = 0; j < kRowsPerWarp; ++j) {
      const int r = j * kAttentionWarps + warp;  // Spread short tiles.
      if (r < tile.num_rows) {                   // Warp-uniform.
        const int pos = seq.start_pos + (tile.first_row + r) / group;
        const int lo = WindowStart(p, pos);
        const int key = k0 + lane;
        float s = -INFINITY;
        if (key >= lo && key <= pos && key <= key_hi) {
          const float* qr = qs + r * D;
          const float* kr = ks + lane * (D + 1);
          // Four independent sums, so that the loads and FMAs of a
          // lane's dot product overlap instead of waiting on each other.
          float dot0 = 0.0f, dot1 = 0.0f, dot2 = 0.0f, dot3 = 0.0f;
          int d = 0;
#pragma unroll 4
          for (; d + 4 <= D; d += 4) {
            dot0 = fmaf(qr[d], kr[d], dot0);
            dot1 = fmaf(qr[d + 1], kr[d + 1], dot1);
            dot2 = fmaf(qr[d + 2], kr[d + 2], dot2);
            dot3 = fmaf(qr[d + 3], kr[d + 3], dot3);
          }
          for (; d < D; ++d) dot0 = fmaf(qr[d], kr[d], dot0);
          s = (dot0 + dot1) + (dot2 + dot3);
        }
        const float tile_max = WarpMax(s);
        if (tile_max != -INFINITY) {
          const float m_new = fmaxf(m[j], tile_max);
          const float corr = exp2f(m[j] - m_new);
          const float prob = exp2f(s - m_new);
          l[j] = l[j] * corr + WarpSum(prob);
          m[j] = m_new;
#pragma unroll
          for (int i = 0; i < kDimsPerLane; ++i) acc[j][i] *= corr;
          for (int kk = 0; kk < BK; ++kk) {
            const float pk = __shfl_sync(kFullMask, prob, kk);
            const float* vr = vs + kk * D;
#pragma unroll
            for (int i = 0; i < kDimsPerLane; ++i) {
              const int d = lane + 32 * i;
              if (d < D) acc[j][i] = fmaf(pk, vr[d], acc[j][i]);
            }
          }
        }
      }
    }
  }

#pragma unroll
  for (int j = 0; j < kRowsPerWarp; ++j) {
    const int r = j * kAttentionWarps + warp;
    if (r >= tile.num_rows) continue;
    const int row = tile.first_row + r;
    const int64_t t = seq.token_offset + row / group;
    const int h = kvh * group + row % group;
    if (p.num_splits == 1) {
      const float inv = l[j] > 0.0f ? 1.0f / l[j] : 0.0f;
      uint16_t* o = p.out + (t * p.num_heads + h) * D;
#pragma unroll
      for (int i = 0; i < kDimsPerLane; ++i) {
        const int d = lane + 32 * i;
        if (d < D) o[d] = ToBf16(acc[j][i] * inv);
      }
    } else {
      float* w = p.workspace +
                 ((split * p.num_tokens + t) * p.num_heads + h) * (D + 2);
#pragma unroll
      for (int i = 0; i < kDimsPerLane; ++i) {
        const int d = lane + 32 * i;
        if (d < D) w[d] = acc[j][i];
      }
      if (lane == 0) {
        w[D] = m[j];
        w[D + 1] = l[j];
      }
    }
  }
}

constexpr int kMmaWarps = 4;

// Paged attention on tensor cores, for prefill, in the manner of
// FlashAttention-2. A block takes one tile of up to kMmaTileRows (token,
// head) rows sharing kv head blockIdx.y, and one context split; each of its
// four warps owns 16 rows. Keys go in steps of kMmaKeys, copied into shared
// memory with cp.async: a step's V while its S is computed, the next step's
// K while P V is (one buffer each). Each warp keeps everything of its rows
// in registers: S = Q K^T from mma.sync m16n8k16 (bf16 in, fp32 out), the
// scale, the causal / window mask and the online softmax on S where it lies
// (a row's scores spread over the four lanes of a quad), P taken from S's
// registers as bf16 for P V, Q's and K's fragments loaded by ldmatrix, V's
// transposed, and the fp32 output accumulated over every step. kMaxD (64, 128 or 256) sizes the
// output registers; the head dim is kMaxD when kExactD (every loop over it
// then unrolls without a branch), else any multiple of 16 up to it.
constexpr int kMmaKeys = 64;  // Keys per step.
static_assert(kMmaTileRows == kMmaWarps * 16, "a warp owns 16 rows");

struct MmaSmem {
  // bf16 per row of Q, K and V: the head and 8 more, so that the 32-bit
  // fragment reads of a warp (8 rows, 4 columns) and ldmatrix's 8 rows
  // fall in 32 different banks.
  int ld;
  // Byte offsets: Q, then a step's K, then its V (one buffer each, so that
  // three blocks fit an SM's shared memory at head dim 128).
  size_t k, v, bytes;
  __host__ __device__ explicit MmaSmem(int d) {
    ld = d + 8;
    const size_t rows = size_t{2} * kMmaKeys * ld;  // 64 rows of bf16.
    static_assert(kMmaKeys == kMmaTileRows);
    k = rows;
    v = k + rows;
    bytes = v + rows;
  }
};

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  return uint32_t{ToBf16(lo)} | uint32_t{ToBf16(hi)} << 16;
}

// Up to head dim 128, registers are capped for four blocks an SM (as its
// shared memory allows): 16 warps, where 167 registers allowed 12. ptxas
// then spills a few values, outside the loop over keys.
template <int kMaxD, bool kExactD>
__global__ void __launch_bounds__(kMmaWarps * 32, kMaxD <= 128 ? 4 : 1)
    PagedAttentionMmaKernel(AttentionParams p) {
  PD_DYNAMIC_SHARED(unsigned char, mma_smem);
  const int D = kExactD ? kMaxD : p.kv.head_dim;
  const MmaSmem layout(D);
  const int ld = layout.ld;
  auto* qs = reinterpret_cast<uint16_t*>(mma_smem);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  // The lane's rows in its warp's 16 (g and g + 8) and its pair of columns
  // in every 8-column fragment (2 quad, 2 quad + 1).
  const int g = lane / 4, quad = lane % 4;

  // The last tiles first: a prompt's last rows see the most keys, and
  // starting them first leaves the short ones to fill the last wave.
  const AttentionTile tile = p.mma_tiles[gridDim.x - 1 - blockIdx.x];
  const AttentionSequence seq = p.sequences[tile.seq];
  const int kvh = blockIdx.y;
  const int split = blockIdx.z;
  const int group = p.num_heads / p.kv.num_kv_heads;
  const int32_t* table = p.block_tables + seq.block_offset;
  const KeyRange keys = TileKeys(p, tile, seq, group, split);
  const int key_lo = keys.lo, key_hi = keys.hi;

  // Two threads per key row (of K, V and Q): the even one copies the row's
  // even 16-byte chunks, the odd one the odd, so that a warp's copies fill
  // whole 32-byte sectors, and a key's paged address costs a thread one
  // division and one block-table read a step. The head dim is a multiple of
  // 16, so both threads have D / 16 chunks.
  static_assert(kMmaKeys == kMmaTileRows && 2 * kMmaKeys == kMmaWarps * 32,
                "two threads per key and per Q row");
  const int my_row = threadIdx.x / 2, my_chunk = threadIdx.x % 2;
  const int64_t v_offset = ValueOffset(p.kv);
  auto* ks = reinterpret_cast<uint16_t*>(mma_smem + layout.k);
  auto* vs = reinterpret_cast<uint16_t*>(mma_smem + layout.v);
  // Copies the K (or, when `value`, the V) rows of keys k0 .. k0 +
  // kMmaKeys - 1 (zero past key_hi) into their buffer, 16 bytes a copy, and
  // commits them as a group.
  auto stage = [&](int k0, bool value) {
    uint16_t* dst = (value ? vs : ks) + my_row * ld;
    const bool valid = k0 + my_row <= key_hi;
    const uint16_t* src =
        valid ? KeyAt(p, table, kvh, k0 + my_row, 0) + (value ? v_offset : 0)
              : nullptr;
#pragma unroll
    for (int i = 0; i < kMaxD / 16; ++i) {
      const int d = (2 * i + my_chunk) * 8;
      if (i < D / 16) CpAsync16(dst + d, valid ? src + d : p.kv.base, valid);
    }
    CpAsyncCommit();
  };
  if (key_lo <= key_hi) stage(key_lo, false);

  // Q as bf16, zero rows past the tile.
  {
    const float* q = nullptr;
    if (my_row < tile.num_rows) {
      const int row = tile.first_row + my_row;
      const int64_t t = seq.token_offset + row / group;
      const int h = kvh * group + row % group;
      q = p.q + t * p.q_row_stride + static_cast<int64_t>(h) * D;
    }
#pragma unroll
    for (int i = 0; i < kMaxD / 16; ++i) {
      const int d = (2 * i + my_chunk) * 8;
      if (i < D / 16) {
#pragma unroll
        for (int e = 0; e < 8; e += 2) {
          *reinterpret_cast<uint32_t*>(qs + my_row * ld + d + e) =
              q ? PackBf16(q[d + e], q[d + e + 1]) : 0u;
        }
      }
    }
  }

  // The lane's two rows: whether they exist, their position and the first
  // key their window sees.
  int rows[2], pos[2], lo[2];
  bool valid[2];
  for (int r = 0; r < 2; ++r) {
    rows[r] = warp * 16 + g + 8 * r;
    valid[r] = rows[r] < tile.num_rows;
    pos[r] = seq.start_pos + (tile.first_row + rows[r]) / group;
    lo[r] = WindowStart(p, pos[r]);
  }
  // Softmax state (l is this lane's share of the row's sum until the end)
  // and the output, o[n] holding columns 8 n + 2 quad (+1) of both rows.
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
  float o[kMaxD / 8][4];
#pragma unroll
  for (int n = 0; n < kMaxD / 8; ++n) {
#pragma unroll
    for (int i = 0; i < 4; ++i) o[n][i] = 0.0f;
  }
  const bool warp_active = warp * 16 < tile.num_rows;
  // Whether all 16 of the warp's rows exist, the first row's position (the
  // smallest) and the last row's first visible key (the largest).
  const bool warp_full = warp * 16 + 16 <= tile.num_rows;
  const int warp_pos = seq.start_pos + (tile.first_row + warp * 16) / group;
  const int warp_lo = WindowStart(
      p, seq.start_pos + (tile.first_row + warp * 16 + 15) / group);
  const float qscale = p.scale * kLog2e;
  // ldmatrix's row addresses: lanes 0-15 give Q's 16 rows at the first 8
  // dims, lanes 16-31 at the next 8; for K, lanes 8i..8i+7 the 8 keys of
  // fragment i / 2 at dims 8 (i % 2) (ks + k_lane).
  const uint16_t* q_lane = qs + (warp * 16 + lane % 16) * ld + lane / 16 * 8;
  const int k_lane = (lane / 16 * 8 + lane % 8) * ld + lane / 8 % 2 * 8;

  for (int k0 = key_lo; k0 <= key_hi; k0 += kMmaKeys) {
    CpAsyncWaitAll();
    // This step's K (and Q) are in shared memory for every thread, and
    // every warp is done with the last step's V.
    __syncthreads();
    stage(k0, true);  // This step's V, while S is computed.
    float s[kMmaKeys / 8][4];
    if (warp_active) {  // Warp-uniform.
      // S = Q K^T: eight 8-key fragments. One ldmatrix gives Q's A fragment
      // of 16 dims, one more the B fragments of two key fragments.
#pragma unroll
      for (int n = 0; n < kMmaKeys / 8; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) s[n][i] = 0.0f;
      }
#pragma unroll
      for (int kk = 0; kk < kMaxD / 16; ++kk) {
        if (kk < D / 16) {
          uint32_t a[4];
          LdMatrixX4(a, q_lane + kk * 16);
#pragma unroll
          for (int n = 0; n < kMmaKeys / 8; n += 2) {
            uint32_t b4[4];
            LdMatrixX4(b4, ks + k_lane + n * 8 * ld + kk * 16);
            const uint32_t b_lo[2] = {b4[0], b4[1]}, b_hi[2] = {b4[2], b4[3]};
            MmaM16n8k16(s[n], a, b_lo);
            MmaM16n8k16(s[n + 1], a, b_hi);
          }
        }
      }

      // Mask what a row does not see (nothing, on a step whose keys every
      // row of the warp sees: most steps of a long prompt), scale.
      const int last_key = k0 + kMmaKeys - 1;
      if (!(warp_full && k0 >= warp_lo && last_key <= warp_pos &&
            last_key <= key_hi)) {
#pragma unroll
        for (int n = 0; n < kMmaKeys / 8; ++n) {
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const int r = i / 2, key = k0 + n * 8 + 2 * quad + i % 2;
            if (!(valid[r] && key >= lo[r] && key <= pos[r] && key <= key_hi)) {
              s[n][i] = -INFINITY;
            }
          }
        }
      }
      float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int n = 0; n < kMmaKeys / 8; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          s[n][i] *= qscale;
          tile_max[i / 2] = fmaxf(tile_max[i / 2], s[n][i]);
        }
      }
      float corr[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        tile_max[r] =
            fmaxf(tile_max[r], __shfl_xor_sync(kFullMask, tile_max[r], 1));
        tile_max[r] =
            fmaxf(tile_max[r], __shfl_xor_sync(kFullMask, tile_max[r], 2));
        const float m_new = fmaxf(m[r], tile_max[r]);
        // A row with nothing visible yet keeps m = -inf and zero weights.
        corr[r] = m_new == -INFINITY ? 1.0f : exp2f(m[r] - m_new);
        m[r] = m_new;
        l[r] *= corr[r];
      }
#pragma unroll
      for (int n = 0; n < kMmaKeys / 8; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int r = i / 2;
          s[n][i] = m[r] == -INFINITY ? 0.0f : exp2f(s[n][i] - m[r]);
          l[r] += s[n][i];
        }
      }
#pragma unroll
      for (int n = 0; n < kMaxD / 8; ++n) {
#pragma unroll
        for (int i = 0; i < 4; ++i) o[n][i] *= corr[i / 2];
      }
    }
    CpAsyncWaitAll();
    // V is in for every thread, and every warp is done with K.
    __syncthreads();
    if (k0 + kMmaKeys <= key_hi) stage(k0 + kMmaKeys, false);  // During P V.
    if (warp_active) {
      // O += P V, 16 keys at a time: P's A fragment is two S fragments;
      // ldmatrix gives the B fragments of two 8-column output fragments.
#pragma unroll
      for (int kk = 0; kk < kMmaKeys / 16; ++kk) {
        const uint32_t a[4] = {PackBf16(s[2 * kk][0], s[2 * kk][1]),
                               PackBf16(s[2 * kk][2], s[2 * kk][3]),
                               PackBf16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                               PackBf16(s[2 * kk + 1][2], s[2 * kk + 1][3])};
        // Lanes 0-7 give keys 0-7 of the 16, lanes 8-15 keys 8-15, at the
        // first 8 columns; lanes 16-31 the same at the next 8.
        const uint16_t* vrow =
            vs + (kk * 16 + lane % 16) * ld + (lane / 16) * 8;
#pragma unroll
        for (int n = 0; n < kMaxD / 16; ++n) {
          if (n < D / 16) {
            uint32_t b4[4];
            LdMatrixX4Trans(b4, vrow + n * 16);
            const uint32_t b_lo[2] = {b4[0], b4[1]}, b_hi[2] = {b4[2], b4[3]};
            MmaM16n8k16(o[2 * n], a, b_lo);
            MmaM16n8k16(o[2 * n + 1], a, b_hi);
          }
        }
      }
    }
  }

  if (!warp_active) return;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(kFullMask, l[r], 1);
    l[r] += __shfl_xor_sync(kFullMask, l[r], 2);
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    if (!valid[r]) continue;
    const int row = tile.first_row + rows[r];
    const int64_t t = seq.token_offset + row / group;
    const int h = kvh * group + row % group;
    if (p.num_splits == 1) {
      const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;
      uint16_t* out = p.out + (t * p.num_heads + h) * D + 2 * quad;
#pragma unroll
      for (int n = 0; n < kMaxD / 8; ++n) {
        if (n < D / 8) {
          *reinterpret_cast<uint32_t*>(out + n * 8) =
              PackBf16(o[n][2 * r] * inv, o[n][2 * r + 1] * inv);
        }
      }
    } else {
      float* w = p.workspace +
                 ((split * p.num_tokens + t) * p.num_heads + h) * (D + 2);
#pragma unroll
      for (int n = 0; n < kMaxD / 8; ++n) {
        if (n < D / 8) {
          w[n * 8 + 2 * quad] = o[n][2 * r];
          w[n * 8 + 2 * quad + 1] = o[n][2 * r + 1];
        }
      }
      if (quad == 0) {
        w[D] = m[r];
        w[D + 1] = l[r];
      }
    }
  }
}

// Merges the splits' partial softmax states of one (token, head).
__global__ void CombineSplitsKernel(AttentionParams p) {
  const int D = p.kv.head_dim;
  const int64_t t = blockIdx.x / p.num_heads;
  const int h = blockIdx.x % p.num_heads;
  const int64_t stride = p.num_tokens * p.num_heads * (D + 2);
  const float* w0 = p.workspace + (t * p.num_heads + h) * (D + 2);
  float max_m = -INFINITY;
  for (int s = 0; s < p.num_splits; ++s)
    max_m = fmaxf(max_m, w0[s * stride + D]);
  float sum = 0.0f;
  for (int s = 0; s < p.num_splits; ++s) {
    const float ms = w0[s * stride + D];
    if (ms != -INFINITY) sum += w0[s * stride + D + 1] * exp2f(ms - max_m);
  }
  const float inv = sum > 0.0f ? 1.0f / sum : 0.0f;
  uint16_t* o = p.out + (t * p.num_heads + h) * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float v = 0.0f;
    for (int s = 0; s < p.num_splits; ++s) {
      const float ms = w0[s * stride + D];
      if (ms != -INFINITY) v += w0[s * stride + d] * exp2f(ms - max_m);
    }
    o[d] = ToBf16(v * inv);
  }
}

}  // namespace

cudaError_t Embedding(const uint16_t* table, int64_t hidden, const int32_t* ids,
                      int64_t n, float* out, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  PD_LAUNCH(EmbeddingKernel, n, 256, 0, stream, table, hidden, ids, out);
  return PD_LAUNCH_ERROR();
}

cudaError_t RmsNorm(const float* x, const int32_t* rows, int64_t n_rows,
                    int64_t n, const float* weight, float eps, uint16_t* out,
                    cudaStream_t stream) {
  if (n_rows == 0) return cudaSuccess;
  // About four elements per thread (up to 1024 threads): a decode step's
  // single row is one block, whose loop is its whole latency.
  const int threads =
      static_cast<int>(std::clamp<int64_t>((n / 4 + 31) / 32 * 32, 32, 1024));
  PD_LAUNCH(RmsNormKernel, n_rows, threads, 0, stream, x, rows, n, weight, eps,
            out);
  return PD_LAUNCH_ERROR();
}

cudaError_t SiluMul(const float* gate_up, int64_t n_rows, int64_t n,
                    uint16_t* out, cudaStream_t stream) {
  if (n_rows * n == 0) return cudaSuccess;
  // gridDim.y is at most 65535 rows.
  for (int64_t r0 = 0; r0 < n_rows; r0 += 65535) {
    const dim3 grid(
        static_cast<unsigned>((n + 255) / 256),
        static_cast<unsigned>(std::min<int64_t>(65535, n_rows - r0)));
    PD_LAUNCH(SiluMulKernel, grid, 256, 0, stream, gate_up + r0 * 2 * n, n,
              out + r0 * n);
  }
  return PD_LAUNCH_ERROR();
}

cudaError_t BiasRope(float* qkv, int64_t row_stride, int64_t row_width,
                     int64_t n_tokens, const int32_t* positions,
                     const float* inv_freq, int num_heads, int num_kv_heads,
                     int head_dim, const float* bias, const HeadNorm& head_norm,
                     RopeStyle style, cudaStream_t stream) {
  if (n_tokens == 0) return cudaSuccess;
  // The row is the q, k and v heads back to back; the bias covers it all.
  const int all_heads = num_heads + 2 * num_kv_heads;
  if (row_width != static_cast<int64_t>(all_heads) * head_dim) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(n_tokens),
                  (all_heads + kRopeHeadsPerBlock - 1) / kRopeHeadsPerBlock);
  PD_LAUNCH(BiasRopeKernel, grid, kRopeHeadsPerBlock * 32, 0, stream, qkv,
            row_stride, positions, inv_freq, num_heads,
            num_heads + num_kv_heads, all_heads, head_dim, bias, head_norm,
            style == RopeStyle::kAdjacentPairs);
  return PD_LAUNCH_ERROR();
}

cudaError_t WriteKv(const float* qkv, int64_t row_stride, int64_t k_offset,
                    int64_t v_offset, int64_t n_tokens, const int64_t* slots,
                    const PagedKvLayer& kv, cudaStream_t stream) {
  if (n_tokens == 0) return cudaSuccess;
  // A token's k and v rows over several blocks (blockIdx.y), so that a
  // decode step of one token is not one block's loop.
  const int64_t kv_dim = static_cast<int64_t>(kv.num_kv_heads) * kv.head_dim;
  const dim3 grid(static_cast<unsigned>(n_tokens),
                  static_cast<unsigned>(std::min<int64_t>(
                      8, std::max<int64_t>(1, (kv_dim + 127) / 128))));
  PD_LAUNCH(WriteKvKernel, grid, 128, 0, stream, qkv, row_stride, k_offset,
            v_offset, slots, kv);
  return PD_LAUNCH_ERROR();
}

int ScalarAttentionSharedBytes(int head_dim) {
  return static_cast<int>(sizeof(float)) *
         (kAttentionTileRows * head_dim + kAttentionKeyTile * (head_dim + 1) +
          kAttentionKeyTile * head_dim);
}

#ifdef PDSERVE_CUDA_EMULATION
cudaError_t PrepareAttention(int) { return cudaSuccess; }
bool AttentionTensorCoresSupported(int head_dim) {
  return head_dim % 16 == 0 && head_dim <= kMaxHeadDim;
}
#else
cudaError_t PrepareAttention(int max_head_dim) {
  cudaError_t err = cudaFuncSetAttribute(
      PagedAttentionKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
      ScalarAttentionSharedBytes(max_head_dim));
  if (err != cudaSuccess) return err;
  if (!AttentionTensorCoresSupported(max_head_dim)) return cudaSuccess;
  const int bytes = static_cast<int>(MmaSmem(max_head_dim).bytes);
  void (*const kernels[])(AttentionParams) = {
      PagedAttentionMmaKernel<64, true>, PagedAttentionMmaKernel<128, true>,
      PagedAttentionMmaKernel<64, false>, PagedAttentionMmaKernel<128, false>,
      PagedAttentionMmaKernel<256, false>};
  for (auto* kernel : kernels) {
    err = cudaFuncSetAttribute(
        kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

bool AttentionTensorCoresSupported(int head_dim) {
  if (head_dim % 16 != 0 || head_dim > kMaxHeadDim) return false;
  int device = 0, major = 0, smem = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor,
                             device) != cudaSuccess ||
      cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                             device) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return major >= 8 &&
         static_cast<size_t>(smem) >=
             MmaSmem(head_dim).bytes;
}
#endif  // PDSERVE_CUDA_EMULATION

cudaError_t PagedAttention(const AttentionParams& p, cudaStream_t stream) {
  const int D = p.kv.head_dim;
  if (D > kMaxHeadDim || D % 2 != 0 ||
      (p.num_splits > 1 && p.workspace == nullptr) ||
      (p.num_mma_tiles > 0 && D % 16 != 0)) {
    return cudaErrorInvalidValue;
  }
  if (p.num_tiles > 0) {
    const dim3 grid(p.num_tiles, p.kv.num_kv_heads, p.num_splits);
    PD_LAUNCH(PagedAttentionKernel, grid, kAttentionWarps * 32,
              ScalarAttentionSharedBytes(D), stream, p);
    const cudaError_t err = PD_LAUNCH_ERROR();
    if (err != cudaSuccess) return err;
  }
  if (p.num_mma_tiles > 0) {
    const dim3 grid(p.num_mma_tiles, p.kv.num_kv_heads, p.num_splits);
    // The common head dims compiled for exactly, the others into the
    // smallest output registers that hold them.
    void (*const kernel)(AttentionParams) =
        D == 64    ? PagedAttentionMmaKernel<64, true>
        : D == 128 ? PagedAttentionMmaKernel<128, true>
        : D < 64   ? PagedAttentionMmaKernel<64, false>
        : D < 128  ? PagedAttentionMmaKernel<128, false>
                   : PagedAttentionMmaKernel<256, false>;
    PD_LAUNCH(kernel, grid, kMmaWarps * 32, MmaSmem(D).bytes, stream, p);
    const cudaError_t err = PD_LAUNCH_ERROR();
    if (err != cudaSuccess) return err;
  }
  if (p.num_splits == 1 || p.num_tokens == 0) return cudaSuccess;
  PD_LAUNCH(CombineSplitsKernel, p.num_tokens * p.num_heads, 128, 0, stream, p);
  return PD_LAUNCH_ERROR();
}

}  // namespace pdserve::cuda
