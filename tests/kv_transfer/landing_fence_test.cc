#include "kv_transfer/landing_fence.h"

#include "absl/time/time.h"
#include "gtest/gtest.h"

namespace pdserve::kv {
namespace {

const absl::Time kT0 = absl::FromUnixSeconds(1000);

TEST(LandingFenceTest, IdsAreFreshAndNeverZero) {
  LandingFence a(true, absl::Seconds(1)), b(true, absl::Seconds(1));
  const uint64_t first = a.Open();
  EXPECT_NE(first, 0u);
  EXPECT_NE(a.Open(), first);
  // Two receivers (a worker and its restart) start far apart.
  EXPECT_NE(b.Open(), first + 1);
}

TEST(LandingFenceTest, WritesLandOnlyWhileTheLandingIsOpen) {
  LandingFence fence(true, absl::Seconds(1));
  const uint64_t id = fence.Open();
  EXPECT_TRUE(fence.BeginWrite(id));
  fence.EndWrite(id);
  EXPECT_FALSE(fence.BeginWrite(id + 1000)) << "unknown landing";
  EXPECT_FALSE(fence.BeginWrite(0)) << "untagged write";
  fence.Close(id, kT0);
  EXPECT_FALSE(fence.BeginWrite(id));
  EXPECT_EQ(fence.dropped_writes(), 3u);
}

TEST(LandingFenceTest, FencedWritesFreeAClosedLandingOnceNoWriteIsInPlace) {
  LandingFence fence(/*every_write_fenced=*/true, absl::Hours(1));
  const uint64_t id = fence.Open();
  EXPECT_FALSE(fence.Fenced(id, kT0)) << "still open";
  ASSERT_TRUE(fence.BeginWrite(id));  // Bytes going into its blocks now.
  fence.Close(id, kT0);
  EXPECT_FALSE(fence.Fenced(id, kT0)) << "a write is being placed";
  fence.EndWrite(id);
  EXPECT_TRUE(fence.Fenced(id, kT0));
  EXPECT_EQ(fence.tracked(), 0u);
}

TEST(LandingFenceTest, OneSidedWritesWaitForTheSenderOrTheQuarantine) {
  LandingFence fence(/*every_write_fenced=*/false, absl::Seconds(15));
  const uint64_t quiet = fence.Open();
  const uint64_t done = fence.Open();
  fence.Close(quiet, kT0);
  fence.Close(done, kT0);
  EXPECT_FALSE(fence.Fenced(quiet, kT0 + absl::Seconds(14)));
  EXPECT_TRUE(fence.Fenced(quiet, kT0 + absl::Seconds(15)));
  EXPECT_FALSE(fence.Fenced(done, kT0));
  fence.SenderDone(done);
  EXPECT_TRUE(fence.Fenced(done, kT0));
  EXPECT_EQ(fence.tracked(), 0u);
}

TEST(LandingFenceTest, SenderDoneBeforeTheCloseFencesAtTheClose) {
  LandingFence fence(false, absl::Hours(1));
  const uint64_t id = fence.Open();
  fence.SenderDone(id);
  EXPECT_FALSE(fence.Fenced(id, kT0)) << "open until closed";
  fence.Close(id, kT0);
  EXPECT_TRUE(fence.Fenced(id, kT0));
  fence.SenderDone(id);  // Late and unknown now: ignored.
  EXPECT_EQ(fence.tracked(), 0u);
}

}  // namespace
}  // namespace pdserve::kv
