// Converter from llama2.c checkpoints (a `.bin` of fp32 weights and a
// `tok*.bin` vocabulary) to a Hugging Face model directory: config.json,
// generation_config.json, model.safetensors, tokenizer.json,
// tokenizer_config.json. The wq/wk rows are permuted from llama2.c's
// adjacent-pair RoPE to HF's half-rotation layout, so the result runs through
// the normal loading path and also loads in `transformers`.
#ifndef PDSERVE_ENGINE_LLAMA2C_H_
#define PDSERVE_ENGINE_LLAMA2C_H_

#include <filesystem>

#include "absl/status/status.h"

namespace pdserve {

// Writes the directory `out_dir` (created if needed). Malformed or truncated
// inputs are INVALID_ARGUMENT naming the file and what was wrong.
absl::Status ConvertLlama2cToHf(const std::filesystem::path& checkpoint_bin,
                                const std::filesystem::path& tokenizer_bin,
                                const std::filesystem::path& out_dir);

}  // namespace pdserve

#endif  // PDSERVE_ENGINE_LLAMA2C_H_
