// Reading and writing safetensors files, and a model directory's checkpoint
// (one `model.safetensors`, or shards listed by `model.safetensors.index.json`).
//
// Files are memory-mapped read-only; a TensorView points into the mapping and
// stays valid while the SafetensorsFile / Checkpoint that returned it lives.
// Every malformed input (short file, bad header JSON, offsets outside the
// data, a shape that does not match the byte length, an unknown dtype, a
// missing shard) is an INVALID_ARGUMENT / NOT_FOUND status naming the file
// and tensor; nothing is read outside the mapping.
//
// Thread-safety: immutable after Open(); const methods are safe to call
// concurrently.
#ifndef PDSERVE_ENGINE_MODEL_FILES_SAFETENSORS_H_
#define PDSERVE_ENGINE_MODEL_FILES_SAFETENSORS_H_

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "engine/dtype.h"

namespace pdserve {

struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  // Raw little-endian elements, row-major; not necessarily aligned.
  std::span<const std::byte> bytes;

  int64_t num_elements() const;
};

class SafetensorsFile {
 public:
  static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(
      const std::filesystem::path& path);
  ~SafetensorsFile();

  const std::vector<TensorView>& tensors() const { return tensors_; }
  // nullptr when absent.
  const TensorView* Find(std::string_view name) const;
  const std::filesystem::path& path() const { return path_; }

 private:
  SafetensorsFile() = default;
  std::filesystem::path path_;
  void* mapping_ = nullptr;
  size_t mapping_size_ = 0;
  std::vector<TensorView> tensors_;  // Sorted by name.
};

class Checkpoint {
 public:
  // `dir` holds model.safetensors, or model.safetensors.index.json and the
  // shards it names.
  static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(
      const std::filesystem::path& dir);

  bool Has(std::string_view name) const;
  // NOT_FOUND naming the tensor when it is absent.
  absl::StatusOr<TensorView> Get(std::string_view name) const;
  // Also INVALID_ARGUMENT when the shape differs from `shape`.
  absl::StatusOr<TensorView> GetWithShape(std::string_view name,
                                          std::span<const int64_t> shape) const;

 private:
  Checkpoint() = default;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
};

struct TensorToWrite {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::span<const std::byte> bytes;  // Must hold exactly the shape's elements.
};

// Writes a safetensors file (with "__metadata__": {"format": "pt"}).
absl::Status WriteSafetensors(const std::filesystem::path& path,
                              std::span<const TensorToWrite> tensors);

}  // namespace pdserve

#endif  // PDSERVE_ENGINE_MODEL_FILES_SAFETENSORS_H_
