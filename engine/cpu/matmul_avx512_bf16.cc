// MatMul's tiles for bf16 activations with AVX512_BF16: bf16 x against
// bf16 weights by VDPBF16PS, two products a lane, 32 elements of k a step.
// Compiled with -mavx512f/bw/vl/dq/bf16 (engine/CMakeLists.txt); called
// only where the CPU has them (cpu_kernels.cc).
#include "engine/cpu/matmul_tile.h"

namespace pdserve::cpu::internal {
namespace {

struct Avx512Bf16 {
  using Acc = __m512;
  using X = __m512bh;
  using W = __m512bh;
  using XElem = uint16_t;
  static constexpr int kStep = 32;

  static Acc Zero() { return _mm512_setzero_ps(); }
  static Acc Add(Acc a, Acc b) { return _mm512_add_ps(a, b); }
  static float Sum(Acc v) { return _mm512_reduce_add_ps(v); }
  static X LoadX(const uint16_t* p) { return (__m512bh)_mm512_loadu_si512(p); }
  template <DType T>
  static W LoadW(const std::byte* p) {
    static_assert(T == DType::kBF16);
    return (__m512bh)_mm512_loadu_si512(p);
  }
  static Acc MulAdd(X x, W w, Acc acc) { return _mm512_dpbf16_ps(acc, x, w); }
  static float XAt(const uint16_t* p, int64_t i) {
    return WeightAt<DType::kBF16>(reinterpret_cast<const std::byte*>(p), i);
  }
};

constexpr TileKernels kAvx512Bf16 = MakeTileKernels<Avx512Bf16, DType::kBF16>();

}  // namespace

const TileKernels& Avx512Bf16Tiles() { return kAvx512Bf16; }

void Avx512RoundToBf16(const float* x, int64_t n, uint16_t* out) {
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const __m512bh b = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + i + 16), _mm512_loadu_ps(x + i));
    _mm512_storeu_si512(out + i, (__m512i)b);
  }
  for (; i < n; i += 16) {
    const __mmask16 mask = n - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m256bh b = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, x + i));
    _mm256_mask_storeu_epi16(out + i, mask, (__m256i)b);
  }
}

}  // namespace pdserve::cpu::internal
