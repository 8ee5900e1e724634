// HttpServer: the HTTP/1.1 server under pd-router's OpenAI-compatible API
// and every process's /metrics (metrics_http.h), on Boost.Beast and Asio.
//
// A few threads run one io_context; every connection is a chain of
// asynchronous operations on its own strand, so an open connection — an SSE
// stream that lasts minutes included — costs a socket, a parser and its
// buffers, never a thread. (docs/http.md has the measurement that chose
// Beast over cpp-httplib, whose threads each serve one connection.)
//
// Each connection reads one request at a time (keep-alive; pipelined bytes
// wait their turn), with bounds a client cannot talk past:
//   - the request line and headers: max_header_bytes (431 beyond),
//   - the body: max_body_bytes (413 beyond, before it is read),
//   - the whole request, from its first byte to its last: request_timeout
//     (slow clients, slow-loris included, are disconnected),
//   - an idle keep-alive connection: idle_timeout,
//   - connections open at once: max_connections (503 beyond).
// A request that cannot be parsed is answered 400 and the connection closed.
//
// The handler runs on the connection's strand and must not block: it
// answers at once or hands the HttpExchange to another thread, which may
// call the exchange's methods from anywhere. While a response is pending
// the server watches the socket, so a client that disconnects (mid-stream
// or before the answer) is noticed at once and the exchange's close
// callback runs.
//
// With Options::tls, every connection first completes a TLS handshake
// (within request_timeout).
//
// Thread-safety: HttpExchange methods from any thread. HttpServer::Stop()
// from one thread.
// Ownership: the server owns its threads and connections. An exchange may
// outlive the server; its methods then do nothing.
#ifndef PDSERVE_COMMON_HTTP_SERVER_H_
#define PDSERVE_COMMON_HTTP_SERVER_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include "absl/strings/string_view.h"
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace pdserve {

class TlsCertificates;

struct HttpRequest {
  std::string method;  // "GET", "POST", ...
  std::string path;    // The target before any '?'.
  std::string query;   // After the '?', undecoded; empty when none.
  // Header fields in arrival order, names lower-cased.
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;

  // The first value of header `name` (lower-case), or empty.
  absl::string_view Header(absl::string_view name) const;
};

// One request's answer: either a whole response (Respond) or a
// Server-Sent Events stream (StartEvents, SendEvent..., EndEvents).
class HttpExchange {
 public:
  virtual ~HttpExchange() = default;

  // A complete response. `headers` are added to Content-Type and
  // Content-Length. Only the first Respond or StartEvents counts.
  virtual void Respond(
      int status, std::string content_type, std::string body,
      std::vector<std::pair<std::string, std::string>> headers = {}) = 0;

  // Starts a 200 text/event-stream response in chunked transfer encoding.
  virtual void StartEvents() = 0;
  // Queues one event: "data: <data>\n\n". Never blocks: events queued while
  // a write is in flight go out together. A client that reads more slowly
  // than events come, beyond max_pending_event_bytes, is disconnected.
  virtual void SendEvent(absl::string_view data) = 0;
  // Ends the stream; the connection then serves its next request.
  virtual void EndEvents() = 0;

  // Runs `on_close` once, on a server thread, if the client goes away before
  // the response is complete (at once if it already has). Set it at most
  // once, before handing the exchange to another thread's work.
  virtual void OnClientGone(std::function<void()> on_close) = 0;
  // True once the client went away.
  virtual bool client_gone() const = 0;
};

class HttpServer {
 public:
  struct Options {
    // Address to listen on, "HOST:PORT"; port 0 picks a free port.
    // Default: "127.0.0.1:0".
    std::string listen = "127.0.0.1:0";
    // Threads running the connections. Default: 2.
    int threads = 2;
    // Bounds (see the file comment). Defaults: 16 KiB, 8 MiB, 30 s, 75 s,
    // 16384 connections, 4 MiB.
    uint32_t max_header_bytes = 16 << 10;
    uint64_t max_body_bytes = 8 << 20;
    absl::Duration request_timeout = absl::Seconds(30);
    absl::Duration idle_timeout = absl::Seconds(75);
    int max_connections = 16384;
    size_t max_pending_event_bytes = 4 << 20;
    // Serve HTTPS with these certificates (common/tls.h; with a CA,
    // clients must present a certificate it signs). Each new connection
    // uses the certificates of the last successful Reload(); open ones
    // keep theirs. A plaintext request gets a plaintext 400 and the
    // connection closes. Must outlive the server. Null: plaintext.
    // Default: null.
    const TlsCertificates* tls = nullptr;
  };

  using Handler = std::function<void(HttpRequest request,
                                     std::shared_ptr<HttpExchange> exchange)>;

  // Binds and starts serving. INVALID_ARGUMENT for bad options or address;
  // UNAVAILABLE when the address cannot be bound.
  static absl::StatusOr<std::unique_ptr<HttpServer>> Start(
      const Options& options, Handler handler);

  // Stop().
  ~HttpServer();

  // The bound port.
  int port() const;
  // Connections open now.
  int connections() const;

  // Closes the listener and every connection, and joins the threads.
  // Exchanges still held elsewhere do nothing from then on. Idempotent.
  void Stop();

  struct Impl;

 private:
  explicit HttpServer(std::shared_ptr<Impl> impl);
  // Shared with the connections' exchanges, which may outlive the server.
  std::shared_ptr<Impl> impl_;
};

}  // namespace pdserve

#endif  // PDSERVE_COMMON_HTTP_SERVER_H_
