// pd-engine-bench: CPU engine throughput on a ~110M-parameter Llama shape
// (dim 768, 12 layers, 12 heads, 4 KV heads, FFN 2048, vocab 32000) with
// random weights in fp32 and bf16 (--dtypes), or on a model given by
// --model (bench/llama_cpp_peer.sh gives it the weights llama.cpp runs):
//   - prefill tokens/s for one prompt of each --prefill_lengths (128, 512);
//   - decode tokens/s at each --decode_batches (1, 16) at --decode_context
//     (256), with the bytes a step must read (weights + KV) turned into
//     achieved bandwidth, as a share of this machine's copy bandwidth
//     measured in the same run (STREAM convention: bytes read + bytes
//     written per second) and of its read bandwidth (a streaming sum,
//     decode's own limit: it reads and hardly writes);
//   - achieved FLOP/s as a share of the machine's fp32 FMA peak, also
//     measured in the same run (independent FMA chains on every thread);
//     bf16 weights with --bf16_activations on a CPU with AVX512_BF16, as a
//     share of the VDPBF16PS peak (measured alike), which their kernels run.
// Every figure is the median of --reps runs; --json writes them all.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <fstream>
#include <iostream>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/statusor.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/bench_process.h"
#include "common/status_macros.h"
#include "engine/builtin_tiny.h"
#include "engine/cpu/cpu_kernels.h"
#include "engine/cpu/matmul_kernels.h"
#include "engine/model_runner.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(int32_t, threads, 2, "CPU threads");
ABSL_FLAG(int32_t, reps, 5, "Repetitions per figure (median reported)");
ABSL_FLAG(int32_t, decode_context, 256, "Context length of each sequence while decoding");
ABSL_FLAG(std::string, dtypes, "f32,bf16", "Weight dtypes to run: f32, bf16, f16 (random weights)");
ABSL_FLAG(std::string, model, "",
          "A model (Hugging Face directory or builtin:...) instead of random weights");
ABSL_FLAG(std::string, prefill_lengths, "128,512", "Prompt lengths of the prefill figures");
ABSL_FLAG(std::string, decode_batches, "1,16", "Batch sizes of the decode figures");
ABSL_FLAG(std::string, json, "", "Also write every figure here as JSON");
ABSL_FLAG(bool, bf16_activations, false,
          "Multiply bf16 weights by activations rounded to bf16 "
          "(ModelRunnerOptions::bf16_activations); their rows say so");
ABSL_FLAG(bool, int8_weights, false,
          "Quantize the weight matrices to int8 at load "
          "(ModelRunnerOptions::int8_weights); their rows say so");

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

// The sum of n floats read as the kernels that read weights in order
// read them: internal::kFewRowStreams stretches at once, each line asked
// for internal::kPrefetchAhead bytes ahead into L2.
float StreamSum(const float* p, size_t n) {
  constexpr int kStreams = cpu::internal::kFewRowStreams;
  const size_t stretch = n / kStreams / 16 * 16;
  __m256 acc[kStreams][2];
  for (int s = 0; s < kStreams; ++s) acc[s][0] = acc[s][1] = _mm256_setzero_ps();
  for (size_t i = 0; i < stretch; i += 16) {  // One line of each stretch a step.
    for (int s = 0; s < kStreams; ++s) {
      const float* line = p + s * stretch + i;
      _mm_prefetch(reinterpret_cast<const char*>(line) + cpu::internal::kPrefetchAhead,
                   _MM_HINT_T1);
      acc[s][0] = _mm256_add_ps(acc[s][0], _mm256_loadu_ps(line));
      acc[s][1] = _mm256_add_ps(acc[s][1], _mm256_loadu_ps(line + 8));
    }
  }
  __m256 v = _mm256_setzero_ps();
  for (int s = 0; s < kStreams; ++s) v = _mm256_add_ps(v, _mm256_add_ps(acc[s][0], acc[s][1]));
  return v[0] + v[1] + v[2] + v[3] + v[4] + v[5] + v[6] + v[7];
}

