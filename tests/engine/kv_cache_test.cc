#include "engine/kv_cache.h"

#include <algorithm>

#include <set>

#include "engine/kv_event_log.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace pdserve {
namespace {

TEST(KvBlockLayoutTest, OffsetsTileTheBlockWithoutOverlap) {
  const KvBlockLayout L{3, 2, 8, 4, DType::kBF16};
  EXPECT_EQ(L.slot_bytes(), 2u * 8 * 2);
  EXPECT_EQ(L.layer_block_bytes(), 2u * 4 * L.slot_bytes());
  EXPECT_EQ(L.block_bytes(), 3 * L.layer_block_bytes());
  std::set<size_t> starts;
  for (int s = 0; s < 4; ++s) {
    for (int h = 0; h < 2; ++h) {
      starts.insert(L.KeyOffset(s, h));
      starts.insert(L.ValueOffset(s, h));
    }
  }
  ASSERT_EQ(starts.size(), 16u);  // Distinct, head_dim apart, covering the block.
  size_t expect = 0;
  for (size_t o : starts) {
    EXPECT_EQ(o, expect);
    expect += 8 * 2;
  }
  EXPECT_EQ(expect, L.layer_block_bytes());
  EXPECT_EQ(L.PoolOffset(2, BlockId(5), 10), (2u * 10 + 5) * L.layer_block_bytes());
}

TEST(KvBlockPoolTest, AllocateIsAllOrNothingAndReleaseReturnsBlocks) {
  KvBlockPool pool(8);
  auto a = pool.Allocate(5);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(pool.num_free(), 3);
  auto b = pool.Allocate(4);
  EXPECT_EQ(b.status().code(), absl::StatusCode::kResourceExhausted);
  EXPECT_EQ(pool.num_free(), 3);
  std::set<int32_t> ids;
  for (BlockId id : *a) ids.insert(id.value);
  EXPECT_EQ(ids.size(), 5u);
  pool.Release(*a);
  EXPECT_EQ(pool.num_free(), 8);
}

TEST(KvBlockPoolTest, RefCountsKeepSharedBlocksInUse) {
  KvBlockPool pool(2);
  auto a = pool.Allocate(1);
  ASSERT_TRUE(a.ok());
  const BlockId b = (*a)[0];
  pool.AddRef(b);
  EXPECT_EQ(pool.ref_count(b), 2);
  pool.Release(b);
  EXPECT_EQ(pool.num_free(), 1);
  pool.Release(b);
  EXPECT_EQ(pool.num_free(), 2);
}

TEST(KvBlockPoolTest, FreedHashedBlockCanBeRevivedUntilReused) {
  KvBlockPool pool(2);
  const int32_t tokens[] = {1, 2, 3, 4};
  const uint64_t h = HashBlockTokens(0, tokens);
  auto a = pool.Allocate(1);
  ASSERT_TRUE(a.ok());
  pool.SetHash((*a)[0], h);
  pool.Release((*a)[0]);
  EXPECT_EQ(pool.num_free(), 2);
  auto hit = pool.LookupPrefix(h);
  ASSERT_TRUE(hit.has_value());
  EXPECT_EQ(*hit, (*a)[0]);
  EXPECT_EQ(pool.num_free(), 1);
  pool.Release(*hit);
  // Oldest-freed first: the other block goes out before the cached one...
  auto c = pool.Allocate(1);
  ASSERT_TRUE(c.ok());
  EXPECT_NE((*c)[0], (*a)[0]);
  EXPECT_TRUE(pool.LookupPrefix(h).has_value());
  pool.Release((*a)[0]);
  // ...and once it is handed out again its hash is gone.
  auto d = pool.Allocate(1);
  ASSERT_TRUE(d.ok());
  EXPECT_EQ((*d)[0], (*a)[0]);
  EXPECT_FALSE(pool.LookupPrefix(h).has_value());
}

TEST(HashBlockTokensTest, DependsOnParentAndEveryToken) {
  const int32_t a[] = {1, 2, 3};
  const int32_t b[] = {1, 2, 4};
  EXPECT_EQ(HashBlockTokens(7, a), HashBlockTokens(7, a));
  EXPECT_NE(HashBlockTokens(7, a), HashBlockTokens(8, a));
  EXPECT_NE(HashBlockTokens(7, a), HashBlockTokens(7, b));
  EXPECT_NE(HashBlockTokens(7, std::span(a, 2)), HashBlockTokens(7, a));
}

TEST(KvBlockPoolDeathTest, DoubleReleaseIsABrokenInvariant) {
  KvBlockPool pool(1);
  auto a = pool.Allocate(1);
  ASSERT_TRUE(a.ok());
  pool.Release((*a)[0]);
  EXPECT_DEATH(pool.Release((*a)[0]), "double release");
}

using Kind = KvCacheEvent::Kind;
using ::testing::ElementsAre;
using ::testing::IsEmpty;
using ::testing::UnorderedElementsAre;

TEST(KvBlockPoolEventsTest, RecordsStoredAndEvictedHashes) {
  KvBlockPool pool(2);
  std::vector<KvCacheEvent> events;
  auto a = pool.Allocate(1);
  ASSERT_TRUE(a.ok());
  pool.SetHash((*a)[0], 11);  // Not recorded yet.
  pool.set_record_events(true);
  auto b = pool.Allocate(1);
  ASSERT_TRUE(b.ok());
  pool.SetHash((*b)[0], 22);
  pool.SetHash((*b)[0], 22);  // Same hash again: no event.
  pool.SetHash((*b)[0], 11);  // 11 is held by a: b drops 22, stays unhashed.
  pool.TakeEvents(events);
  EXPECT_THAT(events, ElementsAre(KvCacheEvent{Kind::kStored, 22}, KvCacheEvent{Kind::kEvicted, 22}));
  events.clear();
  pool.Release(*a);
  pool.Release(*b);
  EXPECT_THAT(pool.HeldHashes(), ElementsAre(11));  // Free, but revivable.
  // a was freed first, so it is handed out first: its hash goes.
  auto c = pool.Allocate(1);
  ASSERT_TRUE(c.ok());
  pool.TakeEvents(events);
  EXPECT_THAT(events, ElementsAre(KvCacheEvent{Kind::kEvicted, 11}));
  EXPECT_THAT(pool.HeldHashes(), IsEmpty());
}

TEST(PromptBlockHashesTest, ChainsFullBlocksOnly) {
  const std::vector<int32_t> tokens = {1, 2, 3, 4, 5, 6, 7};
  const std::vector<uint64_t> h = PromptBlockHashes(tokens, 3);
  ASSERT_EQ(h.size(), 2u);
  EXPECT_EQ(h[0], HashBlockTokens(0, std::span(tokens).first(3)));
  EXPECT_EQ(h[1], HashBlockTokens(h[0], std::span(tokens).subspan(3, 3)));
}

TEST(KvEventLogTest, DeltasFollowTheCursorAndSnapshotsReplace) {
  KvEventLog log;
  ASSERT_NE(log.epoch(), 0u);
  const std::vector<KvCacheEvent> first = {
      {Kind::kStored, 1}, {Kind::kStored, 2}, {Kind::kEvicted, 1}, {Kind::kStored, 3}};
  log.Append(first);
  // No cursor: a snapshot of what is held.
  KvEventsReport r = log.ReportSince(0, 0);
  EXPECT_TRUE(r.snapshot);
  EXPECT_EQ(r.epoch, log.epoch());
  EXPECT_EQ(r.last_seq, 4u);
  EXPECT_THAT(r.stored, UnorderedElementsAre(2, 3));
  // Up to date: an empty delta.
  r = log.ReportSince(log.epoch(), 4);
  EXPECT_FALSE(r.snapshot);
  EXPECT_EQ(r.after_seq, 4u);
  EXPECT_EQ(r.last_seq, 4u);
  EXPECT_THAT(r.stored, IsEmpty());
  // A delta is the net change: 3 evicted then stored again is stored.
  const std::vector<KvCacheEvent> second = {
      {Kind::kEvicted, 3}, {Kind::kStored, 3}, {Kind::kEvicted, 2}, {Kind::kStored, 4}};
  log.Append(second);
  r = log.ReportSince(log.epoch(), 2);
  EXPECT_FALSE(r.snapshot);
  EXPECT_EQ(r.after_seq, 2u);
  EXPECT_EQ(r.last_seq, 8u);
  EXPECT_THAT(r.stored, UnorderedElementsAre(3, 4));
  EXPECT_THAT(r.evicted, UnorderedElementsAre(1, 2));
  // Another epoch, or a cursor ahead of the log: a snapshot.
  EXPECT_TRUE(log.ReportSince(log.epoch() + 1, 8).snapshot);
  EXPECT_TRUE(log.ReportSince(log.epoch(), 9).snapshot);
}

TEST(KvEventLogTest, ReportsAndTheLogAreBounded) {
  KvEventLog log({.capacity = 4, .max_report_hashes = 3});
  std::vector<KvCacheEvent> events;
  for (uint64_t h = 1; h <= 6; ++h) events.push_back({Kind::kStored, h});
  log.Append(events);
  // Events 1 and 2 were dropped: a cursor at 0 or 1 is too old.
  EXPECT_TRUE(log.ReportSince(log.epoch(), 1).snapshot);
  KvEventsReport r = log.ReportSince(log.epoch(), 2);
  ASSERT_FALSE(r.snapshot);
  EXPECT_EQ(r.last_seq, 5u);  // Three events at most; the rest next time.
  EXPECT_THAT(r.stored, UnorderedElementsAre(3, 4, 5));
  r = log.ReportSince(log.epoch(), r.last_seq);
  EXPECT_EQ(r.last_seq, 6u);
  EXPECT_THAT(r.stored, ElementsAre(6));
  r = log.ReportSince(0, 0);
  EXPECT_TRUE(r.snapshot);
  EXPECT_TRUE(r.truncated);
  EXPECT_EQ(r.stored.size(), 3u);
}

}  // namespace
}  // namespace pdserve
