#include "common/http_server.h"

#include <atomic>
#include <array>
#include <chrono>
#include <exception>
#include <iterator>
#include <optional>
#include <thread>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/synchronization/mutex.h"
#include "boost/asio/ip/tcp.hpp"
#include "boost/asio/post.hpp"
#include "boost/asio/ssl/context.hpp"
#include "boost/asio/ssl/error.hpp"
#include "boost/asio/ssl/stream.hpp"
#include "boost/asio/steady_timer.hpp"
#include "boost/asio/strand.hpp"
#include "boost/asio/write.hpp"
#include "boost/beast/http/parser.hpp"
#include "boost/beast/http/status.hpp"
#include "boost/beast/http/string_body.hpp"
#include "common/log.h"
#include "common/process.h"
#include "common/tls.h"
#include "openssl/err.h"
#include "openssl/ssl.h"

namespace pdserve {

namespace net = boost::asio;
namespace http = boost::beast::http;
using tcp = net::ip::tcp;
using boost::system::error_code;

absl::string_view HttpRequest::Header(absl::string_view name) const {
  for (const auto& [key, value] : headers) {
    if (key == name) return value;
  }
  return {};
}

namespace {

absl::string_view View(boost::beast::string_view view) {
  return absl::string_view(view.data(), view.size());
}

// Bytes read from a socket per read.
constexpr size_t kReadChunk = 16 << 10;

std::string StatusLine(int status) {
  return absl::StrCat(
      "HTTP/1.1 ", status, " ",
      View(http::obsolete_reason(static_cast<http::status>(status))),
      "\r\n");
}

std::string WholeResponse(
    int status, absl::string_view content_type, absl::string_view body,
    const std::vector<std::pair<std::string, std::string>>& headers,
    bool keep_alive) {
  std::string out = StatusLine(status);
  absl::StrAppend(&out, "Content-Type: ", content_type,
                  "\r\nContent-Length: ", body.size(), "\r\n");
  for (const auto& [name, value] : headers) {
    absl::StrAppend(&out, name, ": ", value, "\r\n");
  }
  absl::StrAppend(&out, "Connection: ", keep_alive ? "keep-alive" : "close",
                  "\r\n\r\n", body);
  return out;
}

// A TLS context serving `pem`: TLS 1.2 and newer; with a CA, clients must
// present a certificate it signs.
absl::StatusOr<std::shared_ptr<net::ssl::context>> MakeTlsContext(
    const TlsPem& pem) {
  auto context =
      std::make_shared<net::ssl::context>(net::ssl::context::tls_server);
  error_code ec;
  context->set_options(net::ssl::context::default_workarounds |
                           net::ssl::context::no_sslv2 |
                           net::ssl::context::no_sslv3 |
                           net::ssl::context::no_tlsv1 |
                           net::ssl::context::no_tlsv1_1,
                       ec);
  if (!ec) context->use_certificate_chain(net::buffer(pem.chain), ec);
  if (!ec) {
    context->use_private_key(net::buffer(pem.key),
                             net::ssl::context::pem, ec);
  }
  if (!ec && !pem.ca.empty()) {
    context->add_certificate_authority(net::buffer(pem.ca), ec);
    if (!ec) {
      context->set_verify_mode(net::ssl::verify_peer |
                                   net::ssl::verify_fail_if_no_peer_cert,
                               ec);
    }
  }
  if (ec) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot make the HTTP TLS context: ", ec.message()));
  }
  return context;
}

std::string ErrorResponse(int status, absl::string_view message) {
  // The same error object shape as the OpenAI layer's, so every client sees
  // one kind of error body.
  std::string body = absl::StrCat(R"({"error":{"message":")", message,
                                  R"(","type":"invalid_request_error",)",
                                  R"("param":null,"code":null}})");
  return WholeResponse(status, "application/json", body, {}, false);
}

}  // namespace

class Session;

struct HttpServer::Impl {
  Impl(const Options& o, Handler h)
      : options(o),
        handler(std::move(h)),
        acceptor_strand(net::make_strand(ioc)),
        acceptor(acceptor_strand),
        accept_retry(acceptor_strand) {}

  void Accept();
  // The TLS context for a new connection, remade when the certificates
  // were reloaded; null without TLS.
  std::shared_ptr<net::ssl::context> TlsContext();
  // False (not registered) once Stop() has begun.
  bool Register(const std::shared_ptr<Session>& session);
  void Unregister(Session* session);

