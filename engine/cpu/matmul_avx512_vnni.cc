// MatMul's AVX-512 kernels: int8 weights with AVX512_VNNI, and for fp32
// activations 16-lane tiles (few rows) and panels (many rows). Compiled
// with -mavx512f/bw/vl/dq/vnni
// (engine/CMakeLists.txt); called only where the CPU has them
// (cpu_kernels.cc).
#include "engine/cpu/matmul_tile.h"

namespace pdserve::cpu::internal {
namespace {

// One block of kQ8BlockRows weight rows: a 64-byte line of the layout is
// one quad (4 consecutive weights) of each of the 16 rows, so one
// VPDPBUSD multiplies it by x's quad broadcast and adds each row's 4
// products to its own int32 lane. VPDPBUSD takes unsigned by signed bytes:
// the weights are stored biased (w + 128), and each row of x carries
// -128 * the sum of each group, the start of the group's sums, which
// leaves exactly x . w. Each group's sums are then scaled by the rows'
// fp16 scales and x's scale, in fp32. Few rows of x split a group's 8
// steps into independent chains, so that VPDPBUSD's latency (5 cycles)
// does not bound decode. S blocks at once (Q8BlockFn) take the same steps
// each, group by group.
template <int MR, int S>
void Q8BlockAvx512(const std::byte* x, int64_t x_row, int64_t groups, const std::byte* w,
                   float* y, int64_t ldy, int64_t block_step) {
  constexpr int kChains = MR == 1 ? 4 : MR <= 4 ? 2 : 1;
  const int64_t scales_at = groups * kQ8Group;
  const int64_t sums_at = scales_at + 4 * groups;
  const int64_t step_bytes = S > 1 ? block_step * groups * kQ8UnitBytes : 0;
  __m512 acc_of[S][MR];
  for (int s = 0; s < S; ++s)
    for (int i = 0; i < MR; ++i) acc_of[s][i] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    for (int s = 0; s < S; ++s) {
      __m512 (&acc)[MR] = acc_of[s];
      const std::byte* unit = w + s * step_bytes + g * kQ8UnitBytes;
      PrefetchAhead(unit, kQ8UnitBytes);
      __m512i dot[kChains][MR];
      for (int i = 0; i < MR; ++i) {
        int32_t start;
        std::memcpy(&start, x + i * x_row + sums_at + 4 * g, 4);
        dot[0][i] = _mm512_set1_epi32(start);
        for (int c = 1; c < kChains; ++c) dot[c][i] = _mm512_setzero_si512();
      }
      for (int q = 0; q < kQ8Group / 4; ++q) {
        const __m512i wq = _mm512_loadu_si512(unit + 64 * q);
        for (int i = 0; i < MR; ++i) {
          int32_t quad;
          std::memcpy(&quad, x + i * x_row + g * kQ8Group + 4 * q, 4);
          __m512i& d = dot[q % kChains][i];
          d = _mm512_dpbusd_epi32(d, wq, _mm512_set1_epi32(quad));
        }
      }
      const __m512 ws = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(unit + kQ8BlockRows * kQ8Group)));
      for (int i = 0; i < MR; ++i) {
        __m512i sum = dot[0][i];
        for (int c = 1; c < kChains; ++c) sum = _mm512_add_epi32(sum, dot[c][i]);
        float sx;
        std::memcpy(&sx, x + i * x_row + scales_at + 4 * g, 4);
        acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), _mm512_mul_ps(ws, _mm512_set1_ps(sx)),
                                 acc[i]);
      }
    }
  }
  for (int s = 0; s < S; ++s) {
    for (int i = 0; i < MR; ++i) {
      _mm512_storeu_ps(y + s * block_step * kQ8BlockRows + i * ldy, acc_of[s][i]);
    }
  }
}

// Up to 8 rows of x: 8 accumulators and 8 sums of the 32 zmm; one row,
// three blocks at once (3 accumulators and 12 sums).
constexpr Q8Kernels kAvx512VnniQ8 = {
    .max_rows = 8,
    .rows = {&Q8BlockAvx512<1, 1>, &Q8BlockAvx512<2, 1>, &Q8BlockAvx512<3, 1>,
             &Q8BlockAvx512<4, 1>, &Q8BlockAvx512<5, 1>, &Q8BlockAvx512<6, 1>,
             &Q8BlockAvx512<7, 1>, &Q8BlockAvx512<8, 1>},
    .streams = 3,
    .one_row_streams = &Q8BlockAvx512<1, 3>};

