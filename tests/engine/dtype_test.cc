// fp16 / bf16 conversions bit for bit against numpy and torch
// (tests/fixtures/make_dtype_fixtures.py).
#include "engine/dtype.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <vector>

#include "gtest/gtest.h"

namespace pdserve {
namespace {

const std::string kDir = std::string(PDSERVE_FIXTURES_DIR) + "/dtype/";

template <typename T>
std::vector<T> ReadRecords(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), {});
  std::vector<T> out(bytes.size() / sizeof(T));
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(T));
  return out;
}

TEST(DTypeTest, EveryFp16PatternWidensAsNumpyDoes) {
  const auto want = ReadRecords<uint32_t>(kDir + "fp16_to_f32.bin");
  ASSERT_EQ(want.size(), 65536u);
  for (uint32_t h = 0; h < 65536; ++h) {
    const float got = Fp16ToFloat(static_cast<uint16_t>(h));
    const float ref = std::bit_cast<float>(want[h]);
    if (std::isnan(ref)) {
      EXPECT_TRUE(std::isnan(got)) << h;
    } else {
      ASSERT_EQ(std::bit_cast<uint32_t>(got), want[h]) << "fp16 bits " << h;
    }
  }
}

#pragma pack(push, 1)
struct Record {
  uint32_t f32;
  uint16_t f16;
  uint16_t bf16;
};
#pragma pack(pop)

TEST(DTypeTest, NarrowingRoundsToNearestEvenAsNumpyAndTorchDo) {
  const auto records = ReadRecords<Record>(kDir + "f32_to_16.bin");
  ASSERT_GT(records.size(), 4000u);
  for (const Record& r : records) {
    const float v = std::bit_cast<float>(r.f32);
    if (std::isnan(v)) {
      EXPECT_TRUE(std::isnan(Fp16ToFloat(FloatToFp16(v))));
      EXPECT_TRUE(std::isnan(Bf16ToFloat(FloatToBf16(v))));
      continue;
    }
    ASSERT_EQ(FloatToFp16(v), r.f16) << "fp16 of " << v << " (bits " << r.f32 << ")";
    ASSERT_EQ(FloatToBf16(v), r.bf16) << "bf16 of " << v << " (bits " << r.f32 << ")";
  }
}

TEST(DTypeTest, LoadAndStoreThroughEveryType) {
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    std::vector<std::byte> buf(4 * DTypeSize(t));
    for (int i = 0; i < 4; ++i) StoreFromFloat(buf.data(), t, i, 0.5f * i - 1.0f);
    for (int i = 0; i < 4; ++i) EXPECT_EQ(LoadAsFloat(buf.data(), t, i), 0.5f * i - 1.0f);
  }
  EXPECT_EQ(*ParseDType("bfloat16"), DType::kBF16);
  EXPECT_EQ(*ParseDType("F16"), DType::kF16);
  EXPECT_EQ(ParseDType("int8").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(DTypeName(DType::kBF16), "BF16");
}

}  // namespace
}  // namespace pdserve
