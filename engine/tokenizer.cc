#include "engine/tokenizer.h"

#include <algorithm>
#include <array>
#include <fstream>
#include <queue>
#include <sstream>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "common/status_macros.h"
#include "engine/model_files/gguf.h"
#include "engine/split_pattern.h"
#include "engine/unicode.h"
#include "nlohmann/json.hpp"

namespace pdserve {

using Json = nlohmann::json;

namespace {

constexpr char kSpaceMarker[] = "\xE2\x96\x81";  // U+2581 "▁"

absl::Status Unsupported(std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat("tokenizer: unsupported ", std::string(what)));
}

// GPT-2's reversible map from bytes to printable code points.
struct ByteLevelTable {
  std::array<std::string, 256> byte_to_text;
  absl::flat_hash_map<char32_t, uint8_t> cp_to_byte;

  ByteLevelTable() {
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      const char32_t cp = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + n++);
      unicode::AppendUtf8(cp, byte_to_text[b]);
      cp_to_byte[cp] = static_cast<uint8_t>(b);
    }
  }
};

const ByteLevelTable& ByteLevel() {
  static const ByteLevelTable* table = new ByteLevelTable();
  return *table;
}

void ReplaceAll(std::string& s, std::string_view from, std::string_view to) {
  if (from.empty()) return;
  std::string out;
  size_t pos = 0;
  while (true) {
    const size_t hit = s.find(from, pos);
    if (hit == std::string::npos) break;
    out.append(s, pos, hit - pos);
    out.append(to);
    pos = hit + from.size();
  }
  out.append(s, pos);
  s = std::move(out);
}

// Parses "<0xAB>" into 0xAB.
std::optional<uint8_t> ByteTokenValue(std::string_view t) {
  if (t.size() != 6 || !t.starts_with("<0x") || t[5] != '>') return std::nullopt;
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  const int hi = hex(t[3]), lo = hex(t[4]);
  if (hi < 0 || lo < 0) return std::nullopt;
  return static_cast<uint8_t>(hi * 16 + lo);
}

absl::StatusOr<std::string> ReadFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path.string()));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// A piece of text on its way through pre-tokenization; `offset` is where it
// starts in the segment (Metaspace "first" and ByteLevel prefix spaces only
// apply at offset 0).
struct Piece {
  std::string text;
  size_t offset;
};

enum class SplitBehavior { kIsolated, kRemoved, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct PreTokenizerStep {
  enum class Kind { kSplit, kByteLevel, kMetaspace } kind;
  std::optional<SplitPattern> pattern;  // kSplit, kByteLevel with use_regex.
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  bool add_prefix_space = false;      // kByteLevel
  std::string replacement;            // kMetaspace
  enum class Prepend { kAlways, kFirst, kNever } prepend = Prepend::kAlways;
  bool split = false;                 // kMetaspace
};

struct NormalizerStep {
  enum class Kind { kPrepend, kReplace, kNfc } kind;
  std::string a, b;  // kPrepend: a; kReplace: a -> b.
};

struct DecoderStep {
  enum class Kind { kByteLevel, kReplace, kByteFallback, kFuse, kStrip, kMetaspace } kind;
  std::string a, b;        // kReplace: a -> b; kStrip: a is the content; kMetaspace: a.
  int start = 0, stop = 0; // kStrip
  bool prepend = true;     // kMetaspace: strips the leading space of the first token.
};

struct AddedToken {
  int32_t id;
  std::string content;
  bool special, lstrip, rstrip;
  bool single_word = false;  // Matches only where no word character touches it.
};

// The code point that ends / starts `text` (text is valid UTF-8).
char32_t LastCodePoint(std::string_view text) {
  size_t i = text.size();
  while (i > 0 && (static_cast<unsigned char>(text[i - 1]) & 0xC0) == 0x80) --i;
  if (i == 0) return 0;
  const std::vector<char32_t> cps = unicode::DecodeUtf8(text.substr(i - 1));
  return cps.empty() ? 0 : cps.front();
}
char32_t FirstCodePoint(std::string_view text) {
  if (text.empty()) return 0;
  size_t len = 1;
  while (len < text.size() && len < 4 && (static_cast<unsigned char>(text[len]) & 0xC0) == 0x80) ++len;
  const std::vector<char32_t> cps = unicode::DecodeUtf8(text.substr(0, len));
  return cps.empty() ? 0 : cps.front();
}
bool IsWordChar(char32_t c) {
  return c == '_' || unicode::Is(c, unicode::Category::kLetter) ||
         unicode::Is(c, unicode::Category::kNumber);
}
bool IsUnicodeSpace(char32_t c) { return c != 0 && unicode::Is(c, unicode::Category::kWhiteSpace); }

}  // namespace

class TokenizerImpl {
 public:
  // Vocabulary (model tokens and added tokens).
  std::vector<std::string> tokens;
  absl::flat_hash_map<std::string, int32_t> token_ids;
  std::vector<char> special;  // Per id.
  std::vector<AddedToken> added;  // Matched in input text; longest first.
  // Indices into `added` by the first byte of their text, longest first:
  // the input scan looks only at tokens that can start at a position.
  std::array<std::vector<uint32_t>, 256> added_by_first_byte;

  // BPE model. Merges are ranked pairs of ids (Hugging Face) or, for
  // SentencePiece vocabularies from GGUF, scores of the merged piece.
  bool use_scores = false;
  absl::flat_hash_map<uint64_t, std::pair<int32_t, int32_t>> merges;  // (a,b) -> (rank, merged)
  std::vector<float> scores;
  bool byte_fallback = false;
  bool ignore_merges = false;
  bool fuse_unk = false;
  std::optional<int32_t> unk_id;
  std::array<int32_t, 256> byte_ids;

  std::vector<NormalizerStep> normalizer;
  std::vector<PreTokenizerStep> pre_tokenizer;
  std::vector<DecoderStep> decoder;
  std::vector<int32_t> prefix_ids, suffix_ids;  // Post-processor (single sequence).
  std::optional<int32_t> bos_id;
  std::vector<int32_t> eos_ids;

  TokenizerImpl() { byte_ids.fill(-1); }

  int32_t AddToken(std::string text, int32_t id) {
    if (id >= static_cast<int32_t>(tokens.size())) {
      tokens.resize(id + 1);
      special.resize(id + 1, 0);
    }
    tokens[id] = text;
    token_ids.emplace(std::move(text), id);
    return id;
  }

