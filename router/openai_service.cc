#include "router/openai_service.h"

#include <optional>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/random/random.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "common/log.h"
#include "engine/tokenizer.h"
#include "nlohmann/json.hpp"
#include "router/api_keys.h"
#include "router/etcd_discovery.h"
#include "router/openai_api.h"
#include "router/orchestrator.h"
#include "router/router_metrics.h"
#include "router/served_model.h"
#include "router/worker_registry.h"

namespace pdserve {
namespace {

using nlohmann::json;

constexpr absl::string_view kJson = "application/json";

void RespondError(HttpExchange& exchange, const absl::Status& status) {
  const OpenAiError error = MakeOpenAiError(status);
  std::vector<std::pair<std::string, std::string>> headers;
  if (error.http_status == 429) headers.emplace_back("Retry-After", "1");
  if (error.http_status == 401) {
    headers.emplace_back("WWW-Authenticate", "Bearer");
  }
  exchange.Respond(error.http_status, std::string(kJson), error.body,
                   std::move(headers));
}

std::string RandomId(absl::string_view prefix) {
  static absl::BitGen* const gen = new absl::BitGen();
  static absl::Mutex mu(absl::kConstInit);
  uint64_t a, b;
  {
    absl::MutexLock lock(&mu);
    a = absl::Uniform<uint64_t>(*gen);
    b = absl::Uniform<uint64_t>(*gen);
  }
  return absl::StrCat(prefix, absl::Hex(a, absl::kZeroPad16),
                      absl::Hex(b, absl::kZeroPad16));
}

// One HTTP generation request: one orchestrator run per prompt, whose
// messages become OpenAI chunks or one whole response.
class OpenAiCall : public std::enable_shared_from_this<OpenAiCall> {
 public:
  OpenAiCall(const OpenAiService::Deps& deps, OpenAiRequest request,
             std::shared_ptr<HttpExchange> exchange, std::string id)
      : deps_(deps),
        request_(std::move(request)),
        exchange_(std::move(exchange)),
        started_(absl::Now()),
        deadline_(started_ + deps.request_deadline),
        writer_(request_, std::move(id), absl::ToUnixSeconds(started_),
                deps.model->tokenizer()),
        record_(started_, *deps.metrics) {}

  OpenAiResponseWriter& writer() { return writer_; }

  // Starts every prompt's run.
  void Start() {
    std::weak_ptr<OpenAiCall> weak = weak_from_this();
    exchange_->OnClientGone([weak] {
      if (auto self = weak.lock()) self->Cancel();
    });
    {
      absl::MutexLock lock(&mu_);
      remaining_ = static_cast<int>(request_.prompts.size());
    }
    for (size_t i = 0; i < request_.prompts.size(); ++i) {
      std::shared_ptr<RunningRequest> running = deps_.orchestrator->Start(
          request_.prompts[i],
          std::make_shared<PromptStream>(shared_from_this(), i));
      bool failed;
      {
        absl::MutexLock lock(&mu_);
        running_.push_back(running);
        failed = !first_error_.ok();
      }
      // A prompt that failed (or a client gone) cancelled those before;
      // this one too.
      if (failed) running->Cancel();
    }
  }

  void Cancel() {
    std::vector<std::shared_ptr<RunningRequest>> running;
    {
      absl::MutexLock lock(&mu_);
      RecordError(absl::CancelledError("the client went away"));
      running = running_;
    }
    for (auto& r : running) r->Cancel();
  }

 private:
  // One prompt's stream: its messages and its end go to the call.
  class PromptStream final : public GenerateStream {
   public:
    PromptStream(std::shared_ptr<OpenAiCall> call, int index)
        : call_(std::move(call)), index_(index) {}
    absl::Time deadline() const override { return call_->deadline_; }
    void Send(v1::GenerateResponse message) override {
      call_->OnMessage(index_, message);
    }
    void End(const absl::Status& status) override { call_->PromptDone(status); }

   private:
    const std::shared_ptr<OpenAiCall> call_;
    const int index_;
  };

  void OnMessage(int prompt_index, const v1::GenerateResponse& message) {
    absl::MutexLock lock(&mu_);
    if (finished_) return;
    record_.Sent(message);
    if (!request_.stream) {
      writer_.Add(prompt_index, message);
      return;
    }
    if (!events_started_) {
      events_started_ = true;
      exchange_->StartEvents();
    }
    const std::string chunk = writer_.StreamChunk(prompt_index, message);
    if (!chunk.empty()) exchange_->SendEvent(chunk);
  }

