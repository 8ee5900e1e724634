// Reader of the metadata (key/value) section of a GGUF v2/v3 file — enough
// to load a tokenizer vocabulary. Tensor data is not read.
//
// Every read is bounds-checked against the file: a truncated or hostile file
// is an INVALID_ARGUMENT naming the key, never a crash or an allocation
// larger than the file.
#ifndef PDSERVE_ENGINE_MODEL_FILES_GGUF_H_
#define PDSERVE_ENGINE_MODEL_FILES_GGUF_H_

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <variant>
#include <vector>

#include "absl/status/statusor.h"

namespace pdserve {

// One metadata value. Integers of every width are widened to int64 / uint64
// (bools to uint64), floats to double; arrays of scalars and of strings are
// kept as vectors.
using GgufValue = std::variant<int64_t, uint64_t, double, std::string, std::vector<int64_t>,
                               std::vector<double>, std::vector<std::string>>;

struct GgufMetadata {
  uint32_t version = 0;
  std::map<std::string, GgufValue> values;

  // Typed lookups: NOT_FOUND when absent, INVALID_ARGUMENT for another type.
  absl::StatusOr<std::string> GetString(const std::string& key) const;
  absl::StatusOr<int64_t> GetInt(const std::string& key) const;
  absl::StatusOr<std::vector<std::string>> GetStrings(const std::string& key) const;
  absl::StatusOr<std::vector<double>> GetFloats(const std::string& key) const;
  absl::StatusOr<std::vector<int64_t>> GetInts(const std::string& key) const;
};

absl::StatusOr<GgufMetadata> ReadGgufMetadata(const std::filesystem::path& path);
// Same, from the file's bytes (for tests).
absl::StatusOr<GgufMetadata> ParseGgufMetadata(std::string_view bytes);

}  // namespace pdserve

#endif  // PDSERVE_ENGINE_MODEL_FILES_GGUF_H_
