// MatMul's tiles for int8 weights with AVX512_VNNI: two groups of 32 int8
// a step by VPDPBUSD. Compiled with -mavx512f/bw/vl/dq/vnni
// (engine/CMakeLists.txt); called only where the CPU has them
// (cpu_kernels.cc).
#include "engine/cpu/matmul_tile.h"

namespace pdserve::cpu::internal {
namespace {

// VPDPBUSD multiplies unsigned by signed bytes, so x's step is kept as |x|
// and a mask of its negative bytes, which negates w's bytes there (AVX-512
// has no VPSIGNB): |x| * (w * sign(x)) = x * w. Each 32-bit lane sums four
// products; lanes 0-7 are the step's first group, 8-15 its second, and
// the scales are laid out alike.
struct Avx512VnniQ8 {
  using Acc = __m512;
  struct XQ {
    __m512i abs;
    __mmask64 negative;
  };
  using W = __m512i;
  using Scales = __m512;
  static constexpr int kGroups = 2;

  static Acc Zero() { return _mm512_setzero_ps(); }
  static Acc Add(Acc a, Acc b) { return _mm512_add_ps(a, b); }
  static float Sum(Acc v) { return _mm512_reduce_add_ps(v); }
  // The tail step reads only the first group; the second is zero.
  template <bool kTail>
  static __m512i LoadBytes(const int8_t* p) {
    if constexpr (kTail) return _mm512_maskz_loadu_epi8(0xffffffffull, p);
    return _mm512_loadu_si512(p);
  }
  template <bool kTail>
  static XQ LoadX(const int8_t* p) {
    const __m512i v = LoadBytes<kTail>(p);
    return {_mm512_abs_epi8(v), _mm512_movepi8_mask(v)};
  }
  template <bool kTail>
  static W LoadW(const int8_t* p) {
    return LoadBytes<kTail>(p);
  }
  // Lanes 0-7 from element 0 of `two`, lanes 8-15 from element 1.
  static Scales Spread(__m128 two) {
    const __m512i index = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(index, _mm512_castps128_ps512(two));
  }
  template <bool kTail>
  static Scales LoadXScales(const float* p) {
    if constexpr (kTail) return Spread(_mm_load_ss(p));
    return Spread(_mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p))));
  }
  template <bool kTail>
  static Scales LoadWScales(const uint16_t* p) {
    uint32_t bits = p[0];
    if constexpr (!kTail) bits |= static_cast<uint32_t>(p[1]) << 16;
    return Spread(_mm_cvtph_ps(_mm_cvtsi32_si128(static_cast<int>(bits))));
  }
  static Acc MulAdd(const XQ& x, Scales xs, W w, Scales ws, Acc acc) {
    const __m512i signed_w = _mm512_mask_sub_epi8(w, x.negative, _mm512_setzero_si512(), w);
    const __m512i sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), x.abs, signed_w);
    return _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(xs, ws), acc);
  }
};

constexpr TileKernels kAvx512VnniQ8 = MakeQ8TileKernels<Avx512VnniQ8>();

}  // namespace

const TileKernels& Avx512VnniQ8Tiles() { return kAvx512VnniQ8; }

}  // namespace pdserve::cpu::internal
