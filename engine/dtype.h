// Element types of weights, activations and KV blocks, and the scalar
// conversions between them. Conversions are exact where the target can hold
// the value; float -> bf16/fp16 rounds to nearest even.
#ifndef PDSERVE_ENGINE_DTYPE_H_
#define PDSERVE_ENGINE_DTYPE_H_

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "absl/status/statusor.h"

namespace pdserve {

// kQ8 is not an element type but the cpu backend's int8 weight format,
// made at load (ModelRunnerOptions::int8_weights): symmetric int8 weights,
// one fp16 scale per group of kQ8Group consecutive weights of a row,
// weight = int8 * scale, laid out for the kernels (cpu::QuantizeToQ8 says
// how). It never comes from a file, a KV block or the wire: ParseDType
// rejects it, and LoadAsFloat / StoreFromFloat do not take it.
enum class DType : uint8_t { kF32 = 0, kF16 = 1, kBF16 = 2, kQ8 = 3 };

inline constexpr int64_t kQ8Group = 32;
// kQ8 rows come in blocks of this many (the last padded with zero rows).
inline constexpr int64_t kQ8BlockRows = 16;
// Bytes of one block's group: its int8 weights and their fp16 scales.
inline constexpr int64_t kQ8UnitBytes = kQ8BlockRows * (kQ8Group + 2);

// Bytes of one element; for kQ8 its int8 (MatrixBytes counts the rest).
constexpr size_t DTypeSize(DType t) {
  return t == DType::kF32 ? 4 : t == DType::kQ8 ? 1 : 2;
}

// Bytes of a rows x cols matrix.
constexpr size_t MatrixBytes(DType t, int64_t rows, int64_t cols) {
  if (t != DType::kQ8) return static_cast<size_t>(rows * cols) * DTypeSize(t);
  const int64_t blocks = (rows + kQ8BlockRows - 1) / kQ8BlockRows;
  const int64_t groups = (cols + kQ8Group - 1) / kQ8Group;
  return static_cast<size_t>(blocks * groups * kQ8UnitBytes);
}

// "F32", "F16", "BF16" (the safetensors spelling), "Q8".
std::string_view DTypeName(DType t);
// Accepts the safetensors spelling ("F32", "BF16", ...) and the
// config.json `torch_dtype` spelling ("float32", "bfloat16", ...).
absl::StatusOr<DType> ParseDType(std::string_view name);

inline float Bf16ToFloat(uint16_t h) {
  return std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
}

inline uint16_t FloatToBf16(float f) {
  uint32_t bits = std::bit_cast<uint32_t>(f);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;  // NaN stays NaN.
  bits += 0x7fffu + ((bits >> 16) & 1u);                  // Round to nearest even.
  return static_cast<uint16_t>(bits >> 16);
}

float Fp16ToFloat(uint16_t h);
uint16_t FloatToFp16(float f);

// Reads element `i` of a buffer of type `t` as float. For cold paths
// (loading, tests); the kernels have vectorized versions.
inline float LoadAsFloat(const void* data, DType t, size_t i) {
  const auto* bytes = static_cast<const std::byte*>(data);
  if (t == DType::kF32) {
    float f;
    std::memcpy(&f, bytes + 4 * i, 4);
    return f;
  }
  uint16_t h;
  std::memcpy(&h, bytes + 2 * i, 2);
  return t == DType::kBF16 ? Bf16ToFloat(h) : Fp16ToFloat(h);
}

inline void StoreFromFloat(void* data, DType t, size_t i, float v) {
  auto* bytes = static_cast<std::byte*>(data);
  if (t == DType::kF32) {
    std::memcpy(bytes + 4 * i, &v, 4);
    return;
  }
  uint16_t h = t == DType::kBF16 ? FloatToBf16(v) : FloatToFp16(v);
  std::memcpy(bytes + 2 * i, &h, 2);
}

}  // namespace pdserve

#endif  // PDSERVE_ENGINE_DTYPE_H_
