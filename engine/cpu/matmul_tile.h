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
#ifndef PDSERVE_ENGINE_CPU_MATMUL_TILE_H_
#define PDSERVE_ENGINE_CPU_MATMUL_TILE_H_

#include <immintrin.h>

#include <cstddef>
#include <cstdint>
#include <cstring>

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

// A register tile: MR rows of x against NR rows of w over the whole k.
// Small tiles would be bound by the latency of the multiply-adds with only
// MR * NR dependency chains, so they keep several banks of accumulators
// and alternate between them along k: at least four chains for one weight
// row (NR = 1, MatMul's few-row path), two for up to six. One weight row
// is a step of a sequential read of w, which prefetches ahead.
template <typename V, DType T, int MR, int NR>
void MatMulTile(const void* x_data, int64_t k, const std::byte* w, float* y, int64_t ldy) {
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
    if constexpr (NR == 1) PrefetchAhead(w + kk * kElem, kStep * kBanks * kElem);
    for (int b = 0; b < kBanks; ++b) {
      const int64_t at = kk + kStep * b;
      typename V::W wv[NR];
      for (int j = 0; j < NR; ++j) wv[j] = V::template LoadW<T>(w + (j * k + at) * kElem);
      for (int i = 0; i < MR; ++i) {
        const typename V::X xv = V::LoadX(x + i * k + at);
        for (int j = 0; j < NR; ++j) acc[b][i][j] = V::MulAdd(xv, wv[j], acc[b][i][j]);
      }
    }
  }
  for (; kk + kStep <= k; kk += kStep) {  // A last step when the banks do not fit.
    for (int j = 0; j < NR; ++j) {
      const typename V::W wv = V::template LoadW<T>(w + (j * k + kk) * kElem);
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
      for (int64_t t = kk; t < k; ++t) s += V::XAt(x, i * k + t) * WeightAt<T>(w + j * k * kElem, t);
      y[i * ldy + j] = s;
    }
  }
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
