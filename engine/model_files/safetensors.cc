#include "engine/model_files/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace pdserve {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

// The header is JSON of at most this size; larger is a corrupt or hostile
// file (real headers are a few hundred KiB at most).
constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;

absl::Status Invalid(const fs::path& path, std::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(
      "safetensors file ", path.string(), ": ", std::string(what)));
}

// Fills `t` from one header entry, checking it against the data section.
absl::Status ParseEntry(const fs::path& path, const std::string& name,
                        const Json& e, const std::byte* data,
                        uint64_t data_size, TensorView& t) {
  auto where = [&](std::string_view what) {
    return Invalid(path,
                   absl::StrCat("tensor '", name, "' ", std::string(what)));
  };
  if (!e.is_object()) return where("has a malformed entry");
  auto dtype = e.find("dtype");
  auto shape = e.find("shape");
  auto offsets = e.find("data_offsets");
  if (dtype == e.end() || !dtype->is_string()) return where("has no dtype");
  if (shape == e.end() || !shape->is_array()) return where("has no shape");
  if (offsets == e.end() || !offsets->is_array() || offsets->size() != 2 ||
      !(*offsets)[0].is_number_unsigned() ||
      !(*offsets)[1].is_number_unsigned()) {
    return where("has malformed data_offsets");
  }
  // Only F32/F16/BF16 are accepted. Other dtypes (I64 position ids, F64,
  // bool masks) are rejected rather than skipped: Llama-family checkpoints
  // hold none, and skipping would turn a file we misread into a model that
  // is missing a tensor, reported later and further from the cause.
  auto parsed = ParseDType(dtype->get<std::string>());
  if (!parsed.ok()) return where(std::string(parsed.status().message()));
  t.name = name;
  t.dtype = *parsed;
  uint64_t elements = 1;
  for (const Json& d : *shape) {
    if (!d.is_number_unsigned())
      return where("has a negative or non-integer dimension");
    const uint64_t dim = d.get<uint64_t>();
    // 2^48 elements bounds the byte count below 2^51: no product overflows.
    if (dim != 0 && elements > (uint64_t{1} << 48) / dim)
      return where("has an overflowing shape");
    elements *= dim;
    t.shape.push_back(static_cast<int64_t>(dim));
  }
  const uint64_t begin = (*offsets)[0].get<uint64_t>();
  const uint64_t end = (*offsets)[1].get<uint64_t>();
  if (begin > end || end > data_size) {
    return where(absl::StrCat("has data_offsets [", begin, ", ", end,
                              ") outside the ", data_size,
                              "-byte data section"));
  }
  if (end - begin != elements * DTypeSize(t.dtype)) {
    return where(absl::StrCat("holds ", end - begin,
                              " bytes but its shape needs ",
                              elements * DTypeSize(t.dtype)));
  }
  t.bytes = std::span<const std::byte>(data + begin, end - begin);
  return absl::OkStatus();
}

absl::StatusOr<std::string> ReadText(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in)
    return absl::NotFoundError(absl::StrCat("cannot open ", path.string()));
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

}  // namespace

int64_t TensorView::num_elements() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

SafetensorsFile::~SafetensorsFile() {
  if (mapping_ != nullptr) munmap(mapping_, mapping_size_);
}

absl::StatusOr<std::unique_ptr<SafetensorsFile>> SafetensorsFile::Open(
    const fs::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    return absl::NotFoundError(absl::StrCat("cannot open ", path.string(), ": ",
                                            std::strerror(errno)));
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return Invalid(path, "is not a regular file");
  }
  std::unique_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  if (size < 8) {
    ::close(fd);
    return Invalid(path,
                   absl::StrCat("is ", size, " bytes, too short for a header"));
  }
  void* map = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED)
    return Invalid(path,
                   absl::StrCat("cannot be mapped: ", std::strerror(errno)));
  file->mapping_ = map;
  file->mapping_size_ = size;
  const auto* base = static_cast<const std::byte*>(map);

  uint64_t header_len;
  std::memcpy(&header_len, base, 8);  // Little-endian, as every supported host.
  if (header_len > kMaxHeaderBytes || header_len > size - 8) {
    return Invalid(path, absl::StrCat("header length ", header_len,
                                      " exceeds the file size ", size));
  }
  const char* header = reinterpret_cast<const char*>(base + 8);
  Json j = Json::parse(header, header + header_len, nullptr,
                       /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    return Invalid(path, "header is not a JSON object");
  const std::byte* data = base + 8 + header_len;
  const uint64_t data_size = size - 8 - header_len;
  for (auto& [name, entry] : j.items()) {
    if (name == "__metadata__") continue;
    TensorView t;
    PD_RETURN_IF_ERROR(ParseEntry(path, name, entry, data, data_size, t));
    file->tensors_.push_back(std::move(t));
  }
  std::sort(
      file->tensors_.begin(), file->tensors_.end(),
      [](const TensorView& a, const TensorView& b) { return a.name < b.name; });
  return file;
}

const TensorView* SafetensorsFile::Find(std::string_view name) const {
  auto it = std::lower_bound(
      tensors_.begin(), tensors_.end(), name,
      [](const TensorView& t, std::string_view n) { return t.name < n; });
  return it != tensors_.end() && it->name == name ? &*it : nullptr;
}

