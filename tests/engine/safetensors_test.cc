// Safetensors: round trips, and a precise error for every malformed file.
#include "engine/model_files/safetensors.h"

#include <cstring>
#include <filesystem>
#include <fstream>

#include "gtest/gtest.h"

namespace pdserve {
namespace {

namespace fs = std::filesystem;

// A path private to the running test: ctest runs tests in parallel processes
// and other test binaries share the temp directory.
fs::path TempPath(const std::string& name) {
  const fs::path dir =
      fs::path(testing::TempDir()) /
      (std::string("safetensors_test-") +
       testing::UnitTest::GetInstance()->current_test_info()->name());
  fs::create_directories(dir);
  return dir / name;
}

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
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_EQ(LoadAsFloat(ta->bytes.data(), DType::kF32, i), a[i]);
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

TEST(SafetensorsTest, ScalarsRoundTrip) {
  const float x = 42.0f;
  const std::vector<TensorToWrite> tensors = {
      {"scalar", DType::kF32, {}, std::as_bytes(std::span(&x, 1))}};
  ASSERT_TRUE(WriteSafetensors(TempPath("scalar.safetensors"), tensors).ok());
  auto f = SafetensorsFile::Open(TempPath("scalar.safetensors"));
  ASSERT_TRUE(f.ok()) << f.status();
  const TensorView* t = (*f)->Find("scalar");
  ASSERT_NE(t, nullptr);
  EXPECT_TRUE(t->shape.empty());
  EXPECT_EQ(t->num_elements(), 1);
  EXPECT_EQ(LoadAsFloat(t->bytes.data(), DType::kF32, 0), 42.0f);
}

TEST(SafetensorsTest, WriteRejectsBadTensors) {
  const std::vector<float> a = {1, 2, 3};
  const auto bytes = std::as_bytes(std::span(a));
  const auto write = [](std::vector<TensorToWrite> t) {
    return WriteSafetensors(TempPath("bad.safetensors"), t);
  };
  EXPECT_EQ(write({{"a", DType::kF32, {2, 2}, bytes}}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(write({{"a", DType::kF32, {-3}, bytes}}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(
      write({{"a", DType::kF32, {3}, bytes}, {"a", DType::kF32, {3}, bytes}})
          .code(),
      absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(write({{"__metadata__", DType::kF32, {3}, bytes}}).code(),
            absl::StatusCode::kInvalidArgument);
  // 2^32 * 2^32 * 4 bytes wraps to 0 in 64 bits: still rejected.
  EXPECT_EQ(
      write({{"a", DType::kF32, {int64_t{1} << 32, int64_t{1} << 32}, {}}})
          .code(),
      absl::StatusCode::kInvalidArgument);
}

TEST(SafetensorsTest, MalformedFilesGivePreciseErrors) {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  EXPECT_EQ(SafetensorsFile::Open(TempPath("does-not-exist")).status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(OpenRaw("short", "abc"),
            absl::InvalidArgumentError("safetensors file " +
                                       TempPath("short").string() +
                                       ": is 3 bytes, too short for a header"));
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
  // The error names the file and says what is wrong with which tensor.
  auto expect_error = [&](const std::string& name, const std::string& bytes,
                          const std::string& what) {
    const absl::Status s = OpenRaw(name, bytes);
    EXPECT_EQ(s.code(), kInvalid) << name << ": " << s;
    EXPECT_NE(s.message().find(TempPath(name).string()), std::string::npos)
        << s;
    EXPECT_NE(s.message().find(what), std::string::npos) << name << ": " << s;
  };
  expect_error("badjson", RawFile("{\"a\": ", 0),
               "header is not a JSON object");
  expect_error("notobject", RawFile("[1, 2]", 0),
               "header is not a JSON object");
  expect_error(
      "f64",
      RawFile(
          R"({"w": {"dtype": "F64", "shape": [1], "data_offsets": [0, 8]}})",
          8),
      "tensor 'w' unsupported dtype 'F64'");
  expect_error(
      "lowercase",
      RawFile(
          R"({"w": {"dtype": "f32", "shape": [1], "data_offsets": [0, 4]}})",
          8),
      "'f32'");
  expect_error(
      "overflow2",
      RawFile(
          R"({"w": {"dtype": "BF16", "shape": [65536, 65536, 65536, 2], "data_offsets": [0, 8]}})",
          8),
      "tensor 'w' has an overflowing shape");
  expect_error(
      "reversed2",
      RawFile(
          R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [8, 4]}})",
          8),
      "data_offsets [8, 4) outside the 8-byte data section");
  expect_error(
      "pastend",
      RawFile(
          R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]}})",
          8),
      "data_offsets [8, 12) outside the 8-byte data section");
  expect_error(
      "negoffset",
      RawFile(
          R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}})",
          8),
      "malformed data_offsets");
  expect_error(
      "fracdim",
      RawFile(
          R"({"w": {"dtype": "F32", "shape": [1.5], "data_offsets": [0, 4]}})",
          8),
      "negative or non-integer dimension");
  expect_error("nodtype",
               RawFile(R"({"w": {"shape": [1], "data_offsets": [0, 4]}})", 8),
               "tensor 'w' has no dtype");
  expect_error("empty", "", "is 0 bytes, too short for a header");
  {  // The header's JSON is cut short by a header length one byte too small.
    const std::string header =
        R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}})";
    std::string f = RawFile(header, 4);
    const uint64_t shorter = header.size() - 1;
    std::memcpy(f.data(), &shorter, 8);
    expect_error("cutheader", f, "header is not a JSON object");
  }
  {
    auto s = OpenRaw(
        "dtype",
        RawFile(
            R"({"w": {"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}})",
            8));
    EXPECT_EQ(s.code(), kInvalid);
    EXPECT_NE(s.message().find("tensor 'w'"), std::string::npos) << s;
    EXPECT_NE(s.message().find("I64"), std::string::npos) << s;
  }
  {
    auto s = OpenRaw(
        "range",
        RawFile(
            R"({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}})",
            8));
    EXPECT_EQ(s.code(), kInvalid);
    EXPECT_NE(s.message().find("outside"), std::string::npos) << s;
  }
  EXPECT_EQ(
      OpenRaw(
          "reversed",
          RawFile(
              R"({"w": {"dtype": "F32", "shape": [0], "data_offsets": [8, 4]}})",
              8))
          .code(),
      kInvalid);
  {
    auto s = OpenRaw(
        "mismatch",
        RawFile(
            R"({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})",
            8));
    EXPECT_EQ(s.code(), kInvalid);
    EXPECT_NE(s.message().find("shape needs 12"), std::string::npos) << s;
  }
  EXPECT_EQ(
      OpenRaw(
          "overflow",
          RawFile(
              R"({"w": {"dtype": "F32", "shape": [4294967296, 4294967296, 4294967296], "data_offsets": [0, 8]}})",
              8))
          .code(),
      kInvalid);
  EXPECT_EQ(
      OpenRaw(
          "negative",
          RawFile(
              R"({"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}})",
              8))
          .code(),
      kInvalid);
  EXPECT_EQ(
      OpenRaw("noshape",
              RawFile(R"({"w": {"dtype": "F32", "data_offsets": [0, 4]}})", 8))
          .code(),
      kInvalid);
  EXPECT_EQ(
      OpenRaw(
          "badoffsets",
          RawFile(
              R"({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}})",
              8))
          .code(),
      kInvalid);
  EXPECT_EQ(OpenRaw("entry", RawFile(R"({"w": 5})", 8)).code(), kInvalid);
  EXPECT_TRUE(
      OpenRaw("metadata", RawFile(R"({"__metadata__": {"format": "pt"}})", 0))
          .ok());
}

