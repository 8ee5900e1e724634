// kv-transfer-peer: a receiving KV transport in its own process, for the
// cross-process conformance tests (transport_test.cc), which kill it, stop
// it and read its memory back through this small line protocol.
//
//   kv-transfer-peer TRANSPORT BYTES [IO_TIMEOUT_MS]
//
// Registers BYTES zero bytes and prints "ENDPOINT REGION PID". Then, one
// command per line on stdin, one answer line on stdout:
//   notify MS        the next notification's text, or "TIMEOUT"
//   crc OFFSET LEN   CRC-32C of those bytes of the region
//   exit
#include <unistd.h>

#include <iostream>
#include <string>
#include <vector>

#include "kv_transfer/tcp_frame.h"
#include "kv_transfer/transport.h"

int main(int argc, char** argv) {
  using namespace pdserve::kv;
  if (argc < 3) {
    std::cerr << "usage: kv-transfer-peer TRANSPORT BYTES [IO_TIMEOUT_MS]\n";
    return 2;
  }
  TransportOptions options;
  if (argc > 3) options.io_timeout = absl::Milliseconds(std::stoll(argv[3]));
  auto transport = CreateKvTransport(argv[1], options);
  if (!transport.ok()) {
    std::cerr << transport.status() << "\n";
    return 1;
  }
  std::vector<std::byte> memory(std::stoull(argv[2]));
  auto region = (*transport)->RegisterMemory(memory);
  if (!region.ok()) {
    std::cerr << region.status() << "\n";
    return 1;
  }
  std::cout << (*transport)->endpoint() << " " << region->value << " "
            << ::getpid() << std::endl;
  std::string command;
  while (std::cin >> command) {
    if (command == "notify") {
      int64_t ms = 0;
      std::cin >> ms;
      auto n = (*transport)->WaitNotification(absl::Milliseconds(ms));
      std::cout << (n.ok() ? n->message : "TIMEOUT") << std::endl;
    } else if (command == "crc") {
      uint64_t offset = 0, length = 0;
      std::cin >> offset >> length;
      if (offset > memory.size() || length > memory.size() - offset) {
        std::cout << "RANGE" << std::endl;
        continue;
      }
      std::cout << Crc32c(std::span(memory).subspan(offset, length))
                << std::endl;
    } else {
      break;
    }
  }
  return 0;
}
