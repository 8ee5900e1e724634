#include "engine/cpu/cpu_kernels.h"

#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <numbers>

namespace pdserve::cpu {
namespace {

// Eight weights starting at p, widened to fp32.
template <DType T>
inline __m256 Load8(const std::byte* p) {
  if constexpr (T == DType::kF32) {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(p));
  } else if constexpr (T == DType::kBF16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
}

inline float HorizontalSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// A register tile: MR rows of x against NR rows of w over the whole k.
// Small tiles would be bound by the FMA latency with only MR * NR
// dependency chains, so they keep several banks of accumulators and
// alternate between them along k: at least four chains for one weight row
// (NR = 1, the few-row path of MatMulTyped), two for up to six.
template <DType T, int MR, int NR>
void MatMulTile(const float* x, int64_t k, const std::byte* w, float* y, int64_t ldy) {
  constexpr size_t kElem = DTypeSize(T);
  constexpr int kBanks = NR == 1 ? (MR == 1 ? 4 : 2) : MR * NR <= 6 ? 2 : 1;
  __m256 acc[kBanks][MR][NR];
  for (int b = 0; b < kBanks; ++b)
    for (int i = 0; i < MR; ++i)
      for (int j = 0; j < NR; ++j) acc[b][i][j] = _mm256_setzero_ps();
  int64_t kk = 0;
  for (; kk + 8 * kBanks <= k; kk += 8 * kBanks) {
    for (int b = 0; b < kBanks; ++b) {
      const int64_t at = kk + 8 * b;
      __m256 wv[NR];
      for (int j = 0; j < NR; ++j) wv[j] = Load8<T>(w + (j * k + at) * kElem);
      for (int i = 0; i < MR; ++i) {
        const __m256 xv = _mm256_loadu_ps(x + i * k + at);
        for (int j = 0; j < NR; ++j) acc[b][i][j] = _mm256_fmadd_ps(xv, wv[j], acc[b][i][j]);
      }
    }
  }
  for (; kk + 8 <= k; kk += 8) {  // A last group of 8 when two banks do not fit.
    for (int j = 0; j < NR; ++j) {
      const __m256 wv = Load8<T>(w + (j * k + kk) * kElem);
      for (int i = 0; i < MR; ++i) {
        acc[0][i][j] = _mm256_fmadd_ps(_mm256_loadu_ps(x + i * k + kk), wv, acc[0][i][j]);
      }
    }
  }
  for (int i = 0; i < MR; ++i) {
    for (int j = 0; j < NR; ++j) {
      __m256 sum = acc[0][i][j];
      for (int b = 1; b < kBanks; ++b) sum = _mm256_add_ps(sum, acc[b][i][j]);
      float s = HorizontalSum(sum);
      for (int64_t t = kk; t < k; ++t) {
        s += x[i * k + t] * LoadAsFloat(w + j * k * kElem, T, t);
      }
      y[i * ldy + j] = s;
    }
  }
}

constexpr int kMaxMR = 4;
constexpr int kMaxNR = 3;
// Weight rows per parallel task: small enough to stay in L2 while every
// row block of x streams past them.
constexpr int64_t kRowsPerTask = 48;
// Parallel tasks per thread on the few-row path (m <= kMaxMR): a few, so a
// slow thread can be helped, each a long run of consecutive rows.
constexpr int64_t kFewRowTasksPerThread = 4;

using TileFn = void (*)(const float*, int64_t, const std::byte*, float*, int64_t);

template <DType T, int MR, int NR>
constexpr TileFn TileFor() { return &MatMulTile<T, MR, NR>; }

template <DType T>
struct TileTable {
  // kTiles[mr - 1][nr - 1]
  static constexpr TileFn kTiles[kMaxMR][kMaxNR] = {
      {TileFor<T, 1, 1>(), TileFor<T, 1, 2>(), TileFor<T, 1, 3>()},
      {TileFor<T, 2, 1>(), TileFor<T, 2, 2>(), TileFor<T, 2, 3>()},
      {TileFor<T, 3, 1>(), TileFor<T, 3, 2>(), TileFor<T, 3, 3>()},
      {TileFor<T, 4, 1>(), TileFor<T, 4, 2>(), TileFor<T, 4, 3>()},
  };
};

// With few rows of x (decode: one per sequence) the product is bound by
// reading w, once. Tiles of several weight rows read several short rows
// at a time, each a stream the hardware prefetcher must find anew (k
// elements, a few KiB); measured on an EPYC VM, that reached half the read
// bandwidth. So that path reads w in order, one row at a time (NR = 1),
// in long runs of rows per task: one sequential stream per thread, at the
// read bandwidth (bench/engine_bench.cc). Many rows of x (prefill) are
// bound by the FMAs, and keep register tiles of NR = 3 weight rows.
template <DType T>
void MatMulTyped(const float* x, int64_t m, const WeightMatrix& w, float* y, int num_threads) {
  const int64_t n = w.rows;
  const int64_t k = w.cols;
  const size_t row_bytes = static_cast<size_t>(k) * DTypeSize(T);
  if (m <= kMaxMR) {
    const int mr = static_cast<int>(m);
    const int64_t tasks = std::min<int64_t>(n, num_threads * kFewRowTasksPerThread);
    const int threads = static_cast<int>(std::min<int64_t>(num_threads, tasks));
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
    for (int64_t task = 0; task < tasks; ++task) {
      for (int64_t j = n * task / tasks; j < n * (task + 1) / tasks; ++j) {
        TileTable<T>::kTiles[mr - 1][0](x, k, w.data + j * row_bytes, y + j, n);
      }
    }
    return;
  }
  const int64_t tasks = (n + kRowsPerTask - 1) / kRowsPerTask;
  const int threads = static_cast<int>(std::min<int64_t>(num_threads, tasks));
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (int64_t task = 0; task < tasks; ++task) {
    const int64_t n0 = task * kRowsPerTask;
    const int64_t n1 = std::min(n, n0 + kRowsPerTask);
    for (int64_t m0 = 0; m0 < m; m0 += kMaxMR) {
      const int mr = static_cast<int>(std::min<int64_t>(kMaxMR, m - m0));
      for (int64_t j = n0; j < n1; j += kMaxNR) {
        const int nr = static_cast<int>(std::min<int64_t>(kMaxNR, n1 - j));
        TileTable<T>::kTiles[mr - 1][nr - 1](x + m0 * k, k, w.data + j * row_bytes,
                                             y + m0 * n + j, n);
      }
    }
  }
}

inline float Dot(const float* a, const float* b, int64_t n) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

void MatMul(const float* x, int64_t m, const WeightMatrix& w, float* y, int num_threads) {
  if (m <= 0 || w.rows == 0) return;
  switch (w.dtype) {
    case DType::kF32:
      return MatMulTyped<DType::kF32>(x, m, w, y, num_threads);
    case DType::kBF16:
      return MatMulTyped<DType::kBF16>(x, m, w, y, num_threads);
    case DType::kF16:
      return MatMulTyped<DType::kF16>(x, m, w, y, num_threads);
  }
}

void RmsNorm(const float* x, const float* weight, int64_t n, float eps, float* y) {
  // Accumulate in double: HF computes the mean of squares in fp32 over a
  // pairwise reduction; double keeps us within its rounding either way.
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
  const float inv = static_cast<float>(1.0 / std::sqrt(ss / n + eps));
  for (int64_t i = 0; i < n; ++i) y[i] = weight[i] * (x[i] * inv);
}

void SiluMul(const float* gate, const float* up, int64_t n, float* out) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + std::exp(-g)) * up[i];
  }
}

