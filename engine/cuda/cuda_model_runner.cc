#include "engine/cuda/cuda_model_runner.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "engine/cpu/cpu_kernels.h"
#include "engine/cuda/cuda_kernels.h"

namespace pdserve {
namespace {

absl::Status CudaStatus(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return absl::OkStatus();
  if (err == cudaErrorMemoryAllocation) {
    return absl::ResourceExhaustedError(
        absl::StrCat(what, ": ", cudaGetErrorString(err)));
  }
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(err)));
}

absl::Status BlasStatus(cublasStatus_t s, const char* what) {
  if (s == CUBLAS_STATUS_SUCCESS) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, ": ", cublasGetStatusString(s)));
}

struct CudaFree {
  void operator()(void* p) const { cudaFree(p); }
};
struct CudaFreeHost {
  void operator()(void* p) const { cudaFreeHost(p); }
};
template <typename T>
using DevicePtr = std::unique_ptr<T, CudaFree>;

template <typename T>
absl::StatusOr<DevicePtr<T>> DeviceAlloc(size_t count, const char* what) {
  void* p = nullptr;
  PD_RETURN_IF_ERROR(
      CudaStatus(cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T)), what));
  return DevicePtr<T>(static_cast<T*>(p));
}

template <typename T>
absl::StatusOr<DevicePtr<T>> Upload(const std::vector<T>& host,
                                    const char* what) {
  PD_ASSIGN_OR_RETURN(DevicePtr<T> d, DeviceAlloc<T>(host.size(), what));
  PD_RETURN_IF_ERROR(
      CudaStatus(cudaMemcpy(d.get(), host.data(), host.size() * sizeof(T),
                            cudaMemcpyHostToDevice),
                 what));
  return d;
}

// Appends `w` to `out` as bf16 bits, row-major.
void AppendBf16(const WeightMatrix& w, std::vector<uint16_t>& out) {
  const size_t n = static_cast<size_t>(w.rows) * w.cols;
  const size_t at = out.size();
  out.resize(at + n);
  if (w.dtype == DType::kBF16) {
    std::memcpy(out.data() + at, w.data, n * sizeof(uint16_t));
    return;
  }
  for (size_t i = 0; i < n; ++i)
    out[at + i] = FloatToBf16(LoadAsFloat(w.data, w.dtype, i));
}

absl::StatusOr<DevicePtr<uint16_t>> UploadBf16(
    std::initializer_list<const WeightMatrix*> parts, const char* what) {
  std::vector<uint16_t> host;
  for (const WeightMatrix* w : parts) AppendBf16(*w, host);
  return Upload(host, what);
}

struct DeviceLayer {
  DevicePtr<float> attn_norm, ffn_norm;
  DevicePtr<uint16_t> wqkv;       // [q_dim + 2 kv_dim][hidden]
  DevicePtr<float> bqkv;          // [q_dim + 2 kv_dim], or null.
  DevicePtr<uint16_t> wo;         // [hidden][q_dim]
  DevicePtr<uint16_t> w_gate_up;  // [2 ffn][hidden]
  DevicePtr<uint16_t> w_down;     // [hidden][ffn]
};

// Scratch that grows to the largest batch seen and is reused.
template <typename T>
class GrowingBuffer {
 public:
  absl::Status Reserve(size_t count, const char* what) {
    if (count <= capacity_) return absl::OkStatus();
    ptr_.reset();
    PD_ASSIGN_OR_RETURN(ptr_, DeviceAlloc<T>(count, what));
    capacity_ = count;
    return absl::OkStatus();
  }
  T* get() const { return ptr_.get(); }

 private:
  DevicePtr<T> ptr_;
  size_t capacity_ = 0;
};