  void Finish() {
    for (size_t id = 0; id < tokens.size(); ++id) {
      if (auto b = ByteTokenValue(tokens[id]); b && byte_ids[*b] < 0) byte_ids[*b] = static_cast<int32_t>(id);
    }
    std::stable_sort(added.begin(), added.end(), [](const AddedToken& a, const AddedToken& b) {
      return a.content.size() > b.content.size();
    });
    for (auto& bucket : added_by_first_byte) bucket.clear();
    for (uint32_t i = 0; i < added.size(); ++i) {
      added_by_first_byte[static_cast<uint8_t>(added[i].content[0])].push_back(i);
    }
  }

  std::optional<int32_t> Find(std::string_view text) const {
    // Abseil's string_view is its own type in this Abseil build.
    auto it = token_ids.find(absl::string_view(text.data(), text.size()));
    if (it == token_ids.end()) return std::nullopt;
    return it->second;
  }

  absl::Status Encode(std::string_view text, bool add_special, std::vector<int32_t>& out) const;
  absl::Status EncodeSegment(std::string_view text, bool at_start, std::vector<int32_t>& out) const;
  absl::Status PreTokenize(std::string text, bool at_start, std::vector<Piece>& pieces) const;
  void Bpe(std::string_view word, std::vector<int32_t>& out) const;
  std::string DecodeBytes(std::span<const int32_t> ids, bool skip_special) const;
};

// ---------------------------------------------------------------------------
// Encoding

absl::Status TokenizerImpl::Encode(std::string_view text, bool add_special,
                                   std::vector<int32_t>& out) const {
  if (!unicode::IsValidUtf8(text)) {
    return absl::InvalidArgumentError("text is not valid UTF-8");
  }
  if (add_special) out.insert(out.end(), prefix_ids.begin(), prefix_ids.end());
  // Split on added tokens: leftmost match, longest at a position.
  size_t pos = 0, seg_start = 0;
  while (pos < text.size()) {
    const AddedToken* hit = nullptr;
    for (uint32_t i : added_by_first_byte[static_cast<uint8_t>(text[pos])]) {
      const AddedToken& a = added[i];
      if (text.compare(pos, a.content.size(), a.content) != 0) continue;
      if (a.single_word && (IsWordChar(LastCodePoint(text.substr(0, pos))) ||
                            IsWordChar(FirstCodePoint(text.substr(pos + a.content.size()))))) {
        continue;
      }
      hit = &a;
      break;
    }
    if (hit == nullptr) {
      ++pos;
      continue;
    }
    size_t seg_end = pos, next = pos + hit->content.size();
    // lstrip/rstrip take the whitespace (Unicode White_Space) beside the token.
    while (hit->lstrip && seg_end > seg_start &&
           IsUnicodeSpace(LastCodePoint(text.substr(seg_start, seg_end - seg_start)))) {
      std::string cp;
      unicode::AppendUtf8(LastCodePoint(text.substr(seg_start, seg_end - seg_start)), cp);
      seg_end -= cp.size();
    }
    while (hit->rstrip && next < text.size() && IsUnicodeSpace(FirstCodePoint(text.substr(next)))) {
      std::string cp;
      unicode::AppendUtf8(FirstCodePoint(text.substr(next)), cp);
      next += cp.size();
    }
    if (seg_end > seg_start) {
      PD_RETURN_IF_ERROR(EncodeSegment(text.substr(seg_start, seg_end - seg_start), seg_start == 0, out));
    }
    out.push_back(hit->id);
    pos = seg_start = next;
  }
  if (seg_start < text.size()) {
    PD_RETURN_IF_ERROR(EncodeSegment(text.substr(seg_start), seg_start == 0, out));
  }
  if (add_special) out.insert(out.end(), suffix_ids.begin(), suffix_ids.end());
  return absl::OkStatus();
}

absl::Status TokenizerImpl::EncodeSegment(std::string_view segment, bool at_start,
                                          std::vector<int32_t>& out) const {
  std::string text(segment);
  for (const NormalizerStep& n : normalizer) {
    switch (n.kind) {
      case NormalizerStep::Kind::kPrepend:
        if (!text.empty()) text = n.a + text;
        break;
      case NormalizerStep::Kind::kReplace:
        ReplaceAll(text, n.a, n.b);
        break;
      case NormalizerStep::Kind::kNfc:
        text = unicode::NormalizeNfc(text);
        break;
    }
  }
  std::vector<Piece> pieces;
  PD_RETURN_IF_ERROR(PreTokenize(std::move(text), at_start, pieces));
  for (const Piece& p : pieces) {
    if (!p.text.empty()) Bpe(p.text, out);
  }
  return absl::OkStatus();
}

