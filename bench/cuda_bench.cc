// pd-cuda-bench: the cuda backend on a Llama-3-8B shape (vocab 128256,
// hidden 4096, 32 layers, 32 heads, 8 KV heads, FFN 14336) with random
// bf16 weights, against the device's own limits measured in the same run:
//   - decode step time at batch 1, 8, 64 and contexts 512 and 4096; the
//     bytes a step must read (every weight once plus each sequence's K/V)
//     over the step time, as a share of the device's copy bandwidth
//     (cudaMemcpy device to device, counted as bytes read + written);
//   - prefill of one prompt of 512, 2048 and 8192 tokens: achieved FLOP/s
//     as a share of the dense bf16 peak, both the datasheet figure (when
//     the device is one the table knows) and a large cuBLAS GEMM measured
//     here.
// Times are wall-clock around ModelRunner::Forward (metadata upload, the
// logits copy and the synchronisation included), medians of --reps runs.
//
// The weights: one host buffer of random bf16 (the largest matrix, about
// 1 GiB) that every weight matrix of the model aliases; the runner copies
// each matrix to its own device memory, so the device reads 16 GB of
// distinct weights per step like a real 8B model. The KV cache contents are
// whatever the pool holds (timing does not depend on them).
#include <cuda_runtime.h>

#include <chrono>
#include <cstring>
#include <iostream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "bench/model_cost.h"
#include "engine/cuda/cublas_api.h"
#include "engine/cuda/cuda_kernels.h"
#include "engine/cuda/cuda_model_runner.h"
#include "engine/model.h"
#include "engine/model_runner.h"

ABSL_FLAG(int32_t, reps, 5, "Repetitions per figure (median reported)");
ABSL_FLAG(std::string, batches, "1,8,64", "Decode batch sizes");
ABSL_FLAG(std::string, contexts, "512,4096", "Decode context lengths");
ABSL_FLAG(std::string, prefill, "512,2048,8192", "Prefill prompt lengths");
ABSL_FLAG(bool, cuda_graphs, true, "Replay decode steps through CUDA graphs");
ABSL_FLAG(bool, measure_limits, true,
          "Measure the copy bandwidth and GEMM rate first (off: no shares, "
          "and no kernels of its own in a profile)");
ABSL_FLAG(int32_t, num_layers, 32,
          "Layers of the Llama-3-8B shape (fewer fit smaller devices)");

