// kv-transfer-device-peer: kv-transfer-peer (same command line and line
// protocol) with its region in device memory, for the cross-process tests
// of cuda_ipc and nccl (gpu_transport_test.cc).
//
//   kv-transfer-device-peer TRANSPORT BYTES [IO_TIMEOUT_MS [DEVICE]]
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <iostream>
#include <string>
#include <vector>

#include "kv_transfer/tcp_frame.h"
#include "kv_transfer/transport.h"

int main(int argc, char** argv) {
  using namespace pdserve::kv;
  if (argc < 3) {
    std::cerr << "usage: kv-transfer-device-peer TRANSPORT BYTES "
                 "[IO_TIMEOUT_MS [DEVICE]]\n";
    return 2;
  }
  TransportOptions options;
  if (argc > 3) options.io_timeout = absl::Milliseconds(std::stoll(argv[3]));
  if (argc > 4 && cudaSetDevice(std::stoi(argv[4])) != cudaSuccess) {
    std::cerr << "cudaSetDevice(" << argv[4] << ") failed\n";
    return 1;
  }
  const size_t bytes = std::stoull(argv[2]);
  void* device = nullptr;
  if (cudaMalloc(&device, bytes) != cudaSuccess ||
      cudaMemset(device, 0, bytes) != cudaSuccess ||
      cudaDeviceSynchronize() != cudaSuccess) {
    std::cerr << "cannot allocate " << bytes << " bytes of device memory\n";
    return 1;
  }
  auto transport = CreateKvTransport(argv[1], options);
  if (!transport.ok()) {
    std::cerr << transport.status() << "\n";
    return 1;
  }
  std::span<std::byte> memory(static_cast<std::byte*>(device), bytes);
  auto region = (*transport)->RegisterMemory(memory);
  if (!region.ok()) {
    std::cerr << region.status() << "\n";
    return 1;
  }
  std::cout << (*transport)->endpoint() << " " << region->value << " "
            << ::getpid() << std::endl;
  std::string command;
  std::vector<std::byte> host;
  while (std::cin >> command) {
    if (command == "notify") {
      int64_t ms = 0;
      std::cin >> ms;
      auto n = (*transport)->WaitNotification(absl::Milliseconds(ms));
      std::cout << (n.ok() ? n->message : "TIMEOUT") << std::endl;
    } else if (command == "crc") {
      uint64_t offset = 0, length = 0;
      std::cin >> offset >> length;
      if (offset > bytes || length > bytes - offset) {
        std::cout << "RANGE" << std::endl;
        continue;
      }
      host.resize(length);
      if (cudaMemcpy(host.data(), memory.data() + offset, length,
                     cudaMemcpyDeviceToHost) != cudaSuccess) {
        std::cout << "CUDA_ERROR" << std::endl;
        continue;
      }
      std::cout << Crc32c(host) << std::endl;
    } else {
      break;
    }
  }
  return 0;
}
