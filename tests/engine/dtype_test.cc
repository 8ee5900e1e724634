// fp16 / bf16 conversions bit for bit against numpy and torch
// (tests/fixtures/make_dtype_fixtures.py), round trips, the buffer accessors
// and dtype names.
#include "engine/dtype.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace pdserve {
namespace {

const std::string kDir = std::string(PDSERVE_FIXTURES_DIR) + "/dtype/";

template <typename T>
std::vector<T> ReadRecords(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::vector<char> bytes((std::istreambuf_iterator<char>(in)), {});
  EXPECT_EQ(bytes.size() % sizeof(T), 0u) << path;
  std::vector<T> out(bytes.size() / sizeof(T));
  std::memcpy(out.data(), bytes.data(), out.size() * sizeof(T));
  return out;
}

bool IsNanFp16(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0; }
bool IsNanBf16(uint16_t h) { return (h & 0x7f80u) == 0x7f80u && (h & 0x7fu) != 0; }

#pragma pack(push, 1)
struct Record {
  uint32_t f32;
  uint16_t f16;   // numpy: np.float32(x).astype(np.float16)
  uint16_t bf16;  // torch: tensor(x).to(torch.bfloat16)
};
#pragma pack(pop)
static_assert(sizeof(Record) == 8);

TEST(DTypeTest, EveryFp16PatternWidensAsNumpyDoes) {
  const auto want = ReadRecords<uint32_t>(kDir + "fp16_to_f32.bin");
  ASSERT_EQ(want.size(), 65536u);
  for (uint32_t h = 0; h < 65536; ++h) {
    const float got = Fp16ToFloat(static_cast<uint16_t>(h));
    const float ref = std::bit_cast<float>(want[h]);
    if (std::isnan(ref)) {
      ASSERT_TRUE(std::isnan(got)) << "fp16 bits " << h;
    } else {
      ASSERT_EQ(std::bit_cast<uint32_t>(got), want[h]) << "fp16 bits " << h;
    }
    // The buffer accessor reads the same value.
    const uint16_t h16 = static_cast<uint16_t>(h);
    const float loaded = LoadAsFloat(&h16, DType::kF16, 0);
    ASSERT_TRUE(std::bit_cast<uint32_t>(loaded) == std::bit_cast<uint32_t>(got) ||
                (std::isnan(loaded) && std::isnan(got)))
        << h;
  }
}

TEST(DTypeTest, NarrowingRoundsToNearestEvenAsNumpyAndTorchDo) {
  const auto records = ReadRecords<Record>(kDir + "f32_to_16.bin");
  // Edge cases, 4000 random bit patterns, and halfway points with their
  // neighbours for both formats.
  ASSERT_GT(records.size(), 10000u);
  for (const Record& r : records) {
    const float v = std::bit_cast<float>(r.f32);
    uint16_t stored_f16, stored_bf16;
    StoreFromFloat(&stored_f16, DType::kF16, 0, v);
    StoreFromFloat(&stored_bf16, DType::kBF16, 0, v);
    if (std::isnan(v)) {
      // NaN stays NaN (payloads may differ).
      ASSERT_TRUE(IsNanFp16(r.f16) && IsNanBf16(r.bf16)) << "fixture: NaN " << r.f32;
      EXPECT_TRUE(IsNanFp16(FloatToFp16(v))) << "NaN bits " << r.f32;
      EXPECT_TRUE(IsNanBf16(FloatToBf16(v))) << "NaN bits " << r.f32;
      EXPECT_TRUE(IsNanFp16(stored_f16));
      EXPECT_TRUE(IsNanBf16(stored_bf16));
      continue;
    }
    ASSERT_EQ(FloatToFp16(v), r.f16) << "fp16 of " << v << " (bits " << r.f32 << ")";
    ASSERT_EQ(FloatToBf16(v), r.bf16) << "bf16 of " << v << " (bits " << r.f32 << ")";
    ASSERT_EQ(stored_f16, r.f16) << v;
    ASSERT_EQ(stored_bf16, r.bf16) << v;
  }
}

TEST(DTypeTest, EveryHalfValueRoundTripsExactly) {
  // A value the target can hold converts back to the same bits.
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t h16 = static_cast<uint16_t>(h);
    if (IsNanFp16(h16)) {
      EXPECT_TRUE(IsNanFp16(FloatToFp16(Fp16ToFloat(h16)))) << h;
    } else {
      ASSERT_EQ(FloatToFp16(Fp16ToFloat(h16)), h16) << "fp16 bits " << h;
    }
    if (IsNanBf16(h16)) {
      EXPECT_TRUE(IsNanBf16(FloatToBf16(Bf16ToFloat(h16)))) << h;
    } else {
      ASSERT_EQ(std::bit_cast<uint32_t>(Bf16ToFloat(h16)), h << 16) << "bf16 bits " << h;
      ASSERT_EQ(FloatToBf16(Bf16ToFloat(h16)), h16) << "bf16 bits " << h;
    }
  }
}

TEST(DTypeTest, LoadAndStoreThroughEveryTypeAtAnyAlignment) {
  const std::vector<float> values = {-1.0f, -0.5f, 0.0f, 0.5f, 1.0f, 65504.0f, -2.0f / 1024 / 16384};
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) {
    SCOPED_TRACE(DTypeName(t));
    // One byte in, so no element is naturally aligned.
    std::vector<std::byte> buf(1 + values.size() * DTypeSize(t));
    void* data = buf.data() + 1;
    for (size_t i = 0; i < values.size(); ++i) StoreFromFloat(data, t, i, values[i]);
    for (size_t i = 0; i < values.size(); ++i) {
      const float want = t == DType::kBF16 ? Bf16ToFloat(FloatToBf16(values[i])) : values[i];
      EXPECT_EQ(LoadAsFloat(data, t, i), want) << i;
    }
  }
  // f32 storage is bit-exact, NaN payloads included.
  const float payload_nan = std::bit_cast<float>(0x7fa00001u);
  float f;
  StoreFromFloat(&f, DType::kF32, 0, payload_nan);
  EXPECT_EQ(std::bit_cast<uint32_t>(LoadAsFloat(&f, DType::kF32, 0)), 0x7fa00001u);
}

TEST(DTypeTest, NamesParseInBothSpellings) {
  EXPECT_EQ(*ParseDType("F32"), DType::kF32);
  EXPECT_EQ(*ParseDType("float32"), DType::kF32);
  EXPECT_EQ(*ParseDType("F16"), DType::kF16);
  EXPECT_EQ(*ParseDType("float16"), DType::kF16);
  EXPECT_EQ(*ParseDType("BF16"), DType::kBF16);
  EXPECT_EQ(*ParseDType("bfloat16"), DType::kBF16);
  for (DType t : {DType::kF32, DType::kF16, DType::kBF16}) EXPECT_EQ(*ParseDType(DTypeName(t)), t);
  EXPECT_EQ(DTypeName(DType::kBF16), "BF16");
  EXPECT_EQ(DTypeSize(DType::kF32), 4u);
  EXPECT_EQ(DTypeSize(DType::kF16), 2u);
  EXPECT_EQ(DTypeSize(DType::kBF16), 2u);
  for (const char* bad : {"int8", "", "f32", "F8_E4M3", "float64"}) {
    const auto parsed = ParseDType(bad);
    ASSERT_FALSE(parsed.ok()) << bad;
    EXPECT_EQ(parsed.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(parsed.status().message().find(std::string("'") + bad + "'"), std::string::npos)
        << parsed.status();
  }
}

}  // namespace
}  // namespace pdserve
