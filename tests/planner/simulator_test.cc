// The cluster simulator against results that can be had without it:
// queueing theory for a batch-1 server, and timelines computed by hand
// from the profile for continuous batching, chunked prefill, the
// disaggregated hand-off, KV capacity and the prefix cache. Then
// determinism, speed on a real trace, and the profile's JSON.
#include "planner/simulator.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "planner/profile.h"
#include "planner/summary.h"
#include "planner/workload.h"

namespace pdserve::planner {
namespace {

// Every cost 0 but what a test sets; pools large enough for anything.
Profile TestProfile() {
  Profile p;
  p.model = "test";
  p.machine = "test";
  p.cpu_share = "none";
  p.block_size = 16;
  p.max_batch_tokens = 512;
  p.max_running = 64;
  p.prefill_kv_blocks = 1 << 16;
  p.decode_kv_blocks = 1 << 16;
  p.transfers = {{.transport = "tcp", .latency_s = 0, .bytes_per_s = 1e12}};
  p.poll_interval_s = 0.1;
  return p;
}

ClusterShape Shape(int prefill, int decode) {
  ClusterShape s;
  s.prefill = prefill;
  s.decode = decode;
  return s;
}

WorkloadRequest Req(double arrival_s, int32_t input, int32_t output,
                    std::vector<uint64_t> block_ids = {}) {
  return {.arrival_s = arrival_s,
          .input_tokens = input,
          .output_tokens = output,
          .block_ids = std::move(block_ids)};
}

Workload MakeWorkload(std::vector<WorkloadRequest> requests, int32_t block_tokens = 16) {
  Workload w;
  w.block_tokens = block_tokens;
  w.requests = std::move(requests);
  return w;
}

std::vector<RequestRecord> SimulateOk(const Profile& profile, const ClusterShape& shape,
                                      const Workload& workload,
                                      const SimulationOptions& options = {}) {
  absl::StatusOr<Simulation> simulation = Simulate(profile, shape, workload, options);
  EXPECT_TRUE(simulation.ok()) << simulation.status();
  if (!simulation.ok()) return {};
  EXPECT_EQ(simulation->records.size(), workload.requests.size());
  return std::move(simulation->records);
}

double Ttft(const RequestRecord& r) { return r.token_s.front() - r.send_s; }

TEST(SimulatorTest, ContinuousBatchingRunsSimultaneousRequestsInOneBatch) {
  // N requests of a 1-token prompt and L output tokens, all at once, on one
  // colocated decode worker: step 1 prefills every prompt (each samples its
  // first token), steps 2..L decode one token of each: L steps of batch N.
  constexpr int kN = 8, kL = 5;
  Profile p = TestProfile();
  p.step = {.base_s = 0.01, .per_token_s = 0.001, .per_sequence_s = 0.002, .per_attention_s = 1e-4, .per_decode_attention_s = 1e-4};
  p.colocated_first_token_s = 0.003;
  p.token_delivery_s = 0.0005;
  std::vector<WorkloadRequest> requests(kN, Req(0, 1, kL));
  const std::vector<RequestRecord> records = SimulateOk(p, Shape(0, 1), MakeWorkload(requests));
  // Step k computes one token of each sequence, whose context is then k
  // tokens (the prompt's, then one more per step).
  double end = 0;
  std::vector<double> step_end;
  for (int k = 1; k <= kL; ++k) {
    end += 0.01 + 0.001 * kN + 0.002 * kN + 1e-4 * kN * k;
    step_end.push_back(end);
  }
  for (const RequestRecord& r : records) {
    ASSERT_TRUE(r.ok()) << r.error;
    ASSERT_EQ(r.token_s.size(), static_cast<size_t>(kL));
    EXPECT_EQ(r.output_tokens, kL);
    EXPECT_DOUBLE_EQ(r.token_s[0], step_end[0] + 0.003);
    for (int k = 1; k < kL; ++k) EXPECT_DOUBLE_EQ(r.token_s[k], step_end[k] + 0.0005);
    EXPECT_DOUBLE_EQ(r.end_s, step_end.back() + 0.0005);
  }
}

TEST(SimulatorTest, ChunkedPrefillTakesCeilPOverCSteps) {
  // A 1000-token prompt with a 256-token step budget: chunks of 256, 256,
  // 256 and 232 tokens, the first token sampled at the end of the fourth.
  Profile p = TestProfile();
  p.max_batch_tokens = 256;
  p.max_running = 8;
  p.step = {.base_s = 0.01, .per_token_s = 1e-4, .per_attention_s = 1e-7, .per_decode_attention_s = 1e-7};
  p.colocated_first_token_s = 0.002;
  const std::vector<RequestRecord> records =
      SimulateOk(p, Shape(0, 1), MakeWorkload({Req(0.5, 1000, 1)}));
  ASSERT_EQ(records.size(), 1u);
  double ttft = 0;
  for (int start = 0; start < 1000; start += 256) {
    const int n = std::min(256, 1000 - start);
    ttft += 0.01 + 1e-4 * n + 1e-7 * (n * start + n * (n + 1) / 2.0);
  }
  ttft += 0.002;
  ASSERT_TRUE(records[0].ok()) << records[0].error;
  EXPECT_DOUBLE_EQ(records[0].send_s, 0.5);
  EXPECT_NEAR(Ttft(records[0]), ttft, 1e-12);
  EXPECT_DOUBLE_EQ(records[0].end_s, records[0].token_s[0]);
}

TEST(SimulatorTest, DisaggregatedRequestIsPrefillPushFirstTokenThenDecode) {
  // 1P1D, one request of 40 prompt tokens and 3 output tokens; steps of
  // 16 tokens cost 1 s each. Each chunk's KV (1000 bytes a token) moves
  // over the prefill worker's link at 16000 / 1.5 bytes/s as the chunk
  // computes: the link, not the forward pass, is the bottleneck.
  Profile p = TestProfile();
  p.max_batch_tokens = 16;
  p.max_running = 4;
  p.step = {.base_s = 1.0};
  p.kv_bytes_per_token = 1000;
  p.transfers = {{.transport = "tcp", .latency_s = 0.25, .bytes_per_s = 16000 / 1.5}};
  p.disaggregated_first_token_s = 0.125;
  p.disaggregated_token_delivery_s = 0.0625;
  p.token_delivery_s = 0.03125;  // A colocated request's: not this one's.
  ClusterShape shape = Shape(1, 1);
  shape.routing.local_prefill_max_tokens = 0;  // Never prefill on D.
  const std::vector<RequestRecord> records = SimulateOk(p, shape, MakeWorkload({Req(0, 40, 3)}));
  ASSERT_EQ(records.size(), 1u);
  const RequestRecord& r = records[0];
  ASSERT_TRUE(r.ok()) << r.error;
  ASSERT_EQ(r.token_s.size(), 3u);
  // Chunks of 16, 16, 8 tokens in steps [0,1], [1,2], [2,3]; their pushes
  // take 1.5, 1.5 and 0.75 s, each sent as its step writes it, behind the
  // push before it, and done no earlier than its step: at 1.5, 3.0 and
  // 3.75 s. The KV has landed after the latency, at 4.0 s.
  double link = 0;
  const double push_s[] = {1.5, 1.5, 0.75};
  for (int k = 0; k < 3; ++k) link = std::max(k + 1.0, std::max(link, k + 0.0) + push_s[k]);
  const double landed = link + 0.25;
  ASSERT_DOUBLE_EQ(landed, 4.0);
  EXPECT_DOUBLE_EQ(r.token_s[0], landed + 0.125);
  // The decode worker starts at 4.0 and decodes tokens 2 and 3 in two
  // 1-second steps; each reaches the client 0.0625 s after its step.
  EXPECT_DOUBLE_EQ(r.token_s[1], landed + 1.0 + 0.0625);
  EXPECT_DOUBLE_EQ(r.token_s[2], landed + 2.0 + 0.0625);
  EXPECT_DOUBLE_EQ(r.end_s, r.token_s[2]);
}

TEST(SimulatorTest, FastLinkLeavesOnlyTheLatencyAfterTheForwardPass) {
  // The layer-wise push: on a link faster than the forward pass, the KV
  // has moved by the end of the last step but for the latency.
  Profile p = TestProfile();
  p.step = {.base_s = 0.5, .per_token_s = 0.001};
  p.kv_bytes_per_token = 1e6;
  p.transfers = {{.transport = "tcp", .latency_s = 0.01, .bytes_per_s = 1e10}};
  p.disaggregated_first_token_s = 0.002;
  ClusterShape shape = Shape(1, 1);
  shape.routing.local_prefill_max_tokens = 0;
  const std::vector<RequestRecord> records = SimulateOk(p, shape, MakeWorkload({Req(0, 300, 1)}));
  ASSERT_EQ(records.size(), 1u);
  ASSERT_TRUE(records[0].ok());
  EXPECT_DOUBLE_EQ(Ttft(records[0]), 0.5 + 0.001 * 300 + 0.01 + 0.002);
}

TEST(SimulatorTest, ServingThreadsTakeEngineTime) {
  // 1P1D, steps of 16 tokens costing 1 s, a link too fast to matter. The
  // prefill worker's serving threads take 0.5 s a request and 1e-5 s a
  // pushed byte.
  Profile p = TestProfile();
  p.max_batch_tokens = 16;
  p.max_running = 4;
  p.step = {.base_s = 1.0};
  p.kv_bytes_per_token = 1000;
  p.disaggregated_token_delivery_s = 0.1;
  p.prefill_cpu_per_request_s = 0.5;
  p.prefill_cpu_per_kv_byte_s = 1e-5;
  ClusterShape shape = Shape(1, 1);
  shape.routing.local_prefill_max_tokens = 0;
  // The second request comes long after the first has ended: it sees the
  // same times (nothing the first one's threads took is left to pay).
  const std::vector<RequestRecord> records =
      SimulateOk(p, shape, MakeWorkload({Req(0, 40, 3), Req(100, 40, 3)}));
  ASSERT_EQ(records.size(), 2u);
  for (const RequestRecord& r : records) {
    ASSERT_TRUE(r.ok()) << r.error;
    ASSERT_EQ(r.token_s.size(), 3u);
    const double t0 = r.send_s;
    // Chunks of 16, 16, 8 tokens, each step paying its own chunk's push
    // (16000 bytes: 0.16 s; 8000: 0.08 s). The first step also pays the
    // request's 0.5 s.
    const double prefilled = t0 + 1.66 + 1.16 + 1.08;
    EXPECT_NEAR(r.token_s[0], prefilled, 1e-9);
    EXPECT_NEAR(r.token_s[1], prefilled + 0.1 + 1.0, 1e-9);
    EXPECT_NEAR(r.token_s[2], prefilled + 0.1 + 2.0, 1e-9);
  }
}

TEST(SimulatorTest, DecodeServingThreadsTakeEngineTimePerToken) {
  // 0P1D, one request of 16 prompt tokens and 4 output tokens, steps
  // costing 1 s; the decode worker's serving threads take 0.25 s a token
  // streamed. Each step after the first pays for the tokens of the one
  // before it (one each); the time after the last is paid by idle time.
  Profile p = TestProfile();
  p.max_batch_tokens = 16;
  p.max_running = 4;
  p.step = {.base_s = 1.0};
  p.decode_cpu_per_token_s = 0.25;
  const std::vector<RequestRecord> records =
      SimulateOk(p, Shape(0, 1), MakeWorkload({Req(0, 16, 4), Req(100, 16, 4)}));
  ASSERT_EQ(records.size(), 2u);
  for (const RequestRecord& r : records) {
    ASSERT_TRUE(r.ok()) << r.error;
    ASSERT_EQ(r.token_s.size(), 4u);
    // The prefill step, then three decode steps of 1 + 0.25 s.
    EXPECT_NEAR(r.token_s[0] - r.send_s, 1.0, 1e-9);
    for (int i = 1; i < 4; ++i) EXPECT_NEAR(r.token_s[i] - r.token_s[i - 1], 1.25, 1e-9);
  }
  // Two sequences in one batch: each step pays for both of the last one's
  // tokens.
  const std::vector<RequestRecord> batched =
      SimulateOk(p, Shape(0, 1), MakeWorkload({Req(0, 8, 4), Req(0, 8, 4)}));
  ASSERT_EQ(batched.size(), 2u);
  for (const RequestRecord& r : batched) {
    ASSERT_TRUE(r.ok()) << r.error;
    ASSERT_EQ(r.token_s.size(), 4u);
    for (int i = 2; i < 4; ++i) EXPECT_NEAR(r.token_s[i] - r.token_s[i - 1], 1.5, 1e-9);
  }
}

TEST(SimulatorTest, SumsEachRolesStepTimes) {
  // 1P1D and 0P1D: one request of 40 prompt tokens (chunks of 16, 16, 8)
  // and 3 output tokens, steps costing 1 s + 0.01 s a token, a decode
  // worker's streaming 0.5 s a step, a pushed byte 1e-5 s.
  Profile p = TestProfile();
  p.max_batch_tokens = 16;
  p.max_running = 4;
  p.step = {.base_s = 1.0, .per_token_s = 0.01};
  p.kv_bytes_per_token = 1000;
  p.decode_step_overhead_s = 0.5;
  p.prefill_cpu_per_kv_byte_s = 1e-5;
  const Workload w = MakeWorkload({Req(0, 40, 3)});
  ClusterShape shape = Shape(1, 1);
  shape.routing.local_prefill_max_tokens = 0;
  absl::StatusOr<Simulation> disaggregated = Simulate(p, shape, w);
  ASSERT_TRUE(disaggregated.ok()) << disaggregated.status();
  // Three prefill steps of 16, 16 and 8 tokens pushing 16000, 16000 and
  // 8000 bytes; two decode steps (the first token is the prefill's), whose
  // streaming overhead comes after the step, not in it.
  EXPECT_NEAR(disaggregated->prefill_step_s, 3 * 1.0 + 40 * 0.01 + 40000 * 1e-5, 1e-9);
  EXPECT_NEAR(disaggregated->decode_step_s, 2 * (1.0 + 0.01), 1e-9);
  EXPECT_EQ(disaggregated->decode_steps, 2);
  EXPECT_EQ(disaggregated->decode_step_sequences, 2);  // One sequence each.
  EXPECT_NEAR(disaggregated->records[0].token_s.back() - disaggregated->records[0].token_s[0],
              2 * (1.0 + 0.01 + 0.5), 1e-9);
  // The second decode step follows the first with nothing else to do: the
  // first's streaming is the time between them (the first follows the KV's
  // landing, not a step).
  EXPECT_NEAR(disaggregated->decode_gap_s, 0.5, 1e-9);
  absl::StatusOr<Simulation> colocated = Simulate(p, Shape(0, 1), w);
  ASSERT_TRUE(colocated.ok()) << colocated.status();
  // The decode worker prefills too (no push), then decodes the same two.
  EXPECT_EQ(colocated->prefill_step_s, 0);
  EXPECT_NEAR(colocated->decode_step_s, 3 * 1.0 + 40 * 0.01 + 2 * (1.0 + 0.01), 1e-9);
  EXPECT_EQ(colocated->decode_steps, 5);
  EXPECT_EQ(colocated->decode_step_sequences, 5);
  // Five steps back to back: four gaps of its streaming.
  EXPECT_NEAR(colocated->decode_gap_s, 4 * 0.5, 1e-9);

  // A busy prefill worker's engine runs 1.5x its step model: its steps
  // cost that much (not their push), and the first token comes that much
  // later; a decode worker's steps, prefills included, do not change.
  p.prefill_engine_scale = 1.5;
  absl::StatusOr<Simulation> slow = Simulate(p, shape, w);
  ASSERT_TRUE(slow.ok()) << slow.status();
  EXPECT_NEAR(slow->prefill_step_s, 1.5 * (3 * 1.0 + 40 * 0.01) + 40000 * 1e-5, 1e-9);
  EXPECT_NEAR(slow->decode_step_s, disaggregated->decode_step_s, 1e-9);
  EXPECT_NEAR(slow->records[0].token_s[0] - disaggregated->records[0].token_s[0],
              0.5 * (3 * 1.0 + 40 * 0.01), 1e-9);
  absl::StatusOr<Simulation> slow_colocated = Simulate(p, Shape(0, 1), w);
  ASSERT_TRUE(slow_colocated.ok()) << slow_colocated.status();
  EXPECT_NEAR(slow_colocated->decode_step_s, colocated->decode_step_s, 1e-9);

  // A decode worker's at 2x on prompts: its prefill chunks only, so the
  // disaggregated decode worker's steps stay.
  p.decode_engine_scale = 2;
  absl::StatusOr<Simulation> slow_decode = Simulate(p, shape, w);
  ASSERT_TRUE(slow_decode.ok()) << slow_decode.status();
  EXPECT_NEAR(slow_decode->prefill_step_s, slow->prefill_step_s, 1e-9);
  EXPECT_NEAR(slow_decode->decode_step_s, disaggregated->decode_step_s, 1e-9);
  slow_colocated = Simulate(p, Shape(0, 1), w);
  ASSERT_TRUE(slow_colocated.ok()) << slow_colocated.status();
  EXPECT_NEAR(slow_colocated->decode_step_s, 2 * (3 * 1.0 + 40 * 0.01) + 2 * (1.0 + 0.01), 1e-9);

  // And at 3x on decode batches: the steps that only decode, not its
  // streaming overhead; the prefill worker's stay.
  p.decode_batch_scale = 3;
  slow_decode = Simulate(p, shape, w);
  ASSERT_TRUE(slow_decode.ok()) << slow_decode.status();
  EXPECT_NEAR(slow_decode->prefill_step_s, slow->prefill_step_s, 1e-9);
  EXPECT_NEAR(slow_decode->decode_step_s, 3 * 2 * (1.0 + 0.01), 1e-9);
  EXPECT_NEAR(slow_decode->records[0].token_s.back() - slow_decode->records[0].token_s[0],
              2 * (3 * (1.0 + 0.01) + 0.5), 1e-9);
  slow_colocated = Simulate(p, Shape(0, 1), w);
  ASSERT_TRUE(slow_colocated.ok()) << slow_colocated.status();
  EXPECT_NEAR(slow_colocated->decode_step_s,
              2 * (3 * 1.0 + 40 * 0.01) + 3 * 2 * (1.0 + 0.01), 1e-9);
}

TEST(SimulatorTest, ConcurrencyNeverExceedsWhatTheDecodePoolHolds) {
  // A pool of 10 blocks of 16 tokens; each request needs 2 (16 prompt + 16
  // output tokens): at most 5 run at once, the others wait in the router's
  // queue, in waves.
  Profile p = TestProfile();
  p.decode_kv_blocks = 10;
  p.step = {.base_s = 0.01};
  p.token_delivery_s = 0.001;
  // First, 161 tokens: more than the pool, refused at once. (Behind queued
  // requests it would wait for its turn, as in the router.)
  std::vector<WorkloadRequest> requests = {Req(0, 100, 61)};
  requests.insert(requests.end(), 12, Req(0, 16, 16));
  const std::vector<RequestRecord> records = SimulateOk(p, Shape(0, 1), MakeWorkload(requests));
  ASSERT_EQ(records.size(), 13u);
  int max_running = 0;
  for (const RequestRecord& a : records) {
    if (!a.ok()) continue;
    int running = 0;
    for (const RequestRecord& b : records) {
      running +=
          b.ok() && b.token_s.front() <= a.token_s.front() && a.token_s.front() <= b.token_s.back();
    }
    max_running = std::max(max_running, running);
  }
  EXPECT_EQ(max_running, 5);
  for (int i = 1; i <= 12; ++i) {
    ASSERT_TRUE(records[i].ok()) << records[i].error;
    // Three waves of 16 steps each; a wave starts when the one before has
    // ended at the client (the router's ledger frees blocks then).
    const int wave = (i - 1) / 5;
    EXPECT_NEAR(records[i].end_s, (wave + 1) * (16 * 0.01 + 0.001), 1e-12) << i;
  }
  const RequestRecord& big = records.front();
  EXPECT_EQ(big.outcome, "RESOURCE_EXHAUSTED");
  EXPECT_TRUE(big.token_s.empty());
  EXPECT_EQ(big.end_s, big.send_s);
}

TEST(SimulatorTest, FullRouterQueueRefusesRequests) {
  Profile p = TestProfile();
  p.decode_kv_blocks = 2;  // One request at a time.
  p.step = {.base_s = 0.01};
  std::vector<WorkloadRequest> requests(5, Req(0, 16, 16));
  SimulationOptions options;
  options.max_queued = 2;
  const std::vector<RequestRecord> records =
      SimulateOk(p, Shape(0, 1), MakeWorkload(requests), options);
  std::vector<std::string> outcomes;
  for (const RequestRecord& r : records) outcomes.push_back(r.outcome);
  EXPECT_EQ(outcomes, (std::vector<std::string>{"OK", "OK", "OK", "RESOURCE_EXHAUSTED",
                                                "RESOURCE_EXHAUSTED"}));
  EXPECT_NEAR(records[2].end_s, 3 * 16 * 0.01, 1e-12);
}

TEST(SimulatorTest, PrefixCacheComputesOnlyTheUncachedPart) {
  // Two 64-token prompts sharing their first 48 tokens (workload blocks of
  // 16), one after the other on one colocated decode worker: the second
  // computes 16 tokens, which attend to the 48 before them and causally to
  // each other.
  Profile p = TestProfile();
  p.step = {.base_s = 0.01, .per_token_s = 1e-3, .per_attention_s = 1e-6, .per_decode_attention_s = 1e-6};
  p.colocated_first_token_s = 0.002;
  const std::vector<RequestRecord> records =
      SimulateOk(p, Shape(0, 1),
                 MakeWorkload({Req(0, 64, 1, {1, 2, 3, 4}), Req(1, 64, 1, {1, 2, 3, 5}),
                               // The same prompt again: its last block is still
                               // computed (its logits are needed).
                               Req(2, 64, 1, {1, 2, 3, 4})}));
  ASSERT_EQ(records.size(), 3u);
  EXPECT_NEAR(Ttft(records[0]), 0.01 + 64e-3 + (64 * 65 / 2) * 1e-6 + 0.002, 1e-12);
  EXPECT_NEAR(Ttft(records[1]), 0.01 + 16e-3 + (16 * 48 + 16 * 17 / 2) * 1e-6 + 0.002, 1e-12);
  EXPECT_NEAR(Ttft(records[2]), Ttft(records[1]), 1e-12);
}

TEST(SimulatorTest, PrefixCachesOnBothSidesShortenComputeAndPush) {
  // 1P1D: the second request finds 48 of its 64 prompt tokens in the
  // prefill worker's cache (it computes 16) and in the decode worker's
  // (the push skips them).
  Profile p = TestProfile();
  p.step = {.base_s = 0.01, .per_token_s = 1e-3};
  p.kv_bytes_per_token = 1000;
  p.transfers = {{.transport = "tcp", .latency_s = 0.005, .bytes_per_s = 1000 / 0.01}};
  p.disaggregated_first_token_s = 0.002;
  ClusterShape shape = Shape(1, 1);
  shape.routing.local_prefill_max_tokens = 0;
  const std::vector<RequestRecord> records = SimulateOk(
      p, shape, MakeWorkload({Req(0, 64, 2, {1, 2, 3, 4}), Req(10, 64, 2, {1, 2, 3, 5})}));
  ASSERT_EQ(records.size(), 2u);
  // 64 tokens in 0.074 s, pushed at 0.01 s a token: the link ends at 0.64.
  EXPECT_NEAR(Ttft(records[0]), 0.64 + 0.005 + 0.002, 1e-12);
  // 16 tokens in 0.026 s; pushed: 16 tokens, 0.16 s.
  EXPECT_NEAR(Ttft(records[1]), 0.16 + 0.005 + 0.002, 1e-12);
}

TEST(SimulatorTest, ClosedLoopOnBatchOneServerCompletesOneRequestPerServiceTime) {
  // Concurrency 4 on a batch-1 server whose requests take S = 6 steps:
  // the server never idles, and requests end S apart.
  Profile p = TestProfile();
  p.max_running = 1;
  p.step = {.base_s = 0.02};
  p.token_delivery_s = 0.001;
  std::vector<WorkloadRequest> requests(50, Req(1e9, 1, 6));  // Arrivals ignored.
  SimulationOptions options;
  options.concurrency = 4;
  const std::vector<RequestRecord> records =
      SimulateOk(p, Shape(0, 1), MakeWorkload(requests), options);
  const double service = 6 * 0.02;
  for (size_t i = 0; i < records.size(); ++i) {
    ASSERT_TRUE(records[i].ok());
    EXPECT_NEAR(records[i].end_s, (i + 1) * service + 0.001, 1e-9) << i;
    // The first four at once, then one as each ends.
    EXPECT_DOUBLE_EQ(records[i].send_s, i < 4 ? 0.0 : records[i - 4].end_s) << i;
  }
  const double throughput = (records.size() - 1) / (records.back().end_s - records.front().end_s);
  EXPECT_NEAR(throughput, 1 / service, 1e-9);
}

// --- Queueing theory: a batch-1 server (max_running 1) fed Poisson arrivals
// is an M/G/1 queue. Pollaczek-Khinchine: mean wait Wq = lambda E[S^2] /
// (2 (1 - rho)), rho = lambda E[S].

struct QueueCase {
  std::string name;
  // Cost of every step: base_s only (M/D/1 below) or per_token_s only
  // (each step computes one token: the 1-token prompt, then one decode
  // token), so a request of L output tokens takes S = L * step_s.
  bool per_token = false;
  double step_s = 0;
  // Output lengths and their weights.
  std::vector<std::pair<int32_t, double>> outputs;
  double rho = 0;
  int32_t requests = 0;
};

class PollaczekKhinchineTest : public testing::TestWithParam<QueueCase> {};

TEST_P(PollaczekKhinchineTest, MeanWaitMatchesTheFormula) {
  const QueueCase& c = GetParam();
  std::string spec = "hist:";
  double mean_l = 0, weights = 0;
  for (const auto& [l, w] : c.outputs) {
    absl::StrAppend(&spec, spec.size() > 5 ? "," : "", l, "=", w);
    mean_l += w * l;
    weights += w;
  }
  const double lambda = c.rho / (c.step_s * mean_l / weights);

  SyntheticOptions synthetic;
  synthetic.input = *LengthDistribution::Parse("1");
  synthetic.output = *LengthDistribution::Parse(spec);
  synthetic.num_requests = c.requests;
  synthetic.seed = 1007;  // Not the arrivals' seed: the two streams would correlate.
  absl::StatusOr<Workload> workload = MakeSyntheticWorkload(synthetic);
  ASSERT_TRUE(workload.ok()) << workload.status();
  ASSERT_TRUE(AssignArrivals({.rate = lambda, .burstiness = 1, .seed = 11}, *workload).ok());
  // The formula at the sample's own rate and moments of S, each request's S
  // exactly what the profile gives it (the sample's mix of lengths and
  // arrivals is off the nominal by about 0.3%, which moves Wq at rho 0.8 by
  // 1-2%).
  double es = 0, es2 = 0;
  for (const WorkloadRequest& r : workload->requests) {
    const double s = c.step_s * r.output_tokens;
    es += s / c.requests;
    es2 += s * s / c.requests;
  }
  const double rate = c.requests / workload->requests.back().arrival_s;
  const double rho = rate * es;
  ASSERT_NEAR(rho, c.rho, 0.01);
  const double wq = rate * es2 / (2 * (1 - rho));

  Profile p = TestProfile();
  p.max_running = 1;
  p.step = c.per_token ? StepCost{.per_token_s = c.step_s} : StepCost{.base_s = c.step_s};
  const std::vector<RequestRecord> records = SimulateOk(p, Shape(0, 1), *workload);
  ASSERT_EQ(records.size(), static_cast<size_t>(c.requests));
  double wait = 0;
  for (size_t i = 0; i < records.size(); ++i) {
    const RequestRecord& r = records[i];
    ASSERT_TRUE(r.ok()) << r.error;
    // Service starts with the step that computes the prompt and samples
    // the first token, and takes exactly S.
    ASSERT_NEAR(r.end_s - r.token_s.front() + c.step_s,
                c.step_s * workload->requests[i].output_tokens, 1e-9);
    wait += (Ttft(r) - c.step_s) / c.requests;
  }
  // Over seeds the error spreads about +-1% (rho 0.5, 200k requests) and
  // +-1.5% (rho 0.8, 400k).
  EXPECT_NEAR(wait, wq, 0.03 * wq) << "rho " << rho << ", E[S] " << es << " s";
}

INSTANTIATE_TEST_SUITE_P(Queues, PollaczekKhinchineTest,
                         testing::Values(QueueCase{.name = "MD1_rho50",
                                                   .step_s = 0.01,
                                                   .outputs = {{4, 1}},
                                                   .rho = 0.5,
                                                   .requests = 200000},
                                         QueueCase{.name = "MD1_rho80",
                                                   .step_s = 0.01,
                                                   .outputs = {{4, 1}},
                                                   .rho = 0.8,
                                                   .requests = 400000},
                                         QueueCase{.name = "MG1_rho50",
                                                   .per_token = true,
                                                   .step_s = 0.005,
                                                   .outputs = {{2, 0.5}, {10, 0.5}},
                                                   .rho = 0.5,
                                                   .requests = 200000},
                                         QueueCase{.name = "MG1_rho80",
                                                   .per_token = true,
                                                   .step_s = 0.005,
                                                   .outputs = {{2, 0.5}, {10, 0.5}},
                                                   .rho = 0.8,
                                                   .requests = 400000}),
                         [](const testing::TestParamInfo<QueueCase>& info) {
                           return info.param.name;
                         });

// A plausible CPU profile, for runs that only need realistic shapes.
Profile PlausibleProfile() {
  Profile p = TestProfile();
  p.step = {.base_s = 0.005, .per_token_s = 1e-4, .per_sequence_s = 2e-4, .per_attention_s = 1e-9, .per_decode_attention_s = 1e-9};
  p.prefill_kv_blocks = 8192;
  p.decode_kv_blocks = 16384;
  p.kv_bytes_per_token = 32768;
  p.transfers = {{.transport = "tcp", .latency_s = 2e-4, .bytes_per_s = 1e9}};
  p.colocated_first_token_s = 0.002;
  p.disaggregated_first_token_s = 0.004;
  p.disaggregated_token_delivery_s = 0.003;
  p.token_delivery_s = 0.001;
  return p;
}

TEST(SimulatorTest, SameInputsSameRecords) {
  SyntheticOptions synthetic;
  synthetic.input = *LengthDistribution::Parse("uniform:64:1024");
  synthetic.output = *LengthDistribution::Parse("uniform:1:64");
  synthetic.num_requests = 2000;
  synthetic.shared_prefix_tokens = 256;
  synthetic.num_prefixes = 4;
  absl::StatusOr<Workload> workload = MakeSyntheticWorkload(synthetic);
  ASSERT_TRUE(workload.ok()) << workload.status();
  ASSERT_TRUE(AssignArrivals({.rate = 20, .burstiness = 0.5, .seed = 3}, *workload).ok());
  for (const char* policy : {"kv_aware", "least_loaded", "round_robin"}) {
    ClusterShape shape = Shape(2, 2);
    shape.routing.policy = policy;
    const std::vector<RequestRecord> a = SimulateOk(PlausibleProfile(), shape, *workload);
    const std::vector<RequestRecord> b = SimulateOk(PlausibleProfile(), shape, *workload);
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      ASSERT_TRUE(a[i].ok()) << policy << " " << i << ": " << a[i].error;
      ASSERT_EQ(ToJson(a[i]), ToJson(b[i])) << policy << " " << i;
    }
  }
}

// One hour of the Mooncake conversation trace (12,031 requests, mean prompt
// 12k tokens, 343 output), lengths / 16, on 2P2D: 0.11-0.12 s in Release on
// the development machine (2 cores shared with other builds), as are 1P1D
// and the trace at 10x its rate; 4P4D 0.18 s. The test asserts a generous
// 30 s.
TEST(SimulatorTest, AnHourOfTheMooncakeTraceSimulatesInSeconds) {
  const std::string path =
      std::string(PDSERVE_SHARED_DIR) + "/traces/mooncake_conversation_trace.jsonl";
  if (!std::filesystem::exists(path)) GTEST_SKIP() << path << " is missing";
  absl::StatusOr<Workload> workload =
      LoadTraceWorkload({.path = path, .length_scale = 16, .duration_s = 3600});
  ASSERT_TRUE(workload.ok()) << workload.status();
  ASSERT_EQ(workload->requests.size(), 12031u);
  const auto start = std::chrono::steady_clock::now();
  const std::vector<RequestRecord> records = SimulateOk(PlausibleProfile(), Shape(2, 2), *workload);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const Summary summary = Summarize(records, {});
  std::printf(
      "simulated %zu requests (%.0f s of trace) in %.3f s; TTFT p50 %.3f s p99 %.3f s, "
      "TPOT p50 %.4f s\n",
      records.size(), summary.duration_s, seconds, summary.ttft_s.p50, summary.ttft_s.p99,
      summary.tpot_s.p50);
  EXPECT_EQ(summary.completed, 12031);
#ifdef NDEBUG
  EXPECT_LT(seconds, 30);
#endif
}

TEST(SimulatorTest, IdleTimeCostsNothing) {
  // A request, then another a year later: no simulated poll every 0.1 s in
  // between (the test would time out), and the same result for both.
  Profile p = PlausibleProfile();
  ClusterShape shape = Shape(1, 1);
  shape.routing.local_prefill_max_tokens = 0;
  const std::vector<RequestRecord> records =
      SimulateOk(p, shape, MakeWorkload({Req(0, 1000, 10), Req(3.15e7, 1000, 10)}));
  ASSERT_EQ(records.size(), 2u);
  ASSERT_TRUE(records[0].ok() && records[1].ok());
  EXPECT_NEAR(records[1].end_s - records[1].send_s, records[0].end_s - records[0].send_s, 1e-6);
}

TEST(SimulatorTest, RejectsBadShapes) {
  const Workload w = MakeWorkload({Req(0, 1, 1)});
  EXPECT_EQ(Simulate(TestProfile(), Shape(1, 0), w).status().code(),
            absl::StatusCode::kInvalidArgument);
  ClusterShape shape = Shape(1, 1);
  shape.transport = "carrier_pigeon";
  EXPECT_EQ(Simulate(TestProfile(), shape, w).status().code(), absl::StatusCode::kInvalidArgument);
  shape = Shape(1, 1);
  shape.routing.policy = "coin_flip";
  EXPECT_EQ(Simulate(TestProfile(), shape, w).status().code(), absl::StatusCode::kInvalidArgument);
  // No KV moves in a colocated cluster: no transfer cost needed.
  Profile p = TestProfile();
  p.transfers.clear();
  EXPECT_TRUE(Simulate(p, Shape(0, 1), w).ok());
}

// --- Profile JSON. ---

Profile FullProfile() {
  Profile p = TestProfile();
  p.model = "builtin:tiny";
  p.machine = "Xeon, avx2";
  p.cpu_share = "taskset 0-1";
  p.threads = 2;
  p.max_context = 4096;
  p.step = {.base_s = 0.001,
            .per_token_s = 2e-5,
            .per_sequence_s = 3e-5,
            .per_attention_s = 4e-9,
            .per_decode_attention_s = 4e-9,
            .decode_cache_tokens = 256,
            .per_decode_kv_beyond_cache_s = 3e-9,
            .dense_tokens = {1, 4, 5, 64},
            .dense_s = {1e-4, 2e-4, 5e-4, 9e-4}};
  p.kv_bytes_per_token = 8192;
  p.transfers = {{.transport = "tcp", .latency_s = 1e-4, .bytes_per_s = 1e9},
                 {.transport = "ucx", .latency_s = 2e-5, .bytes_per_s = 5e9}};
  p.colocated_first_token_s = 0.001;
  p.disaggregated_first_token_s = 0.002;
  p.disaggregated_token_delivery_s = 0.0005;
  p.token_delivery_s = 0.0003;
  p.prefill_cpu_per_request_s = 0.0004;
  p.prefill_cpu_per_kv_byte_s = 2e-9;
  p.decode_cpu_per_token_s = 1.4e-4;
  p.prefill_engine_scale = 1.08;
  p.decode_engine_scale = 1.04;
  p.decode_batch_scale = 0.97;
  p.poll_interval_s = 0.05;
  p.probe_ratio = 1.07;
  return p;
}

void ExpectSameProfile(const Profile& a, const Profile& b) {
  EXPECT_EQ(ToJson(a), ToJson(b));
  EXPECT_EQ(a.model, b.model);
  EXPECT_EQ(a.decode_kv_blocks, b.decode_kv_blocks);
  EXPECT_EQ(a.step.per_attention_s, b.step.per_attention_s);
  EXPECT_EQ(a.step.per_decode_attention_s, b.step.per_decode_attention_s);
  EXPECT_EQ(a.step.decode_cache_tokens, b.step.decode_cache_tokens);
  EXPECT_EQ(a.step.per_decode_kv_beyond_cache_s, b.step.per_decode_kv_beyond_cache_s);
  EXPECT_EQ(a.step.dense_tokens, b.step.dense_tokens);
  EXPECT_EQ(a.step.dense_s, b.step.dense_s);
  ASSERT_EQ(a.transfers.size(), b.transfers.size());
  EXPECT_EQ(a.transfers[1].transport, b.transfers[1].transport);
  EXPECT_EQ(a.transfers[1].bytes_per_s, b.transfers[1].bytes_per_s);
  EXPECT_EQ(a.poll_interval_s, b.poll_interval_s);
  EXPECT_EQ(a.probe_ratio, b.probe_ratio);
  EXPECT_EQ(a.prefill_engine_scale, b.prefill_engine_scale);
  EXPECT_EQ(a.decode_engine_scale, b.decode_engine_scale);
  EXPECT_EQ(a.decode_batch_scale, b.decode_batch_scale);
}

TEST(ProfileTest, WarnsWhenTheMachinesSpeedChangedWhileProfiling) {
  Profile p = FullProfile();
  p.probe_ratio = 0.97;  // Run 10's: the fit's own bias.
  EXPECT_EQ(ProfileSpeedWarning(p), "");
  p.probe_ratio = 0.70;  // Run 11's.
  EXPECT_NE(ProfileSpeedWarning(p).find("ran 30% faster than the fitted model"), std::string::npos)
      << ProfileSpeedWarning(p);
  p.probe_ratio = 1.4;
  EXPECT_NE(ProfileSpeedWarning(p).find("ran 40% slower"), std::string::npos);
  p.probe_ratio = 1.25;  // The bound itself passes.
  EXPECT_EQ(ProfileSpeedWarning(p), "");
}

TEST(ProfileTest, JsonRoundTrip) {
  const Profile p = FullProfile();
  absl::StatusOr<Profile> back = ProfileFromJson(ToJson(p));
  ASSERT_TRUE(back.ok()) << back.status();
  ExpectSameProfile(p, *back);

  const std::string path =
      (std::filesystem::path(testing::TempDir()) / "profile_round_trip.json").string();
  ASSERT_TRUE(WriteProfile(path, p).ok());
  absl::StatusOr<Profile> read = ReadProfile(path);
  ASSERT_TRUE(read.ok()) << read.status();
  ExpectSameProfile(p, *read);
  std::filesystem::remove(path);
}

TEST(StepCostTest, TheDenseTableIsLinearBetweenItsRowsAndAlongItsEndsBeyond) {
  StepCost c{.dense_tokens = {1, 4, 5, 64}, .dense_s = {1e-4, 2e-4, 5e-4, 9e-4}};
  EXPECT_DOUBLE_EQ(c.Dense(1), 1e-4);
  EXPECT_NEAR(c.Dense(2), 1e-4 + 1e-4 / 3, 1e-15);
  EXPECT_DOUBLE_EQ(c.Dense(4), 2e-4);
  EXPECT_DOUBLE_EQ(c.Dense(5), 5e-4);  // The kink: 4 to 5 rows.
  EXPECT_DOUBLE_EQ(c.Dense(64), 9e-4);
  EXPECT_NEAR(c.Dense(123), 13e-4, 1e-15);  // The last segment, extended.
  EXPECT_NEAR(c.Dense(0), 1e-4 - 1e-4 / 3, 1e-15);
  // The base, per-token and per-sequence costs add to it.
  c.base_s = 1e-3;
  c.per_token_s = 1e-5;
  c.per_sequence_s = 1e-6;
  EXPECT_NEAR(c.Seconds(5, 2, 0), 5e-4 + 1e-3 + 5e-5 + 2e-6, 1e-15);
  // Never below 0 outside the table; one row: constant; none: 0.
  StepCost falling{.dense_tokens = {1, 2}, .dense_s = {2e-4, 1e-4}};
  EXPECT_DOUBLE_EQ(falling.Dense(4), 0);
  StepCost one{.dense_tokens = {8}, .dense_s = {3e-4}};
  EXPECT_DOUBLE_EQ(one.Dense(1), 3e-4);
  EXPECT_DOUBLE_EQ(one.Dense(100), 3e-4);
  EXPECT_DOUBLE_EQ(StepCost{}.Dense(7), 0);
}

TEST(ProfileTest, BadFieldsAreNamed) {
  struct Case {
    std::string pointer;  // JSON pointer to change ("" : remove `field`).
    nlohmann::json value;
    std::string field;  // What the error must name.
  };
  const std::vector<Case> cases = {
      {"/threads", "two", "'threads' must be an integer"},
      {"/block_size", 0, "'block_size' must be at least 1"},
      {"/max_batch_tokens", 8, "'max_batch_tokens' must be at least max_running"},
      {"/decode_kv_blocks", -1, "'decode_kv_blocks'"},
      {"/decode_kv_blocks", 1.5, "'decode_kv_blocks' must be an integer"},
      {"/step/per_token_s", -1e-5, "'step.per_token_s' must be a non-negative number"},
      {"/step/decode_cache_tokens", -1, "'step.decode_cache_tokens' must be a non-negative"},
      {"/step", 3, "'step' must be an object"},
      {"/step/dense_tokens", nlohmann::json::array({1, 5, 4, 64}),
       "'step.dense_tokens' must be ascending row counts of at least 1"},
      {"/step/dense_tokens", nlohmann::json::array({0, 4, 5, 64}),
       "'step.dense_tokens' must be ascending"},
      {"/step/dense_tokens", nlohmann::json::array({1, 4, 5}),
       "'step.dense_s' must have one cost for each of step.dense_tokens"},
      {"/step/dense_tokens/2", 5.5, "'step.dense_tokens[2]' must be an integer"},
      {"/step/dense_s/1", -1e-4, "'step.dense_s[1]' must be a non-negative number"},
      {"/step/dense_s", "fast", "'step.dense_s' must be an array"},
      {"/transfers/0/bytes_per_s", 0, "'transfers[0].bytes_per_s' must be a positive"},
      {"/transfers/1/transport", "tcp", "'transfers[1].transport' 'tcp' is listed twice"},
      {"/transfers/0/latency_s", "fast", "'transfers[0].latency_s' must be a number"},
      {"/poll_interval_s", 0, "'poll_interval_s' must be a positive number"},
      {"/probe_ratio", -1, "'probe_ratio' must be a positive number"},
      {"/prefill_engine_scale", 0, "'prefill_engine_scale' must be a positive number"},
      {"/decode_engine_scale", -1, "'decode_engine_scale' must be a positive number"},
      {"/decode_batch_scale", 0, "'decode_batch_scale' must be a positive number"},
      {"/prefill_cpu_per_kv_byte_s", -1e-9,
       "'prefill_cpu_per_kv_byte_s' must be a non-negative number"},
      {"/decode_cpu_per_token_s", -1e-9, "'decode_cpu_per_token_s' must be a non-negative number"},
      {"/disaggregated_token_delivery_s", -0.001,
       "'disaggregated_token_delivery_s' must be a non-negative number"},
      {"/model", 7, "'model' must be a string"},
  };
  for (const Case& c : cases) {
    nlohmann::json j = ToJson(FullProfile());
    j[nlohmann::json::json_pointer(c.pointer)] = c.value;
    absl::StatusOr<Profile> p = ProfileFromJson(j);
    ASSERT_FALSE(p.ok()) << c.pointer;
    EXPECT_EQ(p.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_NE(p.status().message().find(c.field), std::string::npos) << p.status();
  }
  for (const char* field : {"token_delivery_s", "machine", "transfers", "probe_ratio",
                            "prefill_cpu_per_request_s", "decode_cpu_per_token_s",
                            "disaggregated_token_delivery_s",
                            "prefill_engine_scale", "decode_engine_scale",
                            "decode_batch_scale"}) {
    nlohmann::json j = ToJson(FullProfile());
    j.erase(field);
    absl::StatusOr<Profile> p = ProfileFromJson(j);
    ASSERT_FALSE(p.ok()) << field;
    EXPECT_NE(p.status().message().find(absl::StrCat("'", field, "' is missing")),
              std::string::npos)
        << p.status();
  }
  for (const char* field : {"base_s", "per_decode_kv_beyond_cache_s", "dense_tokens", "dense_s"}) {
    nlohmann::json j = ToJson(FullProfile());
    j["step"].erase(field);
    EXPECT_NE(ProfileFromJson(j).status().message().find(absl::StrCat("'step.", field, "' is missing")),
              std::string::npos)
        << field;
  }
}

TEST(ProfileTest, ReadErrors) {
  EXPECT_EQ(ReadProfile("/nonexistent/profile.json").status().code(), absl::StatusCode::kNotFound);
  const std::string path =
      (std::filesystem::path(testing::TempDir()) / "profile_bad.json").string();
  std::ofstream(path) << "{not json";
  EXPECT_EQ(ReadProfile(path).status().code(), absl::StatusCode::kInvalidArgument);
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace pdserve::planner
