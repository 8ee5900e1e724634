// A request the cluster tests send as token ids, and the public
// GenerateRequest that carries it: the one mapping the cluster, migration
// and fault tests share, so that what they compare with the engine's own
// output is the same request.
#ifndef PDSERVE_TESTS_CLUSTER_STREAM_CASE_H_
#define PDSERVE_TESTS_CLUSTER_STREAM_CASE_H_

#include <cstdint>
#include <vector>

#include "engine/sampler.h"
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

}  // namespace pdserve::testing_util

#endif  // PDSERVE_TESTS_CLUSTER_STREAM_CASE_H_
