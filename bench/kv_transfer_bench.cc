// pd-kv-transfer-bench: over each transport built here (tcp, inproc,
// ucx:shm, ucx:tcp, and with a CUDA device cuda_ipc and nccl), two tables
// of medians of --reps runs:
//  1. one KV write of 4 KiB ... 64 MiB: time (the latency at small sizes)
//     and bandwidth, next to the limit measured in the same run: a plain
//     loopback TCP stream (send the bytes, wait for a 1-byte reply) for the
//     TCP paths, memcpy for the in-memory and shared-memory paths, a
//     device-to-device cudaMemcpy for cuda_ipc and nccl (whose pools are
//     device memory; both ends in this process, so nccl runs its one-GPU
//     loopback mode);
//  2. 16 MiB in one post cut into 1 ... 4096 scattered blocks (every other
//     block of the pool): what many writes per post cost.
// Plus the round trip of a notification on its own, and with tcp the
// frames' CRC-32C on its own: its time at each size against the plain TCP
// stream's (each end of a tcp write computes it once).
#include <poll.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <iostream>
#include <map>
#include <memory>
#include <span>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "kv_transfer/socket_io.h"
#include "kv_transfer/tcp_frame.h"
#include "kv_transfer/transport.h"

#ifdef PDSERVE_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

ABSL_FLAG(int32_t, reps, 9, "Repetitions per size (median reported)");
ABSL_FLAG(int32_t, max_frame_kib, 0,
          "Frame size of the tcp transport in KiB, 1 to 1024 (0: its "
          "default, 512)");
ABSL_FLAG(std::vector<std::string>, transports, {},
          "Transports to measure (default: every one built, 'ucx' aside)");

