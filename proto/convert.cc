#include "proto/convert.h"

#include <algorithm>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace pdserve {

GenerationRequest FromWire(const wire::EngineRequest& r) {
  GenerationRequest out;
  out.id = RequestId(r.request_id());
  out.prompt.assign(r.prompt().begin(), r.prompt().end());
  SamplingParams& s = out.sampling;
  s.temperature = r.temperature();
  s.top_k = r.top_k();
  s.top_p = r.top_p();
  s.min_p = r.min_p();
  s.seed = r.seed();
  // Clamped so a huge uint32 cannot wrap negative; the Generator rejects it.
  s.max_tokens = static_cast<int32_t>(std::min<uint32_t>(r.max_tokens(), 1u << 30));
  s.stop_token_ids.assign(r.stop_token_ids().begin(), r.stop_token_ids().end());
  s.ignore_eos = r.ignore_eos();
  s.logprobs = static_cast<int32_t>(std::min<uint32_t>(r.logprobs(), 1000));
  s.presence_penalty = r.presence_penalty();
  s.frequency_penalty = r.frequency_penalty();
  s.repetition_penalty = r.has_repetition_penalty() ? r.repetition_penalty() : 1.0f;
  s.logit_bias.assign(r.logit_bias().begin(), r.logit_bias().end());
  if (r.has_prompt_logprobs()) {
    s.prompt_logprobs = static_cast<int32_t>(std::min<uint32_t>(r.prompt_logprobs(), 1000));
  }
  // Clamped as max_tokens; the Generator rejects more than the prompt.
  out.resumed_tokens = static_cast<int32_t>(std::min<uint32_t>(r.resumed_tokens(), 1u << 30));
  out.arrival_unix_us = static_cast<int64_t>(
      std::min<uint64_t>(r.arrival_unix_us(), std::numeric_limits<int64_t>::max()));
  return out;
}

void ToWire(const GenerationRequest& r, wire::EngineRequest* out) {
  out->set_request_id(r.id.value);
  out->mutable_prompt()->Assign(r.prompt.begin(), r.prompt.end());
  const SamplingParams& s = r.sampling;
  out->set_temperature(s.temperature);
  out->set_top_k(s.top_k);
  out->set_top_p(s.top_p);
  out->set_min_p(s.min_p);
  out->set_seed(s.seed.value_or(0));
  out->set_max_tokens(static_cast<uint32_t>(s.max_tokens));
  out->mutable_stop_token_ids()->Assign(s.stop_token_ids.begin(), s.stop_token_ids.end());
  out->set_ignore_eos(s.ignore_eos);
  out->set_logprobs(static_cast<uint32_t>(s.logprobs));
  out->set_presence_penalty(s.presence_penalty);
  out->set_frequency_penalty(s.frequency_penalty);
  if (s.repetition_penalty != 1.0f) out->set_repetition_penalty(s.repetition_penalty);
  for (const auto& [id, bias] : s.logit_bias) (*out->mutable_logit_bias())[id] = bias;
  if (s.prompt_logprobs) out->set_prompt_logprobs(static_cast<uint32_t>(*s.prompt_logprobs));
  out->set_resumed_tokens(static_cast<uint32_t>(r.resumed_tokens));
  out->set_arrival_unix_us(static_cast<uint64_t>(std::max<int64_t>(r.arrival_unix_us, 0)));
}

SampledToken FromWire(const wire::SampledToken& t) {
  SampledToken out{.token = t.token_id(), .logprob = t.logprob()};
  for (const wire::TokenLogprob& top : t.top()) {
    out.top_logprobs.push_back({top.token_id(), top.logprob()});
  }
  return out;
}

void ToWire(const SampledToken& t, wire::SampledToken* out) {
  out->set_token_id(t.token);
  out->set_logprob(t.logprob);
  for (const TokenLogprob& top : t.top_logprobs) {
    wire::TokenLogprob* p = out->add_top();
    p->set_token_id(top.token);
    p->set_logprob(top.logprob);
  }
}

wire::FinishReason ToWire(FinishReason finish) {
  switch (finish) {
    case FinishReason::kStop:
      return wire::FINISH_REASON_STOP;
    case FinishReason::kLength:
      return wire::FINISH_REASON_LENGTH;
    case FinishReason::kNone:
    case FinishReason::kCancelled:
      break;
  }
  return wire::FINISH_REASON_UNSPECIFIED;
}

absl::StatusOr<KvBlockLayout> FromWire(const wire::KvLayout& l) {
  PD_ASSIGN_OR_RETURN(DType dtype, ParseDType(l.dtype()));
  constexpr uint32_t kMax = 1u << 20;
  for (uint32_t v : {l.num_layers(), l.num_kv_heads(), l.head_dim(), l.block_size()}) {
    if (v == 0 || v > kMax) {
      return absl::InvalidArgumentError(
          absl::StrCat("KV layout field out of range: ", l.ShortDebugString()));
    }
  }
  return KvBlockLayout{.num_layers = static_cast<int32_t>(l.num_layers()),
                       .num_kv_heads = static_cast<int32_t>(l.num_kv_heads()),
                       .head_dim = static_cast<int32_t>(l.head_dim()),
                       .block_size = static_cast<int32_t>(l.block_size()),
                       .dtype = dtype};
}

void ToWire(const KvBlockLayout& l, wire::KvLayout* out) {
  out->set_num_layers(l.num_layers);
  out->set_num_kv_heads(l.num_kv_heads);
  out->set_head_dim(l.head_dim);
  out->set_block_size(l.block_size);
  out->set_dtype(std::string(DTypeName(l.dtype)));
}

void ToWire(const EngineLoad& load, wire::LoadReport* out) {
  out->set_total_blocks(load.total_blocks);
  out->set_free_blocks(load.free_blocks);
  out->set_running(load.running);
  out->set_waiting(load.waiting);
  out->set_reservations(load.reserved);
  out->set_pending_prompt_tokens(load.pending_prompt_tokens);
  out->set_computed_prompt_tokens(load.computed_prompt_tokens);
  out->set_prefix_cached_tokens(load.prefix_cached_tokens);
  out->set_kv_canary_violations(static_cast<uint64_t>(load.kv_canary_violations));
}

void ToWire(const KvEventLog& log, const wire::LoadRequest& request,
            wire::LoadReport* out) {
  const KvEventsReport report =
      log.ReportSince(request.kv_events_epoch(), request.kv_events_seq());
  wire::KvCacheEvents* events = out->mutable_kv_events();
  events->set_epoch(report.epoch);
  events->set_snapshot(report.snapshot);
  events->set_truncated(report.truncated);
  events->set_after_seq(report.after_seq);
  events->set_last_seq(report.last_seq);
  events->mutable_stored()->Add(report.stored.begin(), report.stored.end());
  events->mutable_evicted()->Add(report.evicted.begin(), report.evicted.end());
}

grpc::Status ToGrpcStatus(const absl::Status& status) {
  if (status.ok()) return grpc::Status::OK;
  return grpc::Status(static_cast<grpc::StatusCode>(status.code()), std::string(status.message()));
}

absl::Status FromGrpcStatus(const grpc::Status& status) {
  if (status.ok()) return absl::OkStatus();
  return absl::Status(static_cast<absl::StatusCode>(status.error_code()), status.error_message());
}

}  // namespace pdserve
