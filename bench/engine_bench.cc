// pd-engine-bench: CPU engine throughput on a ~110M-parameter Llama shape
// (dim 768, 12 layers, 12 heads, 4 KV heads, FFN 2048, vocab 32000) with
// random weights, in fp32 and bf16:
//   - prefill tokens/s for one prompt of 128 and 512 tokens;
//   - decode tokens/s at batch 1 and 16 (context 256), with the bytes a
//     step must read (weights + KV) turned into achieved bandwidth, as a
//     share of this machine's copy bandwidth measured in the same run
//     (STREAM convention: bytes read + bytes written per second);
//   - prefill's achieved FLOP/s as a share of the machine's fp32 FMA peak,
//     also measured in the same run (independent FMA chains on every thread).
// Every figure is the median of --reps runs.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <iostream>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "engine/builtin_tiny.h"
#include "engine/model_runner.h"

ABSL_FLAG(int32_t, threads, 2, "CPU threads");
ABSL_FLAG(int32_t, reps, 5, "Repetitions per figure (median reported)");
ABSL_FLAG(int32_t, decode_context, 256, "Context length of each sequence while decoding");
ABSL_FLAG(std::string, dtypes, "f32,bf16", "Weight dtypes to run: f32, bf16, f16");

namespace pdserve {
namespace {

using Clock = std::chrono::steady_clock;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Copy bandwidth with `threads` threads over buffers far larger than cache.
double MeasureCopyBandwidth(int threads, int reps) {
  const size_t bytes = size_t{512} << 20;
  std::vector<char> src(bytes, 1), dst(bytes, 0);
  std::vector<double> gbps;
  for (int r = 0; r < reps + 1; ++r) {
    const auto t0 = Clock::now();
#pragma omp parallel num_threads(threads)
    {
      const size_t chunk = bytes / omp_get_num_threads();
      const size_t off = chunk * omp_get_thread_num();
      std::memcpy(dst.data() + off, src.data() + off, chunk);
    }
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (r > 0) gbps.push_back(2.0 * bytes / s / 1e9);  // First run warms the pages.
  }
  return Median(gbps);
}

// fp32 FMA throughput with `threads` threads: ten independent chains of
// 8-wide FMAs per thread, enough to cover the FMA latency.
double MeasureFmaPeak(int threads, int reps) {
  const long iters = 50'000'000;
  std::vector<double> gflops;
  for (int r = 0; r < reps; ++r) {
    float sink = 0.0f;
    const auto t0 = Clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
      const __m256 b = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(0.001f);
      __m256 a0 = _mm256_set1_ps(0), a1 = _mm256_set1_ps(1), a2 = _mm256_set1_ps(2),
             a3 = _mm256_set1_ps(3), a4 = _mm256_set1_ps(4), a5 = _mm256_set1_ps(5),
             a6 = _mm256_set1_ps(6), a7 = _mm256_set1_ps(7), a8 = _mm256_set1_ps(8),
             a9 = _mm256_set1_ps(9);
      for (long i = 0; i < iters; ++i) {
        a0 = _mm256_fmadd_ps(a0, b, c); a1 = _mm256_fmadd_ps(a1, b, c);
        a2 = _mm256_fmadd_ps(a2, b, c); a3 = _mm256_fmadd_ps(a3, b, c);
        a4 = _mm256_fmadd_ps(a4, b, c); a5 = _mm256_fmadd_ps(a5, b, c);
        a6 = _mm256_fmadd_ps(a6, b, c); a7 = _mm256_fmadd_ps(a7, b, c);
        a8 = _mm256_fmadd_ps(a8, b, c); a9 = _mm256_fmadd_ps(a9, b, c);
      }
      const __m256 s = _mm256_add_ps(
          _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
          _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)),
                        _mm256_add_ps(a8, a9)));
      sink += s[0];
    }
    const double sec = std::chrono::duration<double>(Clock::now() - t0).count();
    if (sink == 0.0f) std::cerr << "";  // Keeps the loop alive.
    gflops.push_back(2.0 * 8 * 10 * iters * threads / sec / 1e9);
  }
  return Median(gflops);
}

// FLOPs of one forward over `n` new tokens at positions [0, n): the matrix
// products plus attention (QK^T and PV over the causal triangle).
double PrefillFlops(const ModelConfig& c, int64_t n) {
  const double q = static_cast<double>(c.num_heads) * c.head_dim;
  const double kv = static_cast<double>(c.num_kv_heads) * c.head_dim;
  const double per_token_layer =
      2.0 * c.hidden_size * (q + 2 * kv) + 2.0 * q * c.hidden_size +
      3 * 2.0 * c.hidden_size * c.intermediate_size;
  const double attention = 2.0 * 2.0 * q * (static_cast<double>(n) * (n + 1) / 2);
  return c.num_layers * (per_token_layer * n + attention) + 2.0 * c.hidden_size * c.vocab_size;
}

size_t WeightBytesReadPerStep(const Model& m) {
  size_t bytes = m.weights().lm_head.size_bytes();
  for (const LayerWeights& L : m.weights().layers) {
    for (const WeightMatrix* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) {
      bytes += w->size_bytes();
    }
  }
  return bytes;
}

struct Runner {
  std::unique_ptr<ModelRunner> runner;
  std::vector<BlockId> blocks;
};

