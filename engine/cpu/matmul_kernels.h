// Internal to the CPU backend: the register-tile kernels of MatMul, each
// instruction set's in a file of its own compiled with that set's -m
// flags (engine/CMakeLists.txt). MatMul (cpu_kernels.cc, built for the
// AVX2 baseline) splits the work into tiles and calls the kernels the CPU
// runs; nothing compiled for AVX-512 runs unless the CPU has it.
#ifndef PDSERVE_ENGINE_CPU_MATMUL_KERNELS_H_
#define PDSERVE_ENGINE_CPU_MATMUL_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include "engine/dtype.h"

namespace pdserve::cpu::internal {

// The largest tile: rows of x by rows of w.
inline constexpr int kMaxTileRows = 4;
inline constexpr int kMaxTileCols = 3;

// Kernels that read w in order (one weight row a tile, int8 blocks) ask
// for its lines this many bytes ahead, into L2. The hardware prefetcher
// alone keeps too few lines in flight: on the Xeon VM of
// docs/benchmarks.md, batch-1 products of bf16 weights read 18 GB/s on two
// threads that way and 26-28 GB/s (its read bandwidth) with this. Of the
// distances tried there (2 to 16 KiB, a microbenchmark outside the
// repository), 4 KiB and up did best; pd-engine-bench's decode rows show
// the effect.
inline constexpr int64_t kPrefetchAhead = 8192;

// Sequential streams per thread on MatMul's few-row (decode) path: each
// task's run of weight rows is read as this many stretches at once. On the
// AVX2 EPYC VM of docs/benchmarks.md, batch-1 decode against one stream:
// f32 1.32x, bf16 1.49x, f16 1.26x (pd-engine-bench, 6 interleaved pairs,
// medians); three beat two by 5-15%. At most kMaxTileCols.
inline constexpr int kFewRowStreams = 3;
static_assert(kFewRowStreams <= kMaxTileCols);

// y[i * ldy + j * row_step] = sum_t x[i * k + t] * w[j * row_step * k + t]
// for i < MR, j < NR: the tile's NR weight rows are row_step rows apart.
// Adjacent rows (row_step 1) are the dot-product tiles of many rows of x;
// rows far apart are the few-row path's streams (MatMulTiled), each a
// sequential read of its own, which prefetches ahead.
using TileFn = void (*)(const void* x, int64_t k, const std::byte* w, float* y, int64_t ldy,
                        int64_t row_step);

// Every tile shape of one kernel.
struct TileKernels {
  TileFn tiles[kMaxTileRows][kMaxTileCols];  // [MR - 1][NR - 1]
};

// AVX2/FMA/F16C (matmul_avx2.cc): fp32 x against fp32, fp16 and bf16
// weights.
const TileKernels& Avx2Tiles(DType weights);

// Int8 weights (DType::kQ8, laid out as cpu::QuantizeToQ8 says) against x
// quantized alike by MatMul. Each row of x, Q8XRowBytes(k) bytes:
//   RoundUp(k, kQ8Group) int8 (zero past k),
//   one fp32 scale per group,
//   one int32 per group: -128 * the sum of the group's int8 (the VNNI
//   kernels multiply the weights biased to unsigned, w + 128).
inline constexpr int64_t Q8XRowBytes(int64_t k) {
  const int64_t groups = (k + kQ8Group - 1) / kQ8Group;
  return groups * (kQ8Group + 8);
}

// One group of n <= kQ8Group values as int8 into q[0, kQ8Group), zero past
// n: scale = max |v| / 127 (rounded to fp16 when `fp16_scale`), int8 =
// round(v / scale) (to nearest even) within +-127 (NaN to -127, never
// -128, which the kernels rely on; all zero when the scale is 0). Returns
// the scale; *sum = the sum of the int8. matmul_avx2.cc, for every
// instruction set; QuantizeRowQ8 (x) and cpu::QuantizeToQ8 (weights).
float QuantizeGroupQ8(const float* v, int64_t n, bool fp16_scale, int8_t* q, int32_t* sum);

// One row of x (k floats) quantized as Q8XRowBytes says, into `out`, a
// QuantizeGroupQ8 with an fp32 scale per group.
void QuantizeRowQ8(const float* x, int64_t k, std::byte* out);

// y[i * ldy + r] = row r < kQ8BlockRows of one block of weights (`w`: its
// first group) times row i < MR of x (`x`, rows x_row bytes apart), over
// `groups` groups. A streams kernel does the same for S blocks at once,
// block_step blocks apart (w + s * block_step * groups * kQ8UnitBytes into
// y + s * block_step * kQ8BlockRows, s < S), each block's sums taken in
// the order of the one-block kernel; the others ignore block_step.
using Q8BlockFn = void (*)(const std::byte* x, int64_t x_row, int64_t groups, const std::byte* w,
                           float* y, int64_t ldy, int64_t block_step);

// One kernel per MR = 1 .. max_rows, and one for a row of x (decode at
// batch 1) that reads `streams` blocks at once, each a sequential stream
// of its own, as MatMul's fp32 few-row path reads kFewRowStreams rows.
inline constexpr int kMaxQ8Rows = 8;
struct Q8Kernels {
  int max_rows;
  Q8BlockFn rows[kMaxQ8Rows];  // [MR - 1]
  int streams;
  Q8BlockFn one_row_streams;
};

// AVX2 (matmul_avx2.cc): VPMADDUBSW on |x| and w with x's signs.
const Q8Kernels& Avx2Q8Kernels();
// AVX-512 F/BW/VL/DQ and VNNI (matmul_avx512_vnni.cc): VPDPBUSD.
const Q8Kernels& Avx512VnniQ8Kernels();

// The same file: fp32 x against fp32, fp16 and bf16 weights, 16 lanes.
const TileKernels& Avx512Tiles(DType weights);

// Many rows of fp32 x: w is copied a panel of `cols` rows (two vectors'
// lanes) at a time into fp32, one k step a line
// (panel[t * cols + r] = w[r][t]), and tiles of up to `max_rows` rows of
// x multiply it as outer products: x[i][t] broadcast times the panel's
// line t, into 2 x MR accumulators. Each loaded weight serves MR rows and
// each x value `cols` columns, so the tile is bound by the multiply-adds,
// not by the caches, as the dot-product tiles are.
inline constexpr int kMaxPanelMR = 12;

// panel[t * cols + r] = element t < k of row r < rows of w (rows
// `row_bytes` apart) as fp32; zero for rows <= r < cols.
using PackFn = void (*)(const std::byte* w, size_t row_bytes, int rows, int64_t k, float* panel);

// y[i * ldy + r] = sum_t x[i * k + t] * panel[t * cols + r] for i < MR,
// r < n (<= cols); x is fp32, or bf16 for the pair panels below.
// Meanwhile the bytes [prefetch, prefetch_end) are fetched into L2 (the
// next panel's rows, so that its copy does not wait on memory), one line
// every 4 lines of the panel: at most k / 4 lines (k / 8 for pairs).
using PanelFn = void (*)(const void* x, int64_t k, const float* panel, float* y, int64_t ldy,
                         int n, const std::byte* prefetch, const std::byte* prefetch_end);
struct PanelKernels {
  int cols;                    // Weight rows a panel holds.
  int max_rows;                // Rows of x a tile takes at most.
  PackFn pack[3];              // By the weights' DType: kF32, kF16, kBF16.
  PanelFn rows[kMaxPanelMR];   // [MR - 1], MR <= max_rows.
};
// 8 lanes (matmul_avx2.cc): panels of 16 rows, tiles of up to 6.
const PanelKernels& Avx2PanelKernels();
// 16 lanes (matmul_avx512_vnni.cc): panels of 32 rows, tiles of up to 12.
const PanelKernels& Avx512PanelKernels();

// AVX512_BF16 with AVX-512 F/BW/VL/DQ (matmul_avx512_bf16.cc): bf16 x
// against bf16 weights, two products a lane (VDPBF16PS), summed in fp32:
// dot-product tiles (few rows of x), and panels of pairs for many rows:
// a panel's line holds a pair of k steps of each of 16 weight rows
// (panel[(t / 2) * cols + r] is the 32-bit pair w[r][t], w[r][t + 1]),
// which a broadcast pair of x multiplies by one VDPBF16PS, twice the
// products of an fp32 FMA. Pair panels take even k and bf16 weights only
// (pack[kBF16]; the other types' entries are null). And x's conversion:
// out[i] = x[i] rounded to bf16 (to nearest even).
const TileKernels& Avx512Bf16Tiles();
const PanelKernels& Avx512Bf16PanelKernels();
void Avx512RoundToBf16(const float* x, int64_t n, uint16_t* out);

}  // namespace pdserve::cpu::internal

#endif  // PDSERVE_ENGINE_CPU_MATMUL_KERNELS_H_
