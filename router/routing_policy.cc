#include "router/routing_policy.h"

#include <algorithm>
#include <atomic>
#include <functional>
#include <limits>
#include <map>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace pdserve {
namespace {

int64_t CeilDiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

int64_t Busy(const WorkerLoad& w) {
  return w.running + w.waiting + w.dispatched_requests;
}

// Index of the smallest key over `n` candidates, scanning from `start` so
// that ties rotate; -1 when n is 0 or `key` refuses every candidate
// (returns nullopt-like: skip marks it).
template <typename Key>
int ArgMin(size_t n, uint64_t start, const std::function<bool(int, Key*)>& key) {
  int best = -1;
  Key best_key{};
  for (size_t k = 0; k < n; ++k) {
    const int i = static_cast<int>((start + k) % n);
    Key v;
    if (!key(i, &v)) continue;
    if (best < 0 || v < best_key) {
      best = i;
      best_key = v;
    }
  }
  return best;
}

class RoundRobinPolicy final : public RoutingPolicy {
 public:
  const std::string& name() const override { return name_; }
  RoutingChoice Choose(const RoutingInput& in) override {
    RoutingChoice c;
    if (!in.decode.empty()) c.decode = static_cast<int>(next_decode_++ % in.decode.size());
    if (!in.prefill.empty()) {
      c.prefill = static_cast<int>(next_prefill_++ % in.prefill.size());
    }
    return c;
  }

 private:
  const std::string name_ = "round_robin";
  std::atomic<uint64_t> next_decode_ = 0;
  std::atomic<uint64_t> next_prefill_ = 0;
};

class LeastLoadedPolicy final : public RoutingPolicy {
 public:
  const std::string& name() const override { return name_; }
  RoutingChoice Choose(const RoutingInput& in) override {
    using Key = std::tuple<int64_t, int64_t>;
    const uint64_t start = rotation_++;
    RoutingChoice c;
    c.decode = ArgMin<Key>(in.decode.size(), start, [&](int i, Key* k) {
      const WorkerLoad& w = in.decode[i];
      *k = {-(w.free_blocks - w.dispatched_blocks), Busy(w)};
      return true;
    });
    c.prefill = ArgMin<Key>(in.prefill.size(), start, [&](int i, Key* k) {
      const WorkerLoad& w = in.prefill[i];
      *k = {w.pending_prompt_tokens + w.dispatched_tokens, Busy(w)};
      return true;
    });
    return c;
  }

 private:
  const std::string name_ = "least_loaded";
  std::atomic<uint64_t> rotation_ = 0;
};

class KvAwarePolicy final : public RoutingPolicy {
 public:
  explicit KvAwarePolicy(const RoutingOptions& options) : options_(options) {}
  const std::string& name() const override { return name_; }

  RoutingChoice Choose(const RoutingInput& in) override {
    const uint64_t start = rotation_++;
    RoutingChoice c;
    if (in.decode.empty()) return c;
    const int64_t bs = std::max(in.block_size, 1);
    const int64_t prompt = std::max(in.prompt_tokens, 1);
    // Blocks a worker can share: never the last token's.
    const int64_t shareable = (prompt - 1) / bs;
    const int64_t prompt_blocks = CeilDiv(prompt, bs);
    const int64_t needed = CeilDiv(prompt + std::max(in.max_tokens, 0), bs);
    auto cached = [&](const WorkerLoad& w) {
      return std::clamp<int64_t>(w.cached_blocks, 0, shareable);
    };
    auto uncached = [&](const WorkerLoad& w) { return prompt - cached(w) * bs; };
    auto feasible = [&](const WorkerLoad& d) {
      return d.free_blocks - d.dispatched_blocks >= needed - cached(d);
    };
    auto decode_load = [&](const WorkerLoad& d) {
      return options_.decode_request_cost_tokens * static_cast<double>(Busy(d));
    };
    auto local_cost = [&](const WorkerLoad& d) {
      return static_cast<double>(d.pending_prompt_tokens + uncached(d)) + decode_load(d);
    };
    auto prefill_cost = [&](const WorkerLoad& p) {
      return static_cast<double>(p.pending_prompt_tokens + p.dispatched_tokens + uncached(p));
    };
    auto pair_cost = [&](const WorkerLoad& p, const WorkerLoad& d) {
      return prefill_cost(p) +
             options_.block_move_cost_tokens * static_cast<double>(prompt_blocks - cached(d)) +
             decode_load(d);
    };
    const size_t nd = in.decode.size();
    const size_t np = in.prefill.size();
    bool any_feasible = false;
    for (const WorkerLoad& d : in.decode) any_feasible |= feasible(d);

    // 1. Short uncached part on a feasible D: it prefills itself.
    c.decode = ArgMin<double>(nd, start, [&](int i, double* k) {
      const WorkerLoad& d = in.decode[i];
      if (!feasible(d) || uncached(d) > options_.local_prefill_max_tokens) return false;
      *k = local_cost(d);
      return true;
    });
    if (c.decode >= 0) return c;
    if (!any_feasible) {  // The most free blocks; its Reserve decides.
      c.decode = ArgMin<int64_t>(nd, start, [&](int i, int64_t* k) {
        *k = -(in.decode[i].free_blocks - in.decode[i].dispatched_blocks);
        return true;
      });
    }
    if (np == 0) {
      if (c.decode < 0) {
        c.decode = ArgMin<double>(nd, start, [&](int i, double* k) {
          if (!feasible(in.decode[i])) return false;
          *k = local_cost(in.decode[i]);
          return true;
        });
      }
      return c;
    }
    // 2. The cheapest pair, or local prefill when the prefill workers are
    // the bottleneck.
    bool bottleneck = true;
    for (const WorkerLoad& p : in.prefill) {
      bottleneck &= p.pending_prompt_tokens + p.dispatched_tokens >
                    options_.prefill_queue_limit_tokens;
    }
    double best = std::numeric_limits<double>::infinity();
    for (size_t k = 0; k < nd; ++k) {
      const int i = static_cast<int>((start + k) % nd);
      const WorkerLoad& d = in.decode[i];
      if (c.decode >= 0 && !any_feasible && i != c.decode) continue;
      if (any_feasible && !feasible(d)) continue;
      for (size_t m = 0; m < np; ++m) {
        const int j = static_cast<int>((start + m) % np);
        const double cost = pair_cost(in.prefill[j], d);
        if (cost < best) {
          best = cost;
          c = {.decode = i, .prefill = j};
        }
      }
      if (bottleneck && d.waiting == 0 && feasible(d) && local_cost(d) < best) {
        best = local_cost(d);
        c = {.decode = i, .prefill = -1};
      }
    }
    return c;
  }

