// A request the cluster tests send as token ids, and the public
// GenerateRequest that carries it: the one mapping the cluster, migration,
// drain and fault tests share, so that what they compare with the engine's
// own output is the same request; and one Generate stream run to its end.
#ifndef PDSERVE_TESTS_CLUSTER_STREAM_CASE_H_
#define PDSERVE_TESTS_CLUSTER_STREAM_CASE_H_

#include <cstdint>
#include <functional>
#include <vector>

#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "engine/sampler.h"
#include "grpcpp/grpcpp.h"
#include "pdserve/v1/generation.grpc.pb.h"
#include "pdserve/v1/generation.pb.h"

namespace pdserve::testing_util {

struct StreamCase {
  std::vector<int32_t> prompt;
  SamplingParams sampling;
};

inline v1::GenerateRequest ToRequest(const StreamCase& c) {
  v1::GenerateRequest r;
  r.mutable_token_ids()->mutable_ids()->Assign(c.prompt.begin(), c.prompt.end());
  r.mutable_sampling()->set_temperature(c.sampling.temperature);
  r.mutable_sampling()->set_top_p(c.sampling.top_p);
  r.mutable_sampling()->set_top_k(c.sampling.top_k);
  if (c.sampling.seed) r.mutable_sampling()->set_seed(*c.sampling.seed);
  r.set_max_tokens(c.sampling.max_tokens);
  r.set_ignore_eos(c.sampling.ignore_eos);
  return r;
}

// What a Generate stream brought.
struct StreamResult {
  grpc::Status status;
  std::vector<int32_t> tokens;
  v1::FinishReason finish = v1::FINISH_REASON_UNSPECIFIED;
  v1::Usage usage;
};

// Runs one Generate stream of `c` to its end (within `timeout`);
// `on_tokens`, when set, hears the count of tokens received after each
// message.
inline StreamResult GenerateStream(v1::Generation::Stub& stub, const StreamCase& c,
                                   const std::function<void(size_t)>& on_tokens = nullptr,
                                   absl::Duration timeout = absl::Seconds(60)) {
  grpc::ClientContext context;
  context.set_deadline(absl::ToChronoTime(absl::Now() + timeout));
  StreamResult out;
  auto reader = stub.Generate(&context, ToRequest(c));
  v1::GenerateResponse message;
  while (reader->Read(&message)) {
    out.tokens.insert(out.tokens.end(), message.token_ids().begin(), message.token_ids().end());
    if (message.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
      out.finish = message.finish_reason();
      out.usage = message.usage();
    }
    if (on_tokens) on_tokens(out.tokens.size());
  }
  out.status = reader->Finish();
  return out;
}

}  // namespace pdserve::testing_util

#endif  // PDSERVE_TESTS_CLUSTER_STREAM_CASE_H_
