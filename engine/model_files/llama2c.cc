#include "engine/model_files/llama2c.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "engine/model_files/model_config.h"
#include "engine/model_files/safetensors.h"
#include "engine/tokenizer.h"
#include "engine/unicode.h"
#include "nlohmann/json.hpp"

namespace pdserve {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

constexpr char kSpaceMarker[] = "\xE2\x96\x81";  // "▁"

absl::StatusOr<std::string> ReadBinary(const fs::path& path, size_t max_bytes) {
  std::error_code ec;
  const auto size = fs::file_size(path, ec);
  if (ec)
    return absl::NotFoundError(
        absl::StrCat("cannot read ", path.string(), ": ", ec.message()));
  if (size > max_bytes) {
    return absl::InvalidArgumentError(
        absl::StrCat(path.string(), " is larger than ", max_bytes, " bytes"));
  }
  std::ifstream in(path, std::ios::binary);
  std::string data(size, '\0');
  in.read(data.data(), static_cast<std::streamsize>(size));
  if (!in)
    return absl::DataLossError(absl::StrCat("error reading ", path.string()));
  return data;
}

struct Header {
  int32_t dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len;
};

// llama2.c's control tokens: 0 <unk>, 1 <s>, 2 </s>.
constexpr int32_t kBosId = 1;
constexpr int32_t kEosId = 2;

// One row-major fp32 tensor cut from the checkpoint.
struct Tensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> data;
};

// Reorders the rows of a q/k projection [heads * head_dim, dim] from
// llama2.c's adjacent RoPE pairs (2i, 2i+1) to Hugging Face's halves
// (i, i + head_dim/2): within a head, old row 2i + j becomes j*half + i.
std::vector<float> PermuteForHalfRotation(const float* w, int heads,
                                          int head_dim, int cols) {
  std::vector<float> out(static_cast<size_t>(heads) * head_dim * cols);
  const int half = head_dim / 2;
  for (int h = 0; h < heads; ++h) {
    for (int i = 0; i < half; ++i) {
      for (int j = 0; j < 2; ++j) {
        const size_t src = static_cast<size_t>(h * head_dim + 2 * i + j) * cols;
        const size_t dst =
            static_cast<size_t>(h * head_dim + j * half + i) * cols;
        std::memcpy(&out[dst], w + src, sizeof(float) * cols);
      }
    }
  }
  return out;
}

// The config the 28-byte header at the start of `bytes` describes (which
// must hold at least the header): INVALID_ARGUMENT naming `path` for a field
// out of range or a model the engine cannot run.
absl::StatusOr<ModelConfig> ConfigFromHeader(std::string_view bytes,
                                             const fs::path& path, Header& h) {
  if (bytes.size() < sizeof(Header)) {
    return absl::InvalidArgumentError(
        absl::StrCat(path.string(), ": too short for a llama2.c header"));
  }
  std::memcpy(&h, bytes.data(), sizeof(h));
  const int64_t vocab =
      h.vocab_size < 0 ? -static_cast<int64_t>(h.vocab_size) : h.vocab_size;
  for (auto [v, name] : {std::pair{h.dim, "dim"},
                         {h.hidden_dim, "hidden_dim"},
                         {h.n_layers, "n_layers"},
                         {h.n_heads, "n_heads"},
                         {h.n_kv_heads, "n_kv_heads"},
                         {h.seq_len, "seq_len"}}) {
    if (v <= 0 || v > (1 << 20)) {
      return absl::InvalidArgumentError(
          absl::StrCat(path.string(), ": header field ", name, " = ", v,
                       " is out of range"));
    }
  }
  if (vocab == 0 || h.dim % h.n_heads != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(path.string(), ": inconsistent header (dim ", h.dim,
                     ", heads ", h.n_heads, ", vocab ", h.vocab_size, ")"));
  }
  ModelConfig config;
  config.architecture = "LlamaForCausalLM";
  config.vocab_size = static_cast<int>(std::min<int64_t>(vocab, INT32_MAX));
  config.hidden_size = h.dim;
  config.intermediate_size = h.hidden_dim;
  config.num_layers = h.n_layers;
  config.num_heads = h.n_heads;
  config.num_kv_heads = h.n_kv_heads;
  config.head_dim = h.dim / h.n_heads;
  config.max_position_embeddings = h.seq_len;
  config.rms_norm_eps = 1e-5f;
  config.rope_theta = 10000.0f;
  config.tie_word_embeddings = h.vocab_size > 0;
  config.torch_dtype = DType::kF32;
  config.bos_token_id = kBosId;
  config.eos_token_ids = {kEosId};
  // Validate() bounds every dimension (hidden <= 2^16, layers <= 1024, ...),
  // so the size arithmetic of ReadCheckpoint cannot overflow.
  if (absl::Status s = config.Validate(); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        path.string(), ": header describes an unusable model: ", s.message()));
  }
  return config;
}

