// Tokenizer: text <-> token ids for the model families pdserve serves.
//
// Reads a Hugging Face `tokenizer.json` (+ optional `tokenizer_config.json`):
//   - byte-level BPE with GPT-2 / Llama 3 / Qwen2 style pre-tokenization,
//   - SentencePiece-style BPE with byte fallback (Llama 2, Mistral),
// and the vocabulary of a GGUF file (`tokenizer.ggml.*` keys), plus a plain
// byte-level tokenizer for `builtin:tiny`. Added/special tokens are matched
// in the input text before the model's own splitting, as in HF `tokenizers`.
//
// Thread-safety: a Tokenizer is immutable after construction; all const
// methods may be called concurrently. IncrementalDetokenizer is not
// thread-safe (one per stream).
#ifndef PDSERVE_ENGINE_TOKENIZER_H_
#define PDSERVE_ENGINE_TOKENIZER_H_

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"

namespace pdserve {

class TokenizerImpl;

class Tokenizer {
 public:
  // Loads `tokenizer_json`; `tokenizer_config_json` may name a file that does
  // not exist (then BOS/EOS and add_bos come from tokenizer.json alone).
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromHfFiles(
      const std::filesystem::path& tokenizer_json,
      const std::filesystem::path& tokenizer_config_json);
  // Same, from the files' contents; `tokenizer_config_json` may be empty.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromHfJson(
      std::string_view tokenizer_json, std::string_view tokenizer_config_json);
  // Reads the vocabulary stored in a GGUF file's metadata.
  static absl::StatusOr<std::unique_ptr<Tokenizer>> FromGguf(
      const std::filesystem::path& gguf_path);
  // The builtin models' tokenizer: ids 0..255 are the bytes 0..255, 256 is
  // BOS "<s>", 257 is EOS "</s>", and ids 258..vocab_size-1 (if any) are
  // special padding tokens "<extra_ID>" that text never encodes to (as the
  // reserved tokens of real vocabularies). vocab_size must be >= 258.
  static std::unique_ptr<Tokenizer> MakeByteLevel(int32_t vocab_size = 258);

  ~Tokenizer();
  Tokenizer(const Tokenizer&) = delete;
  Tokenizer& operator=(const Tokenizer&) = delete;

  // Text to ids. `add_special_tokens` adds what the tokenizer's post-processor
  // / config asks for (usually BOS). INVALID_ARGUMENT if `text` is not valid
  // UTF-8.
  absl::StatusOr<std::vector<int32_t>> Encode(std::string_view text,
                                              bool add_special_tokens) const;

  // Ids to text. INVALID_ARGUMENT for an id outside [0, vocab_size()).
  absl::StatusOr<std::string> Decode(std::span<const int32_t> ids,
                                     bool skip_special_tokens) const;

  // Number of ids (the largest id + 1, added tokens included).
  int32_t vocab_size() const;
  std::optional<int32_t> bos_token_id() const;
  // EOS ids known to the tokenizer files (may be empty).
  std::vector<int32_t> eos_token_ids() const;
  // True for special / control tokens (BOS, EOS, <unk>, added special=true).
  bool IsSpecial(int32_t id) const;
  // The vocabulary string of `id` as stored (e.g. "▁the", "Ġthe", "<0x0A>");
  // empty for an out-of-range id.
  std::string_view TokenText(int32_t id) const;

 private:
  friend class IncrementalDetokenizer;  // Decodes raw bytes of id windows.
  explicit Tokenizer(std::unique_ptr<TokenizerImpl> impl);
  std::unique_ptr<TokenizerImpl> impl_;
};

// Turns a stream of ids into text deltas for streaming. Never emits an
// incomplete UTF-8 character: bytes of a character split across tokens are
// held back until it is complete. The concatenation of all deltas plus
// Flush() equals tokenizer.Decode(all ids, skip_special_tokens).
class IncrementalDetokenizer {
 public:
  IncrementalDetokenizer(const Tokenizer& tokenizer, bool skip_special_tokens);
  // Appends one id; returns the newly completed text (possibly empty).
  absl::StatusOr<std::string> Append(int32_t id);
  // Returns whatever is still held back (incomplete UTF-8 becomes U+FFFD).
  std::string Flush();

 private:
  const Tokenizer& tokenizer_;
  const bool skip_special_tokens_;
  std::vector<int32_t> ids_;
  size_t prefix_offset_ = 0;  // ids_[prefix_offset_, read_offset_) give context.
  size_t read_offset_ = 0;    // ids_ before this have been emitted.
};

}  // namespace pdserve

#endif  // PDSERVE_ENGINE_TOKENIZER_H_
