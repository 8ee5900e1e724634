#include "engine/cpu/cpu_model_runner.h"

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <new>
#include <thread>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/log.h"
#include "common/status_macros.h"
#include "engine/cpu/cpu_kernels.h"

namespace pdserve {
namespace {

struct FreeDeleter {
  void operator()(std::byte* p) const { std::free(p); }
};

// A model's weights with every matrix but the embedding table as kQ8, and
// the bytes they point into.
struct QuantizedWeights {
  ModelWeights weights;
  std::vector<std::vector<std::byte>> storage;
};

absl::StatusOr<std::unique_ptr<const QuantizedWeights>> QuantizeWeights(const ModelWeights& from,
                                                                        int num_threads) {
  auto q = std::make_unique<QuantizedWeights>();
  q->weights = from;  // Norms and biases as they are; the matrices below.
  auto quantize = [&](WeightMatrix& m, std::string_view name, int layer) -> absl::Status {
    absl::StatusOr<WeightMatrix> r = cpu::QuantizeToQ8(m, q->storage.emplace_back(), num_threads);
    if (!r.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(
          std::string(name), layer >= 0 ? absl::StrCat(" of layer ", layer) : "", ": ",
          std::string(r.status().message())));
    }
    m = *r;
    return absl::OkStatus();
  };
  for (int l = 0; l < static_cast<int>(q->weights.layers.size()); ++l) {
    LayerWeights& L = q->weights.layers[l];
    PD_RETURN_IF_ERROR(quantize(L.wq, "q_proj", l));
    PD_RETURN_IF_ERROR(quantize(L.wk, "k_proj", l));
    PD_RETURN_IF_ERROR(quantize(L.wv, "v_proj", l));
    PD_RETURN_IF_ERROR(quantize(L.wo, "o_proj", l));
    PD_RETURN_IF_ERROR(quantize(L.w_gate, "gate_proj", l));
    PD_RETURN_IF_ERROR(quantize(L.w_up, "up_proj", l));
    PD_RETURN_IF_ERROR(quantize(L.w_down, "down_proj", l));
  }
  // A tied LM head gets a copy of its own; the embedding lookup keeps the
  // original rows.
  PD_RETURN_IF_ERROR(quantize(q->weights.lm_head, "lm_head", -1));
  return q;
}

class CpuModelRunner final : public ModelRunner {
 public:
  // `q8`: the model's matrices quantized to int8 (QuantizeWeights), or
  // null to use the model's own.
  CpuModelRunner(std::shared_ptr<const Model> model, std::unique_ptr<const QuantizedWeights> q8,
                 KvBlockLayout layout, int32_t num_blocks,
                 std::unique_ptr<std::byte, FreeDeleter> pool, int num_threads,
                 cpu::MatMulOptions matmul)
      : model_(std::move(model)),
        q8_(std::move(q8)),
        weights_(q8_ != nullptr ? q8_->weights : model_->weights()),
        layout_(layout),
        num_blocks_(num_blocks),
        pool_(std::move(pool)),
        num_threads_(num_threads),
        matmul_(matmul),
        inv_freq_(cpu::RopeInvFreq(model_->config())) {}

  const Model& model() const override { return *model_; }
  const KvBlockLayout& kv_layout() const override { return layout_; }
  int32_t num_kv_blocks() const override { return num_blocks_; }
  std::span<std::byte> kv_memory() override {
    return {pool_.get(), static_cast<size_t>(num_blocks_) * layout_.block_bytes()};
  }

  absl::Status Forward(const ForwardBatch& batch, std::span<float> logits) override;

 private:
  // Per-token bookkeeping of the flattened batch.
  struct TokenRef {
    int32_t seq;
    int32_t pos;
  };

  void EnsureScratch(int64_t tokens, int64_t max_context);
  void Attention(const ForwardBatch& batch, int layer);

  const std::shared_ptr<const Model> model_;
  const std::unique_ptr<const QuantizedWeights> q8_;
  const ModelWeights& weights_;  // q8_'s or the model's.
  const KvBlockLayout layout_;
  const int32_t num_blocks_;
  const std::unique_ptr<std::byte, FreeDeleter> pool_;
  const int num_threads_;
  const cpu::MatMulOptions matmul_;
  const std::vector<float> inv_freq_;