absl::Status TokenizerImpl::PreTokenize(std::string text, bool at_start,
                                        std::vector<Piece>& pieces) const {
  pieces.push_back({std::move(text), at_start ? 0u : 1u});
  std::vector<Piece> next;
  std::vector<std::pair<size_t, size_t>> matches;
  std::vector<size_t> offsets;
  for (const PreTokenizerStep& step : pre_tokenizer) {
    next.clear();
    for (Piece& piece : pieces) {
      switch (step.kind) {
        case PreTokenizerStep::Kind::kSplit:
        case PreTokenizerStep::Kind::kByteLevel: {
          std::string t = std::move(piece.text);
          if (step.kind == PreTokenizerStep::Kind::kByteLevel && step.add_prefix_space &&
              piece.offset == 0 && !t.empty() && t[0] != ' ') {
            t = " " + t;
          }
          std::vector<std::string> parts;
          if (step.pattern) {
            const std::vector<char32_t> cps = unicode::DecodeUtf8(t, &offsets);
            matches.clear();
            step.pattern->FindAll(cps, matches);
            // Turn matches into [begin, end, is_match] byte spans covering t.
            std::vector<std::tuple<size_t, size_t, bool>> spans;
            size_t last = 0;
            for (auto [b, e] : matches) {
              if (offsets[b] > last) spans.push_back({last, offsets[b], false});
              spans.push_back({offsets[b], offsets[e], true});
              last = offsets[e];
            }
            if (last < t.size()) spans.push_back({last, t.size(), false});
            std::string pending;  // MergedWithNext: matches waiting for the next span.
            bool prev_match = false;  // Contiguous: the last part is a match.
            for (auto& [b, e, m] : spans) {
              if (step.invert) m = !m;
              std::string span = t.substr(b, e - b);
              switch (step.behavior) {
                case SplitBehavior::kContiguous:
                  if (m && prev_match) parts.back() += span; else parts.push_back(std::move(span));
                  prev_match = m;
                  break;
                case SplitBehavior::kIsolated:
                  parts.push_back(std::move(span));
                  break;
                case SplitBehavior::kRemoved:
                  if (!m) parts.push_back(std::move(span));
                  break;
                case SplitBehavior::kMergedWithPrevious:
                  if (m && !parts.empty()) parts.back() += span; else parts.push_back(std::move(span));
                  break;
                case SplitBehavior::kMergedWithNext:
                  if (m) {
                    pending += span;
                  } else {
                    parts.push_back(pending + span);
                    pending.clear();
                  }
                  break;
              }
            }
            if (!pending.empty()) parts.push_back(std::move(pending));
          } else {
            parts.push_back(std::move(t));
          }
          size_t off = piece.offset;
          for (std::string& p : parts) {
            if (step.kind == PreTokenizerStep::Kind::kByteLevel) {
              std::string mapped;
              for (unsigned char c : p) mapped += ByteLevel().byte_to_text[c];
              next.push_back({std::move(mapped), off});
            } else {
              next.push_back({p, off});
            }
            off += p.size();
          }
          break;
        }
        case PreTokenizerStep::Kind::kMetaspace: {
          std::string t = std::move(piece.text);
          ReplaceAll(t, " ", step.replacement);
          const bool prepend = step.prepend == PreTokenizerStep::Prepend::kAlways ||
                               (step.prepend == PreTokenizerStep::Prepend::kFirst && piece.offset == 0);
          if (prepend && !t.starts_with(step.replacement)) t = step.replacement + t;
          if (!step.split) {
            next.push_back({std::move(t), piece.offset});
            break;
          }
          size_t start = 0;
          while (start < t.size()) {
            size_t hit = t.find(step.replacement, start + 1);
            if (hit == std::string::npos) hit = t.size();
            next.push_back({t.substr(start, hit - start), piece.offset + start});
            start = hit;
          }
          break;
        }
      }
    }
    pieces.swap(next);
  }
  return absl::OkStatus();
}