absl::StatusOr<std::vector<Tensor>> ReadCheckpoint(const std::string& bytes,
                                                   const fs::path& path,
                                                   ModelConfig& config) {
  Header h;
  PD_ASSIGN_OR_RETURN(config, ConfigFromHeader(bytes, path, h));
  const bool shared = config.tie_word_embeddings;
  const int64_t vocab = config.vocab_size;
  const int64_t dim = h.dim, hidden = h.hidden_dim, layers = h.n_layers;
  const int head_dim = config.head_dim;
  const int64_t kv_dim = static_cast<int64_t>(head_dim) * h.n_kv_heads;
  const int64_t rope = static_cast<int64_t>(h.seq_len) * head_dim / 2;
  const int64_t floats =
      vocab * dim +
      layers * (2 * dim + 2 * dim * dim + 2 * kv_dim * dim + 3 * hidden * dim) +
      dim + 2 * rope + (shared ? 0 : vocab * dim);
  // llama2.c's (version 0) export writes exactly these tensors; any other
  // size means the header does not describe this file.
  const uint64_t need = sizeof(Header) + static_cast<uint64_t>(floats) * 4;
  if (bytes.size() != need) {
    return absl::InvalidArgumentError(
        absl::StrCat(path.string(), " is ", bytes.size(),
                     " bytes; its header implies ", need));
  }

  const float* p =
      reinterpret_cast<const float*>(bytes.data() + sizeof(Header));
  auto take = [&p](int64_t n) {
    const float* at = p;
    p += n;
    return at;
  };
  std::vector<Tensor> out;
  auto add = [&out](std::string name, std::vector<int64_t> shape,
                    const float* data) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    out.push_back({std::move(name), std::move(shape),
                   std::vector<float>(data, data + n)});
  };
  auto per_layer = [&](const char* suffix, std::vector<int64_t> shape,
                       bool permute_heads = false, int heads = 0) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    const float* all = take(layers * n);
    for (int64_t l = 0; l < layers; ++l) {
      const std::string name = absl::StrCat("model.layers.", l, ".", suffix);
      if (permute_heads) {
        out.push_back({name, shape,
                       PermuteForHalfRotation(all + l * n, heads, head_dim,
                                              static_cast<int>(dim))});
      } else {
        add(name, shape, all + l * n);
      }
    }
  };
  const float* embed = take(vocab * dim);
  add("model.embed_tokens.weight", {vocab, dim}, embed);
  per_layer("input_layernorm.weight", {dim});
  per_layer("self_attn.q_proj.weight", {dim, dim}, true, h.n_heads);
  per_layer("self_attn.k_proj.weight", {kv_dim, dim}, true, h.n_kv_heads);
  per_layer("self_attn.v_proj.weight", {kv_dim, dim});
  per_layer("self_attn.o_proj.weight", {dim, dim});
  per_layer("post_attention_layernorm.weight", {dim});
  per_layer("mlp.gate_proj.weight", {hidden, dim});  // w1
  per_layer("mlp.down_proj.weight", {dim, hidden});  // w2
  per_layer("mlp.up_proj.weight", {hidden, dim});    // w3
  add("model.norm.weight", {dim}, take(dim));
  take(2 * rope);  // Precomputed RoPE tables: recomputed at run time.
  if (!shared) add("lm_head.weight", {vocab, dim}, take(vocab * dim));
  return out;
}

