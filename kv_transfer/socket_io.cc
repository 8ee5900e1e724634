#include "kv_transfer/socket_io.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cerrno>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace pdserve::kv {
namespace {

constexpr std::string_view kUnixPrefix = "unix:";

absl::StatusOr<addrinfo*> Resolve(std::string_view address, bool passive) {
  PD_ASSIGN_OR_RETURN(auto hp, SplitHostPort(address));
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* result = nullptr;
  if (int rc =
          ::getaddrinfo(hp.first.c_str(), hp.second.c_str(), &hints, &result);
      rc != 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot resolve '", std::string(address), "': ", ::gai_strerror(rc)));
  }
  return result;
}

// Finishes a non-blocking connect() begun on `fd`.
absl::Status FinishConnect(int fd, int rc, std::string_view endpoint,
                           absl::Duration timeout) {
  if (rc != 0 && errno != EINPROGRESS) {
    return absl::UnavailableError(absl::StrCat("cannot connect to ",
                                               std::string(endpoint), ": ",
                                               std::strerror(errno)));
  }
  if (WaitFor(fd, POLLOUT, absl::Now() + timeout) != Io::kOk) {
    return absl::DeadlineExceededError(
        absl::StrCat("connecting to ", std::string(endpoint), " timed out"));
  }
  int err = 0;
  socklen_t len = sizeof(err);
  ::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len);
  if (err != 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot connect to ", std::string(endpoint), ": ", std::strerror(err)));
  }
  return absl::OkStatus();
}

// Small frames go out at once instead of waiting for the peer's ACK.
void SetNoDelay(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
}

// Drops the first `n` bytes of `iov`.
void Consume(std::span<iovec>& iov, size_t n) {
  while (!iov.empty() && n >= iov.front().iov_len) {
    n -= iov.front().iov_len;
    iov = iov.subspan(1);
  }
  if (!iov.empty()) {
    iov.front().iov_base = static_cast<std::byte*>(iov.front().iov_base) + n;
    iov.front().iov_len -= n;
  }
}

// Empty entries end nothing: a zero-length read is taken as the peer's close.
void SkipEmpty(std::span<iovec>& iov) {
  while (!iov.empty() && iov.front().iov_len == 0) iov = iov.subspan(1);
}

}  // namespace

void Fd::Reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

Io WaitFor(int fd, short events, absl::Time deadline) {
  while (true) {
    const absl::Duration left = deadline - absl::Now();
    if (left <= absl::ZeroDuration()) return Io::kTimeout;
    pollfd p{fd, events, 0};
    const int ms = static_cast<int>(
        std::min<int64_t>(absl::ToInt64Milliseconds(left) + 1, 1 << 30));
    const int r = ::poll(&p, 1, ms);
    if (r > 0) return Io::kOk;
    if (r < 0 && errno != EINTR) return Io::kError;
  }
}

Io SendAllV(int fd, std::span<iovec> iov, absl::Time deadline) {
  for (SkipEmpty(iov); !iov.empty(); SkipEmpty(iov)) {
    msghdr m{};
    m.msg_iov = iov.data();
    m.msg_iovlen = std::min<size_t>(iov.size(), IOV_MAX);
    const ssize_t n = ::sendmsg(fd, &m, MSG_NOSIGNAL);
    if (n > 0) {
      Consume(iov, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      if (Io io = WaitFor(fd, POLLOUT, deadline); io != Io::kOk) return io;
      continue;
    }
    return errno == EPIPE || errno == ECONNRESET ? Io::kClosed : Io::kError;
  }
  return Io::kOk;
}

Io RecvAllV(int fd, std::span<iovec> iov, absl::Time deadline) {
  for (SkipEmpty(iov); !iov.empty(); SkipEmpty(iov)) {
    msghdr m{};
    m.msg_iov = iov.data();
    m.msg_iovlen = std::min<size_t>(iov.size(), IOV_MAX);
    const ssize_t n = ::recvmsg(fd, &m, 0);
    if (n > 0) {
      Consume(iov, static_cast<size_t>(n));
      continue;
    }
    if (n == 0) return Io::kClosed;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (Io io = WaitFor(fd, POLLIN, deadline); io != Io::kOk) return io;
      continue;
    }
    return errno == ECONNRESET ? Io::kClosed : Io::kError;
  }
  return Io::kOk;
}

Io SendAll(int fd, const std::byte* data, size_t len, absl::Time deadline) {
  iovec one{const_cast<std::byte*>(data), len};
  return SendAllV(fd, {&one, 1}, deadline);
}

Io RecvAll(int fd, std::byte* data, size_t len, absl::Time deadline) {
  iovec one{data, len};
  return RecvAllV(fd, {&one, 1}, deadline);
}

absl::Status IoStatus(Io io, std::string_view what) {
  switch (io) {
    case Io::kOk:
      return absl::OkStatus();
    case Io::kTimeout:
      return absl::DeadlineExceededError(
          absl::StrCat(std::string(what), ": timed out"));
    case Io::kClosed:
      return absl::UnavailableError(
          absl::StrCat(std::string(what), ": peer closed the connection"));
    case Io::kError:
      return absl::UnavailableError(
          absl::StrCat(std::string(what), ": ", std::strerror(errno)));
  }
  return absl::InternalError("unreachable");
}

void SetNonBlocking(int fd) {
  ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) | O_NONBLOCK);
}

absl::StatusOr<std::pair<std::string, std::string>> SplitHostPort(
    std::string_view address) {
  const size_t colon = address.rfind(':');
  if (colon == std::string_view::npos || colon == 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("address '", std::string(address), "' is not host:port"));
  }
  std::string host(address.substr(0, colon));
  if (host.size() > 2 && host.front() == '[' && host.back() == ']')
    host = host.substr(1, host.size() - 2);
  return std::pair{host, std::string(address.substr(colon + 1))};
}

