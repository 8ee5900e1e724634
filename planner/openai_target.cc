// The openai target of loadgen.h: streamed POST /v1/completions on Boost.Beast
// (HTTP/1.1 over Asio), every stream a chain of asynchronous operations on
// one I/O thread, keep-alive connections pooled. Each read completion is
// stamped with the steady clock before its bytes go to the
// OpenAiStreamReader (openai_stream.h), which applies the token rule.
#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/strip.h"
#include "absl/synchronization/mutex.h"
#include "boost/asio/connect.hpp"
#include "boost/asio/executor_work_guard.hpp"
#include "boost/asio/io_context.hpp"
#include "boost/asio/ip/tcp.hpp"
#include "boost/asio/post.hpp"
#include "boost/asio/steady_timer.hpp"
#include "boost/beast/core/flat_buffer.hpp"
#include "boost/beast/http/buffer_body.hpp"
#include "boost/beast/http/error.hpp"
#include "boost/beast/http/parser.hpp"
#include "boost/beast/http/read.hpp"
#include "boost/beast/http/string_body.hpp"
#include "boost/beast/http/write.hpp"
#include "nlohmann/json.hpp"
#include "planner/load_targets.h"
#include "planner/openai_stream.h"

namespace pdserve::planner {
namespace {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace http = boost::beast::http;
using tcp = asio::ip::tcp;
using error_code = boost::system::error_code;

class OpenAiTarget;

// One request: connect (or take a pooled connection), write, read the
// response as it comes. Runs on the target's I/O thread only, so it needs
// no lock. Kept alive by the shared_ptrs its pending handlers hold.
class HttpStream : public std::enable_shared_from_this<HttpStream> {
 public:
  HttpStream(OpenAiTarget* target, std::string body, SteadyTime origin,
             RequestRecord* record, std::function<void()> done);

  void Begin();

 private:
  void Attempt(bool may_reuse);
  void OnConnect(const error_code& ec);
  void Send();
  void OnWrite(const error_code& ec);
  void OnHeader(const error_code& ec);
  void ReadBody();
  void OnBody(error_code ec);
  void Complete();
  // A failure before any byte of the response on a pooled connection (the
  // server closed it while idle) tries once more on a new one.
  bool RetryFresh();
  void End(const absl::Status& status);

  OpenAiTarget* const target_;
  const SteadyTime origin_;
  RequestRecord* const record_;
  std::function<void()> done_;
  http::request<http::string_body> request_;
  std::optional<tcp::socket> socket_;
  bool reused_ = false;
  beast::flat_buffer buffer_;
  std::optional<http::response_parser<http::buffer_body>> parser_;
  char body_[16 * 1024];
  int http_status_ = 0;
  std::string error_body_;
  OpenAiStreamReader reader_;
  asio::steady_timer deadline_;
  bool ended_ = false;
};

class OpenAiTarget final : public LoadTarget {
 public:
  OpenAiTarget(const TargetOptions& options, std::string host,
               std::vector<tcp::endpoint> endpoints)
      : options_(options),
        host_(std::move(host)),
        endpoints_(std::move(endpoints)),
        work_(asio::make_work_guard(io_)),
        thread_([this] { io_.run(); }) {}

  ~OpenAiTarget() override {
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](int64_t* n) { return *n == 0; }, &active_));
    }
    // Every stream ended; what is left on the I/O thread are the
    // completions of cancelled operations and the idle sockets.
    asio::post(io_, [this] { idle_.clear(); });
    work_.reset();
    thread_.join();
  }

  void Start(TargetRequest request, RequestRecord* record,
             std::function<void()> done) override {
    nlohmann::json body = {
        {"prompt", std::move(request.prompt)},
        {"max_tokens", request.max_tokens},
        {"ignore_eos", true},
        {"temperature", 0},
        {"stream", true},
        {"stream_options", {{"include_usage", true}}},
    };
    if (options_.per_chunk_usage) {
      body["stream_options"]["continuous_usage_stats"] = true;
    }
    if (!options_.model.empty()) body["model"] = options_.model;
    {
      absl::MutexLock lock(&mu_);
      ++active_;
    }
    auto stream = std::make_shared<HttpStream>(
        this, body.dump(), request.origin, record, std::move(done));
    asio::post(io_, [stream] { stream->Begin(); });
  }

 private:
  friend class HttpStream;

  void StreamEnded() {
    absl::MutexLock lock(&mu_);
    --active_;
  }

  const TargetOptions options_;
  const std::string host_;  // The Host header.
  const std::vector<tcp::endpoint> endpoints_;
  asio::io_context io_;
  asio::executor_work_guard<asio::io_context::executor_type> work_;
  // Keep-alive connections between requests; the I/O thread's alone.
  std::vector<tcp::socket> idle_;
  absl::Mutex mu_;
  int64_t active_ ABSL_GUARDED_BY(mu_) = 0;
  std::thread thread_;  // Last: it runs io_ from construction.
};

