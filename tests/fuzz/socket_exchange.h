// What the socket fuzz targets do with one input: send it to a live server
// and wait for the server to end the connection.
#ifndef PDSERVE_TESTS_FUZZ_SOCKET_EXCHANGE_H_
#define PDSERVE_TESTS_FUZZ_SOCKET_EXCHANGE_H_

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <span>

namespace pdserve::fuzz {

// Sends `bytes` on the connected socket `fd` while reading what the server
// answers as it goes (so that neither side waits on a full buffer),
// half-closes once everything is sent, and reads until the server closes
// or resets the connection. Every input must end that way: a server that
// has not within `hang` is hung, and that is a finding (a trap). Then
// resets the connection and closes `fd`.
inline void ExchangeUntilClosed(int fd, std::span<const std::byte> bytes,
                                std::chrono::seconds hang) {
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
  const auto give_up = std::chrono::steady_clock::now() + hang;
  size_t sent = 0;
  bool shut = false;
  std::byte sink[4096];
  // libFuzzer's timeout alarm (SIGALRM) interrupts system calls: EINTR is
  // not an answer.
  while (true) {
    if (sent == bytes.size() && !shut) {
      ::shutdown(fd, SHUT_WR);
      shut = true;
    }
    pollfd p{fd, static_cast<short>(POLLIN | (shut ? 0 : POLLOUT)), 0};
    const int ready = ::poll(&p, 1, 1000);
    if (ready < 0 && errno == EINTR) continue;
    if (ready < 0) __builtin_trap();
    if (std::chrono::steady_clock::now() > give_up) __builtin_trap();  // Hung.
    if (ready == 0) continue;
    if (p.revents & ~POLLOUT) {  // Data, the close, or an error to read.
      const ssize_t n = ::recv(fd, sink, sizeof(sink), 0);
      if (n == 0) break;
      if (n < 0 && errno != EINTR && errno != EAGAIN) break;  // Reset.
    }
    if (!shut && (p.revents & POLLOUT)) {
      const ssize_t n = ::send(fd, bytes.data() + sent, bytes.size() - sent,
                               MSG_NOSIGNAL);
      if (n > 0) sent += static_cast<size_t>(n);
      if (n < 0 && errno != EINTR && errno != EAGAIN) break;  // Refused.
    }
  }
  // Reset rather than linger in TIME_WAIT: thousands of inputs a second
  // would otherwise run out of local ports.
  linger reset{1, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_LINGER, &reset, sizeof(reset));
  ::close(fd);
}

}  // namespace pdserve::fuzz

#endif  // PDSERVE_TESTS_FUZZ_SOCKET_EXCHANGE_H_
