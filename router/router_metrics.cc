#include "router/router_metrics.h"

#include <utility>

#include "absl/strings/ascii.h"
#include "absl/time/clock.h"

namespace pdserve {
namespace {

constexpr absl::string_view kRetryKinds[] = {"prefill", "decode"};
constexpr absl::string_view kMigrationOutcomes[] = {"continued", "limit_spent",
                                                    "no_worker", "abandoned"};
constexpr absl::string_view kRejectReasons[] = {"queue_full", "too_large",
                                                "stopping"};

}  // namespace

RouterMetrics::RouterMetrics(const Options& options)
    : requests_(registry_.AddCounterFamily(
          "pdserve_router_requests_total",
          "Generation requests finished, by API (grpc, http) and outcome "
          "(ok, or the status code's name in lower case).",
          {"api", "outcome"})),
      finished_choices_(registry_.AddCounterFamily(
          "pdserve_router_finished_choices_total",
          "Choices (completions) finished, by finish reason (stop: an end "
          "token or stop sequence; length: max_tokens). A cancelled or "
          "failed request's choices are not counted here.",
          {"reason"})),
      prompt_tokens_(registry_.AddCounter(
          "pdserve_router_prompt_tokens_total",
          "Prompt tokens of finished requests.")),
      generation_tokens_(registry_.AddCounter(
          "pdserve_router_generation_tokens_total",
          "Tokens generated for finished requests (all choices).")),
      ttft_(registry_.AddHistogram(
          "pdserve_router_time_to_first_token_seconds",
          "Time from a request's arrival to its first token.",
          LatencyBuckets())),
      itl_(registry_.AddHistogram(
          "pdserve_router_inter_token_latency_seconds",
          "Inter-token latency: one observation per token-bearing message "
          "of a choice after its first, the time since that choice's "
          "previous token-bearing message divided by the message's tokens.",
          LatencyBuckets())),
      tpot_(registry_.AddHistogram(
          "pdserve_router_time_per_output_token_seconds",
          "Mean time per generated token after the first, per request.",
          LatencyBuckets())),
      e2e_(registry_.AddHistogram(
          "pdserve_router_request_duration_seconds",
          "Time from a request's arrival to its end (end to end).",
          LatencyBuckets())),
      queue_time_(registry_.AddHistogram(
          "pdserve_router_queue_time_seconds",
          "Time a request waited for a router thread before it was "
          "orchestrated.",
          LatencyBuckets())),
      routed_(registry_.AddCounterFamily(
          "pdserve_router_routed_total",
          "Routing decisions: prefills (role prefill) and decodes (role "
          "decode) sent to each worker, one per attempt.",
          {"role", "worker"})),
      prefix_prompt_tokens_(registry_.AddCounter(
          "pdserve_router_prefix_match_prompt_tokens_total",
          "Prompt tokens of routed requests. Prefix-cache hit ratio of the "
          "routing = rate(pdserve_router_prefix_match_cached_tokens_total) / "
          "rate(pdserve_router_prefix_match_prompt_tokens_total).")),
      prefix_cached_tokens_(registry_.AddCounter(
          "pdserve_router_prefix_match_cached_tokens_total",
          "Prompt tokens of routed requests that the chosen worker's prefix "
          "cache held, as the routing estimated them (see "
          "pdserve_router_prefix_match_prompt_tokens_total for the ratio).")),
      retries_(registry_.AddCounterFamily(
          "pdserve_router_retries_total",
          "Retries, by kind: prefill (another prefill worker), decode "
          "(another decode worker, the first one full).",
          {"kind"})),
      migrations_(registry_.AddCounterFamily(
          "pdserve_router_migrations_total",
          "Choices moved off a failed or stalled decode worker, by outcome: "
          "continued (another decode worker took it), limit_spent (the "
          "router's migration_limit was reached: the stream ended "
          "UNAVAILABLE), no_worker (no decode worker could take it: the "
          "stream ended UNAVAILABLE), abandoned (the client cancelled or its "
          "deadline passed before another worker took it).",
          {"outcome"})),
      rejected_(registry_.AddCounterFamily(
          "pdserve_router_rejected_requests_total",
          "Requests refused at admission, by reason (queue_full, too_large, "
          "stopping).",
          {"reason"})) {
  for (const std::string& id : options.prefill_workers) {
    routed_prefill_[id] = routed_->WithLabels({"prefill", id});
  }
  for (const std::string& id : options.decode_workers) {
    routed_decode_[id] = routed_->WithLabels({"decode", id});
  }
  for (absl::string_view kind : kRetryKinds) {
    retries_by_kind_[kind] = retries_->WithLabels({std::string(kind)});
  }
  for (absl::string_view outcome : kMigrationOutcomes) {
    migrations_by_outcome_[outcome] =
        migrations_->WithLabels({std::string(outcome)});
  }
  for (absl::string_view reason : kRejectReasons) {
    rejected_by_reason_[reason] = rejected_->WithLabels({std::string(reason)});
  }
  finish_stop_ = finished_choices_->WithLabels({"stop"});
  finish_length_ = finished_choices_->WithLabels({"length"});
}

Counter* RouterMetrics::Find(const CounterMap& known, CounterFamily* family,
                             std::vector<std::string> labels,
                             absl::string_view key) {
  if (auto it = known.find(key); it != known.end()) return it->second;
  return family->WithLabels(labels);
}

void RouterMetrics::RequestFinished(absl::string_view api,
                                    absl::string_view outcome,
                                    uint64_t prompt_tokens,
                                    uint64_t completion_tokens,
                                    absl::Duration ttft,
                                    absl::Duration total) {
  requests_->WithLabels({std::string(api), std::string(outcome)})->Increment();
  prompt_tokens_->Increment(prompt_tokens);
  generation_tokens_->Increment(completion_tokens);
  if (ttft > absl::ZeroDuration()) ttft_->ObserveDuration(ttft);
  if (completion_tokens > 1 && ttft > absl::ZeroDuration()) {
    tpot_->ObserveDuration((total - ttft) /
                           static_cast<double>(completion_tokens - 1));
  }
  e2e_->ObserveDuration(total);
}

void RouterMetrics::ChoiceFinished(v1::FinishReason reason) {
  switch (reason) {
    case v1::FINISH_REASON_STOP:
      finish_stop_->Increment();
      break;
    case v1::FINISH_REASON_LENGTH:
      finish_length_->Increment();
      break;
    default:
      finished_choices_->WithLabels({"other"})->Increment();
  }
}

void RouterMetrics::InterTokenLatency(absl::Duration per_token) {
  itl_->ObserveDuration(per_token);
}

void RouterMetrics::Routed(absl::string_view role,
                           absl::string_view worker_id) {
  static const CounterMap kNone;
  const CounterMap* known = role == "prefill"  ? &routed_prefill_
                            : role == "decode" ? &routed_decode_
                                               : &kNone;
  Find(*known, routed_, {std::string(role), std::string(worker_id)}, worker_id)
      ->Increment();
}

void RouterMetrics::PrefixMatched(uint64_t prompt_tokens,
                                  uint64_t cached_tokens) {
  prefix_prompt_tokens_->Increment(prompt_tokens);
  prefix_cached_tokens_->Increment(cached_tokens);
}

void RouterMetrics::Retried(absl::string_view kind) {
  Find(retries_by_kind_, retries_, {std::string(kind)}, kind)->Increment();
}

void RouterMetrics::Migrated(absl::string_view outcome) {
  Find(migrations_by_outcome_, migrations_, {std::string(outcome)}, outcome)
      ->Increment();
}

void RouterMetrics::Rejected(absl::string_view reason) {
  Find(rejected_by_reason_, rejected_, {std::string(reason)}, reason)
      ->Increment();
}

void RouterMetrics::QueueTime(absl::Duration waited) {
  queue_time_->ObserveDuration(waited);
}

void RequestRecord::Sent(const v1::GenerateResponse& message) {
  if (message.token_ids_size() > 0) {
    const absl::Time now = absl::Now();
    if (ttft_ == absl::ZeroDuration()) ttft_ = now - started_;
    const uint32_t choice = message.index();
    if (choice >= last_token_.size()) {
      last_token_.resize(choice + 1, absl::InfinitePast());
    }
    if (last_token_[choice] != absl::InfinitePast()) {
      metrics_.InterTokenLatency((now - last_token_[choice]) /
                                  message.token_ids_size());
    }
    last_token_[choice] = now;
  }
  if (message.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
    metrics_.ChoiceFinished(message.finish_reason());
  }
  if (message.has_usage()) {
    // Every choice's last message has the usage; the prompt counts once.
    if (message.index() == 0) prompt_tokens_ += message.usage().prompt_tokens();
    completion_tokens_ += message.usage().completion_tokens();
  }
}

void RequestRecord::Finish(absl::string_view api,
                           const absl::Status& status) const {
  metrics_.RequestFinished(api, OutcomeName(status.raw_code()), prompt_tokens_,
                          completion_tokens_, ttft_, absl::Now() - started_);
}

std::string OutcomeName(int absl_status_code) {
  const auto code = static_cast<absl::StatusCode>(absl_status_code);
  if (code == absl::StatusCode::kOk) return "ok";
  return absl::AsciiStrToLower(absl::StatusCodeToString(code));
}

}  // namespace pdserve
