// Reading and checking the cluster configuration file of pd-router: a JSON
// rendering of pdserve.internal.v1.ClusterConfig
// (proto/pdserve/internal/v1/cluster_config.proto), e.g.
//
//   {"model": "builtin:tiny",
//    "prefill_workers": [{"id": "prefill-0", "address": "127.0.0.1:5001"}],
//    "decode_workers":  [{"id": "decode-0",  "address": "127.0.0.1:5002"}],
//    "routing": {"policy": "kv_aware", "localPrefillMaxTokens": 64}}
//
// Thread-safety: plain functions without shared state.
#ifndef PDSERVE_ROUTER_CLUSTER_CONFIG_H_
#define PDSERVE_ROUTER_CLUSTER_CONFIG_H_

#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "pdserve/internal/v1/cluster_config.pb.h"

namespace pdserve {

// Parses `json` (field names in lowerCamelCase or as in the proto; unknown
// fields are an error) and validates the result with ValidateClusterConfig.
// An empty "model" becomes "builtin:tiny". INVALID_ARGUMENT with the parser's
// or validator's message on failure.
absl::StatusOr<internal::v1::ClusterConfig> ParseClusterConfig(
    std::string_view json, bool workers_discovered = false);

// Reads the file at `path` and parses it as above. NOT_FOUND when the file
// cannot be read; errors name the path.
absl::StatusOr<internal::v1::ClusterConfig> LoadClusterConfig(
    const std::string& path, bool workers_discovered = false);

// INVALID_ARGUMENT naming the first problem: no decode worker (unless
// `workers_discovered`: workers then come from etcd, and the lists may be
// empty), a worker with an empty id or address, an id used twice (across
// both roles), or a routing section with an unknown policy or a negative
// threshold.
absl::Status ValidateClusterConfig(const internal::v1::ClusterConfig& config,
                                   bool workers_discovered = false);

}  // namespace pdserve

#endif  // PDSERVE_ROUTER_CLUSTER_CONFIG_H_
