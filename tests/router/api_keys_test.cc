// ApiKeys: key validation, the Bearer check, key files.
#include "router/api_keys.h"

#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pdserve {
namespace {

using ::testing::HasSubstr;
using ::testing::Not;

TEST(ApiKeysTest, AnOpenSetPassesEverything) {
  const ApiKeys open;
  EXPECT_FALSE(open.enabled());
  EXPECT_TRUE(open.Check("").ok());
  EXPECT_TRUE(open.Check("Bearer whatever").ok());
  auto none = ApiKeys::Create({});
  ASSERT_TRUE(none.ok());
  EXPECT_FALSE(none->enabled());
  EXPECT_TRUE(none->Check("garbage").ok());
}

TEST(ApiKeysTest, AcceptsBearerWithAnyKeyOfTheSet) {
  auto keys = ApiKeys::Create({"alpha-1", "beta_2", "alpha-1"});
  ASSERT_TRUE(keys.ok()) << keys.status();
  EXPECT_TRUE(keys->enabled());
  EXPECT_EQ(keys->size(), 2u);  // The duplicate counts once.
  EXPECT_TRUE(keys->Check("Bearer alpha-1").ok());
  EXPECT_TRUE(keys->Check("Bearer beta_2").ok());
  // The scheme is case-insensitive (RFC 7235); spaces around the key go.
  EXPECT_TRUE(keys->Check("bearer alpha-1").ok());
  EXPECT_TRUE(keys->Check("BEARER  beta_2 ").ok());
}

TEST(ApiKeysTest, RefusesMissingMalformedAndWrongValues) {
  auto keys = ApiKeys::Create({"alpha-1"});
  ASSERT_TRUE(keys.ok());
  const absl::Status missing = keys->Check("");
  EXPECT_EQ(missing.code(), absl::StatusCode::kUnauthenticated);
  EXPECT_THAT(missing.message(), HasSubstr("requires an API key"));
  EXPECT_THAT(missing.message(), HasSubstr("authorization: Bearer <key>"));

  for (const char* value :
       {"alpha-1", "Basic alpha-1", "Bearer", "Bearer ", "Beareralpha-1"}) {
    const absl::Status s = keys->Check(value);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << value;
    EXPECT_THAT(s.message(), HasSubstr("not 'Bearer <key>'")) << value;
  }
  // Prefixes, extensions and near misses of the key.
  for (const char* value :
       {"Bearer alpha-", "Bearer alpha-12", "Bearer alpha-2", "Bearer Alpha-1",
        "Bearer blpha-1", "Bearer alpha-1 x"}) {
    const absl::Status s = keys->Check(value);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnauthenticated) << value;
    EXPECT_THAT(s.message(), HasSubstr("not valid")) << value;
    // Nothing sent is echoed back.
    EXPECT_THAT(s.message(), Not(HasSubstr("alpha"))) << value;
  }
}

TEST(ApiKeysTest, RefusesKeysThatCannotBeSent) {
  for (const std::string& bad :
       {std::string(""), std::string("has space"), std::string("a,b"),
        std::string("tab\t"), std::string("caf\xc3\xa9"),
        std::string(257, 'k')}) {
    auto keys = ApiKeys::Create({"good", bad});
    ASSERT_FALSE(keys.ok()) << bad;
    EXPECT_EQ(keys.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(keys.status().message(), HasSubstr("API key 2 of 2"));
  }
  EXPECT_TRUE(ApiKeys::Create({std::string(256, 'k')}).ok());
}

class ApiKeyFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           absl::StrCat("pdserve-api-keys-", ::getpid());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string Write(const std::string& name, const std::string& contents) {
    const std::filesystem::path path = dir_ / name;
    std::ofstream(path) << contents;
    return path.string();
  }

  std::filesystem::path dir_;
};

TEST_F(ApiKeyFileTest, ReadsOneKeyPerLineSkippingBlanksAndComments) {
  const std::string path =
      Write("keys",
            "# production keys\n\nkey-one\n   \n  # indented comment\n"
            "  key-two  \r\nkey-three");
  auto keys = ReadApiKeyFile(path);
  ASSERT_TRUE(keys.ok()) << keys.status();
  EXPECT_EQ(*keys,
            (std::vector<std::string>{"key-one", "key-two", "key-three"}));
  auto set = ApiKeys::Create(*keys);
  ASSERT_TRUE(set.ok());
  EXPECT_TRUE(set->Check("Bearer key-two").ok());
}

TEST_F(ApiKeyFileTest, AFileWithNoKeyIsAnError) {
  for (const std::string contents : {"", "\n\n", "# only a comment\n  \n"}) {
    auto keys = ReadApiKeyFile(Write("empty", contents));
    ASSERT_FALSE(keys.ok());
    EXPECT_EQ(keys.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(keys.status().message(), HasSubstr("has no key"));
  }
}

TEST_F(ApiKeyFileTest, ABadLineIsNamedButNotShown) {
  auto keys = ReadApiKeyFile(Write("bad", "good\n# c\nsecret with space\n"));
  ASSERT_FALSE(keys.ok());
  EXPECT_EQ(keys.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(keys.status().message(), HasSubstr("line 3"));
  EXPECT_THAT(keys.status().message(), Not(HasSubstr("secret")));
}

TEST_F(ApiKeyFileTest, UnreadableFilesSayWhy) {
  auto missing = ReadApiKeyFile((dir_ / "absent").string());
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr("absent"));

  auto directory = ReadApiKeyFile(dir_.string());
  ASSERT_FALSE(directory.ok());
  EXPECT_THAT(directory.status().message(), HasSubstr("is a directory"));

  const std::string locked = Write("locked", "key\n");
  ASSERT_EQ(::chmod(locked.c_str(), 0), 0);
  if (::geteuid() == 0) {
    // root reads a mode-0 file anyway: nothing to test here.
    EXPECT_TRUE(ReadApiKeyFile(locked).ok());
  } else {
    auto denied = ReadApiKeyFile(locked);
    ASSERT_FALSE(denied.ok());
    EXPECT_EQ(denied.status().code(), absl::StatusCode::kPermissionDenied);
  }
}

}  // namespace
}  // namespace pdserve
