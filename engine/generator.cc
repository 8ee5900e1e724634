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
  if (options.kv_canary && runner->kv_memory_kind() != KvMemoryKind::kHost) {
    return absl::FailedPreconditionError(
        "the KV canary checks a host KV pool; this backend's pool is in device memory");
  }
  return std::unique_ptr<Generator>(new Generator(runner, options));
}

Generator::Generator(ModelRunner* runner, const GeneratorOptions& options)
    : runner_(runner), options_(options), pool_(runner->num_kv_blocks()) {
  if (options.kv_canary) {
    canary_ = std::make_unique<KvCanary>(runner->kv_memory(), runner->kv_layout(),
                                         runner->num_kv_blocks());
    pool_.set_listener(canary_.get());
  }
}

int32_t Generator::BlocksFor(const GenerationRequest& r) const {
  const int64_t tokens = static_cast<int64_t>(r.prompt.size()) + r.sampling.max_tokens;
  const int32_t bs = runner_->kv_layout().block_size;
  return static_cast<int32_t>(BlocksForTokens(tokens, bs));
}

absl::Status Generator::Validate(const GenerationRequest& request) const {
  const ModelConfig& c = runner_->model().config();
  if (request.prompt.empty()) return absl::InvalidArgumentError("prompt is empty");
  for (int32_t t : request.prompt) {
    if (t < 0 || t >= c.vocab_size) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompt token id ", t, " outside [0, ", c.vocab_size, ")"));
    }
  }
  PD_RETURN_IF_ERROR(ValidateSamplingParams(request.sampling, c.vocab_size));
  // The last prompt token is the one this run computes logits at, so at
  // least one token before the resumed ones belongs to the original prompt.
  if (request.resumed_tokens < 0 ||
      request.resumed_tokens >= static_cast<int64_t>(request.prompt.size())) {
    return absl::InvalidArgumentError(
        absl::StrCat("resumed_tokens (", request.resumed_tokens, ") outside [0, ",
                     request.prompt.size() - 1, "] for a prompt of ", request.prompt.size(),
                     " tokens"));
  }
  if (request.arrival_unix_us < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("arrival_unix_us (", request.arrival_unix_us, ") is negative"));
  }
  if (request.resumed_tokens > 0 && request.sampling.prompt_logprobs) {
    return absl::InvalidArgumentError(
        "prompt_logprobs with resumed_tokens: the prompt's logprobs went with the first run");
  }
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
  return absl::OkStatus();
}

bool Generator::Known(RequestId id) const {
  auto same_id = [&](const std::unique_ptr<Sequence>& s) { return s->request.id == id; };
  return std::any_of(waiting_.begin(), waiting_.end(), same_id) ||
         std::any_of(running_.begin(), running_.end(), same_id) || held_kv_.contains(id);
}

std::unique_ptr<Generator::Sequence> Generator::NewSequence(GenerationRequest request,
                                                            int64_t sampled_elsewhere) {
  auto seq = std::make_unique<Sequence>();
  // A resumed request draws where its earlier run stopped: the sampler's
  // step is the request's output position, wherever it runs.
  seq->sampler = std::make_unique<Sampler>(request.sampling,
                                           request.resumed_tokens + sampled_elsewhere);
  if (options_.enable_prefix_caching) {
    seq->block_hashes = PromptBlockHashes(request.prompt, runner_->kv_layout().block_size);
  }
  seq->tokens.reserve(request.prompt.size() + request.sampling.max_tokens);
  seq->tokens = request.prompt;
  if (request.sampling.prompt_logprobs && sampled_elsewhere == 0) {
    seq->prompt_logprobs.reserve(request.prompt.size() - 1);
  }
  seq->request = std::move(request);
  return seq;
}

absl::Status Generator::Add(GenerationRequest request) {
  PD_RETURN_IF_ERROR(Validate(request));
  if (Known(request.id) || reservations_.contains(request.id)) {
    return absl::InvalidArgumentError(absl::StrCat("duplicate request id ", request.id.value));
  }
  Enqueue(NewSequence(std::move(request), /*sampled_elsewhere=*/0));
  return absl::OkStatus();
}

