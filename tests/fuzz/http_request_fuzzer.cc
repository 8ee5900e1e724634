// libFuzzer target: the bytes a client may send to pd-router's HTTP port.
// The first byte picks the path:
//   even: the rest is an OpenAI request body, parsed for /v1/completions and
//         /v1/chat/completions (ParseOpenAiRequest), as the router does;
//   odd:  the rest goes down a real socket into a live HttpServer (the
//         router's, Beast's parser and our bounds) whose handler parses the
//         body the same way and answers; the client then closes.
// Anything but a clean answer or a clean close is a finding: a crash, a
// sanitizer report, a hang (no close within 10 s, or libFuzzer's -timeout),
// a leak.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>

#include "common/http_server.h"
#include "router/openai_api.h"
#include "tests/fuzz/socket_exchange.h"

namespace {

using pdserve::HttpExchange;
using pdserve::HttpRequest;
using pdserve::HttpServer;
using pdserve::OpenAiEndpoint;

void ParseBoth(const std::string& body) {
  for (OpenAiEndpoint endpoint : {OpenAiEndpoint::kCompletions,
                                  OpenAiEndpoint::kChatCompletions}) {
    auto parsed = pdserve::ParseOpenAiRequest(endpoint, body);
    if (!parsed.ok()) {
      // Errors must always make a well-formed error object.
      const pdserve::OpenAiError error =
          pdserve::MakeOpenAiError(parsed.status());
      if (error.http_status != 400 || error.body.empty()) __builtin_trap();
    }
  }
}

HttpServer& Server() {
  static HttpServer* const server = [] {
    HttpServer::Options options;
    options.max_header_bytes = 4096;
    options.max_body_bytes = 64 << 10;
    options.request_timeout = absl::Milliseconds(300);
    options.idle_timeout = absl::Milliseconds(300);
    auto started = HttpServer::Start(
        options, [](HttpRequest request, std::shared_ptr<HttpExchange> e) {
          ParseBoth(request.body);
          if (request.path == "/stream") {
            e->StartEvents();
            e->SendEvent(request.body.substr(0, 64));
            e->EndEvents();
          } else {
            e->Respond(200, "text/plain", request.path);
          }
        });
    if (!started.ok()) __builtin_trap();
    return started->release();
  }();
  return *server;
}

void SendToServer(const uint8_t* data, size_t size) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(Server().port());
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return;
  }
  // Every input must end with the server's close, within its 300 ms
  // timeouts; ten seconds without it is a hang.
  pdserve::fuzz::ExchangeUntilClosed(
      fd, std::as_bytes(std::span(data, size)), std::chrono::seconds(10));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  if (data[0] % 2 == 0) {
    ParseBoth(std::string(reinterpret_cast<const char*>(data + 1), size - 1));
  } else {
    SendToServer(data + 1, size - 1);
  }
  return 0;
}
