#include "engine/cuda/cuda_model_runner.h"

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <type_traits>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "engine/cpu/cpu_kernels.h"
#include "engine/cuda/cublas_api.h"
#include "engine/cuda/cuda_kernels.h"
#include "engine/kv_layout.h"

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
  const cuda::CublasApi* blas = cuda::Cublas();
  return absl::InternalError(absl::StrCat(
      what, ": ",
      blas != nullptr ? blas->status_string(s) : "cuBLAS not loaded"));
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
  DevicePtr<float> q_norm, k_norm;  // [head_dim] each, or null (no qk_norm).
  DevicePtr<uint16_t> wo;         // [hidden][q_dim]
  DevicePtr<uint16_t> w_gate_up;  // [2 ffn][hidden]
  DevicePtr<uint16_t> w_down;     // [hidden][ffn]
};

// Scratch that grows to the largest batch seen and is reused. A growth
// bumps *epoch, which invalidates the decode graphs captured with the old
// address.
template <typename T>
class GrowingBuffer {
 public:
  absl::Status Reserve(size_t count, const char* what, int64_t* epoch) {
    if (count <= capacity_) return absl::OkStatus();
    ptr_.reset();
    capacity_ = 0;
    ++*epoch;
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
    const size_t at = Reserve(v.size() * sizeof(T));
    if (!v.empty())
      std::memcpy(host_.data() + at, v.data(), v.size() * sizeof(T));
    return at;
  }
  // Room for `bytes` (zeroed), 16-byte aligned; returns its offset.
  size_t Reserve(size_t bytes) {
    const size_t at = (host_.size() + 15) / 16 * 16;
    host_.resize(at + bytes);
    return at;
  }
  template <typename T>
  T* HostAt(size_t offset) {
    return reinterpret_cast<T*>(host_.data() + offset);
  }
  size_t size() const { return host_.size(); }

