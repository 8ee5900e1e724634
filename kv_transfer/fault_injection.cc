#include "kv_transfer/fault_injection.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "common/log.h"

namespace pdserve::kv {
namespace {

// The longest delay a spec may ask for: past it a "delay" is a hang, which
// drop already models.
constexpr absl::Duration kMaxDelay = absl::Minutes(10);

struct FaultRule {
  bool on_notify = false;  // false: write batches.
  KvFaultAction action = KvFaultAction::kPass;
  absl::Duration delay = absl::ZeroDuration();
  double probability = 1.0;
};

// The hook a spec describes: rules tried in order, one seeded generator.
class SpecFaultHook final : public KvFaultHook {
 public:
  SpecFaultHook(std::vector<FaultRule> rules, uint64_t seed)
      : rules_(std::move(rules)), random_(seed) {}

  KvFault OnWrite(std::span<const WriteOp>) override { return Decide(false); }
  KvFault OnNotify(std::string_view, bool) override { return Decide(true); }

 private:
  KvFault Decide(bool on_notify) {
    absl::MutexLock lock(&mu_);
    for (const FaultRule& rule : rules_) {
      if (rule.on_notify != on_notify) continue;
      if (std::uniform_real_distribution<double>(0.0, 1.0)(random_) >=
          rule.probability)
        continue;
      return {.action = rule.action, .delay = rule.delay, .choice = random_()};
    }
    return {};
  }

  const std::vector<FaultRule> rules_;
  absl::Mutex mu_;
  std::mt19937_64 random_ ABSL_GUARDED_BY(mu_);
};

// (absl::string_view is not std::string_view in this build; the parser
// works in Abseil's, which its string functions take.)
absl::StatusOr<FaultRule> ParseRule(absl::string_view text) {
  const std::vector<absl::string_view> parts = absl::StrSplit(text, ':');
  auto error = [&](absl::string_view why) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_fault rule '", text, "': ", why));
  };
  FaultRule rule;
  if (parts[0] == "notify") {
    rule.on_notify = true;
  } else if (parts[0] != "write") {
    return error("must start with write: or notify:");
  }
  if (parts.size() < 2)
    return error("names no action (delay=DURATION, drop, truncate, corrupt)");
  const absl::string_view action = parts[1];
  if (absl::StartsWith(action, "delay=")) {
    rule.action = KvFaultAction::kDelay;
    if (!absl::ParseDuration(action.substr(6), &rule.delay) ||
        rule.delay <= absl::ZeroDuration() || rule.delay > kMaxDelay) {
      return error(
          "delay must be a duration such as 200ms, above 0 and at most 10m");
    }
  } else if (action == "drop") {
    rule.action = KvFaultAction::kDrop;
  } else if (action == "truncate") {
    rule.action = KvFaultAction::kTruncate;
  } else if (action == "corrupt") {
    rule.action = KvFaultAction::kCorrupt;
  } else {
    return error("unknown action (delay=DURATION, drop, truncate, corrupt)");
  }
  bool have_probability = false;
  for (size_t i = 2; i < parts.size(); ++i) {
    if (!absl::StartsWith(parts[i], "p=") || have_probability) {
      return error("after the action only one p=PROBABILITY may follow");
    }
    have_probability = true;
    if (!absl::SimpleAtod(parts[i].substr(2), &rule.probability) ||
        !std::isfinite(rule.probability) || rule.probability < 0.0 ||
        rule.probability > 1.0) {
      return error("p must be a number in [0, 1]");
    }
  }
  return rule;
}

// A prefix of `message` strictly shorter than it (empty stays empty).
void TruncateMessage(std::string& message, uint64_t choice) {
  if (!message.empty()) message.resize(choice % message.size());
}

// `message` with one byte changed (an empty one gains a byte).
void CorruptMessage(std::string& message, uint64_t choice) {
  if (message.empty()) {
    message.push_back('\xff');
    return;
  }
  // A nonzero mask, so the byte always changes.
  const auto mask = static_cast<char>(1 + (choice >> 32) % 255);
  message[choice % message.size()] ^= mask;
}

// The ops that carry the first `choice % total` bytes of `ops`, the last
// one cut short: fewer bytes than the batch holds.
std::vector<WriteOp> TruncatedPrefix(std::span<const WriteOp> ops,
                                     uint64_t choice) {
  uint64_t total = 0;
  for (const WriteOp& op : ops) total += op.length;
  uint64_t keep = total == 0 ? 0 : choice % total;
  std::vector<WriteOp> prefix;
  for (const WriteOp& op : ops) {
    if (keep == 0) break;
    WriteOp& kept = prefix.emplace_back(op);
    kept.length = std::min(op.length, keep);
    keep -= kept.length;
  }
  return prefix;
}

// `ops` with one op aimed somewhere the receiver must refuse.
std::vector<WriteOp> CorruptedBatch(std::span<const WriteOp> ops,
                                    uint64_t choice) {
  std::vector<WriteOp> batch(ops.begin(), ops.end());
  if (batch.empty()) return batch;
  WriteOp& op = batch[choice % batch.size()];
  switch ((choice / batch.size()) % 3) {
    case 0:  // A region the receiver never registered.
      op.remote_region = RegionId(op.remote_region.value ^ 0x40000000u);
      break;
    case 1:  // Far past the end of any region.
      op.remote_offset = uint64_t{1} << 62;
      break;
    default:  // An end that wraps around when added up naively.
      op.remote_offset = std::numeric_limits<uint64_t>::max() - op.length / 2;
      break;
  }
  return batch;
}

// One log line per fault that changes what arrives (delays are left out:
// a spec may delay every write), so a test can tell from a worker's log
// that its faults fired.
void LogFault(const KvFault& fault, std::string_view what) {
  if (fault.action == KvFaultAction::kPass ||
      fault.action == KvFaultAction::kDelay)
    return;
  PD_LOG(WARNING) << "kv_fault: " << KvFaultActionName(fault.action) << " "
                  << what;
}

class FaultInjectingConnection final : public KvConnection {
 public:
  FaultInjectingConnection(std::unique_ptr<KvConnection> connection,
                           std::shared_ptr<KvFaultHook> hook,
                           absl::Duration io_timeout)
      : connection_(std::move(connection)),
        hook_(std::move(hook)),
        io_timeout_(io_timeout) {}

