#include "engine/model_runner.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "engine/cpu/cpu_model_runner.h"
#ifdef PDSERVE_HAVE_CUDA
#include "engine/cuda/cuda_model_runner.h"
#endif

namespace pdserve {
namespace {

struct BackendEntry {
  const char* name;
  absl::StatusOr<std::unique_ptr<ModelRunner>> (*create)(std::shared_ptr<const Model>,
                                                         const ModelRunnerOptions&);
};

// The registry of backends built into this binary.
constexpr BackendEntry kBackends[] = {
    {"cpu", &CreateCpuModelRunner},
#ifdef PDSERVE_HAVE_CUDA
    {"cuda", &CreateCudaModelRunner},
#endif
};

}  // namespace

absl::StatusOr<std::span<std::byte>> ModelRunner::KvHostStaging() {
  if (kv_memory_kind() != KvMemoryKind::kHost) {
    return absl::UnimplementedError("this backend has no host staging for its KV pool");
  }
  return kv_memory();
}

absl::Status ModelRunner::CopyKvToHostStaging(std::span<const KvByteRange> ranges) {
  return ValidateKvRanges(ranges);  // The staging is the pool itself.
}

absl::Status ModelRunner::CopyKvFromHostStaging(std::span<const KvByteRange> ranges) {
  return ValidateKvRanges(ranges);
}

absl::Status ModelRunner::ValidateKvRanges(std::span<const KvByteRange> ranges) {
  const size_t pool = kv_memory().size();
  for (const KvByteRange& r : ranges) {
    if (r.offset > pool || r.length > pool - r.offset) {
      return absl::InvalidArgumentError(absl::StrCat("KV range [", r.offset, ", +", r.length,
                                                     ") is outside the pool of ", pool, " bytes"));
    }
  }
  return absl::OkStatus();
}

size_t ModelRunner::NumLogitsRows(const ForwardBatch& batch) {
  size_t rows = 0;
  for (const SequenceInput& s : batch.sequences) rows += s.all_logits ? s.tokens.size() : 1;
  return rows;
}

absl::Status ModelRunner::ValidateBatch(const ForwardBatch& batch,
                                        std::span<const float> logits) const {
  const ModelConfig& c = model().config();
  const int32_t block_size = kv_layout().block_size;
  if (batch.sequences.empty()) return absl::InvalidArgumentError("empty batch");
  for (size_t i = 0; i < batch.sequences.size(); ++i) {
    const SequenceInput& s = batch.sequences[i];
    if (s.tokens.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", i, " has no tokens"));
    }
    for (int32_t t : s.tokens) {
      if (t < 0 || t >= c.vocab_size) {
        return absl::InvalidArgumentError(absl::StrCat(
            "sequence ", i, ": token id ", t, " outside [0, ", c.vocab_size, ")"));
      }
    }
    const int64_t end = static_cast<int64_t>(s.start_pos) + s.tokens.size();
    if (s.start_pos < 0 || end > c.max_position_embeddings) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sequence ", i, ": positions [", s.start_pos, ", ", end,
          ") outside the model's context of ", c.max_position_embeddings));
    }
    const int64_t blocks_needed = BlocksForTokens(end, block_size);
    if (static_cast<int64_t>(s.block_table.size()) < blocks_needed) {
      return absl::InvalidArgumentError(absl::StrCat(
          "sequence ", i, ": block table has ", s.block_table.size(), " blocks, ",
          blocks_needed, " needed for ", end, " positions"));
    }
    for (int64_t b = 0; b < blocks_needed; ++b) {
      if (s.block_table[b].value < 0 || s.block_table[b].value >= num_kv_blocks()) {
        return absl::InvalidArgumentError(absl::StrCat(
            "sequence ", i, ": block id ", s.block_table[b].value, " outside the pool of ",
            num_kv_blocks()));
      }
    }
  }
  const size_t want = NumLogitsRows(batch) * static_cast<size_t>(c.vocab_size);
  if (logits.size() != want) {
    return absl::InvalidArgumentError(
        absl::StrCat("logits buffer holds ", logits.size(), " floats, ", want, " needed"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<ModelRunner>> CreateModelRunner(
    std::shared_ptr<const Model> model, const ModelRunnerOptions& options) {
  for (const BackendEntry& b : kBackends) {
    if (options.backend == b.name) return b.create(std::move(model), options);
  }
  return absl::NotFoundError(absl::StrCat("backend '", options.backend,
                                          "' is not built into this binary (available: ",
                                          absl::StrJoin(AvailableBackends(), ", "), ")"));
}

std::vector<std::string> AvailableBackends() {
  std::vector<std::string> names;
  for (const BackendEntry& b : kBackends) names.push_back(b.name);
  return names;
}

}  // namespace pdserve
