// ClusterLauncher: a real pdserve cluster on this machine for pd-plan
// (profile and validate), started and stopped with deploy/local/cluster.sh,
// the launcher users run, with every worker held to a CPU share
// (deploy/local/cpu_share.sh) so that x + y workers on a small machine
// behave like workers with a core (or part of one) each.
//
// Thread-safety: none; one owner. The destructor stops the cluster.
#ifndef PDSERVE_PLANNER_CLUSTER_LAUNCHER_H_
#define PDSERVE_PLANNER_CLUSTER_LAUNCHER_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace pdserve::planner {

// `s` single-quoted for /bin/sh (pd-bench and pd-plan run commands through
// the shell too).
std::string ShellQuote(const std::string& s);

struct LaunchOptions {
  // Default: 1 (0: colocated).
  int prefill = 1;
  // Default: 1.
  int decode = 1;
  // Default: "builtin:tiny".
  std::string model = "builtin:tiny";
  // CPUs of time per worker; 0: no limit. Default: 0.
  double cpu_share = 0;
  // Flags of every worker (engine flags: --num_threads, --max_batch_tokens,
  // --kv_cache_mb, ...). Default: none.
  std::string worker_args;
  // Extra flags of the prefill workers only (e.g. --kv_transport=tcp).
  std::string prefill_args;
  std::string decode_args;
  std::string router_args;
  // The config's routing section as JSON; empty: kv_aware defaults.
  std::string routing;
  // The run directory (ports, logs). Required.
  std::string dir;
  // The source tree (for deploy/local/cluster.sh) and the build tree with
  // the binaries. Required.
  std::string source_dir;
  std::string binary_dir;
};

class ClusterLauncher {
 public:
  // Starts the cluster and waits until the router sees every worker.
  // UNAVAILABLE with the launcher's last output when it did not come up.
  static absl::StatusOr<std::unique_ptr<ClusterLauncher>> Start(const LaunchOptions& options);
  ~ClusterLauncher();
  ClusterLauncher(const ClusterLauncher&) = delete;
  ClusterLauncher& operator=(const ClusterLauncher&) = delete;

  // "127.0.0.1:PORT" of the router's gRPC API and its OpenAI HTTP API.
  const std::string& grpc_address() const { return grpc_address_; }
  const std::string& http_address() const { return http_address_; }
  // The pid of one of its processes by name ("router", "prefill-0",
  // "decode-1"); NOT_FOUND when the cluster has none of that name.
  absl::StatusOr<int> Pid(const std::string& process) const;
  // The sum of `metric`'s samples on that process's /metrics page (e.g. a
  // histogram's "..._sum") over every label set, or over those that hold
  // `label` (e.g. `role="prefill"`) when it is not empty; 0 when the page has
  // none. NOT_FOUND as Pid; UNAVAILABLE when the page cannot be read (30 s
  // at most).
  absl::StatusOr<double> MetricSum(const std::string& process, const std::string& metric,
                                   const std::string& label = "") const;
  // MetricSum of each of `metrics`, in order, from one read of the page.
  absl::StatusOr<std::vector<double>> MetricSums(const std::string& process,
                                                 const std::vector<std::string>& metrics,
                                                 const std::string& label = "") const;

 private:
  ClusterLauncher(std::string launcher, std::string dir) : launcher_(launcher), dir_(dir) {}
  const std::string launcher_;
  const std::string dir_;
  std::string grpc_address_;
  std::string http_address_;
};

}  // namespace pdserve::planner

#endif  // PDSERVE_PLANNER_CLUSTER_LAUNCHER_H_
