#include "engine/unicode.h"

#include <algorithm>
#include <optional>
#include <span>

namespace pdserve::unicode {
namespace {

struct CodePointRange {
  char32_t lo, hi;
};
struct CombiningClassRange {
  char32_t lo, hi;
  uint8_t ccc;
};
struct Decomposition {
  char32_t cp, first, second;  // second == 0: a singleton.
};
struct Composition {
  char32_t first, second, composite;
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

// Hangul syllables compose and decompose algorithmically (Unicode 3.12).
constexpr char32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr char32_t kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount,
                   kSCount = kLCount * kNCount;

uint8_t CombiningClass(char32_t cp) {
  if (cp < 0x300) return 0;
  auto it = std::upper_bound(std::begin(kCombiningClass), std::end(kCombiningClass), cp,
                             [](char32_t c, const CombiningClassRange& r) { return c < r.lo; });
  return it != std::begin(kCombiningClass) && cp <= (it - 1)->hi ? (it - 1)->ccc : 0;
}

void Decompose(char32_t cp, std::u32string& out) {
  if (cp >= kSBase && cp < kSBase + kSCount) {
    const char32_t s = cp - kSBase;
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount != 0) out.push_back(kTBase + s % kTCount);
    return;
  }
  auto it = std::lower_bound(std::begin(kDecomposition), std::end(kDecomposition), cp,
                             [](const Decomposition& d, char32_t c) { return d.cp < c; });
  if (it == std::end(kDecomposition) || it->cp != cp) {
    out.push_back(cp);
    return;
  }
  Decompose(it->first, out);
  if (it->second != 0) Decompose(it->second, out);
}

std::optional<char32_t> Compose(char32_t a, char32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount) {
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  }
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase &&
      b < kTBase + kTCount) {
    return a + (b - kTBase);
  }
  auto it = std::lower_bound(std::begin(kComposition), std::end(kComposition), std::pair{a, b},
                             [](const Composition& c, std::pair<char32_t, char32_t> key) {
                               return std::pair{c.first, c.second} < key;
                             });
  if (it == std::end(kComposition) || it->first != a || it->second != b) return std::nullopt;
  return it->composite;
}

}  // namespace

std::string NormalizeNfc(std::string_view text) {
  if (std::all_of(text.begin(), text.end(), [](char c) { return static_cast<unsigned char>(c) < 0x80; })) {
    return std::string(text);  // ASCII is always NFC.
  }
  // Canonical decomposition, then canonical ordering of combining marks.
  std::u32string d;
  for (char32_t cp : DecodeUtf8(text)) Decompose(cp, d);
  for (size_t i = 0; i < d.size();) {
    if (CombiningClass(d[i]) == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < d.size() && CombiningClass(d[j]) != 0) ++j;
    std::stable_sort(d.begin() + i, d.begin() + j,
                     [](char32_t a, char32_t b) { return CombiningClass(a) < CombiningClass(b); });
    i = j;
  }
  // Canonical composition: each character joins the last starter unless a
  // character of the same or higher class (or a starter) stands between.
  std::u32string out;
  size_t starter = std::u32string::npos;
  int last_class = -1;
  for (char32_t cp : d) {
    const int cc = CombiningClass(cp);
    if (starter != std::u32string::npos && (last_class < cc || (last_class == 0 && starter == out.size() - 1))) {
      if (auto c = Compose(out[starter], cp)) {
        out[starter] = *c;
        continue;
      }
    }
    if (cc == 0) starter = out.size();
    last_class = cc;
    out.push_back(cp);
  }
  std::string result;
  result.reserve(text.size());
  for (char32_t cp : out) AppendUtf8(cp, result);
  return result;
}

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
