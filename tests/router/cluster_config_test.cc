// The cluster config file: what pd-router accepts and the messages it gives
// for what it refuses.
#include "router/cluster_config.h"

#include <filesystem>
#include <fstream>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace pdserve {
namespace {

TEST(ClusterConfigTest, ParsesCamelCaseAndProtoNames) {
  auto config = ParseClusterConfig(R"({
    "model": "builtin:tiny",
    "servedModelName": "tiny",
    "prefill_workers": [{"id": "prefill-0", "address": "127.0.0.1:5001"}],
    "decodeWorkers": [{"id": "decode-0", "address": "127.0.0.1:5002"},
                      {"id": "decode-1", "address": "127.0.0.1:5003"}]
  })");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->served_model_name(), "tiny");
  ASSERT_EQ(config->prefill_workers_size(), 1);
  EXPECT_EQ(config->prefill_workers(0).address(), "127.0.0.1:5001");
  ASSERT_EQ(config->decode_workers_size(), 2);
  EXPECT_EQ(config->decode_workers(1).id(), "decode-1");
}

TEST(ClusterConfigTest, ModelDefaultsToBuiltinTiny) {
  auto config = ParseClusterConfig(
      R"({"decode_workers": [{"id": "d", "address": "h:1"}]})");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->model(), "builtin:tiny");
  EXPECT_EQ(config->prefill_workers_size(), 0);
}

void ExpectInvalid(const std::string& json, const std::string& message_part) {
  auto config = ParseClusterConfig(json);
  ASSERT_FALSE(config.ok()) << json;
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument) << json;
  EXPECT_NE(config.status().message().find(message_part), std::string::npos)
      << "message '" << config.status().message() << "' lacks '" << message_part
      << "'";
}

TEST(ClusterConfigTest, RejectsBadConfigsWithUsefulMessages) {
  ExpectInvalid(R"({"model": "builtin:tiny"})", "no decode_workers");
  ExpectInvalid(R"({"decode_workers": []})", "no decode_workers");
  ExpectInvalid(
      R"({"decode_workers": [{"id": "d", "address": "h:1"}], "colour": 1})",
      "colour");
  ExpectInvalid(R"({"decode_workers": [{"id": "d", "adress": "h:1"}]})",
                "adress");
  ExpectInvalid(R"({"decode_workers": [{"address": "h:1"}]})",
                "decode_workers[0] has no id");
  ExpectInvalid(R"({"decode_workers": [{"id": "d"}]})", "('d') has no address");
  ExpectInvalid(
      R"({"decode_workers": [{"id": "d", "address": "h:1"}, {"id": "d", "address": "h:2"}]})",
      "'d' is used twice");
  ExpectInvalid(R"({"prefill_workers": [{"id": "w", "address": "h:1"}],
                    "decode_workers": [{"id": "w", "address": "h:2"}]})",
                "'w' is used twice");
  ExpectInvalid(R"({"prefill_workers": [{"id": "", "address": "h:1"}],
                    "decode_workers": [{"id": "d", "address": "h:2"}]})",
                "prefill_workers[0] has no id");
  ExpectInvalid("{not json", "not valid");
  ExpectInvalid(R"({"decode_workers": "d"})", "not valid");
}

TEST(ClusterConfigTest, LoadNamesThePath) {
  const auto dir = std::filesystem::temp_directory_path();
  const std::string missing = (dir / "pdserve-no-such-cluster.json").string();
  auto config = LoadClusterConfig(missing);
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(config.status().message().find(missing), std::string::npos);

  const std::string bad =
      (dir / ("pdserve-bad-cluster-" + std::to_string(::getpid()) + ".json"))
          .string();
  std::ofstream(bad) << R"({"decode_workers": []})";
  config = LoadClusterConfig(bad);
  std::filesystem::remove(bad);
  ASSERT_FALSE(config.ok());
  EXPECT_EQ(config.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(config.status().message().find(bad), std::string::npos);
}

TEST(ClusterConfigTest, RoutingSectionIsParsedAndChecked) {
  auto config = ParseClusterConfig(R"({
    "decode_workers": [{"id": "d", "address": "127.0.0.1:1"}],
    "routing": {"policy": "least_loaded", "localPrefillMaxTokens": 32,
                "prefill_queue_limit_tokens": 1000}})");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->routing().policy(), "least_loaded");
  EXPECT_EQ(config->routing().local_prefill_max_tokens(), 32);
  EXPECT_EQ(config->routing().prefill_queue_limit_tokens(), 1000);
  EXPECT_FALSE(config->routing().has_block_move_cost_tokens());
  for (const char* bad : {R"("routing": {"policy": "fastest"})",
                          R"("routing": {"localPrefillMaxTokens": -1})"}) {
    auto refused = ParseClusterConfig(absl::StrCat(
        R"({"decode_workers": [{"id": "d", "address": "127.0.0.1:1"}], )", bad, "}"));
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(refused.status().message().find("routing"), std::string::npos)
        << refused.status();
  }
}

}  // namespace
}  // namespace pdserve
