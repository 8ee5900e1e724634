// Model: a loaded Llama-family model — its config, its weights in host
// memory, and its tokenizer — ready to be handed to a ModelRunner backend.
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
#include "engine/model_config.h"
#include "engine/tokenizer.h"

namespace pdserve {

class Checkpoint;

// A read-only weight matrix [rows][cols]; `data` is not necessarily aligned.
struct WeightMatrix {
  DType dtype = DType::kF32;
  int32_t rows = 0;
  int32_t cols = 0;
  const std::byte* data = nullptr;

  size_t size_bytes() const { return static_cast<size_t>(rows) * cols * DTypeSize(dtype); }
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
  // a 110M Llama shape, for benchmarks) or a Hugging Face model directory.
  static absl::StatusOr<std::shared_ptr<const Model>> Load(std::string_view spec);
  // For builtin models and tests: takes ownership of the weight bytes.
  static absl::StatusOr<std::shared_ptr<const Model>> FromParts(
      std::string name, ModelConfig config, ModelWeights weights,
      std::vector<std::vector<std::byte>> owned_storage,
      std::unique_ptr<Tokenizer> tokenizer);
  ~Model();

  const std::string& name() const { return name_; }
  const ModelConfig& config() const { return config_; }
  const ModelWeights& weights() const { return weights_; }
  // nullptr when the directory has no tokenizer.json (then only token ids
  // can be used).
  const Tokenizer* tokenizer() const { return tokenizer_.get(); }
  // EOS ids from config.json, generation_config.json and the tokenizer.
  const std::vector<int32_t>& eos_token_ids() const { return eos_token_ids_; }
  std::optional<int32_t> bos_token_id() const { return config_.bos_token_id; }

 private:
  Model() = default;
  static absl::StatusOr<std::shared_ptr<const Model>> Assemble(
      std::string name, ModelConfig config, ModelWeights weights,
      std::vector<std::vector<std::byte>> owned_storage,
      std::unique_ptr<Checkpoint> checkpoint, std::unique_ptr<Tokenizer> tokenizer);
  std::string name_;
  ModelConfig config_;
  ModelWeights weights_;
  std::vector<int32_t> eos_token_ids_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<Checkpoint> checkpoint_;          // Mapped weights.
  std::vector<std::vector<std::byte>> owned_storage_;  // Or owned ones.
};

// Weight shapes checked against the config: INVALID_ARGUMENT naming the
// tensor when a shape differs.
absl::Status ValidateWeights(const ModelConfig& config, const ModelWeights& weights);

}  // namespace pdserve

#endif  // PDSERVE_ENGINE_MODEL_H_