// BPE over one pre-tokenized word. Symbols are byte spans of `word`; each
// step merges the best-ranked adjacent pair (leftmost on ties).
void TokenizerImpl::Bpe(std::string_view word, std::vector<int32_t>& out) const {
  if (ignore_merges) {
    if (auto id = Find(word)) {
      out.push_back(*id);
      return;
    }
  }
  struct Symbol {
    size_t start, len;
    int32_t id;  // -1: not in the vocabulary (byte fallback / unk at the end).
    int prev, next;
  };
  std::vector<Symbol> syms;
  syms.reserve(word.size());
  std::vector<size_t> offsets;
  unicode::DecodeUtf8(word, &offsets);
  for (size_t i = 0; i + 1 < offsets.size(); ++i) {
    const size_t s = offsets[i], len = offsets[i + 1] - offsets[i];
    const std::optional<int32_t> id = Find(word.substr(s, len));
    if (!id && byte_fallback && !use_scores) {
      // Hugging Face replaces unknown characters by byte tokens up front.
      bool all = true;
      for (size_t k = 0; k < len; ++k) all = all && byte_ids[static_cast<uint8_t>(word[s + k])] >= 0;
      if (all) {
        for (size_t k = 0; k < len; ++k) {
          syms.push_back({s + k, 1, byte_ids[static_cast<uint8_t>(word[s + k])], 0, 0});
        }
        continue;
      }
    }
    syms.push_back({s, len, id.value_or(-1), 0, 0});
  }
  const int n = static_cast<int>(syms.size());
  for (int i = 0; i < n; ++i) {
    syms[i].prev = i - 1;
    syms[i].next = i + 1 < n ? i + 1 : -1;
  }

  // Candidate merge: (rank, left symbol index, left len, right len).
  struct Candidate {
    double rank;
    int left;
    size_t left_len, right_len;
    int32_t merged;
    bool operator<(const Candidate& o) const {  // For a min-heap via std::greater.
      return rank != o.rank ? rank < o.rank : left < o.left;
    }
    bool operator>(const Candidate& o) const { return o < *this; }
  };
  auto candidate = [&](int l) -> std::optional<Candidate> {
    const int r = syms[l].next;
    if (r < 0) return std::nullopt;
    if (use_scores) {
      const std::optional<int32_t> id = Find(word.substr(syms[l].start, syms[l].len + syms[r].len));
      if (!id) return std::nullopt;
      return Candidate{-static_cast<double>(scores[*id]), l, syms[l].len, syms[r].len, *id};
    }
    if (syms[l].id < 0 || syms[r].id < 0) return std::nullopt;
    auto it = merges.find((static_cast<uint64_t>(syms[l].id) << 32) | static_cast<uint32_t>(syms[r].id));
    if (it == merges.end()) return std::nullopt;
    return Candidate{static_cast<double>(it->second.first), l, syms[l].len, syms[r].len,
                     it->second.second};
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> heap;
  for (int i = 0; i + 1 < n; ++i) {
    if (auto c = candidate(i)) heap.push(*c);
  }
  while (!heap.empty()) {
    const Candidate c = heap.top();
    heap.pop();
    Symbol& l = syms[c.left];
    if (l.len == 0 || l.len != c.left_len || l.next < 0 || syms[l.next].len != c.right_len) {
      continue;  // Stale: one side has changed since this was queued.
    }
    Symbol& r = syms[l.next];
    l.len += r.len;
    l.id = c.merged;
    r.len = 0;
    l.next = r.next;
    if (r.next >= 0) syms[r.next].prev = c.left;
    if (l.prev >= 0) {
      if (auto p = candidate(l.prev)) heap.push(*p);
    }
    if (auto q = candidate(c.left)) heap.push(*q);
  }

  bool last_was_unk = false;
  for (int i = 0; i >= 0 && i < n; i = syms[i].next) {
    const Symbol& s = syms[i];
    if (s.id >= 0) {
      out.push_back(s.id);
      last_was_unk = false;
      continue;
    }
    bool all_bytes = byte_fallback;
    for (size_t k = 0; all_bytes && k < s.len; ++k) all_bytes = byte_ids[static_cast<uint8_t>(word[s.start + k])] >= 0;
    if (all_bytes) {
      for (size_t k = 0; k < s.len; ++k) out.push_back(byte_ids[static_cast<uint8_t>(word[s.start + k])]);
      last_was_unk = false;
    } else if (unk_id) {
      if (!(fuse_unk && last_was_unk)) out.push_back(*unk_id);
      last_was_unk = true;
    }
    // No unk token and no byte fallback: the character is dropped, as in
    // Hugging Face tokenizers.
  }
}

// ---------------------------------------------------------------------------
// Decoding: raw bytes (possibly incomplete UTF-8 at the end).

std::string TokenizerImpl::DecodeBytes(std::span<const int32_t> ids, bool skip_special) const {
  std::vector<std::string> parts;
  parts.reserve(ids.size());
  for (int32_t id : ids) {
    if (skip_special && special[id]) continue;
    parts.push_back(tokens[id]);
  }
  for (const DecoderStep& d : decoder) {
    switch (d.kind) {
      case DecoderStep::Kind::kByteLevel: {
        std::string joined;
        for (const std::string& p : parts) {
          for (char32_t cp : unicode::DecodeUtf8(p)) {
            auto it = ByteLevel().cp_to_byte.find(cp);
            if (it != ByteLevel().cp_to_byte.end()) {
              joined.push_back(static_cast<char>(it->second));
            } else {
              unicode::AppendUtf8(cp, joined);
            }
          }
        }
        parts.assign(1, std::move(joined));
        break;
      }
      case DecoderStep::Kind::kReplace:
        for (std::string& p : parts) ReplaceAll(p, d.a, d.b);
        break;
      case DecoderStep::Kind::kByteFallback: {
        std::vector<std::string> merged;
        bool prev_byte = false;
        for (std::string& p : parts) {
          if (auto b = ByteTokenValue(p)) {
            if (prev_byte) {
              merged.back().push_back(static_cast<char>(*b));
            } else {
              merged.push_back(std::string(1, static_cast<char>(*b)));
            }
            prev_byte = true;
          } else {
            merged.push_back(std::move(p));
            prev_byte = false;
          }
        }
        parts = std::move(merged);
        break;
      }
      case DecoderStep::Kind::kFuse: {
        std::string joined;
        for (const std::string& p : parts) joined += p;
        parts.assign(1, std::move(joined));
        break;
      }
      case DecoderStep::Kind::kStrip:
        for (std::string& p : parts) {
          int k = 0;
          while (k < d.start && p.starts_with(d.a)) {
            p.erase(0, d.a.size());
            ++k;
          }
          k = 0;
          while (k < d.stop && p.ends_with(d.a)) {
            p.erase(p.size() - d.a.size());
            ++k;
          }
        }
        break;
      case DecoderStep::Kind::kMetaspace:
        for (size_t i = 0; i < parts.size(); ++i) {
          ReplaceAll(parts[i], d.a, " ");
          if (i == 0 && d.prepend && parts[i].starts_with(" ")) parts[i].erase(0, 1);
        }
        break;
    }
  }
  std::string out;
  for (const std::string& p : parts) out += p;
  return out;
}

// ---------------------------------------------------------------------------
// Loading tokenizer.json

namespace {

std::string JsonString(const Json& j, const char* key, std::string fallback = "") {
  auto it = j.find(key);
  return it != j.end() && it->is_string() ? it->get<std::string>() : fallback;
}

bool JsonBool(const Json& j, const char* key, bool fallback) {
  auto it = j.find(key);
  return it != j.end() && it->is_boolean() ? it->get<bool>() : fallback;
}

int JsonInt(const Json& j, const char* key, int fallback) {
  auto it = j.find(key);
  return it != j.end() && it->is_number_integer() ? it->get<int>() : fallback;
}

// A missing field reads as null (a const Json's operator[] must not be used
// on a missing key).
const Json& Field(const Json& j, const char* key) {
  static const Json* null = new Json();
  auto it = j.find(key);
  return it != j.end() ? *it : *null;
}

// The literal of a Replace step's {"String": ...} pattern.
absl::StatusOr<std::string> ReplaceLiteral(const Json& step, std::string_view where) {
  const Json& p = Field(step, "pattern");
  if (!p.is_object() || !p.contains("String") || !p["String"].is_string()) {
    return Unsupported(absl::StrCat(std::string(where), " Replace without a string pattern"));
  }
  return p["String"].get<std::string>();
}

// Metaspace's prepend_scheme, or the older add_prefix_space flag.
std::string MetaspaceScheme(const Json& step) {
  return JsonString(step, "prepend_scheme", JsonBool(step, "add_prefix_space", true) ? "always" : "never");
}

// "Sequence" wrappers flattened into a list of steps.
std::vector<const Json*> Flatten(const Json& j, const char* list_key) {
  std::vector<const Json*> out;
  if (j.is_null()) return out;
  if (JsonString(j, "type") == "Sequence" && j.contains(list_key) && j[list_key].is_array()) {
    for (const Json& s : j[list_key]) {
      for (const Json* f : Flatten(s, list_key)) out.push_back(f);
    }
  } else {
    out.push_back(&j);
  }
  return out;
}

// A Split `pattern`: {"String": s} or {"Regex": r}.
absl::StatusOr<SplitPattern> PatternFromJson(const Json& pattern) {
  if (!pattern.is_object()) return Unsupported("Split pattern (not an object)");
  if (pattern.contains("Regex") && pattern["Regex"].is_string()) {
    return SplitPattern::FromRegex(pattern["Regex"].get<std::string>());
  }
  if (pattern.contains("String") && pattern["String"].is_string()) {
    const std::string literal = pattern["String"].get<std::string>();
    if (literal.empty() || !unicode::IsValidUtf8(literal)) return Unsupported("empty or non-UTF-8 Split string");
    const std::vector<char32_t> cps = unicode::DecodeUtf8(literal);
    return SplitPattern::FromLiteral(std::u32string(cps.begin(), cps.end()));
  }
  return Unsupported("Split pattern kind");
}

// A Split/Punctuation `behavior`.
absl::StatusOr<SplitBehavior> BehaviorFromJson(const Json& step, const char* fallback) {
  const std::string behavior = JsonString(step, "behavior", fallback);
  if (behavior == "Isolated") return SplitBehavior::kIsolated;
  if (behavior == "Removed") return SplitBehavior::kRemoved;
  if (behavior == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (behavior == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (behavior == "Contiguous") return SplitBehavior::kContiguous;
  return Unsupported(absl::StrCat("split behavior '", behavior, "'"));
}

absl::Status LoadNormalizer(const Json& j, TokenizerImpl& t) {
  for (const Json* s : Flatten(j, "normalizers")) {
    const std::string type = JsonString(*s, "type");
    if (type == "Prepend") {
      t.normalizer.push_back({NormalizerStep::Kind::kPrepend, JsonString(*s, "prepend")});
    } else if (type == "Replace") {
      PD_ASSIGN_OR_RETURN(std::string from, ReplaceLiteral(*s, "normalizer"));
      t.normalizer.push_back({NormalizerStep::Kind::kReplace, std::move(from), JsonString(*s, "content")});
    } else if (type == "NFC") {
      t.normalizer.push_back({NormalizerStep::Kind::kNfc});
    } else {
      return Unsupported(absl::StrCat("normalizer '", type, "'"));
    }
  }
  return absl::OkStatus();
}

absl::Status LoadPreTokenizer(const Json& j, TokenizerImpl& t) {
  for (const Json* s : Flatten(j, "pretokenizers")) {
    const std::string type = JsonString(*s, "type");
    PreTokenizerStep step;
    if (type == "Split") {
      step.kind = PreTokenizerStep::Kind::kSplit;
      PD_ASSIGN_OR_RETURN(step.pattern, PatternFromJson(Field(*s, "pattern")));
      PD_ASSIGN_OR_RETURN(step.behavior, BehaviorFromJson(*s, ""));
      step.invert = JsonBool(*s, "invert", false);
    } else if (type == "ByteLevel") {
      step.kind = PreTokenizerStep::Kind::kByteLevel;
      step.add_prefix_space = JsonBool(*s, "add_prefix_space", false);
      if (JsonBool(*s, "use_regex", true)) {
        PD_ASSIGN_OR_RETURN(step.pattern, SplitPattern::FromRegex(SplitPattern::kGpt2Regex));
      }
    } else if (type == "Metaspace") {
      step.kind = PreTokenizerStep::Kind::kMetaspace;
      step.replacement = JsonString(*s, "replacement", kSpaceMarker);
      const std::string scheme = MetaspaceScheme(*s);
      step.prepend = scheme == "first"   ? PreTokenizerStep::Prepend::kFirst
                     : scheme == "never" ? PreTokenizerStep::Prepend::kNever
                                         : PreTokenizerStep::Prepend::kAlways;
      step.split = JsonBool(*s, "split", true);
    } else if (type == "Digits") {
      // Runs of digits are one Contiguous split, which a run-matching
      // pattern gives with Isolated.
      step.kind = PreTokenizerStep::Kind::kSplit;
      step.pattern = SplitPattern::Digits(JsonBool(*s, "individual_digits", false));
    } else if (type == "Punctuation") {
      step.kind = PreTokenizerStep::Kind::kSplit;
      PD_ASSIGN_OR_RETURN(step.behavior, BehaviorFromJson(*s, "Isolated"));
      const bool contiguous = step.behavior == SplitBehavior::kContiguous;
      step.pattern = SplitPattern::Punctuation(contiguous);
      if (contiguous) step.behavior = SplitBehavior::kIsolated;
    } else {
      return Unsupported(absl::StrCat("pre-tokenizer '", type, "'"));
    }
    t.pre_tokenizer.push_back(std::move(step));
  }
  return absl::OkStatus();
}

absl::Status LoadDecoder(const Json& j, TokenizerImpl& t) {
  for (const Json* s : Flatten(j, "decoders")) {
    const std::string type = JsonString(*s, "type");
    DecoderStep d;
    if (type == "ByteLevel") {
      d.kind = DecoderStep::Kind::kByteLevel;
    } else if (type == "Replace") {
      d.kind = DecoderStep::Kind::kReplace;
      PD_ASSIGN_OR_RETURN(d.a, ReplaceLiteral(*s, "decoder"));
      d.b = JsonString(*s, "content");
    } else if (type == "ByteFallback") {
      d.kind = DecoderStep::Kind::kByteFallback;
    } else if (type == "Fuse") {
      d.kind = DecoderStep::Kind::kFuse;
    } else if (type == "Strip") {
      d.kind = DecoderStep::Kind::kStrip;
      d.a = JsonString(*s, "content", " ");
      d.start = JsonInt(*s, "start", 0);
      d.stop = JsonInt(*s, "stop", 0);
    } else if (type == "Metaspace") {
      d.kind = DecoderStep::Kind::kMetaspace;
      d.a = JsonString(*s, "replacement", kSpaceMarker);
      d.prepend = MetaspaceScheme(*s) != "never";
    } else {
      return Unsupported(absl::StrCat("decoder '", type, "'"));
    }
    t.decoder.push_back(std::move(d));
  }
  return absl::OkStatus();
}

absl::Status LoadPostProcessor(const Json& j, TokenizerImpl& t) {
  for (const Json* s : Flatten(j, "processors")) {
    const std::string type = JsonString(*s, "type");
    if (type == "ByteLevel") continue;  // Offsets only.
    if (type != "TemplateProcessing") return Unsupported(absl::StrCat("post-processor '", type, "'"));
    bool before = true;
    const Json& single = Field(*s, "single");
    if (!single.is_array()) return absl::InvalidArgumentError("tokenizer: TemplateProcessing without 'single'");
    for (const Json& item : single) {
      if (item.contains("Sequence")) {
        before = false;
      } else if (item.contains("SpecialToken")) {
        const std::string name = JsonString(item["SpecialToken"], "id");
        const Json& specials = Field(*s, "special_tokens");
        if (!specials.is_object() || !specials.contains(name) || !specials[name].is_object() ||
            !specials[name].contains("ids") || !specials[name]["ids"].is_array()) {
          return absl::InvalidArgumentError(absl::StrCat("tokenizer: post-processor names unknown token ", name));
        }
        for (const Json& id : specials[name]["ids"]) {
          if (!id.is_number_integer()) return absl::InvalidArgumentError("tokenizer: bad post-processor id");
          (before ? t.prefix_ids : t.suffix_ids).push_back(id.get<int32_t>());
        }
      }
    }
  }
  return absl::OkStatus();
}

// "bos_token": "<s>" or {"content": "<s>", ...}.
std::optional<std::string> ConfigTokenText(const Json& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
    return (*it)["content"].get<std::string>();
  }
  return std::nullopt;
}

absl::Status LoadHfJson(std::string_view tokenizer_json, std::string_view config_json,
                        TokenizerImpl& t) {
  const Json j = Json::parse(tokenizer_json.begin(), tokenizer_json.end(), nullptr, false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError("tokenizer.json is not a valid JSON object");
  }
  const Json& model = j.contains("model") ? j["model"] : Json();
  if (!model.is_object()) return absl::InvalidArgumentError("tokenizer.json has no model");
  const std::string type = JsonString(model, "type", "BPE");
  if (type != "BPE") return Unsupported(absl::StrCat("tokenizer model '", type, "' (only BPE)"));
  if (!JsonString(model, "continuing_subword_prefix").empty() ||
      !JsonString(model, "end_of_word_suffix").empty()) {
    return Unsupported("BPE with subword prefixes/suffixes");
  }
  if (model.contains("dropout") && !model["dropout"].is_null() && model["dropout"].is_number() &&
      model["dropout"].get<double>() > 0) {
    return Unsupported("BPE dropout");
  }
  if (!model.contains("vocab") || !model["vocab"].is_object()) {
    return absl::InvalidArgumentError("tokenizer.json: model.vocab is missing");
  }
  for (auto& [text, id] : model["vocab"].items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() >= (1 << 24)) {
      return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: bad id for token '", text, "'"));
    }
    t.AddToken(text, id.get<int32_t>());
  }
  t.byte_fallback = JsonBool(model, "byte_fallback", false);
  t.ignore_merges = JsonBool(model, "ignore_merges", false);
  t.fuse_unk = JsonBool(model, "fuse_unk", false);
  if (auto unk = JsonString(model, "unk_token"); !unk.empty()) t.unk_id = t.Find(unk);
  if (model.contains("merges") && model["merges"].is_array()) {
    int32_t rank = 0;
    for (const Json& m : model["merges"]) {
      std::string a, b;
      if (m.is_string()) {
        const std::string s = m.get<std::string>();
        const size_t sp = s.find(' ', 1);
        if (sp == std::string::npos) return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: bad merge '", s, "'"));
        a = s.substr(0, sp);
        b = s.substr(sp + 1);
      } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
        a = m[0].get<std::string>();
        b = m[1].get<std::string>();
      } else {
        return absl::InvalidArgumentError("tokenizer.json: malformed merge entry");
      }
      const auto ia = t.Find(a), ib = t.Find(b), im = t.Find(a + b);
      if (!ia || !ib || !im) {
        return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: merge '", a, " ", b, "' uses unknown tokens"));
      }
      t.merges.try_emplace((static_cast<uint64_t>(*ia) << 32) | static_cast<uint32_t>(*ib), rank++, *im);
    }
  }
  if (j.contains("added_tokens") && j["added_tokens"].is_array()) {
    for (const Json& a : j["added_tokens"]) {
      if (!a.is_object() || !a.contains("id") || !a["id"].is_number_integer() ||
          !a.contains("content") || !a["content"].is_string() || a["id"].get<int64_t>() < 0 ||
          a["id"].get<int64_t>() >= (1 << 24)) {
        return absl::InvalidArgumentError("tokenizer.json: malformed added token");
      }
      AddedToken tok{a["id"].get<int32_t>(), a["content"].get<std::string>(),
                     JsonBool(a, "special", false), JsonBool(a, "lstrip", false),
                     JsonBool(a, "rstrip", false), JsonBool(a, "single_word", false)};
      if (tok.content.empty()) continue;
      t.AddToken(tok.content, tok.id);
      t.special[tok.id] = tok.special;
      t.added.push_back(std::move(tok));
    }
  }
  for (size_t id = 0; id < t.tokens.size(); ++id) {
    if (t.tokens[id].empty() && !t.Find("")) {
      return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: id ", id, " has no token"));
    }
  }
  if (j.contains("normalizer")) PD_RETURN_IF_ERROR(LoadNormalizer(j["normalizer"], t));
  if (j.contains("pre_tokenizer")) PD_RETURN_IF_ERROR(LoadPreTokenizer(j["pre_tokenizer"], t));
  if (j.contains("decoder")) PD_RETURN_IF_ERROR(LoadDecoder(j["decoder"], t));
  if (j.contains("post_processor")) PD_RETURN_IF_ERROR(LoadPostProcessor(j["post_processor"], t));

  if (!config_json.empty()) {
    const Json c = Json::parse(config_json.begin(), config_json.end(), nullptr, false);
    if (c.is_discarded() || !c.is_object()) {
      return absl::InvalidArgumentError("tokenizer_config.json is not a valid JSON object");
    }
    if (auto bos = ConfigTokenText(c, "bos_token")) t.bos_id = t.Find(*bos);
    if (auto eos = ConfigTokenText(c, "eos_token"); eos && t.Find(*eos)) t.eos_ids.push_back(*t.Find(*eos));
    // transformers' Llama-family fast tokenizers rebuild the post-processor
    // from add_bos_token (default true) and add_eos_token (default false)
    // when they load, whatever tokenizer.json says.
    const std::string cls = JsonString(c, "tokenizer_class");
    if (cls.starts_with("LlamaTokenizer") || cls.starts_with("CodeLlamaTokenizer") ||
        cls.starts_with("GemmaTokenizer")) {
      t.prefix_ids.clear();
      t.suffix_ids.clear();
      if (JsonBool(c, "add_bos_token", true) && t.bos_id) t.prefix_ids.push_back(*t.bos_id);
      if (JsonBool(c, "add_eos_token", false) && !t.eos_ids.empty()) t.suffix_ids.push_back(t.eos_ids[0]);
    } else if (JsonBool(c, "add_bos_token", false) && t.bos_id && t.prefix_ids.empty()) {
      // An explicit add_bos_token without a post-processor that adds it.
      t.prefix_ids.push_back(*t.bos_id);
    }
  }
  return absl::OkStatus();
}

// GGUF `tokenizer.ggml.pre` names to the regexes that split text before BPE.
absl::StatusOr<std::vector<std::string>> GgufPreTokenizerPatterns(const std::string& pre) {
  const std::string gpt2 = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S))";
  if (pre == "default" || pre == "gpt-2" || pre == "gpt2" || pre == "mpt" || pre == "olmo") return std::vector{gpt2};
  if (pre == "starcoder" || pre == "refact") return std::vector<std::string>{R"(\p{N})", gpt2};
  if (pre == "falcon") {
    return std::vector<std::string>{R"([\p{P}\$\+<=>\^~\|`]+)", gpt2, "[0-9][0-9][0-9]"};
  }
  if (pre == "llama3" || pre == "llama-bpe") {
    return std::vector<std::string>{
        R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"};
  }
  if (pre == "qwen2") {
    return std::vector<std::string>{
        R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"};
  }
  if (pre == "deepseek-llm") {
    return std::vector<std::string>{
        "[\r\n]",
        "\\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\u1F7Dᾀ-ᾴᾶ-ᾼ\u1FBEῂ-ῄῆ-ῌῐ-\u1FD3ῖ-\u1FDBῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\u2126ℨ\u212A-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",
        "\\s?[!-/:-~！-／：-～‘-‟　-。]+",
        "\\s+$",
        "[一-龥ࠀ-一가-퟿]+",
        "\\p{N}+",
    };
  }
  return Unsupported(absl::StrCat("GGUF pre-tokenizer '", pre, "'"));
}

absl::Status LoadGguf(const GgufMetadata& m, TokenizerImpl& t) {
  PD_ASSIGN_OR_RETURN(std::string model, m.GetString("tokenizer.ggml.model"));
  PD_ASSIGN_OR_RETURN(std::vector<std::string> tokens, m.GetStrings("tokenizer.ggml.tokens"));
  std::vector<int64_t> types;
  if (auto ty = m.GetInts("tokenizer.ggml.token_type"); ty.ok()) types = *std::move(ty);
  if (!types.empty() && types.size() != tokens.size()) {
    return absl::InvalidArgumentError("GGUF: token_type and tokens differ in length");
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    t.AddToken(tokens[i], static_cast<int32_t>(i));
    const int64_t type = types.empty() ? 1 : types[i];
    // 3: control, 4: user-defined (matched in text), 2: unknown.
    if (type == 3 || type == 4) {
      t.special[i] = type == 3;
      if (!tokens[i].empty()) t.added.push_back({static_cast<int32_t>(i), tokens[i], type == 3, false, false});
    }
    if (type == 2) t.special[i] = true;
  }
  if (auto bos = m.GetInt("tokenizer.ggml.bos_token_id"); bos.ok() && *bos >= 0 && *bos < static_cast<int64_t>(tokens.size())) {
    t.bos_id = static_cast<int32_t>(*bos);
  }
  if (auto eos = m.GetInt("tokenizer.ggml.eos_token_id"); eos.ok() && *eos >= 0 && *eos < static_cast<int64_t>(tokens.size())) {
    t.eos_ids.push_back(static_cast<int32_t>(*eos));
  }
  if (auto unk = m.GetInt("tokenizer.ggml.unknown_token_id"); unk.ok() && *unk >= 0 && *unk < static_cast<int64_t>(tokens.size())) {
    t.unk_id = static_cast<int32_t>(*unk);
  }
  if (model == "llama") {
    // SentencePiece BPE: merges by score of the merged piece, byte fallback.
    PD_ASSIGN_OR_RETURN(std::vector<double> scores, m.GetFloats("tokenizer.ggml.scores"));
    if (scores.size() != tokens.size()) return absl::InvalidArgumentError("GGUF: scores and tokens differ in length");
    t.scores.assign(scores.begin(), scores.end());
    t.use_scores = true;
    t.byte_fallback = true;
    bool add_space_prefix = true;
    if (auto v = m.values.find("tokenizer.ggml.add_space_prefix"); v != m.values.end() &&
                                                                    std::holds_alternative<uint64_t>(v->second)) {
      add_space_prefix = std::get<uint64_t>(v->second) != 0;
    }
    t.normalizer.push_back({NormalizerStep::Kind::kReplace, " ", kSpaceMarker});
    if (add_space_prefix) t.normalizer.insert(t.normalizer.begin(), {NormalizerStep::Kind::kPrepend, " "});
    t.decoder = {{DecoderStep::Kind::kReplace, kSpaceMarker, " "},
                 {DecoderStep::Kind::kByteFallback},
                 {DecoderStep::Kind::kFuse}};
    if (add_space_prefix) t.decoder.push_back({DecoderStep::Kind::kStrip, " ", "", 1, 0});
  } else if (model == "gpt2") {
    PD_ASSIGN_OR_RETURN(std::vector<std::string> merges, m.GetStrings("tokenizer.ggml.merges"));
    int32_t rank = 0;
    for (const std::string& s : merges) {
      const size_t sp = s.find(' ', 1);
      if (sp == std::string::npos) return absl::InvalidArgumentError(absl::StrCat("GGUF: bad merge '", s, "'"));
      const auto ia = t.Find(s.substr(0, sp)), ib = t.Find(s.substr(sp + 1)),
                 im = t.Find(s.substr(0, sp) + s.substr(sp + 1));
      if (!ia || !ib || !im) continue;  // Unreachable merges are harmless.
      t.merges.try_emplace((static_cast<uint64_t>(*ia) << 32) | static_cast<uint32_t>(*ib), rank++, *im);
    }
    std::string pre = "default";
    if (auto p = m.GetString("tokenizer.ggml.pre"); p.ok()) pre = *p;
    PD_ASSIGN_OR_RETURN(std::vector<std::string> patterns, GgufPreTokenizerPatterns(pre));
    for (size_t i = 0; i < patterns.size(); ++i) {
      PreTokenizerStep step;
      step.kind = PreTokenizerStep::Kind::kSplit;
      PD_ASSIGN_OR_RETURN(step.pattern, SplitPattern::FromRegex(patterns[i]));
      t.pre_tokenizer.push_back(std::move(step));
    }
    PreTokenizerStep byte_level;
    byte_level.kind = PreTokenizerStep::Kind::kByteLevel;
    t.pre_tokenizer.push_back(std::move(byte_level));
    t.decoder = {{DecoderStep::Kind::kByteLevel}};
  } else {
    return Unsupported(absl::StrCat("GGUF tokenizer model '", model, "'"));
  }
  if (auto add_bos = m.values.find("tokenizer.ggml.add_bos_token");
      add_bos != m.values.end() && std::holds_alternative<uint64_t>(add_bos->second) &&
      std::get<uint64_t>(add_bos->second) != 0 && t.bos_id) {
    t.prefix_ids.push_back(*t.bos_id);
  }
  return absl::OkStatus();
}

}  // namespace

