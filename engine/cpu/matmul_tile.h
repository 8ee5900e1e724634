// Internal to the CPU backend: MatMul's register tile, written once and
// instantiated by each kernel file (matmul_avx2.cc, matmul_avx512_bf16.cc) with
// its vector type, under that file's -m flags.
//
// Everything here has internal linkage, on purpose: were a function of this
// header an ordinary inline one, the linker would keep one copy of it for
// the whole program, possibly the one compiled with AVX-512, and an AVX2
// machine would run it. For the same reason the kernel files call no inline
// function of another header at run time (dtype.h's conversions included).
//
// A vector type V provides:
//   Acc                      fp32 accumulators of one tile cell
//   X, W                     registers of x and of weights
//   XElem                    an element of x in memory
//   kStep                    elements of k one MulAdd consumes
//   Zero(), Add(a, b), Sum(a) (the horizontal sum)
//   LoadX(p), LoadW<T>(p)    kStep elements of x / of a weight row
//   MulAdd(x, w, acc)        acc + the products of x and w, in lanes
//   XAt(p, i)                element i of x as float (the k tail)
// and, for the panels (kStep lanes, a weight row each):
//   kPerLine                 steps of k a panel line holds: 1 (fp32), 2
//                            (bf16 pairs)
//   LoadLine(p)              a line of the panel
//   Broadcast(p)             the kPerLine elements of x at p, in every lane
//   Store(p, v, n)           the first n <= kStep lanes of v to p
// and, to pack fp32 panels (PackPanel):
//   Transpose(v)             v[kStep]: lane e of v[r] to lane r of v[e]
//   UnpackLo/UnpackHi(a, b), Shuffle<imm>(a, b): the unpack and shuffle
//                            instructions, for TransposeWithinLanes
#ifndef PDSERVE_ENGINE_CPU_MATMUL_TILE_H_
#define PDSERVE_ENGINE_CPU_MATMUL_TILE_H_

#include <immintrin.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>

#include "engine/cpu/matmul_kernels.h"
#include "engine/dtype.h"

