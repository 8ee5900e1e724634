// Blocking-with-deadline socket I/O that the socket-based transports share
// (tcp, and the control channels of cuda_ipc and nccl): an owning fd,
// waits bounded by a deadline, listening and connecting on TCP and on
// Unix-domain sockets. Internal to kv_transfer/ (and its tests and
// pd-kv-transfer-bench).
//
// Every socket made here is non-blocking and close-on-exec; SendAll and
// RecvAll wait with poll() until their deadline.
#ifndef PDSERVE_KV_TRANSFER_SOCKET_IO_H_
#define PDSERVE_KV_TRANSFER_SOCKET_IO_H_

#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/un.h>

#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace pdserve::kv {

// Outcome of a socket wait: the caller turns it into a Status (IoStatus).
enum class Io { kOk, kClosed, kTimeout, kError };

class Fd {
 public:
  explicit Fd(int fd = -1) : fd_(fd) {}
  ~Fd() { Reset(); }
  Fd(Fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)) {}
  Fd& operator=(Fd&& o) noexcept {
    Reset();
    fd_ = std::exchange(o.fd_, -1);
    return *this;
  }
  int get() const { return fd_; }
  void Reset();
  // Gives up ownership: the descriptor stays open.
  int Release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

// Waits until `fd` has one of `events` (POLLIN, POLLOUT) or the deadline.
Io WaitFor(int fd, short events, absl::Time deadline);
Io SendAll(int fd, const std::byte* data, size_t len, absl::Time deadline);
Io RecvAll(int fd, std::byte* data, size_t len, absl::Time deadline);
// The bytes of every entry of `iov`, in order, in as few system calls as
// the socket allows; `iov`'s entries are used up in the process.
Io SendAllV(int fd, std::span<iovec> iov, absl::Time deadline);
Io RecvAllV(int fd, std::span<iovec> iov, absl::Time deadline);
// OK, DEADLINE_EXCEEDED, or UNAVAILABLE (peer closed, socket error; errno
// is read for kError), prefixed with `what`.
absl::Status IoStatus(Io io, std::string_view what);

void SetNonBlocking(int fd);

// "host:port" ("[v6]:port" too) split in two; INVALID_ARGUMENT otherwise.
absl::StatusOr<std::pair<std::string, std::string>> SplitHostPort(
    std::string_view address);

// A TCP listener on `address` ("host:port", port 0 picks one) and the
// "host:port" a peer connects to.
absl::StatusOr<std::pair<Fd, std::string>> ListenTcp(std::string_view address);
// A connected TCP socket (TCP_NODELAY); DEADLINE_EXCEEDED after `timeout`.
absl::StatusOr<Fd> ConnectTcp(std::string_view address, absl::Duration timeout);

// The next connection on a listening socket, non-blocking; a TCP one with
// TCP_NODELAY, as ConnectTcp's, so that a small reply is not held back by
// Nagle's algorithm behind the peer's delayed ACK (40 ms on Linux). An
// invalid Fd when there is none.
Fd Accept(int listen_fd);

// A Unix-domain socket address written as "unix:/path/to/socket" (a file;
// reachable from every process that can open the path) or "unix:@name"
// (Linux's abstract namespace: no file, gone with its listener, reachable
// within one network namespace). INVALID_ARGUMENT for anything else,
// including a path longer than sockaddr_un holds.
struct UnixAddress {
  sockaddr_un addr{};
  socklen_t len = 0;
};
absl::StatusOr<UnixAddress> ParseUnixEndpoint(std::string_view endpoint);

// A listener on a "unix:..." endpoint. An existing path is not replaced
// (FAILED_PRECONDITION): whoever made it removes it. The caller unlinks a
// path it listened on when it stops listening.
absl::StatusOr<Fd> ListenUnix(std::string_view endpoint);
absl::StatusOr<Fd> ConnectUnix(std::string_view endpoint,
                               absl::Duration timeout);

}  // namespace pdserve::kv

#endif  // PDSERVE_KV_TRANSFER_SOCKET_IO_H_