// ---------------------------------------------------------------------------
// Tokenizer

Tokenizer::Tokenizer(std::unique_ptr<TokenizerImpl> impl) : impl_(std::move(impl)) {}
Tokenizer::~Tokenizer() = default;

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromHfJson(std::string_view tokenizer_json,
                                                                 std::string_view config_json) {
  auto impl = std::make_unique<TokenizerImpl>();
  // Every field is type-checked before use; this only contains what a
  // check might have missed, so no exception leaves the module.
  try {
    PD_RETURN_IF_ERROR(LoadHfJson(tokenizer_json, config_json, *impl));
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("tokenizer.json: ", e.what()));
  }
  impl->Finish();
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromHfFiles(
    const std::filesystem::path& tokenizer_json, const std::filesystem::path& tokenizer_config_json) {
  PD_ASSIGN_OR_RETURN(std::string text, ReadFile(tokenizer_json));
  std::string config;
  if (std::filesystem::exists(tokenizer_config_json)) {
    PD_ASSIGN_OR_RETURN(config, ReadFile(tokenizer_config_json));
  }
  return FromHfJson(text, config);
}

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::FromGguf(const std::filesystem::path& path) {
  PD_ASSIGN_OR_RETURN(GgufMetadata m, ReadGgufMetadata(path));
  auto impl = std::make_unique<TokenizerImpl>();
  PD_RETURN_IF_ERROR(LoadGguf(m, *impl));
  impl->Finish();
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
}

