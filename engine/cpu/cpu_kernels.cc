#include "engine/cpu/cpu_kernels.h"

#include <cpuid.h>
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <numbers>
#include <string>
#include <utility>

#include "absl/strings/str_cat.h"
#include "engine/cpu/matmul_kernels.h"

namespace pdserve::cpu {
namespace {

constexpr int kMaxMR = internal::kMaxTileRows;
constexpr int kMaxNR = internal::kMaxTileCols;
// Weight rows per parallel task: small enough to stay in L2 while every
// row block of x streams past them.
constexpr int64_t kRowsPerTask = 48;
// Parallel tasks per thread on the few-row path (m <= kMaxMR): a few, so a
// slow thread can be helped, each a long run of consecutive rows.
constexpr int64_t kFewRowTasksPerThread = 4;
// Consecutive weight panels per parallel task on the many-row (prefill)
// path: two, so that the first's tiles prefetch the second, and tasks stay
// small enough for the threads to even out. On the AVX2 EPYC VM of
// docs/benchmarks.md, against a static split of the panels by thread:
// prefill of 128 tokens 1.08-1.16x in f32, 1.03-1.11x in bf16, 512 tokens
// within noise (pd-engine-bench, 8 interleaved pairs); 1 or 4 panels per
// task no better than 2.
constexpr int64_t kPanelsPerTask = 2;

CpuIsa BestCpuIsa() {
  CpuIsa best = CpuIsa::kAvx2;
  for (CpuIsa isa : kAllCpuIsas) {
    if (CpuRuns(isa)) best = isa;
  }
  return best;
}

// Scratch for x rounded to bf16, one per thread and type; grown, never
// shrunk, so that steady decoding allocates nothing.
template <typename T>
std::span<T> Scratch(size_t n) {
  thread_local std::vector<T> scratch;
  if (scratch.size() < n) scratch.resize(n);
  return {scratch.data(), n};
}

// Calls fn(product, begin, end) for each run of product's units [begin,
// end) that the units [first, last) cover, the products' units (of
// `units(w)` each) laid end to end: so one split of the work covers
// several products of one x.
template <typename Units, typename Fn>
void ForEachRun(std::span<const MatMulProduct> products, Units units, int64_t first,
                int64_t last, Fn fn) {
  int64_t start = 0;
  for (const MatMulProduct& product : products) {
    const int64_t count = units(*product.w);
    const int64_t begin = std::max(first, start);
    const int64_t end = std::min(last, start + count);
    if (begin < end) fn(product, begin - start, end - start);
    start += count;
  }
}

int64_t TotalUnits(std::span<const MatMulProduct> products, int64_t (*units)(const WeightMatrix&)) {
  int64_t total = 0;
  for (const MatMulProduct& product : products) total += units(*product.w);
  return total;
}

int64_t Rows(const WeightMatrix& w) { return w.rows; }
int64_t Q8Blocks(const WeightMatrix& w) { return (w.rows + kQ8BlockRows - 1) / kQ8BlockRows; }

// With few rows of x (decode: one per sequence) the product is bound by
// reading w, once. Tiles of several adjacent weight rows read several
// short rows at a time, each a stream the hardware prefetcher must find
// anew (k elements, a few KiB); measured on an EPYC VM, that reached half
// the read bandwidth. So that path gives each task a long run of rows and
// reads it as internal::kFewRowStreams sequential streams, the run cut in
// as many stretches, one row of each per tile (row_step: the stretch):
// one core keeps more lines in flight over three streams than over one.
// The runs cross from one product to the next, so that several small
// products (q, k and v) share one parallel region. Many rows of x
// (prefill) are bound by the multiply-adds, and keep register tiles of
// NR = 3 adjacent weight rows.
void MatMulTiled(const internal::TileKernels& kernels, const void* x, size_t x_row_bytes,
                 int64_t m, std::span<const MatMulProduct> products, int num_threads) {
  const int64_t k = products[0].w->cols;
  const size_t row_bytes = static_cast<size_t>(k) * DTypeSize(products[0].w->dtype);
  const auto* x_bytes = static_cast<const std::byte*>(x);
  if (m <= kMaxMR) {
    const internal::TileFn streams = kernels.tiles[m - 1][internal::kFewRowStreams - 1];
    const int64_t rows = TotalUnits(products, Rows);
    const int64_t tasks = std::min<int64_t>(rows, num_threads * kFewRowTasksPerThread);
    const int threads = static_cast<int>(std::min<int64_t>(num_threads, tasks));
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
    for (int64_t task = 0; task < tasks; ++task) {
      ForEachRun(products, Rows, rows * task / tasks, rows * (task + 1) / tasks,
                 [&](const MatMulProduct& p, int64_t begin, int64_t end) {
                   const int64_t stretch = (end - begin) / internal::kFewRowStreams;
                   for (int64_t j = begin; j < begin + stretch; ++j) {
                     streams(x, k, p.w->data + j * row_bytes, p.y + j, p.w->rows, stretch);
                   }
                   // The rows left over: the same tile, each row in every
                   // stream (row_step 0), so that every row's sum is taken in
                   // one order whatever the split.
                   for (int64_t j = begin + stretch * internal::kFewRowStreams; j < end; ++j) {
                     streams(x, k, p.w->data + j * row_bytes, p.y + j, p.w->rows, 0);
                   }
                 });
    }
    return;
  }
  for (const MatMulProduct& p : products) {
    const int64_t n = p.w->rows;
    const int64_t tasks = (n + kRowsPerTask - 1) / kRowsPerTask;
    if (tasks == 0) continue;
    const int threads = static_cast<int>(std::min<int64_t>(num_threads, tasks));
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t n0 = task * kRowsPerTask;
      const int64_t n1 = std::min(n, n0 + kRowsPerTask);
      for (int64_t m0 = 0; m0 < m; m0 += kMaxMR) {
        const int mr = static_cast<int>(std::min<int64_t>(kMaxMR, m - m0));
        for (int64_t j = n0; j < n1; j += kMaxNR) {
          const int nr = static_cast<int>(std::min<int64_t>(kMaxNR, n1 - j));
          kernels.tiles[mr - 1][nr - 1](x_bytes + m0 * x_row_bytes, k, p.w->data + j * row_bytes,
                                        p.y + m0 * n + j, n, 1);
        }
      }
    }
  }
}

// MatMul of kQ8 weights: x quantized (once for all the products), then
// tasks of whole blocks of kQ8BlockRows weight rows, each read once per
// max_rows rows of x. With few rows of x (decode) the tasks are a few long
// runs of blocks per thread (crossing from one product to the next), each
// block one sequential stream; one row of x reads a run's blocks as
// kernels.streams streams, as MatMulTiled's few-row path reads rows. With
// many rows, tasks of kRowsPerTask rows.
void MatMulQ8(const internal::Q8Kernels& kernels, const float* x, int64_t m,
              std::span<const MatMulProduct> products, int num_threads) {
  const int64_t k = products[0].w->cols;
  const int64_t groups = (k + kQ8Group - 1) / kQ8Group;
  const int64_t x_row = internal::Q8XRowBytes(k);
  const std::span<std::byte> xq = Scratch<std::byte>(static_cast<size_t>(m * x_row));
#pragma omp parallel for num_threads(num_threads) if (m > 1 && num_threads > 1)
  for (int64_t i = 0; i < m; ++i) internal::QuantizeRowQ8(x + i * k, k, &xq[i * x_row]);

  const int64_t blocks = TotalUnits(products, Q8Blocks);
  const int64_t block_bytes = groups * kQ8UnitBytes;
  const int64_t tasks =
      m <= kernels.max_rows
          ? std::min<int64_t>(blocks, num_threads * kFewRowTasksPerThread)
          : (blocks + kRowsPerTask / kQ8BlockRows - 1) / (kRowsPerTask / kQ8BlockRows);
  const int threads = static_cast<int>(std::min<int64_t>(num_threads, tasks));
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) if (threads > 1)
  for (int64_t task = 0; task < tasks; ++task) {
    ForEachRun(products, Q8Blocks, blocks * task / tasks, blocks * (task + 1) / tasks,
               [&](const MatMulProduct& p, int64_t begin, int64_t end) {
      const int64_t n = p.w->rows;
      // One row of x: the run's whole blocks as kernels.streams streams
      // (a stretch apart), as MatMulTiled's few-row path.
      int64_t rest = begin;
      if (m == 1) {
        const int64_t whole = std::min(end, n / kQ8BlockRows) - begin;
        const int64_t stretch = std::max<int64_t>(whole, 0) / kernels.streams;
        for (int64_t b = begin; b < begin + stretch; ++b) {
          kernels.one_row_streams(xq.data(), x_row, groups, p.w->data + b * block_bytes,
                                  p.y + b * kQ8BlockRows, n, stretch);
        }
        rest = begin + stretch * kernels.streams;
      }
      // The last block's rows past n land here, not in y.
      float tail[internal::kMaxQ8Rows * kQ8BlockRows];
      for (int64_t b = rest; b < end; ++b) {
        const int64_t j = b * kQ8BlockRows;
        const bool partial = n - j < kQ8BlockRows;
        for (int64_t m0 = 0; m0 < m; m0 += kernels.max_rows) {
          const int mr = static_cast<int>(std::min<int64_t>(kernels.max_rows, m - m0));
          kernels.rows[mr - 1](&xq[m0 * x_row], x_row, groups, p.w->data + b * block_bytes,
                               partial ? tail : p.y + m0 * n + j, partial ? kQ8BlockRows : n, 0);
          if (partial) {
            for (int i = 0; i < mr; ++i) {
              std::copy_n(tail + i * kQ8BlockRows, n - j, p.y + (m0 + i) * n + j);
            }
          }
        }
      }
    });
  }
}