  void PromptDone(const absl::Status& status) {
    std::vector<std::shared_ptr<RunningRequest>> to_cancel;
    {
      absl::MutexLock lock(&mu_);
      if (!status.ok()) {
        RecordError(status);
        to_cancel = running_;  // One prompt failed: the request has.
      }
      --remaining_;
      if (remaining_ == 0) {
        FinishLocked();
        running_.clear();
      }
    }
    for (auto& r : to_cancel) r->Cancel();
  }

  void RecordError(const absl::Status& status) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (first_error_.ok()) first_error_ = status;
  }

  void FinishLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (finished_) return;
    finished_ = true;
    record_.Finish("http", first_error_);
    if (!first_error_.ok()) {
      if (absl::IsCancelled(first_error_) && exchange_->client_gone()) return;
      if (events_started_) {
        // The status line went out: the error travels as an event, as
        // OpenAI and vLLM send it.
        exchange_->SendEvent(MakeOpenAiError(first_error_).body);
        exchange_->SendEvent("[DONE]");
        exchange_->EndEvents();
      } else {
        RespondError(*exchange_, first_error_);
      }
      return;
    }
    if (!request_.stream) {
      exchange_->Respond(200, std::string(kJson), writer_.Whole());
      return;
    }
    if (!events_started_) exchange_->StartEvents();
    if (std::string usage = writer_.UsageChunk(); !usage.empty()) {
      exchange_->SendEvent(usage);
    }
    exchange_->SendEvent("[DONE]");
    exchange_->EndEvents();
  }

  const OpenAiService::Deps& deps_;
  const OpenAiRequest request_;
  const std::shared_ptr<HttpExchange> exchange_;
  const absl::Time started_;
  const absl::Time deadline_;