struct Piece {
  std::string text;
  float score;
};

absl::StatusOr<std::vector<Piece>> ReadVocabulary(const std::string& bytes,
                                                  const fs::path& path,
                                                  int vocab_size) {
  auto bad = [&](std::string_view what) {
    return absl::InvalidArgumentError(
        absl::StrCat(path.string(), ": ", std::string(what)));
  };
  size_t pos = 0;
  auto read = [&](void* dst, size_t n) {
    if (bytes.size() - pos < n) return false;
    std::memcpy(dst, bytes.data() + pos, n);
    pos += n;
    return true;
  };
  if (vocab_size < 3) return bad("needs at least <unk>, <s> and </s>");
  int32_t max_len;
  if (!read(&max_len, 4) || max_len <= 0 || max_len > 4096)
    return bad("bad max_token_length");
  std::vector<Piece> pieces(vocab_size);
  for (int i = 0; i < vocab_size; ++i) {
    int32_t len;
    if (!read(&pieces[i].score, 4) || !read(&len, 4))
      return bad(absl::StrCat("truncated at token ", i));
    if (len < 0 || len > max_len)
      return bad(absl::StrCat("token ", i, " has length ", len));
    pieces[i].text.resize(len);
    if (!read(pieces[i].text.data(), len))
      return bad(absl::StrCat("truncated at token ", i));
    if (!unicode::IsValidUtf8(pieces[i].text))
      return bad(absl::StrCat("token ", i, " is not UTF-8"));
  }
  // llama2.c stores the control tokens with newlines around them.
  pieces[0].text = "<unk>";
  pieces[1].text = "<s>";
  pieces[2].text = "</s>";
  return pieces;
}

// The vocabulary's pieces as tokenizer.json spells them: "▁" for spaces in
// the ordinary pieces (ids 3.. ; 0-2 are <unk>, <s>, </s>). A piece that
// appears twice cannot map to one token id: INVALID_ARGUMENT.
absl::StatusOr<std::vector<std::string>> PieceTexts(
    const std::vector<Piece>& pieces, const fs::path& path) {
  std::vector<std::string> texts(pieces.size());
  for (size_t i = 0; i < pieces.size(); ++i) {
    std::string t = pieces[i].text;
    if (i >= 3) {
      size_t at;
      while ((at = t.find(' ')) != std::string::npos)
        t.replace(at, 1, kSpaceMarker);
    }
    texts[i] = std::move(t);
  }
  std::set<std::string_view> seen;
  for (size_t i = 0; i < texts.size(); ++i) {
    if (!seen.insert(texts[i]).second) {
      return absl::InvalidArgumentError(absl::StrCat(
          path.string(), ": token ", i, " repeats the piece '", texts[i], "'"));
    }
  }
  return texts;
}

