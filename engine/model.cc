#include "engine/model.h"

#include <filesystem>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "engine/builtin_tiny.h"
#include "engine/model_files/safetensors.h"

namespace pdserve {
namespace {

absl::StatusOr<WeightMatrix> GetMatrix(const Checkpoint& ckpt, const std::string& name,
                                       int64_t rows, int64_t cols) {
  const int64_t shape[] = {rows, cols};
  PD_ASSIGN_OR_RETURN(TensorView t, ckpt.GetWithShape(name, shape));
  return WeightMatrix{t.dtype, static_cast<int32_t>(rows), static_cast<int32_t>(cols),
                      t.bytes.data()};
}

absl::StatusOr<std::vector<float>> GetVector(const Checkpoint& ckpt, const std::string& name,
                                             int64_t n) {
  const int64_t shape[] = {n};
  PD_ASSIGN_OR_RETURN(TensorView t, ckpt.GetWithShape(name, shape));
  std::vector<float> out(n);
  for (int64_t i = 0; i < n; ++i) out[i] = LoadAsFloat(t.bytes.data(), t.dtype, i);
  return out;
}

absl::StatusOr<ModelWeights> LoadWeights(const ModelConfig& c, const Checkpoint& ckpt) {
  ModelWeights w;
  const int64_t q_dim = static_cast<int64_t>(c.num_heads) * c.head_dim;
  const int64_t kv_dim = static_cast<int64_t>(c.num_kv_heads) * c.head_dim;
  PD_ASSIGN_OR_RETURN(w.embed, GetMatrix(ckpt, "model.embed_tokens.weight", c.vocab_size, c.hidden_size));
  for (int l = 0; l < c.num_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    LayerWeights& L = w.layers.emplace_back();
    PD_ASSIGN_OR_RETURN(L.attn_norm, GetVector(ckpt, p + "input_layernorm.weight", c.hidden_size));
    PD_ASSIGN_OR_RETURN(L.wq, GetMatrix(ckpt, p + "self_attn.q_proj.weight", q_dim, c.hidden_size));
    PD_ASSIGN_OR_RETURN(L.wk, GetMatrix(ckpt, p + "self_attn.k_proj.weight", kv_dim, c.hidden_size));
    PD_ASSIGN_OR_RETURN(L.wv, GetMatrix(ckpt, p + "self_attn.v_proj.weight", kv_dim, c.hidden_size));
    PD_ASSIGN_OR_RETURN(L.wo, GetMatrix(ckpt, p + "self_attn.o_proj.weight", c.hidden_size, q_dim));
    if (c.qkv_bias) {
      PD_ASSIGN_OR_RETURN(L.bq, GetVector(ckpt, p + "self_attn.q_proj.bias", q_dim));
      PD_ASSIGN_OR_RETURN(L.bk, GetVector(ckpt, p + "self_attn.k_proj.bias", kv_dim));
      PD_ASSIGN_OR_RETURN(L.bv, GetVector(ckpt, p + "self_attn.v_proj.bias", kv_dim));
    }
    if (c.qk_norm) {
      PD_ASSIGN_OR_RETURN(L.q_norm, GetVector(ckpt, p + "self_attn.q_norm.weight", c.head_dim));
      PD_ASSIGN_OR_RETURN(L.k_norm, GetVector(ckpt, p + "self_attn.k_norm.weight", c.head_dim));
    }
    PD_ASSIGN_OR_RETURN(L.ffn_norm, GetVector(ckpt, p + "post_attention_layernorm.weight", c.hidden_size));
    PD_ASSIGN_OR_RETURN(L.w_gate, GetMatrix(ckpt, p + "mlp.gate_proj.weight", c.intermediate_size, c.hidden_size));
    PD_ASSIGN_OR_RETURN(L.w_up, GetMatrix(ckpt, p + "mlp.up_proj.weight", c.intermediate_size, c.hidden_size));
    PD_ASSIGN_OR_RETURN(L.w_down, GetMatrix(ckpt, p + "mlp.down_proj.weight", c.hidden_size, c.intermediate_size));
  }
  PD_ASSIGN_OR_RETURN(w.final_norm, GetVector(ckpt, "model.norm.weight", c.hidden_size));
  if (c.tie_word_embeddings && !ckpt.Has("lm_head.weight")) {
    w.lm_head = w.embed;
  } else {
    PD_ASSIGN_OR_RETURN(w.lm_head, GetMatrix(ckpt, "lm_head.weight", c.vocab_size, c.hidden_size));
  }
  return w;
}

absl::Status CheckMatrix(const WeightMatrix& m, int64_t rows, int64_t cols, std::string_view name) {
  if (m.data == nullptr || m.rows != rows || m.cols != cols) {
    return absl::InvalidArgumentError(absl::StrCat(
        "weight ", std::string(name), " has shape [", m.rows, ", ", m.cols, "], expected [", rows, ", ", cols, "]"));
  }
  return absl::OkStatus();
}

absl::Status CheckVector(const std::vector<float>& v, int64_t n, std::string_view name) {
  if (static_cast<int64_t>(v.size()) != n) {
    return absl::InvalidArgumentError(absl::StrCat("weight ", std::string(name), " has ", v.size(),
                                                   " elements, expected ", n));
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateWeights(const ModelConfig& c, const ModelWeights& w) {
  const int64_t q_dim = static_cast<int64_t>(c.num_heads) * c.head_dim;
  const int64_t kv_dim = static_cast<int64_t>(c.num_kv_heads) * c.head_dim;
  PD_RETURN_IF_ERROR(CheckMatrix(w.embed, c.vocab_size, c.hidden_size, "embed"));
  PD_RETURN_IF_ERROR(CheckMatrix(w.lm_head, c.vocab_size, c.hidden_size, "lm_head"));
  PD_RETURN_IF_ERROR(CheckVector(w.final_norm, c.hidden_size, "final_norm"));
  if (static_cast<int>(w.layers.size()) != c.num_layers) {
    return absl::InvalidArgumentError(absl::StrCat("model has ", w.layers.size(),
                                                   " layers, config says ", c.num_layers));
  }
  for (const LayerWeights& L : w.layers) {
    PD_RETURN_IF_ERROR(CheckVector(L.attn_norm, c.hidden_size, "attn_norm"));
    PD_RETURN_IF_ERROR(CheckVector(L.ffn_norm, c.hidden_size, "ffn_norm"));
    PD_RETURN_IF_ERROR(CheckMatrix(L.wq, q_dim, c.hidden_size, "q_proj"));
    PD_RETURN_IF_ERROR(CheckMatrix(L.wk, kv_dim, c.hidden_size, "k_proj"));
    PD_RETURN_IF_ERROR(CheckMatrix(L.wv, kv_dim, c.hidden_size, "v_proj"));
    PD_RETURN_IF_ERROR(CheckMatrix(L.wo, c.hidden_size, q_dim, "o_proj"));
    PD_RETURN_IF_ERROR(CheckMatrix(L.w_gate, c.intermediate_size, c.hidden_size, "gate_proj"));
    PD_RETURN_IF_ERROR(CheckMatrix(L.w_up, c.intermediate_size, c.hidden_size, "up_proj"));
    PD_RETURN_IF_ERROR(CheckMatrix(L.w_down, c.hidden_size, c.intermediate_size, "down_proj"));
    if (c.qkv_bias) {
      PD_RETURN_IF_ERROR(CheckVector(L.bq, q_dim, "q_proj.bias"));
      PD_RETURN_IF_ERROR(CheckVector(L.bk, kv_dim, "k_proj.bias"));
      PD_RETURN_IF_ERROR(CheckVector(L.bv, kv_dim, "v_proj.bias"));
    }
    if (c.qk_norm) {
      PD_RETURN_IF_ERROR(CheckVector(L.q_norm, c.head_dim, "q_norm"));
      PD_RETURN_IF_ERROR(CheckVector(L.k_norm, c.head_dim, "k_norm"));
    }
  }
  return absl::OkStatus();
}

Model::~Model() = default;

absl::StatusOr<std::shared_ptr<const Model>> Model::FromInfo(
    std::shared_ptr<const ModelInfo> info, ModelWeights weights,
    std::vector<std::vector<std::byte>> owned_storage) {
  return Assemble(std::move(info), std::move(weights), std::move(owned_storage),
                  nullptr);
}

absl::StatusOr<std::shared_ptr<const Model>> Model::FromParts(
    std::string name, ModelConfig config, ModelWeights weights,
    std::vector<std::vector<std::byte>> owned_storage, std::unique_ptr<Tokenizer> tokenizer) {
  PD_ASSIGN_OR_RETURN(
      std::shared_ptr<const ModelInfo> info,
      ModelInfo::FromParts({.name = std::move(name),
                            .config = std::move(config),
                            .tokenizer = std::move(tokenizer)}));
  return FromInfo(std::move(info), std::move(weights),
                  std::move(owned_storage));
}

absl::StatusOr<std::shared_ptr<const Model>> Model::Assemble(
    std::shared_ptr<const ModelInfo> info, ModelWeights weights,
    std::vector<std::vector<std::byte>> owned_storage,
    std::unique_ptr<Checkpoint> checkpoint) {
  PD_RETURN_IF_ERROR(ValidateWeights(info->config(), weights));
  std::shared_ptr<Model> m(new Model());
  m->info_ = std::move(info);
  m->weights_ = std::move(weights);
  m->owned_storage_ = std::move(owned_storage);
  m->checkpoint_ = std::move(checkpoint);
  return std::shared_ptr<const Model>(std::move(m));
}

absl::StatusOr<std::shared_ptr<const Model>> Model::Load(std::string_view spec) {
  PD_ASSIGN_OR_RETURN(std::shared_ptr<const ModelInfo> info,
                      LoadModelInfo(spec));
  if (spec.starts_with("builtin:")) return MakeBuiltinModel(std::move(info));
  PD_ASSIGN_OR_RETURN(std::unique_ptr<Checkpoint> ckpt,
                      Checkpoint::Open(std::filesystem::path(spec)));
  PD_ASSIGN_OR_RETURN(ModelWeights weights, LoadWeights(info->config(), *ckpt));
  return Assemble(std::move(info), std::move(weights), {}, std::move(ckpt));
}

}  // namespace pdserve
