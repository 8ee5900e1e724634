// HttpServer over real sockets: keep-alive, pipelining, chunked SSE, the
// bounds a client cannot talk past (headers, body, request time, slow
// clients), malformed input, and a client that goes away mid-answer.
#include "common/http_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <string>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/synchronization/notification.h"
#include "gtest/gtest.h"

namespace pdserve {
namespace {

// A blocking client socket with a receive timeout.
class Client {
 public:
  explicit Client(int port) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = connect(fd_, reinterpret_cast<sockaddr*>(&addr),
                         sizeof(addr)) == 0;
  }
  ~Client() { Close(); }
  bool connected() const { return connected_; }
  void Close() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

  bool Send(const std::string& bytes) {
    size_t sent = 0;
    while (sent < bytes.size()) {
      const ssize_t n =
          send(fd_, bytes.data() + sent, bytes.size() - sent, MSG_NOSIGNAL);
      if (n <= 0) return false;
      sent += n;
    }
    return true;
  }

  // Reads until `stop` is in what was read, the peer closes, or `timeout_ms`.
  std::string ReadUntil(const std::string& stop, int timeout_ms = 5000) {
    std::string out;
    const auto end =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (!absl::StrContains(out, stop)) {
      const int left = std::chrono::duration_cast<std::chrono::milliseconds>(
                           end - std::chrono::steady_clock::now())
                           .count();
      if (left <= 0) break;
      pollfd p{fd_, POLLIN, 0};
      if (poll(&p, 1, left) <= 0) break;
      char buf[4096];
      const ssize_t n = recv(fd_, buf, sizeof(buf), 0);
      if (n <= 0) {
        closed_ = true;
        break;
      }
      out.append(buf, n);
    }
    return out;
  }
  // True when the peer closed the connection within `timeout_ms`.
  bool WaitClosed(int timeout_ms) {
    ReadUntil("\x01never\x02", timeout_ms);
    return closed_;
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
  bool closed_ = false;
};

std::string Get(const std::string& path, bool close = false) {
  return absl::StrCat("GET ", path, " HTTP/1.1\r\nHost: x\r\n",
                      close ? "Connection: close\r\n" : "", "\r\n");
}

std::string Post(const std::string& path, const std::string& body) {
  return absl::StrCat("POST ", path,
                      " HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                      "\r\nContent-Length: ",
                      body.size(), "\r\n\r\n", body);
}

// Echoes method, path and body; /stream sends three events from another
// thread; /hold answers only when released and records the client leaving.
// The handler runs on the server's threads: what it shares with the test
// is under `mu` or handed over by a Notification.
struct TestHandler {
  std::atomic<int> gone{0};
  absl::Notification release;
  absl::Notification holding;  // `held` is set.
  absl::Mutex mu;
  std::shared_ptr<HttpExchange> held ABSL_GUARDED_BY(mu);
  std::vector<std::thread> threads ABSL_GUARDED_BY(mu);

  ~TestHandler() {
    if (!release.HasBeenNotified()) release.Notify();
    std::vector<std::thread> joining;
    {
      absl::MutexLock lock(&mu);
      joining.swap(threads);
    }
    for (auto& t : joining) t.join();
  }

  // The /hold exchange, once the handler has it (null after 5 s).
  std::shared_ptr<HttpExchange> WaitHeld() {
    if (!holding.WaitForNotificationWithTimeout(absl::Seconds(5))) return {};
    absl::MutexLock lock(&mu);
    return held;
  }

