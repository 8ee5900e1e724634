// VirtualNetwork: machines made of network namespaces for tests that need
// pdserve's processes on separate hosts (tests/multihost/). Every host is a
// namespace with its own address on one subnet; their links meet on a
// bridge, which lives in a namespace of its own (the switch) so that
// nothing is left on the test machine's own network but one veth: the
// test process's link to the switch, so that it reaches every host.
//
//   test process (10.215.S.1) ─┐
//   host "etcd"   (10.215.S.10)├─ bridge in the switch namespace
//   host "router" (10.215.S.11)┘   ... one port per host
//
// A host's link can be cut and healed at its switch port (a partition
// between that host and all the rest). The destructor deletes every
// namespace, which deletes their links; Create deletes those a crashed
// test process left behind. Needs root and `ip` (iproute2);
// Create says why when the kernel or the user forbids namespaces.
//
// Not thread-safe.
#ifndef PDSERVE_TESTS_COMMON_VIRTUAL_NETWORK_H_
#define PDSERVE_TESTS_COMMON_VIRTUAL_NETWORK_H_

#include <signal.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace pdserve::testing_util {

class VirtualNetwork {
 public:
  // FAILED_PRECONDITION (with the reason) when namespaces cannot be made.
  static absl::StatusOr<std::unique_ptr<VirtualNetwork>> Create() {
    if (::geteuid() != 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "network namespaces need root; this test runs as uid ", ::geteuid()));
    }
    static int serial = 0;
    std::unique_ptr<VirtualNetwork> n(new VirtualNetwork(serial++));
    DeleteLeftovers();
    n->DeleteNamespace(n->switch_);
    const std::string sw = "-n " + n->switch_ + " ";
    for (const std::string& command :
         {"netns add " + n->switch_, sw + "link add br0 type bridge", sw + "link set br0 up",
          sw + "link set lo up",
          absl::StrCat("link add ", n->uplink_, " type veth peer name uplink netns ", n->switch_),
          sw + "link set uplink master br0", sw + "link set uplink up",
          absl::StrCat("addr add ", n->Address(1), "/24 dev ", n->uplink_),
          absl::StrCat("link set ", n->uplink_, " up")}) {
      if (absl::Status s = Ip(command); !s.ok()) {
        return absl::FailedPreconditionError(
            absl::StrCat("cannot make the test network (does the kernel allow network "
                         "namespaces and veth links?): ",
                         s.message()));
      }
    }
    return n;
  }

  ~VirtualNetwork() {
    for (const auto& [name, host] : hosts_) DeleteNamespace(host.ns);
    DeleteNamespace(switch_);  // Takes the uplink's peer, so the uplink too.
  }

  // A new host `name` (letters, digits, '-') with the next free address;
  // returns that address.
  absl::StatusOr<std::string> AddHost(const std::string& name) {
    if (hosts_.contains(name)) return absl::AlreadyExistsError(name);
    Host host{.ns = absl::StrCat(prefix_, "-", name),
              .port = absl::StrCat("h", next_octet_),
              .address = Address(next_octet_)};
    ++next_octet_;
    DeleteNamespace(host.ns);
    const std::string sw = "-n " + switch_ + " ";
    const std::string in = "-n " + host.ns + " ";
    for (const std::string& command :
         {"netns add " + host.ns,
          absl::StrCat(sw, "link add ", host.port, " type veth peer name eth0 netns ", host.ns),
          absl::StrCat(sw, "link set ", host.port, " master br0"),
          absl::StrCat(sw, "link set ", host.port, " up"),
          absl::StrCat(in, "addr add ", host.address, "/24 dev eth0"),
          in + "link set eth0 up", in + "link set lo up"}) {
      if (absl::Status s = Ip(command); !s.ok()) return s;
    }
    hosts_[name] = host;
    return host.address;
  }

  // The command prefix that runs a program on host `name`.
  std::string Exec(const std::string& name) const {
    return "ip netns exec " + hosts_.at(name).ns + " ";
  }
  std::string address(const std::string& name) const { return hosts_.at(name).address; }

  // Cuts host `name` off from every other host and the test process (its
  // switch port down), or heals the cut.
  absl::Status SetCut(const std::string& name, bool cut) {
    return Ip(absl::StrCat("-n ", switch_, " link set ", hosts_.at(name).port,
                           cut ? " down" : " up"));
  }

 private:
  struct Host {
    std::string ns;       // Its namespace.
    std::string port;     // Its link's end on the switch.
    std::string address;  // On eth0, inside the namespace.
  };

  // Names and subnet unique to this process and this network in it.
  explicit VirtualNetwork(int serial)
      : prefix_(absl::StrCat("pdmh", ::getpid(), "-", serial)),
        switch_(prefix_ + "-switch"),
        uplink_(absl::StrCat("pdmh", ::getpid() % 100000, "u", serial % 100)),
        subnet_(absl::StrCat("10.215.", (::getpid() + serial) % 250, ".")) {}

  std::string Address(int octet) const { return absl::StrCat(subnet_, octet); }

  static absl::Status Ip(const std::string& arguments) {
    const std::string command = "ip " + arguments;
    if (std::system((command + " >/dev/null 2>&1").c_str()) != 0) {
      return absl::UnavailableError("failed: " + command);
    }
    return absl::OkStatus();
  }
  // The namespaces of test processes that died before their destructor
  // ran (named "pdmh<pid>-..."; deleting them takes their links along).
  static void DeleteLeftovers() {
    std::FILE* list = ::popen("ip netns list 2>/dev/null", "r");
    if (list == nullptr) return;
    char line[256];
    while (std::fgets(line, sizeof(line), list) != nullptr) {
      int pid = 0;
      char rest[200];
      if (std::sscanf(line, "pdmh%d-%199s", &pid, rest) != 2) continue;
      if (pid > 0 && ::kill(pid, 0) != 0 && errno == ESRCH) {
        DeleteNamespace(absl::StrCat("pdmh", pid, "-", rest));
      }
    }
    ::pclose(list);
  }
  static void DeleteNamespace(const std::string& ns) {
    (void)std::system(("ip netns del " + ns + " >/dev/null 2>&1").c_str());
  }

  const std::string prefix_, switch_, uplink_, subnet_;
  std::map<std::string, Host> hosts_;
  int next_octet_ = 10;
};

}  // namespace pdserve::testing_util

#endif  // PDSERVE_TESTS_COMMON_VIRTUAL_NETWORK_H_