  // Scratch, grown on demand and reused across calls.
  std::vector<TokenRef> tokens_;
  std::vector<float> x_, xn_, q_, k_, v_, attn_, gate_, up_, cos_, sin_, final_;
  std::vector<float> scores_;  // num_threads_ rows of score_stride_.
  int64_t score_stride_ = 0;
};

void CpuModelRunner::EnsureScratch(int64_t t, int64_t max_context) {
  const ModelConfig& c = model_->config();
  const int64_t q_dim = static_cast<int64_t>(c.num_heads) * c.head_dim;
  const int64_t kv_dim = static_cast<int64_t>(c.num_kv_heads) * c.head_dim;
  auto grow = [](std::vector<float>& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  };
  grow(x_, t * c.hidden_size);
  grow(xn_, t * c.hidden_size);
  grow(q_, t * q_dim);
  grow(k_, t * kv_dim);
  grow(v_, t * kv_dim);
  grow(attn_, t * q_dim);
  grow(gate_, t * c.intermediate_size);
  grow(up_, t * c.intermediate_size);
  grow(cos_, t * (c.head_dim / 2));
  grow(sin_, t * (c.head_dim / 2));
  const int64_t group_scores = static_cast<int64_t>(c.num_heads / c.num_kv_heads) * max_context;
  if (score_stride_ < group_scores) {
    score_stride_ = group_scores;
    scores_.assign(static_cast<size_t>(num_threads_) * score_stride_, 0.0f);
  }
}

void CpuModelRunner::Attention(const ForwardBatch& batch, int layer) {
  const ModelConfig& c = model_->config();
  const int group = c.num_heads / c.num_kv_heads;
  const int64_t q_dim = static_cast<int64_t>(c.num_heads) * c.head_dim;
  const float scale = 1.0f / std::sqrt(static_cast<float>(c.head_dim));
  std::byte* layer_base =
      pool_.get() + layout_.PoolOffset(layer, BlockId(0), num_blocks_);
  // One item per token and KV head: the group's query heads share its K/V.
  const int64_t items = static_cast<int64_t>(tokens_.size()) * c.num_kv_heads;
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads_) if (items > 1)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t t = item / c.num_kv_heads;
    const int kv_head = static_cast<int>(item % c.num_kv_heads);
    const TokenRef& ref = tokens_[t];
    const cpu::PagedKv kv{&layout_, layer_base, batch.sequences[ref.seq].block_table};
    const int64_t first =
        c.sliding_window > 0 ? std::max<int64_t>(0, ref.pos - c.sliding_window + 1) : 0;
    const int64_t at = t * q_dim + static_cast<int64_t>(kv_head) * group * c.head_dim;
    cpu::AttendGroup(&q_[at], group, kv, kv_head, first, ref.pos, scale,
                     &scores_[omp_get_thread_num() * score_stride_], &attn_[at]);
  }
}