namespace pdserve {
namespace {

using Clock = std::chrono::steady_clock;

std::vector<int> ParseList(const std::string& s) {
  std::vector<int> out;
  for (absl::string_view part : absl::StrSplit(s, ',', absl::SkipEmpty())) {
    int v = 0;
    if (absl::SimpleAtoi(part, &v) && v > 0) out.push_back(v);
  }
  return out;
}

ModelConfig Llama3_8BConfig(int num_layers) {
  ModelConfig c;
  c.architecture = "LlamaForCausalLM";
  c.vocab_size = 128256;
  c.hidden_size = 4096;
  c.intermediate_size = 14336;
  c.num_layers = num_layers;
  c.num_heads = 32;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.max_position_embeddings = 8192;
  c.rms_norm_eps = 1e-5f;
  c.rope_theta = 500000.0f;
  c.rope_scaling = {RopeScaling::Type::kLlama3, 8.0f, 1.0f, 4.0f, 8192};
  c.torch_dtype = DType::kBF16;
  return c;
}

absl::StatusOr<std::shared_ptr<const Model>> MakeAliasedModel(
    const ModelConfig& c) {
  const size_t elems = static_cast<size_t>(c.vocab_size) * c.hidden_size + 1;
  std::vector<std::byte> buf(elems * 2);
  uint64_t state = 0x9e3779b97f4a7c15ull;
  for (size_t i = 0; i < elems; ++i) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    // Uniform in about +-0.02: small enough that 32 random layers keep the
    // residual stream finite.
    const float v =
        (static_cast<float>(state >> 40) / 16777216.0f - 0.5f) * 0.04f;
    const uint16_t h = FloatToBf16(v);
    std::memcpy(&buf[2 * i], &h, 2);
  }
  const std::byte* p = buf.data();
  auto m = [&](int rows, int cols, size_t offset) {
    return WeightMatrix{DType::kBF16, rows, cols, p + 2 * offset};
  };
  const int q = c.num_heads * c.head_dim, kv = c.num_kv_heads * c.head_dim;
  ModelWeights w;
  w.embed = m(c.vocab_size, c.hidden_size, 0);
  w.lm_head = m(c.vocab_size, c.hidden_size, 1);  // Not tied: its own copy.
  w.final_norm.assign(c.hidden_size, 1.0f);
  for (int l = 0; l < c.num_layers; ++l) {
    LayerWeights& L = w.layers.emplace_back();
    L.attn_norm.assign(c.hidden_size, 1.0f);
    L.ffn_norm.assign(c.hidden_size, 1.0f);
    L.wq = m(q, c.hidden_size, 0);
    L.wk = m(kv, c.hidden_size, 0);
    L.wv = m(kv, c.hidden_size, 0);
    L.wo = m(c.hidden_size, q, 0);
    L.w_gate = m(c.intermediate_size, c.hidden_size, 0);
    L.w_up = m(c.intermediate_size, c.hidden_size, 0);
    L.w_down = m(c.hidden_size, c.intermediate_size, 0);
  }
  std::vector<std::vector<std::byte>> storage;
  storage.push_back(std::move(buf));
  return Model::FromParts("llama3-8b-shape", c, std::move(w),
                          std::move(storage), nullptr);
}

// Device-to-device copy bandwidth (bytes read + written per second).
double MeasureCopyBandwidth(int reps) {
  const size_t bytes = size_t{2} << 30;
  void *src = nullptr, *dst = nullptr;
  if (cudaMalloc(&src, bytes) != cudaSuccess ||
      cudaMalloc(&dst, bytes) != cudaSuccess) {
    cudaFree(src);
    return 0.0;
  }
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<double> gbps;
  for (int r = 0; r < reps + 1; ++r) {
    cudaEventRecord(a);
    cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice);
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    if (r > 0) gbps.push_back(2.0 * bytes / (ms * 1e-3) / 1e9);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  cudaFree(src);
  cudaFree(dst);
  return bench::Median(gbps);
}

// bf16 GEMM throughput of cuBLAS at 8192^3 through the backend's Gemm.
double MeasureGemmTflops(int reps) {
  const int64_t n = 8192;
  uint16_t *x = nullptr, *w = nullptr;
  float* y = nullptr;
  if (cudaMalloc(&x, n * n * 2) != cudaSuccess ||
      cudaMalloc(&w, n * n * 2) != cudaSuccess ||
      cudaMalloc(&y, n * n * 4) != cudaSuccess) {
    return 0.0;
  }
  cudaMemset(x, 0x3c, n * n * 2);  // 0x3c3c: about 0.0115 in bf16.
  cudaMemset(w, 0x3c, n * n * 2);
  const cuda::CublasApi* blas = cuda::Cublas();
  if (blas == nullptr) return 0.0;
  cublasHandle_t h;
  blas->create(&h);
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  std::vector<double> tflops;
  for (int r = 0; r < reps + 1; ++r) {
    cudaEventRecord(a);
    cuda::Gemm(h, x, n, w, n, n, y, 0.0f);
    cudaEventRecord(b);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    if (r > 0) tflops.push_back(2.0 * n * n * n / (ms * 1e-3) / 1e12);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  blas->destroy(h);
  cudaFree(x);
  cudaFree(w);
  cudaFree(y);
  return bench::Median(tflops);
}

// Dense bf16 tensor-core peak from the datasheet, or 0 when unknown.
double DatasheetBf16Tflops(const std::string& name) {
  const bool pcie = name.find("PCIe") != std::string::npos;
  if (name.find("H100") != std::string::npos) return pcie ? 756.0 : 989.4;
  if (name.find("H200") != std::string::npos) return 989.4;
  if (name.find("A100") != std::string::npos) return 312.0;
  return 0.0;
}

int Run() {
  const int reps = absl::GetFlag(FLAGS_reps);
  const std::vector<int> batches = ParseList(absl::GetFlag(FLAGS_batches));
  const std::vector<int> contexts = ParseList(absl::GetFlag(FLAGS_contexts));
  const std::vector<int> prefill = ParseList(absl::GetFlag(FLAGS_prefill));
  if (CudaDeviceCount() == 0) {
    std::cerr << "pd-cuda-bench: no CUDA device\n";
    return 1;
  }
  cudaDeviceProp prop;
  cudaGetDeviceProperties(&prop, 0);
  const std::string device = prop.name;
  const bool limits = absl::GetFlag(FLAGS_measure_limits);
  const double copy_gbps = limits ? MeasureCopyBandwidth(reps) : 0.0;
  const double gemm_tflops = limits ? MeasureGemmTflops(reps) : 0.0;
  const double sheet_tflops = DatasheetBf16Tflops(device);
  std::cout << absl::StrFormat(
      "device: %s (%d SMs, %.1f GiB); copy bandwidth %.0f GB/s; cuBLAS bf16 "
      "GEMM 8192^3 %.0f TFLOP/s; datasheet dense bf16 %s\n\n",
      device, prop.multiProcessorCount, prop.totalGlobalMem / double(1 << 30),
      copy_gbps, gemm_tflops,
      sheet_tflops > 0 ? absl::StrFormat("%.0f TFLOP/s", sheet_tflops)
                       : "unknown");

  const ModelConfig c = Llama3_8BConfig(absl::GetFlag(FLAGS_num_layers));
  auto model = MakeAliasedModel(c);
  if (!model.ok()) {
    std::cerr << model.status() << "\n";
    return 1;
  }
  const int block_size = 16;
  int max_batch = 1, max_context = 1, max_prefill = 1;
  for (int b : batches) max_batch = std::max(max_batch, b);
  for (int x : contexts) max_context = std::max(max_context, x);
  for (int x : prefill) max_prefill = std::max(max_prefill, x);
  const int blocks_per_seq = (max_context + block_size) / block_size + 1;
  const int num_blocks = std::max(max_batch * blocks_per_seq,
                                  (max_prefill + block_size - 1) / block_size);
  const auto t0 = Clock::now();
  auto runner = CreateModelRunner(
      *model,
      {.backend = "cuda",
       .num_kv_blocks = num_blocks,
       .block_size = block_size,
       .cuda_graphs = absl::GetFlag(FLAGS_cuda_graphs)});
  if (!runner.ok()) {
    std::cerr << runner.status() << "\n";
    return 1;
  }
  std::cout << absl::StrFormat(
      "weights uploaded in %.1f s; KV pool %d blocks (%.1f GiB)\n\n",
      std::chrono::duration<double>(Clock::now() - t0).count(), num_blocks,
      (*runner)->kv_memory().size() / double(1 << 30));

  const int vocab = c.vocab_size;
  std::vector<float> logits(static_cast<size_t>(max_batch) * vocab);
  std::vector<BlockId> all_blocks(num_blocks);
  for (int i = 0; i < num_blocks; ++i) all_blocks[i] = BlockId(i);
  std::vector<int32_t> tokens(std::max(max_prefill, max_batch));
  for (size_t i = 0; i < tokens.size(); ++i) {
    tokens[i] = static_cast<int32_t>((i * 7919) % vocab);
  }

  std::cout
      << "| phase | tokens per forward | median time | tokens/s | GB/s read "
         "(share of copy BW) | TFLOP/s (share of datasheet / of measured "
         "GEMM) |\n|---|---|---|---|---|---|\n";
  auto timed = [&](const ForwardBatch& batch, size_t rows) -> double {
    std::vector<double> secs;
    for (int r = 0; r < reps + 1; ++r) {
      const auto start = Clock::now();
      const absl::Status s =
          (*runner)->Forward(batch, std::span(logits).first(rows * vocab));
      if (!s.ok()) {
        std::cerr << s << "\n";
        return -1.0;
      }
      if (r > 0)
        secs.push_back(
            std::chrono::duration<double>(Clock::now() - start).count());
    }
    return bench::Median(secs);
  };
  auto share = [](double v, double of) {
    return of > 0 ? absl::StrFormat("%.0f%%", 100.0 * v / of)
                  : std::string("-");
  };

  for (int n : prefill) {
    ForwardBatch batch;
    batch.sequences.push_back({.tokens = std::span(tokens).first(n),
                               .start_pos = 0,
                               .block_table = all_blocks});
    const double t = timed(batch, 1);
    if (t < 0) return 1;
    const double tflops = bench::ForwardFlops(c, 0, n) / t / 1e12;
    std::cout << absl::StrFormat(
        "| prefill %d | %d | %.1f ms | %.0f | | %.0f (%s / %s) |\n", n, n,
        t * 1e3, n / t, tflops, share(tflops, sheet_tflops),
        share(tflops, gemm_tflops));
  }

  const double kv_bytes_per_token =
      2.0 * (*runner)->kv_layout().slot_bytes() * c.num_layers;
  for (int context : contexts) {
    for (int b : batches) {
      ForwardBatch batch;
      for (int s = 0; s < b; ++s) {
        batch.sequences.push_back(
            {.tokens = std::span(tokens).subspan(s, 1),
             .start_pos = context - 1,
             .block_table = std::span(all_blocks)
                                .subspan(s * blocks_per_seq, blocks_per_seq)});
      }
      const double t = timed(batch, b);
      if (t < 0) return 1;
      const double gbps =
          bench::DecodeBytes(c, b, context, 2.0, kv_bytes_per_token) / t / 1e9;
      const double tflops =
          b * bench::ForwardFlops(c, context - 1, 1) / t / 1e12;
      std::cout << absl::StrFormat(
          "| decode b=%d, context %d | %d | %.2f ms | %.0f | %.0f (%s) | %.1f "
          "(%s / %s) |\n",
          b, context, b, t * 1e3, b / t, gbps, share(gbps, copy_gbps), tflops,
          share(tflops, sheet_tflops), share(tflops, gemm_tflops));
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
