#include "planner/openai_stream.h"

#include <chrono>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace pdserve::planner {
namespace {

using json = nlohmann::json;

absl::StatusCode CodeOfHttpStatus(int http_status) {
  switch (http_status) {
    case 400:
      return absl::StatusCode::kInvalidArgument;
    case 401:
      return absl::StatusCode::kUnauthenticated;
    case 403:
      return absl::StatusCode::kPermissionDenied;
    case 404:
      return absl::StatusCode::kNotFound;
    case 408:
    case 504:
      return absl::StatusCode::kDeadlineExceeded;
    case 429:
      return absl::StatusCode::kResourceExhausted;
    case 499:
      return absl::StatusCode::kCancelled;
    case 501:
      return absl::StatusCode::kUnimplemented;
    case 502:
    case 503:
      return absl::StatusCode::kUnavailable;
    default:
      return http_status >= 500 ? absl::StatusCode::kInternal
                                : absl::StatusCode::kFailedPrecondition;
  }
}

// pd-router's and OpenAI's error types.
absl::StatusCode CodeOfErrorType(std::string_view type) {
  if (type == "invalid_request_error")
    return absl::StatusCode::kInvalidArgument;
  if (type == "authentication_error") return absl::StatusCode::kUnauthenticated;
  if (type == "permission_error") return absl::StatusCode::kPermissionDenied;
  if (type == "not_found_error") return absl::StatusCode::kNotFound;
  if (type == "rate_limit_error") return absl::StatusCode::kResourceExhausted;
  if (type == "service_unavailable") return absl::StatusCode::kUnavailable;
  if (type == "timeout") return absl::StatusCode::kDeadlineExceeded;
  if (type == "cancelled") return absl::StatusCode::kCancelled;
  return absl::StatusCode::kInternal;
}

// The status of an OpenAI error object {"message", "type", "code"}.
absl::Status StatusOfErrorObject(const json& error, int http_status) {
  std::string message = error.dump();
  if (auto m = error.find("message"); m != error.end() && m->is_string()) {
    message = m->get<std::string>();
  }
  absl::StatusCode code = absl::StatusCode::kUnknown;
  if (auto c = error.find("code"); c != error.end() && c->is_number_integer()) {
    code = CodeOfHttpStatus(c->get<int>());
  } else if (http_status != 0) {
    code = CodeOfHttpStatus(http_status);
  } else if (auto t = error.find("type"); t != error.end() && t->is_string()) {
    code = CodeOfErrorType(t->get<std::string>());
  }
  return absl::Status(code, message);
}

// The text a completion (`text`) or chat (`delta.content`) choice brings.
std::string_view ChoiceText(const json& choice) {
  if (!choice.is_object()) return {};
  if (auto t = choice.find("text"); t != choice.end() && t->is_string()) {
    return t->get_ref<const std::string&>();
  }
  if (auto d = choice.find("delta"); d != choice.end() && d->is_object()) {
    if (auto c = d->find("content"); c != d->end() && c->is_string()) {
      return c->get_ref<const std::string&>();
    }
  }
  return {};
}

}  // namespace

OpenAiStreamReader::OpenAiStreamReader(RequestRecord* record, SteadyTime origin)
    : record_(record), origin_(origin) {}

void OpenAiStreamReader::Feed(std::string_view bytes, SteadyTime when) {
  last_feed_ = when;
  while (!bytes.empty()) {
    const size_t newline = bytes.find('\n');
    if (newline == std::string_view::npos) {
      line_.append(bytes);
      return;
    }
    if (line_.empty()) {
      OnLine(bytes.substr(0, newline), when);
    } else {
      line_.append(bytes.substr(0, newline));
      OnLine(line_, when);
      line_.clear();
    }
    bytes.remove_prefix(newline + 1);
  }
}

