#include "router/router_metrics.h"

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace pdserve {

void LatencyHistogram::Observe(absl::Duration duration) {
  const double seconds = absl::ToDoubleSeconds(duration);
  size_t bucket = 0;
  while (bucket < kBounds.size() && seconds > kBounds[bucket]) ++bucket;
  buckets_[bucket].fetch_add(1, std::memory_order_relaxed);
  count_.fetch_add(1, std::memory_order_relaxed);
  sum_nanos_.fetch_add(absl::ToInt64Nanoseconds(duration),
                       std::memory_order_relaxed);
}

void LatencyHistogram::Write(absl::string_view name, absl::string_view help,
                             std::string* out) const {
  absl::StrAppend(out, "# HELP ", name, " ", help, "\n# TYPE ", name,
                  " histogram\n");
  uint64_t cumulative = 0;
  for (size_t i = 0; i < buckets_.size(); ++i) {
    cumulative += buckets_[i].load(std::memory_order_relaxed);
    const std::string le =
        i < kBounds.size() ? absl::StrCat(kBounds[i]) : "+Inf";
    absl::StrAppend(out, name, "_bucket{le=\"", le, "\"} ", cumulative, "\n");
  }
  absl::StrAppend(
      out, name, "_sum ",
      static_cast<double>(sum_nanos_.load(std::memory_order_relaxed)) * 1e-9,
      "\n", name, "_count ", count_.load(std::memory_order_relaxed), "\n");
}

void RouterMetrics::RequestFinished(absl::string_view api,
                                    absl::string_view outcome,
                                    uint64_t prompt_tokens,
                                    uint64_t completion_tokens,
                                    absl::Duration ttft,
                                    absl::Duration total) {
  {
    absl::MutexLock lock(&mu_);
    ++requests_[{std::string(api), std::string(outcome)}];
  }
  prompt_tokens_.fetch_add(prompt_tokens, std::memory_order_relaxed);
  generation_tokens_.fetch_add(completion_tokens, std::memory_order_relaxed);
  if (ttft > absl::ZeroDuration()) ttft_.Observe(ttft);
  if (completion_tokens > 1 && ttft > absl::ZeroDuration()) {
    tpot_.Observe((total - ttft) / static_cast<double>(completion_tokens - 1));
  }
  e2e_.Observe(total);
}

std::string RouterMetrics::Exposition(
    const std::function<void(std::string*)>& gauges) const {
  std::string out;
  absl::StrAppend(&out,
                  "# HELP pdserve_router_requests_total Generation requests "
                  "finished, by API and outcome.\n"
                  "# TYPE pdserve_router_requests_total counter\n");
  {
    absl::MutexLock lock(&mu_);
    for (const auto& [key, count] : requests_) {
      absl::StrAppend(&out, "pdserve_router_requests_total{api=\"", key.first,
                      "\",outcome=\"", key.second, "\"} ", count, "\n");
    }
  }
  absl::StrAppend(
      &out,
      "# HELP pdserve_router_prompt_tokens_total Prompt tokens of finished "
      "requests.\n# TYPE pdserve_router_prompt_tokens_total counter\n"
      "pdserve_router_prompt_tokens_total ",
      prompt_tokens_.load(std::memory_order_relaxed),
      "\n# HELP pdserve_router_generation_tokens_total Tokens generated for "
      "finished requests.\n# TYPE pdserve_router_generation_tokens_total "
      "counter\npdserve_router_generation_tokens_total ",
      generation_tokens_.load(std::memory_order_relaxed), "\n");
  ttft_.Write("pdserve_router_time_to_first_token_seconds",
              "Time from a request's arrival to its first token.", &out);
  tpot_.Write("pdserve_router_time_per_output_token_seconds",
              "Mean time per generated token after the first, per request.",
              &out);
  e2e_.Write("pdserve_router_request_duration_seconds",
             "Time from a request's arrival to its end.", &out);
  if (gauges) gauges(&out);
  return out;
}

void RequestRecord::Sent(const v1::GenerateResponse& message) {
  if (ttft_ == absl::ZeroDuration() && message.token_ids_size() > 0) {
    ttft_ = absl::Now() - started_;
  }
  if (message.has_usage()) {
    // Every choice's last message has the usage; the prompt counts once.
    if (message.index() == 0) prompt_tokens_ += message.usage().prompt_tokens();
    completion_tokens_ += message.usage().completion_tokens();
  }
}

void RequestRecord::Finish(absl::string_view api, const absl::Status& status,
                           RouterMetrics& metrics) const {
  metrics.RequestFinished(api, OutcomeName(status.raw_code()), prompt_tokens_,
                          completion_tokens_, ttft_, absl::Now() - started_);
}

std::string OutcomeName(int absl_status_code) {
  const auto code = static_cast<absl::StatusCode>(absl_status_code);
  if (code == absl::StatusCode::kOk) return "ok";
  return absl::AsciiStrToLower(absl::StatusCodeToString(code));
}

}  // namespace pdserve
