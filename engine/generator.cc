#include "engine/generator.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace pdserve {

absl::StatusOr<std::unique_ptr<Generator>> Generator::Create(ModelRunner* runner,
                                                             const GeneratorOptions& options) {
  if (options.max_batch_tokens < 1 || options.max_running < 1) {
    return absl::InvalidArgumentError("max_batch_tokens and max_running must be positive");
  }
  if (options.max_batch_tokens < options.max_running) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_batch_tokens (", options.max_batch_tokens, ") must be at least max_running (",
        options.max_running, ") so every running sequence decodes each step"));
  }
  return std::unique_ptr<Generator>(new Generator(runner, options));
}

Generator::Generator(ModelRunner* runner, const GeneratorOptions& options)
    : runner_(runner), options_(options), pool_(runner->num_kv_blocks()) {}

int32_t Generator::BlocksFor(const GenerationRequest& r) const {
  const int64_t tokens = static_cast<int64_t>(r.prompt.size()) + r.sampling.max_tokens;
  const int32_t bs = runner_->kv_layout().block_size;
  return static_cast<int32_t>((tokens + bs - 1) / bs);
}

absl::Status Generator::Add(GenerationRequest request) {
  const ModelConfig& c = runner_->model().config();
  if (request.prompt.empty()) return absl::InvalidArgumentError("prompt is empty");
  for (int32_t t : request.prompt) {
    if (t < 0 || t >= c.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompt token id ", t, " outside [0, ", c.vocab_size, ")"));
    }
  }
  PD_RETURN_IF_ERROR(ValidateSamplingParams(request.sampling, c.vocab_size));
  const int64_t total = static_cast<int64_t>(request.prompt.size()) + request.sampling.max_tokens;
  if (total > c.max_position_embeddings) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt (", request.prompt.size(), " tokens) + max_tokens (", request.sampling.max_tokens,
        ") exceeds the model's context of ", c.max_position_embeddings));
  }
  if (BlocksFor(request) > pool_.num_blocks()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "request needs ", BlocksFor(request), " KV blocks; the pool has ", pool_.num_blocks()));
  }
  auto same_id = [&](const std::unique_ptr<Sequence>& s) { return s->request.id == request.id; };
  if (std::any_of(waiting_.begin(), waiting_.end(), same_id) ||
      std::any_of(running_.begin(), running_.end(), same_id)) {
    return absl::InvalidArgumentError(absl::StrCat("duplicate request id ", request.id.value));
  }
  auto seq = std::make_unique<Sequence>();
  seq->sampler = std::make_unique<Sampler>(request.sampling);
  if (options_.enable_prefix_caching) {
    const size_t bs = runner_->kv_layout().block_size;
    uint64_t parent = 0;
    for (size_t end = bs; end <= request.prompt.size(); end += bs) {
      parent = HashBlockTokens(parent, std::span(request.prompt).subspan(end - bs, bs));
      seq->block_hashes.push_back(parent);
    }
  }
  seq->tokens.reserve(total);
  seq->tokens = request.prompt;
  seq->request = std::move(request);
  waiting_.push_back(std::move(seq));
  return absl::OkStatus();
}

void Generator::Cancel(RequestId id) {
  auto match = [&](const std::unique_ptr<Sequence>& s) { return s->request.id == id; };
  if (auto it = std::find_if(waiting_.begin(), waiting_.end(), match); it != waiting_.end()) {
    waiting_.erase(it);
    cancelled_.push_back(id);
  } else if (auto rit = std::find_if(running_.begin(), running_.end(), match);
             rit != running_.end()) {
    pool_.Release((*rit)->blocks);
    running_.erase(rit);
    cancelled_.push_back(id);
  }
}

void Generator::Admit() {
  while (!waiting_.empty() && static_cast<int32_t>(running_.size()) < options_.max_running) {
    Sequence& s = *waiting_.front();
    // Shared prefix blocks first. The prompt's last token is always
    // computed (its logits are needed), so its block is never shared.
    const int32_t bs = runner_->kv_layout().block_size;
    const size_t shareable =
        std::min(s.block_hashes.size(), (s.request.prompt.size() - 1) / static_cast<size_t>(bs));
    std::vector<BlockId> blocks;
    while (blocks.size() < shareable) {
      const std::optional<BlockId> hit = pool_.LookupPrefix(s.block_hashes[blocks.size()]);
      if (!hit) break;
      blocks.push_back(*hit);
    }
    auto fresh = pool_.Allocate(BlocksFor(s.request) - static_cast<int32_t>(blocks.size()));
    if (!fresh.ok()) {  // FIFO: wait for blocks to free up.
      pool_.Release(blocks);
      return;
    }
    s.num_computed = static_cast<int32_t>(blocks.size()) * bs;
    s.num_hashed = blocks.size();
    prefix_cached_tokens_ += s.num_computed;
    blocks.insert(blocks.end(), fresh->begin(), fresh->end());
    s.blocks = std::move(blocks);
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
  }
}