  absl::Mutex mu_;
  OpenAiResponseWriter writer_ ABSL_GUARDED_BY(mu_);
  // The prompts' runs, until the last one ends.
  std::vector<std::shared_ptr<RunningRequest>> running_ ABSL_GUARDED_BY(mu_);
  int remaining_ ABSL_GUARDED_BY(mu_) = 0;
  absl::Status first_error_ ABSL_GUARDED_BY(mu_);
  bool events_started_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  RequestRecord record_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

OpenAiService::OpenAiService(Deps deps)
    : deps_(std::move(deps)), created_(absl::ToUnixSeconds(absl::Now())) {}

void OpenAiService::Handle(HttpRequest request,
                           std::shared_ptr<HttpExchange> exchange) {
  const std::string& path = request.path;
  const bool get = request.method == "GET";
  const bool post = request.method == "POST";
  if (path == "/health") {
    if (!get) return RespondError(*exchange, absl::InvalidArgumentError("use GET"));
    const bool serving = deps_.registry->healthy_decode() > 0;
    const v1::Discovery discovery = DiscoveryStatus(deps_.discovery);
    nlohmann::json d = {{"source", discovery.source()}, {"connected", discovery.connected()}};
    if (!discovery.error().empty()) d["error"] = discovery.error();
    if (!discovery.since().empty()) d["since"] = discovery.since();
    exchange->Respond(
        serving ? 200 : 503, std::string(kJson),
        DumpJson({{"status", serving ? "ok" : "unavailable"},
                  {"prefill_workers", deps_.registry->healthy_prefill()},
                  {"decode_workers", deps_.registry->healthy_decode()},
                  {"discovery", std::move(d)}}));
    return;
  }
  if (path == "/metrics") {
    exchange->Respond(200, "text/plain; version=0.0.4; charset=utf-8",
                      deps_.metrics->Exposition());
    return;
  }
  const bool models = path == "/v1/models";
  const bool completions = path == "/v1/completions";
  const bool chat = path == "/v1/chat/completions";
  if (!models && !completions && !chat) {
    return RespondError(
        *exchange, absl::NotFoundError(absl::StrCat(
                       "no route ", request.method, " ", path,
                       "; this server has /v1/completions, "
                       "/v1/chat/completions, /v1/models, /health, /metrics")));
  }
  if (absl::Status auth = CheckApiKey(request); !auth.ok()) {
    return RespondError(*exchange, auth);
  }
  if (models) {
    if (!get) {
      return RespondError(*exchange,
                          absl::InvalidArgumentError("/v1/models takes GET"));
    }
    const ServedModel& model = *deps_.model;
    json card = {{"id", model.name()},
                 {"object", "model"},
                 {"created", created_},
                 {"owned_by", "pdserve"},
                 {"root", model.spec()},
                 {"max_model_len", model.context_length()}};
    exchange->Respond(200, std::string(kJson),
                      DumpJson({{"object", "list"},
                                {"data", json::array({std::move(card)})}}));
    return;
  }
  if (!post) {
    return RespondError(*exchange,
                        absl::InvalidArgumentError(absl::StrCat(
                            path, " takes POST with a JSON body")));
  }
  Generate(chat, std::move(request), std::move(exchange));
}

absl::Status OpenAiService::CheckApiKey(const HttpRequest& request) const {
  if (deps_.api_keys == nullptr) return absl::OkStatus();
  const absl::string_view header = request.Header("authorization");
  return deps_.api_keys->Check(std::string_view(header.data(), header.size()));
}

void OpenAiService::Generate(bool chat, HttpRequest request,
                             std::shared_ptr<HttpExchange> exchange) {
  absl::StatusOr<OpenAiRequest> parsed = ParseOpenAiRequest(
      chat ? OpenAiEndpoint::kChatCompletions : OpenAiEndpoint::kCompletions,
      request.body);
  if (!parsed.ok()) return RespondError(*exchange, parsed.status());
  const ServedModel& model = *deps_.model;
  if (!parsed->model.empty() && parsed->model != model.name()) {
    return RespondError(
        *exchange,
        absl::NotFoundError(absl::StrCat("the model '", parsed->model,
                                         "' does not exist; this server "
                                         "serves '",
                                         model.name(), "'")));
  }
  if (parsed->model.empty()) parsed->model = model.name();
  for (v1::GenerateRequest& prompt : parsed->prompts) {
    prompt.set_model(model.name());
  }
  if (chat) {
    absl::StatusOr<std::string> rendered = model.RenderChat(
        parsed->messages, parsed->tools, parsed->add_generation_prompt,
        parsed->chat_template_kwargs);
    if (!rendered.ok()) return RespondError(*exchange, rendered.status());
    parsed->prompts[0].set_text(*std::move(rendered));
  }

  // Echo needs each prompt's text and tokens; chat without max_tokens the
  // prompt's length.
  // Logprobs too: a token's text depends on the one before it.
  const bool need_tokens = parsed->echo || parsed->max_tokens_from_context ||
                           parsed->logprobs.has_value();
  std::vector<std::pair<std::string, std::vector<int32_t>>> prompt_texts;
  if (need_tokens) {
    const Tokenizer* tokenizer = model.tokenizer();
    for (const v1::GenerateRequest& prompt : parsed->prompts) {
      std::string text;
      std::vector<int32_t> ids;
      if (prompt.has_text()) {
        text = prompt.text();
        if (tokenizer != nullptr) {
          absl::StatusOr<std::vector<int32_t>> encoded = tokenizer->Encode(
              text, prompt.add_special_tokens());
          if (!encoded.ok()) return RespondError(*exchange, encoded.status());
          ids = *std::move(encoded);
        }
      } else {
        ids.assign(prompt.token_ids().ids().begin(),
                   prompt.token_ids().ids().end());
        if (tokenizer != nullptr) {
          absl::StatusOr<std::string> decoded =
              tokenizer->Decode(ids, /*skip_special_tokens=*/false);
          // Ids outside the vocabulary fail validation with a clear message.
          if (decoded.ok()) text = *std::move(decoded);
        }
      }
      prompt_texts.emplace_back(std::move(text), std::move(ids));
    }
  }
  if (parsed->max_tokens_from_context) {
    const int64_t room = static_cast<int64_t>(model.context_length()) -
                         static_cast<int64_t>(prompt_texts[0].second.size());
    // Too long a prompt leaves no room: validation then says so.
    parsed->prompts[0].set_max_tokens(room < 1 ? 1 : room);
  }

  auto call = std::make_shared<OpenAiCall>(
      deps_, *std::move(parsed), exchange,
      RandomId(chat ? "chatcmpl-" : "cmpl-"));
  for (size_t i = 0; i < prompt_texts.size(); ++i) {
    call->writer().SetPrompt(static_cast<int>(i),
                             std::move(prompt_texts[i].first),
                             std::move(prompt_texts[i].second));
  }
  call->Start();
}

}  // namespace pdserve