  absl::Status Write(std::span<const WriteOp> ops) override {
    if (connection_ == nullptr) return Closed();
    const KvFault fault = hook_->OnWrite(ops);
    LogFault(fault, "of a write batch sent");
    switch (fault.action) {
      case KvFaultAction::kPass:
        break;
      case KvFaultAction::kDelay:
        absl::SleepFor(fault.delay);
        break;
      case KvFaultAction::kDrop:
        return Lose("write");
      case KvFaultAction::kTruncate: {
        const std::vector<WriteOp> prefix = TruncatedPrefix(ops, fault.choice);
        if (!prefix.empty()) (void)connection_->Write(prefix);
        return Break("write");
      }
      case KvFaultAction::kCorrupt:
        return connection_->Write(CorruptedBatch(ops, fault.choice));
    }
    return connection_->Write(ops);
  }

  absl::Status Notify(std::string_view message) override {
    if (connection_ == nullptr) return Closed();
    const KvFault fault = hook_->OnNotify(message, /*received=*/false);
    LogFault(fault, "of a notification sent");
    std::string altered(message);
    switch (fault.action) {
      case KvFaultAction::kPass:
        break;
      case KvFaultAction::kDelay:
        absl::SleepFor(fault.delay);
        break;
      case KvFaultAction::kDrop:
        return Lose("notification");
      case KvFaultAction::kTruncate:
        TruncateMessage(altered, fault.choice);
        if (!altered.empty()) (void)connection_->Notify(altered);
        return Break("notification");
      case KvFaultAction::kCorrupt:
        CorruptMessage(altered, fault.choice);
        break;
    }
    return connection_->Notify(altered);
  }

 private:
  // A lost call: nothing reaches the peer, no acknowledgement comes back
  // within io_timeout, and the sender gives the connection up.
  absl::Status Lose(std::string_view what) {
    absl::SleepFor(io_timeout_);
    connection_.reset();
    return absl::DeadlineExceededError(absl::StrCat(
        "no acknowledgement of the ", std::string(what), " within ",
        absl::FormatDuration(io_timeout_), " (kv_fault: dropped)"));
  }

  // The connection failed part way through.
  absl::Status Break(std::string_view what) {
    connection_.reset();
    return absl::UnavailableError(absl::StrCat("connection lost during the ",
                                               std::string(what),
                                               " (kv_fault: truncated)"));
  }

  static absl::Status Closed() {
    return absl::UnavailableError(
        "connection closed after an injected fault (kv_fault)");
  }

  std::unique_ptr<KvConnection> connection_;  // Null once a fault closed it.
  const std::shared_ptr<KvFaultHook> hook_;
  const absl::Duration io_timeout_;
};

class FaultInjectingTransport final : public KvTransport {
 public:
  FaultInjectingTransport(std::unique_ptr<KvTransport> transport,
                          std::shared_ptr<KvFaultHook> hook,
                          absl::Duration io_timeout)
      : transport_(std::move(transport)),
        hook_(std::move(hook)),
        io_timeout_(io_timeout) {}