namespace pdserve::cpu::internal {
namespace {

// Element i of a weight row of type T as float.
template <DType T>
float WeightAt(const std::byte* w, int64_t i) {
  if constexpr (T == DType::kF32) {
    float f;
    std::memcpy(&f, w + 4 * i, 4);
    return f;
  } else {
    uint16_t h;
    std::memcpy(&h, w + 2 * i, 2);
    if constexpr (T == DType::kF16) return _cvtsh_ss(h);
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
}

// Asks for the lines of [p, p + bytes) + kPrefetchAhead into L2.
void PrefetchAhead(const std::byte* p, int64_t bytes) {
  for (int64_t line = 0; line < bytes; line += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(p + kPrefetchAhead + line), _MM_HINT_T1);
  }
}

// A register tile: MR rows of x against NR rows of w (row_step rows
// apart) over the whole k. Small tiles would be bound by the latency of
// the multiply-adds with only MR * NR dependency chains, so they keep
// several banks of accumulators and alternate between them along k: at
// least four chains for one weight row, two for up to six. Rows apart
// (row_step > 1, MatMul's few-row path) are each a step of a sequential
// read of w, which prefetches ahead.
template <typename V, DType T, int MR, int NR>
void MatMulTile(const void* x_data, int64_t k, const std::byte* w, float* y, int64_t ldy,
                int64_t row_step) {
  using X = typename V::XElem;
  const X* x = static_cast<const X*>(x_data);
  constexpr int64_t kElem = static_cast<int64_t>(DTypeSize(T));
  constexpr int64_t kStep = V::kStep;
  constexpr int kBanks = NR == 1 ? (MR == 1 ? 4 : 2) : MR * NR <= 6 ? 2 : 1;
  typename V::Acc acc[kBanks][MR][NR];
  for (int b = 0; b < kBanks; ++b)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[b][i][j] = V::Zero();
  int64_t kk = 0;
  for (; kk + kStep * kBanks <= k; kk += kStep * kBanks) {
    if (NR == 1 || row_step > 1) {
      for (int j = 0; j < NR; ++j) {
        PrefetchAhead(w + (j * row_step * k + kk) * kElem, kStep * kBanks * kElem);
      }
    }
    for (int b = 0; b < kBanks; ++b) {
      const int64_t at = kk + kStep * b;
      typename V::W wv[NR];
      for (int j = 0; j < NR; ++j) wv[j] = V::template LoadW<T>(w + (j * row_step * k + at) * kElem);
      for (int i = 0; i < MR; ++i) {
        const typename V::X xv = V::LoadX(x + i * k + at);
        for (int j = 0; j < NR; ++j) acc[b][i][j] = V::MulAdd(xv, wv[j], acc[b][i][j]);
      }
    }
  }
  for (; kk + kStep <= k; kk += kStep) {  // A last step when the banks do not fit.
    for (int j = 0; j < NR; ++j) {
      const typename V::W wv = V::template LoadW<T>(w + (j * row_step * k + kk) * kElem);
      for (int i = 0; i < MR; ++i) {
        acc[0][i][j] = V::MulAdd(V::LoadX(x + i * k + kk), wv, acc[0][i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      typename V::Acc sum = acc[0][i][j];
      for (int b = 1; b < kBanks; ++b) sum = V::Add(sum, acc[b][i][j]);
      float s = V::Sum(sum);
      for (int64_t t = kk; t < k; ++t) {
        s += V::XAt(x, i * k + t) * WeightAt<T>(w + j * row_step * k * kElem, t);
      }
      y[i * ldy + j * row_step] = s;
    }
  }
}

// The first two rounds of V::Transpose, alike at every width since they
// work within 128-bit lanes: pairs of rows interleaved, then 4 x 4
// blocks. Afterwards lane L (of 4 floats) of v[4g + c] holds rows
// 4g .. 4g+3 at element 4L + c; V::Transpose then moves the lanes.
template <typename V>
void TransposeWithinLanes(typename V::W v[V::kStep]) {
  constexpr int kRows = V::kStep;
  typename V::W t[kRows];
  for (int i = 0; i < kRows / 2; ++i) {
    // Lane L: r0[4L] r1[4L] r0[4L+1] r1[4L+1], and the next two elements.
    t[2 * i] = V::UnpackLo(v[2 * i], v[2 * i + 1]);
    t[2 * i + 1] = V::UnpackHi(v[2 * i], v[2 * i + 1]);
  }
  for (int g = 0; g < kRows / 4; ++g) {
    v[4 * g + 0] = V::template Shuffle<0x44>(t[4 * g], t[4 * g + 2]);
    v[4 * g + 1] = V::template Shuffle<0xEE>(t[4 * g], t[4 * g + 2]);
    v[4 * g + 2] = V::template Shuffle<0x44>(t[4 * g + 1], t[4 * g + 3]);
    v[4 * g + 3] = V::template Shuffle<0xEE>(t[4 * g + 1], t[4 * g + 3]);
  }
}

// kStep elements of a weight row at p as fp32, those past n (< kStep)
// zero and not read.
template <typename V, DType T>
typename V::W LoadWPart(const std::byte* p, int n) {
  constexpr int kElem = static_cast<int>(DTypeSize(T));
  if (n == V::kStep) return V::template LoadW<T>(p);
  alignas(64) std::byte part[V::kStep * kElem] = {};
  std::memcpy(part, p, n * kElem);
  return V::template LoadW<T>(part);
}

// The panel of `rows` (<= 2 * kStep) weight rows, `row_bytes` apart, of
// type T: panel[t * 2 * kStep + r] = w[r][t] as fp32 for t < k, zero for
// the rows past `rows` (matmul_kernels.h).
template <typename V, DType T>
void PackPanel(const std::byte* w, size_t row_bytes, int rows, int64_t k, float* panel) {
  constexpr int kLanes = V::kStep;
  constexpr int kCols = 2 * kLanes;
  constexpr int64_t kElem = static_cast<int64_t>(DTypeSize(T));
  for (int64_t t0 = 0; t0 < k; t0 += kLanes) {
    const int n = k - t0 < kLanes ? static_cast<int>(k - t0) : kLanes;  // No std::min: see above.
    for (int half = 0; half < 2; ++half) {
      typename V::W v[kLanes];
      for (int i = 0; i < kLanes; ++i) {
        const int r = kLanes * half + i;
        v[i] = r < rows ? LoadWPart<V, T>(w + r * row_bytes + t0 * kElem, n) : V::Zero();
      }
      V::Transpose(v);
      for (int t = 0; t < n; ++t) V::Store(panel + (t0 + t) * kCols + kLanes * half, v[t], kLanes);
    }
  }
}

// MR rows of x times one panel: per line of the panel (V::kPerLine steps
// of k; k is a multiple of it) two lines of weights, each x value (or
// pair) broadcast once against both. The largest MR keeps its 2 * MR
// accumulators, the two lines and the broadcast in the registers (AVX2:
// MR 6, 15 of the 16; AVX-512: MR 12, 27 of the 32). Every fourth line
// also prefetches a line of `prefetch` into L2 (the load ports have
// room to spare), until `prefetch_end`. The loop takes four lines a
// turn: one prefetch test and one loop branch per 4 * 2 * MR
// multiply-adds, which on the AVX2 EPYC VM of docs/benchmarks.md made a
// layer's products of 128 rows 1.15-1.20x faster than one step a turn
// (f32 and bf16, one and two threads, 8-12 interleaved pairs); eight
// steps a turn were no faster.
template <typename V, int MR>
void PanelTile(const void* x_data, int64_t k, const float* panel, float* y, int64_t ldy, int cols,
               const std::byte* prefetch, const std::byte* prefetch_end) {
  const auto* x = static_cast<const typename V::XElem*>(x_data);
  constexpr int kLanes = V::kStep;
  constexpr int kCols = 2 * kLanes;
  const int64_t lines = k / V::kPerLine;
  typename V::Acc acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = V::Zero();
  const auto step = [&](int64_t t) {
    const typename V::W w0 = V::LoadLine(panel + t * kCols);
    const typename V::W w1 = V::LoadLine(panel + t * kCols + kLanes);
    for (int i = 0; i < MR; ++i) {
      const typename V::X xi = V::Broadcast(x + i * k + t * V::kPerLine);
      acc[i][0] = V::MulAdd(xi, w0, acc[i][0]);
      acc[i][1] = V::MulAdd(xi, w1, acc[i][1]);
    }
  };
  int64_t t = 0;
  for (; t + 4 <= lines; t += 4) {
    if (prefetch < prefetch_end) {
      _mm_prefetch(reinterpret_cast<const char*>(prefetch), _MM_HINT_T1);
      prefetch += 64;
    }
    step(t);
    step(t + 1);
    step(t + 2);
    step(t + 3);
  }
  for (; t < lines; ++t) step(t);
  const int lo = cols < kLanes ? cols : kLanes;
  const int hi = cols - lo;
  for (int i = 0; i < MR; ++i) {
    V::Store(y + i * ldy, acc[i][0], lo);
    if (hi > 0) V::Store(y + i * ldy + kLanes, acc[i][1], hi);
  }
}

// V's panel kernels: tiles of 1 .. kMaxMR rows, and the packing of each
// weight type (by DType: kF32, kF16, kBF16), PackPanel's unless given.
template <typename V, int kMaxMR, int... kMR>
constexpr PanelKernels MakePanelKernels(std::array<PackFn, 3> pack,
                                        std::integer_sequence<int, kMR...>) {
  static_assert(kMaxMR <= kMaxPanelMR);
  PanelKernels out{.cols = 2 * V::kStep, .max_rows = kMaxMR, .pack = {pack[0], pack[1], pack[2]}};
  ((out.rows[kMR] = &PanelTile<V, kMR + 1>), ...);
  return out;
}
template <typename V, int kMaxMR>
constexpr PanelKernels MakePanelKernels(
    std::array<PackFn, 3> pack = {&PackPanel<V, DType::kF32>, &PackPanel<V, DType::kF16>,
                                  &PackPanel<V, DType::kBF16>}) {
  return MakePanelKernels<V, kMaxMR>(pack, std::make_integer_sequence<int, kMaxMR>());
}

template <typename V, DType T, int MR>
constexpr void FillTileRow(TileKernels& out) {
  out.tiles[MR - 1][0] = &MatMulTile<V, T, MR, 1>;
  out.tiles[MR - 1][1] = &MatMulTile<V, T, MR, 2>;
  out.tiles[MR - 1][2] = &MatMulTile<V, T, MR, 3>;
  static_assert(kMaxTileCols == 3);
}

// Every tile shape of V for weights of type T.
template <typename V, DType T>
constexpr TileKernels MakeTileKernels() {
  TileKernels out{};
  FillTileRow<V, T, 1>(out);
  FillTileRow<V, T, 2>(out);
  FillTileRow<V, T, 3>(out);
  FillTileRow<V, T, 4>(out);
  static_assert(kMaxTileRows == 4);
  return out;
}

}  // namespace
}  // namespace pdserve::cpu::internal

#endif  // PDSERVE_ENGINE_CPU_MATMUL_TILE_H_
