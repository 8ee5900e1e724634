// The CPU backend's kernels: fp32 compute over fp32/fp16/bf16 weights,
// vectorized with AVX2/FMA and parallelized with OpenMP. They are also the
// reference every other backend's kernels are tested against.
//
// All buffers are row-major and fp32 unless said otherwise; none may alias
// unless said otherwise.
#ifndef PDSERVE_ENGINE_CPU_CPU_KERNELS_H_
#define PDSERVE_ENGINE_CPU_CPU_KERNELS_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "engine/kv_layout.h"
#include "engine/model.h"
#include "engine/model_files/model_config.h"

namespace pdserve::cpu {

// y[i][j] = sum_k x[i][k] * w[j][k] for i < m, j < w.rows, k < w.cols.
// x has row stride w.cols, y has row stride w.rows. Uses `num_threads`.
void MatMul(const float* x, int64_t m, const WeightMatrix& w, float* y, int num_threads);

// y = x / rms(x) * weight over one row of n; y may alias x.
void RmsNorm(const float* x, const float* weight, int64_t n, float eps, float* y);

// out[i] = silu(gate[i]) * up[i]; out may alias gate or up.
void SiluMul(const float* gate, const float* up, int64_t n, float* out);

// Copies row `id` of the embedding table into `out` as fp32.
void EmbeddingRow(const WeightMatrix& embed, int32_t id, float* out);

// RoPE inverse frequencies (head_dim / 2 of them) with the config's
// scaling applied (llama3, linear), computed as Hugging Face does in fp32.
std::vector<float> RopeInvFreq(const ModelConfig& config);

// cos/sin tables for one position: cos_out[i] = cos(pos * inv_freq[i]).
void RopeAngles(int64_t pos, std::span<const float> inv_freq, float* cos_out, float* sin_out);

enum class RopeStyle {
  kHalfRotation,   // Hugging Face: pairs (i, i + head_dim/2).
  kAdjacentPairs,  // llama2.c / GPT-J: pairs (2i, 2i + 1).
};

// Rotates every head of x ([num_heads][head_dim]) in place.
void ApplyRope(float* x, int num_heads, int head_dim, const float* cos, const float* sin,
               RopeStyle style);

// Where one sequence's K/V live: a layer's region of an fp32 KV pool
// (kv_layout.h) and the sequence's block table.
struct PagedKv {
  const KvBlockLayout* layout = nullptr;
  std::byte* layer_base = nullptr;  // Start of this layer's region.
  std::span<const BlockId> block_table;

  float* Key(int64_t pos, int kv_head) const;
  float* Value(int64_t pos, int kv_head) const;
};

// Attention of one query head at position `pos` over the keys at positions
// [first_pos, pos] of `kv_head` (causal; first_pos > 0 for a sliding
// window). `scores` is scratch of at least pos - first_pos + 1 floats.
void AttendOne(const float* q, const PagedKv& kv, int kv_head, int64_t first_pos, int64_t pos,
               float scale, float* scores, float* out);

}  // namespace pdserve::cpu

#endif  // PDSERVE_ENGINE_CPU_CPU_KERNELS_H_
