// UTF-8 and the few Unicode properties the tokenizer needs.
#ifndef PDSERVE_ENGINE_UNICODE_H_
#define PDSERVE_ENGINE_UNICODE_H_

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace pdserve::unicode {

enum class Category { kLetter, kNumber, kPunctuation, kMark, kSymbol, kWhiteSpace };

bool Is(char32_t cp, Category category);

// True when `text` is well-formed UTF-8 (no overlongs, surrogates or code
// points past U+10FFFF).
bool IsValidUtf8(std::string_view text);

// Decodes well-formed UTF-8 (check IsValidUtf8 first) into code points and,
// when `offsets` is not null, the byte offset of each (plus a final entry
// holding text.size()).
std::vector<char32_t> DecodeUtf8(std::string_view text, std::vector<size_t>* offsets = nullptr);

void AppendUtf8(char32_t cp, std::string& out);

// Length of the longest prefix of `bytes` made of complete UTF-8 sequences:
// an incomplete sequence at the end is left out (invalid bytes are kept, so
// they can be replaced, not held back forever).
size_t CompleteUtf8Prefix(std::string_view bytes);

// Replaces every ill-formed subsequence with U+FFFD, as Python's
// errors="replace" and Rust's from_utf8_lossy do (maximal subparts).
std::string ToValidUtf8(std::string_view bytes);

// Unicode Normalization Form C of well-formed UTF-8 (check IsValidUtf8
// first), with the tables of tools/gen_unicode_tables.py.
std::string NormalizeNfc(std::string_view text);

}  // namespace pdserve::unicode

#endif  // PDSERVE_ENGINE_UNICODE_H_
