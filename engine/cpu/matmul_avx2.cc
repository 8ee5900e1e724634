// MatMul's tiles for the AVX2/FMA/F16C baseline (x86-64-v3): 8 lanes of
// fp32; fp16 and bf16 weights widened to fp32 as they are loaded; int8
// weights against int8 x, 32 products a step by VPMADDUBSW.
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

// One group of 32 int8 a step. VPMADDUBSW multiplies unsigned by signed
// bytes, so x's step is kept as |x| and its signs move onto w (VPSIGNB):
// |x| * (w * sign(x)) = x * w. Pairs of products stay within int16
// (2 * 127 * 127), as neither side is ever -128.
struct Avx2Q8 {
  using Acc = __m256;
  struct XQ {
    __m256i abs;
    __m256i x;
  };
  using W = __m256i;
  using Scales = __m256;
  static constexpr int kGroups = 1;

  static Acc Zero() { return _mm256_setzero_ps(); }
  static Acc Add(Acc a, Acc b) { return _mm256_add_ps(a, b); }
  static float Sum(Acc v) { return Avx2::Sum(v); }
  template <bool kTail>
  static XQ LoadX(const int8_t* p) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    return {_mm256_sign_epi8(v, v), v};
  }
  template <bool kTail>
  static W LoadW(const int8_t* p) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  }
  template <bool kTail>
  static Scales LoadXScales(const float* p) { return _mm256_broadcast_ss(p); }
  template <bool kTail>
  static Scales LoadWScales(const uint16_t* p) { return _mm256_set1_ps(_cvtsh_ss(*p)); }
  static Acc MulAdd(const XQ& x, Scales xs, W w, Scales ws, Acc acc) {
    const __m256i pairs = _mm256_maddubs_epi16(x.abs, _mm256_sign_epi8(w, x.x));
    const __m256i sums = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(xs, ws), acc);
  }
};

constexpr TileKernels kAvx2Q8 = MakeQ8TileKernels<Avx2Q8>();

// Indexed by DType (kF32 = 0, kF16 = 1, kBF16 = 2).
constexpr TileKernels kAvx2[3] = {MakeTileKernels<Avx2, DType::kF32>(),
                                  MakeTileKernels<Avx2, DType::kF16>(),
                                  MakeTileKernels<Avx2, DType::kBF16>()};

}  // namespace

const TileKernels& Avx2Tiles(DType weights) {
  return weights == DType::kQ8 ? kAvx2Q8 : kAvx2[static_cast<int>(weights)];
}

}  // namespace pdserve::cpu::internal
