// NetnsCluster: a 1P2D pdserve cluster in which decode-1 sits in its own
// network namespace behind a veth pair, so that a test can break the
// network between it and the rest (router, prefill-0, decode-0 on the
// host's loopback): a partition that heals, a slow link, a lossy link.
// The test creates and removes the namespace itself; it needs root.
//
// Network tools are probed, not assumed: `tc ... netem` gives delay and
// random loss where the kernel has sch_netem; without it the slow link is a
// token bucket (tc tbf) and loss is the link dropping for short spells
// (ip link set down/up), bursty rather than random. Network() says which.
#ifndef PDSERVE_TESTS_FAULT_NETNS_CLUSTER_H_
#define PDSERVE_TESTS_FAULT_NETNS_CLUSTER_H_

#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "grpcpp/grpcpp.h"
#include "pdserve/v1/generation.grpc.pb.h"
#include "tests/cluster/local_cluster.h"
#include "tests/fault/fault_harness.h"

namespace pdserve::fault {

class NetnsCluster {
 public:
  // FAILED_PRECONDITION when not root or `ip` cannot make a namespace;
  // UNAVAILABLE when the cluster does not come up.
  static absl::StatusOr<std::unique_ptr<NetnsCluster>> Start(
      const std::string& binary_dir, const std::string& prefill_args,
      const std::string& decode_args) {
    if (::geteuid() != 0) {
      return absl::FailedPreconditionError(
          "network namespaces need root; this test runs as uid " +
          std::to_string(::geteuid()));
    }
    std::unique_ptr<NetnsCluster> c(new NetnsCluster());
    if (absl::Status s = c->MakeNetwork(); !s.ok()) return s;
    const std::string decode = binary_dir + "/decode_worker/pd-decode";
    const std::string prefill = binary_dir + "/prefill_worker/pd-prefill";
    c->Launch("decode-0", "", decode,
              absl::StrCat("--listen=127.0.0.1:0 --kv_listen=127.0.0.1:0 "
                           "--worker_id=decode-0 ",
                           "--metrics_listen=127.0.0.1:0 --metrics_port_file=",
                           c->File("decode-0.metrics_port"), " ", decode_args));
    c->Launch("decode-1", "ip netns exec " + c->namespace_, decode,
              absl::StrCat(
                  "--listen=", c->inner_ip_, ":0 --kv_listen=", c->inner_ip_,
                  ":0 --worker_id=decode-1 --metrics_listen=", c->inner_ip_,
                  ":0 --metrics_port_file=", c->File("decode-1.metrics_port"),
                  " ", decode_args));
    c->Launch(
        "prefill-0", "", prefill,
        absl::StrCat("--listen=127.0.0.1:0 --worker_id=prefill-0 "
                     "--metrics_listen=127.0.0.1:0 ",
                     "--metrics_port_file=", c->File("prefill-0.metrics_port"),
                     " ", prefill_args));
    for (const char* name : {"decode-0", "decode-1", "prefill-0"}) {
      if (absl::Status s = c->WaitForPort(name); !s.ok()) return s;
    }
    std::ofstream(c->File("cluster.json"))
        << "{\"model\": \"builtin:tiny\", \"prefill_workers\": [{\"id\": "
           "\"prefill-0\", \"address\": \""
        << c->Address("prefill-0")
        << "\"}], \"decode_workers\": [{\"id\": \"decode-0\", \"address\": \""
        << c->Address("decode-0")
        << "\"}, {\"id\": \"decode-1\", \"address\": \""
        << c->Address("decode-1")
        << "\"}], \"routing\": {\"localPrefillMaxTokens\": 0}}\n";
    c->Launch(
        "router", "", binary_dir + "/router/pd-router",
        absl::StrCat(
            "--listen=127.0.0.1:0 --http_listen=127.0.0.1:0 --http_port_file=",
            c->File("router.metrics_port"),
            " --config=", c->File("cluster.json")));
    if (absl::Status s = c->WaitForPort("router"); !s.ok()) return s;
    c->router_ = v1::Generation::NewStub(grpc::CreateChannel(
        c->Address("router"), grpc::InsecureChannelCredentials()));
    for (int i = 0; i < 300; ++i) {
      grpc::ClientContext context;
      context.set_deadline(
          absl::ToChronoTime(absl::Now() + absl::Milliseconds(500)));
      v1::HealthResponse health;
      if (c->router_->Health(&context, {}, &health).ok() &&
          health.decode_workers() == 2 && health.prefill_workers() == 1) {
        return c;
      }
      absl::SleepFor(absl::Milliseconds(100));
    }
    return absl::UnavailableError(
        "the netns cluster's router never saw its 3 workers:\n" +
        c->Read("router.log"));
  }