  // Copies the packing to the device buffer, which is reallocated (and
  // *epoch bumped, when given) only when it is too small.
  absl::Status Upload(cudaStream_t stream, int64_t* epoch) {
    if (host_.size() > capacity_) {
      pinned_.reset();
      device_.reset();
      capacity_ = 0;
      if (epoch != nullptr) ++*epoch;
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

struct GraphExecDeleter {
  void operator()(cudaGraphExec_t g) const { cudaGraphExecDestroy(g); }
};
using GraphExec =
    std::unique_ptr<std::remove_pointer_t<cudaGraphExec_t>, GraphExecDeleter>;

// What the kernels of one forward read: device pointers into the metadata
// and the counts. The same plan drives an eager forward and a capture.
struct ForwardPlan {
  int64_t tokens = 0;  // T: rows of the activations.
  int64_t rows = 0;    // R: logits rows.
  const int32_t* ids = nullptr;
  const int32_t* positions = nullptr;
  const int64_t* slots = nullptr;  // -1: do not store (graph padding).
  const int32_t* logit_rows = nullptr;
  cuda::AttentionParams attention;  // Minus the layer's kv base.
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

  absl::StatusOr<std::span<std::byte>> KvHostStaging() override;
  absl::Status CopyKvToHostStaging(
      std::span<const KvByteRange> ranges) override {
    return CopyStaging(ranges, cudaMemcpyDeviceToHost);
  }
  absl::Status CopyKvFromHostStaging(
      std::span<const KvByteRange> ranges) override {
    return CopyStaging(ranges, cudaMemcpyHostToDevice);
  }

 private:
  // A decode step of `batch` sequences (padded up to a power of two)
  // captured once and replayed: its metadata lives at fixed addresses.
  struct DecodeGraph {
    int64_t epoch = -1;  // buffer_epoch_ at capture.
    GraphExec exec;
    MetadataBuffer meta;
    size_t ids_at = 0, pos_at = 0, slots_at = 0, rows_at = 0, seqs_at = 0,
           tiles_at = 0, tables_at = 0;
  };

  CudaModelRunner(std::shared_ptr<const Model> model, KvBlockLayout layout,
                  int32_t num_blocks, bool use_graphs)
      : model_(std::move(model)),
        layout_(layout),
        num_blocks_(num_blocks),
        max_blocks_per_seq_(
            (model_->config().max_position_embeddings + layout.block_size - 1) /
            layout.block_size),
        use_graphs_(use_graphs) {}

  absl::Status Init();
  // Context splits for `tiles` attention tiles (of all kinds) and the
  // longest context: about four blocks per SM when the tiles alone leave
  // SMs idle (decode), each split at least one key tile long.
  int AttentionSplits(int64_t tiles, int64_t max_context) const;
  absl::Status ReserveScratch(int64_t tokens, int64_t rows, int num_splits);
  absl::Status EagerForward(const ForwardBatch& batch, std::span<float> logits);
  // Decode steps through a captured graph; *done false when this batch
  // cannot use one (then nothing was enqueued).
  absl::Status GraphForward(const ForwardBatch& batch, std::span<float> logits,
                            bool* done);
  absl::Status EnqueueLayers(
      const ForwardPlan& plan,
      const std::function<void(int32_t)>& on_layer_kv_written);
  // Copies `ranges` between the pool and the staging memory (same
  // offsets) on copy_stream_, adjacent ranges as one copy, and waits.
  absl::Status CopyStaging(std::span<const KvByteRange> ranges,
                           cudaMemcpyKind direction);

  const std::shared_ptr<const Model> model_;
  const KvBlockLayout layout_;
  const int32_t num_blocks_;
  const int32_t max_blocks_per_seq_;  // Block table capacity in graphs.
  const bool use_graphs_;

  cudaStream_t stream_ = nullptr;
  // KV staging copies, which may run on another thread during a forward.
  cudaStream_t copy_stream_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  int device_ = 0;  // The creating thread's device; Forward selects it.
  int num_sms_ = 1;
  bool tensor_cores_ = false;   // Prefill attention on tensor cores.
  bool graphs_broken_ = false;  // A capture failed; stay eager.

  DevicePtr<std::byte> pool_;
  std::unique_ptr<std::byte, CudaFreeHost> staging_;  // KvHostStaging().
  DevicePtr<std::byte> blas_workspace_;
  DevicePtr<uint16_t> embed_, lm_head_;  // lm_head_ null when tied.
  DevicePtr<float> final_norm_, inv_freq_;
  std::vector<DeviceLayer> layers_;

  int64_t buffer_epoch_ = 0;        // Bumped whenever a scratch buffer moves.
  GrowingBuffer<float> x_;          // [T][hidden] residual stream.
  GrowingBuffer<float> wide_;       // [T][max(qkv_dim, 2 ffn)] GEMM outputs.
  GrowingBuffer<uint16_t> act_;     // [T][max(hidden, q_dim, ffn)] bf16.
  GrowingBuffer<float> logits_;     // [rows][vocab]
  GrowingBuffer<float> workspace_;  // Attention splits.
  MetadataBuffer meta_;
  // Keyed by log2(padded batch) * 8 + log2(splits).
  absl::flat_hash_map<int, std::unique_ptr<DecodeGraph>> graphs_;

  // Host-side per-forward vectors, kept to reuse their capacity.
  std::vector<int32_t> ids_, positions_, block_tables_, logit_rows_;
  std::vector<int64_t> slots_;
  std::vector<cuda::AttentionSequence> sequences_;
  std::vector<cuda::AttentionTile> tiles_, mma_tiles_;
};

// Largest decode batch replayed through a graph (padded to a power of two).
constexpr int kMaxGraphBatch = 256;
// cuBLAS workspace, set explicitly so that captured GEMMs never allocate.
constexpr size_t kBlasWorkspaceBytes = size_t{32} << 20;

CudaModelRunner::~CudaModelRunner() {
  graphs_.clear();
  if (blas_ != nullptr) cuda::Cublas()->destroy(blas_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
  if (copy_stream_ != nullptr) cudaStreamDestroy(copy_stream_);
}

absl::StatusOr<std::unique_ptr<CudaModelRunner>> CudaModelRunner::Create(
    std::shared_ptr<const Model> model, const ModelRunnerOptions& options) {
  const ModelConfig& c = model->config();
  if (options.int8_weights) {
    return absl::InvalidArgumentError(
        "int8 weights are a cpu backend format; the cuda backend runs bf16 "
        "(drop --int8_weights or use --backend=cpu)");
  }
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
      std::move(model), layout, static_cast<int32_t>(num_blocks),
      options.cuda_graphs));
  PD_RETURN_IF_ERROR(runner->Init());
  return runner;
}

absl::Status CudaModelRunner::Init() {
  const ModelConfig& c = model_->config();
  const ModelWeights& w = model_->weights();
  PD_RETURN_IF_ERROR(CudaStatus(cudaGetDevice(&device_), "cudaGetDevice"));
  const int device = device_;
  PD_RETURN_IF_ERROR(CudaStatus(
      cudaDeviceGetAttribute(&num_sms_, cudaDevAttrMultiProcessorCount, device),
      "SM count"));
  PD_RETURN_IF_ERROR(CudaStatus(
      cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), "stream"));
  PD_RETURN_IF_ERROR(CudaStatus(
      cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking),
      "copy stream"));
  std::string blas_error;
  const cuda::CublasApi* blas = cuda::Cublas(&blas_error);
  if (blas == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("cannot load cuBLAS: ", blas_error));
  }
  PD_RETURN_IF_ERROR(BlasStatus(blas->create(&blas_), "cublasCreate"));
  PD_RETURN_IF_ERROR(
      BlasStatus(blas->set_stream(blas_, stream_), "cublasSetStream"));
  PD_ASSIGN_OR_RETURN(
      blas_workspace_,
      DeviceAlloc<std::byte>(kBlasWorkspaceBytes, "cuBLAS workspace"));
  PD_RETURN_IF_ERROR(BlasStatus(
      blas->set_workspace(blas_, blas_workspace_.get(), kBlasWorkspaceBytes),
      "cuBLAS workspace"));
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
    if (c.qk_norm) {
      PD_ASSIGN_OR_RETURN(d.q_norm, Upload(L.q_norm, "q norm"));
      PD_ASSIGN_OR_RETURN(d.k_norm, Upload(L.k_norm, "k norm"));
    }
    PD_ASSIGN_OR_RETURN(d.wo, UploadBf16({&L.wo}, "wo"));
    PD_ASSIGN_OR_RETURN(d.w_gate_up,
                        UploadBf16({&L.w_gate, &L.w_up}, "w_gate_up"));
    PD_ASSIGN_OR_RETURN(d.w_down, UploadBf16({&L.w_down}, "w_down"));
  }
  return CudaStatus(cudaDeviceSynchronize(), "weight upload");
}

