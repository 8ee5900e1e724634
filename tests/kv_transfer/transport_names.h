// Which transports a test suite runs over, by the memory they register.
#ifndef PDSERVE_TESTS_KV_TRANSFER_TRANSPORT_NAMES_H_
#define PDSERVE_TESTS_KV_TRANSFER_TRANSPORT_NAMES_H_

#include <cctype>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "kv_transfer/transport.h"

namespace pdserve::kv {

// cuda_ipc and nccl register device memory only; their suite is
// gpu_transport_test.cc.
inline bool RegistersDeviceMemoryOnly(const std::string& name) {
  return name == "cuda_ipc" || name == "nccl";
}

// Every transport built here whose memory may be host memory, less
// `except`.
inline std::vector<std::string> HostMemoryTransports(
    const std::vector<std::string>& except = {}) {
  std::vector<std::string> names;
  for (const std::string& n : AvailableKvTransports()) {
    bool skip = RegistersDeviceMemoryOnly(n);
    for (const std::string& e : except) skip |= n == e;
    if (!skip) names.push_back(n);
  }
  return names;
}

inline std::string TransportTestName(
    const ::testing::TestParamInfo<std::string>& info) {
  std::string name = info.param;
  for (char& c : name) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return name;
}

}  // namespace pdserve::kv

#endif  // PDSERVE_TESTS_KV_TRANSFER_TRANSPORT_NAMES_H_