// Many rows of x (internal::PanelKernels; rows x_row_bytes apart, fp32,
// or bf16 for the pair panels): the products' panels of
// kernels.cols weight rows, laid end to end, are dealt out in tasks of
// kPanelsPerTask consecutive panels to whichever thread is free (so that a
// thread slowed by a neighbour on its core leaves work to the other), and
// several products of one x (q, k and v) share one parallel region. Each
// panel is copied to fp32 in a scratch of the thread's (k * cols * 4
// bytes: L2) and multiplied by every tile of x. The copy is the one read
// of w, which would wait on memory (one thread reads about 9 GB/s where
// the tiles would take ~25): the tiles of one panel prefetch the next one
// of the task, whose rows follow in memory. The rows of x are split into
// tiles of equal size, at most kernels.max_rows each, so that no tile is
// left with a few rows (and few accumulator chains).
void MatMulPanels(const internal::PanelKernels& kernels, const void* x, size_t x_row_bytes,
                  int64_t m, std::span<const MatMulProduct> products, int num_threads) {
  const auto* x_bytes = static_cast<const std::byte*>(x);
  const int64_t k = products[0].w->cols;
  const DType dtype = products[0].w->dtype;
  const size_t row_bytes = static_cast<size_t>(k) * DTypeSize(dtype);
  const int64_t cols = kernels.cols;
  const internal::PackFn pack = kernels.pack[static_cast<int>(dtype)];
  const auto panels_of = [cols](const WeightMatrix& w) { return (w.rows + cols - 1) / cols; };
  int64_t panels = 0;
  for (const MatMulProduct& p : products) panels += panels_of(*p.w);
  const int64_t tasks = (panels + kPanelsPerTask - 1) / kPanelsPerTask;
  const int64_t tiles = (m + kernels.max_rows - 1) / kernels.max_rows;
  const int threads = static_cast<int>(std::min<int64_t>(num_threads, tasks));
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    // Not Scratch<float>: the calling thread's may hold x (rounded to bf16).
    thread_local std::vector<float> panel;
    panel.resize(static_cast<size_t>(k * cols));
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < tasks; ++task) {
      const int64_t first = task * kPanelsPerTask;
      const int64_t last = std::min(panels, first + kPanelsPerTask);
      ForEachRun(products, panels_of, first, last,
                 [&](const MatMulProduct& product, int64_t begin, int64_t end) {
        const int64_t n = product.w->rows;
        const auto rows_of = [&](int64_t p) { return std::min(cols, n - p * cols); };
        for (int64_t p = begin; p < end; ++p) {
          const int rows = static_cast<int>(rows_of(p));
          const std::byte* source = product.w->data + p * cols * row_bytes;
          pack(source, row_bytes, rows, k, panel.data());
          // The next panel's rows, a share for each tile.
          const std::byte* next = source + rows * row_bytes;
          const int64_t next_bytes =
              p + 1 < end ? rows_of(p + 1) * static_cast<int64_t>(row_bytes) : 0;
          for (int64_t tile = 0; tile < tiles; ++tile) {
            const int64_t i0 = m * tile / tiles;
            const int64_t i1 = m * (tile + 1) / tiles;
            kernels.rows[i1 - i0 - 1](x_bytes + i0 * x_row_bytes, k, panel.data(),
                                      product.y + i0 * n + p * cols, n, rows,
                                      next + next_bytes * tile / tiles,
                                      next + next_bytes * (tile + 1) / tiles);
          }
        }
      });
    }
  }
}

