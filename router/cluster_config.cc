#include "router/cluster_config.h"

#include <fstream>
#include <sstream>

#include "absl/container/flat_hash_set.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "router/routing_policy.h"
#include "google/protobuf/util/json_util.h"

namespace pdserve {
namespace {

namespace wire = ::pdserve::internal::v1;

absl::Status ValidateWorkers(
    const google::protobuf::RepeatedPtrField<wire::WorkerConfig>& workers,
    const std::string& role, absl::flat_hash_set<std::string>& ids) {
  for (int i = 0; i < workers.size(); ++i) {
    const wire::WorkerConfig& w = workers[i];
    const std::string where = absl::StrCat(role, "_workers[", i, "]");
    if (w.id().empty()) {
      return absl::InvalidArgumentError(absl::StrCat(where, " has no id"));
    }
    if (w.address().empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, " ('", w.id(), "') has no address"));
    }
    if (!ids.insert(w.id()).second) {
      return absl::InvalidArgumentError(
          absl::StrCat(where, ": worker id '", w.id(), "' is used twice"));
    }
  }
  return absl::OkStatus();
}

}  // namespace

absl::Status ValidateClusterConfig(const wire::ClusterConfig& config,
                                   bool workers_discovered) {
  if (config.decode_workers().empty() && !workers_discovered) {
    return absl::InvalidArgumentError(
        "the cluster has no decode_workers; at least one is needed (or "
        "discover the workers through etcd: pd-router --etcd)");
  }
  absl::flat_hash_set<std::string> ids;
  PD_RETURN_IF_ERROR(ValidateWorkers(config.prefill_workers(), "prefill", ids));
  PD_RETURN_IF_ERROR(ValidateWorkers(config.decode_workers(), "decode", ids));
  PD_RETURN_IF_ERROR(RoutingOptionsFromConfig(config.routing()).status());
  return absl::OkStatus();
}

absl::StatusOr<wire::ClusterConfig> ParseClusterConfig(std::string_view json,
                                                      bool workers_discovered) {
  wire::ClusterConfig config;
  google::protobuf::util::JsonParseOptions options;
  options.ignore_unknown_fields = false;
  const auto status = google::protobuf::util::JsonStringToMessage(
      google::protobuf::StringPiece(json.data(), json.size()), &config,
      options);
  if (!status.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cluster config is not valid: ", std::string(status.message())));
  }
  if (config.model().empty()) config.set_model("builtin:tiny");
  PD_RETURN_IF_ERROR(ValidateClusterConfig(config, workers_discovered));
  return config;
}

absl::StatusOr<wire::ClusterConfig> LoadClusterConfig(const std::string& path,
                                                     bool workers_discovered) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat("cannot read cluster config ", path));
  }
  std::ostringstream text;
  text << in.rdbuf();
  absl::StatusOr<wire::ClusterConfig> config = ParseClusterConfig(text.str(), workers_discovered);
  if (!config.ok()) {
    return absl::Status(config.status().code(),
                        absl::StrCat(path, ": ", config.status().message()));
  }
  return config;
}

}  // namespace pdserve