absl::Status CpuModelRunner::Forward(const ForwardBatch& batch, std::span<float> logits) {
  PD_RETURN_IF_ERROR(ValidateBatch(batch, logits));
  const ModelConfig& c = model_->config();
  const ModelWeights& w = weights_;
  const int64_t hidden = c.hidden_size;
  const int64_t q_dim = static_cast<int64_t>(c.num_heads) * c.head_dim;
  const int64_t kv_dim = static_cast<int64_t>(c.num_kv_heads) * c.head_dim;
  const int64_t ffn = c.intermediate_size;
  const int half = c.head_dim / 2;

  tokens_.clear();
  int64_t max_context = 0;
  for (size_t s = 0; s < batch.sequences.size(); ++s) {
    const SequenceInput& seq = batch.sequences[s];
    for (size_t i = 0; i < seq.tokens.size(); ++i) {
      tokens_.push_back({static_cast<int32_t>(s), static_cast<int32_t>(seq.start_pos + i)});
    }
    max_context = std::max<int64_t>(max_context, seq.start_pos + seq.tokens.size());
  }
  const int64_t T = static_cast<int64_t>(tokens_.size());
  EnsureScratch(T, max_context);

  // Embeddings and RoPE angles, once per forward.
  {
    int64_t t = 0;
    for (const SequenceInput& seq : batch.sequences) {
      for (int32_t id : seq.tokens) {
        cpu::EmbeddingRow(w.embed, id, &x_[t * hidden]);
        cpu::RopeAngles(tokens_[t].pos, inv_freq_, &cos_[t * half], &sin_[t * half]);
        ++t;
      }
    }
  }

  for (int l = 0; l < c.num_layers; ++l) {
    const LayerWeights& L = w.layers[l];
    for (int64_t t = 0; t < T; ++t) {
      cpu::RmsNorm(&x_[t * hidden], L.attn_norm.data(), hidden, c.rms_norm_eps, &xn_[t * hidden]);
    }
    const cpu::MatMulProduct qkv[] = {
        {.w = &L.wq, .y = q_.data()}, {.w = &L.wk, .y = k_.data()}, {.w = &L.wv, .y = v_.data()}};
    cpu::MatMul(xn_.data(), T, qkv, matmul_);
    std::byte* layer_base = pool_.get() + layout_.PoolOffset(l, BlockId(0), num_blocks_);
    for (int64_t t = 0; t < T; ++t) {
      float* q = &q_[t * q_dim];
      float* k = &k_[t * kv_dim];
      float* v = &v_[t * kv_dim];
      if (c.qkv_bias) {
        for (int64_t i = 0; i < q_dim; ++i) q[i] += L.bq[i];
        for (int64_t i = 0; i < kv_dim; ++i) k[i] += L.bk[i];
        for (int64_t i = 0; i < kv_dim; ++i) v[i] += L.bv[i];
      }
      if (c.qk_norm) {  // Qwen3: every head normalized on its own.
        for (int h = 0; h < c.num_heads; ++h) {
          float* qh = q + static_cast<int64_t>(h) * c.head_dim;
          cpu::RmsNorm(qh, L.q_norm.data(), c.head_dim, c.rms_norm_eps, qh);
        }
        for (int h = 0; h < c.num_kv_heads; ++h) {
          float* kh = k + static_cast<int64_t>(h) * c.head_dim;
          cpu::RmsNorm(kh, L.k_norm.data(), c.head_dim, c.rms_norm_eps, kh);
        }
      }
      cpu::ApplyRope(q, c.num_heads, c.head_dim, &cos_[t * half], &sin_[t * half],
                     cpu::RopeStyle::kHalfRotation);
      cpu::ApplyRope(k, c.num_kv_heads, c.head_dim, &cos_[t * half], &sin_[t * half],
                     cpu::RopeStyle::kHalfRotation);
      // Store this token's K/V in its cache slot.
      const cpu::PagedKv kv{&layout_, layer_base, batch.sequences[tokens_[t].seq].block_table};
      for (int h = 0; h < c.num_kv_heads; ++h) {
        std::copy_n(k + h * c.head_dim, c.head_dim, kv.Key(tokens_[t].pos, h));
        std::copy_n(v + h * c.head_dim, c.head_dim, kv.Value(tokens_[t].pos, h));
      }
    }
    if (batch.on_layer_kv_written) batch.on_layer_kv_written(l);
    Attention(batch, l);
    cpu::MatMul(attn_.data(), T, L.wo, xn_.data(), matmul_);
    for (int64_t i = 0; i < T * hidden; ++i) x_[i] += xn_[i];

    for (int64_t t = 0; t < T; ++t) {
      cpu::RmsNorm(&x_[t * hidden], L.ffn_norm.data(), hidden, c.rms_norm_eps, &xn_[t * hidden]);
    }
    const cpu::MatMulProduct gate_up[] = {{.w = &L.w_gate, .y = gate_.data()},
                                          {.w = &L.w_up, .y = up_.data()}};
    cpu::MatMul(xn_.data(), T, gate_up, matmul_);
    cpu::SiluMul(gate_.data(), up_.data(), T * ffn, gate_.data());
    cpu::MatMul(gate_.data(), T, L.w_down, xn_.data(), matmul_);
    for (int64_t i = 0; i < T * hidden; ++i) x_[i] += xn_[i];
  }

  // Final norm of the rows that want logits, then the LM head straight into
  // the caller's buffer.
  const int64_t rows = static_cast<int64_t>(ModelRunner::NumLogitsRows(batch));
  if (static_cast<int64_t>(final_.size()) < rows * hidden) final_.resize(rows * hidden);
  int64_t row = 0, t0 = 0;
  for (const SequenceInput& seq : batch.sequences) {
    const int64_t n = static_cast<int64_t>(seq.tokens.size());
    for (int64_t t = seq.all_logits ? t0 : t0 + n - 1; t < t0 + n; ++t, ++row) {
      cpu::RmsNorm(&x_[t * hidden], w.final_norm.data(), hidden, c.rms_norm_eps,
                   &final_[row * hidden]);
    }
    t0 += n;
  }
  cpu::MatMul(final_.data(), rows, w.lm_head, logits.data(), matmul_);
  return absl::OkStatus();
}

}  // namespace