// Read bandwidth with `threads` threads over a buffer far larger than
// cache: the limit of decode, which reads its weights and writes next to
// nothing. On some machines far below the copy bandwidth (bytes read +
// written), which streaming stores help.
double MeasureReadBandwidth(int threads, int reps) {
  const size_t floats = (size_t{512} << 20) / sizeof(float);
  std::vector<float> src(floats, 1.0f);
  std::vector<double> gbps;
  for (int r = 0; r < reps + 1; ++r) {
    float sink = 0.0f;
    const auto t0 = Clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
      const size_t chunk = floats / omp_get_num_threads();
      sink += StreamSum(src.data() + chunk * omp_get_thread_num(), chunk);
    }
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (sink == 0.0f) std::cerr << "";  // Keeps the loop alive.
    if (r > 0) gbps.push_back(floats * sizeof(float) / s / 1e9);
  }
  return Median(gbps);
}

// One thread's fp32 multiply-adds: ten independent chains of 16-lane
// (AVX-512) or 8-lane FMAs, enough to cover the FMA latency. Each returns
// a value that keeps its loop alive.
__attribute__((target("avx512f"))) float FmaChains16(long iters) {
  const __m512 b = _mm512_set1_ps(0.999f), c = _mm512_set1_ps(0.001f);
  __m512 a[10];
  for (int j = 0; j < 10; ++j) a[j] = _mm512_set1_ps(static_cast<float>(j));
  for (long i = 0; i < iters; ++i) {
#pragma GCC unroll 10
    for (int j = 0; j < 10; ++j) a[j] = _mm512_fmadd_ps(a[j], b, c);
  }
  float sum = 0.0f;
  for (int j = 0; j < 10; ++j) sum += _mm512_cvtss_f32(a[j]);
  return sum;
}

float FmaChains8(long iters) {
  const __m256 b = _mm256_set1_ps(0.999f), c = _mm256_set1_ps(0.001f);
  __m256 a[10];
  for (int j = 0; j < 10; ++j) a[j] = _mm256_set1_ps(static_cast<float>(j));
  for (long i = 0; i < iters; ++i) {
#pragma GCC unroll 10
    for (int j = 0; j < 10; ++j) a[j] = _mm256_fmadd_ps(a[j], b, c);
  }
  float sum = 0.0f;
  for (int j = 0; j < 10; ++j) sum += a[j][0];
  return sum;
}

// Ten chains of VDPBF16PS: two bf16 products a lane, summed into 16 fp32
// lanes, what the bf16-activation kernels run where AVX512_BF16 is.
__attribute__((target("avx512f,avx512bf16"))) float Dpbf16Chains(long iters) {
  const __m512bh b = (__m512bh)_mm512_set1_epi32(0x3f803f80);  // A pair of 1.0.
  __m512 a[10];
  for (int j = 0; j < 10; ++j) a[j] = _mm512_set1_ps(static_cast<float>(j));
  for (long i = 0; i < iters; ++i) {
#pragma GCC unroll 10
    for (int j = 0; j < 10; ++j) a[j] = _mm512_dpbf16_ps(a[j], b, b);
  }
  float sum = 0.0f;
  for (int j = 0; j < 10; ++j) sum += _mm512_cvtss_f32(a[j]);
  return sum;
}