// Per-forward metadata, built on the host and copied to the device in one
// transfer through pinned memory.
class MetadataBuffer {
 public:
  // Starts a new packing; offsets are 16-byte aligned.
  void Clear() { host_.clear(); }
  template <typename T>
  size_t Add(const std::vector<T>& v) {
    const size_t at = (host_.size() + 15) / 16 * 16;
    host_.resize(at + v.size() * sizeof(T));
    if (!v.empty())
      std::memcpy(host_.data() + at, v.data(), v.size() * sizeof(T));
    return at;
  }
  absl::Status Upload(cudaStream_t stream) {
    if (host_.size() > capacity_) {
      pinned_.reset();
      device_.reset();
      const size_t cap = std::max<size_t>(host_.size() * 2, 4096);
      void* p = nullptr;
      PD_RETURN_IF_ERROR(
          CudaStatus(cudaMallocHost(&p, cap), "pinned metadata"));
      pinned_.reset(static_cast<std::byte*>(p));
      PD_ASSIGN_OR_RETURN(device_, DeviceAlloc<std::byte>(cap, "metadata"));
      capacity_ = cap;
    }
    // The previous forward finished (Forward synchronises before it
    // returns), so the pinned buffer is free to reuse.
    std::memcpy(pinned_.get(), host_.data(), host_.size());
    return CudaStatus(
        cudaMemcpyAsync(device_.get(), pinned_.get(), host_.size(),
                        cudaMemcpyHostToDevice, stream),
        "metadata copy");
  }
  template <typename T>
  T* At(size_t offset) const {
    return reinterpret_cast<T*>(device_.get() + offset);
  }

 private:
  std::vector<std::byte> host_;
  std::unique_ptr<std::byte, CudaFreeHost> pinned_;
  DevicePtr<std::byte> device_;
  size_t capacity_ = 0;
};

class CudaModelRunner final : public ModelRunner {
 public:
  static absl::StatusOr<std::unique_ptr<CudaModelRunner>> Create(
      std::shared_ptr<const Model> model, const ModelRunnerOptions& options);
  ~CudaModelRunner() override;

  const Model& model() const override { return *model_; }
  const KvBlockLayout& kv_layout() const override { return layout_; }
  int32_t num_kv_blocks() const override { return num_blocks_; }
  std::span<std::byte> kv_memory() override {
    return {pool_.get(),
            static_cast<size_t>(num_blocks_) * layout_.block_bytes()};
  }
  KvMemoryKind kv_memory_kind() const override {
    return KvMemoryKind::kCudaDevice;
  }

  absl::Status Forward(const ForwardBatch& batch,
                       std::span<float> logits) override;

 private:
  CudaModelRunner(std::shared_ptr<const Model> model, KvBlockLayout layout,
                  int32_t num_blocks)
      : model_(std::move(model)), layout_(layout), num_blocks_(num_blocks) {}

  absl::Status Init();
  absl::Status EnqueueForward(const ForwardBatch& batch,
                              std::span<float> logits);

  const std::shared_ptr<const Model> model_;
  const KvBlockLayout layout_;
  const int32_t num_blocks_;

  cudaStream_t stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  int num_sms_ = 1;
  bool tensor_cores_ = false;  // Prefill attention on tensor cores.

  DevicePtr<std::byte> pool_;
  DevicePtr<uint16_t> embed_, lm_head_;  // lm_head_ null when tied.
  DevicePtr<float> final_norm_, inv_freq_;
  std::vector<DeviceLayer> layers_;

  GrowingBuffer<float> x_;          // [T][hidden] residual stream.
  GrowingBuffer<float> wide_;       // [T][max(qkv_dim, 2 ffn)] GEMM outputs.
  GrowingBuffer<uint16_t> act_;     // [T][max(hidden, q_dim, ffn)] bf16.
  GrowingBuffer<float> logits_;     // [rows][vocab]
  GrowingBuffer<float> workspace_;  // Attention splits.
  MetadataBuffer meta_;