// out[i] = x[i] rounded to bf16 (to nearest even; NaN stays NaN), as
// fp32: Bf16ToFloat(FloatToBf16(x[i])), eight at a time.
void RoundToBf16Values(const float* x, int64_t n, float* out) {
  const __m256i round = _mm256_set1_epi32(0x7fff);
  const __m256i one = _mm256_set1_epi32(1);
  const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
  const __m256 nan = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fc00000));
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);
    const __m256i rounded =
        _mm256_and_si256(_mm256_add_epi32(bits, _mm256_add_epi32(round, lsb)), high);
    _mm256_storeu_ps(out + i, _mm256_blendv_ps(_mm256_castsi256_ps(rounded), nan,
                                               _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  }
  for (; i < n; ++i) out[i] = Bf16ToFloat(FloatToBf16(x[i]));
}

// exp(x) in eight lanes: exp(x) = 2^j * exp(r), x = j ln 2 + r with
// |r| <= ln 2 / 2 (ln 2 in two parts, so r is exact), exp(r) by its
// degree-6 polynomial (Cephes' expf coefficients, within 2 ulp of the
// exact value). x is held within [-87.3, 88.3], where 2^j stays a normal
// float: below, 0 where expf gives a subnormal (< 1e-38); above, 2e38
// where expf overflows towards infinity. NaN stays NaN.
__m256 Exp8(__m256 x) {
  // MAXPS and MINPS return their second operand, x, where x is NaN.
  x = _mm256_min_ps(_mm256_set1_ps(88.3f), _mm256_max_ps(_mm256_set1_ps(-87.3f), x));
  const __m256 j = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(j, _mm256_set1_ps(-2.12194440e-4f),
                                    _mm256_fnmadd_ps(j, _mm256_set1_ps(0.693359375f), x));
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i pow2j =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(j), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(pow2j));
}

