// Every kernel of the cuda backend against the CPU backend's kernel of the
// same name (engine/cpu/cpu_kernels.h) on random shapes, odd sizes
// included. Inputs are rounded to bf16 first where the device takes bf16,
// so the CPU sees exactly what the GPU sees; the tolerances are what is
// left: bf16 rounding of outputs (relative 2^-8), of the probabilities in
// the tensor-core attention kernel, and fp32 summation order. Attention
// runs through both of its kernels (fp32 tiles, tensor-core tiles).
// Label `gpu`; every test skips without a CUDA device. The same file, built
// with PDSERVE_CUDA_EMULATION, runs the kernels on the CPU emulation of
// cuda_emulation.h (cuda_kernels_emulated_test, no label, runs in CI).
#include "engine/cuda/cuda_kernels.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "absl/strings/str_cat.h"
#include "engine/cpu/cpu_kernels.h"
#include "engine/cuda/cublas_api.h"
#include "gtest/gtest.h"
#include "tests/engine/cuda/cuda_test_util.h"

namespace pdserve::cuda {
namespace {

using testing_util::DeviceVector;
using testing_util::FromBf16Bits;
using testing_util::RoundToBf16;
using testing_util::ToBf16Bits;

// Relative error of one bf16 rounding, with room for the fp32 work before.
constexpr float kBf16Tol = 1.0f / 128;

std::vector<float> Random(size_t n, std::mt19937& rng, float scale = 1.0f) {
  std::normal_distribution<float> dist(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = dist(rng);
  return v;
}

TEST(CudaKernelsTest, EmbeddingCopiesRows) {
  PD_REQUIRE_CUDA_DEVICE();
  std::mt19937 rng(1);
  const int vocab = 37, hidden = 75;
  const std::vector<float> table = RoundToBf16(Random(vocab * hidden, rng));
  const std::vector<uint16_t> bits = ToBf16Bits(table);
  const WeightMatrix w{DType::kBF16, vocab, hidden,
                       reinterpret_cast<const std::byte*>(bits.data())};
  const std::vector<int32_t> ids = {0, 36, 5, 5, 17};
  DeviceVector<uint16_t> d_table(bits);
  DeviceVector<int32_t> d_ids(ids);
  DeviceVector<float> d_out(ids.size() * hidden);
  ASSERT_EQ(Embedding(d_table.get(), hidden, d_ids.get(), ids.size(),
                      d_out.get(), nullptr),
            cudaSuccess);
  const std::vector<float> got = d_out.Download();
  std::vector<float> want(hidden);
  for (size_t i = 0; i < ids.size(); ++i) {
    cpu::EmbeddingRow(w, ids[i], want.data());
    for (int j = 0; j < hidden; ++j) ASSERT_EQ(got[i * hidden + j], want[j]);
  }
}

TEST(CudaKernelsTest, RmsNormMatchesCpuWithAndWithoutRowList) {
  PD_REQUIRE_CUDA_DEVICE();
  std::mt19937 rng(2);
  for (const int n : {1, 75, 4099}) {
    const int rows = 5;
    const std::vector<float> x = Random(rows * n, rng, 3.0f);
    const std::vector<float> w = Random(n, rng);
    DeviceVector<float> d_x(x), d_w(w);
    DeviceVector<uint16_t> d_out(rows * n);
    // All rows, then rows {4, 1} only.
    for (const std::vector<int32_t>& list :
         {std::vector<int32_t>{}, std::vector<int32_t>{4, 1}}) {
      DeviceVector<int32_t> d_rows(list);
      const int n_rows = list.empty() ? rows : static_cast<int>(list.size());
      ASSERT_EQ(RmsNorm(d_x.get(), list.empty() ? nullptr : d_rows.get(),
                        n_rows, n, d_w.get(), 1e-5f, d_out.get(), nullptr),
                cudaSuccess);
      const std::vector<float> got = FromBf16Bits(d_out.Download());
      std::vector<float> want(n);
      for (int i = 0; i < n_rows; ++i) {
        const int r = list.empty() ? i : list[i];
        cpu::RmsNorm(&x[r * n], w.data(), n, 1e-5f, want.data());
        for (int j = 0; j < n; ++j) {
          ASSERT_NEAR(got[i * n + j], want[j],
                      kBf16Tol * std::abs(want[j]) + 1e-6)
              << "n " << n << " row " << r << " at " << j;
        }
      }
    }
  }
}

TEST(CudaKernelsTest, SiluMulMatchesCpu) {
  PD_REQUIRE_CUDA_DEVICE();
  std::mt19937 rng(3);
  const int rows = 3, n = 1001;
  std::vector<float> gate_up = Random(rows * 2 * n, rng, 4.0f);
  gate_up[0] = -30.0f;  // Deep in the tails.
  gate_up[1] = 30.0f;
  DeviceVector<float> d_gu(gate_up);
  DeviceVector<uint16_t> d_out(rows * n);
  ASSERT_EQ(SiluMul(d_gu.get(), rows, n, d_out.get(), nullptr), cudaSuccess);
  const std::vector<float> got = FromBf16Bits(d_out.Download());
  std::vector<float> want(n);
  for (int r = 0; r < rows; ++r) {
    cpu::SiluMul(&gate_up[r * 2 * n], &gate_up[r * 2 * n + n], n, want.data());
    for (int i = 0; i < n; ++i) {
      ASSERT_NEAR(got[r * n + i], want[i], kBf16Tol * std::abs(want[i]) + 1e-6)
          << r << "," << i;
    }
  }
}

struct RopeCase {
  int heads, kv_heads, head_dim;
  bool bias;
  RopeStyle style;
  bool llama3;
  bool head_norm = false;  // Qwen3's q/k norm before the rotation.
};
// gtest names each case by its printed parameter (ctest shows it): print
// the fields, not the struct's bytes.
void PrintTo(const RopeCase& c, std::ostream* os) {
  *os << c.heads << "/" << c.kv_heads << " heads of " << c.head_dim
      << (c.bias ? ", bias" : "")
      << (c.style == RopeStyle::kAdjacentPairs ? ", adjacent pairs" : "")
      << (c.llama3 ? ", llama3 scaling" : "")
      << (c.head_norm ? ", head norm" : "");
}

class BiasRopeTest : public ::testing::TestWithParam<RopeCase> {};

TEST_P(BiasRopeTest, MatchesCpu) {
  PD_REQUIRE_CUDA_DEVICE();
  const RopeCase p = GetParam();
  std::mt19937 rng(4);
  ModelConfig c;
  c.head_dim = p.head_dim;
  c.rope_theta = 500000.0f;
  if (p.llama3) {
    c.rope_scaling = {RopeScaling::Type::kLlama3, 8.0f, 1.0f, 4.0f, 64};
  }
  const std::vector<float> inv_freq = cpu::RopeInvFreq(c);
  const std::vector<int32_t> positions = {0, 1, 63, 64, 1000, 131071};
  const int n_tokens = static_cast<int>(positions.size());
  const int width = (p.heads + 2 * p.kv_heads) * p.head_dim;
  const int stride = width + 3;  // Rows with a gap after them.
  std::vector<float> qkv = Random(n_tokens * stride, rng);
  const std::vector<float> bias = Random(width, rng, 0.1f);
  std::vector<float> q_norm = Random(p.head_dim, rng, 0.2f);
  std::vector<float> k_norm = Random(p.head_dim, rng, 0.2f);
  for (float& w : q_norm) w += 1.0f;
  for (float& w : k_norm) w -= 1.0f;  // Unlike q's: a mix-up shows.
  const float eps = 1e-6f;

  DeviceVector<float> d_qkv(qkv), d_bias(bias), d_inv(inv_freq);
  DeviceVector<float> d_q_norm(q_norm), d_k_norm(k_norm);
  DeviceVector<int32_t> d_pos(positions);
  const HeadNorm head_norm =
      p.head_norm ? HeadNorm{d_q_norm.get(), d_k_norm.get(), eps} : HeadNorm{};
  ASSERT_EQ(
      BiasRope(d_qkv.get(), stride, width, n_tokens, d_pos.get(), d_inv.get(),
               p.heads, p.kv_heads, p.head_dim, p.bias ? d_bias.get() : nullptr,
               head_norm, p.style, nullptr),
      cudaSuccess);
  const std::vector<float> got = d_qkv.Download();

  const int half = p.head_dim / 2;
  std::vector<float> cos(half), sin(half);
  const cpu::RopeStyle style = p.style == RopeStyle::kHalfRotation
                                   ? cpu::RopeStyle::kHalfRotation
                                   : cpu::RopeStyle::kAdjacentPairs;
  for (int t = 0; t < n_tokens; ++t) {
    float* row = &qkv[t * stride];
    if (p.bias) {
      for (int i = 0; i < width; ++i) row[i] += bias[i];
    }
    if (p.head_norm) {
      for (int h = 0; h < p.heads + p.kv_heads; ++h) {
        float* v = row + h * p.head_dim;
        cpu::RmsNorm(v, h < p.heads ? q_norm.data() : k_norm.data(), p.head_dim,
                     eps, v);
      }
    }
    cpu::RopeAngles(positions[t], inv_freq, cos.data(), sin.data());
    cpu::ApplyRope(row, p.heads + p.kv_heads, p.head_dim, cos.data(),
                   sin.data(), style);
    for (int i = 0; i < stride; ++i) {
      ASSERT_NEAR(got[t * stride + i], row[i], 1e-5f * (1 + std::abs(row[i])))
          << "token " << t << " element " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, BiasRopeTest,
    ::testing::Values(
        RopeCase{4, 2, 64, false, RopeStyle::kHalfRotation, false},
        RopeCase{3, 1, 6, true, RopeStyle::kHalfRotation, false},
        RopeCase{5, 5, 10, true, RopeStyle::kAdjacentPairs, false},
        RopeCase{8, 2, 128, false, RopeStyle::kHalfRotation, true},
        RopeCase{2, 1, 256, true, RopeStyle::kAdjacentPairs, true},
        // Qwen3: 5 heads of 128 over 4 warps (one warp takes two), a head
        // shorter than a warp, bias with the norm.
        RopeCase{4, 1, 128, false, RopeStyle::kHalfRotation, false, true},
        RopeCase{3, 3, 10, true, RopeStyle::kHalfRotation, false, true}),
    [](const auto& info) {
      const RopeCase& p = info.param;
      return absl::StrCat(
          "h", p.heads, "kv", p.kv_heads, "d", p.head_dim, p.bias ? "Bias" : "",
          p.style == RopeStyle::kHalfRotation ? "Half" : "Adjacent",
          p.llama3 ? "Llama3" : "", p.head_norm ? "HeadNorm" : "");
    });

TEST(CudaKernelsTest, WriteKvStoresSlotsInTheWireLayout) {
  PD_REQUIRE_CUDA_DEVICE();
  std::mt19937 rng(5);
  const KvBlockLayout layout{/*num_layers=*/1, /*num_kv_heads=*/3,
                             /*head_dim=*/10, /*block_size=*/5, DType::kBF16};
  const int num_blocks = 4, heads = 2;
  const int kv_dim = layout.num_kv_heads * layout.head_dim;
  const int q_dim = heads * layout.head_dim;
  const int stride = q_dim + 2 * kv_dim + 1;
  const std::vector<int64_t> slots = {0, 4, 5, 19, 12};
  const int n = static_cast<int>(slots.size());
  const std::vector<float> qkv = Random(n * stride, rng);
  DeviceVector<float> d_qkv(qkv);
  DeviceVector<int64_t> d_slots(slots);
  DeviceVector<uint16_t> d_pool(num_blocks * layout.layer_block_bytes() / 2);
  const PagedKvLayer kv{d_pool.get(), layout.num_kv_heads, layout.head_dim,
                        layout.block_size};
  ASSERT_EQ(WriteKv(d_qkv.get(), stride, q_dim, q_dim + kv_dim, n,
                    d_slots.get(), kv, nullptr),
            cudaSuccess);
  const std::vector<uint16_t> pool = d_pool.Download();
  const auto* bytes = reinterpret_cast<const std::byte*>(pool.data());
  for (int t = 0; t < n; ++t) {
    const BlockId block(static_cast<int32_t>(slots[t] / layout.block_size));
    const int slot = static_cast<int>(slots[t] % layout.block_size);
    const std::byte* base = bytes + layout.PoolOffset(0, block, num_blocks);
    for (int h = 0; h < layout.num_kv_heads; ++h) {
      for (int d = 0; d < layout.head_dim; ++d) {
        const float k = qkv[t * stride + q_dim + h * layout.head_dim + d];
        const float v =
            qkv[t * stride + q_dim + kv_dim + h * layout.head_dim + d];
        EXPECT_EQ(
            LoadAsFloat(base + layout.KeyOffset(slot, h), DType::kBF16, d),
            Bf16ToFloat(FloatToBf16(k)));
        EXPECT_EQ(
            LoadAsFloat(base + layout.ValueOffset(slot, h), DType::kBF16, d),
            Bf16ToFloat(FloatToBf16(v)));
      }
    }
  }
}

struct AttentionCase {
  std::string name;
  int heads, kv_heads, head_dim, block_size, sliding_window;
  std::vector<std::pair<int, int>> seqs;  // (start_pos, new tokens)
  int num_splits;                         // 1: no context split.
};
void PrintTo(const AttentionCase& c, std::ostream* os) { *os << c.name; }

class PagedAttentionTest : public ::testing::TestWithParam<AttentionCase> {};

TEST_P(PagedAttentionTest, MatchesCpuAttendGroup) {
  PD_REQUIRE_CUDA_DEVICE();
  const AttentionCase p = GetParam();
#ifdef PDSERVE_CUDA_EMULATION
  // Emulated warps synchronise through OS threads: the long cases would
  // take minutes, and the short ones already cover every code path.
  double work = 0;
  for (auto [start, n] : p.seqs)
    work += static_cast<double>(n) * p.heads * (start + n) * p.head_dim;
  if (work > 6e6) GTEST_SKIP() << "too large to emulate (" << work << ")";
#endif
  std::mt19937 rng(6);
  const int D = p.head_dim, group = p.heads / p.kv_heads;
  const KvBlockLayout cpu_layout{1, p.kv_heads, D, p.block_size, DType::kF32};
  const KvBlockLayout gpu_layout{1, p.kv_heads, D, p.block_size, DType::kBF16};

  // Block tables: a shuffled pool, so tables are not in order.
  int total_blocks = 0, total_tokens = 0, max_context = 0;
  for (auto [start, n] : p.seqs) {
    total_blocks += (start + n + p.block_size - 1) / p.block_size;
    total_tokens += n;
    max_context = std::max(max_context, start + n);
  }
  const int num_blocks = total_blocks + 3;
  std::vector<int32_t> ids(num_blocks);
  std::iota(ids.begin(), ids.end(), 0);
  std::shuffle(ids.begin(), ids.end(), rng);

  std::vector<std::byte> cpu_pool(num_blocks * cpu_layout.layer_block_bytes());
  std::vector<std::byte> gpu_pool(num_blocks * gpu_layout.layer_block_bytes());
  std::vector<std::vector<BlockId>> tables;
  std::vector<int32_t> flat_tables;
  std::vector<AttentionSequence> seqs;
  std::vector<int32_t> group_rows;  // Rows (token x head) per sequence.
  std::normal_distribution<float> dist(0.0f, 1.0f);
  int next_block = 0, token = 0;
  for (size_t s = 0; s < p.seqs.size(); ++s) {
    const auto [start, n] = p.seqs[s];
    const int blocks = (start + n + p.block_size - 1) / p.block_size;
    std::vector<BlockId>& table = tables.emplace_back();
    seqs.push_back({token, n, start, static_cast<int32_t>(flat_tables.size())});
    for (int b = 0; b < blocks; ++b) {
      table.push_back(BlockId(ids[next_block++]));
      flat_tables.push_back(table.back().value);
    }
    // Every position of the sequence (the new ones too: the runner writes
    // them before attention) gets random K/V, the same in both pools.
    for (int pos = 0; pos < start + n; ++pos) {
      const BlockId block = table[pos / p.block_size];
      const int slot = pos % p.block_size;
      for (int h = 0; h < p.kv_heads; ++h) {
        for (int d = 0; d < D; ++d) {
          for (const bool value : {false, true}) {
            const float x = Bf16ToFloat(FloatToBf16(dist(rng)));
            const size_t c_off = cpu_layout.PoolOffset(0, block, num_blocks) +
                                 (value ? cpu_layout.ValueOffset(slot, h)
                                        : cpu_layout.KeyOffset(slot, h));
            const size_t g_off = gpu_layout.PoolOffset(0, block, num_blocks) +
                                 (value ? gpu_layout.ValueOffset(slot, h)
                                        : gpu_layout.KeyOffset(slot, h));
            StoreFromFloat(cpu_pool.data() + c_off, DType::kF32, d, x);
            StoreFromFloat(gpu_pool.data() + g_off, DType::kBF16, d, x);
          }
        }
      }
    }
    group_rows.push_back(n * group);
    token += n;
  }
  // q values are bf16-exact: the tensor-core kernel rounds q to bf16, the
  // fp32 kernel does not, and the reference should not care.
  const int q_stride = p.heads * D + 5;
  const std::vector<float> q =
      RoundToBf16(Random(total_tokens * q_stride, rng));

  DeviceVector<float> d_q(q);
  std::vector<uint16_t> pool_bits(gpu_pool.size() / 2);
  std::memcpy(pool_bits.data(), gpu_pool.data(), gpu_pool.size());
  DeviceVector<uint16_t> d_pool(pool_bits);
  DeviceVector<int32_t> d_tables(flat_tables);
  DeviceVector<AttentionSequence> d_seqs(seqs);
  const int num_splits = p.num_splits;
  DeviceVector<float> d_work(static_cast<size_t>(num_splits) * total_tokens *
                             p.heads * (D + 2));
  ASSERT_EQ(PrepareAttention(D), cudaSuccess);

  // Both kernels: fp32 tiles only, then tensor-core tiles where they
  // apply.
  std::vector<std::pair<std::string, std::vector<float>>> results;
  const struct {
    const char* name;
    bool tensor_cores;
  } variants[] = {{"fp32", false}, {"mma.sync", true}};
  for (const auto& [name, tensor_cores] : variants) {
    if (tensor_cores && !AttentionTensorCoresSupported(D)) continue;
    std::vector<AttentionTile> tiles, mma_tiles;
    for (size_t s = 0; s < group_rows.size(); ++s) {
      AppendAttentionTiles(static_cast<int32_t>(s), group_rows[s], tensor_cores,
                           tiles, mma_tiles);
    }
    if (tensor_cores && mma_tiles.empty()) continue;
    DeviceVector<AttentionTile> d_tiles(tiles), d_mma_tiles(mma_tiles);
    DeviceVector<uint16_t> d_out(total_tokens * p.heads * D);
    AttentionParams ap;
    ap.q = d_q.get();
    ap.q_row_stride = q_stride;
    ap.kv = {d_pool.get(), p.kv_heads, D, p.block_size};
    ap.block_tables = d_tables.get();
    ap.sequences = d_seqs.get();
    ap.tiles = d_tiles.get();
    ap.num_tiles = static_cast<int>(tiles.size());
    ap.mma_tiles = d_mma_tiles.get();
    ap.num_mma_tiles = static_cast<int>(mma_tiles.size());
    ap.num_heads = p.heads;
    ap.sliding_window = p.sliding_window;
    ap.scale = 1.0f / std::sqrt(static_cast<float>(D));
    ap.num_splits = num_splits;
    ap.num_tokens = total_tokens;
    ap.workspace = d_work.get();
    ap.out = d_out.get();
    ASSERT_EQ(PagedAttention(ap, nullptr), cudaSuccess);
    results.emplace_back(name, FromBf16Bits(d_out.Download()));
  }

  ASSERT_FALSE(results.empty());
  std::vector<float> scores(max_context), want(D);
  const float scale = 1.0f / std::sqrt(static_cast<float>(D));
  token = 0;
  for (size_t s = 0; s < p.seqs.size(); ++s) {
    const auto [start, n] = p.seqs[s];
    const cpu::PagedKv kv{&cpu_layout, cpu_pool.data(), tables[s]};
    for (int i = 0; i < n; ++i, ++token) {
      const int pos = start + i;
      const int first =
          p.sliding_window > 0 ? std::max(0, pos - p.sliding_window + 1) : 0;
      for (int h = 0; h < p.heads; ++h) {
        cpu::AttendGroup(&q[token * q_stride + h * D], 1, kv, h / group, first, pos,
                         scale, scores.data(), want.data());
        for (const auto& [kernel, got] : results) {
          for (int d = 0; d < D; ++d) {
            ASSERT_NEAR(got[(token * p.heads + h) * D + d], want[d],
                        kBf16Tol * std::abs(want[d]) + 2e-3f)
                << kernel << ": seq " << s << " pos " << pos << " head " << h
                << " dim " << d;
          }
        }
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, PagedAttentionTest,
    ::testing::Values(
        AttentionCase{"PrefillGqa2", 4, 2, 64, 16, 0, {{0, 37}}, 1},
        AttentionCase{"RaggedMixGroup3Dim10Block5",
                      6,
                      2,
                      10,
                      5,
                      0,
                      {{0, 20}, {35, 1}, {100, 3}, {7, 9}},
                      1},
        AttentionCase{"DecodeGroup8Split",
                      8,
                      1,
                      128,
                      16,
                      0,
                      {{500, 1}, {129, 1}, {0, 1}},
                      8},
        AttentionCase{"PrefillDim256Split", 2, 2, 256, 16, 0, {{10, 40}}, 2},
        AttentionCase{"SlidingWindow", 4, 4, 32, 16, 7, {{5, 30}, {90, 1}}, 1},
        AttentionCase{"SlidingWindowSplit", 4, 2, 32, 8, 50, {{300, 2}}, 5},
        AttentionCase{"Group20SpansTiles", 20, 1, 16, 3, 0, {{3, 2}}, 1},
        AttentionCase{
            "LongContextOddBlock", 8, 2, 96, 7, 0, {{2000, 3}, {1, 1}}, 8},
        AttentionCase{
            "LongPrefillGqa4Dim128", 8, 2, 128, 16, 0, {{100, 150}, {0, 9}}, 1},
        AttentionCase{"PrefillWindowDim64", 4, 2, 64, 16, 50, {{0, 120}}, 1},
        // Three tensor-core tiles, each over three or four steps of keys
        // (both shared-memory buffers, each used twice).
        AttentionCase{
            "ChunkAfterContextDim128", 4, 1, 128, 16, 0, {{150, 40}}, 1},
        AttentionCase{
            "ChunkAfterLongContextSplit", 8, 2, 96, 16, 0, {{2000, 100}}, 7},
        AttentionCase{
            "MoreSplitsThanKeys", 4, 2, 16, 16, 0, {{2, 1}, {40, 1}}, 16},
        // A tensor-core warp whose positions (60-63) end just before its
        // step's last key (63): the step is masked, not taken as seen whole.
        AttentionCase{"CausalStepEdgeGqa4", 4, 1, 64, 16, 0, {{0, 64}}, 1},
        // Steps every row sees causally, where the window hides the first
        // keys from some rows of a warp.
        AttentionCase{"ChunkWindowGqa2", 4, 2, 64, 16, 100, {{130, 40}}, 1},
        // A head dim the tensor-core kernel is not compiled for exactly.
        AttentionCase{"PrefillDim96", 4, 2, 96, 16, 0, {{0, 40}}, 1}),
    [](const auto& info) { return info.param.name; });

#ifndef PDSERVE_CUDA_EMULATION  // cuBLAS needs a device.
struct GemmCase {
  int64_t m, n, k;
  float beta;
};
void PrintTo(const GemmCase& c, std::ostream* os) {
  *os << "m=" << c.m << " n=" << c.n << " k=" << c.k << " beta=" << c.beta;
}

class GemmTest : public ::testing::TestWithParam<GemmCase> {};

TEST_P(GemmTest, MatchesCpuMatMul) {
  PD_REQUIRE_CUDA_DEVICE();
  const auto [m, n, k, beta] = GetParam();
  std::mt19937 rng(static_cast<unsigned>(m * 7919 + n * 31 + k));
  const std::vector<float> x = RoundToBf16(Random(m * k, rng));
  const std::vector<float> wf = RoundToBf16(Random(n * k, rng));
  const std::vector<float> y0 = Random(m * n, rng);
  const std::vector<uint16_t> x_bits = ToBf16Bits(x), w_bits = ToBf16Bits(wf);
  DeviceVector<uint16_t> d_x(x_bits), d_w(w_bits);
  DeviceVector<float> d_y(y0);
  const CublasApi* blas = Cublas();
  ASSERT_NE(blas, nullptr);
  cublasHandle_t handle;
  ASSERT_EQ(blas->create(&handle), CUBLAS_STATUS_SUCCESS);
  ASSERT_EQ(Gemm(handle, d_x.get(), m, d_w.get(), n, k, d_y.get(), beta),
            CUBLAS_STATUS_SUCCESS);
  const std::vector<float> got = d_y.Download();
  blas->destroy(handle);

  const WeightMatrix w{DType::kBF16, static_cast<int32_t>(n),
                       static_cast<int32_t>(k),
                       reinterpret_cast<const std::byte*>(w_bits.data())};
  std::vector<float> want(m * n);
  cpu::MatMul(x.data(), m, w, want.data(), /*num_threads=*/2);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double mag = std::abs(beta * y0[i * n + j]);
      for (int64_t t = 0; t < k; ++t)
        mag += std::abs(x[i * k + t] * wf[j * k + t]);
      ASSERT_NEAR(got[i * n + j], want[i * n + j] + beta * y0[i * n + j],
                  1e-5 * mag + 1e-6)
          << i << "," << j;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, GemmTest,
    ::testing::Values(GemmCase{1, 5, 8, 0.0f}, GemmCase{7, 130, 264, 0.0f},
                      GemmCase{33, 64, 17, 1.0f}, GemmCase{2, 1000, 512, 1.0f},
                      GemmCase{129, 257, 96, 0.0f}),
    [](const auto& info) {
      return absl::StrCat("m", info.param.m, "n", info.param.n, "k",
                          info.param.k,
                          info.param.beta != 0 ? "Accumulate" : "");
    });

#endif  // PDSERVE_CUDA_EMULATION

}  // namespace
}  // namespace pdserve::cuda