  // Host-side per-forward vectors, kept to reuse their capacity.
  std::vector<int32_t> ids_, positions_, block_tables_, logit_rows_;
  std::vector<int64_t> slots_;
  std::vector<cuda::AttentionSequence> sequences_;
  std::vector<cuda::AttentionTile> tiles_, mma_tiles_;
};

CudaModelRunner::~CudaModelRunner() {
  if (blas_ != nullptr) cublasDestroy(blas_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

absl::StatusOr<std::unique_ptr<CudaModelRunner>> CudaModelRunner::Create(
    std::shared_ptr<const Model> model, const ModelRunnerOptions& options) {
  const ModelConfig& c = model->config();
  if (options.block_size < 1 || options.block_size > 1024) {
    return absl::InvalidArgumentError(absl::StrCat(
        "block_size must be in [1, 1024], got ", options.block_size));
  }
  if (c.head_dim % 2 != 0 || c.head_dim > cuda::kMaxHeadDim) {
    return absl::InvalidArgumentError(
        absl::StrCat("the cuda backend supports even head_dim up to ",
                     cuda::kMaxHeadDim, ", got ", c.head_dim));
  }
  const KvBlockLayout layout{c.num_layers, c.num_kv_heads, c.head_dim,
                             options.block_size, DType::kBF16};
  int64_t num_blocks = options.num_kv_blocks;
  if (num_blocks == 0) {
    num_blocks =
        static_cast<int64_t>(options.kv_cache_bytes / layout.block_bytes());
  }
  if (num_blocks < 1 || num_blocks > (int64_t{1} << 30) ||
      num_blocks * options.block_size > (int64_t{1} << 40)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV pool of ", num_blocks, " blocks (", layout.block_bytes(),
        " bytes each) is out of range; raise kv_cache_bytes or num_kv_blocks"));
  }
  std::unique_ptr<CudaModelRunner> runner(new CudaModelRunner(
      std::move(model), layout, static_cast<int32_t>(num_blocks)));
  PD_RETURN_IF_ERROR(runner->Init());
  return runner;
}

absl::Status CudaModelRunner::Init() {
  const ModelConfig& c = model_->config();
  const ModelWeights& w = model_->weights();
  int device = 0;
  PD_RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&device), "cudaGetDevice"));
  PD_RETURN_IF_ERROR(CudaStatus(
      cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device),
      "SM count"));
  PD_RETURN_IF_ERROR(CudaStatus(
      cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream"));
  PD_RETURN_IF_ERROR(BlasStatus(cublasCreate(&blas_), "cublasCreate"));
  PD_RETURN_IF_ERROR(
      BlasStatus(cublasSetStream(blas_, stream_), "cublasSetStream"));
  PD_RETURN_IF_ERROR(
      CudaStatus(cuda::PrepareAttention(c.head_dim), "attention setup"));
  tensor_cores_ = cuda::AttentionTensorCoresSupported(c.head_dim);

  const size_t pool_bytes =
      static_cast<size_t>(num_blocks_) * layout_.block_bytes();
  PD_ASSIGN_OR_RETURN(pool_, DeviceAlloc<std::byte>(pool_bytes, "KV pool"));
  PD_RETURN_IF_ERROR(
      CudaStatus(cudaMemset(pool_.get(), 0, pool_bytes), "KV pool"));

  PD_ASSIGN_OR_RETURN(embed_, UploadBf16({&w.embed}, "embedding"));
  if (w.lm_head.data != w.embed.data) {
    PD_ASSIGN_OR_RETURN(lm_head_, UploadBf16({&w.lm_head}, "lm_head"));
  }
  PD_ASSIGN_OR_RETURN(final_norm_, Upload(w.final_norm, "final norm"));
  PD_ASSIGN_OR_RETURN(inv_freq_, Upload(cpu::RopeInvFreq(c), "rope"));
  layers_.resize(c.num_layers);
  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights& L = w.layers[l];
    DeviceLayer& d = layers_[l];
    PD_ASSIGN_OR_RETURN(d.attn_norm, Upload(L.attn_norm, "attn norm"));
    PD_ASSIGN_OR_RETURN(d.ffn_norm, Upload(L.ffn_norm, "ffn norm"));
    PD_ASSIGN_OR_RETURN(d.wqkv, UploadBf16({&L.wq, &L.wk, &L.wv}, "wqkv"));
    if (c.qkv_bias) {
      std::vector<float> b = L.bq;
      b.insert(b.end(), L.bk.begin(), L.bk.end());
      b.insert(b.end(), L.bv.begin(), L.bv.end());
      PD_ASSIGN_OR_RETURN(d.bqkv, Upload(b, "qkv bias"));
    }
    PD_ASSIGN_OR_RETURN(d.wo, UploadBf16({&L.wo}, "wo"));
    PD_ASSIGN_OR_RETURN(d.w_gate_up,
                        UploadBf16({&L.w_gate, &L.w_up}, "w_gate_up"));
    PD_ASSIGN_OR_RETURN(d.w_down, UploadBf16({&L.w_down}, "w_down"));
  }
  return CudaStatus(cudaDeviceSynchronize(), "weight upload");
}

