// Model: a loaded Llama-family model — its ModelInfo (config, generation
// config, tokenizer, chat template; engine/model_files/model_info.h) and its
// weights in host memory — ready to be handed to a ModelRunner backend.
//
// Weights stay in the checkpoint's dtype (fp32, fp16 or bf16; row-major
// [out_features][in_features] as in Hugging Face) and, for a model directory,
// point into the memory-mapped safetensors files, which the Model keeps open.
// Norm weights and biases are converted to fp32 at load.
//
// Thread-safety: immutable after loading; share it with shared_ptr<const>.
#ifndef PDSERVE_ENGINE_MODEL_H_
#define PDSERVE_ENGINE_MODEL_H_

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "engine/dtype.h"
#include "engine/model_files/model_config.h"
#include "engine/model_files/model_info.h"
#include "engine/tokenizer.h"

namespace pdserve {

class Checkpoint;

// A read-only weight matrix [rows][cols]; `data` is not necessarily aligned.
struct WeightMatrix {
  DType dtype = DType::kF32;
  int32_t rows = 0;
  int32_t cols = 0;
  const std::byte* data = nullptr;

  size_t size_bytes() const { return MatrixBytes(dtype, rows, cols); }
};

struct LayerWeights {
  std::vector<float> attn_norm;  // [hidden]
  WeightMatrix wq, wk, wv, wo;   // q: [heads*head_dim][hidden], o: [hidden][heads*head_dim]
  std::vector<float> bq, bk, bv; // Empty unless config.qkv_bias.
  std::vector<float> q_norm, k_norm;  // [head_dim]; empty unless config.qk_norm.
  std::vector<float> ffn_norm;   // [hidden]
  WeightMatrix w_gate, w_up;     // [intermediate][hidden]
  WeightMatrix w_down;           // [hidden][intermediate]
};

struct ModelWeights {
  WeightMatrix embed;            // [vocab][hidden]
  std::vector<LayerWeights> layers;
  std::vector<float> final_norm; // [hidden]
  WeightMatrix lm_head;          // [vocab][hidden]; == embed when tied.
};

class Model {
 public:
  // `spec` is "builtin:tiny", "builtin:llama-110m" (random bf16 weights of
  // a 110M Llama shape, for benchmarks) or a Hugging Face model directory:
  // LoadModelInfo(spec), then the weights.
  static absl::StatusOr<std::shared_ptr<const Model>> Load(std::string_view spec);
  // For builtin models and tests: takes ownership of the weight bytes.
  static absl::StatusOr<std::shared_ptr<const Model>> FromInfo(
      std::shared_ptr<const ModelInfo> info, ModelWeights weights,
      std::vector<std::vector<std::byte>> owned_storage);
  // Same, with a ModelInfo made of `config` and `tokenizer` (may be null).
  static absl::StatusOr<std::shared_ptr<const Model>> FromParts(
      std::string name, ModelConfig config, ModelWeights weights,
      std::vector<std::vector<std::byte>> owned_storage,
      std::unique_ptr<Tokenizer> tokenizer);
  ~Model();

  // Everything about the model but its weights; never null.
  const std::shared_ptr<const ModelInfo>& info() const { return info_; }
  const std::string& name() const { return info_->name(); }
  const ModelConfig& config() const { return info_->config(); }
  const ModelWeights& weights() const { return weights_; }
  // nullptr when the directory has no tokenizer.json (then only token ids
  // can be used).
  const Tokenizer* tokenizer() const { return info_->tokenizer(); }
  // EOS ids from config.json, generation_config.json and the tokenizer.
  const std::vector<int32_t>& eos_token_ids() const {
    return info_->eos_token_ids();
  }
  std::optional<int32_t> bos_token_id() const { return info_->bos_token_id(); }

 private:
  Model() = default;
  static absl::StatusOr<std::shared_ptr<const Model>> Assemble(
      std::shared_ptr<const ModelInfo> info, ModelWeights weights,
      std::vector<std::vector<std::byte>> owned_storage,
      std::unique_ptr<Checkpoint> checkpoint);
  std::shared_ptr<const ModelInfo> info_;
  ModelWeights weights_;
  std::unique_ptr<Checkpoint> checkpoint_;          // Mapped weights.
  std::vector<std::vector<std::byte>> owned_storage_;  // Or owned ones.
};

// Weight shapes checked against the config: INVALID_ARGUMENT naming the
// tensor when a shape differs.
absl::Status ValidateWeights(const ModelConfig& config, const ModelWeights& weights);

}  // namespace pdserve

#endif  // PDSERVE_ENGINE_MODEL_H_