  HttpServer::Handler handler() {
    return [this](HttpRequest request, std::shared_ptr<HttpExchange> exchange) {
      absl::MutexLock lock(&mu);
      if (request.path == "/stream") {
        threads.emplace_back([exchange] {
          exchange->StartEvents();
          for (int i = 0; i < 3; ++i) exchange->SendEvent(absl::StrCat("e", i));
          exchange->SendEvent("[DONE]");
          exchange->EndEvents();
        });
        return;
      }
      if (request.path == "/hold") {
        exchange->OnClientGone([this] { gone.fetch_add(1); });
        held = exchange;
        threads.emplace_back([this, exchange] {
          release.WaitForNotification();
          exchange->StartEvents();
          exchange->SendEvent("late");
          exchange->EndEvents();
        });
        holding.Notify();
        return;
      }
      exchange->Respond(
          200, "text/plain",
          absl::StrCat(request.method, " ", request.path, " q=", request.query,
                       " auth=", request.Header("authorization"),
                       " body=", request.body));
    };
  }
};

class HttpServerTest : public ::testing::Test {
 protected:
  void StartServer(HttpServer::Options options = {}) {
    auto server = HttpServer::Start(options, handler_.handler());
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }
  TestHandler handler_;
  std::unique_ptr<HttpServer> server_;
};

TEST_F(HttpServerTest, KeepAliveServesSeveralRequestsOnOneConnection) {
  StartServer();
  Client c(server_->port());
  ASSERT_TRUE(c.connected());
  ASSERT_TRUE(c.Send(Get("/a?x=1")));
  std::string first = c.ReadUntil("q=x=1");
  EXPECT_TRUE(absl::StartsWith(first, "HTTP/1.1 200 OK\r\n")) << first;
  EXPECT_TRUE(absl::StrContains(first, "Connection: keep-alive")) << first;
  ASSERT_TRUE(c.Send(Post("/b", "{\"k\":1}")));
  EXPECT_TRUE(absl::StrContains(c.ReadUntil("{\"k\":1}"), "POST /b"));
  ASSERT_TRUE(c.Send(Get("/c", /*close=*/true)));
  EXPECT_TRUE(absl::StrContains(c.ReadUntil("GET /c"), "Connection: close"));
  EXPECT_TRUE(c.WaitClosed(2000));
}

TEST_F(HttpServerTest, PipelinedRequestsAreAnsweredInOrder) {
  StartServer();
  Client c(server_->port());
  ASSERT_TRUE(c.Send(Get("/one") + Post("/two", "2") + Get("/three")));
  const std::string all = c.ReadUntil("GET /three");
  const size_t one = all.find("GET /one");
  const size_t two = all.find("POST /two");
  const size_t three = all.find("GET /three");
  ASSERT_NE(one, std::string::npos) << all;
  ASSERT_NE(two, std::string::npos) << all;
  ASSERT_NE(three, std::string::npos) << all;
  EXPECT_LT(one, two);
  EXPECT_LT(two, three);
}

TEST_F(HttpServerTest, HeadersAreLowerCasedAndFound) {
  StartServer();
  Client c(server_->port());
  ASSERT_TRUE(c.Send(
      "GET /h HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k1\r\n\r\n"));
  EXPECT_TRUE(absl::StrContains(c.ReadUntil("auth=Bearer k1"),
                                "auth=Bearer k1"));
}

TEST_F(HttpServerTest, EventsStreamAsChunkedSse) {
  StartServer();
  Client c(server_->port());
  ASSERT_TRUE(c.Send(Get("/stream")));
  const std::string all = c.ReadUntil("0\r\n\r\n");
  EXPECT_TRUE(absl::StrContains(all, "Content-Type: text/event-stream"));
  EXPECT_TRUE(absl::StrContains(all, "Transfer-Encoding: chunked"));
  // Each event is one chunk: its size in hex, "data: e0\n\n".
  EXPECT_TRUE(absl::StrContains(all, "a\r\ndata: e0\n\n\r\n")) << all;
  EXPECT_TRUE(absl::StrContains(all, "data: e2\n\n"));
  EXPECT_TRUE(absl::StrContains(all, "data: [DONE]\n\n"));
  EXPECT_TRUE(absl::EndsWith(all, "0\r\n\r\n")) << all;
  // The connection serves the next request after the stream.
  ASSERT_TRUE(c.Send(Get("/after")));
  EXPECT_TRUE(absl::StrContains(c.ReadUntil("GET /after"), "GET /after"));
}

TEST_F(HttpServerTest, OversizedBodyIs413BeforeItIsRead) {
  HttpServer::Options options;
  options.max_body_bytes = 1000;
  StartServer(options);
  Client c(server_->port());
  ASSERT_TRUE(c.Send("POST /big HTTP/1.1\r\nHost: x\r\nContent-Length: "
                     "100000000\r\n\r\n"));
  const std::string reply = c.ReadUntil("}}");
  EXPECT_TRUE(absl::StartsWith(reply, "HTTP/1.1 413 ")) << reply;
  EXPECT_TRUE(absl::StrContains(reply, "\"error\""));
  EXPECT_TRUE(c.WaitClosed(2000));
}

TEST_F(HttpServerTest, HeaderFloodIs431) {
  HttpServer::Options options;
  options.max_header_bytes = 4096;
  StartServer(options);
  Client c(server_->port());
  std::string request = "GET / HTTP/1.1\r\nHost: x\r\n";
  for (int i = 0; i < 500; ++i) absl::StrAppend(&request, "X-H", i, ": v\r\n");
  request += "\r\n";
  c.Send(request);  // The server may close before taking it all.
  const std::string reply = c.ReadUntil("}}");
  EXPECT_TRUE(absl::StartsWith(reply, "HTTP/1.1 431 ")) << reply;
}

TEST_F(HttpServerTest, MalformedRequestIs400AndClosed) {
  StartServer();
  for (const std::string& bad :
       {std::string("NOT HTTP AT ALL\r\n\r\n"),
        std::string("GET / HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n"),
        std::string("GET / HTTP/1.1\r\nBad Header Line\r\n\r\n"),
        std::string("POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: "
                    "chunked\r\n\r\nzz\r\n")}) {
    Client c(server_->port());
    ASSERT_TRUE(c.Send(bad));
    const std::string reply = c.ReadUntil("}}");
    EXPECT_TRUE(absl::StartsWith(reply, "HTTP/1.1 400 ")) << bad << reply;
    EXPECT_TRUE(c.WaitClosed(2000)) << bad;
  }
}

TEST_F(HttpServerTest, ChunkedRequestBodyIsAccepted) {
  StartServer();
  Client c(server_->port());
  ASSERT_TRUE(c.Send("POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: "
                     "chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"));
  EXPECT_TRUE(absl::StrContains(c.ReadUntil("body=abcde"), "body=abcde"));
}

TEST_F(HttpServerTest, ExpectContinueGetsAnInterimResponse) {
  StartServer();
  Client c(server_->port());
  ASSERT_TRUE(c.Send("POST /e HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n"
                     "Expect: 100-continue\r\n\r\n"));
  EXPECT_TRUE(absl::StartsWith(c.ReadUntil("\r\n\r\n"),
                               "HTTP/1.1 100 Continue\r\n\r\n"));
  ASSERT_TRUE(c.Send("body"));
  EXPECT_TRUE(absl::StrContains(c.ReadUntil("body=body"), "body=body"));
}

TEST_F(HttpServerTest, SlowLorisIsDisconnectedAtTheRequestTimeout) {
  HttpServer::Options options;
  options.request_timeout = absl::Milliseconds(500);
  StartServer(options);
  Client c(server_->port());
  const auto start = std::chrono::steady_clock::now();
  // A header line every 100 ms never completes the request in time.
  bool open = true;
  for (int i = 0; i < 30 && open; ++i) {
    open = c.Send(i == 0 ? std::string("GET / HTTP/1.1\r\n")
                         : absl::StrCat("X-", i, ": v\r\n"));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(c.WaitClosed(3000));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(4));
}

TEST_F(HttpServerTest, IdleKeepAliveConnectionIsClosed) {
  HttpServer::Options options;
  options.idle_timeout = absl::Milliseconds(300);
  StartServer(options);
  Client c(server_->port());
  ASSERT_TRUE(c.Send(Get("/x")));
  c.ReadUntil("GET /x");
  EXPECT_TRUE(c.WaitClosed(3000));
  // The connection's last handlers run after the close.
  for (int i = 0; i < 100 && server_->connections() > 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(server_->connections(), 0);
}

TEST_F(HttpServerTest, ClientLeavingMidAnswerIsReported) {
  StartServer();
  std::shared_ptr<HttpExchange> held;
  {
    Client c(server_->port());
    ASSERT_TRUE(c.Send(Get("/hold")));
    held = handler_.WaitHeld();
    ASSERT_TRUE(held);
    EXPECT_FALSE(held->client_gone());
  }  // The client closes its socket.
  for (int i = 0; i < 200 && handler_.gone.load() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(handler_.gone.load(), 1);
  EXPECT_TRUE(held->client_gone());
  // Answering a departed client is harmless.
  handler_.release.Notify();
}

TEST_F(HttpServerTest, ConnectionsBeyondTheLimitGet503) {
  HttpServer::Options options;
  options.max_connections = 2;
  StartServer(options);
  Client a(server_->port()), b(server_->port());
  ASSERT_TRUE(a.Send(Get("/a")));
  ASSERT_TRUE(b.Send(Get("/b")));
  a.ReadUntil("GET /a");
  b.ReadUntil("GET /b");
  Client c(server_->port());
  EXPECT_TRUE(absl::StartsWith(c.ReadUntil("}}"), "HTTP/1.1 503 "));
}

TEST_F(HttpServerTest, ExchangeOutlivingTheServerDoesNothing) {
  StartServer();
  Client c(server_->port());
  ASSERT_TRUE(c.Send(Get("/hold")));
  ASSERT_TRUE(handler_.WaitHeld());
  server_->Stop();
  EXPECT_TRUE(c.WaitClosed(2000));
  handler_.release.Notify();  // The held exchange answers a stopped server.
}

TEST(HttpServerOptionsTest, BadListenAddressIsRefused) {
  HttpServer::Options options;
  options.listen = "no-port";
  EXPECT_EQ(HttpServer::Start(options, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
  options.listen = "256.1.1.1:0";
  EXPECT_EQ(HttpServer::Start(options, nullptr).status().code(),
            absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace pdserve