  const Options options;
  const Handler handler;
  net::io_context ioc;
  // The acceptor, its retry timer and their handlers live on one strand.
  net::strand<net::io_context::executor_type> acceptor_strand;
  tcp::acceptor acceptor;
  net::steady_timer accept_retry;
  std::vector<std::thread> threads;
  int port = 0;
  std::atomic<int> connections{0};
  std::weak_ptr<Impl> weak_self;
  // Exchanges post to connections under a reader lock of post_mu, Stop()
  // sets `stopped` under its writer lock: after Stop() returns nothing is
  // posted to the stopped io_context.
  absl::Mutex post_mu;
  bool stopped ABSL_GUARDED_BY(post_mu) = false;
  absl::Mutex mu;
  absl::flat_hash_map<Session*, std::weak_ptr<Session>> sessions
      ABSL_GUARDED_BY(mu);
  bool closing ABSL_GUARDED_BY(mu) = false;
  absl::Mutex tls_mu;
  std::shared_ptr<net::ssl::context> tls_context ABSL_GUARDED_BY(tls_mu);
  uint64_t tls_generation ABSL_GUARDED_BY(tls_mu) = 0;
};

namespace {

class Exchange;

}  // namespace

// One connection. Every member is touched on the connection's strand only.
class Session : public std::enable_shared_from_this<Session> {
 public:
  // Plaintext when `tls` is null.
  Session(std::shared_ptr<HttpServer::Impl> server, tcp::socket socket,
          std::shared_ptr<net::ssl::context> tls)
      : server_(std::move(server)),
        options_(server_->options),
        tls_context_(std::move(tls)),
        timer_(socket.get_executor()) {
    if (tls_context_) {
      tls_.emplace(std::move(socket), *tls_context_);
    } else {
      socket_.emplace(std::move(socket));
    }
  }

  ~Session() { server_->connections.fetch_sub(1); }

  auto executor() { return timer_.get_executor(); }

  void Start(bool over_capacity) {
    if (tls_ && !handshake_done_) return Handshake(over_capacity);
    if (over_capacity) {
      busy_ = true;  // Nothing is read: the answer goes and the socket closes.
      keep_alive_ = false;
      Queue(ErrorResponse(503, "the server is at its connection limit"),
            /*response_done=*/true);
      return;
    }
    ParseOrRead();
  }

  // From the exchange, on the strand, while it is current.
  void Queue(std::string bytes, bool response_done);
  bool IsCurrent(const void* exchange) const {
    return busy_ && exchange == current_exchange_;
  }
  bool keep_alive() const { return keep_alive_; }
  void set_keep_alive(bool keep_alive) { keep_alive_ = keep_alive; }
  void Close();

 private:
  // The TCP socket under TLS, or the plaintext one.
  tcp::socket& raw() { return tls_ ? tls_->next_layer() : *socket_; }
  void Handshake(bool over_capacity);
  void ParseOrRead();
  void Read();
  void OnRead(error_code ec, size_t bytes);
  void Dispatch();
  void Fail(int status, absl::string_view message);
  void Write();
  void OnWrite(error_code ec);
  void ArmTimer(absl::Duration after);
  void ArmTimerAt(std::chrono::steady_clock::time_point when);
  void DisarmTimer() { timer_.cancel(); }

  const std::shared_ptr<HttpServer::Impl> server_;
  const HttpServer::Options& options_;
  // Exactly one of socket_ and tls_; the stream refers to the context.
  const std::shared_ptr<net::ssl::context> tls_context_;
  std::optional<tcp::socket> socket_;
  std::optional<net::ssl::stream<tcp::socket>> tls_;
  bool handshake_done_ = false;
  net::steady_timer timer_;
  std::string in_;  // Bytes read and not yet parsed.
  std::array<char, kReadChunk> read_buffer_;
  std::optional<http::request_parser<http::string_body>> parser_;
  bool reading_ = false;
  bool request_started_ = false;
  std::chrono::steady_clock::time_point request_deadline_;
  bool continue_sent_ = false;
  bool busy_ = false;  // A request is being answered.
  bool keep_alive_ = true;
  bool response_done_ = false;
  bool closed_ = false;
  std::string outbox_;
  std::string writing_;
  bool write_in_flight_ = false;
  std::shared_ptr<Exchange> exchange_;
  const void* current_exchange_ = nullptr;
};

