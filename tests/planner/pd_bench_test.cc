// The load generator (planner/loadgen.h) and pd-bench: the OpenAI stream's
// token rule on canned bytes, then both targets against a real local
// cluster (deploy/local/cluster.sh, builtin:tiny, 1P1D): every token
// recorded, the closed loop's bound, the open loop's send times, a dead
// server, and the pd-bench binary's summary JSON.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "planner/loadgen.h"
#include "planner/openai_stream.h"
#include "planner/summary.h"
#include "planner/workload.h"
#include "tests/cluster/local_cluster.h"

namespace pdserve::planner {
namespace {

namespace fs = std::filesystem;
using testing_util::ClusterSpec;
using testing_util::LocalCluster;

// ---- OpenAiStreamReader: the token rule, no server --------------------------

SteadyTime At(SteadyTime origin, double s) {
  return origin + std::chrono::duration_cast<SteadyTime::duration>(
                      std::chrono::duration<double>(s));
}

TEST(OpenAiStreamReaderTest, OneTokenPerTextChunkAndMergedTokensFromUsage) {
  RequestRecord record;
  const SteadyTime origin = std::chrono::steady_clock::now();
  OpenAiStreamReader reader(&record, origin);
  // Split anywhere, \r\n line ends, a keep-alive comment, usage: null.
  reader.Feed(
      "data: {\"choices\":[{\"text\":\"a\"}],\"usage\":null}\r\n\r\n: ping\n\n",
      At(origin, 1));
  reader.Feed("data: {\"choices\":[{\"te", At(origin, 2));
  reader.Feed("xt\":\"bc\"}]}\n\n", At(origin, 3));
  reader.Feed("data: {\"choices\":[{\"text\":\"\"}]}\n\n",
              At(origin, 4));  // No token.
  reader.Feed(
      "data: {\"choices\":[],\"usage\":{\"completion_tokens\":4}}\n\n"
      "data: [DONE]\n\n",
      At(origin, 5));
  ASSERT_TRUE(reader.Finish().ok());
  EXPECT_EQ(record.output_tokens, 4);
  // Rule 2 counted 2; the 2 more the usage counts came with the last text.
  EXPECT_EQ(record.token_s, (std::vector<double>{1, 3, 3, 3}));
}

TEST(OpenAiStreamReaderTest, PerChunkUsageCountsEachChunk) {
  RequestRecord record;
  const SteadyTime origin = std::chrono::steady_clock::now();
  OpenAiStreamReader reader(&record, origin);
  reader.Feed(
      "data: "
      "{\"choices\":[{\"text\":\"a\"}],\"usage\":{\"completion_tokens\":1}}"
      "\n\n",
      At(origin, 1));
  reader.Feed(
      "data: "
      "{\"choices\":[{\"text\":\"bcd\"}],\"usage\":{\"completion_tokens\":3}}"
      "\n\n",
      At(origin, 2));
  reader.Feed(
      "data: {\"choices\":[],\"usage\":{\"completion_tokens\":3}}\n\ndata: "
      "[DONE]\n\n",
      At(origin, 3));
  ASSERT_TRUE(reader.Finish().ok());
  EXPECT_EQ(record.token_s, (std::vector<double>{1, 2, 2}));
}

TEST(OpenAiStreamReaderTest, ErrorEventAndMissingDoneFail) {
  const SteadyTime origin = std::chrono::steady_clock::now();
  {
    RequestRecord record;
    OpenAiStreamReader reader(&record, origin);
    reader.Feed(
        "data: {\"choices\":[{\"text\":\"a\"}]}\n\n"
        "data: {\"error\":{\"message\":\"worker "
        "lost\",\"type\":\"service_unavailable\"}}"
        "\n\ndata: [DONE]\n\n",
        At(origin, 1));
    const absl::Status status = reader.Finish();
    EXPECT_EQ(status.code(), absl::StatusCode::kUnavailable);
    EXPECT_EQ(status.message(), "worker lost");
    EXPECT_EQ(record.output_tokens, 1);
  }
  {
    RequestRecord record;
    OpenAiStreamReader reader(&record, origin);
    reader.Feed("data: {\"choices\":[{\"text\":\"a\"}]}\n\n", At(origin, 1));
    EXPECT_EQ(reader.Finish().code(), absl::StatusCode::kUnavailable);
  }
  EXPECT_EQ(HttpErrorStatus(429, R"({"error":{"message":"queue full"}})"),
            absl::ResourceExhaustedError("HTTP 429: queue full"));
  EXPECT_EQ(HttpErrorStatus(400, "plain text").code(),
            absl::StatusCode::kInvalidArgument);
}

// ---- Against a real cluster -----------------------------------------------

// A port nothing listens on (bound, then closed).
int DeadPort() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
  socklen_t len = sizeof(addr);
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

Workload SmallWorkload(int n, uint64_t seed) {
  SyntheticOptions options;
  options.input = *LengthDistribution::Parse("uniform:8:48");
  options.output = *LengthDistribution::Parse("uniform:2:12");
  options.num_requests = n;
  options.seed = seed;
  absl::StatusOr<Workload> workload = MakeSyntheticWorkload(options);
  EXPECT_TRUE(workload.ok()) << workload.status();
  return *std::move(workload);
}

std::unique_ptr<LoadTarget> Target(const std::string& name,
                                   const std::string& address,
                                   absl::Duration timeout = absl::Seconds(60)) {
  TargetOptions options;
  options.address = address;
  options.request_timeout = timeout;
  auto target = MakeLoadTarget(name, options);
  EXPECT_TRUE(target.ok()) << target.status();
  return target.ok() ? *std::move(target) : nullptr;
}

LoadResult RunWorkload(const Workload& workload, LoadTarget& target,
                       int concurrency) {
  LoadOptions options;
  options.concurrency = concurrency;
  options.progress = false;
  absl::StatusOr<LoadResult> result = RunLoad(workload, target, options);
  EXPECT_TRUE(result.ok()) << result.status();
  return result.ok() ? *std::move(result) : LoadResult{};
}

class PdBenchClusterTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    LocalCluster::on_kv_leak = [](const std::string& leak) {
      ADD_FAILURE() << "KV leak: " << leak;
    };
    auto cluster = LocalCluster::Start(ClusterSpec{});
    ASSERT_TRUE(cluster.ok()) << cluster.status();
    cluster_ = std::move(*cluster).release();
  }
  static void TearDownTestSuite() {
    delete cluster_;
    cluster_ = nullptr;
  }

