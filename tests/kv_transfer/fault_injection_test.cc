// The fault-injecting transport wrapper over every host-memory transport:
// what each fault does to the bytes and notifications that reach the peer
// and to what the sender is told, and the spec parser behind --kv_fault.
#include "kv_transfer/fault_injection.h"

#include <algorithm>
#include <cstring>
#include <deque>
#include <random>

#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "tests/kv_transfer/transport_names.h"

// UCX 1.13's own allocations on a failed shared-memory endpoint (see
// transport_test.cc); nothing of ours is left out.
extern "C" const char* __lsan_default_suppressions() {
  return "leak:uct_mm_ep_t_new\nleak:libuct.so\nleak:ucs_malloc\n";
}

namespace pdserve::kv {
namespace {

constexpr absl::Duration kIoTimeout = absl::Milliseconds(300);

// A hook the test scripts: each call takes the next fault queued for its
// kind (pass once the queue is empty) and is recorded.
class ScriptedFaultHook final : public KvFaultHook {
 public:
  void QueueWrite(KvFault fault) {
    absl::MutexLock lock(&mu_);
    writes_.push_back(fault);
  }
  void QueueNotify(KvFault fault) {
    absl::MutexLock lock(&mu_);
    notifies_.push_back(fault);
  }
  KvFault OnWrite(std::span<const WriteOp>) override { return Next(writes_); }
  KvFault OnNotify(std::string_view, bool) override { return Next(notifies_); }

 private:
  KvFault Next(std::deque<KvFault>& queue) {
    absl::MutexLock lock(&mu_);
    if (queue.empty()) return {};
    KvFault fault = queue.front();
    queue.pop_front();
    return fault;
  }
  absl::Mutex mu_;
  std::deque<KvFault> writes_ ABSL_GUARDED_BY(mu_);
  std::deque<KvFault> notifies_ ABSL_GUARDED_BY(mu_);
};

// A sender wrapped with `sender_hook_`, a receiver wrapped with
// `receiver_hook_`, 4 KiB of patterned source and zeroed destination.
class FaultInjectionTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    TransportOptions options;
    options.io_timeout = kIoTimeout;
    options.max_frame_bytes = 1024;  // Several frames per op.
    auto sender = CreateKvTransport(GetParam(), options);
    auto receiver = CreateKvTransport(GetParam(), options);
    ASSERT_TRUE(sender.ok()) << sender.status();
    ASSERT_TRUE(receiver.ok()) << receiver.status();
    sender_ =
        WrapKvTransportWithFaults(*std::move(sender), sender_hook_, kIoTimeout);
    receiver_ = WrapKvTransportWithFaults(*std::move(receiver), receiver_hook_,
                                          kIoTimeout);
    std::mt19937 rng(3);
    for (auto& b : src_)
      b = static_cast<std::byte>(1 + rng() % 255);  // Never 0.
    auto local = sender_->RegisterMemory(src_);
    auto remote = receiver_->RegisterMemory(dst_);
    ASSERT_TRUE(local.ok() && remote.ok());
    local_ = *local;
    remote_ = *remote;
  }

  std::unique_ptr<KvConnection> Connect() {
    auto connection = sender_->Connect(receiver_->endpoint());
    EXPECT_TRUE(connection.ok()) << connection.status();
    return connection.ok() ? *std::move(connection) : nullptr;
  }

  // Two ops of 2 KiB: src [0, 2K) -> dst [2K, 4K) and src [2K, 4K) -> dst [0,
  // 2K).
  std::vector<WriteOp> TwoOps() const {
    return {{local_, 0, remote_, 2048, 2048}, {local_, 2048, remote_, 0, 2048}};
  }
  bool DestinationUntouched() const {
    return std::all_of(dst_.begin(), dst_.end(),
                       [](std::byte b) { return b == std::byte{0}; });
  }
  // How many bytes of TwoOps' data landed, in write order, before the
  // first untouched byte; -1 if a landed byte differs from its source.
  int64_t LandedPrefix() const {
    int64_t landed = 0;
    for (const WriteOp& op : TwoOps()) {
      for (uint64_t i = 0; i < op.length; ++i) {
        const std::byte got = dst_[op.remote_offset + i];
        if (got == std::byte{0}) return landed;
        if (got != src_[op.local_offset + i]) return -1;
        ++landed;
      }
    }
    return landed;
  }

