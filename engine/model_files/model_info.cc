#include "engine/model_files/model_info.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace pdserve {
namespace {

namespace fs = std::filesystem;

absl::StatusOr<std::string> ReadSmallFile(const fs::path& path) {
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  if (ec) {
    return absl::NotFoundError(
        absl::StrCat("cannot read ", path.string(), ": ", ec.message()));
  }
  if (size > (64u << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path.string(), " is too large (", size, " bytes)"));
  }
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  if (!in.good() && !in.eof()) {
    return absl::DataLossError(absl::StrCat("error reading ", path.string()));
  }
  return text.str();
}

void AddUnique(std::vector<int32_t>& ids, int32_t id) {
  if (std::find(ids.begin(), ids.end(), id) == ids.end()) ids.push_back(id);
}

absl::StatusOr<ModelInfo::Parts> ReadModelDirectory(const fs::path& dir) {
  ModelInfo::Parts parts;
  fs::path canonical = fs::absolute(dir).lexically_normal();
  if (canonical.filename().empty())
    canonical = canonical.parent_path();  // "dir/"
  parts.name = canonical.filename().string();
  PD_ASSIGN_OR_RETURN(std::string config_text,
                      ReadSmallFile(dir / "config.json"));
  PD_ASSIGN_OR_RETURN(parts.config, ParseHfConfig(config_text));
  if (fs::exists(dir / "generation_config.json")) {
    PD_ASSIGN_OR_RETURN(std::string text,
                        ReadSmallFile(dir / "generation_config.json"));
    PD_ASSIGN_OR_RETURN(parts.generation_config, ParseGenerationConfig(text));
  }
  if (fs::exists(dir / "tokenizer.json")) {
    PD_ASSIGN_OR_RETURN(parts.tokenizer,
                        Tokenizer::FromHfFiles(dir / "tokenizer.json",
                                               dir / "tokenizer_config.json"));
  }
  PD_ASSIGN_OR_RETURN(parts.chat_template, LoadChatTemplate(dir.string()));
  return parts;
}

}  // namespace

ModelInfo::ModelInfo(Parts parts)
    : name_(std::move(parts.name)),
      config_(std::move(parts.config)),
      generation_config_(std::move(parts.generation_config)),
      tokenizer_(std::move(parts.tokenizer)),
      chat_template_(std::move(parts.chat_template)) {}

absl::StatusOr<std::shared_ptr<const ModelInfo>> ModelInfo::FromParts(
    Parts parts) {
  PD_RETURN_IF_ERROR(parts.config.Validate());
  PD_RETURN_IF_ERROR(
      ApplyGenerationConfig(parts.generation_config, parts.config));
  std::shared_ptr<ModelInfo> info(new ModelInfo(std::move(parts)));
  ModelConfig& config = info->config_;
  for (int32_t id : config.eos_token_ids) AddUnique(info->eos_token_ids_, id);
  if (const Tokenizer* tokenizer = info->tokenizer_.get()) {
    if (tokenizer->vocab_size() > config.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("tokenizer has ", tokenizer->vocab_size(),
                       " tokens but the model only ", config.vocab_size));
    }
    for (int32_t id : tokenizer->eos_token_ids()) {
      AddUnique(info->eos_token_ids_, id);
    }
    if (!config.bos_token_id) config.bos_token_id = tokenizer->bos_token_id();
  }
  for (int32_t id : info->eos_token_ids_) {
    if (id < 0 || id >= config.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("EOS id ", id, " outside the vocabulary"));
    }
  }
  return std::shared_ptr<const ModelInfo>(std::move(info));
}

ModelConfig TinyModelConfig() {
  ModelConfig c;
  c.architecture = "LlamaForCausalLM";
  c.vocab_size = 258;
  c.hidden_size = 128;
  c.intermediate_size = 384;
  c.num_layers = 4;
  c.num_heads = 4;
  c.num_kv_heads = 2;
  c.head_dim = 32;
  c.max_position_embeddings = 4096;
  c.rms_norm_eps = 1e-5f;
  c.rope_theta = 10000.0f;
  c.torch_dtype = DType::kF32;
  c.bos_token_id = 256;
  c.eos_token_ids = {257};
  return c;
}

ModelConfig Llama110MConfig() {
  ModelConfig c = TinyModelConfig();
  c.vocab_size = 32000;
  c.hidden_size = 768;
  c.intermediate_size = 2048;
  c.num_layers = 12;
  c.num_heads = 12;
  c.num_kv_heads = 4;
  c.head_dim = 64;
  c.max_position_embeddings = 16384;
  c.torch_dtype = DType::kBF16;
  return c;
}

absl::StatusOr<std::shared_ptr<const ModelInfo>> LoadModelInfo(
    std::string_view spec) {
  if (spec.starts_with("builtin:")) {
    ModelInfo::Parts parts;
    if (spec == "builtin:tiny") {
      parts.config = TinyModelConfig();
    } else if (spec == "builtin:llama-110m") {
      parts.config = Llama110MConfig();
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown builtin model '", std::string(spec),
                       "' (known: builtin:tiny, builtin:llama-110m)"));
    }
    parts.name = std::string(spec);
    parts.tokenizer = Tokenizer::MakeByteLevel(parts.config.vocab_size);
    return ModelInfo::FromParts(std::move(parts));
  }
  const fs::path dir(spec);
  if (!fs::is_directory(dir)) {
    return absl::NotFoundError(absl::StrCat(
        "model directory '", std::string(spec), "' does not exist"));
  }
  PD_ASSIGN_OR_RETURN(ModelInfo::Parts parts, ReadModelDirectory(dir));
  return ModelInfo::FromParts(std::move(parts));
}

}  // namespace pdserve
