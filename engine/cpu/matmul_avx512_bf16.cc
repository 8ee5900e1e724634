// MatMul's kernels for bf16 activations with AVX512_BF16: bf16 x against
// bf16 weights by VDPBF16PS, two products a lane: dot-product tiles (32
// elements of k a step) and panels of pairs. Compiled with
// -mavx512f/bw/vl/dq/bf16 (engine/CMakeLists.txt); called only where the
// CPU has them (cpu_kernels.cc).
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

// PanelTile's vector type for panels of bf16 pairs (matmul_kernels.h): a
// line holds two steps of k of 16 weight rows, and a pair of x broadcast
// multiplies it by one VDPBF16PS.
struct Avx512Bf16Pairs {
  using Acc = __m512;
  using X = __m512bh;
  using W = __m512bh;
  using XElem = uint16_t;
  static constexpr int kStep = 16;
  static constexpr int kPerLine = 2;

  static Acc Zero() { return _mm512_setzero_ps(); }
  static W LoadLine(const float* p) { return (__m512bh)_mm512_loadu_ps(p); }
  static X Broadcast(const uint16_t* p) {
    int32_t pair;
    std::memcpy(&pair, p, 4);
    return (__m512bh)_mm512_set1_epi32(pair);
  }
  static Acc MulAdd(X x, W w, Acc acc) { return _mm512_dpbf16_ps(acc, x, w); }
  static void Store(float* p, Acc v, int n) {
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v);
  }
};

// A pair of bf16 is 32 bits: the panel of pairs is the 16-lane fp32 panel
// of the rows read as k / 2 floats (k even), the same transpose.
void PackBf16Pairs(const std::byte* w, size_t row_bytes, int rows, int64_t k, float* panel) {
  Avx512PanelKernels().pack[static_cast<int>(DType::kF32)](w, row_bytes, rows, k / 2, panel);
}

// Tiles of up to 12 rows of x: 24 accumulators, two lines and the
// broadcast in the 32 zmm, as the fp32 panels.
constexpr PanelKernels kAvx512Bf16Panels =
    MakePanelKernels<Avx512Bf16Pairs, 12>({nullptr, nullptr, &PackBf16Pairs});

}  // namespace

const TileKernels& Avx512Bf16Tiles() { return kAvx512Bf16; }

const PanelKernels& Avx512Bf16PanelKernels() { return kAvx512Bf16Panels; }

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
