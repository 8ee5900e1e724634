// The flags pd-bench and pd-plan share (planner/workload_flags.h): what
// each means, and that a bad one is refused naming the flag.
#include "planner/workload_flags.h"

#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

ABSL_DECLARE_FLAG(std::string, input_len);
ABSL_DECLARE_FLAG(std::optional<int32_t>, num_requests);
ABSL_DECLARE_FLAG(std::string, trace);
ABSL_DECLARE_FLAG(int32_t, shared_prefix_len);
ABSL_DECLARE_FLAG(int32_t, num_prefixes);
ABSL_DECLARE_FLAG(double, trace_start_s);
ABSL_DECLARE_FLAG(double, trace_duration_s);
ABSL_DECLARE_FLAG(int32_t, trace_max_requests);
ABSL_DECLARE_FLAG(int32_t, concurrency);
ABSL_DECLARE_FLAG(std::string, request_rate);
ABSL_DECLARE_FLAG(std::vector<std::string>, request_rates);
ABSL_DECLARE_FLAG(double, slo_ttft_ms);
ABSL_DECLARE_FLAG(double, slo_tpot_ms);

namespace pdserve::planner {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;

class WorkloadFlagsTest : public ::testing::Test {
 protected:
  // A Mooncake trace of 4 requests, one a second from t = 10 s.
  void SetUp() override {
    trace_ = (fs::temp_directory_path() / absl::StrCat("workload-flags-", ::getpid(), ".jsonl"))
                 .string();
    std::ofstream out(trace_);
    for (int i = 0; i < 4; ++i) {
      out << R"({"timestamp": )" << 10000 + 1000 * i
          << R"(, "input_length": 512, "output_length": 8, "hash_ids": [)" << i << "]}\n";
    }
  }
  void TearDown() override { fs::remove(trace_); }