  ~NetnsCluster() {
    for (const char* name : {"router", "prefill-0", "decode-0", "decode-1"}) {
      const std::string pid = Read(absl::StrCat(name, ".pid"));
      if (!pid.empty()) ::kill(std::stoi(pid), SIGKILL);
    }
    // Deleting the namespace deletes the veth pair with it.
    (void)std::system(
        absl::StrCat("ip netns del ", namespace_, " 2>/dev/null").c_str());
    std::error_code ignored;
    std::filesystem::remove_all(dir_, ignored);
  }

  v1::Generation::Stub& router() { return *router_; }
  std::string Log(const std::string& name) const { return Read(name + ".log"); }

  std::vector<ClusterProcess> Processes() const {
    std::vector<ClusterProcess> out;
    for (const char* name : {"router", "prefill-0", "decode-0", "decode-1"}) {
      out.push_back(
          {.name = name,
           .address = Address(name),
           .metrics_host =
               std::string(name) == "decode-1" ? inner_ip_ : "127.0.0.1",
           .metrics_port = std::stoi(Read(absl::StrCat(name, ".metrics_port"))),
           .pid = std::stoi(Read(absl::StrCat(name, ".pid")))});
    }
    return out;
  }

  // How delay and loss are made here, for the test's output.
  std::string Network() const {
    return has_netem_
               ? "tc netem (delay, random loss), ip link down/up (partition)"
               : "no sch_netem in this kernel: tc tbf token bucket (slow "
                 "link), ip link "
                 "down/up in short spells (bursty loss) and for seconds "
                 "(partition)";
  }

  // Cuts decode-1 off (both directions), or heals the cut.
  absl::Status SetPartitioned(bool partitioned) {
    return Ip(
        absl::StrCat("link set ", host_veth_, partitioned ? " down" : " up"));
  }

  // A slow link both ways: netem delay, or a token bucket of `rate` whose
  // queue holds up to `latency` of traffic.
  absl::Status SetSlowLink(bool slow) {
    for (const std::string& side : {std::string(), "-n " + namespace_ + " "}) {
      const std::string dev = side.empty() ? host_veth_ : inner_veth_;
      const std::string tc = absl::StrCat("tc ", side, "qdisc ");
      absl::Status s =
          !slow        ? Run(absl::StrCat(tc, "del dev ", dev, " root"))
          : has_netem_ ? Run(absl::StrCat(tc, "add dev ", dev,
                                          " root netem delay 40ms 10ms"))
                       : Run(absl::StrCat(
                             tc, "add dev ", dev,
                             " root tbf rate 2mbit burst 16kb latency 800ms"));
      if (!s.ok()) return s;
    }
    return absl::OkStatus();
  }

  // A lossy link for `duration`: netem loss of 10 % both ways, or the link
  // down 100 ms in every 400 ms.
  absl::Status LoseFor(absl::Duration duration) {
    if (has_netem_) {
      for (const std::string& side :
           {std::string(), "-n " + namespace_ + " "}) {
        const std::string dev = side.empty() ? host_veth_ : inner_veth_;
        if (absl::Status s = Run(absl::StrCat("tc ", side, "qdisc add dev ",
                                              dev, " root netem loss 10%"));
            !s.ok()) {
          return s;
        }
      }
      absl::SleepFor(duration);
      return SetSlowLink(false);  // Removes the root qdisc either way.
    }
    const absl::Time end = absl::Now() + duration;
    while (absl::Now() < end) {
      if (absl::Status s = SetPartitioned(true); !s.ok()) return s;
      absl::SleepFor(absl::Milliseconds(100));
      if (absl::Status s = SetPartitioned(false); !s.ok()) return s;
      absl::SleepFor(absl::Milliseconds(300));
    }
    return absl::OkStatus();
  }