std::unique_ptr<Tokenizer> Tokenizer::MakeByteLevel(int32_t vocab_size) {
  auto impl = std::make_unique<TokenizerImpl>();
  for (int b = 0; b < 256; ++b) impl->AddToken(absl::StrFormat("<0x%02X>", b), b);
  impl->AddToken("<s>", 256);
  impl->AddToken("</s>", 257);
  for (int32_t id = 258; id < vocab_size; ++id) {
    impl->AddToken(absl::StrCat("<extra_", id, ">"), id);
    impl->special[id] = 1;
  }
  impl->special[256] = impl->special[257] = 1;
  impl->added = {{256, "<s>", true, false, false}, {257, "</s>", true, false, false}};
  impl->byte_fallback = true;
  impl->bos_id = 256;
  impl->eos_ids = {257};
  impl->prefix_ids = {256};
  impl->decoder = {{DecoderStep::Kind::kByteFallback}, {DecoderStep::Kind::kFuse}};
  impl->Finish();
  return std::unique_ptr<Tokenizer>(new Tokenizer(std::move(impl)));
}

absl::StatusOr<std::vector<int32_t>> Tokenizer::Encode(std::string_view text,
                                                       bool add_special_tokens) const {
  std::vector<int32_t> out;
  PD_RETURN_IF_ERROR(impl_->Encode(text, add_special_tokens, out));
  return out;
}