  std::shared_ptr<ScriptedFaultHook> sender_hook_ =
      std::make_shared<ScriptedFaultHook>();
  std::shared_ptr<ScriptedFaultHook> receiver_hook_ =
      std::make_shared<ScriptedFaultHook>();
  std::unique_ptr<KvTransport> sender_, receiver_;
  std::vector<std::byte> src_ = std::vector<std::byte>(4096);
  std::vector<std::byte> dst_ = std::vector<std::byte>(4096, std::byte{0});
  RegionId local_, remote_;
};

TEST_P(FaultInjectionTest, WithoutFaultsBytesAndNotificationsGoThrough) {
  auto connection = Connect();
  ASSERT_NE(connection, nullptr);
  // The wrapper is invisible to negotiation: it reports the wrapped
  // transport's capabilities.
  auto plain = CreateKvTransport(GetParam(), {});
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(sender_->capabilities().name, (*plain)->capabilities().name);
  ASSERT_TRUE(connection->Write(TwoOps()).ok());
  ASSERT_TRUE(connection->Notify("done").ok());
  auto notification = receiver_->WaitNotification(absl::Seconds(5));
  ASSERT_TRUE(notification.ok()) << notification.status();
  EXPECT_EQ(notification->message, "done");
  EXPECT_EQ(LandedPrefix(), 4096);
}

TEST_P(FaultInjectionTest, DelayedWriteWaitsThenLands) {
  sender_hook_->QueueWrite(
      {.action = KvFaultAction::kDelay, .delay = absl::Milliseconds(200)});
  auto connection = Connect();
  ASSERT_NE(connection, nullptr);
  const absl::Time start = absl::Now();
  ASSERT_TRUE(connection->Write(TwoOps()).ok());
  EXPECT_GE(absl::Now() - start, absl::Milliseconds(200));
  EXPECT_EQ(LandedPrefix(), 4096);
}