void EmbeddingRow(const WeightMatrix& embed, int32_t id, float* out) {
  const std::byte* row = embed.data + static_cast<size_t>(id) * embed.cols * DTypeSize(embed.dtype);
  for (int32_t i = 0; i < embed.cols; ++i) out[i] = LoadAsFloat(row, embed.dtype, i);
}

std::vector<float> RopeInvFreq(const ModelConfig& c) {
  const int half = c.head_dim / 2;
  std::vector<float> inv(half);
  for (int i = 0; i < half; ++i) {
    // fp32 as in transformers: base ** (arange(0, dim, 2).float() / dim).
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(c.head_dim);
    inv[i] = 1.0f / std::pow(c.rope_theta, exponent);
  }
  const RopeScaling& s = c.rope_scaling;
  if (s.type == RopeScaling::Type::kLinear) {
    for (float& f : inv) f /= s.factor;
  } else if (s.type == RopeScaling::Type::kLlama3) {
    const float old_len = static_cast<float>(s.original_max_position_embeddings);
    const float low_freq_wavelen = old_len / s.low_freq_factor;
    const float high_freq_wavelen = old_len / s.high_freq_factor;
    for (float& f : inv) {
      const float wavelen = 2.0f * std::numbers::pi_v<float> / f;
      if (wavelen > low_freq_wavelen) {
        f = f / s.factor;  // Low frequencies: fully interpolated.
      } else if (wavelen >= high_freq_wavelen) {
        // Medium frequencies: blend between interpolated and original.
        const float smooth =
            (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
        f = (1.0f - smooth) * f / s.factor + smooth * f;
      }
    }
  }
  return inv;
}

void RopeAngles(int64_t pos, std::span<const float> inv_freq, float* cos_out, float* sin_out) {
  for (size_t i = 0; i < inv_freq.size(); ++i) {
    const float angle = static_cast<float>(pos) * inv_freq[i];  // fp32, as HF.
    cos_out[i] = static_cast<float>(std::cos(static_cast<double>(angle)));
    sin_out[i] = static_cast<float>(std::sin(static_cast<double>(angle)));
  }
}

void ApplyRope(float* x, int num_heads, int head_dim, const float* cos, const float* sin,
               RopeStyle style) {
  const int half = head_dim / 2;
  for (int h = 0; h < num_heads; ++h) {
    float* v = x + h * head_dim;
    for (int i = 0; i < half; ++i) {
      const int a = style == RopeStyle::kHalfRotation ? i : 2 * i;
      const int b = style == RopeStyle::kHalfRotation ? i + half : 2 * i + 1;
      const float x0 = v[a], x1 = v[b];
      v[a] = x0 * cos[i] - x1 * sin[i];
      v[b] = x1 * cos[i] + x0 * sin[i];
    }
  }
}

float* PagedKv::Key(int64_t pos, int kv_head) const {
  const BlockId block = block_table[pos / layout->block_size];
  std::byte* base = layer_base + static_cast<size_t>(block.value) * layout->layer_block_bytes();
  return reinterpret_cast<float*>(base +
                                  layout->KeyOffset(static_cast<int>(pos % layout->block_size), kv_head));
}

float* PagedKv::Value(int64_t pos, int kv_head) const {
  const BlockId block = block_table[pos / layout->block_size];
  std::byte* base = layer_base + static_cast<size_t>(block.value) * layout->layer_block_bytes();
  return reinterpret_cast<float*>(
      base + layout->ValueOffset(static_cast<int>(pos % layout->block_size), kv_head));
}

void AttendOne(const float* q, const PagedKv& kv, int kv_head, int64_t first_pos, int64_t pos,
               float scale, float* scores, float* out) {
  const int d = kv.layout->head_dim;
  const int64_t n = pos - first_pos + 1;
  float max_score = -INFINITY;
  for (int64_t t = 0; t < n; ++t) {
    scores[t] = Dot(q, kv.Key(first_pos + t, kv_head), d) * scale;
    max_score = std::max(max_score, scores[t]);
  }
  float sum = 0.0f;
  for (int64_t t = 0; t < n; ++t) {
    scores[t] = std::exp(scores[t] - max_score);
    sum += scores[t];
  }
  std::fill(out, out + d, 0.0f);
  const float inv_sum = 1.0f / sum;
  for (int64_t t = 0; t < n; ++t) {
    const float p = scores[t] * inv_sum;
    const float* v = kv.Value(first_pos + t, kv_head);
#pragma omp simd
    for (int i = 0; i < d; ++i) out[i] += p * v[i];
  }
}

}  // namespace pdserve::cpu
