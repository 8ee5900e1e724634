#include "engine/model_files/gguf.h"

#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace pdserve {
namespace {

enum GgufType : uint32_t {
  kU8 = 0, kI8 = 1, kU16 = 2, kI16 = 3, kU32 = 4, kI32 = 5, kF32 = 6, kBool = 7,
  kString = 8, kArray = 9, kU64 = 10, kI64 = 11, kF64 = 12,
};

class Reader {
 public:
  explicit Reader(std::string_view bytes) : b_(bytes) {}

  size_t remaining() const { return b_.size() - pos_; }

  template <typename T>
  absl::StatusOr<T> Scalar() {
    if (remaining() < sizeof(T)) return Truncated();
    T v;
    std::memcpy(&v, b_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }

  absl::StatusOr<std::string> String() {
    PD_ASSIGN_OR_RETURN(uint64_t len, Scalar<uint64_t>());
    if (len > remaining()) return Truncated();
    std::string s(b_.substr(pos_, len));
    pos_ += len;
    return s;
  }

  absl::Status Truncated() const {
    return absl::InvalidArgumentError(absl::StrCat("GGUF: truncated at byte ", pos_));
  }

 private:
  std::string_view b_;
  size_t pos_ = 0;
};

size_t ScalarSize(uint32_t type) {
  switch (type) {
    case kU8: case kI8: case kBool: return 1;
    case kU16: case kI16: return 2;
    case kU32: case kI32: case kF32: return 4;
    case kU64: case kI64: case kF64: return 8;
    default: return 0;
  }
}

// Reads one scalar of `type` as int64 / uint64 / double.
absl::StatusOr<GgufValue> ReadScalar(Reader& r, uint32_t type) {
  switch (type) {
    case kU8: { PD_ASSIGN_OR_RETURN(uint8_t v, r.Scalar<uint8_t>()); return GgufValue(uint64_t{v}); }
    case kBool: { PD_ASSIGN_OR_RETURN(uint8_t v, r.Scalar<uint8_t>()); return GgufValue(uint64_t{v != 0}); }
    case kI8: { PD_ASSIGN_OR_RETURN(int8_t v, r.Scalar<int8_t>()); return GgufValue(int64_t{v}); }
    case kU16: { PD_ASSIGN_OR_RETURN(uint16_t v, r.Scalar<uint16_t>()); return GgufValue(uint64_t{v}); }
    case kI16: { PD_ASSIGN_OR_RETURN(int16_t v, r.Scalar<int16_t>()); return GgufValue(int64_t{v}); }
    case kU32: { PD_ASSIGN_OR_RETURN(uint32_t v, r.Scalar<uint32_t>()); return GgufValue(uint64_t{v}); }
    case kI32: { PD_ASSIGN_OR_RETURN(int32_t v, r.Scalar<int32_t>()); return GgufValue(int64_t{v}); }
    case kU64: { PD_ASSIGN_OR_RETURN(uint64_t v, r.Scalar<uint64_t>()); return GgufValue(v); }
    case kI64: { PD_ASSIGN_OR_RETURN(int64_t v, r.Scalar<int64_t>()); return GgufValue(v); }
    case kF32: { PD_ASSIGN_OR_RETURN(float v, r.Scalar<float>()); return GgufValue(double{v}); }
    case kF64: { PD_ASSIGN_OR_RETURN(double v, r.Scalar<double>()); return GgufValue(v); }
    default: return absl::InvalidArgumentError(absl::StrCat("GGUF: unknown value type ", type));
  }
}

absl::StatusOr<GgufValue> ReadValue(Reader& r, uint32_t type) {
  if (type == kString) {
    PD_ASSIGN_OR_RETURN(std::string s, r.String());
    return GgufValue(std::move(s));
  }
  if (type != kArray) return ReadScalar(r, type);
  PD_ASSIGN_OR_RETURN(uint32_t elem, r.Scalar<uint32_t>());
  PD_ASSIGN_OR_RETURN(uint64_t count, r.Scalar<uint64_t>());
  if (elem == kString) {
    // Each string takes at least its 8-byte length: bound the count by the
    // bytes left before reserving anything.
    if (count > r.remaining() / 8) return r.Truncated();
    std::vector<std::string> v;
    v.reserve(count);
    for (uint64_t i = 0; i < count; ++i) {
      PD_ASSIGN_OR_RETURN(std::string s, r.String());
      v.push_back(std::move(s));
    }
    return GgufValue(std::move(v));
  }
  const size_t size = ScalarSize(elem);
  if (size == 0) return absl::InvalidArgumentError(absl::StrCat("GGUF: unsupported array element type ", elem));
  if (count > r.remaining() / size) return r.Truncated();
  if (elem == kF32 || elem == kF64) {
    std::vector<double> v;
    v.reserve(count);
    for (uint64_t i = 0; i < count; ++i) {
      PD_ASSIGN_OR_RETURN(GgufValue x, ReadScalar(r, elem));
      v.push_back(std::get<double>(x));
    }
    return GgufValue(std::move(v));
  }
  std::vector<int64_t> v;
  v.reserve(count);
  for (uint64_t i = 0; i < count; ++i) {
    PD_ASSIGN_OR_RETURN(GgufValue x, ReadScalar(r, elem));
    v.push_back(std::holds_alternative<int64_t>(x) ? std::get<int64_t>(x)
                                                   : static_cast<int64_t>(std::get<uint64_t>(x)));
  }
  return GgufValue(std::move(v));
}

template <typename T>
absl::StatusOr<T> Get(const GgufMetadata& m, const std::string& key) {
  auto it = m.values.find(key);
  if (it == m.values.end()) return absl::NotFoundError(absl::StrCat("GGUF: no key ", key));
  if (const T* v = std::get_if<T>(&it->second)) return *v;
  return absl::InvalidArgumentError(absl::StrCat("GGUF: key ", key, " has an unexpected type"));
}

}  // namespace

absl::StatusOr<std::string> GgufMetadata::GetString(const std::string& key) const {
  return Get<std::string>(*this, key);
}

absl::StatusOr<int64_t> GgufMetadata::GetInt(const std::string& key) const {
  auto it = values.find(key);
  if (it != values.end() && std::holds_alternative<uint64_t>(it->second)) {
    const uint64_t v = std::get<uint64_t>(it->second);
    if (v > static_cast<uint64_t>(INT64_MAX)) return absl::InvalidArgumentError(absl::StrCat("GGUF: ", key, " out of range"));
    return static_cast<int64_t>(v);
  }
  return Get<int64_t>(*this, key);
}

absl::StatusOr<std::vector<std::string>> GgufMetadata::GetStrings(const std::string& key) const {
  return Get<std::vector<std::string>>(*this, key);
}

absl::StatusOr<std::vector<double>> GgufMetadata::GetFloats(const std::string& key) const {
  return Get<std::vector<double>>(*this, key);
}

absl::StatusOr<std::vector<int64_t>> GgufMetadata::GetInts(const std::string& key) const {
  return Get<std::vector<int64_t>>(*this, key);
}

absl::StatusOr<GgufMetadata> ParseGgufMetadata(std::string_view bytes) {
  Reader r(bytes);
  PD_ASSIGN_OR_RETURN(uint32_t magic, r.Scalar<uint32_t>());
  if (magic != 0x46554747) return absl::InvalidArgumentError("GGUF: bad magic (not a GGUF file)");
  GgufMetadata m;
  PD_ASSIGN_OR_RETURN(m.version, r.Scalar<uint32_t>());
  if (m.version != 2 && m.version != 3) {
    return absl::InvalidArgumentError(absl::StrCat("GGUF: unsupported version ", m.version));
  }
  PD_ASSIGN_OR_RETURN(uint64_t tensors, r.Scalar<uint64_t>());
  PD_ASSIGN_OR_RETURN(uint64_t kv_count, r.Scalar<uint64_t>());
  (void)tensors;
  if (kv_count > r.remaining() / 12) return r.Truncated();  // Key length + type at least.
  for (uint64_t i = 0; i < kv_count; ++i) {
    PD_ASSIGN_OR_RETURN(std::string key, r.String());
    PD_ASSIGN_OR_RETURN(uint32_t type, r.Scalar<uint32_t>());
    auto value = ReadValue(r, type);
    if (!value.ok()) {
      return absl::InvalidArgumentError(absl::StrCat(value.status().message(), " (key ", key, ")"));
    }
    m.values[std::move(key)] = *std::move(value);
  }
  return m;
}

absl::StatusOr<GgufMetadata> ReadGgufMetadata(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot open ", path.string()));
  std::ostringstream s;
  s << in.rdbuf();
  return ParseGgufMetadata(s.str());
}

}  // namespace pdserve