// The sum of the eight lanes of v.
float Sum8(__m256 v) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  h = _mm_add_ss(h, _mm_movehdup_ps(h));
  return _mm_cvtss_f32(h);
}

// The sum of a[i] * b[i], i < n: four chains of eight lanes, so that a
// head's dot product (64 or 128) is not bound by the latency of one chain.
float Dot(const float* a, const float* b, int64_t n) {
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    for (int c = 0; c < 4; ++c) {
      acc[c] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8 * c), _mm256_loadu_ps(b + i + 8 * c),
                               acc[c]);
    }
  }
  for (int c = 0; i + 8 <= n; i += 8, c = (c + 1) % 4) {
    acc[c] = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc[c]);
  }
  float s = Sum8(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3])));
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

}  // namespace

std::string_view CpuIsaName(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kAvx2:
      return "avx2";
    case CpuIsa::kAvx512Vnni:
      return "avx512_vnni";
    case CpuIsa::kAvx512Bf16:
      return "avx512_bf16";
  }
  return "?";
}

bool CpuRuns(CpuIsa isa) {
  // __builtin_cpu_supports also checks that the OS saves the registers.
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  const bool avx512_vnni = avx2 && __builtin_cpu_supports("avx512f") &&
                           __builtin_cpu_supports("avx512bw") &&
                           __builtin_cpu_supports("avx512vl") &&
                           __builtin_cpu_supports("avx512dq") &&
                           __builtin_cpu_supports("avx512vnni");
  switch (isa) {
    case CpuIsa::kAvx2:
      return avx2;
    case CpuIsa::kAvx512Vnni:
      return avx512_vnni;
    case CpuIsa::kAvx512Bf16:
      return avx512_vnni && __builtin_cpu_supports("avx512bf16");
  }
  return false;
}

