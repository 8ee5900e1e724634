#include "engine/dtype.h"

#include <cmath>

#include "absl/strings/str_cat.h"

namespace pdserve {

std::string_view DTypeName(DType t) {
  switch (t) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
    case DType::kQ8:
      return "Q8";
  }
  return "?";
}

absl::StatusOr<DType> ParseDType(std::string_view name) {
  if (name == "F32" || name == "float32") return DType::kF32;
  if (name == "F16" || name == "float16") return DType::kF16;
  if (name == "BF16" || name == "bfloat16") return DType::kBF16;
  return absl::InvalidArgumentError(
      absl::StrCat("unsupported dtype '", std::string(name), "' (expected F32, F16 or BF16)"));
}

float Fp16ToFloat(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t mant = h & 0x3ffu;
  if (exp == 0) {  // Zero or subnormal: mant * 2^-24.
    float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  if (exp == 31) {  // Inf or NaN.
    return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  }
  return std::bit_cast<float>(sign | ((exp + 112) << 23) | (mant << 13));
}

uint16_t FloatToFp16(float f) {
  const uint32_t bits = std::bit_cast<uint32_t>(f);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t abs = bits & 0x7fffffffu;
  if (abs > 0x7f800000u) return sign | 0x7e00u;      // NaN.
  if (abs >= 0x477ff000u) return sign | 0x7c00u;     // Overflow rounds to inf.
  if (abs < 0x38800000u) {                           // Subnormal or zero.
    const float v = std::bit_cast<float>(abs);
    return sign | static_cast<uint16_t>(std::nearbyint(std::ldexp(v, 24)));
  }
  uint32_t m = abs + 0xfffu + ((abs >> 13) & 1u);    // Round to nearest even.
  return sign | static_cast<uint16_t>((m - (112u << 23)) >> 13);
}

}  // namespace pdserve