int Run() {
  const int threads = absl::GetFlag(FLAGS_threads);
  const int reps = absl::GetFlag(FLAGS_reps);
  const int context = absl::GetFlag(FLAGS_decode_context);
  const double copy_gbps = MeasureCopyBandwidth(threads, reps);
  const double peak_gflops = MeasureFmaPeak(threads, reps);
  std::cout << absl::StrFormat(
      "copy bandwidth (%d threads): %.1f GB/s; fp32 FMA peak: %.1f GFLOP/s\n\n", threads,
      copy_gbps, peak_gflops);
  std::cout << "| weights | phase | tokens per forward | median time | tokens/s | GB/s read (share of copy BW) | GFLOP/s (share of FMA peak) |\n"
               "|---|---|---|---|---|---|---|\n";

  const std::vector<std::string> dtypes = absl::StrSplit(absl::GetFlag(FLAGS_dtypes), ',');
  for (const auto& [name, dtype] : {std::pair{"f32", DType::kF32}, std::pair{"bf16", DType::kBF16},
                                    std::pair{"f16", DType::kF16}}) {
    if (std::find(dtypes.begin(), dtypes.end(), name) == dtypes.end()) continue;
    auto model = MakeRandomModel("bench-110m", Llama110MConfig(), dtype, 1);
    if (!model.ok()) {
      std::cerr << model.status() << "\n";
      return 1;
    }
    const int vocab = (*model)->config().vocab_size;
    const int block_size = 16;
    const int max_batch = 16;
    const int blocks_per_seq = (std::max(512, context + 64) + block_size - 1) / block_size;
    auto runner = CreateModelRunner(*model, {.num_kv_blocks = max_batch * blocks_per_seq,
                                             .block_size = block_size,
                                             .num_threads = threads});
    if (!runner.ok()) {
      std::cerr << runner.status() << "\n";
      return 1;
    }
    std::vector<std::vector<BlockId>> tables(max_batch);
    for (int s = 0; s < max_batch; ++s) {
      for (int b = 0; b < blocks_per_seq; ++b) tables[s].push_back(BlockId(s * blocks_per_seq + b));
    }
    std::vector<int32_t> prompt(512);
    for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>((i * 7919) % vocab);
    std::vector<float> logits(max_batch * vocab);

    for (int len : {128, 512}) {
      std::vector<double> secs;
      for (int r = 0; r < reps + 1; ++r) {
        ForwardBatch b;
        b.sequences.push_back({.tokens = std::span(prompt).subspan(0, len), .start_pos = 0,
                               .block_table = tables[0]});
        const auto t0 = Clock::now();
        if (auto s = (*runner)->Forward(b, std::span(logits).subspan(0, vocab)); !s.ok()) {
          std::cerr << s << "\n";
          return 1;
        }
        if (r > 0) secs.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      }
      const double t = Median(secs);
      const double gflops = PrefillFlops((*model)->config(), len) / t / 1e9;
      std::cout << absl::StrFormat("| %s | prefill %d | %d | %.1f ms | %.0f | | %.1f (%.0f%%) |\n", name,
                                   len, len, t * 1e3, len / t, gflops, 100.0 * gflops / peak_gflops);
    }

    for (int batch : {1, max_batch}) {
      // Fill every sequence's context once (prefill), then time decode steps.
      for (int s = 0; s < batch; ++s) {
        ForwardBatch b;
        b.sequences.push_back({.tokens = std::span(prompt).subspan(0, context), .start_pos = 0,
                               .block_table = tables[s]});
        if (auto st = (*runner)->Forward(b, std::span(logits).subspan(0, vocab)); !st.ok()) return 1;
      }
      std::vector<double> secs;
      std::vector<int32_t> tokens(batch, 42);
      for (int r = 0; r < reps + 1; ++r) {
        ForwardBatch b;
        for (int s = 0; s < batch; ++s) {
          b.sequences.push_back({.tokens = std::span(tokens).subspan(s, 1),
                                 .start_pos = context + r, .block_table = tables[s]});
        }
        const auto t0 = Clock::now();
        if (auto st = (*runner)->Forward(b, std::span(logits).subspan(0, batch * vocab)); !st.ok()) {
          std::cerr << st << "\n";
          return 1;
        }
        if (r > 0) secs.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
      }
      const double t = Median(secs);
      const KvBlockLayout& L = (*runner)->kv_layout();
      const double kv_bytes = 2.0 * batch * (context + reps / 2) * L.slot_bytes() * L.num_layers;
      const double bytes = WeightBytesReadPerStep(**model) + kv_bytes;
      // Decode FLOPs: the per-token matrix products plus attention over the context.
      const double flops = batch * (PrefillFlops((*model)->config(), 1) +
                                    (*model)->config().num_layers * 4.0 * context *
                                        (*model)->config().num_heads * (*model)->config().head_dim);
      std::cout << absl::StrFormat("| %s | decode b=%d, context %d | %d | %.2f ms | %.1f | %.1f (%.0f%%) | %.1f (%.0f%%) |\n",
                                   name, batch, context, batch, t * 1e3, batch / t, bytes / t / 1e9,
                                   100.0 * bytes / t / 1e9 / copy_gbps, flops / t / 1e9,
                                   100.0 * flops / t / 1e9 / peak_gflops);
    }
  }
  return 0;
}

}  // namespace
}  // namespace pdserve

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return pdserve::Run();
}