absl::StatusOr<CpuIsa> CpuIsaFromEnvironment() {
  const CpuIsa best = BestCpuIsa();
  const char* value = std::getenv("PDSERVE_CPU_ISA");
  if (value == nullptr || *value == '\0') return best;
  std::string names;
  for (CpuIsa isa : kAllCpuIsas) {
    if (CpuIsaName(isa) == value) return std::min(isa, best);
    absl::StrAppend(&names, names.empty() ? "" : ", ", std::string(CpuIsaName(isa)));
  }
  return absl::InvalidArgumentError(absl::StrCat("PDSERVE_CPU_ISA='", value,
                                                 "' names no CPU kernels; set one of ", names,
                                                 " (the most the kernels may use) or unset it"));
}

bool Avx512Fp32Pays() {
  static const bool pays = [] {
    unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
    if (__get_cpuid(0, &eax, &ebx, &ecx, &edx) == 0) return true;
    char vendor[13] = {};
    std::memcpy(vendor, &ebx, 4);
    std::memcpy(vendor + 4, &edx, 4);
    std::memcpy(vendor + 8, &ecx, 4);
    if (std::string_view(vendor) != "AuthenticAMD") return true;
    if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return true;
    const unsigned base = (eax >> 8) & 0xf;
    const unsigned family = base == 0xf ? base + ((eax >> 20) & 0xff) : base;
    return family != 0x19;
  }();
  return pays;
}

CpuIsa DefaultCpuIsa() {
  static const CpuIsa isa = CpuIsaFromEnvironment().value_or(BestCpuIsa());
  return isa;
}