absl::StatusOr<std::unique_ptr<Checkpoint>> Checkpoint::Open(
    const fs::path& dir) {
  std::unique_ptr<Checkpoint> ckpt(new Checkpoint());
  const fs::path index = dir / "model.safetensors.index.json";
  if (fs::exists(index)) {
    PD_ASSIGN_OR_RETURN(std::string text, ReadText(index));
    Json j = Json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object() || !j.contains("weight_map") ||
        !j["weight_map"].is_object()) {
      return absl::InvalidArgumentError(absl::StrCat(
          index.string(), ": not a JSON object with a weight_map"));
    }
    const Json& weight_map = j["weight_map"];
    if (weight_map.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(index.string(), ": weight_map is empty"));
    }
    std::set<std::string> shards;
    for (auto& [tensor, shard] : weight_map.items()) {
      if (!shard.is_string()) {
        return absl::InvalidArgumentError(
            absl::StrCat(index.string(), ": weight_map entry for '", tensor,
                         "' is not a file name"));
      }
      const std::string name = shard.get<std::string>();
      if (name.empty() || name.find('/') != std::string::npos || name == "..") {
        return absl::InvalidArgumentError(
            absl::StrCat(index.string(), ": shard name '", name,
                         "' is not a plain file name"));
      }
      shards.insert(name);
    }
    for (const std::string& shard : shards) {
      if (!fs::exists(dir / shard)) {
        return absl::NotFoundError(absl::StrCat(
            "shard ", shard, " listed in ", index.string(), " does not exist"));
      }
      PD_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(dir / shard));
      ckpt->files_.push_back(std::move(file));
    }
    // Each listed tensor must be where the index says (a stale index would
    // otherwise surface as a missing tensor at load time).
    for (auto& [tensor, shard] : weight_map.items()) {
      const std::string name = shard.get<std::string>();
      auto file = std::find_if(
          ckpt->files_.begin(), ckpt->files_.end(),
          [&](const auto& f) { return f->path().filename() == name; });
      if (file == ckpt->files_.end() || (*file)->Find(tensor) == nullptr) {
        return absl::InvalidArgumentError(
            absl::StrCat(index.string(), ": tensor '", tensor,
                         "' is not in its shard ", name));
      }
    }
  } else {
    const fs::path single = dir / "model.safetensors";
    if (!fs::exists(single)) {
      return absl::NotFoundError(absl::StrCat(
          "no model.safetensors or model.safetensors.index.json in ",
          dir.string()));
    }
    PD_ASSIGN_OR_RETURN(auto file, SafetensorsFile::Open(single));
    ckpt->files_.push_back(std::move(file));
  }
  return ckpt;
}

bool Checkpoint::Has(std::string_view name) const {
  for (const auto& f : files_) {
    if (f->Find(name) != nullptr) return true;
  }
  return false;
}

absl::StatusOr<TensorView> Checkpoint::Get(std::string_view name) const {
  for (const auto& f : files_) {
    if (const TensorView* t = f->Find(name)) return *t;
  }
  return absl::NotFoundError(absl::StrCat("tensor '", std::string(name),
                                          "' not found in the checkpoint"));
}

absl::StatusOr<TensorView> Checkpoint::GetWithShape(
    std::string_view name, std::span<const int64_t> shape) const {
  PD_ASSIGN_OR_RETURN(TensorView t, Get(name));
  if (!std::equal(t.shape.begin(), t.shape.end(), shape.begin(), shape.end())) {
    auto dims = [](auto s) {
      std::string out = "[";
      for (size_t i = 0; i < s.size(); ++i)
        absl::StrAppend(&out, i ? ", " : "", s[i]);
      return out + "]";
    };
    return absl::InvalidArgumentError(
        absl::StrCat("tensor '", std::string(name), "' has shape ",
                     dims(t.shape), ", expected ", dims(shape)));
  }
  return t;
}

absl::Status WriteSafetensors(const fs::path& path,
                              std::span<const TensorToWrite> tensors) {
  Json header = Json::object();
  header["__metadata__"] = {{"format", "pt"}};
  uint64_t offset = 0;
  for (const TensorToWrite& t : tensors) {
    if (t.name == "__metadata__" || header.contains(t.name)) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor name '", t.name, "' is reserved or repeated"));
    }
    uint64_t elements = 1;
    for (int64_t d : t.shape) {
      if (d < 0)
        return absl::InvalidArgumentError(
            absl::StrCat("tensor '", t.name, "' has a negative dimension"));
      if (d != 0 && elements > (uint64_t{1} << 48) / static_cast<uint64_t>(d)) {
        return absl::InvalidArgumentError(
            absl::StrCat("tensor '", t.name, "' has an overflowing shape"));
      }
      elements *= static_cast<uint64_t>(d);
    }
    if (elements * DTypeSize(t.dtype) != t.bytes.size()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "tensor '", t.name, "' has ", t.bytes.size(),
          " bytes for its shape's ", elements * DTypeSize(t.dtype)));
    }
    header[t.name] = {{"dtype", std::string(DTypeName(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.bytes.size()}}};
    offset += t.bytes.size();
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // Data starts 8-byte aligned.
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  if (!out)
    return absl::PermissionDeniedError(
        absl::StrCat("cannot write ", path.string()));
  const uint64_t len = text.size();
  out.write(reinterpret_cast<const char*>(&len), 8);
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  for (const TensorToWrite& t : tensors) {
    out.write(reinterpret_cast<const char*>(t.bytes.data()),
              static_cast<std::streamsize>(t.bytes.size()));
  }
  out.close();
  if (!out)
    return absl::DataLossError(absl::StrCat("error writing ", path.string()));
  return absl::OkStatus();
}

}  // namespace pdserve