absl::StatusOr<std::span<const BlockId>> Generator::Reserve(RequestId id, int32_t num_tokens) {
  PD_ASSIGN_OR_RETURN(const KvReservation r, Reserve(id, num_tokens, 0, {}));
  return r.blocks;
}

absl::StatusOr<KvReservation> Generator::Reserve(RequestId id, int32_t num_tokens,
                                                 int32_t prompt_tokens,
                                                 std::span<const uint64_t> prompt_block_hashes) {
  const int32_t context = runner_->model().config().max_position_embeddings;
  if (num_tokens < 1 || num_tokens > context) {
    return absl::InvalidArgumentError(
        absl::StrCat("reservation of ", num_tokens, " tokens outside [1, ", context, "]"));
  }
  if (prompt_tokens < 0 || prompt_tokens > num_tokens) {
    return absl::InvalidArgumentError(absl::StrCat(
        "a prompt of ", prompt_tokens, " tokens in a reservation of ", num_tokens));
  }
  if (Known(id) || reservations_.contains(id)) {
    return absl::InvalidArgumentError(absl::StrCat("duplicate request id ", id.value));
  }
  const int32_t bs = runner_->kv_layout().block_size;
  Reserved reserved;
  if (options_.enable_prefix_caching && prompt_tokens > 0) {
    // As Admit: the block of the prompt's last token is never shared.
    const size_t shareable =
        std::min(prompt_block_hashes.size(), static_cast<size_t>((prompt_tokens - 1) / bs));
    while (reserved.blocks.size() < shareable) {
      const uint64_t hash = prompt_block_hashes[reserved.blocks.size()];
      const std::optional<BlockId> hit = pool_.LookupPrefix(hash);
      if (!hit) break;
      reserved.blocks.push_back(*hit);
      reserved.shared_hashes.push_back(hash);
    }
  }
  const int32_t total = static_cast<int32_t>(BlocksForTokens(num_tokens, bs));
  auto fresh = pool_.Allocate(total - static_cast<int32_t>(reserved.blocks.size()));
  if (!fresh.ok()) {
    pool_.Release(reserved.blocks);
    return fresh.status();
  }
  reserved.blocks.insert(reserved.blocks.end(), fresh->begin(), fresh->end());
  const int32_t cached = static_cast<int32_t>(reserved.shared_hashes.size()) * bs;
  return KvReservation{.blocks = (reservations_[id] = std::move(reserved)).blocks,
                       .cached_tokens = cached};
}

void Generator::ReleaseReservation(RequestId id) {
  if (auto it = reservations_.find(id); it != reservations_.end()) {
    pool_.Release(it->second.blocks);
    reservations_.erase(it);
  }
}

std::vector<BlockId> Generator::TakeReservation(RequestId id) {
  auto it = reservations_.find(id);
  if (it == reservations_.end()) return {};
  std::vector<BlockId> blocks = std::move(it->second.blocks);
  reservations_.erase(it);
  return blocks;
}

void Generator::ReleaseBlocks(std::span<const BlockId> blocks) { pool_.Release(blocks); }

absl::Status Generator::AddPrefilled(GenerationRequest request, int32_t first_token) {
  PD_RETURN_IF_ERROR(Validate(request));
  if (request.sampling.max_tokens < 2) {
    return absl::InvalidArgumentError("max_tokens < 2: nothing is left to decode");
  }
  if (first_token < 0 || first_token >= runner_->model().config().vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat("first token id ", first_token,
                                                   " is outside the vocabulary"));
  }
  if (Known(request.id)) {
    return absl::InvalidArgumentError(absl::StrCat("duplicate request id ", request.id.value));
  }
  auto it = reservations_.find(request.id);
  if (it == reservations_.end()) {
    return absl::NotFoundError(absl::StrCat("no KV reservation for request ", request.id.value));
  }
  Reserved& reserved = it->second;
  if (static_cast<int32_t>(reserved.blocks.size()) < BlocksFor(request)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the reservation holds ", reserved.blocks.size(), " blocks; prompt + max_tokens need ",
        BlocksFor(request)));
  }
  const int32_t prompt_len = static_cast<int32_t>(request.prompt.size());
  const int32_t bs = runner_->kv_layout().block_size;
  const size_t shared = reserved.shared_hashes.size();
  std::unique_ptr<Sequence> seq = NewSequence(std::move(request), /*sampled_elsewhere=*/1);
  // Shared blocks hold another prompt's KV: only the same tokens may use it.
  if (shared > 0 &&
      (static_cast<int64_t>(shared) * bs >= prompt_len || seq->block_hashes.size() < shared ||
       !std::equal(reserved.shared_hashes.begin(), reserved.shared_hashes.end(),
                   seq->block_hashes.begin()))) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the ", shared, " prefix blocks shared by the reservation of request ",
        seq->request.id.value, " are not the prompt's"));
  }
  seq->tokens.push_back(first_token);
  seq->num_computed = prompt_len;
  seq->num_reported = prompt_len;
  seq->blocks = std::move(reserved.blocks);
  seq->num_hashed = shared;  // Registered already.
  prefix_cached_tokens_ += static_cast<int64_t>(shared) * bs;
  reservations_.erase(it);
  HashComputedBlocks(*seq);
  Enqueue(std::move(seq));
  return absl::OkStatus();
}