absl::StatusOr<std::pair<Fd, std::string>> ListenTcp(std::string_view address) {
  PD_ASSIGN_OR_RETURN(addrinfo * ai, Resolve(address, /*passive=*/true));
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> free_ai(ai,
                                                               &::freeaddrinfo);
  Fd fd(
      ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
  const int one = 1;
  ::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  if (fd.get() < 0 || ::bind(fd.get(), ai->ai_addr, ai->ai_addrlen) != 0 ||
      ::listen(fd.get(), 64) != 0) {
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on ", std::string(address), ": ", std::strerror(errno)));
  }
  SetNonBlocking(fd.get());
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  ::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&addr), &len);
  char host[NI_MAXHOST], port[NI_MAXSERV];
  ::getnameinfo(reinterpret_cast<sockaddr*>(&addr), len, host, sizeof(host),
                port, sizeof(port), NI_NUMERICHOST | NI_NUMERICSERV);
  std::string endpoint = addr.ss_family == AF_INET6
                             ? absl::StrCat("[", host, "]:", port)
                             : absl::StrCat(host, ":", port);
  return std::pair{std::move(fd), std::move(endpoint)};
}

absl::StatusOr<Fd> ConnectTcp(std::string_view address,
                              absl::Duration timeout) {
  PD_ASSIGN_OR_RETURN(addrinfo * ai, Resolve(address, /*passive=*/false));
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> free_ai(ai,
                                                               &::freeaddrinfo);
  Fd fd(
      ::socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol));
  if (fd.get() < 0)
    return absl::UnavailableError(
        absl::StrCat("socket: ", std::strerror(errno)));
  SetNonBlocking(fd.get());
  PD_RETURN_IF_ERROR(
      FinishConnect(fd.get(), ::connect(fd.get(), ai->ai_addr, ai->ai_addrlen),
                    address, timeout));
  SetNoDelay(fd.get());
  return fd;
}

Fd Accept(int listen_fd) {
  Fd fd(::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
  if (fd.get() < 0) return fd;
  sockaddr_storage local{};
  socklen_t len = sizeof(local);
  if (::getsockname(fd.get(), reinterpret_cast<sockaddr*>(&local), &len) == 0 &&
      (local.ss_family == AF_INET || local.ss_family == AF_INET6)) {
    SetNoDelay(fd.get());
  }
  return fd;
}

absl::StatusOr<UnixAddress> ParseUnixEndpoint(std::string_view endpoint) {
  if (!endpoint.starts_with(kUnixPrefix)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", std::string(endpoint),
        "' is not a Unix socket endpoint (unix:/path or unix:@name)"));
  }
  const std::string_view name = endpoint.substr(kUnixPrefix.size());
  UnixAddress a;
  a.addr.sun_family = AF_UNIX;
  if (name.size() < 2 || (name[0] != '/' && name[0] != '@') ||
      name.find('\0') != std::string_view::npos) {
    return absl::InvalidArgumentError(absl::StrCat(
        "'", std::string(endpoint),
        "': a Unix socket is unix:/absolute/path or unix:@abstract-name"));
  }
  // A path needs its terminating NUL; an abstract name starts with one.
  const size_t limit = sizeof(a.addr.sun_path) - (name[0] == '/' ? 1 : 0);
  if (name.size() > limit) {
    return absl::InvalidArgumentError(
        absl::StrCat("Unix socket name '", std::string(name),
                     "' is longer than ", limit, " bytes"));
  }
  std::memcpy(a.addr.sun_path, name.data(), name.size());
  if (name[0] == '@') a.addr.sun_path[0] = '\0';
  a.len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size() +
                                 (name[0] == '/' ? 1 : 0));
  return a;
}

absl::StatusOr<Fd> ListenUnix(std::string_view endpoint) {
  PD_ASSIGN_OR_RETURN(const UnixAddress a, ParseUnixEndpoint(endpoint));
  Fd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (fd.get() < 0)
    return absl::UnavailableError(
        absl::StrCat("socket: ", std::strerror(errno)));
  if (::bind(fd.get(), reinterpret_cast<const sockaddr*>(&a.addr), a.len) !=
      0) {
    const int err = errno;
    if (err == EADDRINUSE) {
      return absl::FailedPreconditionError(absl::StrCat(
          "cannot listen on ", std::string(endpoint),
          ": in use (a stale socket file must be removed by its owner)"));
    }
    return absl::UnavailableError(absl::StrCat(
        "cannot listen on ", std::string(endpoint), ": ", std::strerror(err)));
  }
  if (::listen(fd.get(), 64) != 0) {
    return absl::UnavailableError(absl::StrCat("cannot listen on ",
                                               std::string(endpoint), ": ",
                                               std::strerror(errno)));
  }
  return fd;
}

absl::StatusOr<Fd> ConnectUnix(std::string_view endpoint,
                               absl::Duration timeout) {
  PD_ASSIGN_OR_RETURN(const UnixAddress a, ParseUnixEndpoint(endpoint));
  Fd fd(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0));
  if (fd.get() < 0)
    return absl::UnavailableError(
        absl::StrCat("socket: ", std::strerror(errno)));
  const int rc =
      ::connect(fd.get(), reinterpret_cast<const sockaddr*>(&a.addr), a.len);
  // A Unix socket connects at once or fails (EAGAIN: backlog full).
  if (rc != 0 && errno == EAGAIN) {
    return absl::UnavailableError(absl::StrCat(
        std::string(endpoint), ": the listener's backlog is full"));
  }
  PD_RETURN_IF_ERROR(FinishConnect(fd.get(), rc, endpoint, timeout));
  return fd;
}

}  // namespace pdserve::kv