// The multiply-add peak with `threads` threads of the kernels' widest
// instruction: fp32 FMAs of 16 lanes (the fp32 kernels' width on this
// CPU is AVX-512) or 8, or VDPBF16PS (32 products an instruction).
enum class Peak { kFma8, kFma16, kDpbf16 };
double MeasurePeak(int threads, int reps, Peak peak) {
  const long iters = 50'000'000;
  const int products = peak == Peak::kFma8 ? 8 : peak == Peak::kFma16 ? 16 : 32;
  std::vector<double> gflops;
  for (int r = 0; r < reps; ++r) {
    float sink = 0.0f;
    const auto t0 = Clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    sink += peak == Peak::kFma8    ? FmaChains8(iters)
            : peak == Peak::kFma16 ? FmaChains16(iters)
                                   : Dpbf16Chains(iters);
    const double sec = std::chrono::duration<double>(Clock::now() - t0).count();
    if (sink == 0.0f) std::cerr << "";  // Keeps the loops alive.
    gflops.push_back(2.0 * products * 10 * iters * threads / sec / 1e9);
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

// The matrices' bytes, as stored or (int8) as quantized at load.
size_t WeightBytesReadPerStep(const Model& m, bool int8) {
  auto bytes_of = [int8](const WeightMatrix& w) {
    return int8 ? MatrixBytes(DType::kQ8, w.rows, w.cols) : w.size_bytes();
  };
  size_t bytes = bytes_of(m.weights().lm_head);
  for (const LayerWeights& L : m.weights().layers) {
    for (const WeightMatrix* w : {&L.wq, &L.wk, &L.wv, &L.wo, &L.w_gate, &L.w_up, &L.w_down}) {
      bytes += bytes_of(*w);
    }
  }
  return bytes;
}

// One timed figure, printed as a table row and written to --json.
struct Row {
  std::string weights;
  std::string phase;  // "prefill N" or "decode b=B".
  double seconds = 0;
  double tokens_per_s = 0;
  double gbps = 0;    // Decode: bytes read per second.
  double gflops = 0;
};

absl::StatusOr<std::vector<int>> IntList(const std::string& flag, const std::string& text) {
  std::vector<int> out;
  for (absl::string_view part : absl::StrSplit(text, ',', absl::SkipEmpty())) {
    int v = 0;
    if (!absl::SimpleAtoi(part, &v) || v < 1) {
      return absl::InvalidArgumentError(
          absl::StrCat("--", flag, ": '", part, "' is not a positive integer"));
    }
    out.push_back(v);
  }
  return out;
}

// Runs the prefill and decode figures of one model; appends its rows.
absl::Status BenchModel(const std::string& label, std::shared_ptr<const Model> model,
                        const std::vector<int>& prefill_lengths, const std::vector<int>& batches,
                        double copy_gbps, double read_gbps, double peak_gflops,
                        std::vector<Row>& rows) {
  const int threads = absl::GetFlag(FLAGS_threads);
  const int reps = absl::GetFlag(FLAGS_reps);
  const int context = absl::GetFlag(FLAGS_decode_context);
  const bool bf16_activations = absl::GetFlag(FLAGS_bf16_activations);
  const bool int8 = absl::GetFlag(FLAGS_int8_weights);
  const std::string weights =
      int8 ? absl::StrCat(label, " as int8")
      : bf16_activations && model->weights().layers[0].wq.dtype == DType::kBF16
          ? absl::StrCat(label, " (bf16 activations)")
          : label;
  const ModelConfig& config = model->config();
  const int vocab = config.vocab_size;
  const int block_size = 16;
  const int max_batch = *std::max_element(batches.begin(), batches.end());
  const int longest = *std::max_element(prefill_lengths.begin(), prefill_lengths.end());
  const int blocks_per_seq =
      (std::max(longest, context + reps + 2) + block_size - 1) / block_size;
  PD_ASSIGN_OR_RETURN(std::unique_ptr<ModelRunner> runner,
                      CreateModelRunner(model, {.num_kv_blocks = max_batch * blocks_per_seq,
                                                .block_size = block_size,
                                                .num_threads = threads,
                                                .bf16_activations = bf16_activations,
                                                .int8_weights = int8}));
  std::vector<std::vector<BlockId>> tables(max_batch);
  for (int s = 0; s < max_batch; ++s) {
    for (int b = 0; b < blocks_per_seq; ++b) tables[s].push_back(BlockId(s * blocks_per_seq + b));
  }
  std::vector<int32_t> prompt(std::max(longest, context));
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = static_cast<int32_t>((i * 7919) % vocab);
  std::vector<float> logits(static_cast<size_t>(max_batch) * vocab);
  auto print = [&](const Row& r, int tokens) {
    std::cout << absl::StrFormat("| %s | %s | %d | %.2f ms | %.1f | %s | %.1f (%.0f%%) |\n",
                                 r.weights, r.phase, tokens, r.seconds * 1e3, r.tokens_per_s,
                                 r.gbps > 0 ? absl::StrFormat("%.1f (%.0f%% / %.0f%%)", r.gbps,
                                                              100.0 * r.gbps / copy_gbps,
                                                              100.0 * r.gbps / read_gbps)
                                            : std::string(),
                                 r.gflops, 100.0 * r.gflops / peak_gflops);
    std::cout.flush();
  };

  for (int len : prefill_lengths) {
    std::vector<double> secs;
    for (int r = 0; r < reps + 1; ++r) {
      ForwardBatch b;
      b.sequences.push_back({.tokens = std::span(prompt).subspan(0, len), .start_pos = 0,
                             .block_table = tables[0]});
      const auto t0 = Clock::now();
      PD_RETURN_IF_ERROR(runner->Forward(b, std::span(logits).subspan(0, vocab)));
      if (r > 0) secs.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    Row row{.weights = weights, .phase = absl::StrCat("prefill ", len), .seconds = Median(secs)};
    row.tokens_per_s = len / row.seconds;
    row.gflops = PrefillFlops(config, len) / row.seconds / 1e9;
    print(row, len);
    rows.push_back(row);
  }

  for (int batch : batches) {
    // Fill every sequence's context once (prefill), then time decode steps.
    for (int s = 0; s < batch; ++s) {
      ForwardBatch b;
      b.sequences.push_back({.tokens = std::span(prompt).subspan(0, context), .start_pos = 0,
                             .block_table = tables[s]});
      PD_RETURN_IF_ERROR(runner->Forward(b, std::span(logits).subspan(0, vocab)));
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
      PD_RETURN_IF_ERROR(runner->Forward(b, std::span(logits).subspan(0, batch * vocab)));
      if (r > 0) secs.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
    Row row{.weights = weights, .phase = absl::StrCat("decode b=", batch), .seconds = Median(secs)};
    const KvBlockLayout& L = runner->kv_layout();
    const double kv_bytes = 2.0 * batch * (context + reps / 2) * L.slot_bytes() * L.num_layers;
    // Decode FLOPs: the per-token matrix products plus attention over the context.
    const double flops = batch * (PrefillFlops(config, 1) +
                                  config.num_layers * 4.0 * context * config.num_heads *
                                      config.head_dim);
    row.tokens_per_s = batch / row.seconds;
    row.gbps = (WeightBytesReadPerStep(*model, int8) + kv_bytes) / row.seconds / 1e9;
    row.gflops = flops / row.seconds / 1e9;
    print(row, batch);
    rows.push_back(row);
  }
  return absl::OkStatus();
}

absl::Status Run() {
  const int threads = absl::GetFlag(FLAGS_threads);
  const int reps = absl::GetFlag(FLAGS_reps);
  if (threads < 1 || reps < 1 || absl::GetFlag(FLAGS_decode_context) < 1) {
    return absl::InvalidArgumentError("--threads, --reps and --decode_context must be at least 1");
  }
  PD_ASSIGN_OR_RETURN(std::vector<int> prefill_lengths,
                      IntList("prefill_lengths", absl::GetFlag(FLAGS_prefill_lengths)));
  PD_ASSIGN_OR_RETURN(std::vector<int> batches,
                      IntList("decode_batches", absl::GetFlag(FLAGS_decode_batches)));
  if (prefill_lengths.empty() || batches.empty()) {
    return absl::InvalidArgumentError("--prefill_lengths and --decode_batches need a value each");
  }
  const double copy_gbps = MeasureCopyBandwidth(threads, reps);
  const double read_gbps = MeasureReadBandwidth(threads, reps);
  const cpu::CpuIsa isa = cpu::DefaultCpuIsa();
  const bool avx512_fp32 = cpu::MatMulOptions{.isa = isa}.Avx512Fp32();
  const double fma_gflops = MeasurePeak(threads, reps, avx512_fp32 ? Peak::kFma16 : Peak::kFma8);
  // bf16 weights with bf16 activations run VDPBF16PS where the CPU has it:
  // their rows are held to its peak.
  const bool dpbf16 = absl::GetFlag(FLAGS_bf16_activations) && isa == cpu::CpuIsa::kAvx512Bf16;
  const double dpbf16_gflops = dpbf16 ? MeasurePeak(threads, reps, Peak::kDpbf16) : 0.0;
  const std::string_view kernels = cpu::CpuIsaName(isa);
  const std::string_view int8_kernels =
      cpu::CpuIsaName(std::min(isa, cpu::CpuIsa::kAvx512Vnni));
  const std::string_view fp32_kernels = avx512_fp32 ? "avx512 (16 lanes)" : "avx2";
  std::cout << absl::StrFormat("%s\nkernels: %s for fp32 activations, %s "
                               "for bf16 ones, %s for int8 weights (PDSERVE_CPU_ISA caps them)\n"
                               "%d threads: copy bandwidth %.1f GB/s, read bandwidth %.1f GB/s, "
                               "fp32 FMA peak (%d lanes) %.1f GFLOP/s%s\n\n",
                               bench::MachineDescription(), fp32_kernels, kernels,
                               int8_kernels, threads, copy_gbps, read_gbps, avx512_fp32 ? 16 : 8,
                               fma_gflops,
                               dpbf16 ? absl::StrFormat(", VDPBF16PS peak %.1f GFLOP/s (the bf16 "
                                                        "rows' share is of this one)",
                                                        dpbf16_gflops)
                                      : std::string());
  std::cout << "| weights | phase | tokens per forward | median time | tokens/s | GB/s read (share of copy BW / read BW) | GFLOP/s (share of FMA peak) |\n"
               "|---|---|---|---|---|---|---|\n";

  const auto peak_of = [&](DType weights) {
    return dpbf16 && weights == DType::kBF16 && !absl::GetFlag(FLAGS_int8_weights) ? dpbf16_gflops
                                                                                   : fma_gflops;
  };
  std::vector<Row> rows;
  if (const std::string spec = absl::GetFlag(FLAGS_model); !spec.empty()) {
    PD_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model, Model::Load(spec));
    const DType dtype = model->weights().layers[0].wq.dtype;
    PD_RETURN_IF_ERROR(BenchModel(std::string(DTypeName(dtype)), model, prefill_lengths, batches,
                                  copy_gbps, read_gbps, peak_of(dtype), rows));
  } else {
    const std::vector<std::string> dtypes = absl::StrSplit(absl::GetFlag(FLAGS_dtypes), ',');
    for (const auto& [name, dtype] : {std::pair{"f32", DType::kF32},
                                      std::pair{"bf16", DType::kBF16},
                                      std::pair{"f16", DType::kF16}}) {
      if (std::find(dtypes.begin(), dtypes.end(), name) == dtypes.end()) continue;
      PD_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model,
                          MakeRandomModel("bench-110m", Llama110MConfig(), dtype, 1));
      PD_RETURN_IF_ERROR(BenchModel(name, model, prefill_lengths, batches, copy_gbps, read_gbps,
                                    peak_of(dtype), rows));
    }
  }
  if (const std::string path = absl::GetFlag(FLAGS_json); !path.empty()) {
    nlohmann::json j = {{"machine", bench::MachineDescription()},
                        {"bf16_activation_kernels", std::string(kernels)},
                        {"int8_kernels", std::string(int8_kernels)},
                        {"fp32_kernels", std::string(fp32_kernels)},
                        {"threads", threads},
                        {"copy_gbps", copy_gbps}, {"read_gbps", read_gbps},
                        {"fma_gflops", fma_gflops}, {"dpbf16_gflops", dpbf16_gflops},
                        {"rows", nlohmann::json::array()}};
    for (const Row& r : rows) {
      j["rows"].push_back({{"weights", r.weights}, {"phase", r.phase}, {"seconds", r.seconds},
                           {"tokens_per_s", r.tokens_per_s}, {"gbps", r.gbps},
                           {"gflops", r.gflops}});
    }
    std::ofstream out(path);
    out << j.dump(1) << "\n";
    if (!out) return absl::InternalError(absl::StrCat("cannot write --json ", path));
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace pdserve

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "pd-engine-bench [--model=DIR|builtin:...] [--dtypes=f32,bf16] [--threads=2]; see the "
      "header of bench/engine_bench.cc");
  absl::ParseCommandLine(argc, argv);
  if (const absl::Status s = pdserve::Run(); !s.ok()) {
    std::cerr << "pd-engine-bench: " << s << "\n";
    return 1;
  }
  return 0;
}