  static std::string GrpcAddress() { return cluster_->Address("router"); }
  static std::string HttpAddress() {
    return absl::StrCat("127.0.0.1:", cluster_->MetricsPort("router"));
  }

  static LocalCluster* cluster_;
};

LocalCluster* PdBenchClusterTest::cluster_ = nullptr;

// Every request OK, every token of it recorded once, in order, inside the
// request's life.
void ExpectEveryToken(const Workload& workload, const LoadResult& result) {
  ASSERT_EQ(result.records.size(), workload.requests.size());
  for (size_t i = 0; i < result.records.size(); ++i) {
    const RequestRecord& r = result.records[i];
    const WorkloadRequest& w = workload.requests[i];
    SCOPED_TRACE(absl::StrCat("request ", i));
    EXPECT_EQ(r.index, static_cast<int64_t>(i));
    EXPECT_EQ(r.outcome, "OK") << r.error;
    EXPECT_EQ(r.input_tokens, w.input_tokens);
    EXPECT_EQ(r.output_tokens, w.output_tokens);
    ASSERT_EQ(r.token_s.size(), static_cast<size_t>(w.output_tokens));
    EXPECT_GT(r.token_s.front(), r.send_s);
    EXPECT_TRUE(std::is_sorted(r.token_s.begin(), r.token_s.end()));
    EXPECT_GE(r.end_s, r.token_s.back());
  }
}

TEST_F(PdBenchClusterTest, GrpcTargetRecordsEveryToken) {
  const Workload workload = SmallWorkload(10, 1);
  auto target = Target("grpc", GrpcAddress());
  ASSERT_NE(target, nullptr);
  ExpectEveryToken(workload, RunWorkload(workload, *target, 4));
}

TEST_F(PdBenchClusterTest, OpenAiTargetRecordsEveryToken) {
  const Workload workload = SmallWorkload(10, 2);
  auto target = Target("openai", HttpAddress());
  ASSERT_NE(target, nullptr);
  ExpectEveryToken(workload, RunWorkload(workload, *target, 4));
}

TEST_F(PdBenchClusterTest, ClosedLoopNeverExceedsItsConcurrency) {
  const Workload workload = SmallWorkload(16, 3);
  for (const std::string name : {"grpc", "openai"}) {
    SCOPED_TRACE(name);
    auto target = Target(name, name == "grpc" ? GrpcAddress() : HttpAddress());
    ASSERT_NE(target, nullptr);
    const LoadResult result = RunWorkload(workload, *target, 3);
    ASSERT_EQ(result.records.size(), workload.requests.size());
    // Most requests in flight at once: sweep over sends (+1) and ends (-1),
    // an end before a send at the same time.
    std::vector<std::pair<double, int>> events;
    for (const RequestRecord& r : result.records) {
      EXPECT_TRUE(r.ok()) << r.outcome << ": " << r.error;
      events.push_back({r.send_s, +1});
      events.push_back({r.end_s, -1});
    }
    std::sort(events.begin(), events.end());
    int in_flight = 0, most = 0;
    for (const auto& [t, delta] : events)
      most = std::max(most, in_flight += delta);
    EXPECT_EQ(most, 3);
  }
}