TEST(SafetensorsTest, EveryTruncationOfARealFileIsRejectedCleanly) {
  const std::vector<float> a(64, 1.0f);
  const std::vector<TensorToWrite> t = {
      {"a", DType::kF32, {8, 8}, std::as_bytes(std::span(a))},
      {"b", DType::kF32, {64}, std::as_bytes(std::span(a))}};
  ASSERT_TRUE(WriteSafetensors(TempPath("full.safetensors"), t).ok());
  const std::string full = ReadBytes(TempPath("full.safetensors"));
  for (size_t n = 0; n < full.size(); n += 7) {
    EXPECT_FALSE(OpenRaw("cut", full.substr(0, n)).ok())
        << "truncated to " << n;
  }
}

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = TempPath("ckpt");
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void WriteShard(const std::string& name, const std::string& tensor,
                  std::vector<int64_t> shape) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    storage_.emplace_back(n, 0.5f);
    const std::vector<TensorToWrite> t = {
        {tensor, DType::kF32, shape,
         std::as_bytes(std::span(storage_.back()))}};
    ASSERT_TRUE(WriteSafetensors(dir_ / name, t).ok());
  }
  fs::path dir_;
  std::vector<std::vector<float>> storage_;
};

TEST_F(CheckpointTest, ShardedCheckpointFindsEveryTensor) {
  WriteShard("model-00001-of-00002.safetensors", "x.weight", {2, 3});
  WriteShard("model-00002-of-00002.safetensors", "y.weight", {4});
  WriteBytes(
      dir_ / "model.safetensors.index.json",
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
  EXPECT_NE(bad.status().message().find("[2, 3], expected [2, 2]"),
            std::string::npos)
      << bad.status();
  EXPECT_EQ((*c)->Get("z").status().code(), absl::StatusCode::kNotFound);
}

TEST_F(CheckpointTest, IndexMustMatchTheShards) {
  WriteShard("a.safetensors", "x", {1});
  WriteShard("b.safetensors", "y", {1});
  const auto index = [&](const std::string& json) {
    WriteBytes(dir_ / "model.safetensors.index.json", json);
    return Checkpoint::Open(dir_).status();
  };
  EXPECT_TRUE(
      index(R"({"weight_map": {"x": "a.safetensors", "y": "b.safetensors"}})")
          .ok());
  absl::Status s =
      index(R"({"weight_map": {"x": "b.safetensors", "y": "b.safetensors"}})");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("tensor 'x' is not in its shard b.safetensors"),
            std::string::npos)
      << s;
  s = index(R"({"weight_map": {}})");
  EXPECT_NE(s.message().find("weight_map is empty"), std::string::npos) << s;
  s = index(R"({"weight_map": {"x": 3}})");
  EXPECT_NE(s.message().find("weight_map entry for 'x' is not a file name"),
            std::string::npos)
      << s;
  s = index(R"({"weight_map": ["a.safetensors"]})");
  EXPECT_NE(s.message().find("not a JSON object with a weight_map"),
            std::string::npos)
      << s;
  s = index(R"({"metadata": {}})");
  EXPECT_NE(s.message().find("not a JSON object with a weight_map"),
            std::string::npos)
      << s;
  s = index(R"({"weight_map": {"x": "/etc/passwd"}})");
  EXPECT_NE(s.message().find("is not a plain file name"), std::string::npos)
      << s;
  // A corrupt shard is reported with the shard's own path.
  WriteBytes(dir_ / "b.safetensors", "garbage!garbage!");
  s = index(R"({"weight_map": {"x": "a.safetensors", "y": "b.safetensors"}})");
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find((dir_ / "b.safetensors").string()),
            std::string::npos)
      << s;
}