  absl::FlagSaver saver_;  // Every test starts from the defaults.
  std::string trace_;
};

TEST_F(WorkloadFlagsTest, SyntheticByDefaultWith200Requests) {
  auto workload = WorkloadFromFlags();
  ASSERT_TRUE(workload.ok()) << workload.status();
  EXPECT_EQ(workload->requests.size(), 200u);
  absl::SetFlag(&FLAGS_num_requests, 7);
  EXPECT_EQ(WorkloadFromFlags()->requests.size(), 7u);
}

TEST_F(WorkloadFlagsTest, BadWorkloadFlagsAreNamed) {
  absl::SetFlag(&FLAGS_input_len, "bogus");
  EXPECT_THAT(WorkloadFromFlags().status().message(), HasSubstr("--input_len"));
  absl::SetFlag(&FLAGS_input_len, "16");
  absl::SetFlag(&FLAGS_num_requests, 0);
  EXPECT_THAT(WorkloadFromFlags().status().message(), HasSubstr("--num_requests"));
}

TEST_F(WorkloadFlagsTest, ATraceTakesTraceMaxRequestsNotNumRequests) {
  absl::SetFlag(&FLAGS_trace, trace_);
  absl::SetFlag(&FLAGS_num_requests, 2);
  auto refused = WorkloadFromFlags();
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(refused.status().message(), HasSubstr("--trace_max_requests"));

  absl::SetFlag(&FLAGS_num_requests, std::nullopt);
  absl::SetFlag(&FLAGS_trace_max_requests, 2);
  auto workload = WorkloadFromFlags();
  ASSERT_TRUE(workload.ok()) << workload.status();
  EXPECT_EQ(workload->requests.size(), 2u);
}

TEST_F(WorkloadFlagsTest, TraceDurationZeroReplaysToTheEnd) {
  absl::SetFlag(&FLAGS_trace, trace_);
  absl::SetFlag(&FLAGS_trace_start_s, 11);
  EXPECT_EQ(WorkloadFromFlags()->requests.size(), 3u);
  absl::SetFlag(&FLAGS_trace_duration_s, 1.5);
  EXPECT_EQ(WorkloadFromFlags()->requests.size(), 2u);
  absl::SetFlag(&FLAGS_trace_start_s, 100);  // Past the last request.
  EXPECT_THAT(WorkloadFromFlags().status().message(), HasSubstr("--trace_start_s"));
}

TEST_F(WorkloadFlagsTest, ATraceAtItsOwnTimesOffersItsMeanRate) {
  absl::SetFlag(&FLAGS_trace, trace_);
  auto workload = WorkloadFromFlags();
  ASSERT_TRUE(workload.ok()) << workload.status();
  auto levels = LoadLevelsFromFlags();
  ASSERT_TRUE(levels.ok()) << levels.status();
  ASSERT_EQ(levels->size(), 1u);
  EXPECT_EQ((*levels)[0].Name(), "trace times");
  auto at = WorkloadAtLoad(*workload, (*levels)[0]);
  ASSERT_TRUE(at.ok()) << at.status();
  EXPECT_DOUBLE_EQ(OfferedRate(*at, (*levels)[0]), 1.0);
}

TEST_F(WorkloadFlagsTest, ATraceAtARateKeepsItsPatternTimeScaled) {
  absl::SetFlag(&FLAGS_trace, trace_);
  absl::SetFlag(&FLAGS_request_rate, "4");
  auto workload = WorkloadFromFlags();
  ASSERT_TRUE(workload.ok()) << workload.status();
  auto levels = LoadLevelsFromFlags();
  ASSERT_TRUE(levels.ok()) << levels.status();
  auto at = WorkloadAtLoad(*workload, (*levels)[0]);
  ASSERT_TRUE(at.ok()) << at.status();
  // One a second becomes four a second; the whole time axis is scaled,
  // the 10 s before the first request included.
  for (size_t i = 0; i < at->requests.size(); ++i) {
    EXPECT_DOUBLE_EQ(at->requests[i].arrival_s, 2.5 + 0.25 * i);
  }
  EXPECT_DOUBLE_EQ(OfferedRate(*at, (*levels)[0]), 4.0);
}

TEST_F(WorkloadFlagsTest, EveryLevelAndEveryRunOfOneGetsNewContent) {
  // validate --repeats sends a level's prompts to one cluster more than
  // once: each run's must be new to its prefix cache, with the same
  // lengths and arrivals.
  absl::SetFlag(&FLAGS_trace, trace_);
  absl::SetFlag(&FLAGS_request_rate, "4");
  auto workload = WorkloadFromFlags();
  ASSERT_TRUE(workload.ok()) << workload.status();
  auto levels = LoadLevelsFromFlags();
  ASSERT_TRUE(levels.ok()) << levels.status();
  const LoadLevel first = (*levels)[0];
  LoadLevel again = first, next = first, next_again = first;
  again.repeat = 1;
  next.index = 1;
  next_again.index = 1;
  next_again.repeat = 1;
  std::vector<Workload> runs;
  for (const LoadLevel& l : {first, again, next, next_again}) {
    auto at = WorkloadAtLoad(*workload, l);
    ASSERT_TRUE(at.ok()) << at.status();
    runs.push_back(*std::move(at));
  }
  EXPECT_EQ(runs[0].requests[0].block_ids, workload->requests[0].block_ids);
  for (size_t a = 0; a < runs.size(); ++a) {
    for (size_t b = a + 1; b < runs.size(); ++b) {
      ASSERT_EQ(runs[a].requests.size(), runs[b].requests.size());
      for (size_t i = 0; i < runs[a].requests.size(); ++i) {
        const WorkloadRequest& x = runs[a].requests[i];
        const WorkloadRequest& y = runs[b].requests[i];
        EXPECT_EQ(x.input_tokens, y.input_tokens);
        EXPECT_DOUBLE_EQ(x.arrival_s, y.arrival_s);
        ASSERT_EQ(x.block_ids.size(), y.block_ids.size());
        for (size_t k = 0; k < x.block_ids.size(); ++k) {
          EXPECT_NE(x.block_ids[k], y.block_ids[k]) << "runs " << a << " and " << b;
        }
      }
    }
  }
}

TEST_F(WorkloadFlagsTest, LoadLevels) {
  EXPECT_THAT(LoadLevelsFromFlags().status().message(), HasSubstr("give a load"));
  absl::SetFlag(&FLAGS_request_rates, std::vector<std::string>{"1", " INF "});
  auto levels = LoadLevelsFromFlags();
  ASSERT_TRUE(levels.ok()) << levels.status();
  ASSERT_EQ(levels->size(), 2u);
  EXPECT_EQ((*levels)[0].Name(), "1 req/s");
  EXPECT_TRUE(std::isinf((*levels)[1].rate));
  absl::SetFlag(&FLAGS_concurrency, 4);
  EXPECT_THAT(LoadLevelsFromFlags().status().message(), HasSubstr("--concurrency"));
  absl::SetFlag(&FLAGS_request_rates, std::vector<std::string>{"0"});
  absl::SetFlag(&FLAGS_concurrency, 0);
  EXPECT_THAT(LoadLevelsFromFlags().status().message(), HasSubstr("--request_rates: '0'"));
}

TEST_F(WorkloadFlagsTest, AnSloOfZeroIsNoTarget) {
  auto spec = SummarySpecFromFlags();
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_TRUE(std::isinf(spec->slo.ttft_s));
  EXPECT_TRUE(std::isinf(spec->slo.tpot_s));
  absl::SetFlag(&FLAGS_slo_ttft_ms, 250);
  absl::SetFlag(&FLAGS_slo_tpot_ms, 20);
  spec = SummarySpecFromFlags();
  ASSERT_TRUE(spec.ok()) << spec.status();
  EXPECT_DOUBLE_EQ(spec->slo.ttft_s, 0.25);
  EXPECT_DOUBLE_EQ(spec->slo.tpot_s, 0.02);
  absl::SetFlag(&FLAGS_slo_tpot_ms, -1);
  EXPECT_THAT(SummarySpecFromFlags().status().message(), HasSubstr("--slo_tpot_ms"));
}

TEST_F(WorkloadFlagsTest, LaterLevelsOfASweepGetFreshPromptsWithTheSamePrefixes) {
  // One cluster serves every level of a sweep: were the prompts of level 2
  // those of level 1, its prefill would come from the prefix cache.
  absl::SetFlag(&FLAGS_input_len, std::string("64"));
  absl::SetFlag(&FLAGS_shared_prefix_len, 32);
  absl::SetFlag(&FLAGS_num_prefixes, 1);
  absl::SetFlag(&FLAGS_num_requests, 4);
  absl::SetFlag(&FLAGS_request_rates, std::vector<std::string>{"1", "2"});
  auto workload = WorkloadFromFlags();
  ASSERT_TRUE(workload.ok()) << workload.status();
  auto levels = LoadLevelsFromFlags();
  ASSERT_TRUE(levels.ok()) << levels.status();
  auto first = WorkloadAtLoad(*workload, (*levels)[0]);
  auto second = WorkloadAtLoad(*workload, (*levels)[1]);
  ASSERT_TRUE(first.ok() && second.ok());
  for (size_t i = 0; i < first->requests.size(); ++i) {
    const auto& a = first->requests[i].block_ids;
    const auto& b = second->requests[i].block_ids;
    ASSERT_EQ(a.size(), b.size());
    for (size_t k = 0; k < a.size(); ++k) EXPECT_NE(a[k], b[k]);
    EXPECT_NE(PromptTokens(*first, first->requests[i]), PromptTokens(*second, second->requests[i]));
    // The shared prefix (the first 2 blocks of 16) stays shared.
    EXPECT_EQ(b[0], second->requests[0].block_ids[0]);
    EXPECT_EQ(b[1], second->requests[0].block_ids[1]);
  }
  EXPECT_NE(second->requests[0].block_ids[2], second->requests[1].block_ids[2]);
}

}  // namespace
}  // namespace pdserve::planner
