// EngineMetrics: each step's figures reach the exposition under the names
// pd-plan reads (planner/profiler.cc, planner/pd_plan_main.cc).
#include "engine/engine_metrics.h"

#include <string>

#include "common/metrics.h"
#include "gtest/gtest.h"

namespace pdserve {
namespace {

double Sum(const std::string& exposition, const std::string& name) {
  absl::StatusOr<std::optional<double>> sum = SumOfSamples(exposition, name);
  EXPECT_TRUE(sum.ok()) << sum.status();
  EXPECT_TRUE(sum.ok() && sum->has_value()) << name << " is not exposed";
  return sum.ok() && sum->has_value() ? **sum : -1;
}

TEST(EngineMetricsTest, StepsWallCpuAndGapAreExposedApart) {
  MetricsRegistry registry;
  EngineMetrics metrics(&registry, "pdserve_decode", "step");
  metrics.OnStep({.duration = absl::Milliseconds(3),
                  .cpu = absl::Milliseconds(1),
                  .running = 2,
                  .generated_tokens = 2,
                  .gap = absl::Microseconds(250)});
  metrics.OnStep({.duration = absl::Milliseconds(5),
                  .cpu = absl::Milliseconds(4),
                  .running = 3,
                  .generated_tokens = 3,
                  .prompt_tokens = 7});
  const std::string text = registry.Exposition();
  EXPECT_DOUBLE_EQ(Sum(text, "pdserve_decode_step_seconds_sum"), 0.008);
  EXPECT_DOUBLE_EQ(Sum(text, "pdserve_decode_step_seconds_count"), 2);
  EXPECT_DOUBLE_EQ(Sum(text, "pdserve_decode_step_cpu_seconds_sum"), 0.005);
  EXPECT_DOUBLE_EQ(Sum(text, "pdserve_decode_step_cpu_seconds_count"), 2);
  // Only the step that followed another back to back has a gap.
  EXPECT_DOUBLE_EQ(Sum(text, "pdserve_decode_step_gap_seconds_sum"), 0.00025);
  EXPECT_DOUBLE_EQ(Sum(text, "pdserve_decode_step_gap_seconds_count"), 1);
  EXPECT_DOUBLE_EQ(Sum(text, "pdserve_decode_batch_size_sum"), 5);
  EXPECT_DOUBLE_EQ(Sum(text, "pdserve_decode_generated_tokens_total"), 5);
  EXPECT_DOUBLE_EQ(Sum(text, "pdserve_decode_computed_prompt_tokens_total"), 7);
}

}  // namespace
}  // namespace pdserve
