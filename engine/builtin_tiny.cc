#include "engine/builtin_tiny.h"

#include <cmath>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace pdserve {
namespace {

// splitmix64: a tiny, well-mixed, portable generator, so builtin weights are
// identical on every machine and compiler.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t Next() {
    uint64_t z = (state_ += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  // Uniform in [-1, 1).
  float NextSigned() { return static_cast<float>(Next() >> 40) * 0x1p-23f - 1.0f; }

 private:
  uint64_t state_;
};

class WeightMaker {
 public:
  WeightMaker(DType dtype, uint64_t seed) : dtype_(dtype), rng_(seed) {}

  WeightMatrix Matrix(int32_t rows, int32_t cols, float scale) {
    std::vector<std::byte>& buf = storage_.emplace_back(
        static_cast<size_t>(rows) * cols * DTypeSize(dtype_));
    // Uniform with standard deviation scale / sqrt(cols).
    const float amp = scale * std::sqrt(3.0f / static_cast<float>(cols));
    for (size_t i = 0; i < static_cast<size_t>(rows) * cols; ++i) {
      StoreFromFloat(buf.data(), dtype_, i, amp * rng_.NextSigned());
    }
    return WeightMatrix{dtype_, rows, cols, buf.data()};
  }

  std::vector<float> Vector(int32_t n, float center, float spread) {
    std::vector<float> v(n);
    for (float& x : v) x = center + spread * rng_.NextSigned();
    return v;
  }

  std::vector<std::vector<std::byte>> TakeStorage() { return std::move(storage_); }

 private:
  const DType dtype_;
  SplitMix64 rng_;
  std::vector<std::vector<std::byte>> storage_;
};

}  // namespace

absl::StatusOr<std::shared_ptr<const Model>> MakeRandomModel(std::string name,
                                                             const ModelConfig& config,
                                                             DType dtype, uint64_t seed) {
  PD_RETURN_IF_ERROR(config.Validate());
  std::unique_ptr<Tokenizer> tokenizer;
  if (config.vocab_size >= 258)
    tokenizer = Tokenizer::MakeByteLevel(config.vocab_size);
  PD_ASSIGN_OR_RETURN(
      std::shared_ptr<const ModelInfo> info,
      ModelInfo::FromParts({.name = std::move(name),
                            .config = config,
                            .tokenizer = std::move(tokenizer)}));
  return MakeRandomModel(std::move(info), dtype, seed);
}

absl::StatusOr<std::shared_ptr<const Model>> MakeRandomModel(
    std::shared_ptr<const ModelInfo> info, DType dtype, uint64_t seed) {
  const ModelConfig& config = info->config();
  WeightMaker make(dtype, seed);
  const int32_t hidden = config.hidden_size;
  const int32_t q_dim = config.num_heads * config.head_dim;
  const int32_t kv_dim = config.num_kv_heads * config.head_dim;
  ModelWeights w;
  // Embeddings with unit-ish rows so the first RMSNorm sees sane input.
  w.embed = make.Matrix(config.vocab_size, hidden, std::sqrt(static_cast<float>(hidden)));
  for (int l = 0; l < config.num_layers; ++l) {
    LayerWeights& L = w.layers.emplace_back();
    L.attn_norm = make.Vector(hidden, 1.0f, 0.2f);
    L.wq = make.Matrix(q_dim, hidden, 1.0f);
    L.wk = make.Matrix(kv_dim, hidden, 1.0f);
    L.wv = make.Matrix(kv_dim, hidden, 1.0f);
    L.wo = make.Matrix(hidden, q_dim, 1.0f);
    if (config.qkv_bias) {
      L.bq = make.Vector(q_dim, 0.0f, 0.1f);
      L.bk = make.Vector(kv_dim, 0.0f, 0.1f);
      L.bv = make.Vector(kv_dim, 0.0f, 0.1f);
    }
    if (config.qk_norm) {
      L.q_norm = make.Vector(config.head_dim, 1.0f, 0.2f);
      L.k_norm = make.Vector(config.head_dim, 1.0f, 0.2f);
    }
    L.ffn_norm = make.Vector(hidden, 1.0f, 0.2f);
    L.w_gate = make.Matrix(config.intermediate_size, hidden, 1.0f);
    L.w_up = make.Matrix(config.intermediate_size, hidden, 1.0f);
    L.w_down = make.Matrix(hidden, config.intermediate_size, 1.0f);
  }
  w.final_norm = make.Vector(hidden, 1.0f, 0.2f);
  w.lm_head = config.tie_word_embeddings ? w.embed : make.Matrix(config.vocab_size, hidden, 4.0f);
  return Model::FromInfo(std::move(info), std::move(w), make.TakeStorage());
}

absl::StatusOr<std::shared_ptr<const Model>> MakeBuiltinModel(
    std::shared_ptr<const ModelInfo> info) {
  if (info->name() == "builtin:tiny")
    return MakeRandomModel(std::move(info), DType::kF32, 0);
  if (info->name() == "builtin:llama-110m") {
    return MakeRandomModel(std::move(info), DType::kBF16, 1);
  }
  return absl::InvalidArgumentError(
      absl::StrCat("'", info->name(), "' is not a builtin model"));
}

absl::StatusOr<std::shared_ptr<const Model>> MakeTinyModel() {
  PD_ASSIGN_OR_RETURN(std::shared_ptr<const ModelInfo> info,
                      LoadModelInfo("builtin:tiny"));
  return MakeBuiltinModel(std::move(info));
}

}  // namespace pdserve
