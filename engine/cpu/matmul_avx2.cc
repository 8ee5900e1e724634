// MatMul's kernels for the AVX2/FMA/F16C baseline (x86-64-v3): tiles and
// panels of 8 lanes of fp32, fp16 and bf16 weights widened to fp32 as they
// are loaded; int8 weights against int8 x by VPMADDUBSW.
#include <algorithm>

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
  static constexpr int kPerLine = 1;
  static W LoadLine(const float* p) { return _mm256_loadu_ps(p); }
  static X Broadcast(const float* p) { return _mm256_set1_ps(*p); }
  static void Store(float* p, Acc v, int n) {
    if (n == 8) return _mm256_storeu_ps(p, v);
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    _mm256_maskstore_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(n), lanes), v);
  }
  static W UnpackLo(W a, W b) { return _mm256_unpacklo_ps(a, b); }
  static W UnpackHi(W a, W b) { return _mm256_unpackhi_ps(a, b); }
  template <int kImm>
  static W Shuffle(W a, W b) {
    return _mm256_shuffle_ps(a, b, kImm);
  }
  // v[r] holds element e of row r in lane e; afterwards v[e] holds element
  // e of row r in lane r.
  static void Transpose(__m256 v[8]) {
    TransposeWithinLanes<Avx2>(v);
    __m256 out[8];
    for (int c = 0; c < 4; ++c) {
      out[c] = _mm256_permute2f128_ps(v[c], v[4 + c], 0x20);
      out[4 + c] = _mm256_permute2f128_ps(v[c], v[4 + c], 0x31);
    }
    for (int i = 0; i < 8; ++i) v[i] = out[i];
  }
};

// Int8 weights: one block of kQ8BlockRows weight rows, rows 0-7 and 8-15
// in two registers of 8 int32 lanes, each lane summing 4 products of one
// row a step (the layout's quads). VPMADDUBSW multiplies unsigned by
// signed bytes, so x's quad is taken as |x| and its signs move onto the
// weights (unbiased first): |x| * (w * sign(x)) = x * w. Pairs of
// products stay within int16 (2 * 127 * 127): neither side is ever -128.
// S blocks at once (Q8BlockFn) take the same steps each, group by group.
template <int MR, int S>
void Q8BlockAvx2(const std::byte* x, int64_t x_row, int64_t groups, const std::byte* w, float* y,
                 int64_t ldy, int64_t block_step) {
  const __m256i bias = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t scales_at = groups * kQ8Group;
  const int64_t step_bytes = S > 1 ? block_step * groups * kQ8UnitBytes : 0;
  __m256 acc_of[S][MR][2];
  for (int s = 0; s < S; ++s)
    for (int i = 0; i < MR; ++i) acc_of[s][i][0] = acc_of[s][i][1] = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    for (int s = 0; s < S; ++s) {
      __m256 (&acc)[MR][2] = acc_of[s];
      const std::byte* unit = w + s * step_bytes + g * kQ8UnitBytes;
      PrefetchAhead(unit, kQ8UnitBytes);
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
        const std::byte* scales = unit + kQ8BlockRows * kQ8Group + 16 * h;
        ws[h] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales)));
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
  }
  for (int s = 0; s < S; ++s) {
    float* ys = y + s * block_step * kQ8BlockRows;
    for (int i = 0; i < MR; ++i) {
      _mm256_storeu_ps(ys + i * ldy, acc_of[s][i][0]);
      _mm256_storeu_ps(ys + i * ldy + 8, acc_of[s][i][1]);
    }
  }
}

// Two rows of x at most: each keeps four accumulators of the 16 ymm. One
// row reads three blocks at once: twelve, a few spilled, and on the AVX2
// EPYC VM of docs/benchmarks.md int8 decode 1.05x two blocks at once,
// 1.14x one (pd-engine-bench, 8-10 interleaved pairs).
constexpr Q8Kernels kAvx2Q8 = {.max_rows = 2,
                               .rows = {&Q8BlockAvx2<1, 1>, &Q8BlockAvx2<2, 1>},
                               .streams = 3,
                               .one_row_streams = &Q8BlockAvx2<1, 3>};

// Indexed by DType (kF32 = 0, kF16 = 1, kBF16 = 2).
constexpr TileKernels kAvx2[3] = {MakeTileKernels<Avx2, DType::kF32>(),
                                  MakeTileKernels<Avx2, DType::kF16>(),
                                  MakeTileKernels<Avx2, DType::kBF16>()};

// 12 accumulators, two lines and the broadcast: 15 of the 16 ymm.
constexpr PanelKernels kAvx2Panels = MakePanelKernels<Avx2, 6>();

}  // namespace

const PanelKernels& Avx2PanelKernels() { return kAvx2Panels; }

const TileKernels& Avx2Tiles(DType weights) { return kAvx2[static_cast<int>(weights)]; }

const Q8Kernels& Avx2Q8Kernels() { return kAvx2Q8; }

float QuantizeGroupQ8(const float* v, int64_t n, bool fp16_scale, int8_t* q, int32_t* sum) {
  alignas(32) float group[kQ8Group] = {};  // Zero past n.
  std::memcpy(group, v, n * sizeof(float));
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 lanes[4];
  __m256 max_abs = _mm256_setzero_ps();
  for (int c = 0; c < 4; ++c) {
    lanes[c] = _mm256_load_ps(group + 8 * c);
    max_abs = _mm256_max_ps(max_abs, _mm256_andnot_ps(sign, lanes[c]));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(max_abs), _mm256_extractf128_ps(max_abs, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  float scale = _mm_cvtss_f32(m4) / 127.0f;
  if (fp16_scale) scale = _cvtsh_ss(_cvtss_sh(scale, _MM_FROUND_TO_NEAREST_INT));
  const __m256 inv = _mm256_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
  __m256i ints[4];
  for (int c = 0; c < 4; ++c) {
    __m256 r = _mm256_round_ps(_mm256_mul_ps(lanes[c], inv),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // MAXPS returns its second operand when the first is NaN.
    r = _mm256_min_ps(_mm256_max_ps(r, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
    ints[c] = _mm256_cvtps_epi32(r);
  }
  // 32 int32 to 32 int8, back in order (the packs work per 128-bit lane).
  const __m256i words = _mm256_packs_epi32(ints[0], ints[1]);
  const __m256i words2 = _mm256_packs_epi32(ints[2], ints[3]);
  const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(words, words2),
                                                    _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(q), bytes);
  const __m256i sum16 = _mm256_madd_epi16(_mm256_add_epi16(words, words2), _mm256_set1_epi16(1));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum16), _mm256_extracti128_si256(sum16, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4e));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xb1));
  *sum = _mm_cvtsi128_si32(s4);
  return scale;
}

void QuantizeRowQ8(const float* x, int64_t k, std::byte* out) {
  const int64_t groups = (k + kQ8Group - 1) / kQ8Group;
  auto* q = reinterpret_cast<int8_t*>(out);
  std::byte* scales = out + groups * kQ8Group;
  std::byte* sums = scales + 4 * groups;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t n = std::min(k - g * kQ8Group, kQ8Group);
    int32_t sum;
    const float scale =
        QuantizeGroupQ8(x + g * kQ8Group, n, /*fp16_scale=*/false, q + g * kQ8Group, &sum);
    const int32_t start = -128 * sum;
    std::memcpy(scales + 4 * g, &scale, 4);
    std::memcpy(sums + 4 * g, &start, 4);
  }
}

}  // namespace pdserve::cpu::internal