void MatMul(const float* x, int64_t m, std::span<const MatMulProduct> products,
            const MatMulOptions& options) {
  if (m <= 0 || products.empty() || TotalUnits(products, Rows) == 0) return;
  const WeightMatrix& w = *products[0].w;
  for (const MatMulProduct& p : products) {
    if (p.w->dtype != w.dtype || p.w->cols != w.cols) {
      // A model file may store q, k and v in different types: one at a time.
      for (const MatMulProduct& q : products) MatMul(x, m, std::span(&q, 1), options);
      return;
    }
  }
  const size_t n = static_cast<size_t>(m) * w.cols;
  // Many rows of fp32 x (or of x rounded to bf16 values): MatMulPanels,
  // of 16 lanes where those pay, else of 8.
  const bool many_rows = m > kMaxMR;
  const internal::PanelKernels& panels = options.Avx512Fp32() ? internal::Avx512PanelKernels()
                                                               : internal::Avx2PanelKernels();
  const auto panel_products = [&](const float* xs) {
    MatMulPanels(panels, xs, w.cols * sizeof(float), m, products, options.num_threads);
  };
  // Many rows of x rounded to bf16 against bf16 weights: VDPBF16PS's
  // panels of pairs multiply twice as many products an instruction as the
  // fp32 panels (even k only).
  const bool pair_panels = many_rows && w.cols % 2 == 0;
  if (w.dtype == DType::kQ8) {
    MatMulQ8(options.isa >= CpuIsa::kAvx512Vnni ? internal::Avx512VnniQ8Kernels()
                                                : internal::Avx2Q8Kernels(),
             x, m, products, options.num_threads);
  } else if (!options.bf16_activations || w.dtype != DType::kBF16) {
    if (many_rows) {
      panel_products(x);
    } else {
      MatMulTiled(options.Avx512Fp32() ? internal::Avx512Tiles(w.dtype)
                                       : internal::Avx2Tiles(w.dtype),
                  x, w.cols * sizeof(float), m, products, options.num_threads);
    }
  } else if (options.isa == CpuIsa::kAvx512Bf16 &&
             (pair_panels || !(many_rows && options.Avx512Fp32()))) {
    // Few rows (the dot-product tiles), many rows of even k (the pair
    // panels), or a CPU where the 16-lane fp32 kernels do not pay (Zen 4:
    // there the 8-lane panels were never measured against the tiles).
    const std::span<uint16_t> x_bf16 = Scratch<uint16_t>(n);
    internal::Avx512RoundToBf16(x, static_cast<int64_t>(n), x_bf16.data());
    if (pair_panels) {
      MatMulPanels(internal::Avx512Bf16PanelKernels(), x_bf16.data(), w.cols * sizeof(uint16_t),
                   m, products, options.num_threads);
    } else {
      MatMulTiled(internal::Avx512Bf16Tiles(), x_bf16.data(), w.cols * sizeof(uint16_t), m,
                  products, options.num_threads);
    }
  } else {
    // The same products from the fp32 kernels (bf16 values are exact in
    // fp32, and so are the products of two of them), summed in another
    // order. Many rows of odd k with 16-lane fp32 kernels take this way
    // too: the fp32 panels prefill faster than the VDPBF16PS tiles, which
    // are dot products (on the Xeon of docs/benchmarks.md, 1.29-1.38x
    // llama.cpp's BF16 against 0.94-0.95x).
    const std::span<float> x_rounded = Scratch<float>(n);
    RoundToBf16Values(x, static_cast<int64_t>(n), x_rounded.data());
    if (many_rows) {
      panel_products(x_rounded.data());
    } else {
      MatMulTiled(internal::Avx2Tiles(DType::kBF16), x_rounded.data(), w.cols * sizeof(float), m,
                  products, options.num_threads);
    }
  }
}

void MatMul(const float* x, int64_t m, const WeightMatrix& w, float* y,
            const MatMulOptions& options) {
  const MatMulProduct product{.w = &w, .y = y};
  MatMul(x, m, std::span(&product, 1), options);
}

void MatMul(const float* x, int64_t m, const WeightMatrix& w, float* y, int num_threads) {
  MatMul(x, m, w, y, MatMulOptions{.num_threads = num_threads});
}

