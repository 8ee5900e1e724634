#include "planner/sim/simulated_generator.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "engine/kv_layout.h"
#include "planner/profile.h"

namespace pdserve::planner {

SimulatedGenerator::SimulatedGenerator(int32_t num_blocks, int32_t block_size,
                                       int32_t max_batch_tokens, int32_t max_running)
    : block_size_(block_size),
      max_batch_tokens_(max_batch_tokens),
      max_running_(max_running),
      pool_(num_blocks) {
  pool_.set_record_events(true);  // The router's KV index reads them.
}

int64_t SimulatedGenerator::BlocksForTokens(int64_t tokens) const {
  return pdserve::BlocksForTokens(tokens, block_size_);
}

void SimulatedGenerator::Add(const SimRequest& request) {
  auto s = std::make_unique<Sequence>();
  s->request = request;
  waiting_.push_back(std::move(s));
}

absl::StatusOr<int32_t> SimulatedGenerator::Reserve(int64_t id, int32_t num_tokens,
                                                    int32_t prompt_tokens,
                                                    std::span<const uint64_t> block_hashes) {
  Reserved reserved;
  if (prompt_tokens > 0) {
    // As Admit: the block of the prompt's last token is never shared.
    const size_t shareable =
        std::min(block_hashes.size(), static_cast<size_t>((prompt_tokens - 1) / block_size_));
    while (reserved.blocks.size() < shareable) {
      const std::optional<BlockId> hit = pool_.LookupPrefix(block_hashes[reserved.blocks.size()]);
      if (!hit) break;
      reserved.blocks.push_back(*hit);
    }
  }
  reserved.shared = reserved.blocks.size();
  const int64_t total = BlocksForTokens(num_tokens);
  auto fresh = pool_.Allocate(static_cast<int32_t>(total - reserved.shared));
  if (!fresh.ok()) {
    pool_.Release(reserved.blocks);
    return fresh.status();
  }
  reserved.blocks.insert(reserved.blocks.end(), fresh->begin(), fresh->end());
  const int32_t cached = static_cast<int32_t>(reserved.shared) * block_size_;
  reservations_[id] = std::move(reserved);
  return cached;
}

void SimulatedGenerator::ReleaseReservation(int64_t id) {
  if (auto it = reservations_.find(id); it != reservations_.end()) {
    pool_.Release(it->second.blocks);
    reservations_.erase(it);
  }
}

absl::Status SimulatedGenerator::AddPrefilled(const SimRequest& request) {
  auto it = reservations_.find(request.id);
  if (it == reservations_.end()) {
    return absl::NotFoundError(absl::StrCat("no KV reservation for request ", request.id));
  }
  if (static_cast<int64_t>(it->second.blocks.size()) <
      BlocksForTokens(static_cast<int64_t>(request.prompt_tokens) + request.max_tokens)) {
    return absl::InvalidArgumentError(
        absl::StrCat("the reservation of request ", request.id, " is smaller than its budget"));
  }
  auto s = std::make_unique<Sequence>();
  s->request = request;
  s->num_computed = request.prompt_tokens;
  s->num_reported = request.prompt_tokens;
  s->generated = 1;
  s->blocks = std::move(it->second.blocks);
  s->num_hashed = it->second.shared;  // Registered already.
  reservations_.erase(it);
  HashComputedBlocks(*s);
  waiting_.push_back(std::move(s));
  return absl::OkStatus();
}

void SimulatedGenerator::ReleaseKv(int64_t id) {
  if (auto it = held_kv_.find(id); it != held_kv_.end()) {
    pool_.Release(it->second);
    held_kv_.erase(it);
  }
}

int64_t SimulatedGenerator::num_pending_prompt_tokens() const {
  int64_t n = 0;
  auto pending = [](const Sequence& s) {
    return std::max<int64_t>(0, s.request.prompt_tokens - s.num_computed);
  };
  for (const auto& s : waiting_) n += pending(*s);
  for (const auto& s : running_) n += pending(*s);
  return n;
}

void SimulatedGenerator::Admit() {
  while (!waiting_.empty() && static_cast<int32_t>(running_.size()) < max_running_) {
    Sequence& s = *waiting_.front();
    if (!s.blocks.empty()) {  // Prefilled elsewhere; its blocks are reserved.
      running_.push_back(std::move(waiting_.front()));
      waiting_.pop_front();
      continue;
    }
    // Shared prefix blocks first; never the block of the prompt's last token.
    const size_t shareable =
        std::min(s.request.block_hashes.size(),
                 static_cast<size_t>((s.request.prompt_tokens - 1) / block_size_));
    std::vector<BlockId> blocks;
    while (blocks.size() < shareable) {
      const std::optional<BlockId> hit = pool_.LookupPrefix(s.request.block_hashes[blocks.size()]);
      if (!hit) break;
      blocks.push_back(*hit);
    }
    const int64_t budget =
        BlocksForTokens(static_cast<int64_t>(s.request.prompt_tokens) + s.request.max_tokens);
    auto fresh = pool_.Allocate(static_cast<int32_t>(budget - static_cast<int64_t>(blocks.size())));
    if (!fresh.ok()) {  // FIFO: wait for blocks to free up.
      pool_.Release(blocks);
      return;
    }
    s.num_computed = static_cast<int32_t>(blocks.size()) * block_size_;
    s.num_hashed = blocks.size();
    blocks.insert(blocks.end(), fresh->begin(), fresh->end());
    s.blocks = std::move(blocks);
    running_.push_back(std::move(waiting_.front()));
    waiting_.pop_front();
  }
}

void SimulatedGenerator::HashComputedBlocks(Sequence& s) {
  const size_t full = static_cast<size_t>(s.num_computed) / block_size_;
  for (; s.num_hashed < std::min(full, s.request.block_hashes.size()); ++s.num_hashed) {
    pool_.SetHash(s.blocks[s.num_hashed], s.request.block_hashes[s.num_hashed]);
  }
}

void SimulatedGenerator::FreeBlocks(Sequence& s) {
  if (s.request.hold_kv) {
    held_kv_[s.request.id] = std::move(s.blocks);
  } else {
    pool_.Release(s.blocks);
  }
  s.blocks.clear();
}

bool SimulatedGenerator::BeginStep(StepShape& shape) {
  Admit();
  batch_.clear();
  batch_seqs_.clear();
  shape = StepShape();
  if (running_.empty()) return false;
  int32_t budget = max_batch_tokens_;
  auto add = [&](Sequence& s, int32_t n, bool decode) {
    batch_.push_back({.id = s.request.id,
                      .start = s.num_computed,
                      .tokens = n,
                      .reported_from = s.num_reported});
    batch_seqs_.push_back(&s);
    shape.tokens += n;
    ++shape.sequences;
    (decode ? shape.decode_attention : shape.attention) += AttentionPairs(s.num_computed, n);
    budget -= n;
  };
  // Decode tokens first: every running sequence past its prompt advances.
  for (auto& s : running_) {
    if (s->num_computed >= s->request.prompt_tokens) add(*s, 1, true);
  }
  // Then prefill chunks, oldest first, while the budget lasts.
  for (auto& s : running_) {
    if (s->num_computed >= s->request.prompt_tokens || budget <= 0) continue;
    add(*s, std::min(budget, s->request.prompt_tokens - s->num_computed), false);
  }
  return true;
}

void SimulatedGenerator::EndStep(std::vector<SimEvent>& events) {
  bool any_finished = false;
  for (size_t i = 0; i < batch_seqs_.size(); ++i) {
    Sequence& s = *batch_seqs_[i];
    s.num_computed += batch_[i].tokens;
    s.num_reported = s.num_computed;
    HashComputedBlocks(s);  // Prompt blocks now complete become shareable.
    if (s.num_computed < s.request.prompt_tokens) continue;  // Mid-prompt.
    ++s.generated;
    const bool finished = s.generated >= s.request.max_tokens || s.request.hold_kv;
    events.push_back({.id = s.request.id, .generated = s.generated, .finished = finished});
    if (finished) {
      FreeBlocks(s);
      any_finished = true;
    }
  }
  batch_seqs_.clear();
  if (any_finished) {
    std::erase_if(running_, [](const std::unique_ptr<Sequence>& s) { return s->blocks.empty(); });
  }
}

}  // namespace pdserve::planner