absl::StatusOr<std::unique_ptr<ModelRunner>> CreateCpuModelRunner(
    std::shared_ptr<const Model> model, const ModelRunnerOptions& options) {
  const ModelConfig& c = model->config();
  PD_ASSIGN_OR_RETURN(const cpu::CpuIsa isa, cpu::CpuIsaFromEnvironment());
  if (options.block_size < 1 || options.block_size > 1024) {
    return absl::InvalidArgumentError(
        absl::StrCat("block_size must be in [1, 1024], got ", options.block_size));
  }
  KvBlockLayout layout{c.num_layers, c.num_kv_heads, c.head_dim, options.block_size, DType::kF32};
  int64_t num_blocks = options.num_kv_blocks;
  if (num_blocks == 0) num_blocks = static_cast<int64_t>(options.kv_cache_bytes / layout.block_bytes());
  if (num_blocks < 1 || num_blocks > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "KV pool of ", num_blocks, " blocks (", layout.block_bytes(),
        " bytes each) is out of range; raise kv_cache_bytes or num_kv_blocks"));
  }
  const size_t bytes = static_cast<size_t>(num_blocks) * layout.block_bytes();
  void* raw = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (raw == nullptr) {
    return absl::ResourceExhaustedError(
        absl::StrCat("cannot allocate a KV pool of ", bytes, " bytes"));
  }
  std::unique_ptr<std::byte, FreeDeleter> pool(static_cast<std::byte*>(raw));
  int threads = options.num_threads;
  if (threads <= 0) threads = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::unique_ptr<const QuantizedWeights> q8;
  if (options.int8_weights) {
    const absl::Time start = absl::Now();
    PD_ASSIGN_OR_RETURN(q8, QuantizeWeights(model->weights(), threads));
    size_t bytes = 0;
    for (const std::vector<std::byte>& s : q8->storage) bytes += s.size();
    PD_LOG(INFO) << "cpu backend: weights quantized to int8 ("
                 << absl::StrFormat("%.1f", bytes / 1048576.0) << " MiB) in "
                 << absl::ToInt64Milliseconds(absl::Now() - start) << " ms";
  }
  const cpu::MatMulOptions matmul{
      .num_threads = threads, .isa = isa, .bf16_activations = options.bf16_activations};
  PD_LOG(INFO) << "cpu backend: " << threads << " threads, " << cpu::CpuIsaName(isa)
               << " kernels" << (matmul.Avx512Fp32() ? " (16-lane fp32)" : "")
               << (options.int8_weights ? ", int8 weights" : "")
               << (options.bf16_activations && !options.int8_weights ? ", bf16 activations" : "");
  return std::make_unique<CpuModelRunner>(std::move(model), std::move(q8), layout,
                                          static_cast<int32_t>(num_blocks), std::move(pool),
                                          threads, matmul);
}

}  // namespace pdserve