// A tokenizer.json as transformers writes it for a Llama 2 SentencePiece
// model (transformers 5 converting tokenizer.model with this converter's
// tokenizer_config.json: legacy Metaspace, BOS post-processor, no model
// unk_token since byte fallback covers every byte). The merges are derived
// from the vocabulary the way transformers' SentencePiece converter derives
// them: every split of a piece into two vocabulary pieces, ordered by the
// merged piece's score (highest first), then its id, then the split point
// left to right. The three control tokens are added tokens, never merge
// inputs or outputs.
//
// Score order is what SentencePiece's BPE itself applies. transformers 5
// orders by id instead; the two agree for tok512.bin (the file is then
// identical to transformers' own conversion), but not for Llama 2's 32000
// pieces, whose whitespace runs ("▁▁", id 259) score -1e9: by id they merge
// first and "a  b" no longer encodes as SentencePiece encodes it. By score,
// 5000 sampled texts encode exactly as SentencePiece does.
std::string TokenizerJson(const std::vector<Piece>& pieces,
                          const std::vector<std::string>& texts) {
  std::map<std::string_view, int> ids;
  for (size_t i = 0; i < texts.size(); ++i)
    ids.emplace(texts[i], static_cast<int>(i));
  struct Merge {
    float score;
    int merged;
    size_t split;  // Byte offset of the split within the merged piece.
    int left, right;
  };
  std::vector<Merge> merges;
  for (size_t i = 3; i < texts.size(); ++i) {
    const std::string_view t = texts[i];
    std::vector<size_t> offsets;
    unicode::DecodeUtf8(t, &offsets);
    for (size_t k = 1; k + 1 < offsets.size(); ++k) {
      auto l = ids.find(t.substr(0, offsets[k]));
      auto r = ids.find(t.substr(offsets[k]));
      if (l != ids.end() && r != ids.end() && l->second >= 3 &&
          r->second >= 3) {
        merges.push_back({pieces[i].score, static_cast<int>(i), offsets[k],
                          l->second, r->second});
      }
    }
  }
  std::sort(merges.begin(), merges.end(), [](const Merge& a, const Merge& b) {
    if (a.score != b.score) return a.score > b.score;
    return std::tie(a.merged, a.split) < std::tie(b.merged, b.split);
  });

  Json vocab = Json::object();
  for (size_t i = 0; i < texts.size(); ++i) vocab[texts[i]] = i;
  Json merge_list = Json::array();
  for (const Merge& m : merges)
    merge_list.push_back({texts[m.left], texts[m.right]});
  Json added = Json::array();
  for (int i = 0; i < 3; ++i) {
    added.push_back({{"id", i},
                     {"content", texts[i]},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  }
  Json j = {
      {"version", "1.0"},
      {"truncation", nullptr},
      {"padding", nullptr},
      {"added_tokens", added},
      {"normalizer", nullptr},
      {"pre_tokenizer",
       {{"type", "Metaspace"},
        {"replacement", kSpaceMarker},
        {"prepend_scheme", "always"},
        {"split", false}}},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single",
         {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
          {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
        {"pair",
         {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
          {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
          {{"SpecialToken", {{"id", "<s>"}, {"type_id", 1}}}},
          {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}}},
        {"special_tokens",
         {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}}}}},
      {"decoder",
       {{"type", "Sequence"},
        {"decoders",
         {{{"type", "Replace"},
           {"pattern", {{"String", kSpaceMarker}}},
           {"content", " "}},
          {{"type", "ByteFallback"}},
          {{"type", "Fuse"}},
          {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}}},
      {"model",
       {{"type", "BPE"},
        {"dropout", nullptr},
        {"unk_token", nullptr},
        {"continuing_subword_prefix", nullptr},
        {"end_of_word_suffix", nullptr},
        {"fuse_unk", true},
        {"byte_fallback", true},
        {"ignore_merges", false},
        {"vocab", vocab},
        {"merges", merge_list}}},
  };
  return j.dump(2) + "\n";
}

absl::Status WriteText(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  out.close();
  if (!out)
    return absl::PermissionDeniedError(
        absl::StrCat("cannot write ", path.string()));
  return absl::OkStatus();
}

// What a converted directory's tokenizer files hold.
struct TokenizerFiles {
  std::string tokenizer_json;
  std::string tokenizer_config_json;
};

absl::StatusOr<TokenizerFiles> ReadTokenizerFiles(const fs::path& tokenizer_bin,
                                                  const ModelConfig& config) {
  PD_ASSIGN_OR_RETURN(std::string tok,
                      ReadBinary(tokenizer_bin, size_t{256} << 20));
  PD_ASSIGN_OR_RETURN(std::vector<Piece> pieces,
                      ReadVocabulary(tok, tokenizer_bin, config.vocab_size));
  PD_ASSIGN_OR_RETURN(std::vector<std::string> texts,
                      PieceTexts(pieces, tokenizer_bin));
  const Json tokenizer_config = {
      {"tokenizer_class", "LlamaTokenizer"},
      {"bos_token", "<s>"},
      {"eos_token", "</s>"},
      {"unk_token", "<unk>"},
      {"add_bos_token", true},
      {"add_eos_token", false},
      {"legacy", true},
      {"clean_up_tokenization_spaces", false},
      {"model_max_length", config.max_position_embeddings}};
  return TokenizerFiles{TokenizerJson(pieces, texts),
                        tokenizer_config.dump(2) + "\n"};
}

}  // namespace

absl::StatusOr<std::shared_ptr<const ModelInfo>> LoadLlama2cModelInfo(
    const fs::path& checkpoint_bin, const fs::path& tokenizer_bin) {
  std::ifstream in(checkpoint_bin, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("cannot read ", checkpoint_bin.string()));
  }
  std::string header(sizeof(Header), '\0');
  in.read(header.data(), static_cast<std::streamsize>(header.size()));
  header.resize(static_cast<size_t>(in.gcount()));
  Header h;
  ModelInfo::Parts parts;
  PD_ASSIGN_OR_RETURN(parts.config,
                      ConfigFromHeader(header, checkpoint_bin, h));
  PD_ASSIGN_OR_RETURN(TokenizerFiles files,
                      ReadTokenizerFiles(tokenizer_bin, parts.config));
  PD_ASSIGN_OR_RETURN(
      parts.tokenizer,
      Tokenizer::FromHfJson(files.tokenizer_json, files.tokenizer_config_json));
  parts.name = checkpoint_bin.stem().string();
  parts.generation_config = {.bos_token_id = kBosId, .eos_token_ids = {kEosId}};
  return ModelInfo::FromParts(std::move(parts));
}

absl::Status ConvertLlama2cToHf(const fs::path& checkpoint_bin,
                                const fs::path& tokenizer_bin,
                                const fs::path& out_dir) {
  PD_ASSIGN_OR_RETURN(std::string ckpt,
                      ReadBinary(checkpoint_bin, size_t{64} << 30));
  ModelConfig config;
  PD_ASSIGN_OR_RETURN(std::vector<Tensor> tensors,
                      ReadCheckpoint(ckpt, checkpoint_bin, config));
  ckpt.clear();
  ckpt.shrink_to_fit();
  PD_ASSIGN_OR_RETURN(TokenizerFiles tokenizer_files,
                      ReadTokenizerFiles(tokenizer_bin, config));

  std::error_code ec;
  fs::create_directories(out_dir, ec);
  if (ec)
    return absl::PermissionDeniedError(
        absl::StrCat("cannot create ", out_dir.string(), ": ", ec.message()));
  std::vector<TensorToWrite> writes;
  for (const Tensor& t : tensors) {
    writes.push_back(
        {t.name, DType::kF32, t.shape, std::as_bytes(std::span(t.data))});
  }
  PD_RETURN_IF_ERROR(WriteSafetensors(out_dir / "model.safetensors", writes));
  PD_RETURN_IF_ERROR(
      WriteText(out_dir / "config.json", ToHfConfigJson(config)));
  PD_RETURN_IF_ERROR(WriteText(
      out_dir / "generation_config.json",
      Json({{"bos_token_id", kBosId}, {"eos_token_id", kEosId}}).dump(2) +
          "\n"));
  PD_RETURN_IF_ERROR(
      WriteText(out_dir / "tokenizer.json", tokenizer_files.tokenizer_json));
  return WriteText(out_dir / "tokenizer_config.json",
                   tokenizer_files.tokenizer_config_json);
}

}  // namespace pdserve
