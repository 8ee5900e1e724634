// The CPU backend's kernels: fp32 compute over fp32/fp16/bf16 weights,
// parallelized with OpenMP. MatMul's inner loops exist for several
// instruction sets and are chosen at run time (CpuIsa); one binary runs on
// every x86-64-v3 machine. They are also the reference every other
// backend's kernels are tested against.
//
// All buffers are row-major and fp32 unless said otherwise; none may alias
// unless said otherwise.
#ifndef PDSERVE_ENGINE_CPU_CPU_KERNELS_H_
#define PDSERVE_ENGINE_CPU_CPU_KERNELS_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

#include "engine/kv_layout.h"
#include "engine/model.h"
#include "engine/model_files/model_config.h"

namespace pdserve::cpu {

// The instruction sets MatMul has kernels for; each needs the ones before.
enum class CpuIsa : uint8_t {
  kAvx2,        // AVX2, FMA, F16C: the baseline the whole binary needs.
  kAvx512Vnni,  // AVX-512 F, BW, VL, DQ and VNNI: int8 weights, 16-lane
                // fp32 kernels (Avx512Fp32Pays).
  kAvx512Bf16,  // The above and AVX512_BF16: fast bf16 activations.
};
inline constexpr CpuIsa kAllCpuIsas[] = {CpuIsa::kAvx2, CpuIsa::kAvx512Vnni,
                                         CpuIsa::kAvx512Bf16};

// "avx2", "avx512_vnni", "avx512_bf16".
std::string_view CpuIsaName(CpuIsa isa);

// Whether this CPU (and its operating system) runs `isa`'s kernels.
bool CpuRuns(CpuIsa isa);

// The kernels to use: the best this CPU runs, capped by the environment
// variable PDSERVE_CPU_ISA when it is set (as oneDNN's ONEDNN_MAX_CPU_ISA):
// "avx2" on an AVX-512 machine runs the AVX2 kernels, "avx512_bf16" on an
// AVX2 machine runs AVX2. INVALID_ARGUMENT when the value names none of
// them. CreateCpuModelRunner fails with that error.
absl::StatusOr<CpuIsa> CpuIsaFromEnvironment();

// MatMul's default kernels: CpuIsaFromEnvironment(), read once, or the
// best this CPU runs when the variable is bad. Thread-safe.
CpuIsa DefaultCpuIsa();

// Whether fp32 activations should run 16-lane AVX-512 kernels rather than
// the 8-lane AVX2 ones, where the CPU has AVX-512 at all: few rows
// (decode: m <= 4, the path bound by reading the weights) run 16-lane
// tiles, many rows (prefill) panels (matmul_kernels.h). On an Intel Xeon
// they decode 15-20% faster and prefill faster still (docs/benchmarks.md);
// AMD family 19h (Zen 4) splits a 512-bit FMA in two 256-bit halves, and
// there 16-lane tiles did not pay. Read from CPUID, as BLAS libraries pick
// kernels per core type. Thread-safe.
bool Avx512Fp32Pays();

// How MatMul runs.
struct MatMulOptions {
  // OpenMP threads. Default: 1.
  int num_threads = 1;
  // The kernels; CpuRuns(isa) must hold. Default: DefaultCpuIsa().
  CpuIsa isa = DefaultCpuIsa();
  // With bf16 weights, round x to bf16 first and sum the (exact) products
  // in fp32, as a PyTorch bf16 model and llama.cpp's BF16 weights do:
  // with kAvx512Bf16 two products a lane (VDPBF16PS), elsewhere the same
  // numbers from the fp32 kernels. No effect on fp32 and fp16 weights.
  // Off, every product is of fp32 x. No effect on kQ8 weights either.
  // Default: false.
  bool bf16_activations = false;
  // fp32 x runs 16-lane kernels when `isa` has AVX-512 (Avx512Fp32Pays
  // says which); the sums are the same products in another order.
  // Default: Avx512Fp32Pays().
  bool avx512_fp32 = Avx512Fp32Pays();

  // Whether fp32 x runs the 16-lane kernels.
  bool Avx512Fp32() const { return avx512_fp32 && isa >= CpuIsa::kAvx512Vnni; }
};

// y[i][j] = sum_k x[i][k] * w[j][k] for i < m, j < w.rows, k < w.cols.
// x has row stride w.cols, y has row stride w.rows. Each product is of x
// (see bf16_activations) and the weight widened to fp32, summed in fp32.
// kQ8 weights: each row of x is quantized as they are (QuantizeToQ8, with
// an fp32 scale), each group's int8 products summed exactly, scaled by
// both scales and summed in fp32 (llama.cpp's Q8_0 x Q8_0).
void MatMul(const float* x, int64_t m, const WeightMatrix& w, float* y,
            const MatMulOptions& options);
// With the default options but `num_threads`.
void MatMul(const float* x, int64_t m, const WeightMatrix& w, float* y, int num_threads);

// One product of several of one x: y = x times w's rows, of row stride
// w->rows.
struct MatMulProduct {
  const WeightMatrix* w = nullptr;
  float* y = nullptr;
};
// Each product as MatMul(x, m, *p.w, p.y, options) computes it (the same
// numbers). Where the weights share their type (and, as they must, their
// columns), few rows of x (decode) share one parallel region, the split
// of the work and, for kQ8, x's quantization: q, k and v (or gate and up)
// cost one pass over their rows, not three short ones.
void MatMul(const float* x, int64_t m, std::span<const MatMulProduct> products,
            const MatMulOptions& options);

// w (fp32, fp16 or bf16) as kQ8 (dtype.h) written into `storage`, which
// the result points into. Per group of kQ8Group weights of a row:
// scale = fp16(max |w| / 127), int8 = round(w / scale), within +-127.
// The layout, for the kernels: blocks of kQ8BlockRows rows (the last
// padded with zero rows), each a run of kQ8UnitBytes units, one per
// group of columns (the last padded with zeros). A unit holds 8 lines of
// 64 bytes, line q the weights 4q .. 4q + 3 of the group of each of the 16
// rows in turn, each stored as int8 + 128 (unsigned); then the 16 rows'
// fp16 scales. Same bytes per weight as llama.cpp's Q8_0 (34 per 32).
// INVALID_ARGUMENT naming the row when a weight is not finite or a scale
// overflows fp16. Rows are split among `num_threads` threads.
absl::StatusOr<WeightMatrix> QuantizeToQ8(const WeightMatrix& w, std::vector<std::byte>& storage,
                                          int num_threads);

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

// Attention of `heads` query heads (q: heads rows of head_dim floats; the
// heads of one GQA group, or one) at position `pos` over the keys at
// positions [first_pos, pos] of `kv_head` (causal; first_pos > 0 for a
// sliding window), into out (heads rows of head_dim). `scores` is scratch
// of at least heads * (pos - first_pos + 1) floats.
void AttendGroup(const float* q, int heads, const PagedKv& kv, int kv_head, int64_t first_pos,
                 int64_t pos, float scale, float* scores, float* out);

}  // namespace pdserve::cpu

#endif  // PDSERVE_ENGINE_CPU_CPU_KERNELS_H_
