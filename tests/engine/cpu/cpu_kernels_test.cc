// The CPU kernels against straightforward double-precision references.
#include "engine/cpu/cpu_kernels.h"

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <complex>
#include <numeric>
#include <random>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/engine/test_util.h"

namespace pdserve::cpu {
namespace {

std::vector<float> RandomVector(size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

struct MatMulCase {
  int64_t m, n, k;
  DType dtype;
};
// gtest names each case by its printed parameter: the fields, not the bytes.
void PrintTo(const MatMulCase& c, std::ostream* os) {
  *os << "m=" << c.m << " n=" << c.n << " k=" << c.k << " " << DTypeName(c.dtype);
}

// Every case runs on every instruction set MatMul has kernels for, with
// fp32 and with bf16 activations; a set this CPU lacks is skipped, saying
// so.
class MatMulTest
    : public ::testing::TestWithParam<std::tuple<MatMulCase, CpuIsa, bool>> {};

TEST_P(MatMulTest, MatchesDoubleReference) {
  const auto [m, n, k, dtype] = std::get<0>(GetParam());
  const CpuIsa isa = std::get<1>(GetParam());
  const bool bf16_activations = std::get<2>(GetParam());
  if (!CpuRuns(isa)) GTEST_SKIP() << "this CPU has no " << CpuIsaName(isa);
  std::mt19937 rng(static_cast<unsigned>(m * 1000003 + n * 101 + k));
  const std::vector<float> x = RandomVector(m * k, rng);
  const std::vector<float> wf = RandomVector(n * k, rng);
  std::vector<std::byte> wbytes(n * k * DTypeSize(dtype));
  for (int64_t i = 0; i < n * k; ++i) StoreFromFloat(wbytes.data(), dtype, i, wf[i]);
  const WeightMatrix w{dtype, static_cast<int32_t>(n), static_cast<int32_t>(k), wbytes.data()};
  // bf16 activations: bf16 weights multiply x rounded to bf16.
  const bool bf16_x = bf16_activations && dtype == DType::kBF16;

  // Every AVX-512 set runs its 16-lane fp32 kernels here (tiles for
  // m <= 4, panels above), whichever the CPU prefers (Avx512Fp32Pays),
  // but for bf16 activations against bf16 weights with AVX512_BF16 (its
  // dot-product tiles, and its panels of pairs where k is even); avx2
  // runs the 8-lane tiles.
  std::vector<float> y(m * n, -1.0f);
  MatMul(x.data(), m, w, y.data(),
         {.num_threads = 2, .isa = isa, .bf16_activations = bf16_activations,
          .avx512_fp32 = true});
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double ref = 0.0, mag = 0.0;
      for (int64_t t = 0; t < k; ++t) {
        const float xt = bf16_x ? Bf16ToFloat(FloatToBf16(x[i * k + t])) : x[i * k + t];
        const double p = static_cast<double>(xt) * LoadAsFloat(wbytes.data(), dtype, j * k + t);
        ref += p;
        mag += std::abs(p);
      }
      ASSERT_NEAR(y[i * n + j], ref, 1e-5 * mag + 1e-6) << "at " << i << "," << j;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, MatMulTest,
    ::testing::Combine(
        ::testing::Values(
            MatMulCase{1, 1, 1, DType::kF32}, MatMulCase{1, 7, 13, DType::kF32},
            MatMulCase{3, 50, 64, DType::kF32}, MatMulCase{4, 96, 67, DType::kF32},
            MatMulCase{17, 131, 200, DType::kF32}, MatMulCase{5, 49, 8, DType::kBF16},
            MatMulCase{9, 100, 129, DType::kBF16}, MatMulCase{2, 37, 31, DType::kF16},
            MatMulCase{13, 97, 256, DType::kF16},
            // The few-row path (m <= 4): three weight rows a stretch
            // apart, the rows left over, accumulator banks, k tails of a
            // vector and of single elements.
            MatMulCase{1, 200, 768, DType::kBF16}, MatMulCase{1, 5, 45, DType::kF16},
            MatMulCase{1, 1000, 64, DType::kF32}, MatMulCase{4, 500, 40, DType::kF16},
            MatMulCase{2, 33, 100, DType::kF32}, MatMulCase{3, 10, 40, DType::kBF16},
            MatMulCase{4, 64, 2048, DType::kF32}, MatMulCase{1, 3, 7, DType::kF32},
            // Every k tail of the 16- and 32-lane kernels, and odd k for
            // the bf16 pairs.
            MatMulCase{6, 20, 95, DType::kBF16}, MatMulCase{5, 11, 33, DType::kBF16},
            MatMulCase{7, 9, 47, DType::kF16}, MatMulCase{1, 19, 161, DType::kBF16},
            // 16-lane panels (m > 4 with AVX-512): whole tiles of 12 rows and
            // panels of 32, a panel of one row, tiles of 8 and 9 rows, k
            // of one element and k tails of a 16-column transpose.
            MatMulCase{24, 64, 16, DType::kF32}, MatMulCase{17, 33, 17, DType::kF32},
            MatMulCase{12, 32, 1, DType::kF16}, MatMulCase{40, 70, 100, DType::kBF16},
            MatMulCase{128, 96, 768, DType::kF32},
            // 8-lane panels (m > 4 below AVX-512): tiles of 6 rows split
            // in 3 and 4, one panel of 16, k tails of an 8-column
            // transpose.
            MatMulCase{7, 16, 9, DType::kF16}, MatMulCase{6, 18, 15, DType::kBF16},
            // Panels of bf16 pairs (m > 4, even k, bf16 activations with
            // AVX512_BF16): whole tiles of 12 rows, a panel of 13 rows, a
            // tail of 3 pairs after the loop's 4 a turn; a single pair.
            MatMulCase{24, 45, 70, DType::kBF16}, MatMulCase{13, 32, 2, DType::kBF16}),
        ::testing::ValuesIn(kAllCpuIsas), ::testing::Bool()),
    [](const auto& info) {
      const MatMulCase& c = std::get<0>(info.param);
      return absl::StrCat("m", c.m, "n", c.n, "k", c.k, std::string(DTypeName(c.dtype)), "_",
                          std::string(CpuIsaName(std::get<1>(info.param))),
                          std::get<2>(info.param) ? "_bf16_activations" : "");
    });

// Several products of one x (q, k and v) in one call give each product's
// own MatMul bit for bit, on every instruction set, weight type, few and
// many rows, one to three threads; products whose weights differ in type
// too. And every row's sum is taken in one order however the rows are
// split between tasks: one, two and three threads give the same bits
// (the few-row path's streams cut each task's run in stretches).
TEST(MatMulProductsTest, EqualOneMatMulEach) {
  constexpr int64_t k = 72;
  const int64_t rows[] = {200, 17, 130};  // Partial int8 blocks and tiles.
  std::mt19937 rng(7);
  for (const DType dtype : {DType::kF32, DType::kBF16, DType::kF16, DType::kQ8}) {
    std::vector<std::vector<std::byte>> bytes(3), storage(3);
    std::vector<WeightMatrix> w(3);
    for (int p = 0; p < 3; ++p) {
      const DType stored = dtype == DType::kQ8 ? DType::kBF16 : dtype;
      const std::vector<float> wf = RandomVector(rows[p] * k, rng, 0.1f);
      bytes[p].resize(wf.size() * DTypeSize(stored));
      for (size_t i = 0; i < wf.size(); ++i) StoreFromFloat(bytes[p].data(), stored, i, wf[i]);
      w[p] = {stored, static_cast<int32_t>(rows[p]), static_cast<int32_t>(k), bytes[p].data()};
      if (dtype == DType::kQ8) {
        absl::StatusOr<WeightMatrix> q = QuantizeToQ8(w[p], storage[p], 1);
        ASSERT_TRUE(q.ok()) << q.status();
        w[p] = *q;
      }
    }
    for (const CpuIsa isa : kAllCpuIsas) {
      if (!CpuRuns(isa)) continue;
      for (const int64_t m : {1, 3, 7}) {
        for (const bool bf16_activations : {false, true}) {
          const std::vector<float> x = RandomVector(m * k, rng);
          std::vector<std::vector<float>> first(3);  // One thread's.
          for (const int threads : {1, 2, 3}) {
            SCOPED_TRACE(absl::StrCat(std::string(DTypeName(dtype)), " ",
                                      std::string(CpuIsaName(isa)), " m=", m, " threads=", threads,
                                      " bf16_activations=", bf16_activations ? "yes" : "no"));
            const MatMulOptions options{
                .num_threads = threads, .isa = isa, .bf16_activations = bf16_activations};
            std::vector<std::vector<float>> one(3), all(3);
            std::vector<MatMulProduct> products;
            for (int p = 0; p < 3; ++p) {
              one[p].assign(m * rows[p], 0.0f);
              all[p].assign(m * rows[p], -1.0f);
              MatMul(x.data(), m, w[p], one[p].data(), options);
              products.push_back({.w = &w[p], .y = all[p].data()});
            }
            MatMul(x.data(), m, products, options);
            if (threads == 1) first = one;
            for (int p = 0; p < 3; ++p) {
              EXPECT_EQ(one[p], all[p]) << "product " << p;
              EXPECT_EQ(one[p], first[p]) << "product " << p << " against one thread";
            }
          }
        }
      }
    }
  }
  // Weights of two types: each product on its own kernels.
  const WeightMatrix f32{DType::kF32, 5, k, nullptr};
  std::vector<float> f32_values = RandomVector(5 * k, rng);
  WeightMatrix mixed[2] = {f32, {}};
  mixed[0].data = reinterpret_cast<const std::byte*>(f32_values.data());
  std::vector<std::byte> bf16_bytes(9 * k * 2);
  for (int64_t i = 0; i < 9 * k; ++i) {
    StoreFromFloat(bf16_bytes.data(), DType::kBF16, i, 0.01f * i);
  }
  mixed[1] = {DType::kBF16, 9, k, bf16_bytes.data()};
  const std::vector<float> x = RandomVector(2 * k, rng);
  std::vector<float> a(2 * 5), b(2 * 9), a1(2 * 5), b1(2 * 9);
  const MatMulProduct products[] = {{.w = &mixed[0], .y = a.data()},
                                    {.w = &mixed[1], .y = b.data()}};
  MatMul(x.data(), 2, products, MatMulOptions{});
  MatMul(x.data(), 2, mixed[0], a1.data(), MatMulOptions{});
  MatMul(x.data(), 2, mixed[1], b1.data(), MatMulOptions{});
  EXPECT_EQ(a, a1);
  EXPECT_EQ(b, b1);
}

// Int8 weights: QuantizeToQ8 of fp32, bf16 and fp16 matrices, then MatMul
// on every instruction set (int8 kernels: VNNI from kAvx512Vnni up, AVX2
// below), against a double reference that quantizes x itself.
struct Q8Case {
  int64_t m, n, k;
  DType from;
};
void PrintTo(const Q8Case& c, std::ostream* os) {
  *os << "m=" << c.m << " n=" << c.n << " k=" << c.k << " from " << DTypeName(c.from);
}

class Q8MatMulTest : public ::testing::TestWithParam<std::tuple<Q8Case, CpuIsa>> {};

TEST_P(Q8MatMulTest, MatchesTheQuantizedProductAndStaysNearFp32) {
  const auto [m, n, k, from] = std::get<0>(GetParam());
  const CpuIsa isa = std::get<1>(GetParam());
  if (!CpuRuns(isa)) GTEST_SKIP() << "this CPU has no " << CpuIsaName(isa);
  std::mt19937 rng(static_cast<unsigned>(m * 7919 + n * 31 + k));
  const std::vector<float> x = RandomVector(m * k, rng);
  const std::vector<float> wf = RandomVector(n * k, rng, 0.05f);
  std::vector<std::byte> wbytes(n * k * DTypeSize(from));
  for (int64_t i = 0; i < n * k; ++i) StoreFromFloat(wbytes.data(), from, i, wf[i]);
  const WeightMatrix w{from, static_cast<int32_t>(n), static_cast<int32_t>(k), wbytes.data()};
  std::vector<std::byte> storage;
  const absl::StatusOr<WeightMatrix> q = QuantizeToQ8(w, storage, 2);
  ASSERT_TRUE(q.ok()) << q.status();
  ASSERT_EQ(q->dtype, DType::kQ8);
  ASSERT_EQ(storage.size(), q->size_bytes());

  // The stored layout (QuantizeToQ8): int8 within +-127, stored + 128,
  // zero past k and past n, each weight within half a step of its scale,
  // the scale fp16(max |w| / 127).
  const int64_t groups = (k + 31) / 32;
  const int64_t blocks = (n + 15) / 16;
  ASSERT_EQ(static_cast<int64_t>(storage.size()), blocks * groups * 16 * 34);
  auto unit = [&](int64_t row, int64_t g) { return q->data + ((row / 16) * groups + g) * 16 * 34; };
  auto stored = [&](int64_t row, int64_t t) {  // Weight t of row, as int8.
    return static_cast<int>(unit(row, t / 32)[(t % 32) / 4 * 64 + (row % 16) * 4 + t % 4]) - 128;
  };
  auto stored_scale = [&](int64_t row, int64_t g) {
    uint16_t h;
    std::memcpy(&h, unit(row, g) + 512 + 2 * (row % 16), 2);
    return h;
  };
  std::vector<int8_t> wq(n * groups * 32);
  std::vector<float> ws(n * groups);
  for (int64_t j = 0; j < blocks * 16; ++j) {
    for (int64_t g = 0; g < groups; ++g) {
      float max_abs = 0.0f;
      for (int64_t t = g * 32; j < n && t < std::min(k, g * 32 + 32); ++t) {
        max_abs = std::max(max_abs, std::abs(LoadAsFloat(wbytes.data(), from, j * k + t)));
      }
      ASSERT_EQ(stored_scale(j, g), j < n ? FloatToFp16(max_abs / 127.0f) : 0)
          << "row " << j << " group " << g;
      if (j < n) ws[j * groups + g] = Fp16ToFloat(stored_scale(j, g));
    }
    for (int64_t t = 0; t < groups * 32; ++t) {
      const int v = stored(j, t);
      ASSERT_GE(v, -127);
      ASSERT_LE(v, 127);
      if (j >= n || t >= k) {
        ASSERT_EQ(v, 0) << "padding at row " << j << ", column " << t;
        continue;
      }
      wq[j * groups * 32 + t] = static_cast<int8_t>(v);
      const float scale = ws[j * groups + t / 32];
      ASSERT_NEAR(v * scale, LoadAsFloat(wbytes.data(), from, j * k + t), 0.5001f * scale);
    }
  }

  std::vector<float> y(m * n, -1.0f);
  MatMul(x.data(), m, *q, y.data(), {.num_threads = 2, .isa = isa});
  for (int64_t i = 0; i < m; ++i) {
    // x quantized as MatMul documents: per group scale max |x| / 127.
    std::vector<double> xq(groups * 32, 0.0), xs(groups, 0.0);
    for (int64_t g = 0; g < groups; ++g) {
      float max_abs = 0.0f;
      for (int64_t t = g * 32; t < std::min(k, g * 32 + 32); ++t) {
        max_abs = std::max(max_abs, std::abs(x[i * k + t]));
      }
      xs[g] = max_abs / 127.0f;
      for (int64_t t = g * 32; t < std::min(k, g * 32 + 32); ++t) {
        xq[t] = xs[g] > 0 ? std::nearbyint(x[i * k + t] / xs[g]) : 0.0;
      }
    }
    for (int64_t j = 0; j < n; ++j) {
      double ref = 0.0, mag = 0.0, step = 0.0, fp32 = 0.0, fp32_mag = 0.0;
      for (int64_t g = 0; g < groups; ++g) {
        const double scale = xs[g] * ws[j * groups + g];
        for (int64_t t = g * 32; t < g * 32 + 32; ++t) {
          const double p = scale * xq[t] * wq[j * groups * 32 + t];
          ref += p;
          mag += std::abs(p);
        }
        step = std::max(step, scale * 127);  // One x rounded the other way.
      }
      for (int64_t t = 0; t < k; ++t) {
        const double p = static_cast<double>(x[i * k + t]) * wf[j * k + t];
        fp32 += p;
        fp32_mag += std::abs(p);
      }
      ASSERT_NEAR(y[i * n + j], ref, 1e-5 * mag + step + 1e-6) << "at " << i << "," << j;
      // Two roundings of at most half a step each side of every product.
      ASSERT_NEAR(y[i * n + j], fp32, 0.02 * fp32_mag + 1e-6) << "at " << i << "," << j;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, Q8MatMulTest,
    ::testing::Combine(
        ::testing::Values(
            // Decode's few-row path, a group's tail (k % 32), an odd
            // number of groups (the 64-wide step's half step), one group.
            Q8Case{1, 1, 1, DType::kF32}, Q8Case{1, 7, 13, DType::kBF16},
            Q8Case{1, 200, 768, DType::kBF16}, Q8Case{2, 33, 100, DType::kF32},
            Q8Case{3, 10, 40, DType::kF16}, Q8Case{4, 64, 2048, DType::kBF16},
            Q8Case{1, 19, 161, DType::kF16}, Q8Case{1, 5, 96, DType::kF32},
            // One row of x: runs of whole blocks read as several streams,
            // the blocks left over and a partial last block.
            Q8Case{1, 1000, 64, DType::kF32}, Q8Case{1, 2000, 32, DType::kBF16},
            // Register tiles (m > 4) and their row and column tails.
            Q8Case{5, 49, 32, DType::kF32}, Q8Case{6, 20, 96, DType::kBF16},
            Q8Case{9, 100, 129, DType::kF16}, Q8Case{17, 131, 200, DType::kBF16},
            Q8Case{13, 97, 256, DType::kF32}),
        ::testing::ValuesIn(kAllCpuIsas)),
    [](const auto& info) {
      const Q8Case& c = std::get<0>(info.param);
      return absl::StrCat("m", c.m, "n", c.n, "k", c.k, "from", std::string(DTypeName(c.from)),
                          "_", std::string(CpuIsaName(std::get<1>(info.param))));
    });

TEST(QuantizeToQ8Test, ZeroRowsStayZeroAndNonFiniteWeightsAreAnError) {
  std::vector<float> wf(3 * 40, 0.0f);
  wf[40 + 3] = 1.0f;  // Row 1: one weight, the rest zero.
  WeightMatrix w{DType::kF32, 3, 40, reinterpret_cast<const std::byte*>(wf.data())};
  std::vector<std::byte> storage;
  absl::StatusOr<WeightMatrix> q = QuantizeToQ8(w, storage, 1);
  ASSERT_TRUE(q.ok()) << q.status();
  const std::vector<float> x(40, 2.0f);
  std::vector<float> y(3, -1.0f);
  for (CpuIsa isa : kAllCpuIsas) {
    if (!CpuRuns(isa)) continue;
    MatMul(x.data(), 1, *q, y.data(), {.isa = isa});
    // 1 is 127 steps of fp16(1 / 127).
    const float one = 127 * Fp16ToFloat(FloatToFp16(1.0f / 127));
    EXPECT_EQ(y, (std::vector<float>{0.0f, 2.0f * one, 0.0f})) << CpuIsaName(isa);
  }

  for (float bad : {INFINITY, NAN, 1e9f}) {
    wf[2 * 40 + 39] = bad;
    q = QuantizeToQ8(w, storage, 2);
    EXPECT_EQ(q.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_TRUE(absl::StrContains(q.status().message(), "row 2")) << q.status();
  }
}

TEST(CpuIsaTest, TheEnvironmentCapsTheKernelsAndABadValueIsAnError) {
  testing_util::ScopedEnv env("PDSERVE_CPU_ISA", "avx2");
  EXPECT_EQ(CpuIsaFromEnvironment().value(), CpuIsa::kAvx2);
  CpuIsa best = CpuIsa::kAvx2;
  for (CpuIsa isa : kAllCpuIsas) {
    if (CpuRuns(isa)) best = isa;
  }
  // A cap above what the CPU runs is what the CPU runs.
  env.Set("avx512_bf16");
  EXPECT_EQ(CpuIsaFromEnvironment().value(), best);
  env.Set("avx1024");
  const absl::StatusOr<CpuIsa> bad = CpuIsaFromEnvironment();
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "avx2, avx512_vnni, avx512_bf16"))
      << bad.status();
  env.Set(std::nullopt);
  EXPECT_EQ(CpuIsaFromEnvironment().value(), best);
  std::cout << "this CPU runs up to " << CpuIsaName(best) << "\n";
}

TEST(RmsNormTest, MatchesDefinition) {
  std::mt19937 rng(1);
  const int n = 75;
  const std::vector<float> x = RandomVector(n, rng, 3.0f), w = RandomVector(n, rng);
  std::vector<float> y(n);
  RmsNorm(x.data(), w.data(), n, 1e-5f, y.data());
  double ss = 0.0;
  for (float v : x) ss += static_cast<double>(v) * v;
  const double inv = 1.0 / std::sqrt(ss / n + 1e-5);
  for (int i = 0; i < n; ++i) EXPECT_NEAR(y[i], w[i] * x[i] * inv, 1e-5 * std::abs(w[i] * x[i] * inv) + 1e-7);
  RmsNorm(x.data(), w.data(), n, 1e-5f, const_cast<float*>(x.data()));  // In place.
  for (int i = 0; i < n; ++i) EXPECT_FLOAT_EQ(x[i], y[i]);
}

// Eight values at a time and a tail; gates from -100 (where exp(-g)
// overflows float) to 100.
TEST(SiluMulTest, MatchesDefinition) {
  std::vector<float> g = {-20.0f, -1.0f, 0.0f, 0.5f, 3.0f, 30.0f};
  std::vector<float> u = {2.0f, 3.0f, 4.0f, -1.0f, 0.25f, 1.0f};
  for (int i = 0; i <= 400; ++i) {
    g.push_back(-100.0f + 0.5f * i);
    u.push_back(1.0f - 0.01f * i);
  }
  std::vector<float> out(g.size());
  SiluMul(g.data(), u.data(), g.size(), out.data());
  for (size_t i = 0; i < g.size(); ++i) {
    const double s = g[i] / (1.0 + std::exp(-static_cast<double>(g[i])));
    EXPECT_NEAR(out[i], s * u[i], 1e-6 * std::abs(s * u[i]) + 1e-7);
  }
}

TEST(RopeTest, BothStylesRotatePairsByPositionTimesFrequency) {
  ModelConfig c;
  c.head_dim = 8;
  c.rope_theta = 10000.0f;
  const std::vector<float> inv = RopeInvFreq(c);
  ASSERT_EQ(inv.size(), 4u);
  for (int i = 0; i < 4; ++i) EXPECT_NEAR(inv[i], std::pow(10000.0, -2.0 * i / 8), 1e-7);
  const int pos = 37;
  std::vector<float> cs(4), sn(4);
  RopeAngles(pos, inv, cs.data(), sn.data());
  std::mt19937 rng(3);
  const std::vector<float> x = RandomVector(16, rng);  // Two heads.
  for (RopeStyle style : {RopeStyle::kHalfRotation, RopeStyle::kAdjacentPairs}) {
    std::vector<float> y = x;
    ApplyRope(y.data(), 2, 8, cs.data(), sn.data(), style);
    for (int h = 0; h < 2; ++h) {
      for (int i = 0; i < 4; ++i) {
        const int a = style == RopeStyle::kHalfRotation ? i : 2 * i;
        const int b = style == RopeStyle::kHalfRotation ? i + 4 : 2 * i + 1;
        const std::complex<double> z(x[h * 8 + a], x[h * 8 + b]);
        const std::complex<double> r = z * std::polar(1.0, pos * static_cast<double>(inv[i]));
        EXPECT_NEAR(y[h * 8 + a], r.real(), 1e-5);
        EXPECT_NEAR(y[h * 8 + b], r.imag(), 1e-5);
      }
    }
  }
}

TEST(RopeTest, Llama3ScalingKeepsHighScalesLowAndBlendsMiddle) {
  ModelConfig c;
  c.head_dim = 64;
  c.rope_theta = 500000.0f;
  const std::vector<float> base = RopeInvFreq(c);
  c.rope_scaling = {RopeScaling::Type::kLlama3, 8.0f, 1.0f, 4.0f, 8192};
  const std::vector<float> scaled = RopeInvFreq(c);
  int high = 0, low = 0, mid = 0;
  for (size_t i = 0; i < base.size(); ++i) {
    const double wavelen = 2 * M_PI / base[i];
    if (wavelen < 8192.0 / 4) {
      EXPECT_FLOAT_EQ(scaled[i], base[i]);
      ++high;
    } else if (wavelen > 8192.0) {
      EXPECT_FLOAT_EQ(scaled[i], base[i] / 8);
      ++low;
    } else {
      EXPECT_GT(scaled[i], base[i] / 8 * 0.999f);
      EXPECT_LT(scaled[i], base[i] * 1.001f);
      ++mid;
    }
  }
  EXPECT_GT(high, 0);
  EXPECT_GT(low, 0);
  EXPECT_GT(mid, 0);
}

// Runs of positions within each block, a window starting mid-block, the
// exponentials eight at a time and in the tail (lengths 9 to 45), a scale
// that spreads the scores so that most weights underflow; three query
// heads sharing the KV head; head sizes of one vector, of several and a
// tail (68: 8 + a tail of 4), and of more vectors than one pass (136).
TEST(AttendGroupTest, MatchesSoftmaxAttentionThroughAShuffledBlockTable) {
  for (const int d : {16, 68, 136}) {
    const KvBlockLayout layout{1, 2, d, 4, DType::kF32};
    const int num_blocks = 14;
    std::vector<std::byte> pool(layout.layer_block_bytes() * num_blocks);
    const std::vector<BlockId> table = {BlockId(4),  BlockId(1), BlockId(5), BlockId(0),
                                        BlockId(13), BlockId(7), BlockId(2), BlockId(9),
                                        BlockId(11), BlockId(3), BlockId(8), BlockId(12)};
    const PagedKv kv{&layout, pool.data(), table};
    std::mt19937 rng(7);
    const int len = 45;
    const int heads = 3;
    std::vector<std::vector<float>> keys, values;
    for (int p = 0; p < len; ++p) {
      keys.push_back(RandomVector(d, rng));
      values.push_back(RandomVector(d, rng));
      std::copy(keys.back().begin(), keys.back().end(), kv.Key(p, 1));
      std::copy(values.back().begin(), values.back().end(), kv.Value(p, 1));
      // KV head 0 of the same slots holds other values, never read.
      const std::vector<float> other = RandomVector(d, rng);
      std::copy(other.begin(), other.end(), kv.Key(p, 0));
      std::copy(other.begin(), other.end(), kv.Value(p, 0));
    }
    const std::vector<float> q = RandomVector(heads * d, rng);
    for (const float scale : {0.25f, 60.0f / d * 16}) {
      for (const auto [first, last] : {std::pair{0, 13}, std::pair{5, 13}, std::pair{0, 44},
                                       std::pair{7, 44}, std::pair{3, 11}}) {
        std::vector<float> scores(heads * len), out(heads * d);
        AttendGroup(q.data(), heads, kv, 1, first, last, scale, scores.data(), out.data());
        for (int h = 0; h < heads; ++h) {
          std::vector<double> w;
          double mx = -1e30, sum = 0;
          for (int p = first; p <= last; ++p) {
            double s = 0;
            for (int i = 0; i < d; ++i) s += q[h * d + i] * keys[p][i];
            w.push_back(s * scale);
            mx = std::max(mx, w.back());
          }
          for (double& x : w) sum += (x = std::exp(x - mx));
          for (int i = 0; i < d; ++i) {
            double ref = 0;
            for (int p = first; p <= last; ++p) ref += w[p - first] / sum * values[p][i];
            EXPECT_NEAR(out[h * d + i], ref, 1e-5)
                << "d " << d << ", head " << h << ", scale " << scale << ", positions "
                << first << ".." << last << ", element " << i;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace pdserve::cpu