bool Generator::IsStopToken(const Sequence& s, int32_t token) const {
  const auto& stops = s.request.sampling.stop_token_ids;
  if (std::find(stops.begin(), stops.end(), token) != stops.end()) return true;
  if (s.request.sampling.ignore_eos) return false;
  const auto& eos = runner_->model().eos_token_ids();
  return std::find(eos.begin(), eos.end(), token) != eos.end();
}

bool Generator::SampleNext(Sequence& s, std::span<const float> logits,
                           std::vector<GenerationEvent>& events) {
  GenerationEvent& e = events.emplace_back();
  e.id = s.request.id;
  e.has_token = true;
  e.token = s.sampler->Sample(logits);
  s.tokens.push_back(e.token.token);
  const int32_t generated = static_cast<int32_t>(s.tokens.size() - s.request.prompt.size());
  if (IsStopToken(s, e.token.token)) {
    e.finish = FinishReason::kStop;
  } else if (generated >= s.request.sampling.max_tokens) {
    e.finish = FinishReason::kLength;
  }
  return e.finish != FinishReason::kNone;
}

absl::Status Generator::Step(std::vector<GenerationEvent>& events) {
  for (RequestId id : cancelled_) {
    events.push_back({.id = id, .has_token = false, .finish = FinishReason::kCancelled});
  }
  cancelled_.clear();
  Admit();
  if (running_.empty()) return absl::OkStatus();

  batch_.sequences.clear();
  batch_seqs_.clear();
  int32_t budget = options_.max_batch_tokens;
  // Decode tokens first: every running sequence past its prompt advances.
  for (auto& s : running_) {
    if (s->num_computed < static_cast<int32_t>(s->request.prompt.size())) continue;
    batch_.sequences.push_back({.tokens = std::span(s->tokens).subspan(s->num_computed, 1),
                                .start_pos = s->num_computed,
                                .block_table = s->blocks});
    batch_seqs_.push_back(s.get());
    --budget;
  }
  // Then prefill chunks, oldest first, while the budget lasts.
  for (auto& s : running_) {
    const int32_t prompt_len = static_cast<int32_t>(s->request.prompt.size());
    if (s->num_computed >= prompt_len || budget <= 0) continue;
    const int32_t n = std::min(budget, prompt_len - s->num_computed);
    batch_.sequences.push_back({.tokens = std::span(s->tokens).subspan(s->num_computed, n),
                                .start_pos = s->num_computed,
                                .block_table = s->blocks});
    batch_seqs_.push_back(s.get());
    budget -= n;
  }

  const int32_t vocab = runner_->model().config().vocab_size;
  logits_.resize(ModelRunner::NumLogitsRows(batch_) * vocab);
  PD_RETURN_IF_ERROR(runner_->Forward(batch_, logits_));

  bool any_finished = false;
  for (size_t i = 0; i < batch_seqs_.size(); ++i) {
    Sequence& s = *batch_seqs_[i];
    s.num_computed += static_cast<int32_t>(batch_.sequences[i].tokens.size());
    // Prompt blocks now complete become shareable.
    const size_t full = static_cast<size_t>(s.num_computed) / runner_->kv_layout().block_size;
    for (; s.num_hashed < std::min(full, s.block_hashes.size()); ++s.num_hashed) {
      pool_.SetHash(s.blocks[s.num_hashed], s.block_hashes[s.num_hashed]);
    }
    if (s.num_computed < static_cast<int32_t>(s.request.prompt.size())) continue;  // Mid-prompt.
    if (SampleNext(s, std::span(logits_).subspan(i * vocab, vocab), events)) {
      pool_.Release(s.blocks);
      s.blocks.clear();
      any_finished = true;
    }
  }
  if (any_finished) {
    std::erase_if(running_, [](const std::unique_ptr<Sequence>& s) { return s->blocks.empty(); });
  }
  return absl::OkStatus();
}

}  // namespace pdserve