int CudaModelRunner::AttentionSplits(int64_t tiles, int64_t max_context) const {
  const int64_t blocks = tiles * model_->config().num_kv_heads;
  // A decode block's time is the latency of its walk over its keys, so
  // aim for about four blocks per multiprocessor (the fp32 kernel's shared
  // memory allows five), each split at least one key tile long.
  constexpr int64_t kMinSplitLen = cuda::kAttentionKeyTile;
  const int64_t target = 4 * num_sms_;
  if (blocks >= target || max_context < 2 * kMinSplitLen) return 1;
  return static_cast<int>(std::min<int64_t>(
      {(target + blocks - 1) / blocks, max_context / kMinSplitLen, 64}));
}

absl::Status CudaModelRunner::ReserveScratch(int64_t T, int64_t R,
                                             int num_splits) {
  const ModelConfig& c = model_->config();
  const int64_t hidden = c.hidden_size, D = c.head_dim,
                ffn = c.intermediate_size;
  const int64_t q_dim = c.num_heads * D,
                qkv_dim = q_dim + 2 * c.num_kv_heads * D;
  PD_RETURN_IF_ERROR(x_.Reserve(T * hidden, "activations", &buffer_epoch_));
  PD_RETURN_IF_ERROR(wide_.Reserve(T * std::max(qkv_dim, 2 * ffn),
                                   "activations", &buffer_epoch_));
  PD_RETURN_IF_ERROR(act_.Reserve(T * std::max({hidden, q_dim, ffn}),
                                  "activations", &buffer_epoch_));
  PD_RETURN_IF_ERROR(
      logits_.Reserve(R * c.vocab_size, "logits", &buffer_epoch_));
  if (num_splits > 1) {
    PD_RETURN_IF_ERROR(
        workspace_.Reserve(num_splits * T * c.num_heads * (D + 2),
                           "attention workspace", &buffer_epoch_));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::span<std::byte>> CudaModelRunner::KvHostStaging() {
  const size_t bytes = kv_memory().size();
  if (staging_ == nullptr) {
    PD_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
    void* p = nullptr;
    const cudaError_t err = cudaMallocHost(&p, bytes);
    if (err != cudaSuccess) {
      cudaGetLastError();  // Clear it: the device itself is fine.
      return absl::ResourceExhaustedError(
          absl::StrCat("cannot pin ", bytes,
                       " bytes of host memory to stage the KV pool: ",
                       cudaGetErrorString(err)));
    }
    staging_.reset(static_cast<std::byte*>(p));
  }
  return std::span<std::byte>(staging_.get(), bytes);
}

absl::Status CudaModelRunner::CopyStaging(std::span<const KvByteRange> ranges,
                                          cudaMemcpyKind direction) {
  PD_RETURN_IF_ERROR(ValidateKvRanges(ranges));
  if (staging_ == nullptr) {
    return absl::FailedPreconditionError(
        "KV staging copy before KvHostStaging()");
  }
  PD_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  absl::Status status;
  for (size_t i = 0; i < ranges.size() && status.ok();) {
    const size_t offset = ranges[i].offset;
    size_t length = ranges[i].length;
    for (++i; i < ranges.size() && ranges[i].offset == offset + length; ++i) {
      length += ranges[i].length;
    }
    if (length == 0) continue;
    std::byte* device = pool_.get() + offset;
    std::byte* host = staging_.get() + offset;
    status = CudaStatus(
        direction == cudaMemcpyDeviceToHost
            ? cudaMemcpyAsync(host, device, length, direction, copy_stream_)
            : cudaMemcpyAsync(device, host, length, direction, copy_stream_),
        "KV staging copy");
  }
  // Wait even after a failed enqueue: no copy may outlive the call.
  const absl::Status synced =
      CudaStatus(cudaStreamSynchronize(copy_stream_), "KV staging copy");
  return status.ok() ? synced : status;
}

absl::Status CudaModelRunner::Forward(const ForwardBatch& batch,
                                      std::span<float> logits) {
  PD_RETURN_IF_ERROR(ValidateBatch(batch, logits));
  // The engine thread may not be the one that created the runner.
  PD_RETURN_IF_ERROR(CudaStatus(cudaSetDevice(device_), "cudaSetDevice"));
  bool done = false;
  absl::Status s = GraphForward(batch, logits, &done);
  if (s.ok() && !done) s = EagerForward(batch, logits);
  // Whatever was enqueued finishes before the caller may touch the cache
  // or reuse the batch's memory.
  const absl::Status sync =
      CudaStatus(cudaStreamSynchronize(stream_), "forward");
  return s.ok() ? sync : s;
}

absl::Status CudaModelRunner::EagerForward(const ForwardBatch& batch,
                                           std::span<float> logits) {
  const ModelConfig& c = model_->config();
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
    const int64_t blocks = BlocksForTokens(end, bs);
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
  const int num_splits = AttentionSplits(
      static_cast<int64_t>(tiles_.size() + mma_tiles_.size()), max_context);
  PD_RETURN_IF_ERROR(ReserveScratch(T, R, num_splits));

  meta_.Clear();
  const size_t ids_at = meta_.Add(ids_);
  const size_t pos_at = meta_.Add(positions_);
  const size_t slots_at = meta_.Add(slots_);
  const size_t tables_at = meta_.Add(block_tables_);
  const size_t rows_at = meta_.Add(logit_rows_);
  const size_t seqs_at = meta_.Add(sequences_);
  const size_t tiles_at = meta_.Add(tiles_);
  const size_t mma_tiles_at = meta_.Add(mma_tiles_);
  // No graph reads meta_, so its moves need not invalidate them.
  PD_RETURN_IF_ERROR(meta_.Upload(stream_, /*epoch=*/nullptr));

  ForwardPlan plan;
  plan.tokens = T;
  plan.rows = R;
  plan.ids = meta_.At<int32_t>(ids_at);
  plan.positions = meta_.At<int32_t>(pos_at);
  plan.slots = meta_.At<int64_t>(slots_at);
  plan.logit_rows = meta_.At<int32_t>(rows_at);
  cuda::AttentionParams& ap = plan.attention;
  ap.block_tables = meta_.At<int32_t>(tables_at);
  ap.sequences = meta_.At<cuda::AttentionSequence>(seqs_at);
  ap.tiles = meta_.At<cuda::AttentionTile>(tiles_at);
  ap.num_tiles = static_cast<int>(tiles_.size());
  ap.mma_tiles = meta_.At<cuda::AttentionTile>(mma_tiles_at);
  ap.num_mma_tiles = static_cast<int>(mma_tiles_.size());
  ap.num_splits = num_splits;
  PD_RETURN_IF_ERROR(EnqueueLayers(plan, batch.on_layer_kv_written));
  return CudaStatus(cudaMemcpyAsync(logits.data(), logits_.get(),
                                    R * c.vocab_size * sizeof(float),
                                    cudaMemcpyDeviceToHost, stream_),
                    "logits copy");
}

absl::Status CudaModelRunner::GraphForward(const ForwardBatch& batch,
                                           std::span<float> logits,
                                           bool* done) {
  *done = false;
  const ModelConfig& c = model_->config();
  const int group = c.num_heads / c.num_kv_heads;
  const int bs = layout_.block_size;
  const int64_t B = static_cast<int64_t>(batch.sequences.size());
  // Pure decode steps only: one token (so one logits row) per sequence,
  // one fp32 attention tile per sequence, no per-layer hook.
  if (!use_graphs_ || graphs_broken_ || batch.on_layer_kv_written ||
      B > kMaxGraphBatch || group > cuda::kAttentionTileRows) {
    return absl::OkStatus();
  }
  int64_t max_context = 0;
  for (const SequenceInput& s : batch.sequences) {
    if (s.tokens.size() != 1) return absl::OkStatus();
    max_context = std::max<int64_t>(max_context, s.start_pos + 1);
  }
  int padded = 1, log_batch = 0;
  while (padded < B) padded *= 2, ++log_batch;
  // Splits rounded down to a power of two, so that few graphs cover all
  // contexts.
  int splits = 1, log_splits = 0;
  const int want = AttentionSplits(padded, max_context);
  while (splits * 2 <= want) splits *= 2, ++log_splits;
  PD_RETURN_IF_ERROR(ReserveScratch(padded, padded, splits));

  std::unique_ptr<DecodeGraph>& g = graphs_[log_batch * 8 + log_splits];
  if (g == nullptr) {
    g = std::make_unique<DecodeGraph>();
    MetadataBuffer& m = g->meta;
    g->ids_at = m.Reserve(padded * sizeof(int32_t));
    g->pos_at = m.Reserve(padded * sizeof(int32_t));
    g->slots_at = m.Reserve(padded * sizeof(int64_t));
    g->rows_at = m.Reserve(padded * sizeof(int32_t));
    g->seqs_at = m.Reserve(padded * sizeof(cuda::AttentionSequence));
    g->tiles_at = m.Reserve(padded * sizeof(cuda::AttentionTile));
    g->tables_at = m.Reserve(static_cast<size_t>(padded) * max_blocks_per_seq_ *
                             sizeof(int32_t));
  }
  // Fill the fixed layout: the batch's sequences, then padding sequences
  // that read block 0 at position 0 and store nothing.
  MetadataBuffer& m = g->meta;
  for (int64_t i = 0; i < padded; ++i) {
    const bool real = i < B;
    const SequenceInput* s = real ? &batch.sequences[i] : nullptr;
    const int32_t pos = real ? s->start_pos : 0;
    m.HostAt<int32_t>(g->ids_at)[i] = real ? s->tokens[0] : 0;
    m.HostAt<int32_t>(g->pos_at)[i] = pos;
    m.HostAt<int64_t>(g->slots_at)[i] =
        real ? static_cast<int64_t>(s->block_table[pos / bs].value) * bs +
                   pos % bs
             : -1;
    m.HostAt<int32_t>(g->rows_at)[i] = static_cast<int32_t>(i);
    const int32_t table_at = static_cast<int32_t>(i * max_blocks_per_seq_);
    m.HostAt<cuda::AttentionSequence>(g->seqs_at)[i] = {static_cast<int32_t>(i),
                                                        1, pos, table_at};
    m.HostAt<cuda::AttentionTile>(g->tiles_at)[i] = {static_cast<int32_t>(i), 0,
                                                     group};
    int32_t* table = m.HostAt<int32_t>(g->tables_at) + table_at;
    const int64_t blocks = real ? pos / bs + 1 : 1;
    for (int64_t b = 0; b < blocks; ++b)
      table[b] = real ? s->block_table[b].value : 0;
  }
  // The layout's size is fixed, so the buffer is only allocated before the
  // graph's first capture.
  PD_RETURN_IF_ERROR(m.Upload(stream_, /*epoch=*/nullptr));

  if (g->exec == nullptr || g->epoch != buffer_epoch_) {
    g->exec.reset();
    ForwardPlan plan;
    plan.tokens = padded;
    plan.rows = padded;
    plan.ids = m.At<int32_t>(g->ids_at);
    plan.positions = m.At<int32_t>(g->pos_at);
    plan.slots = m.At<int64_t>(g->slots_at);
    plan.logit_rows = m.At<int32_t>(g->rows_at);
    cuda::AttentionParams& ap = plan.attention;
    ap.block_tables = m.At<int32_t>(g->tables_at);
    ap.sequences = m.At<cuda::AttentionSequence>(g->seqs_at);
    ap.tiles = m.At<cuda::AttentionTile>(g->tiles_at);
    ap.num_tiles = static_cast<int>(padded);
    ap.num_splits = splits;
    const cudaError_t began =
        cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal);
    absl::Status enqueued = absl::UnavailableError("capture did not begin");
    cudaGraph_t graph = nullptr;
    cudaError_t ended = began;
    if (began == cudaSuccess) {
      enqueued = EnqueueLayers(plan, nullptr);
      ended = cudaStreamEndCapture(stream_, &graph);
    }
    cudaGraphExec_t exec = nullptr;
    cudaError_t made = cudaErrorStreamCaptureInvalidated;
    if (enqueued.ok() && ended == cudaSuccess)
      made = cudaGraphInstantiate(&exec, graph, 0);
    if (graph != nullptr) cudaGraphDestroy(graph);
    if (!enqueued.ok() || ended != cudaSuccess || made != cudaSuccess) {
      // Stay eager from now on; this step runs eagerly below.
      cudaGetLastError();
      graphs_broken_ = true;
      graphs_.clear();
      return absl::OkStatus();
    }
    g->exec.reset(exec);
    g->epoch = buffer_epoch_;
  }
  PD_RETURN_IF_ERROR(
      CudaStatus(cudaGraphLaunch(g->exec.get(), stream_), "graph launch"));
  *done = true;
  return CudaStatus(cudaMemcpyAsync(logits.data(), logits_.get(),
                                    B * c.vocab_size * sizeof(float),
                                    cudaMemcpyDeviceToHost, stream_),
                    "logits copy");
}

absl::Status CudaModelRunner::EnqueueLayers(
    const ForwardPlan& plan,
    const std::function<void(int32_t)>& on_layer_kv_written) {
  const ModelConfig& c = model_->config();
  const int64_t hidden = c.hidden_size;
  const int64_t D = c.head_dim;
  const int64_t q_dim = c.num_heads * D;
  const int64_t kv_dim = c.num_kv_heads * D;
  const int64_t qkv_dim = q_dim + 2 * kv_dim;
  const int64_t ffn = c.intermediate_size;
  const int64_t T = plan.tokens, R = plan.rows;
  float* x = x_.get();
  float* wide = wide_.get();
  uint16_t* act = act_.get();

  PD_RETURN_IF_ERROR(
      CudaStatus(cuda::Embedding(embed_.get(), hidden, plan.ids, T, x, stream_),
                 "embedding"));

  cuda::AttentionParams ap = plan.attention;
  ap.q = wide;
  ap.q_row_stride = qkv_dim;
  ap.num_heads = c.num_heads;
  ap.sliding_window = c.sliding_window;
  ap.scale = 1.0f / std::sqrt(static_cast<float>(D));
  ap.num_tokens = T;
  ap.workspace = workspace_.get();
  ap.out = act;

  for (int l = 0; l < c.num_layers; ++l) {
    const DeviceLayer& L = layers_[l];
    uint16_t* layer_base = reinterpret_cast<uint16_t*>(
        pool_.get() + layout_.PoolOffset(l, BlockId(0), num_blocks_));
    const cuda::PagedKvLayer kv{layer_base, c.num_kv_heads, c.head_dim,
                                layout_.block_size};

    PD_RETURN_IF_ERROR(
        CudaStatus(cuda::RmsNorm(x, nullptr, T, hidden, L.attn_norm.get(),
                                 c.rms_norm_eps, act, stream_),
                   "attn norm"));
    PD_RETURN_IF_ERROR(BlasStatus(
        cuda::Gemm(blas_, act, T, L.wqkv.get(), qkv_dim, hidden, wide, 0.0f),
        "qkv"));
    PD_RETURN_IF_ERROR(CudaStatus(
        cuda::BiasRope(wide, qkv_dim, qkv_dim, T, plan.positions,
                       inv_freq_.get(), c.num_heads, c.num_kv_heads, c.head_dim,
                       L.bqkv.get(),
                       {L.q_norm.get(), L.k_norm.get(), c.rms_norm_eps},
                       cuda::RopeStyle::kHalfRotation, stream_),
        "rope"));
    PD_RETURN_IF_ERROR(
        CudaStatus(cuda::WriteKv(wide, qkv_dim, q_dim, q_dim + kv_dim, T,
                                 plan.slots, kv, stream_),
                   "kv write"));
    if (on_layer_kv_written) {
      PD_RETURN_IF_ERROR(
          CudaStatus(cudaStreamSynchronize(stream_), "kv write"));
      on_layer_kv_written(l);
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
      CudaStatus(cuda::RmsNorm(x, plan.logit_rows, R, hidden, final_norm_.get(),
                               c.rms_norm_eps, act, stream_),
                 "final norm"));
  const uint16_t* head = lm_head_ != nullptr ? lm_head_.get() : embed_.get();
  return BlasStatus(cuda::Gemm(blas_, act, R, head, c.vocab_size, hidden,
                               logits_.get(), 0.0f),
                    "lm_head");
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