  const TransportCapabilities& capabilities() const override {
    return transport_->capabilities();
  }
  std::string endpoint() const override { return transport_->endpoint(); }
  absl::StatusOr<RegionId> RegisterMemory(
      std::span<std::byte> memory) override {
    return transport_->RegisterMemory(memory);
  }
  absl::Status DeregisterMemory(RegionId region) override {
    return transport_->DeregisterMemory(region);
  }
  void SetWriteFence(WriteFence* fence) override {
    transport_->SetWriteFence(fence);
  }

  absl::StatusOr<std::unique_ptr<KvConnection>> Connect(
      std::string_view endpoint) override {
    absl::StatusOr<std::unique_ptr<KvConnection>> connection =
        transport_->Connect(endpoint);
    if (!connection.ok()) return connection.status();
    return std::make_unique<FaultInjectingConnection>(*std::move(connection),
                                                      hook_, io_timeout_);
  }

  absl::StatusOr<Notification> WaitNotification(
      absl::Duration timeout) override {
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      absl::StatusOr<Notification> notification = transport_->WaitNotification(
          std::max(deadline - absl::Now(), absl::ZeroDuration()));
      if (!notification.ok()) return notification;
      const KvFault fault =
          hook_->OnNotify(notification->message, /*received=*/true);
      LogFault(fault, "of a notification received");
      switch (fault.action) {
        case KvFaultAction::kPass:
          return notification;
        case KvFaultAction::kDelay:
          absl::SleepFor(fault.delay);
          return notification;
        case KvFaultAction::kDrop:
          // Never delivered; wait on for the next one.
          if (absl::Now() >= deadline) {
            return absl::DeadlineExceededError(
                "no notification (kv_fault dropped one)");
          }
          continue;
        case KvFaultAction::kTruncate:
          TruncateMessage(notification->message, fault.choice);
          return notification;
        case KvFaultAction::kCorrupt:
          CorruptMessage(notification->message, fault.choice);
          return notification;
      }
    }
  }

 private:
  const std::unique_ptr<KvTransport> transport_;
  const std::shared_ptr<KvFaultHook> hook_;
  const absl::Duration io_timeout_;
};

}  // namespace

std::string_view KvFaultActionName(KvFaultAction action) {
  switch (action) {
    case KvFaultAction::kPass:
      return "pass";
    case KvFaultAction::kDelay:
      return "delay";
    case KvFaultAction::kDrop:
      return "drop";
    case KvFaultAction::kTruncate:
      return "truncate";
    case KvFaultAction::kCorrupt:
      return "corrupt";
  }
  return "unknown";
}

absl::StatusOr<std::shared_ptr<KvFaultHook>> ParseKvFaultSpec(
    std::string_view std_spec) {
  const absl::string_view spec(std_spec.data(), std_spec.size());
  if (spec.empty()) return absl::InvalidArgumentError("kv_fault spec is empty");
  std::vector<FaultRule> rules;
  uint64_t seed = 1;
  bool have_seed = false;
  for (absl::string_view item : absl::StrSplit(spec, ',')) {
    if (item.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("kv_fault spec '", spec, "' has an empty rule"));
    }
    if (absl::StartsWith(item, "seed=")) {
      if (have_seed || !absl::SimpleAtoi(item.substr(5), &seed)) {
        return absl::InvalidArgumentError(
            absl::StrCat("kv_fault '", item,
                         "': give one seed=N, N a non-negative integer"));
      }
      have_seed = true;
      continue;
    }
    absl::StatusOr<FaultRule> rule = ParseRule(item);
    if (!rule.ok()) return rule.status();
    rules.push_back(*rule);
  }
  if (rules.empty()) {
    return absl::InvalidArgumentError(
        absl::StrCat("kv_fault spec '", spec, "' has a seed but no rule"));
  }
  return std::make_shared<SpecFaultHook>(std::move(rules), seed);
}

std::unique_ptr<KvTransport> WrapKvTransportWithFaults(
    std::unique_ptr<KvTransport> transport, std::shared_ptr<KvFaultHook> hook,
    absl::Duration io_timeout) {
  return std::make_unique<FaultInjectingTransport>(std::move(transport),
                                                   std::move(hook), io_timeout);
}

absl::StatusOr<std::unique_ptr<KvTransport>> CreateKvTransportWithFaults(
    std::string_view name, const TransportOptions& options,
    std::string_view fault_spec) {
  std::shared_ptr<KvFaultHook> hook;
  if (!fault_spec.empty()) {
    absl::StatusOr<std::shared_ptr<KvFaultHook>> parsed =
        ParseKvFaultSpec(fault_spec);
    if (!parsed.ok()) return parsed.status();
    hook = *std::move(parsed);
  }
  absl::StatusOr<std::unique_ptr<KvTransport>> transport =
      CreateKvTransport(name, options);
  if (!transport.ok() || hook == nullptr) return transport;
  return WrapKvTransportWithFaults(*std::move(transport), std::move(hook),
                                   options.io_timeout);
}

}  // namespace pdserve::kv