 private:
  const std::string name_ = "kv_aware";
  const RoutingOptions options_;
  std::atomic<uint64_t> rotation_ = 0;
};

using Factory = std::function<std::unique_ptr<RoutingPolicy>(const RoutingOptions&)>;

const std::map<std::string, Factory>& Registry() {
  static const auto* registry = new std::map<std::string, Factory>{
      {"round_robin",
       [](const RoutingOptions&) { return std::make_unique<RoundRobinPolicy>(); }},
      {"least_loaded",
       [](const RoutingOptions&) { return std::make_unique<LeastLoadedPolicy>(); }},
      {"kv_aware",
       [](const RoutingOptions& o) { return std::make_unique<KvAwarePolicy>(o); }},
  };
  return *registry;
}

absl::Status CheckOptions(const RoutingOptions& o) {
  if (!Registry().contains(o.policy)) {
    return absl::NotFoundError(absl::StrCat("unknown routing policy '", o.policy,
                                            "'; known: ",
                                            absl::StrJoin(RoutingPolicyNames(), ", ")));
  }
  if (o.local_prefill_max_tokens < 0 || o.prefill_queue_limit_tokens < 0 ||
      !(o.block_move_cost_tokens >= 0) || !(o.decode_request_cost_tokens >= 0)) {
    return absl::InvalidArgumentError(
        "routing thresholds and costs must be non-negative numbers");
  }
  return absl::OkStatus();
}

}  // namespace

std::vector<std::string> RoutingPolicyNames() {
  std::vector<std::string> names;
  for (const auto& [name, factory] : Registry()) names.push_back(name);
  return names;
}

absl::StatusOr<std::unique_ptr<RoutingPolicy>> CreateRoutingPolicy(
    const RoutingOptions& options) {
  if (absl::Status s = CheckOptions(options); !s.ok()) return s;
  return Registry().at(options.policy)(options);
}

absl::StatusOr<RoutingOptions> RoutingOptionsFromConfig(
    const internal::v1::RoutingConfig& config) {
  RoutingOptions o;
  if (!config.policy().empty()) o.policy = config.policy();
  if (config.has_local_prefill_max_tokens()) {
    o.local_prefill_max_tokens = config.local_prefill_max_tokens();
  }
  if (config.has_prefill_queue_limit_tokens()) {
    o.prefill_queue_limit_tokens = config.prefill_queue_limit_tokens();
  }
  if (config.has_block_move_cost_tokens()) {
    o.block_move_cost_tokens = config.block_move_cost_tokens();
  }
  if (config.has_decode_request_cost_tokens()) {
    o.decode_request_cost_tokens = config.decode_request_cost_tokens();
  }
  if (absl::Status s = CheckOptions(o); !s.ok()) {
    return absl::InvalidArgumentError(absl::StrCat("routing: ", s.message()));
  }
  return o;
}

}  // namespace pdserve