HttpStream::HttpStream(OpenAiTarget* target, std::string body,
                       SteadyTime origin, RequestRecord* record,
                       std::function<void()> done)
    : target_(target),
      origin_(origin),
      record_(record),
      done_(std::move(done)),
      reader_(record, origin),
      deadline_(target->io_) {
  request_.method(http::verb::post);
  request_.target("/v1/completions");
  request_.version(11);
  request_.set(http::field::host, target->host_);
  request_.set(http::field::content_type, "application/json");
  request_.set(http::field::accept, "text/event-stream");
  if (!target->options_.api_key.empty()) {
    request_.set(http::field::authorization,
                 "Bearer " + target->options_.api_key);
  }
  request_.keep_alive(true);
  request_.body() = std::move(body);
  request_.prepare_payload();
}

void HttpStream::Begin() {
  deadline_.expires_after(std::chrono::nanoseconds(
      absl::ToInt64Nanoseconds(target_->options_.request_timeout)));
  deadline_.async_wait([self = shared_from_this()](const error_code& ec) {
    if (ec) return;  // Cancelled: the stream ended.
    self->End(absl::DeadlineExceededError(absl::StrCat(
        "no end of the stream within the request timeout, ",
        absl::FormatDuration(self->target_->options_.request_timeout))));
  });
  Attempt(/*may_reuse=*/true);
}

void HttpStream::Attempt(bool may_reuse) {
  if (may_reuse && !target_->idle_.empty()) {
    socket_.emplace(std::move(target_->idle_.back()));
    target_->idle_.pop_back();
    reused_ = true;
    Send();
    return;
  }
  reused_ = false;
  socket_.emplace(target_->io_);
  asio::async_connect(
      *socket_, target_->endpoints_,
      [self = shared_from_this()](const error_code& ec, const tcp::endpoint&) {
        self->OnConnect(ec);
      });
}

void HttpStream::OnConnect(const error_code& ec) {
  if (ended_) return;
  if (ec) {
    End(absl::UnavailableError(absl::StrCat(
        "cannot connect to ", target_->options_.address, ": ", ec.message())));
    return;
  }
  error_code ignored;
  socket_->set_option(tcp::no_delay(true), ignored);
  Send();
}

void HttpStream::Send() {
  http::async_write(*socket_, request_,
                    [self = shared_from_this()](const error_code& ec, size_t) {
                      self->OnWrite(ec);
                    });
}

void HttpStream::OnWrite(const error_code& ec) {
  if (ended_) return;
  if (ec) {
    if (RetryFresh()) return;
    End(absl::UnavailableError(
        absl::StrCat("sending the request: ", ec.message())));
    return;
  }
  buffer_.clear();
  parser_.emplace();
  parser_->body_limit(std::numeric_limits<std::uint64_t>::max());
  http::async_read_header(
      *socket_, buffer_, *parser_,
      [self = shared_from_this()](const error_code& ec, size_t) {
        self->OnHeader(ec);
      });
}

void HttpStream::OnHeader(const error_code& ec) {
  if (ended_) return;
  if (ec) {
    if (RetryFresh()) return;
    End(absl::UnavailableError(
        absl::StrCat("reading the response's header: ", ec.message())));
    return;
  }
  http_status_ = parser_->get().result_int();
  if (parser_->is_done()) {
    Complete();
    return;
  }
  ReadBody();
}

void HttpStream::ReadBody() {
  parser_->get().body().data = body_;
  parser_->get().body().size = sizeof(body_);
  http::async_read_some(
      *socket_, buffer_, *parser_,
      [self = shared_from_this()](error_code ec, size_t) { self->OnBody(ec); });
}