void Generator::ReleaseKv(RequestId id) {
  if (auto it = held_kv_.find(id); it != held_kv_.end()) {
    pool_.Release(it->second);
    held_kv_.erase(it);
  }
}

int64_t Generator::num_pending_prompt_tokens() const {
  int64_t n = 0;
  auto pending = [](const Sequence& s) {
    return std::max<int64_t>(0, static_cast<int64_t>(s.request.prompt.size()) - s.num_computed);
  };
  for (const auto& s : waiting_) n += pending(*s);
  for (const auto& s : running_) n += pending(*s);
  return n;
}

void Generator::Cancel(RequestId id) {
  auto match = [&](const std::unique_ptr<Sequence>& s) { return s->request.id == id; };
  if (auto it = std::find_if(waiting_.begin(), waiting_.end(), match); it != waiting_.end()) {
    if (!(*it)->blocks.empty()) FreeBlocks(**it);  // Prefilled: it waits with its blocks.
    waiting_.erase(it);
    cancelled_.push_back(id);
  } else if (auto rit = std::find_if(running_.begin(), running_.end(), match);
             rit != running_.end()) {
    FreeBlocks(**rit);
    running_.erase(rit);
    cancelled_.push_back(id);
  }
}

void Generator::Enqueue(std::unique_ptr<Sequence> seq) {
  // Behind every waiting request that arrived no later (a 0 arrival stops
  // the search: it holds its place).
  const int64_t arrival = seq->request.arrival_unix_us;
  auto pos = waiting_.end();
  while (arrival > 0 && pos != waiting_.begin() &&
         (*std::prev(pos))->request.arrival_unix_us > arrival) {
    --pos;
  }
  waiting_.insert(pos, std::move(seq));
}