TEST_P(FaultInjectionTest, DroppedWriteNeverLandsAndTheSenderTimesOut) {
  sender_hook_->QueueWrite({.action = KvFaultAction::kDrop});
  auto connection = Connect();
  ASSERT_NE(connection, nullptr);
  const absl::Time start = absl::Now();
  EXPECT_EQ(connection->Write(TwoOps()).code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_GE(absl::Now() - start, kIoTimeout);
  // The connection is given up: nothing more goes through it.
  EXPECT_EQ(connection->Write(TwoOps()).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(connection->Notify("late").code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(
      receiver_->WaitNotification(absl::Milliseconds(100)).status().code(),
      absl::StatusCode::kDeadlineExceeded);
  EXPECT_TRUE(DestinationUntouched());
}

TEST_P(FaultInjectionTest, DroppedNotificationIsNeverDelivered) {
  sender_hook_->QueueNotify({.action = KvFaultAction::kDrop});
  auto connection = Connect();
  ASSERT_NE(connection, nullptr);
  ASSERT_TRUE(connection->Write(TwoOps()).ok());
  EXPECT_EQ(connection->Notify("done").code(),
            absl::StatusCode::kDeadlineExceeded);
  EXPECT_EQ(
      receiver_->WaitNotification(absl::Milliseconds(200)).status().code(),
      absl::StatusCode::kDeadlineExceeded);
}

TEST_P(FaultInjectionTest, NotificationDroppedAtTheReceiverIsSkipped) {
  receiver_hook_->QueueNotify({.action = KvFaultAction::kDrop});
  auto connection = Connect();
  ASSERT_NE(connection, nullptr);
  ASSERT_TRUE(connection->Notify("first").ok());
  ASSERT_TRUE(connection->Notify("second").ok());
  auto notification = receiver_->WaitNotification(absl::Seconds(5));
  ASSERT_TRUE(notification.ok()) << notification.status();
  EXPECT_EQ(notification->message, "second");
}

TEST_P(FaultInjectionTest,
       TruncatedWriteLandsOnlyAPrefixAndTheConnectionFails) {
  // 3000 of the 4096 bytes: all of the first op, part of the second.
  sender_hook_->QueueWrite(
      {.action = KvFaultAction::kTruncate, .choice = 4096 * 5 + 3000});
  auto connection = Connect();
  ASSERT_NE(connection, nullptr);
  EXPECT_EQ(connection->Write(TwoOps()).code(), absl::StatusCode::kUnavailable);
  EXPECT_EQ(LandedPrefix(), 3000);
  EXPECT_EQ(connection->Write(TwoOps()).code(), absl::StatusCode::kUnavailable);
}

TEST_P(FaultInjectionTest,
       CorruptedWriteIsRefusedAndWritesNothingFromTheBadOpOn) {
  // Each way a target is corrupted ((choice / ops) % 3), on each op
  // (choice % ops).
  for (uint64_t choice = 0; choice < 6; ++choice) {
    SCOPED_TRACE(choice);
    std::fill(dst_.begin(), dst_.end(), std::byte{0});
    sender_hook_->QueueWrite(
        {.action = KvFaultAction::kCorrupt, .choice = choice});
    auto connection = Connect();
    ASSERT_NE(connection, nullptr);
    const absl::Status status = connection->Write(TwoOps());
    EXPECT_TRUE(status.code() == absl::StatusCode::kOutOfRange ||
                status.code() == absl::StatusCode::kNotFound)
        << status;
    // A transport may check the whole batch before writing (ucx) or
    // write op by op (tcp): the good ops before the bad one may land.
    const int64_t good_ops_bytes = choice % 2 == 0 ? 0 : 2048;
    const int64_t landed = LandedPrefix();
    EXPECT_TRUE(landed == 0 || landed == good_ops_bytes) << landed;
    EXPECT_EQ(std::count_if(dst_.begin(), dst_.end(),
                            [](std::byte b) { return b != std::byte{0}; }),
              landed);
  }
  std::fill(dst_.begin(), dst_.end(), std::byte{0});
  // The receiver still takes good writes.
  auto connection = Connect();
  ASSERT_NE(connection, nullptr);
  EXPECT_TRUE(connection->Write(TwoOps()).ok());
  EXPECT_EQ(LandedPrefix(), 4096);
}

TEST_P(FaultInjectionTest, CorruptedNotificationArrivesWithOneByteChanged) {
  sender_hook_->QueueNotify(
      {.action = KvFaultAction::kCorrupt, .choice = 0x1234'0000'0002});
  auto connection = Connect();
  ASSERT_NE(connection, nullptr);
  const std::string sent = "KvComplete landing 17";
  ASSERT_TRUE(connection->Notify(sent).ok());
  auto notification = receiver_->WaitNotification(absl::Seconds(5));
  ASSERT_TRUE(notification.ok()) << notification.status();
  ASSERT_EQ(notification->message.size(), sent.size());
  int changed = 0;
  for (size_t i = 0; i < sent.size(); ++i)
    changed += notification->message[i] != sent[i];
  EXPECT_EQ(changed, 1);
}

TEST_P(FaultInjectionTest, TruncatedNotificationDeliversAPrefixAtTheReceiver) {
  receiver_hook_->QueueNotify(
      {.action = KvFaultAction::kTruncate, .choice = 5});
  auto connection = Connect();
  ASSERT_NE(connection, nullptr);
  ASSERT_TRUE(connection->Notify("0123456789").ok());
  auto notification = receiver_->WaitNotification(absl::Seconds(5));
  ASSERT_TRUE(notification.ok()) << notification.status();
  EXPECT_EQ(notification->message, "01234");
}

INSTANTIATE_TEST_SUITE_P(Transports, FaultInjectionTest,
                         ::testing::ValuesIn(HostMemoryTransports()),
                         TransportTestName);

TEST(KvFaultSpecTest, MalformedSpecsAreRefusedNamingTheRule) {
  const std::pair<std::string, std::string> cases[] = {
      {"", "empty"},
      {"write", "no action"},
      {"read:drop", "'read:drop'"},
      {"write:explode", "unknown action"},
      {"write:delay=soon", "delay must be"},
      {"write:delay=0s", "delay must be"},
      {"write:delay=2h", "delay must be"},
      {"notify:drop:p=1.5", "p must be"},
      {"notify:drop:p=-0.1", "p must be"},
      {"notify:drop:p=nan", "p must be"},
      {"notify:drop:p=0.1:p=0.2", "only one p"},
      {"notify:drop:q=0.1", "only one p"},
      {"write:drop,,notify:drop", "empty rule"},
      {"write:drop,seed=x", "seed=N"},
      {"write:drop,seed=1,seed=2", "seed=N"},
      {"seed=3", "no rule"},
  };
  for (const auto& [spec, why] : cases) {
    auto hook = ParseKvFaultSpec(spec);
    ASSERT_FALSE(hook.ok()) << spec;
    EXPECT_EQ(hook.status().code(), absl::StatusCode::kInvalidArgument) << spec;
    EXPECT_NE(hook.status().message().find(why), std::string::npos)
        << spec << ": " << hook.status().message();
  }
  EXPECT_EQ(
      CreateKvTransportWithFaults("tcp", {}, "write:boom").status().code(),
      absl::StatusCode::kInvalidArgument);
}

TEST(KvFaultSpecTest, RulesFireAtTheirProbabilityInOrderAndReplayFromTheSeed) {
  const std::string spec =
      "write:delay=200ms:p=0.3,write:drop:p=0.5,notify:corrupt,seed=7";
  auto a = ParseKvFaultSpec(spec);
  auto b = ParseKvFaultSpec(spec);
  ASSERT_TRUE(a.ok() && b.ok());
  int delayed = 0, dropped = 0;
  constexpr int kCalls = 4000;
  for (int i = 0; i < kCalls; ++i) {
    const KvFault fa = (*a)->OnWrite({});
    const KvFault fb = (*b)->OnWrite({});
    ASSERT_EQ(fa.action, fb.action) << i;
    ASSERT_EQ(fa.choice, fb.choice) << i;
    if (fa.action == KvFaultAction::kDelay) {
      ++delayed;
      EXPECT_EQ(fa.delay, absl::Milliseconds(200));
    }
    dropped += fa.action == KvFaultAction::kDrop;
    EXPECT_NE(fa.action, KvFaultAction::kCorrupt);  // A notify rule.
    EXPECT_EQ((*a)->OnNotify("m", false).action, KvFaultAction::kCorrupt);
    (void)(*b)->OnNotify("m", false);
  }
  // 30 % delayed; half of the other 70 % dropped (35 %).
  EXPECT_NEAR(delayed, 0.30 * kCalls, 0.04 * kCalls);
  EXPECT_NEAR(dropped, 0.35 * kCalls, 0.04 * kCalls);
  auto other_seed = ParseKvFaultSpec("write:drop:p=0.5,seed=8");
  auto same_rules = ParseKvFaultSpec("write:drop:p=0.5,seed=7");
  ASSERT_TRUE(other_seed.ok() && same_rules.ok());
  int differ = 0;
  for (int i = 0; i < 100; ++i) {
    differ +=
        (*other_seed)->OnWrite({}).action != (*same_rules)->OnWrite({}).action;
  }
  EXPECT_GT(differ, 0);
}

TEST(KvFaultSpecTest, NeverAndAlwaysMeanIt) {
  auto hook = ParseKvFaultSpec("write:truncate:p=0,notify:drop:p=1");
  ASSERT_TRUE(hook.ok()) << hook.status();
  for (int i = 0; i < 1000; ++i) {
    EXPECT_EQ((*hook)->OnWrite({}).action, KvFaultAction::kPass);
    EXPECT_EQ((*hook)->OnNotify("m", true).action, KvFaultAction::kDrop);
  }
}

}  // namespace
}  // namespace pdserve::kv
