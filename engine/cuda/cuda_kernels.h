// The CUDA backend's kernels and its one GEMM entry point. Each mirrors a
// CPU kernel in engine/cpu/cpu_kernels.h (the reference the conformance
// tests hold them to) on device memory: bf16 weights and activations, fp32
// residual stream, fp32 accumulation everywhere.
//
// Every pointer is a device pointer. Functions only enqueue work on
// `stream`; a launch error is returned as the cudaError_t of the launch,
// an execution error surfaces at the next synchronisation. bf16 values are
// passed as their bit patterns (uint16_t) so that this header needs no
// CUDA C++ types and host code compiled by the C++ compiler can include it.
//
// The header is free of absl and of the engine's model types so that nvcc
// compiles the .cu file quickly; the runner translates between the two.
#ifndef PDSERVE_ENGINE_CUDA_CUDA_KERNELS_H_
#define PDSERVE_ENGINE_CUDA_CUDA_KERNELS_H_

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace pdserve::cuda {

// Largest head_dim the attention kernel supports (any even value up to it).
inline constexpr int kMaxHeadDim = 256;

// out[i] = embedding row ids[i] as fp32, for i < n. table: [vocab][hidden].
cudaError_t Embedding(const uint16_t* table, int64_t hidden, const int32_t* ids,
                      int64_t n, float* out, cudaStream_t stream);

// out[i] = bf16(x[r] / rms(x[r]) * weight) with r = rows ? rows[i] : i, for
// i < n_rows; x rows are n wide (fp32), out rows too (bf16).
cudaError_t RmsNorm(const float* x, const int32_t* rows, int64_t n_rows,
                    int64_t n, const float* weight, float eps, uint16_t* out,
                    cudaStream_t stream);

// out[r][i] = bf16(silu(gate_up[r][i]) * gate_up[r][n + i]) for r < n_rows,
// i < n: gate_up holds the gate and up projections side by side.
cudaError_t SiluMul(const float* gate_up, int64_t n_rows, int64_t n,
                    uint16_t* out, cudaStream_t stream);

enum class RopeStyle {
  kHalfRotation,   // Hugging Face: pairs (i, i + head_dim/2).
  kAdjacentPairs,  // llama2.c / GPT-J: pairs (2i, 2i + 1).
};

// Qwen3's RMSNorm of every q and k head on its own (cpu::RmsNorm over
// head_dim, fp32 in and out), between the bias and the rotation.
struct HeadNorm {
  const float* q_weight = nullptr;  // [head_dim]; null: no head norm.
  const float* k_weight = nullptr;  // [head_dim]; set with q_weight.
  float eps = 0.0f;
};

// For each of n_tokens rows of `qkv` (row stride `row_stride` floats),
// whose first row_width = (num_heads + 2 * num_kv_heads) * head_dim
// elements are the q, k and v heads (cudaErrorInvalidValue otherwise):
// adds `bias` (nullable; row_width floats) to them, normalizes each of the
// first num_heads heads (q) and the following num_kv_heads heads (k) when
// `head_norm` has weights, then
// rotates those heads by positions[t] * inv_freq (head_dim / 2 of them),
// angles computed in fp32 and cos/sin in double as the CPU backend does.
cudaError_t BiasRope(float* qkv, int64_t row_stride, int64_t row_width,
                     int64_t n_tokens, const int32_t* positions,
                     const float* inv_freq, int num_heads, int num_kv_heads,
                     int head_dim, const float* bias, const HeadNorm& head_norm,
                     RopeStyle style, cudaStream_t stream);

// Where one layer of a bf16 paged KV pool lives (engine/kv_layout.h).
struct PagedKvLayer {
  uint16_t* base = nullptr;  // The layer's first block.
  int num_kv_heads = 0;
  int head_dim = 0;
  int block_size = 0;
};

// Stores each token's K (row offset k_offset) and V (v_offset) of `qkv`
// into the cache slot slots[t] = block id * block_size + slot, as bf16;
// a negative slot stores nothing.
cudaError_t WriteKv(const float* qkv, int64_t row_stride, int64_t k_offset,
                    int64_t v_offset, int64_t n_tokens, const int64_t* slots,
                    const PagedKvLayer& kv, cudaStream_t stream);

// Per-sequence metadata of a ragged batch, for attention.
struct AttentionSequence {
  int32_t token_offset;  // Row of its first new token in q and out.
  int32_t num_tokens;    // New tokens.
  int32_t start_pos;     // Position of its first new token.
  int32_t block_offset;  // Index of its block table in `block_tables`.
};

// A unit of attention work: `num_rows` consecutive (token, head-in-group)
// rows of one sequence, row r = token_local * group + head_in_group.
struct AttentionTile {
  int32_t seq;
  int32_t first_row;
  int32_t num_rows;
};

// Rows per tile of the fp32 (CUDA core) attention kernel, used for decode
// and short chunks.
inline constexpr int kAttentionTileRows = 16;
// Keys per step of the fp32 kernel; context splits are multiples of it.
inline constexpr int kAttentionKeyTile = 32;
// Rows (and keys per step) of the tensor-core kernel's tiles, for prefill.
inline constexpr int kMmaTileRows = 64;

// Appends the tiles covering `rows` rows of sequence `seq`: while at least
// half an MMA tile is left, MMA tiles (when `tensor_cores`), the rest fp32
// tiles.
inline void AppendAttentionTiles(int32_t seq, int32_t rows, bool tensor_cores,
                                 std::vector<AttentionTile>& tiles,
                                 std::vector<AttentionTile>& mma_tiles) {
  int32_t r = 0;
  if (tensor_cores) {
    for (; rows - r >= kMmaTileRows / 2; r += kMmaTileRows) {
      mma_tiles.push_back({seq, r, std::min(kMmaTileRows, rows - r)});
    }
  }
  for (; r < rows; r += kAttentionTileRows) {
    tiles.push_back({seq, r, std::min(kAttentionTileRows, rows - r)});
  }
}

struct AttentionParams {
  // q of token t, head h: q[t * q_row_stride + h * head_dim] (fp32, RoPE'd).
  const float* q = nullptr;
  int64_t q_row_stride = 0;
  PagedKvLayer kv;  // Already holds the new tokens' K/V.
  const int32_t* block_tables = nullptr;
  const AttentionSequence* sequences = nullptr;
  // Tiles for the fp32 kernel (at most kAttentionTileRows rows each) and
  // for the tensor-core kernel (at most kMmaTileRows rows each); together
  // they cover every row once.
  const AttentionTile* tiles = nullptr;
  int num_tiles = 0;
  const AttentionTile* mma_tiles = nullptr;
  int num_mma_tiles = 0;
  int num_heads = 0;
  int sliding_window = 0;  // 0: full causal attention.
  float scale = 0.0f;      // Softmax scale, usually 1 / sqrt(head_dim).
  // Context splits (decode): split s of a sequence whose new tokens end at
  // position e covers key positions [s * len, (s + 1) * len), len =
  // ceil((e + 1) / num_splits). The launch depends on num_splits only, not
  // on the contexts (a captured decode graph stays valid as they grow).
  // 1 split needs no workspace.
  int num_splits = 1;
  int64_t num_tokens = 0;  // Rows of q and out.
  // Workspace for num_splits > 1: num_splits * num_tokens * num_heads *
  // (head_dim + 2) floats.
  float* workspace = nullptr;
  // Output: bf16 [num_tokens][num_heads * head_dim].
  uint16_t* out = nullptr;
};

// Causal (optionally sliding-window) attention of every new token over its
// sequence's cache, GQA, flash-style online softmax with fp32 statistics;
// grid: tiles x kv heads x splits for each kernel, then a combine pass
// when split. The tensor-core kernel rounds q and the probabilities to
// bf16 for its MMAs (as flash attention does); the fp32 kernel keeps q fp32.
cudaError_t PagedAttention(const AttentionParams& p, cudaStream_t stream);

// Whether the tensor-core kernel can run `head_dim` on the current device
// (a multiple of 16 up to kMaxHeadDim, compute capability 8.0 or newer,
// enough shared memory). Call after PrepareAttention.
bool AttentionTensorCoresSupported(int head_dim);

// Raises the attention kernels' shared memory limits for `max_head_dim`
// on the current device; once per runner (and per test shape).
cudaError_t PrepareAttention(int max_head_dim);

// y[m][n] = beta * y + x[m][k] . w[n][k]^T: bf16 x and w (row-major, as
// the checkpoint stores [out][in]), fp32 y, fp32 accumulation, cuBLAS
// (through cublas_api.h; CUBLAS_STATUS_NOT_INITIALIZED when it cannot be
// loaded). Defined in cublas_api.cc.
cublasStatus_t Gemm(cublasHandle_t handle, const uint16_t* x, int64_t m,
                    const uint16_t* w, int64_t n, int64_t k, float* y,
                    float beta);

}  // namespace pdserve::cuda

#endif  // PDSERVE_ENGINE_CUDA_CUDA_KERNELS_H_