namespace pdserve::kv {
namespace {

using Clock = std::chrono::steady_clock;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Seconds to push `bytes` through a plain loopback TCP stream and get a
// one-byte acknowledgement back: the limit the TCP paths are measured
// against. The same kernel path and the tcp transport's own socket loops
// (socket_io.h: non-blocking sockets, poll), with no framing and no
// checksum. Both ends move the bytes in pieces of `chunk` (for tcp its
// frame size: a piece is still in the cache when the kernel copies it) and
// the receiver reads into a buffer of the whole size, as the transport
// lands a write in place. 32 MiB go through first, unmeasured, so that the
// kernel's window has grown as it has on the transport's connection. -1
// when a socket call fails.
double PlainTcpConnectionSeconds(size_t bytes, size_t chunk, int reps) {
  const size_t warm_up = size_t{32} << 20;
  auto listener = ListenTcp("127.0.0.1:0");
  if (!listener.ok()) return -1;
  const absl::Time deadline = absl::Now() + absl::Minutes(1);
  // Moves `n` bytes at `p` in pieces of `chunk` with `io` (SendAll/RecvAll).
  const auto pieces = [&](auto io, int fd, std::byte* p, size_t n) {
    for (size_t at = 0; at < n; at += chunk) {
      if (io(fd, p + at, std::min(chunk, n - at), deadline) != Io::kOk) {
        return false;
      }
    }
    return true;
  };
  std::thread server([&] {
    const absl::Time connect_by = absl::Now() + absl::Seconds(5);
    if (WaitFor(listener->first.get(), POLLIN, connect_by) != Io::kOk) return;
    const Fd fd = Accept(listener->first.get());
    std::vector<std::byte> buf(std::max(bytes, warm_up));
    std::byte ack{1};
    for (int r = 0; r <= reps; ++r) {
      if (!pieces(RecvAll, fd.get(), buf.data(), r == 0 ? warm_up : bytes) ||
          SendAll(fd.get(), &ack, 1, deadline) != Io::kOk) {
        return;
      }
    }
  });
  auto fd = ConnectTcp(listener->second, absl::Seconds(5));
  std::vector<std::byte> data(std::max(bytes, warm_up), std::byte{3});
  std::vector<double> secs;
  for (int r = 0; fd.ok() && r <= reps; ++r) {  // Round 0 warms up.
    const auto t0 = Clock::now();
    std::byte got;
    if (!pieces(SendAll, fd->get(), data.data(), r == 0 ? warm_up : bytes) ||
        RecvAll(fd->get(), &got, 1, deadline) != Io::kOk) {
      break;
    }
    if (r > 0) {
      secs.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
    }
  }
  if (fd.ok()) fd->Reset();
  server.join();
  return secs.size() == static_cast<size_t>(reps) ? Median(secs) : -1;
}

// The fastest of three connections' medians: where the scheduler puts a
// new connection's two threads (one vCPU or two) moves a connection's
// time by up to 2x on a small VM, and a limit is the best the path does.
double PlainTcpSeconds(size_t bytes, size_t chunk, int reps) {
  double best = -1;
  for (int c = 0; c < 3; ++c) {
    const double t = PlainTcpConnectionSeconds(bytes, chunk, reps);
    if (t <= 0) return -1;
    best = best < 0 ? t : std::min(best, t);
  }
  return best;
}

double MemcpySeconds(size_t bytes, int reps) {
  std::vector<char> a(bytes, 1), b(bytes, 0);
  std::vector<double> secs;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    std::memcpy(b.data(), a.data(), bytes);
    secs.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return Median(secs);
}

double ChecksumSeconds(std::span<const std::byte> bytes, int reps) {
  std::vector<double> secs;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = Clock::now();
    Crc32c(bytes);  // Calls into ISA-L, a shared library: never elided.
    secs.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return Median(secs);
}

bool DeviceOnly(const std::string& name) {
  return name == "cuda_ipc" || name == "nccl";
}

#ifdef PDSERVE_HAVE_CUDA
// Two device buffers of `bytes` (the pools of the device transports).
struct DevicePools {
  explicit DevicePools(size_t bytes) : bytes(bytes) {
    ok = cudaMalloc(&src, bytes) == cudaSuccess &&
         cudaMalloc(&dst, bytes) == cudaSuccess &&
         cudaMemset(src, 1, bytes) == cudaSuccess &&
         cudaDeviceSynchronize() == cudaSuccess;
  }
  ~DevicePools() {
    cudaFree(src);
    cudaFree(dst);
  }
  size_t bytes;
  void* src = nullptr;
  void* dst = nullptr;
  bool ok = false;
};

// The limit of the device transports: one device-to-device cudaMemcpy.
double DeviceCopySeconds(DevicePools& pools, size_t bytes, int reps) {
  std::vector<double> secs;
  for (int r = 0; r < reps + 1; ++r) {
    const auto t0 = Clock::now();
    if (cudaMemcpy(pools.dst, pools.src, bytes, cudaMemcpyDeviceToDevice) !=
            cudaSuccess ||
        cudaDeviceSynchronize() != cudaSuccess) {
      std::cerr << "cudaMemcpy failed\n";
      std::exit(1);
    }
    if (r > 0)
      secs.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return Median(secs);
}
#endif

bool OverTcp(const std::string& name) {
  return name == "tcp" || name == "ucx:tcp";
}

struct Pair {
  std::unique_ptr<KvTransport> sender, receiver;
  std::unique_ptr<KvConnection> conn;
  RegionId local, remote;
};

// Seconds of the median post of `ops` (one warm-up post first).
double PostSeconds(KvConnection& conn, const std::vector<WriteOp>& ops,
                   int reps) {
  std::vector<double> secs;
  for (int r = 0; r < reps + 1; ++r) {
    const auto t0 = Clock::now();
    if (absl::Status s = conn.Write(ops); !s.ok()) {
      std::cerr << s << "\n";
      std::exit(1);
    }
    if (r > 0)
      secs.push_back(std::chrono::duration<double>(Clock::now() - t0).count());
  }
  return Median(secs);
}

int Run() {
  const int reps = absl::GetFlag(FLAGS_reps);
  std::vector<std::string> names = absl::GetFlag(FLAGS_transports);
  if (names.empty()) {
    for (const std::string& n : AvailableKvTransports()) {
      if (n != "ucx") names.push_back(n);  // "ucx" is the environment's mix.
    }
  }
  const size_t max_bytes = size_t{64} << 20;
  std::vector<std::byte> src(max_bytes, std::byte{1}), dst(max_bytes);
#ifdef PDSERVE_HAVE_CUDA
  std::unique_ptr<DevicePools> device_pools;
#endif
  TransportOptions options;
  const int32_t frame_kib = absl::GetFlag(FLAGS_max_frame_kib);
  if (frame_kib < 0 || frame_kib > 1024) {
    std::cerr << "--max_frame_kib must be 1 to 1024 (0: the default)\n";
    return 1;
  }
  if (frame_kib > 0) {
    options.max_frame_bytes = static_cast<uint32_t>(frame_kib) << 10;
  }
  std::vector<std::string> sizes_table, blocks_table, notify_table,
      checksum_table;
  for (const std::string& name : names) {
    auto sender = CreateKvTransport(name, options);
    auto receiver = CreateKvTransport(name, options);
    if (DeviceOnly(name) &&
        (sender.status().code() == absl::StatusCode::kFailedPrecondition)) {
      std::cerr << name << ": skipped: " << sender.status().message() << "\n";
      continue;  // No device (or no libnccl) here.
    }
    if (!sender.ok() || !receiver.ok()) {
      std::cerr << name << ": "
                << (sender.ok() ? receiver.status() : sender.status()) << "\n";
      return 1;
    }
    std::span<std::byte> src_pool(src), dst_pool(dst);
    std::string limit_name = OverTcp(name) ? "plain TCP stream" : "memcpy";
    std::function<double(size_t)> limit_seconds = [&](size_t bytes) {
      // tcp's stream moves its frames; ucx:tcp's goes whole (UCX cuts its
      // own pieces).
      const size_t chunk = name == "tcp" ? options.max_frame_bytes : bytes;
      return OverTcp(name) ? PlainTcpSeconds(bytes, chunk, reps)
                           : MemcpySeconds(bytes, reps);
    };
#ifdef PDSERVE_HAVE_CUDA
    if (DeviceOnly(name)) {
      if (device_pools == nullptr) {
        device_pools = std::make_unique<DevicePools>(max_bytes);
      }
      if (!device_pools->ok) {
        std::cerr << name << ": cannot allocate device memory\n";
        return 1;
      }
      src_pool = {static_cast<std::byte*>(device_pools->src), max_bytes};
      dst_pool = {static_cast<std::byte*>(device_pools->dst), max_bytes};
      limit_name = "device cudaMemcpy";
      limit_seconds = [&](size_t bytes) {
        return DeviceCopySeconds(*device_pools, bytes, reps);
      };
    }
#endif
    auto local = (*sender)->RegisterMemory(src_pool);
    auto remote = (*receiver)->RegisterMemory(dst_pool);
    if (!local.ok() || !remote.ok()) {
      std::cerr << name << ": "
                << (local.ok() ? remote.status() : local.status()) << "\n";
      return 1;
    }
    auto conn = (*sender)->Connect((*receiver)->endpoint());
    if (!conn.ok()) {
      std::cerr << name << ": " << conn.status() << "\n";
      return 1;
    }
    std::map<size_t, double> limits;  // By size: the checksum table's too.
    for (size_t bytes = 4096; bytes <= max_bytes; bytes *= 4) {
      const double t =
          PostSeconds(**conn, {{*local, 0, *remote, 0, bytes}}, reps);
      const double limit = limits[bytes] = limit_seconds(bytes);
      if (limit <= 0) {
        std::cerr << name << ": the plain TCP stream failed\n";
        return 1;
      }
      sizes_table.push_back(
          absl::StrFormat("| %s | %d | %.1f us | %.2f | %s | %.2f | %.0f%% |",
                          name, bytes, t * 1e6, bytes / t / 1e9, limit_name,
                          bytes / limit / 1e9, 100.0 * limit / t));
    }
    if (name == "tcp") {  // Sizes the table above measured the stream at.
      for (size_t bytes = 4096; bytes <= max_bytes; bytes *= 16) {
        const double t = ChecksumSeconds(std::span(src).first(bytes), reps);
        const double stream = limits.at(bytes);
        checksum_table.push_back(absl::StrFormat(
            "| %d | %.1f us | %.2f | %.1f us | %.0f%% |", bytes, t * 1e6,
            bytes / t / 1e9, stream * 1e6, 100.0 * t / stream));
      }
    }
    const size_t total = size_t{16} << 20;
    for (size_t blocks : {1, 16, 256, 4096}) {
      const size_t block = total / blocks;
      std::vector<WriteOp> ops;
      for (size_t b = 0; b < blocks;
           ++b) {  // Every other block of a 32 MiB pool.
        ops.push_back({*local, 2 * b * block, *remote,
                       (2 * (blocks - 1 - b)) * block, block});
      }
      const double t = PostSeconds(**conn, ops, reps);
      blocks_table.push_back(absl::StrFormat(
          "| %s | %d | %d | %.1f us | %.2f | %.2f us |", name, blocks, block,
          t * 1e6, total / t / 1e9, t * 1e6 / blocks));
    }
    std::vector<double> secs;
    for (int r = 0; r < 10 * reps + 1; ++r) {
      const auto t0 = Clock::now();
      if (!(*conn)->Notify("kv complete").ok()) return 1;
      if (r > 0)
        secs.push_back(
            std::chrono::duration<double>(Clock::now() - t0).count());
      if (!(*receiver)->WaitNotification(absl::Seconds(5)).ok()) return 1;
    }
    notify_table.push_back(
        absl::StrFormat("| %s | %.1f us |", name, Median(secs) * 1e6));
  }
  std::cout << "One write of N bytes\n\n"
               "| transport | bytes | median time | GB/s | limit (same run) | "
               "limit GB/s | share of limit |\n"
               "|---|---|---|---|---|---|---|\n"
            << absl::StrJoin(sizes_table, "\n") << "\n\n";
  std::cout << "16 MiB in one post, cut into scattered blocks\n\n"
               "| transport | blocks per post | block bytes | median time | "
               "GB/s | per block |\n"
               "|---|---|---|---|---|---|\n"
            << absl::StrJoin(blocks_table, "\n") << "\n\n";
  std::cout << "Notification round trip (queued at the peer)\n\n"
               "| transport | median |\n|---|---|\n"
            << absl::StrJoin(notify_table, "\n") << "\n";
  if (!checksum_table.empty()) {
    std::cout << "\ntcp frames' CRC-32C (ISA-L), once, against the plain "
                 "TCP stream of the same bytes\n\n"
                 "| bytes | median time | GB/s | plain stream | checksum / "
                 "stream |\n|---|---|---|---|---|\n"
              << absl::StrJoin(checksum_table, "\n") << "\n";
  }
  return 0;
}

}  // namespace
}  // namespace pdserve::kv

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return pdserve::kv::Run();
}