void OpenAiStreamReader::OnLine(std::string_view line, SteadyTime when) {
  if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
  if (line.empty()) {  // An event ends.
    if (in_event_) OnEvent(event_, when);
    event_.clear();
    in_event_ = false;
    return;
  }
  if (line.substr(0, 5) != "data:") return;  // Comments, event:, id:.
  line.remove_prefix(5);
  if (!line.empty() && line.front() == ' ') line.remove_prefix(1);
  if (in_event_) event_.push_back('\n');
  event_.append(line);
  in_event_ = true;
}

void OpenAiStreamReader::OnEvent(std::string_view data, SteadyTime when) {
  if (data == "[DONE]") {
    done_ = true;
    return;
  }
  const json chunk = json::parse(data, nullptr, /*allow_exceptions=*/false);
  if (!chunk.is_object()) {
    if (error_.ok()) {
      error_ =
          absl::InternalError(absl::StrCat("not a JSON object in the stream: ",
                                           std::string(data.substr(0, 200))));
    }
    return;
  }
  if (auto e = chunk.find("error"); e != chunk.end()) {
    if (error_.ok()) {
      error_ = e->is_object() ? StatusOfErrorObject(*e, 0)
                              : absl::InternalError(e->dump());
    }
    return;
  }
  int64_t usage_tokens = -1;
  if (auto u = chunk.find("usage"); u != chunk.end() && u->is_object()) {
    if (auto c = u->find("completion_tokens");
        c != u->end() && c->is_number_integer()) {
      usage_tokens = c->get<int64_t>();
    }
  }
  const auto choices = chunk.find("choices");
  const bool has_choices =
      choices != chunk.end() && choices->is_array() && !choices->empty();
  if (!has_choices) {  // Rule 3: the final usage chunk.
    if (usage_tokens >= 0) {
      final_tokens_ = usage_tokens;
      usage_s_ = std::chrono::duration<double>(when - origin_).count();
    }
    return;
  }
  bool has_text = false;
  for (const json& choice : *choices) has_text |= !ChoiceText(choice).empty();
  if (has_text) {
    last_text_s_ = std::chrono::duration<double>(when - origin_).count();
  }
  if (usage_tokens >= 0) {  // Rule 1.
    AddTokens(usage_tokens - static_cast<int64_t>(record_->token_s.size()),
              when);
  } else if (has_text) {  // Rule 2.
    AddTokens(1, when);
  }
}

void OpenAiStreamReader::AddTokens(int64_t count, SteadyTime when) {
  const double t = std::chrono::duration<double>(when - origin_).count();
  for (int64_t i = 0; i < count; ++i) record_->token_s.push_back(t);
}

absl::Status OpenAiStreamReader::Finish() {
  // An event not followed by its blank line still counts.
  if (!line_.empty()) {
    OnLine(line_, last_feed_);
    line_.clear();
  }
  if (in_event_) OnEvent(event_, last_feed_);
  in_event_ = false;
  const int64_t counted = static_cast<int64_t>(record_->token_s.size());
  if (final_tokens_ > counted) {
    const double t = last_text_s_ >= 0 ? last_text_s_ : usage_s_;
    record_->token_s.insert(record_->token_s.end(), final_tokens_ - counted, t);
  }
  record_->output_tokens = static_cast<int32_t>(record_->token_s.size());
  if (!error_.ok()) return error_;
  if (!done_) {
    return absl::UnavailableError(
        "the stream ended without its last event, data: [DONE]");
  }
  return absl::OkStatus();
}

absl::Status HttpErrorStatus(int http_status, std::string_view body) {
  const json parsed = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (parsed.is_object()) {
    if (auto e = parsed.find("error"); e != parsed.end() && e->is_object()) {
      const absl::Status s = StatusOfErrorObject(*e, http_status);
      return absl::Status(
          CodeOfHttpStatus(http_status),
          absl::StrCat("HTTP ", http_status, ": ", s.message()));
    }
  }
  return absl::Status(CodeOfHttpStatus(http_status),
                      absl::StrCat("HTTP ", http_status, ": ",
                                   std::string(body.substr(0, 500))));
}

}  // namespace pdserve::planner