absl::StatusOr<WeightMatrix> QuantizeToQ8(const WeightMatrix& w, std::vector<std::byte>& storage,
                                          int num_threads) {
  if (w.dtype == DType::kQ8) return absl::InvalidArgumentError("the matrix is already kQ8");
  const WeightMatrix q{.dtype = DType::kQ8, .rows = w.rows, .cols = w.cols};
  const int64_t groups = (w.cols + kQ8Group - 1) / kQ8Group;
  const int64_t units = static_cast<int64_t>(q.size_bytes()) / kQ8UnitBytes;
  storage.resize(q.size_bytes());
  // Padding (rows past w.rows, columns past w.cols): weight 0 (biased:
  // 128), scale 0.
  for (int64_t u = 0; u < units; ++u) {
    std::byte* unit = storage.data() + u * kQ8UnitBytes;
    std::fill_n(unit, kQ8BlockRows * kQ8Group, std::byte{0x80});
    std::fill_n(unit + kQ8BlockRows * kQ8Group, 2 * kQ8BlockRows, std::byte{0});
  }
  const size_t in_row = static_cast<size_t>(w.cols) * DTypeSize(w.dtype);
  // Rows with a weight that is not finite or needs a scale beyond fp16.
  std::vector<uint8_t> bad(w.rows, 0);
#pragma omp parallel num_threads(num_threads) if (num_threads > 1)
  {
    std::vector<float> row(w.cols);
#pragma omp for schedule(static)
    for (int32_t r = 0; r < w.rows; ++r) {
      for (int32_t i = 0; i < w.cols; ++i) {
        row[i] = LoadAsFloat(w.data + r * in_row, w.dtype, i);
        bad[r] |= !std::isfinite(row[i]);
      }
      const int64_t block = r / kQ8BlockRows;
      const int64_t lane = r % kQ8BlockRows;
      for (int64_t g = 0; g < groups && !bad[r]; ++g) {
        const int64_t lo = g * kQ8Group;
        int8_t group[kQ8Group];
        int32_t sum;
        const float scale = internal::QuantizeGroupQ8(
            &row[lo], std::min<int64_t>(w.cols - lo, kQ8Group), /*fp16_scale=*/true, group, &sum);
        bad[r] = !std::isfinite(scale);
        std::byte* unit = storage.data() + (block * groups + g) * kQ8UnitBytes;
        for (int64_t t = 0; t < kQ8Group; ++t) {
          unit[(t / 4) * 4 * kQ8BlockRows + lane * 4 + t % 4] =
              static_cast<std::byte>(static_cast<uint8_t>(group[t] + 128));
        }
        const uint16_t half = FloatToFp16(scale);  // Exact: scale is an fp16 value.
        std::memcpy(unit + kQ8BlockRows * kQ8Group + 2 * lane, &half, 2);
      }
    }
  }
  if (const auto it = std::find(bad.begin(), bad.end(), 1); it != bad.end()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot quantize to int8: row ", it - bad.begin(),
        " has a weight that is not finite or above 127 * 65504 (an fp16 scale)"));
  }
  WeightMatrix out = q;
  out.data = storage.data();
  return out;
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
  const __m256 one = _mm256_set1_ps(1.0f);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = Exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)),
                                            _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) {
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

namespace {

// v[i] = exp(v[i] - shift) for i < n; returns their sum. Eight lanes at
// a time (Exp8); the tail of n % 8 values: std::exp.
float ExpShifted(float* v, int64_t n, float shift) {
  const __m256 shift_v = _mm256_set1_ps(shift);
  __m256 sum = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 e = Exp8(_mm256_sub_ps(_mm256_loadu_ps(v + i), shift_v));
    _mm256_storeu_ps(v + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  float total = Sum8(sum);
  for (; i < n; ++i) {
    v[i] = std::exp(v[i] - shift);
    total += v[i];
  }
  return total;
}

// Positions from p to the end of p's block or `pos`, whichever is first:
// consecutive slots of one block.
int64_t RunFrom(const PagedKv& kv, int64_t p, int64_t pos) {
  const int64_t block_size = kv.layout->block_size;
  return std::min(pos + 1, (p / block_size + 1) * block_size) - p;
}

// The largest of v[0, n), NaN skipped (-inf when all are).
float MaxOf(const float* v, int64_t n) {
  __m256 acc = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  // MAXPS returns its second operand, the running maximum, when v is NaN.
  for (; i + 8 <= n; i += 8) acc = _mm256_max_ps(_mm256_loadu_ps(v + i), acc);
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  float m = -INFINITY;
  for (float lane : lanes) m = std::max(m, lane);
  for (; i < n; ++i) m = std::max(m, v[i]);
  return m;
}

// out[e] += sum over j < run of weights[j] * value[j * slot_floats + e],
// for e < 8 * VECTORS: the sums stay in registers over the run.
template <int VECTORS>
void AddValues(const float* value, int64_t run, int64_t slot_floats, const float* weights,
               float* out) {
  __m256 acc[VECTORS];
  for (int v = 0; v < VECTORS; ++v) acc[v] = _mm256_loadu_ps(out + 8 * v);
  for (int64_t j = 0; j < run; ++j) {
    const __m256 weight = _mm256_set1_ps(weights[j]);
    for (int v = 0; v < VECTORS; ++v) {
      acc[v] = _mm256_fmadd_ps(weight, _mm256_loadu_ps(value + j * slot_floats + 8 * v), acc[v]);
    }
  }
  for (int v = 0; v < VECTORS; ++v) _mm256_storeu_ps(out + 8 * v, acc[v]);
}

// AddValues<1> .. AddValues<kMaxValueVectors>: a head of 64 in one call.
constexpr int kMaxValueVectors = 8;
template <int... V>
constexpr auto MakeAddValues(std::integer_sequence<int, V...>) {
  return std::array{&AddValues<V + 1>...};
}
constexpr auto kAddValues = MakeAddValues(std::make_integer_sequence<int, kMaxValueVectors>{});

}  // namespace

// The keys and values of one KV head are read a block's run of positions
// at a time (consecutive slots, slot_bytes apart). Every query head of the
// group takes its turn on a run while it is in L1, so the group reads the
// K/V from memory once.
void AttendGroup(const float* q, int heads, const PagedKv& kv, int kv_head, int64_t first_pos,
                 int64_t pos, float scale, float* scores, float* out) {
  const int d = kv.layout->head_dim;
  const int64_t n = pos - first_pos + 1;
  const int64_t slot_floats = static_cast<int64_t>(kv.layout->slot_bytes() / sizeof(float));
  for (int64_t p = first_pos; p <= pos;) {
    const int64_t run = RunFrom(kv, p, pos);
    const float* key = kv.Key(p, kv_head);
    for (int h = 0; h < heads; ++h) {
      float* s = scores + h * n + (p - first_pos);
      for (int64_t j = 0; j < run; ++j) s[j] = Dot(q + h * d, key + j * slot_floats, d) * scale;
    }
    p += run;
  }
  // Each head's softmax, its weights normalized in place.
  for (int h = 0; h < heads; ++h) {
    float* s = scores + h * n;
    const float max_score = MaxOf(s, n);
    const float inv_sum = 1.0f / ExpShifted(s, n, max_score);
    for (int64_t j = 0; j < n; ++j) s[j] *= inv_sum;
  }
  std::fill(out, out + static_cast<int64_t>(heads) * d, 0.0f);
  for (int64_t p = first_pos; p <= pos;) {
    const int64_t run = RunFrom(kv, p, pos);
    const float* value = kv.Value(p, kv_head);
    for (int h = 0; h < heads; ++h) {
      const float* weights = scores + h * n + (p - first_pos);
      float* o = out + h * d;
      int i = 0;
      while (i + 8 <= d) {  // Up to kMaxValueVectors vectors of out at a time.
        const int vectors = std::min(kMaxValueVectors, (d - i) / 8);
        kAddValues[vectors - 1](value + i, run, slot_floats, weights, o + i);
        i += 8 * vectors;
      }
      for (; i < d; ++i) {  // The d % 8 tail.
        for (int64_t j = 0; j < run; ++j) o[i] += weights[j] * value[j * slot_floats + i];
      }
    }
    p += run;
  }
}

}  // namespace pdserve::cpu
