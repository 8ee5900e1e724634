// llama2.c checkpoints (a `.bin` of fp32 weights and a `tok*.bin`
// vocabulary): a converter to a Hugging Face model directory (config.json,
// generation_config.json, model.safetensors, tokenizer.json,
// tokenizer_config.json), and the ModelInfo of such a pair read from the
// checkpoint's header alone. The wq/wk rows are permuted from llama2.c's
// adjacent-pair RoPE to HF's half-rotation layout, so the converted
// directory runs through the normal loading path and also loads in
// `transformers`.
#ifndef PDSERVE_ENGINE_MODEL_FILES_LLAMA2C_H_
#define PDSERVE_ENGINE_MODEL_FILES_LLAMA2C_H_

#include <filesystem>
#include <memory>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/model_files/model_info.h"

namespace pdserve {

// Writes the directory `out_dir` (created if needed). Malformed or truncated
// inputs are INVALID_ARGUMENT naming the file and what was wrong.
absl::Status ConvertLlama2cToHf(const std::filesystem::path& checkpoint_bin,
                                const std::filesystem::path& tokenizer_bin,
                                const std::filesystem::path& out_dir);

// The ModelInfo of the directory ConvertLlama2cToHf would write (same
// config, generation config and tokenizer; no chat template), named after
// the checkpoint's file stem. Reads the checkpoint's 28-byte header and no
// weights: a checkpoint truncated after its header still gives its info,
// though it would not convert. NOT_FOUND when a file is missing;
// INVALID_ARGUMENT for a bad header or vocabulary, naming the file.
absl::StatusOr<std::shared_ptr<const ModelInfo>> LoadLlama2cModelInfo(
    const std::filesystem::path& checkpoint_bin,
    const std::filesystem::path& tokenizer_bin);

}  // namespace pdserve

#endif  // PDSERVE_ENGINE_MODEL_FILES_LLAMA2C_H_
