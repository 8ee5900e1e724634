#include "router/kv_index.h"

#include <thread>

#include "engine/kv_cache.h"
#include "engine/kv_event_log.h"
#include "gtest/gtest.h"
#include "proto/convert.h"

namespace pdserve {
namespace {

namespace wire = ::pdserve::internal::v1;
using Kind = KvCacheEvent::Kind;

// What a worker whose engine logged `log` answers a router at `cursor`.
wire::KvCacheEvents ReportFor(const KvEventLog& log, KvIndex::Cursor cursor) {
  wire::LoadRequest request;
  request.set_kv_events_epoch(cursor.epoch);
  request.set_kv_events_seq(cursor.seq);
  wire::LoadReport report;
  ToWire(log, request, &report);
  return report.kv_events();
}

TEST(KvIndexTest, FollowsAWorkersEventsAndCountsLeadingBlocks) {
  const std::vector<int32_t> prompt(100, 7);
  const std::vector<uint64_t> chain = PromptBlockHashes(prompt, 16);  // 6 blocks.
  KvEventLog log;
  KvIndex index;
  std::vector<KvCacheEvent> events;
  for (int i = 0; i < 4; ++i) events.push_back({Kind::kStored, chain[i]});
  log.Append(events);
  EXPECT_EQ(index.CursorOf("d0").epoch, 0u);
  EXPECT_TRUE(index.Apply("d0", 16, ReportFor(log, index.CursorOf("d0"))));
  EXPECT_EQ(index.LeadingBlocks("d0", chain, 16), 4);
  EXPECT_EQ(index.LeadingBlocks("d0", chain, 32), 0);  // Other block size.
  EXPECT_EQ(index.LeadingBlocks("d1", chain, 16), 0);  // Unknown worker.
  // Block 1 evicted: only block 0 leads.
  const std::vector<KvCacheEvent> evict = {{Kind::kEvicted, chain[1]}};
  log.Append(evict);
  const wire::KvCacheEvents delta = ReportFor(log, index.CursorOf("d0"));
  EXPECT_FALSE(delta.snapshot());
  EXPECT_TRUE(index.Apply("d0", 16, delta));
  EXPECT_EQ(index.LeadingBlocks("d0", chain, 16), 1);
  EXPECT_EQ(index.num_hashes("d0"), 3u);
  // The same delta again does not follow the cursor: dropped, and the next
  // report is a snapshot that brings the index back.
  EXPECT_FALSE(index.Apply("d0", 16, delta));
  EXPECT_EQ(index.LeadingBlocks("d0", chain, 16), 0);
  const wire::KvCacheEvents snapshot = ReportFor(log, index.CursorOf("d0"));
  EXPECT_TRUE(snapshot.snapshot());
  EXPECT_TRUE(index.Apply("d0", 16, snapshot));
  EXPECT_EQ(index.LeadingBlocks("d0", chain, 16), 1);
  EXPECT_EQ(index.num_hashes("d0"), 3u);
  // A restarted worker (new epoch) sends a snapshot for the old cursor.
  KvEventLog restarted;
  const wire::KvCacheEvents fresh = ReportFor(restarted, index.CursorOf("d0"));
  EXPECT_TRUE(fresh.snapshot());
  EXPECT_TRUE(index.Apply("d0", 16, fresh));
  EXPECT_EQ(index.num_hashes("d0"), 0u);
  index.Drop("d0");
  EXPECT_EQ(index.CursorOf("d0").epoch, 0u);
}

TEST(KvIndexTest, ReadersRunWhileReportsApply) {
  const std::vector<uint64_t> chain = PromptBlockHashes(std::vector<int32_t>(64, 3), 16);
  KvIndex index;
  std::thread writer([&] {
    for (int i = 0; i < 2000; ++i) {
      wire::KvCacheEvents e;
      e.set_snapshot(true);
      e.set_epoch(1);
      e.set_last_seq(i);
      for (int b = 0; b <= i % 4; ++b) e.add_stored(chain[b]);
      index.Apply(i % 2 ? "d0" : "d1", 16, e);
    }
  });
  for (int i = 0; i < 2000; ++i) {
    const int32_t n = index.LeadingBlocks("d0", chain, 16);
    EXPECT_GE(n, 0);
    EXPECT_LE(n, 4);
  }
  writer.join();
}

}  // namespace
}  // namespace pdserve