absl::Status CudaModelRunner::Forward(const ForwardBatch& batch,
                                      std::span<float> logits) {
  PD_RETURN_IF_ERROR(ValidateBatch(batch, logits));
  absl::Status s = EnqueueForward(batch, logits);
  // Whatever was enqueued finishes before the caller may touch the cache
  // or reuse the batch's memory.
  const absl::Status sync =
      CudaStatus(cudaStreamSynchronize(stream_), "forward");
  return s.ok() ? sync : s;
}

absl::Status CudaModelRunner::EnqueueForward(const ForwardBatch& batch,
                                             std::span<float> logits) {
  const ModelConfig& c = model_->config();
  const int64_t hidden = c.hidden_size;
  const int64_t D = c.head_dim;
  const int64_t q_dim = c.num_heads * D;
  const int64_t kv_dim = c.num_kv_heads * D;
  const int64_t qkv_dim = q_dim + 2 * kv_dim;
  const int64_t ffn = c.intermediate_size;
  const int64_t vocab = c.vocab_size;
  const int group = c.num_heads / c.num_kv_heads;
  const int bs = layout_.block_size;

  // Flatten the ragged batch.
  ids_.clear();
  positions_.clear();
  slots_.clear();
  block_tables_.clear();
  logit_rows_.clear();
  sequences_.clear();
  tiles_.clear();
  mma_tiles_.clear();
  int64_t max_context = 0;
  for (size_t s = 0; s < batch.sequences.size(); ++s) {
    const SequenceInput& seq = batch.sequences[s];
    const int32_t n = static_cast<int32_t>(seq.tokens.size());
    const int32_t t0 = static_cast<int32_t>(ids_.size());
    const int64_t end = seq.start_pos + n;
    const int64_t blocks = (end + bs - 1) / bs;
    sequences_.push_back(
        {t0, n, seq.start_pos, static_cast<int32_t>(block_tables_.size())});
    for (int64_t b = 0; b < blocks; ++b)
      block_tables_.push_back(seq.block_table[b].value);
    for (int32_t i = 0; i < n; ++i) {
      const int32_t pos = seq.start_pos + i;
      ids_.push_back(seq.tokens[i]);
      positions_.push_back(pos);
      slots_.push_back(static_cast<int64_t>(seq.block_table[pos / bs].value) *
                           bs +
                       pos % bs);
      if (seq.all_logits || i == n - 1) logit_rows_.push_back(t0 + i);
    }
    cuda::AppendAttentionTiles(static_cast<int32_t>(s), n * group,
                               tensor_cores_, tiles_, mma_tiles_);
    max_context = std::max(max_context, end);
  }
  const int64_t T = static_cast<int64_t>(ids_.size());
  const int64_t R = static_cast<int64_t>(logit_rows_.size());

  // Split the context when the tiles alone would leave most SMs idle
  // (decode): aim for two blocks per SM, at least two key tiles per split.
  const int64_t blocks =
      static_cast<int64_t>(tiles_.size() + mma_tiles_.size()) * c.num_kv_heads;
  int num_splits = 1, split_len = 0;
  constexpr int64_t kMinSplitLen = 2 * cuda::kAttentionKeyTile;
  if (blocks < 2 * num_sms_ && max_context >= 2 * kMinSplitLen) {
    const int64_t want = std::min<int64_t>(
        {(2 * num_sms_ + blocks - 1) / blocks, max_context / kMinSplitLen, 64});
    const int64_t len = (max_context + want - 1) / want;
    split_len =
        static_cast<int>((len + cuda::kAttentionKeyTile - 1) /
                         cuda::kAttentionKeyTile * cuda::kAttentionKeyTile);
    num_splits = static_cast<int>((max_context + split_len - 1) / split_len);
    if (num_splits == 1) split_len = 0;
  }

  PD_RETURN_IF_ERROR(x_.Reserve(T * hidden, "activations"));
  PD_RETURN_IF_ERROR(
      wide_.Reserve(T * std::max(qkv_dim, 2 * ffn), "activations"));
  PD_RETURN_IF_ERROR(
      act_.Reserve(T * std::max({hidden, q_dim, ffn}), "activations"));
  PD_RETURN_IF_ERROR(logits_.Reserve(R * vocab, "logits"));
  if (num_splits > 1) {
    PD_RETURN_IF_ERROR(workspace_.Reserve(
        num_splits * T * c.num_heads * (D + 2), "attention workspace"));
  }

  meta_.Clear();
  const size_t ids_at = meta_.Add(ids_);
  const size_t pos_at = meta_.Add(positions_);
  const size_t slots_at = meta_.Add(slots_);
  const size_t tables_at = meta_.Add(block_tables_);
  const size_t rows_at = meta_.Add(logit_rows_);
  const size_t seqs_at = meta_.Add(sequences_);
  const size_t tiles_at = meta_.Add(tiles_);
  const size_t mma_tiles_at = meta_.Add(mma_tiles_);
  PD_RETURN_IF_ERROR(meta_.Upload(stream_));

  float* x = x_.get();
  float* wide = wide_.get();
  uint16_t* act = act_.get();
  PD_RETURN_IF_ERROR(
      CudaStatus(cuda::Embedding(embed_.get(), hidden,
                                 meta_.At<int32_t>(ids_at), T, x, stream_),
                 "embedding"));

  cuda::AttentionParams ap;
  ap.q = wide;
  ap.q_row_stride = qkv_dim;
  ap.kv = {nullptr, c.num_kv_heads, c.head_dim, bs};
  ap.block_tables = meta_.At<int32_t>(tables_at);
  ap.sequences = meta_.At<cuda::AttentionSequence>(seqs_at);
  ap.tiles = meta_.At<cuda::AttentionTile>(tiles_at);
  ap.num_tiles = static_cast<int>(tiles_.size());
  ap.mma_tiles = meta_.At<cuda::AttentionTile>(mma_tiles_at);
  ap.num_mma_tiles = static_cast<int>(mma_tiles_.size());
  ap.num_heads = c.num_heads;
  ap.sliding_window = c.sliding_window;
  ap.scale = 1.0f / std::sqrt(static_cast<float>(D));
  ap.num_splits = num_splits;
  ap.split_len = split_len;
  ap.num_tokens = T;
  ap.workspace = workspace_.get();
  ap.out = act;

  for (int l = 0; l < c.num_layers; ++l) {
    const DeviceLayer& L = layers_[l];
    uint16_t* layer_base = reinterpret_cast<uint16_t*>(
        pool_.get() + layout_.PoolOffset(l, BlockId(0), num_blocks_));
    const cuda::PagedKvLayer kv{layer_base, c.num_kv_heads, c.head_dim, bs};

    PD_RETURN_IF_ERROR(
        CudaStatus(cuda::RmsNorm(x, nullptr, T, hidden, L.attn_norm.get(),
                                 c.rms_norm_eps, act, stream_),
                   "attn norm"));
    PD_RETURN_IF_ERROR(BlasStatus(
        cuda::Gemm(blas_, act, T, L.wqkv.get(), qkv_dim, hidden, wide, 0.0f),
        "qkv"));
    PD_RETURN_IF_ERROR(CudaStatus(
        cuda::BiasRope(wide, qkv_dim, qkv_dim, T, meta_.At<int32_t>(pos_at),
                       inv_freq_.get(), c.num_heads, c.num_kv_heads, c.head_dim,
                       L.bqkv.get(), cuda::RopeStyle::kHalfRotation, stream_),
        "rope"));
    PD_RETURN_IF_ERROR(
        CudaStatus(cuda::WriteKv(wide, qkv_dim, q_dim, q_dim + kv_dim, T,
                                 meta_.At<int64_t>(slots_at), kv, stream_),
                   "kv write"));
    if (batch.on_layer_kv_written) {
      PD_RETURN_IF_ERROR(
          CudaStatus(cudaStreamSynchronize(stream_), "kv write"));
      batch.on_layer_kv_written(l);
    }
    ap.kv = kv;
    PD_RETURN_IF_ERROR(
        CudaStatus(cuda::PagedAttention(ap, stream_), "attention"));
    PD_RETURN_IF_ERROR(BlasStatus(
        cuda::Gemm(blas_, act, T, L.wo.get(), hidden, q_dim, x, 1.0f), "wo"));

    PD_RETURN_IF_ERROR(
        CudaStatus(cuda::RmsNorm(x, nullptr, T, hidden, L.ffn_norm.get(),
                                 c.rms_norm_eps, act, stream_),
                   "ffn norm"));
    PD_RETURN_IF_ERROR(BlasStatus(cuda::Gemm(blas_, act, T, L.w_gate_up.get(),
                                             2 * ffn, hidden, wide, 0.0f),
                                  "gate_up"));
    PD_RETURN_IF_ERROR(
        CudaStatus(cuda::SiluMul(wide, T, ffn, act, stream_), "silu"));
    PD_RETURN_IF_ERROR(BlasStatus(
        cuda::Gemm(blas_, act, T, L.w_down.get(), hidden, ffn, x, 1.0f),
        "down"));
  }

  PD_RETURN_IF_ERROR(
      CudaStatus(cuda::RmsNorm(x, meta_.At<int32_t>(rows_at), R, hidden,
                               final_norm_.get(), c.rms_norm_eps, act, stream_),
                 "final norm"));
  const uint16_t* head = lm_head_ != nullptr ? lm_head_.get() : embed_.get();
  PD_RETURN_IF_ERROR(BlasStatus(
      cuda::Gemm(blas_, act, R, head, vocab, hidden, logits_.get(), 0.0f),
      "lm_head"));
  return CudaStatus(
      cudaMemcpyAsync(logits.data(), logits_.get(), R * vocab * sizeof(float),
                      cudaMemcpyDeviceToHost, stream_),
      "logits copy");
}

}  // namespace

absl::StatusOr<std::unique_ptr<ModelRunner>> CreateCudaModelRunner(
    std::shared_ptr<const Model> model, const ModelRunnerOptions& options) {
  if (CudaDeviceCount() == 0) {
    return absl::FailedPreconditionError(
        "the cuda backend found no CUDA device");
  }
  PD_ASSIGN_OR_RETURN(std::unique_ptr<CudaModelRunner> runner,
                      CudaModelRunner::Create(std::move(model), options));
  return runner;
}

int CudaDeviceCount() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // Clear the error for later calls.
    return 0;
  }
  return n;
}

}  // namespace pdserve
