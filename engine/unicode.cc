#include "engine/unicode.h"

#include <algorithm>
#include <span>

namespace pdserve::unicode {
namespace {

struct CodePointRange {
  char32_t lo, hi;
};

#include "engine/unicode_tables.inc"

bool InRanges(std::span<const CodePointRange> ranges, char32_t cp) {
  auto it = std::upper_bound(ranges.begin(), ranges.end(), cp,
                             [](char32_t c, const CodePointRange& r) { return c < r.lo; });
  return it != ranges.begin() && cp <= (it - 1)->hi;
}

// Length of the well-formed UTF-8 sequence at the start of `s` (1..4), or 0
// if the bytes there do not start one. `incomplete` is set when `s` ends in
// the middle of what would be a well-formed sequence.
size_t SequenceLength(std::string_view s, bool* incomplete) {
  *incomplete = false;
  const auto b0 = static_cast<unsigned char>(s[0]);
  if (b0 < 0x80) return 1;
  size_t len;
  unsigned char lo = 0x80, hi = 0xBF;  // Allowed range of the second byte.
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    len = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    len = 3;
    if (b0 == 0xE0) lo = 0xA0;  // No overlongs.
    if (b0 == 0xED) hi = 0x9F;  // No surrogates.
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    len = 4;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;  // Nothing past U+10FFFF.
  } else {
    return 0;
  }
  for (size_t i = 1; i < len; ++i) {
    if (i >= s.size()) {
      *incomplete = true;
      return 0;
    }
    const auto b = static_cast<unsigned char>(s[i]);
    const unsigned char l = i == 1 ? lo : 0x80, h = i == 1 ? hi : 0xBF;
    if (b < l || b > h) return 0;
  }
  return len;
}

}  // namespace

bool Is(char32_t cp, Category category) {
  switch (category) {
    case Category::kLetter:
      return InRanges(kLetter, cp);
    case Category::kNumber:
      return InRanges(kNumber, cp);
    case Category::kPunctuation:
      return InRanges(kPunctuation, cp);
    case Category::kMark:
      return InRanges(kMark, cp);
    case Category::kSymbol:
      return InRanges(kSymbol, cp);
    case Category::kWhiteSpace:
      return InRanges(kWhiteSpace, cp);
  }
  return false;
}

bool IsValidUtf8(std::string_view text) {
  bool incomplete;
  for (size_t i = 0; i < text.size();) {
    const size_t len = SequenceLength(text.substr(i), &incomplete);
    if (len == 0) return false;
    i += len;
  }
  return true;
}

std::vector<char32_t> DecodeUtf8(std::string_view text, std::vector<size_t>* offsets) {
  std::vector<char32_t> out;
  out.reserve(text.size());
  if (offsets) offsets->clear();
  for (size_t i = 0; i < text.size();) {
    const auto b0 = static_cast<unsigned char>(text[i]);
    size_t len = b0 < 0x80 ? 1 : b0 < 0xE0 ? 2 : b0 < 0xF0 ? 3 : 4;
    len = std::min(len, text.size() - i);
    char32_t cp = len == 1 ? b0 : len == 2 ? (b0 & 0x1F) : len == 3 ? (b0 & 0x0F) : (b0 & 0x07);
    for (size_t k = 1; k < len; ++k) cp = (cp << 6) | (static_cast<unsigned char>(text[i + k]) & 0x3F);
    if (offsets) offsets->push_back(i);
    out.push_back(cp);
    i += len;
  }
  if (offsets) offsets->push_back(text.size());
  return out;
}

void AppendUtf8(char32_t cp, std::string& out) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

size_t CompleteUtf8Prefix(std::string_view bytes) {
  bool incomplete;
  size_t i = 0;
  while (i < bytes.size()) {
    const size_t len = SequenceLength(bytes.substr(i), &incomplete);
    if (incomplete) return i;
    i += len == 0 ? 1 : len;
  }
  return i;
}

std::string ToValidUtf8(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  bool incomplete;
  for (size_t i = 0; i < bytes.size();) {
    const size_t len = SequenceLength(bytes.substr(i), &incomplete);
    if (len > 0) {
      out.append(bytes.substr(i, len));
      i += len;
      continue;
    }
    out.append("\xEF\xBF\xBD");
    // Skip the maximal subpart: the lead byte and any continuation bytes
    // that were still valid for it.
    size_t skip = 1;
    const auto b0 = static_cast<unsigned char>(bytes[i]);
    if (b0 >= 0xC2 && b0 <= 0xF4) {
      const size_t want = b0 < 0xE0 ? 2 : b0 < 0xF0 ? 3 : 4;
      while (skip < want && i + skip < bytes.size()) {
        const auto b = static_cast<unsigned char>(bytes[i + skip]);
        unsigned char lo = 0x80, hi = 0xBF;
        if (skip == 1) {
          if (b0 == 0xE0) lo = 0xA0;
          if (b0 == 0xED) hi = 0x9F;
          if (b0 == 0xF0) lo = 0x90;
          if (b0 == 0xF4) hi = 0x8F;
        }
        if (b < lo || b > hi) break;
        ++skip;
      }
    }
    i += skip;
  }
  return out;
}

}  // namespace pdserve::unicode