namespace {

class Exchange final : public HttpExchange,
                       public std::enable_shared_from_this<Exchange> {
 public:
  Exchange(std::weak_ptr<HttpServer::Impl> server,
           std::weak_ptr<Session> session, bool chunked)
      : server_(std::move(server)),
        session_(std::move(session)),
        chunked_(chunked) {}

  void Respond(int status, std::string content_type, std::string body,
               std::vector<std::pair<std::string, std::string>> headers)
      override {
    if (started_.exchange(true)) return;
    // keep-alive is decided on the strand; written as a placeholder here.
    Post([status, content_type = std::move(content_type),
          body = std::move(body),
          headers = std::move(headers)](Session& s, bool keep_alive) {
      s.Queue(WholeResponse(status, content_type, body, headers, keep_alive),
              /*response_done=*/true);
    });
  }

  void StartEvents() override {
    if (started_.exchange(true)) return;
    streaming_ = true;
    std::string head = StatusLine(200);
    absl::StrAppend(&head,
                    "Content-Type: text/event-stream\r\n"
                    "Cache-Control: no-cache\r\n",
                    chunked_ ? "Transfer-Encoding: chunked\r\n" : "",
                    "Connection: keep-alive\r\n\r\n");
    Post([head = std::move(head)](Session& s, bool) {
      s.Queue(std::move(head), false);
    });
  }

  void SendEvent(absl::string_view data) override {
    if (!streaming_) return;
    std::string event;
    const size_t size = data.size() + 8;  // "data: " + "\n\n".
    if (chunked_) absl::StrAppend(&event, absl::Hex(size), "\r\n");
    absl::StrAppend(&event, "data: ", data, "\n\n");
    if (chunked_) event += "\r\n";
    Post([event = std::move(event)](Session& s, bool) {
      s.Queue(std::move(event), false);
    });
  }

  void EndEvents() override {
    if (!streaming_ || ended_.exchange(true)) return;
    Post([chunked = chunked_](Session& s, bool) {
      if (!chunked) s.set_keep_alive(false);  // Only the close ends it.
      s.Queue(chunked ? "0\r\n\r\n" : "", /*response_done=*/true);
    });
  }

  void OnClientGone(std::function<void()> on_close) override {
    bool gone_already;
    {
      absl::MutexLock lock(&mu_);
      gone_already = gone_;
      if (!gone_already) on_close_ = std::move(on_close);
    }
    if (gone_already && on_close) on_close();
  }

  bool client_gone() const override {
    absl::MutexLock lock(&mu_);
    return gone_;
  }

  // On the strand, once.
  void MarkGone() {
    std::function<void()> on_close;
    {
      absl::MutexLock lock(&mu_);
      if (gone_) return;
      gone_ = true;
      on_close = std::move(on_close_);
    }
    if (on_close) on_close();
  }

 private:
  template <typename F>
  void Post(F f) {
    std::shared_ptr<HttpServer::Impl> server = server_.lock();
    if (!server) return;
    absl::ReaderMutexLock lock(&server->post_mu);
    if (server->stopped) return;
    std::shared_ptr<Session> session = session_.lock();
    if (!session) return;
    net::post(session->executor(),
              [session, self = shared_from_this(), f = std::move(f)]() mutable {
                if (!session->IsCurrent(self.get())) return;
                f(*session, session->keep_alive());
              });
  }

  const std::weak_ptr<HttpServer::Impl> server_;
  const std::weak_ptr<Session> session_;
  const bool chunked_;
  std::atomic<bool> started_{false};
  std::atomic<bool> streaming_{false};
  std::atomic<bool> ended_{false};
  mutable absl::Mutex mu_;
  bool gone_ ABSL_GUARDED_BY(mu_) = false;
  std::function<void()> on_close_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

void Session::ParseOrRead() {
  if (closed_ || busy_) return;
  if (!parser_) {
    parser_.emplace();
    parser_->header_limit(options_.max_header_bytes);
    parser_->body_limit(options_.max_body_bytes);
    parser_->eager(true);
    request_started_ = false;
    continue_sent_ = false;
  }
  if (!in_.empty()) {
    if (!request_started_) {
      request_started_ = true;
      request_deadline_ = std::chrono::steady_clock::now() +
                          absl::ToChronoNanoseconds(options_.request_timeout);
      ArmTimerAt(request_deadline_);
    }
    error_code ec;
    const size_t used = parser_->put(net::buffer(in_), ec);
    in_.erase(0, used);
    if (ec == http::error::need_more) {
      ec = {};
    } else if (ec == http::error::body_limit) {
      return Fail(413, "the request body is larger than the server accepts");
    } else if (ec == http::error::header_limit) {
      return Fail(431, "the request's headers are larger than allowed");
    } else if (ec) {
      return Fail(400, absl::StrCat("malformed HTTP request: ", ec.message()));
    }
    if (parser_->is_done()) return Dispatch();
    if (parser_->is_header_done() && !continue_sent_) {
      continue_sent_ = true;
      const auto expect = parser_->get().find(http::field::expect);
      if (expect != parser_->get().end() &&
          absl::EqualsIgnoreCase(View(expect->value()),
                                 "100-continue")) {
        outbox_ += "HTTP/1.1 100 Continue\r\n\r\n";
        Write();
      }
    }
  } else if (!request_started_) {
    ArmTimer(options_.idle_timeout);
  }
  Read();
}

void Session::Read() {
  if (reading_ || closed_) return;
  // The parser bounds what a request may hold; this bounds what waits
  // behind the request being answered.
  if (in_.size() > options_.max_header_bytes + options_.max_body_bytes +
                       kReadChunk) {
    return Close();
  }
  reading_ = true;
  auto on_read = [self = shared_from_this()](error_code ec, size_t bytes) {
    self->in_.append(self->read_buffer_.data(), bytes);
    self->OnRead(ec, bytes);
  };
  if (tls_) {
    tls_->async_read_some(net::buffer(read_buffer_), std::move(on_read));
  } else {
    socket_->async_read_some(net::buffer(read_buffer_), std::move(on_read));
  }
}

void Session::Handshake(bool over_capacity) {
  ArmTimer(options_.request_timeout);
  tls_->async_handshake(
      net::ssl::stream_base::server,
      [self = shared_from_this(), over_capacity](error_code ec) {
        self->DisarmTimer();
        if (!ec) {
          self->handshake_done_ = true;
          return self->Start(over_capacity);
        }
        if (ec.category() == net::error::get_ssl_category() &&
            ERR_GET_REASON(ec.value()) == SSL_R_HTTP_REQUEST) {
          // A plaintext client: tell it in words it can read, as plaintext.
          PD_LOG(INFO) << "HTTP TLS handshake failed: " << ec.message();
          auto answer = std::make_shared<const std::string>(ErrorResponse(
              400, "this port speaks HTTPS: use https:// (TLS)"));
          self->ArmTimer(self->options_.request_timeout);
          net::async_write(self->raw(), net::buffer(*answer),
                           [self, answer](error_code, size_t) { self->Close(); });
          return;
        }
        PD_LOG(INFO) << "HTTP TLS handshake failed: " << ec.message();
        self->Close();
      });
}

void Session::OnRead(error_code ec, size_t bytes) {
  reading_ = false;
  if (ec || bytes == 0) {
    // The client closed (or reset) the connection: a request being
    // answered has lost its reader.
    return Close();
  }
  if (busy_) {
    Read();  // Pipelined: parsed after this answer. Keep watching.
    return;
  }
  ParseOrRead();
}

void Session::Dispatch() {
  DisarmTimer();
  http::request<http::string_body> message = parser_->release();
  parser_.reset();
  keep_alive_ = message.keep_alive();
  HttpRequest request;
  request.method = std::string(View(message.method_string()));
  const absl::string_view target = View(message.target());
  const size_t question = target.find('?');
  request.path = std::string(target.substr(0, question));
  if (question != absl::string_view::npos) {
    request.query = std::string(target.substr(question + 1));
  }
  request.headers.reserve(std::distance(message.begin(), message.end()));
  for (const auto& field : message) {
    request.headers.emplace_back(
        absl::AsciiStrToLower(View(field.name_string())),
        std::string(View(field.value())));
  }
  request.body = std::move(message.body());
  busy_ = true;
  response_done_ = false;
  exchange_ = std::make_shared<Exchange>(server_, weak_from_this(),
                                         message.version() >= 11);
  current_exchange_ = exchange_.get();
  Read();  // Watches for the client going away while the answer is made.
  try {
    server_->handler(std::move(request), exchange_);
  } catch (const std::exception& e) {
    PD_LOG(ERROR) << "HTTP handler threw: " << e.what();
    exchange_->Respond(500, "application/json",
                       R"({"error":{"message":"internal error",)"
                       R"("type":"internal_error","param":null,"code":null}})",
                       {});
  }
}

void Session::Fail(int status, absl::string_view message) {
  parser_.reset();
  in_.clear();
  busy_ = true;
  keep_alive_ = false;
  current_exchange_ = nullptr;
  Queue(ErrorResponse(status, message), /*response_done=*/true);
}

void Session::Queue(std::string bytes, bool response_done) {
  if (closed_) return;
  outbox_ += bytes;
  if (response_done) response_done_ = true;
  if (outbox_.size() > options_.max_pending_event_bytes) {
    PD_LOG(WARNING) << "closing an HTTP connection whose client reads too "
                       "slowly ("
                    << outbox_.size() << " bytes waiting)";
    return Close();
  }
  Write();
}

void Session::Write() {
  if (write_in_flight_ || closed_) return;
  if (outbox_.empty()) {
    if (!busy_ || !response_done_) return;
    // The answer is out.
    busy_ = false;
    current_exchange_ = nullptr;
    exchange_.reset();
    if (!keep_alive_) return Close();
    return ParseOrRead();
  }
  write_in_flight_ = true;
  writing_.swap(outbox_);
  outbox_.clear();
  // A client that takes nothing for this long is gone.
  ArmTimer(options_.request_timeout);
  auto on_write = [self = shared_from_this()](error_code ec, size_t) {
    self->OnWrite(ec);
  };
  if (tls_) {
    net::async_write(*tls_, net::buffer(writing_), std::move(on_write));
  } else {
    net::async_write(*socket_, net::buffer(writing_), std::move(on_write));
  }
}

void Session::OnWrite(error_code ec) {
  write_in_flight_ = false;
  DisarmTimer();
  if (ec) return Close();
  // A "100 Continue" went out: the request's own deadline still holds.
  if (!busy_ && request_started_) ArmTimerAt(request_deadline_);
  writing_.clear();
  Write();
}

void Session::ArmTimer(absl::Duration after) {
  ArmTimerAt(std::chrono::steady_clock::now() +
             absl::ToChronoNanoseconds(after));
}

void Session::ArmTimerAt(std::chrono::steady_clock::time_point when) {
  timer_.expires_at(when);
  timer_.async_wait([self = shared_from_this()](error_code ec) {
    if (ec) return;  // Re-armed or cancelled.
    self->Close();
  });
}

void Session::Close() {
  if (closed_) return;
  closed_ = true;
  timer_.cancel();
  error_code ignored;
  // Under TLS without a close_notify: the client learns nothing more from
  // one, and a closing handshake could wait on a client that reads nothing.
  raw().shutdown(tcp::socket::shutdown_both, ignored);
  raw().close(ignored);
  if (exchange_ && !response_done_) exchange_->MarkGone();
  exchange_.reset();
  current_exchange_ = nullptr;
  server_->Unregister(this);
}

bool HttpServer::Impl::Register(const std::shared_ptr<Session>& session) {
  absl::MutexLock lock(&mu);
  if (closing) return false;
  sessions.emplace(session.get(), session);
  return true;
}

void HttpServer::Impl::Unregister(Session* session) {
  absl::MutexLock lock(&mu);
  sessions.erase(session);
}

void HttpServer::Impl::Accept() {
  acceptor.async_accept(
      net::make_strand(ioc), [this](error_code ec, tcp::socket socket) {
        if (ec) {
          if (ec == net::error::operation_aborted || !acceptor.is_open()) {
            return;  // Stopped.
          }
          // Out of descriptors, say: try again shortly rather than spin.
          PD_LOG(WARNING) << "HTTP accept failed: " << ec.message();
          accept_retry.expires_after(std::chrono::milliseconds(50));
          accept_retry.async_wait([this](error_code wait_ec) {
            if (!wait_ec && acceptor.is_open()) Accept();
          });
          return;
        } else {
          // Sessions share the Impl so a late exchange can still find it.
          std::shared_ptr<Impl> self = weak_self.lock();
          const bool over =
              connections.fetch_add(1) >= options.max_connections;
          socket.set_option(tcp::no_delay(true), ec);
          auto session = std::make_shared<Session>(self, std::move(socket),
                                                   TlsContext());
          if (!Register(session)) return;  // Stopping: it closes unused.
          net::post(session->executor(),
                    [session, over] { session->Start(over); });
        }
        Accept();
      });
}

std::shared_ptr<net::ssl::context> HttpServer::Impl::TlsContext() {
  if (options.tls == nullptr) return nullptr;
  const uint64_t generation = options.tls->generation();
  absl::MutexLock lock(&tls_mu);
  if (tls_context == nullptr || tls_generation != generation) {
    absl::StatusOr<std::shared_ptr<net::ssl::context>> fresh =
        MakeTlsContext(options.tls->pem());
    if (fresh.ok()) {
      tls_context = *std::move(fresh);
    } else {
      // Checked by TlsCertificates already; keep the context in use.
      PD_LOG(ERROR) << fresh.status();
    }
    tls_generation = generation;
  }
  return tls_context;
}

absl::StatusOr<std::unique_ptr<HttpServer>> HttpServer::Start(
    const Options& options, Handler handler) {
  if (options.threads < 1 || options.max_connections < 1 ||
      options.max_header_bytes < 1024 ||
      options.request_timeout <= absl::ZeroDuration() ||
      options.idle_timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError(
        "bad HTTP server options: threads and max_connections must be >= 1, "
        "max_header_bytes >= 1024, timeouts positive");
  }
  const size_t colon = options.listen.rfind(':');
  int port = 0;
  if (colon == std::string::npos ||
      !absl::SimpleAtoi(options.listen.substr(colon + 1), &port) || port < 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad HTTP listen address '", options.listen, "': want HOST:PORT"));
  }
  std::string host = options.listen.substr(0, colon);
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    host = host.substr(1, host.size() - 2);
  }
  error_code ec;
  const net::ip::address address = net::ip::make_address(
      host.empty() || host == "localhost" ? "127.0.0.1" : host, ec);
  if (ec) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bad HTTP listen address '", options.listen, "': ", ec.message()));
  }
  // Every open connection is a descriptor.
  RaiseOpenFileLimit();
  auto impl = std::make_shared<Impl>(options, std::move(handler));
  impl->weak_self = impl;
  if (options.tls != nullptr) {
    absl::MutexLock lock(&impl->tls_mu);
    absl::StatusOr<std::shared_ptr<net::ssl::context>> context =
        MakeTlsContext(options.tls->pem());
    if (!context.ok()) return context.status();
    impl->tls_context = *std::move(context);
    impl->tls_generation = options.tls->generation();
  }
  const tcp::endpoint endpoint(address, static_cast<uint16_t>(port));
  impl->acceptor.open(endpoint.protocol(), ec);
  if (!ec) impl->acceptor.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) impl->acceptor.bind(endpoint, ec);
  if (!ec) impl->acceptor.listen(net::socket_base::max_listen_connections, ec);
  if (ec) {
    return absl::UnavailableError(absl::StrCat(
        "cannot serve HTTP on ", options.listen, ": ", ec.message()));
  }
  impl->port = impl->acceptor.local_endpoint().port();
  impl->Accept();
  for (int i = 0; i < options.threads; ++i) {
    impl->threads.emplace_back([raw = impl.get()] { raw->ioc.run(); });
  }
  return std::unique_ptr<HttpServer>(new HttpServer(std::move(impl)));
}

HttpServer::HttpServer(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}

HttpServer::~HttpServer() { Stop(); }

int HttpServer::port() const { return impl_->port; }

int HttpServer::connections() const { return impl_->connections.load(); }

void HttpServer::Stop() {
  {
    absl::WriterMutexLock lock(&impl_->post_mu);
    if (impl_->stopped) return;
    impl_->stopped = true;
  }
  net::post(impl_->acceptor_strand, [impl = impl_.get()] {
    error_code ignored;
    impl->acceptor.close(ignored);
    impl->accept_retry.cancel();
  });
  std::vector<std::shared_ptr<Session>> sessions;
  {
    absl::MutexLock lock(&impl_->mu);
    impl_->closing = true;
    for (auto& [raw, weak] : impl_->sessions) {
      if (auto session = weak.lock()) sessions.push_back(std::move(session));
    }
  }
  for (auto& session : sessions) {
    net::post(session->executor(), [session] { session->Close(); });
  }
  sessions.clear();
  for (std::thread& thread : impl_->threads) thread.join();
  impl_->threads.clear();
}

}  // namespace pdserve