void HttpStream::OnBody(error_code ec) {
  // Stamped before anything else: this is when these bytes arrived.
  const SteadyTime now = std::chrono::steady_clock::now();
  if (ended_) return;
  if (ec == http::error::need_buffer) ec = {};
  const size_t produced = sizeof(body_) - parser_->get().body().size;
  if (http_status_ == 200) {
    reader_.Feed(std::string_view(body_, produced), now);
  } else if (error_body_.size() < 64 * 1024) {
    error_body_.append(body_, produced);
  }
  if (ec) {
    End(absl::UnavailableError(
        absl::StrCat("the connection failed mid-response after ",
                     record_->token_s.size(), " tokens: ", ec.message())));
    return;
  }
  if (parser_->is_done()) {
    Complete();
    return;
  }
  ReadBody();
}

void HttpStream::Complete() {
  absl::Status status;
  if (http_status_ == 200) {
    status = reader_.Finish();
  } else {
    status = HttpErrorStatus(http_status_, error_body_);
  }
  // Back to the pool, unless the server closes it or the stream is not
  // known to have ended cleanly.
  if (parser_->keep_alive() && (http_status_ != 200 || reader_.done())) {
    target_->idle_.push_back(std::move(*socket_));
    socket_.reset();
  }
  End(status);
}

bool HttpStream::RetryFresh() {
  if (!reused_) return false;
  error_code ignored;
  socket_->close(ignored);
  Attempt(/*may_reuse=*/false);
  return true;
}

void HttpStream::End(const absl::Status& status) {
  if (ended_) return;
  ended_ = true;
  const SteadyTime now = std::chrono::steady_clock::now();
  deadline_.cancel();
  if (socket_.has_value()) {
    error_code ignored;
    socket_->close(ignored);  // Its pending operations complete, cancelled.
  }
  // The reader's Finish, when it ran, put every counted token in token_s.
  record_->output_tokens = static_cast<int32_t>(record_->token_s.size());
  record_->end_s = std::chrono::duration<double>(now - origin_).count();
  record_->outcome = absl::StatusCodeToString(status.code());
  record_->error = std::string(status.message());
  std::function<void()> done = std::move(done_);
  OpenAiTarget* target = target_;
  done();
  target->StreamEnded();
}

// "host:port", "[v6]:port", with an optional http:// in front.
absl::StatusOr<std::pair<std::string, std::string>> SplitAddress(
    absl::string_view address) {
  if (absl::StartsWith(address, "https://")) {
    return absl::InvalidArgumentError(
        "the openai target speaks plain HTTP; terminate TLS in front of it or "
        "give http://host:port");
  }
  absl::ConsumePrefix(&address, "http://");
  absl::ConsumeSuffix(&address, "/");
  const size_t colon = address.rfind(':');
  int port = 0;
  if (colon == absl::string_view::npos || colon == 0 ||
      !absl::SimpleAtoi(address.substr(colon + 1), &port) || port <= 0 ||
      port > 65535) {
    return absl::InvalidArgumentError(absl::StrCat(
        "address '", address, "' is not host:port (e.g. 127.0.0.1:8000)"));
  }
  absl::string_view host = address.substr(0, colon);
  if (absl::StartsWith(host, "[") && absl::EndsWith(host, "]")) {
    host = host.substr(1, host.size() - 2);
  }
  return std::make_pair(std::string(host),
                        std::string(address.substr(colon + 1)));
}

}  // namespace

absl::StatusOr<std::unique_ptr<LoadTarget>> MakeOpenAiTarget(
    const TargetOptions& options) {
  auto split = SplitAddress(options.address);
  if (!split.ok()) return split.status();
  asio::io_context io;
  tcp::resolver resolver(io);
  error_code ec;
  const auto results = resolver.resolve(split->first, split->second, ec);
  if (ec || results.empty()) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve '", split->first, "': ", ec.message()));
  }
  std::vector<tcp::endpoint> endpoints;
  for (const auto& r : results) endpoints.push_back(r.endpoint());
  std::string host = absl::StrCat(split->first, ":", split->second);
  return std::make_unique<OpenAiTarget>(options, std::move(host),
                                        std::move(endpoints));
}

}  // namespace pdserve::planner