TEST(CheckpointFixtureTest, OpensTransformersOutputInEveryDtype) {
  // Written by transformers' save_pretrained
  // (tests/fixtures/make_hf_fixtures.py).
  const fs::path hf = fs::path(PDSERVE_FIXTURES_DIR) / "hf";
  if (!fs::exists(hf / "mistral" / "model.safetensors"))
    GTEST_SKIP() << "no " << hf;
  auto mistral = Checkpoint::Open(hf / "mistral");
  ASSERT_TRUE(mistral.ok()) << mistral.status();
  const int64_t q_shape[] = {4 * 32, 64};  // head_dim 32, not hidden / heads.
  auto q = (*mistral)->GetWithShape("model.layers.0.self_attn.q_proj.weight",
                                    q_shape);
  ASSERT_TRUE(q.ok()) << q.status();
  EXPECT_EQ(q->dtype, DType::kBF16);
  auto qwen = Checkpoint::Open(hf / "qwen2_bias_tied");
  ASSERT_TRUE(qwen.ok()) << qwen.status();
  auto bias = (*qwen)->Get("model.layers.1.self_attn.k_proj.bias");
  ASSERT_TRUE(bias.ok()) << bias.status();
  EXPECT_EQ(bias->dtype, DType::kF32);
  EXPECT_EQ(bias->shape, (std::vector<int64_t>{2 * 16}));
  EXPECT_FALSE((*qwen)->Has("lm_head.weight"));  // Tied.
}

TEST_F(CheckpointTest, MissingShardOrBadIndexIsAnError) {
  WriteShard("a.safetensors", "x", {1});
  WriteBytes(dir_ / "model.safetensors.index.json",
             R"({"weight_map": {"x": "a.safetensors", "y": "b.safetensors"}})");
  auto c = Checkpoint::Open(dir_);
  EXPECT_EQ(c.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(c.status().message().find("b.safetensors"), std::string::npos)
      << c.status();
  WriteBytes(dir_ / "model.safetensors.index.json",
             R"({"weight_map": {"x": "../a.safetensors"}})");
  EXPECT_EQ(Checkpoint::Open(dir_).status().code(),
            absl::StatusCode::kInvalidArgument);
  WriteBytes(dir_ / "model.safetensors.index.json", "{not json");
  EXPECT_EQ(Checkpoint::Open(dir_).status().code(),
            absl::StatusCode::kInvalidArgument);
  fs::remove(dir_ / "model.safetensors.index.json");
  EXPECT_EQ(Checkpoint::Open(dir_).status().code(),
            absl::StatusCode::kNotFound);  // No model.safetensors.
}

}  // namespace
}  // namespace pdserve
