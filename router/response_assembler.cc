#include "router/response_assembler.h"

#include <utility>

#include "absl/strings/str_cat.h"

namespace pdserve {
namespace {

void ToPublic(const internal::v1::SampledToken& token, v1::TokenLogprobs* out) {
  out->set_token_id(token.token_id());
  out->set_logprob(token.logprob());
  for (const internal::v1::TokenLogprob& top : token.top()) {
    v1::TokenLogprob* alt = out->add_top();
    alt->set_token_id(top.token_id());
    alt->set_logprob(top.logprob());
  }
}

}  // namespace

ResponseAssembler::ResponseAssembler(Options options)
    : options_(std::move(options)), stop_(options_.stop_strings) {
  if (options_.tokenizer != nullptr) {
    detokenizer_.emplace(*options_.tokenizer, options_.skip_special_tokens);
  }
}

v1::GenerateResponse ResponseAssembler::NewMessage() const {
  v1::GenerateResponse message;
  message.set_request_id(options_.request_id);
  message.set_index(options_.index);
  return message;
}

absl::Status ResponseAssembler::AddToken(
    const internal::v1::SampledToken& token, v1::GenerateResponse* out) {
  if (stopped()) return absl::OkStatus();
  ++completion_tokens_;
  out->add_token_ids(token.token_id());
  if (options_.logprobs) ToPublic(token, out->add_logprobs());
  if (!detokenizer_) return absl::OkStatus();
  absl::StatusOr<std::string> delta = detokenizer_->Append(token.token_id());
  if (!delta.ok()) {
    return absl::InternalError(absl::StrCat("a worker sent token ",
                                            token.token_id(), ": ",
                                            delta.status().message()));
  }
  out->mutable_text()->append(stop_.Append(*delta));
  return absl::OkStatus();
}

void ResponseAssembler::AddPromptLogprobs(
    const google::protobuf::RepeatedPtrField<internal::v1::SampledToken>&
        prompt_logprobs,
    v1::GenerateResponse* out) const {
  out->mutable_prompt_logprobs()->Reserve(prompt_logprobs.size());
  for (const internal::v1::SampledToken& t : prompt_logprobs) {
    ToPublic(t, out->add_prompt_logprobs());
  }
}

void ResponseAssembler::Finish(v1::FinishReason reason,
                               v1::GenerateResponse* out) {
  if (detokenizer_ && !stopped()) {
    out->mutable_text()->append(stop_.Append(detokenizer_->Flush()));
    out->mutable_text()->append(stop_.Flush());
  }
  out->set_finish_reason(stopped() ? v1::FINISH_REASON_STOP : reason);
  out->mutable_usage()->set_prompt_tokens(options_.prompt_tokens);
  out->mutable_usage()->set_completion_tokens(completion_tokens_);
}

void MergeResponse(v1::GenerateResponse&& from, v1::GenerateResponse* into) {
  into->mutable_token_ids()->MergeFrom(from.token_ids());
  into->mutable_text()->append(from.text());
  for (v1::TokenLogprobs& lp : *from.mutable_logprobs()) {
    *into->add_logprobs() = std::move(lp);
  }
  for (v1::TokenLogprobs& lp : *from.mutable_prompt_logprobs()) {
    *into->add_prompt_logprobs() = std::move(lp);
  }
  if (from.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) {
    into->set_finish_reason(from.finish_reason());
  }
  if (from.has_usage()) *into->mutable_usage() = from.usage();
}

}  // namespace pdserve