absl::StatusOr<std::string> Tokenizer::Decode(std::span<const int32_t> ids,
                                              bool skip_special_tokens) const {
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size()) {
      return absl::InvalidArgumentError(absl::StrCat("token id ", id, " outside [0, ", vocab_size(), ")"));
    }
  }
  return unicode::ToValidUtf8(impl_->DecodeBytes(ids, skip_special_tokens));
}

int32_t Tokenizer::vocab_size() const { return static_cast<int32_t>(impl_->tokens.size()); }
std::optional<int32_t> Tokenizer::bos_token_id() const { return impl_->bos_id; }
std::vector<int32_t> Tokenizer::eos_token_ids() const { return impl_->eos_ids; }
bool Tokenizer::IsSpecial(int32_t id) const {
  return id >= 0 && id < vocab_size() && impl_->special[id];
}
std::string_view Tokenizer::TokenText(int32_t id) const {
  return id >= 0 && id < vocab_size() ? std::string_view(impl_->tokens[id]) : std::string_view();
}

// ---------------------------------------------------------------------------
// IncrementalDetokenizer: decodes a short window of recent ids, emitting
// only text that is complete UTF-8 (the vLLM prefix/read offset scheme).

IncrementalDetokenizer::IncrementalDetokenizer(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(tokenizer), skip_special_tokens_(skip_special_tokens) {}

absl::StatusOr<std::string> IncrementalDetokenizer::Append(int32_t id) {
  if (id < 0 || id >= tokenizer_.vocab_size()) {
    return absl::InvalidArgumentError(absl::StrCat("token id ", id, " outside the vocabulary"));
  }
  ids_.push_back(id);
  const auto window = std::span(ids_);
  const std::string prefix = tokenizer_.impl_->DecodeBytes(
      window.subspan(prefix_offset_, read_offset_ - prefix_offset_), skip_special_tokens_);
  const std::string full =
      tokenizer_.impl_->DecodeBytes(window.subspan(prefix_offset_), skip_special_tokens_);
  const size_t complete = unicode::CompleteUtf8Prefix(full);
  if (complete < full.size() || full.size() <= prefix.size() || !full.starts_with(prefix)) {
    return std::string();  // Hold back until the character completes.
  }
  prefix_offset_ = read_offset_;
  read_offset_ = ids_.size();
  return unicode::ToValidUtf8(std::string_view(full).substr(prefix.size()));
}

std::string IncrementalDetokenizer::Flush() {
  const auto window = std::span(ids_);
  const std::string prefix = tokenizer_.impl_->DecodeBytes(
      window.subspan(prefix_offset_, read_offset_ - prefix_offset_), skip_special_tokens_);
  const std::string full =
      tokenizer_.impl_->DecodeBytes(window.subspan(prefix_offset_), skip_special_tokens_);
  prefix_offset_ = read_offset_ = ids_.size();
  if (full.size() <= prefix.size()) return std::string();
  return unicode::ToValidUtf8(std::string_view(full).substr(prefix.size()));
}

}  // namespace pdserve
