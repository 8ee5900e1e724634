// MatMul's tiles for the AVX2/FMA/F16C baseline (x86-64-v3): 8 lanes of
// fp32; fp16 and bf16 weights widened to fp32 as they are loaded; int8
// weights against int8 x by VPMADDUBSW.
#include "engine/cpu/matmul_tile.h"

namespace pdserve::cpu::internal {
namespace {

struct Avx2 {
  using Acc = __m256;
  using X = __m256;
  using W = __m256;
  using XElem = float;
  static constexpr int kStep = 8;

  static Acc Zero() { return _mm256_setzero_ps(); }
  static Acc Add(Acc a, Acc b) { return _mm256_add_ps(a, b); }
  static float Sum(Acc v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  static X LoadX(const float* p) { return _mm256_loadu_ps(p); }
  template <DType T>
  static W LoadW(const std::byte* p) {
    if constexpr (T == DType::kF32) {
      return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
    } else if constexpr (T == DType::kBF16) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    }
  }
  static Acc MulAdd(X x, W w, Acc acc) { return _mm256_fmadd_ps(x, w, acc); }
  static float XAt(const float* p, int64_t i) { return p[i]; }
};

// Int8 weights: one block of kQ8BlockRows weight rows, rows 0-7 and 8-15
// in two registers of 8 int32 lanes, each lane summing 4 products of one
// row a step (the layout's quads). VPMADDUBSW multiplies unsigned by
// signed bytes, so x's quad is taken as |x| and its signs move onto the
// weights (unbiased first): |x| * (w * sign(x)) = x * w. Pairs of
// products stay within int16 (2 * 127 * 127): neither side is ever -128.
template <int MR>
void Q8BlockAvx2(const std::byte* x, int64_t x_row, int64_t groups, const std::byte* w, float* y,
                 int64_t ldy) {
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t scales_at = groups * kQ8Group;
  __m256 acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const std::byte* unit = w + g * kQ8UnitBytes;
    __m256i dot[MR][2];
    for (int i = 0; i < MR; ++i) dot[i][0] = dot[i][1] = _mm256_setzero_si256();
    for (int q = 0; q < kQ8Group / 4; ++q) {
      __m256i wq[2];
      for (int h = 0; h < 2; ++h) {
        wq[h] = _mm256_xor_si256(
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + 64 * q + 32 * h)), bias);
      }
      for (int i = 0; i < MR; ++i) {
        int32_t quad;
        std::memcpy(&quad, x + i * x_row + g * kQ8Group + 4 * q, 4);
        const __m256i xq = _mm256_set1_epi32(quad);
        const __m256i xa = _mm256_sign_epi8(xq, xq);
        for (int h = 0; h < 2; ++h) {
          const __m256i pairs = _mm256_maddubs_epi16(xa, _mm256_sign_epi8(wq[h], xq));
          dot[i][h] = _mm256_add_epi32(dot[i][h], _mm256_madd_epi16(pairs, ones));
        }
      }
    }
    __m256 ws[2];
    for (int h = 0; h < 2; ++h) {
      ws[h] = _mm256_cvtph_ps(
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(unit + kQ8BlockRows * kQ8Group + 16 * h)));
    }
    for (int i = 0; i < MR; ++i) {
      float sx;
      std::memcpy(&sx, x + i * x_row + scales_at + 4 * g, 4);
      const __m256 xs = _mm256_set1_ps(sx);
      for (int h = 0; h < 2; ++h) {
        acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[i][h]), _mm256_mul_ps(ws[h], xs),
                                    acc[i][h]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    _mm256_storeu_ps(y + i * ldy, acc[i][0]);
    _mm256_storeu_ps(y + i * ldy + 8, acc[i][1]);
  }
}

// Two rows of x at most: each keeps four accumulators of the 16 ymm.
constexpr Q8Kernels kAvx2Q8 = {
    .max_rows = 2, .rows = {&Q8BlockAvx2<1>, &Q8BlockAvx2<2>}};

// Indexed by DType (kF32 = 0, kF16 = 1, kBF16 = 2).
constexpr TileKernels kAvx2[3] = {MakeTileKernels<Avx2, DType::kF32>(),
                                  MakeTileKernels<Avx2, DType::kF16>(),
                                  MakeTileKernels<Avx2, DType::kBF16>()};

}  // namespace

const TileKernels& Avx2Tiles(DType weights) { return kAvx2[static_cast<int>(weights)]; }

const Q8Kernels& Avx2Q8Kernels() { return kAvx2Q8; }

}  // namespace pdserve::cpu::internal