void Generator::Admit() {
  while (!waiting_.empty() && static_cast<int32_t>(running_.size()) < options_.max_running) {
    Sequence& s = *waiting_.front();
    if (!s.blocks.empty()) {  // Prefilled elsewhere; its blocks are reserved.
      running_.push_back(std::move(waiting_.front()));
      waiting_.pop_front();
      continue;
    }
    // Shared prefix blocks first. The prompt's last token is always
    // computed (its logits are needed), so its block is never shared.
    const int32_t bs = runner_->kv_layout().block_size;
    const size_t shareable =
        s.request.sampling.prompt_logprobs
            ? 0  // Every prompt position's logits are needed.
            : std::min(s.block_hashes.size(), (s.request.prompt.size() - 1) / static_cast<size_t>(bs));
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

void Generator::HashComputedBlocks(Sequence& s) {
  const size_t full = static_cast<size_t>(s.num_computed) / runner_->kv_layout().block_size;
  for (; s.num_hashed < std::min(full, s.block_hashes.size()); ++s.num_hashed) {
    pool_.SetHash(s.blocks[s.num_hashed], s.block_hashes[s.num_hashed]);
  }
}

void Generator::AddPromptLogprobs(Sequence& s, int32_t start, std::span<const float> rows) {
  const int32_t vocab = runner_->model().config().vocab_size;
  const int32_t top_n = *s.request.sampling.prompt_logprobs;
  const std::vector<int32_t>& prompt = s.request.prompt;
  const int32_t num_rows = static_cast<int32_t>(rows.size() / vocab);
  for (int32_t j = 0; j < num_rows; ++j) {
    const int32_t pos = start + j + 1;
    if (pos >= static_cast<int32_t>(prompt.size())) break;  // The sampling row.
    FillLogprobs(rows.subspan(static_cast<size_t>(j) * vocab, vocab), prompt[pos], top_n,
                 logprob_scratch_, s.prompt_logprobs.emplace_back());
  }
}

bool Generator::SampleNext(Sequence& s, std::span<const float> logits,
                           std::vector<GenerationEvent>& events) {
  GenerationEvent& e = events.emplace_back();
  e.id = s.request.id;
  e.has_token = true;
  const std::span<const int32_t> tokens = s.tokens;
  const size_t prompt_len = s.request.prompt.size();
  // The penalties see a resumed request's earlier tokens as output.
  const size_t original_prompt_len = prompt_len - s.request.resumed_tokens;
  e.token = s.sampler->Sample(logits, tokens.first(original_prompt_len),
                              tokens.subspan(original_prompt_len));
  if (s.tokens.size() == prompt_len) e.prompt_logprobs = std::move(s.prompt_logprobs);
  s.tokens.push_back(e.token.token);
  const int32_t generated = static_cast<int32_t>(s.tokens.size() - s.request.prompt.size());
  if (IsStopToken(s, e.token.token)) {
    e.finish = FinishReason::kStop;
  } else if (generated >= s.request.sampling.max_tokens) {
    e.finish = FinishReason::kLength;
  }
  return e.finish != FinishReason::kNone || s.request.hold_kv;
}

void Generator::FreeBlocks(Sequence& s) {
  if (s.request.hold_kv) {
    held_kv_[s.request.id] = std::move(s.blocks);
  } else {
    pool_.Release(s.blocks);
  }
  s.blocks.clear();
}

void Generator::ReportLayer(int32_t layer) { kv_observer_(layer, computed_); }

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
                                .block_table = s->blocks,
                                .all_logits = s->request.sampling.prompt_logprobs.has_value()});
    computed_prompt_tokens_ += n;
    batch_seqs_.push_back(s.get());
    budget -= n;
  }

  computed_.clear();
  batch_.on_layer_kv_written = nullptr;
  if (kv_observer_) {
    for (size_t i = 0; i < batch_seqs_.size(); ++i) {
      const Sequence& s = *batch_seqs_[i];
      computed_.push_back({.id = s.request.id,
                           .block_table = s.blocks,
                           .begin = s.num_reported,
                           .end = s.num_computed +
                                  static_cast<int32_t>(batch_.sequences[i].tokens.size())});
    }
    batch_.on_layer_kv_written = [this](int32_t layer) { ReportLayer(layer); };
  }

  const int32_t vocab = runner_->model().config().vocab_size;
  logits_.resize(ModelRunner::NumLogitsRows(batch_) * vocab);
  PD_RETURN_IF_ERROR(runner_->Forward(batch_, logits_));

  bool any_finished = false;
  size_t row = 0;  // First logits row of sequence i.
  for (size_t i = 0; i < batch_seqs_.size(); ++i) {
    Sequence& s = *batch_seqs_[i];
    const SequenceInput& input = batch_.sequences[i];
    const size_t rows = input.all_logits ? input.tokens.size() : 1;
    const std::span<const float> logits = std::span(logits_).subspan(row * vocab, rows * vocab);
    row += rows;
    if (input.all_logits) AddPromptLogprobs(s, input.start_pos, logits);
    s.num_computed += static_cast<int32_t>(input.tokens.size());
    s.num_reported = s.num_computed;
    HashComputedBlocks(s);  // Prompt blocks now complete become shareable.
    if (s.num_computed < static_cast<int32_t>(s.request.prompt.size())) continue;  // Mid-prompt.
    if (SampleNext(s, logits.last(vocab), events)) {
      FreeBlocks(s);
      any_finished = true;
    }
  }
  if (any_finished) {
    std::erase_if(running_, [](const std::unique_ptr<Sequence>& s) { return s->blocks.empty(); });
  }
  return absl::OkStatus();
}

}  // namespace pdserve
