// Safetensors: round trips, and a precise error for every malformed file.
#include "engine/safetensors.h"

#include <cstring>
#include <filesystem>
#include <fstream>

#include "gtest/gtest.h"

namespace pdserve {
namespace {

namespace fs = std::filesystem;

fs::path TempPath(const std::string& name) { return fs::path(testing::TempDir()) / name; }

void WriteBytes(const fs::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
}

std::string ReadBytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// A file with the given header JSON and `data_bytes` zero bytes of data.
std::string RawFile(const std::string& header, size_t data_bytes) {
  std::string out(8, '\0');
  const uint64_t len = header.size();
  std::memcpy(out.data(), &len, 8);
  return out + header + std::string(data_bytes, '\0');
}

absl::Status OpenRaw(const std::string& name, const std::string& bytes) {
  WriteBytes(TempPath(name), bytes);
  return SafetensorsFile::Open(TempPath(name)).status();
}

TEST(SafetensorsTest, WriteThenReadRoundTrips) {
  const std::vector<float> a = {1.5f, -2.0f, 3.25f, 0.0f, 1e-8f, -7.0f};
  const std::vector<uint16_t> b = {0x3f80, 0xc000, 0x7f80};  // bf16 1, -2, inf
  const std::vector<TensorToWrite> tensors = {
      {"a.weight", DType::kF32, {2, 3}, std::as_bytes(std::span(a))},
      {"b", DType::kBF16, {3}, std::as_bytes(std::span(b))},
      {"empty", DType::kF16, {0, 4}, {}},
  };
  ASSERT_TRUE(WriteSafetensors(TempPath("rt.safetensors"), tensors).ok());
  auto f = SafetensorsFile::Open(TempPath("rt.safetensors"));
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ((*f)->tensors().size(), 3u);
  const TensorView* ta = (*f)->Find("a.weight");
  ASSERT_NE(ta, nullptr);
  EXPECT_EQ(ta->dtype, DType::kF32);
  EXPECT_EQ(ta->shape, (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(ta->num_elements(), 6);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_EQ(LoadAsFloat(ta->bytes.data(), DType::kF32, i), a[i]);
  const TensorView* tb = (*f)->Find("b");
  ASSERT_NE(tb, nullptr);
  EXPECT_EQ(LoadAsFloat(tb->bytes.data(), DType::kBF16, 1), -2.0f);
  EXPECT_EQ((*f)->Find("missing"), nullptr);
  // Data starts 8-byte aligned after the header.
  const std::string raw = ReadBytes(TempPath("rt.safetensors"));
  uint64_t header_len;
  std::memcpy(&header_len, raw.data(), 8);
  EXPECT_EQ(header_len % 8, 0u);
}

TEST(SafetensorsTest, WriteRejectsALengthThatDoesNotMatchTheShape) {
  const std::vector<float> a = {1, 2, 3};
  const std::vector<TensorToWrite> t = {{"a", DType::kF32, {2, 2}, std::as_bytes(std::span(a))}};
  EXPECT_EQ(WriteSafetensors(TempPath("bad.safetensors"), t).code(), absl::StatusCode::kInvalidArgument);
}

TEST(SafetensorsTest, MalformedFilesGivePreciseErrors) {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(SafetensorsFile::Open(TempPath("does-not-exist")).status().code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(OpenRaw("short", "abc"), absl::InvalidArgumentError(
      "safetensors file " + TempPath("short").string() + ": is 3 bytes, too short for a header"));
  {  // Header length beyond the file.
    std::string f = RawFile("{}", 0);
    const uint64_t huge = 1000;
    std::memcpy(f.data(), &huge, 8);
    auto s = OpenRaw("hdrlen", f);
    EXPECT_EQ(s.code(), kInvalid);
    EXPECT_NE(s.message().find("header length 1000"), std::string::npos) << s;
  }
  {  // Absurd header length (would overflow 8 + len).
    std::string f = RawFile("{}", 0);
    const uint64_t huge = ~uint64_t{0};
    std::memcpy(f.data(), &huge, 8);
    EXPECT_EQ(OpenRaw("hdrhuge", f).code(), kInvalid);
  }
  EXPECT_EQ(OpenRaw("badjson", RawFile("{\"a\": ", 0)).code(), kInvalid);
  EXPECT_EQ(OpenRaw("notobject", RawFile("[1, 2]", 0)).code(), kInvalid);
  {
    auto s = OpenRaw("dtype", RawFile(R"({"w": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}})", 8));
    EXPECT_EQ(s.code(), kInvalid);
    EXPECT_NE(s.message().find("tensor 'w'"), std::string::npos) << s;
    EXPECT_NE(s.message().find("I64"), std::string::npos) << s;
  }
  {
    auto s = OpenRaw("range", RawFile(R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})", 8));
    EXPECT_EQ(s.code(), kInvalid);
    EXPECT_NE(s.message().find("outside"), std::string::npos) << s;
  }
  EXPECT_EQ(OpenRaw("reversed", RawFile(R"({"w": {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}})", 8)).code(), kInvalid);
  {
    auto s = OpenRaw("mismatch", RawFile(R"({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", 8));
    EXPECT_EQ(s.code(), kInvalid);
    EXPECT_NE(s.message().find("shape needs 12"), std::string::npos) << s;
  }
  EXPECT_EQ(OpenRaw("overflow", RawFile(R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296, 4294967296], "data_offsets": [0, 8]}})", 8)).code(), kInvalid);
  EXPECT_EQ(OpenRaw("negative", RawFile(R"({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})", 8)).code(), kInvalid);
  EXPECT_EQ(OpenRaw("noshape", RawFile(R"({"w": {"dtype": "F32", "data_offsets": [0, 4]}})", 8)).code(), kInvalid);
  EXPECT_EQ(OpenRaw("badoffsets", RawFile(R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})", 8)).code(), kInvalid);
  EXPECT_EQ(OpenRaw("entry", RawFile(R"({"w": 5})", 8)).code(), kInvalid);
  EXPECT_TRUE(OpenRaw("metadata", RawFile(R"({"__metadata__": {"format": "pt"}})", 0)).ok());
}

TEST(SafetensorsTest, EveryTruncationOfARealFileIsRejectedCleanly) {
  const std::vector<float> a(64, 1.0f);
  const std::vector<TensorToWrite> t = {{"a", DType::kF32, {8, 8}, std::as_bytes(std::span(a))},
                                        {"b", DType::kF32, {64}, std::as_bytes(std::span(a))}};
  ASSERT_TRUE(WriteSafetensors(TempPath("full.safetensors"), t).ok());
  const std::string full = ReadBytes(TempPath("full.safetensors"));
  for (size_t n = 0; n < full.size(); n += 7) {
    EXPECT_FALSE(OpenRaw("cut", full.substr(0, n)).ok()) << "truncated to " << n;
  }
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = TempPath("ckpt-" + std::string(::testing::UnitTest::GetInstance()->current_test_info()->name()));
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void WriteShard(const std::string& name, const std::string& tensor, std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    storage_.emplace_back(n, 0.5f);
    const std::vector<TensorToWrite> t = {{tensor, DType::kF32, shape, std::as_bytes(std::span(storage_.back()))}};
    ASSERT_TRUE(WriteSafetensors(dir_ / name, t).ok());
  }
  fs::path dir_;
  std::vector<std::vector<float>> storage_;
};

TEST_F(CheckpointTest, ShardedCheckpointFindsEveryTensor) {
  WriteShard("model-00001-of-00002.safetensors", "x.weight", {2, 3});
  WriteShard("model-00002-of-00002.safetensors", "y.weight", {4});
  WriteBytes(dir_ / "model.safetensors.index.json",
             R"({"metadata": {}, "weight_map": {"x.weight": "model-00001-of-00002.safetensors",
                                               "y.weight": "model-00002-of-00002.safetensors"}})");
  auto c = Checkpoint::Open(dir_);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_TRUE((*c)->Has("x.weight"));
  EXPECT_TRUE((*c)->Has("y.weight"));
  const int64_t shape[] = {4};
  EXPECT_TRUE((*c)->GetWithShape("y.weight", shape).ok());
  const int64_t wrong[] = {2, 2};
  auto bad = (*c)->GetWithShape("x.weight", wrong);
  EXPECT_EQ(bad.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("[2, 3], expected [2, 2]"), std::string::npos) << bad.status();
  EXPECT_EQ((*c)->Get("z").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(CheckpointTest, MissingShardOrBadIndexIsAnError) {
  WriteShard("a.safetensors", "x", {1});
  WriteBytes(dir_ / "model.safetensors.index.json", R"({"weight_map": {"x": "a.safetensors", "y": "b.safetensors"}})");
  auto c = Checkpoint::Open(dir_);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(c.status().message().find("b.safetensors"), std::string::npos) << c.status();
  WriteBytes(dir_ / "model.safetensors.index.json", R"({"weight_map": {"x": "../a.safetensors"}})");
  EXPECT_EQ(Checkpoint::Open(dir_).status().code(), absl::StatusCode::kInvalidArgument);
  WriteBytes(dir_ / "model.safetensors.index.json", "{not json");
  EXPECT_EQ(Checkpoint::Open(dir_).status().code(), absl::StatusCode::kInvalidArgument);
  fs::remove(dir_ / "model.safetensors.index.json");
  EXPECT_EQ(Checkpoint::Open(dir_).status().code(), absl::StatusCode::kNotFound);  // No model.safetensors.
}

}  // namespace
}  // namespace pdserve