TEST_F(PdBenchClusterTest, OpenLoopSendsAtTheArrivalTimes) {
  Workload workload = SmallWorkload(15, 4);
  ASSERT_TRUE(
      AssignArrivals({.rate = 20, .burstiness = 1, .seed = 4}, workload).ok());
  auto target = Target("openai", HttpAddress());
  ASSERT_NE(target, nullptr);
  const LoadResult result = RunWorkload(workload, *target, 0);
  ASSERT_EQ(result.records.size(), workload.requests.size());
  for (size_t i = 0; i < result.records.size(); ++i) {
    const double lateness =
        result.records[i].send_s - workload.requests[i].arrival_s;
    EXPECT_GE(lateness, 0) << "request " << i;
    EXPECT_LT(lateness, 0.02) << "request " << i;
    EXPECT_TRUE(result.records[i].ok()) << result.records[i].error;
  }
  EXPECT_LT(result.max_send_lateness_s, 0.02);
}

TEST(PdBenchTest, DeadServerEndsUnavailableAtOnce) {
  const std::string dead = absl::StrCat("127.0.0.1:", DeadPort());
  const Workload workload = SmallWorkload(3, 5);
  for (const std::string name : {"grpc", "openai"}) {
    SCOPED_TRACE(name);
    auto target = Target(name, dead, absl::Seconds(30));
    ASSERT_NE(target, nullptr);
    const absl::Time start = absl::Now();
    const LoadResult result = RunWorkload(workload, *target, 3);
    EXPECT_LT(absl::Now() - start, absl::Seconds(10));
    ASSERT_EQ(result.records.size(), 3u);
    for (const RequestRecord& r : result.records) {
      EXPECT_EQ(r.outcome, "UNAVAILABLE") << r.error;
      EXPECT_TRUE(r.token_s.empty());
    }
  }
}

TEST_F(PdBenchClusterTest, PdBenchWritesAParseableSummary) {
  const fs::path dir =
      fs::temp_directory_path() / absl::StrCat("pd-bench-test-", ::getpid());
  fs::create_directories(dir);
  const std::string command = absl::StrCat(
      PDSERVE_BINARY_DIR,
      "/planner/pd-bench --target=openai --address=", HttpAddress(),
      " --input_len=uniform:8:32 --output_len=4 --num_requests=6 "
      "--request_rates=10,inf"
      " --slo_ttft_ms=5000 --progress=false --summary_json=",
      (dir / "summary.json").string(),
      " --records=", (dir / "records.jsonl").string(), " >",
      (dir / "stdout.txt").string());
  ASSERT_EQ(std::system(command.c_str()), 0) << command;
  std::ifstream in(dir / "summary.json");
  const nlohmann::json summary =
      nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  ASSERT_TRUE(summary.is_object());
  ASSERT_EQ(summary["points"].size(), 2u);
  EXPECT_EQ(summary["points"][0]["rate"], 10);
  EXPECT_TRUE(summary["points"][1]["rate"].is_null());  // inf
  for (const nlohmann::json& point : summary["points"]) {
    EXPECT_EQ(point["requests"], 6);
    EXPECT_EQ(point["completed"], 6);
    EXPECT_EQ(point["slo_attainment"], 1.0);
  }
  EXPECT_TRUE(summary["goodput"].is_null());  // Every rate met it: infinite.
  for (const char* name : {"records.rate-10.jsonl", "records.rate-inf.jsonl"}) {
    auto records = ReadRecords((dir / name).string());
    ASSERT_TRUE(records.ok()) << records.status();
    EXPECT_EQ(records->size(), 6u);
  }
  std::ifstream table(dir / "stdout.txt");
  const std::string out(std::istreambuf_iterator<char>(table), {});
  EXPECT_NE(out.find("| rate (req/s)"), std::string::npos) << out;
  fs::remove_all(dir);
}

TEST(PdBenchTest, PdBenchRefusesBadFlagsWithAReason) {
  const std::string bench =
      absl::StrCat(PDSERVE_BINARY_DIR, "/planner/pd-bench");
  for (const std::string flags :
       {"--address=127.0.0.1:1 --concurrency=2 --request_rate=3",
        "--address=127.0.0.1:1 --input_len=bogus --concurrency=1",
        "--concurrency=1", "--address=127.0.0.1:1 --target=ftp --concurrency=1",
        "--address=127.0.0.1:1 --request_rate=-1",
        // The shared flags (planner/workload_flags.h) are checked too.
        "--address=127.0.0.1:1 --trace=t.jsonl --num_requests=5",
        "--address=127.0.0.1:1 --concurrency=1 --slo_ttft_ms=-1",
        "--address=127.0.0.1:1 --request_rate=2 --burstiness=0"}) {
    const int rc =
        std::system(absl::StrCat(bench, " ", flags, " 2>/dev/null").c_str());
    EXPECT_TRUE(WIFEXITED(rc) && WEXITSTATUS(rc) == 2) << flags;
  }
}

}  // namespace
}  // namespace pdserve::planner