 private:
  NetnsCluster() {
    const int id = ::getpid() % 10000;
    namespace_ = absl::StrCat("pdfault", id);
    host_veth_ = absl::StrCat("pdfh", id);
    inner_veth_ = absl::StrCat("pdfn", id);
    const int subnet = ::getpid() % 250;
    host_ip_ = absl::StrCat("10.213.", subnet, ".1");
    inner_ip_ = absl::StrCat("10.213.", subnet, ".2");
    dir_ = std::filesystem::temp_directory_path() /
           absl::StrCat("pdserve-netns-", ::getpid());
    std::filesystem::create_directories(dir_);
  }

  absl::Status MakeNetwork() {
    (void)std::system(
        absl::StrCat("ip netns del ", namespace_, " 2>/dev/null").c_str());
    for (const std::string& command :
         {absl::StrCat("netns add ", namespace_),
          absl::StrCat("link add ", host_veth_, " type veth peer name ",
                       inner_veth_),
          absl::StrCat("link set ", inner_veth_, " netns ", namespace_),
          absl::StrCat("addr add ", host_ip_, "/30 dev ", host_veth_),
          absl::StrCat("link set ", host_veth_, " up"),
          absl::StrCat("-n ", namespace_, " addr add ", inner_ip_, "/30 dev ",
                       inner_veth_),
          absl::StrCat("-n ", namespace_, " link set ", inner_veth_, " up"),
          absl::StrCat("-n ", namespace_, " link set lo up")}) {
      if (absl::Status s = Ip(command); !s.ok()) {
        return absl::FailedPreconditionError(
            absl::StrCat("cannot make the test network: ", s.message()));
      }
    }
    // Probed on the veth itself: present here or not, removed at once.
    has_netem_ = Run(absl::StrCat("tc qdisc add dev ", host_veth_,
                                  " root netem delay 1ms"))
                     .ok();
    if (has_netem_)
      (void)Run(absl::StrCat("tc qdisc del dev ", host_veth_, " root"));
    return absl::OkStatus();
  }

  static absl::Status Run(const std::string& command) {
    if (std::system((command + " >/dev/null 2>&1").c_str()) != 0) {
      return absl::UnavailableError(absl::StrCat("failed: ", command));
    }
    return absl::OkStatus();
  }
  static absl::Status Ip(const std::string& arguments) {
    return Run("ip " + arguments);
  }

  void Launch(const std::string& name, const std::string& prefix,
              const std::string& binary, const std::string& arguments) {
    const std::string command = absl::StrCat(
        prefix, " '", binary, "' --port_file=", File(name + ".port"), " ",
        arguments, " >", File(name + ".log"), " 2>&1 & echo $! >",
        File(name + ".pid"));
    (void)std::system(command.c_str());
  }

  absl::Status WaitForPort(const std::string& name) {
    for (int i = 0; i < 600; ++i) {
      if (!Read(name + ".port").empty()) return absl::OkStatus();
      absl::SleepFor(absl::Milliseconds(100));
    }
    return absl::UnavailableError(
        absl::StrCat(name, " did not start:\n", Read(name + ".log")));
  }

  std::string Address(const std::string& name) const {
    return absl::StrCat(name == "decode-1" ? inner_ip_ : "127.0.0.1", ":",
                        Read(name + ".port"));
  }
  std::string File(const std::string& name) const {
    return (dir_ / name).string();
  }
  std::string Read(const std::string& name) const {
    std::ifstream in(dir_ / name);
    return std::string(std::istreambuf_iterator<char>(in), {});
  }

  std::string namespace_, host_veth_, inner_veth_, host_ip_, inner_ip_;
  bool has_netem_ = false;
  std::filesystem::path dir_;
  std::unique_ptr<v1::Generation::Stub> router_;
};

}  // namespace pdserve::fault

#endif  // PDSERVE_TESTS_FAULT_NETNS_CLUSTER_H_