// fp32 x against fp32, fp16 and bf16 weights widened as they are loaded,
// 16 lanes: MatMulTile's vector type.
struct Avx512 {
  using Acc = __m512;
  using X = __m512;
  using W = __m512;
  using XElem = float;
  static constexpr int kStep = 16;

  static Acc Zero() { return _mm512_setzero_ps(); }
  static Acc Add(Acc a, Acc b) { return _mm512_add_ps(a, b); }
  static float Sum(Acc v) { return _mm512_reduce_add_ps(v); }
  static X LoadX(const float* p) { return _mm512_loadu_ps(p); }
  template <DType T>
  static W LoadW(const std::byte* p) {
    if constexpr (T == DType::kF32) {
      return _mm512_loadu_ps(reinterpret_cast<const float*>(p));
    } else if constexpr (T == DType::kBF16) {
      const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    } else {
      return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    }
  }
  static Acc MulAdd(X x, W w, Acc acc) { return _mm512_fmadd_ps(x, w, acc); }
  static float XAt(const float* p, int64_t i) { return p[i]; }
  static constexpr int kPerLine = 1;
  static W LoadLine(const float* p) { return _mm512_loadu_ps(p); }
  static X Broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static void Store(float* p, Acc v, int n) {
    if (n == 16) return _mm512_storeu_ps(p, v);
    _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v);
  }
  static W UnpackLo(W a, W b) { return _mm512_unpacklo_ps(a, b); }
  static W UnpackHi(W a, W b) { return _mm512_unpackhi_ps(a, b); }
  template <int kImm>
  static W Shuffle(W a, W b) {
    return _mm512_shuffle_ps(a, b, kImm);
  }
  // v[r] holds element e of row r in lane e; afterwards v[e] holds element
  // e of row r in lane r.
  static void Transpose(__m512 v[16]) {
    TransposeWithinLanes<Avx512>(v);
    __m512 out[16];
    for (int c = 0; c < 4; ++c) {
      // Lanes 0 and 2 (even) and 1 and 3 (odd) of rows 0-7, then of 8-15.
      const __m512 even_lo = _mm512_shuffle_f32x4(v[c], v[4 + c], 0x88);
      const __m512 odd_lo = _mm512_shuffle_f32x4(v[c], v[4 + c], 0xDD);
      const __m512 even_hi = _mm512_shuffle_f32x4(v[8 + c], v[12 + c], 0x88);
      const __m512 odd_hi = _mm512_shuffle_f32x4(v[8 + c], v[12 + c], 0xDD);
      out[c] = _mm512_shuffle_f32x4(even_lo, even_hi, 0x88);
      out[8 + c] = _mm512_shuffle_f32x4(even_lo, even_hi, 0xDD);
      out[4 + c] = _mm512_shuffle_f32x4(odd_lo, odd_hi, 0x88);
      out[12 + c] = _mm512_shuffle_f32x4(odd_lo, odd_hi, 0xDD);
    }
    for (int i = 0; i < 16; ++i) v[i] = out[i];
  }
};

// Indexed by DType (kF32 = 0, kF16 = 1, kBF16 = 2).
constexpr TileKernels kAvx512[3] = {MakeTileKernels<Avx512, DType::kF32>(),
                                    MakeTileKernels<Avx512, DType::kF16>(),
                                    MakeTileKernels<Avx512, DType::kBF16>()};

constexpr PanelKernels kAvx512Panels = MakePanelKernels<Avx512, 12>();

}  // namespace

const PanelKernels& Avx512PanelKernels() { return kAvx512Panels; }

const Q8Kernels& Avx512VnniQ8Kernels() { return kAvx512VnniQ8; }

const TileKernels& Avx512Tiles(DType weights) { return kAvx512[static_cast<int>(weights)]; }

}  // namespace pdserve::cpu::internal
