#include "engine/kv_cache.h"

#include <set>

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

}  // namespace
}  // namespace pdserve
