// The KV transport ranking and the choice among a landing's offers
// (kv_transfer/negotiation.h); the workers' use of it is in
// tests/prefill_worker and tests/cluster.
#include "kv_transfer/negotiation.h"

#include <string>
#include <vector>

#include "gtest/gtest.h"

namespace pdserve {
namespace {

TEST(KvNegotiationTest, RankingFollowsLocality) {
  const std::vector<std::string> best_first = {
      "cuda_ipc", "nccl", "ucx:rc_verbs,sm", "ucx:shm",
      "ucx:tcp",  "tcp",  "inproc",          "carrier-pigeon"};
  for (size_t i = 0; i + 1 < best_first.size(); ++i) {
    EXPECT_LT(kv::KvTransportRank(best_first[i]),
              kv::KvTransportRank(best_first[i + 1]))
        << best_first[i] << " vs " << best_first[i + 1];
  }
  EXPECT_EQ(kv::KvTransportRank("ucx"), kv::KvTransportRank("ucx:tcp"));
  EXPECT_EQ(kv::KvTransportRank("ucx:sm,self"), kv::KvTransportRank("ucx:shm"));
  EXPECT_EQ(kv::KvTransportRank("ucx:dc_mlx5"), kv::KvTransportRank("ucx:rc"));
  EXPECT_EQ(kv::KvTransportRank("ucx:tcp,sm"), kv::KvTransportRank("ucx:tcp"));
}

TEST(KvNegotiationTest, ChoosesCommonOffersBestFirstKeepingTheirOrderOnTies) {
  const std::vector<kv::KvOffer> theirs = {{"tcp", "a", kv::RegionId(1)},
                                           {"ucx:tcp", "b", kv::RegionId(2)},
                                           {"ucx", "c", kv::RegionId(3)},
                                           {"ucx:shm", "d", kv::RegionId(4)}};
  const std::vector<std::string> ours = {"tcp", "ucx", "ucx:tcp", "ucx:shm"};
  auto chosen = kv::ChooseKvOffers(theirs, ours);
  ASSERT_TRUE(chosen.ok()) << chosen.status();
  std::vector<std::string> endpoints;
  for (const kv::KvOffer& o : *chosen) endpoints.push_back(o.endpoint);
  EXPECT_EQ(endpoints, (std::vector<std::string>{"d", "b", "c", "a"}));
  const std::vector<std::string> tcp_only = {"tcp"};
  chosen = kv::ChooseKvOffers(theirs, tcp_only);
  ASSERT_TRUE(chosen.ok());
  ASSERT_EQ(chosen->size(), 1u);
  EXPECT_EQ((*chosen)[0].region, kv::RegionId(1));
}

TEST(KvNegotiationTest, ParsesTransportLists) {
  auto names = kv::ParseKvTransportList("ucx:shm,tcp");
  ASSERT_TRUE(names.ok());
  EXPECT_EQ(*names, (std::vector<std::string>{"ucx:shm", "tcp"}));
  names = kv::ParseKvTransportList("ucx:rc_verbs+sm,tcp");
  ASSERT_TRUE(names.ok());
  EXPECT_EQ(*names, (std::vector<std::string>{"ucx:rc_verbs,sm", "tcp"}));
  for (const char* bad : {"", ",", "tcp,", "tcp,tcp", "a,b,c,d,e,f,g,h,i"}) {
    EXPECT_EQ(kv::ParseKvTransportList(bad).status().code(),
              absl::StatusCode::kInvalidArgument)
        << "'" << bad << "'";
  }
}

}  // namespace
}  // namespace pdserve
