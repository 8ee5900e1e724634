// TimedDecodeWorker: a decode worker without a model, for load benchmarks
// of the router (pd-router-bench, pd-http-bench) and the load generator's
// cross-check against AIPerf (tests/planner). Each Decode call streams
// max_tokens script tokens on gRPC's callback API, token i at
// first_token_delay + i x interval after the call arrived (by default the
// first at once: no delay); one timer thread drives
// every stream, so it holds tens of thousands of streams where the tests'
// FakeDecodeWorker (a synchronous thread per stream) holds a few hundred.
// GetLoad reports a KV pool far larger than any load.
//
// Thread-safety: gRPC calls it from any thread; the timer has its own.
#ifndef PDSERVE_BENCH_TIMED_DECODE_WORKER_H_
#define PDSERVE_BENCH_TIMED_DECODE_WORKER_H_

#include <algorithm>
#include <iostream>
#include <memory>
#include <queue>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/grpc_server.h"
#include "grpcpp/grpcpp.h"
#include "pdserve/internal/v1/worker.grpc.pb.h"
#include "tests/router/fake_workers.h"

namespace pdserve::bench {

namespace wire = ::pdserve::internal::v1;

class TokenTimer;

// One Decode call: writes the tokens due by the schedule, one write in
// flight, and finishes after max_tokens. Owned by a shared_ptr: its own
// reference goes in OnDone, the timer's when it has no token left to wake
// it for.
class TimedDecodeStream final
    : public grpc::ServerWriteReactor<wire::DecodeResponse>,
      public std::enable_shared_from_this<TimedDecodeStream> {
 public:
  TimedDecodeStream(const wire::EngineRequest& request,
                    absl::Duration interval,
                    absl::Duration first_token_delay = absl::ZeroDuration())
      : request_(request),
        first_(absl::Now() + first_token_delay),
        interval_(interval),
        total_(std::max<int>(1, request.max_tokens())) {}

  // When token 0 is due.
  absl::Time first() const { return first_; }

  // Writes token 0 when it is due at once; else the timer wakes it at
  // first().
  void Start() {
    {
      absl::MutexLock lock(&mu_);
      self_ = shared_from_this();
    }
    if (first_ <= absl::Now()) TokenDue();
  }

  // One more token is due: writes it unless a write is in flight (whose
  // completion writes it). Returns when the next token is due, or
  // InfiniteFuture when none is left.
  absl::Time TokenDue() {
    absl::Time next = absl::InfiniteFuture();
    {
      absl::MutexLock lock(&mu_);
      if (due_ < total_) ++due_;
      if (due_ < total_) next = first_ + due_ * interval_;
      if (writing_ || finished_ || sent_ == due_) return next;
      writing_ = true;
      FillLocked();
    }
    Write();
    return next;
  }

  void OnWriteDone(bool ok) override {
    {
      absl::MutexLock lock(&mu_);
      writing_ = false;
      if (finished_) return;
      if (!ok) {
        finished_ = true;
      } else if (sent_ == due_) {
        return;
      } else {
        writing_ = true;
        FillLocked();
      }
    }
    if (!ok) {
      Finish(grpc::Status(grpc::StatusCode::CANCELLED, "fake: write failed"));
    } else {
      Write();
    }
  }

  void OnCancel() override {
    {
      absl::MutexLock lock(&mu_);
      // A write in flight fails and finishes the call.
      if (finished_ || writing_) return;
      finished_ = true;
    }
    Finish(grpc::Status(grpc::StatusCode::CANCELLED, "fake: cancelled"));
  }

  void OnDone() override {
    std::shared_ptr<TimedDecodeStream> self;
    absl::MutexLock lock(&mu_);
    finished_ = true;
    self = std::move(self_);
  }

 private:
  // Puts the tokens due and not sent in response_ (the timer or a write
  // completion catching up sends them together).
  void FillLocked() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    response_.Clear();
    wire::FinishReason finish = wire::FINISH_REASON_UNSPECIFIED;
    for (; sent_ < due_ && finish == wire::FINISH_REASON_UNSPECIFIED;
         ++sent_) {
      wire::SampledToken* t = response_.add_tokens();
      t->set_token_id(testing_util::ScriptToken(kScript, sent_, true));
      finish = testing_util::ScriptFinish(request_, t->token_id(), sent_);
    }
    response_.set_finish_reason(finish);
    last_ = finish != wire::FINISH_REASON_UNSPECIFIED;
    if (last_) finished_ = true;
  }

  // Only the thread that set writing_ calls this.
  void Write() {
    if (last_) {
      StartWriteAndFinish(&response_, grpc::WriteOptions(),
                          grpc::Status::OK);
    } else {
      StartWrite(&response_);
    }
  }

  static constexpr char kScript[] = "Once upon a time, there was a little girl. ";

  const wire::EngineRequest request_;
  const absl::Time first_;
  const absl::Duration interval_;
  const int total_;

  absl::Mutex mu_;
  std::shared_ptr<TimedDecodeStream> self_ ABSL_GUARDED_BY(mu_);
  int due_ ABSL_GUARDED_BY(mu_) = 0;   // Tokens due so far.
  int sent_ ABSL_GUARDED_BY(mu_) = 0;  // Tokens written or being written.
  bool writing_ ABSL_GUARDED_BY(mu_) = false;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  // response_ and last_ belong to whoever set writing_.
  wire::DecodeResponse response_;
  bool last_ = false;
};

// Wakes every stream when its next token is due: one thread, one heap.
class TokenTimer {
 public:
  TokenTimer() : thread_([this] { Loop(); }) {}
  ~TokenTimer() {
    {
      absl::MutexLock lock(&mu_);
      stop_ = true;
    }
    thread_.join();
  }

  void Add(absl::Time due, std::shared_ptr<TimedDecodeStream> stream) {
    absl::MutexLock lock(&mu_);
    heap_.push({due, std::move(stream)});
  }

 private:
  using Entry = std::pair<absl::Time, std::shared_ptr<TimedDecodeStream>>;
  struct Later {
    bool operator()(const Entry& a, const Entry& b) const {
      return a.first > b.first;
    }
  };

  void Loop() {
    std::vector<Entry> due;
    absl::MutexLock lock(&mu_);
    while (!stop_) {
      const absl::Time now = absl::Now();
      while (!heap_.empty() && heap_.top().first <= now) {
        due.push_back(heap_.top());
        heap_.pop();
      }
      if (due.empty()) {
        // Woken at the next due time, and at least every millisecond for
        // streams added meanwhile.
        const absl::Time until =
            heap_.empty() ? now + absl::Milliseconds(1)
                          : std::min(heap_.top().first,
                                     now + absl::Milliseconds(1));
        cv_.WaitWithDeadline(&mu_, until);
        continue;
      }
      mu_.Unlock();
      for (Entry& e : due) e.first = e.second->TokenDue();
      mu_.Lock();
      // A stream whose next token is due already (this thread fell behind)
      // goes back too: the next round writes it at once.
      for (Entry& e : due) {
        if (e.first != absl::InfiniteFuture()) heap_.push(std::move(e));
      }
      due.clear();
    }
  }

  absl::Mutex mu_;
  absl::CondVar cv_;
  bool stop_ ABSL_GUARDED_BY(mu_) = false;
  std::priority_queue<Entry, std::vector<Entry>, Later> heap_
      ABSL_GUARDED_BY(mu_);
  std::thread thread_;
};

// A decode worker without a model for load: Decode streams on the timer's
// schedule, GetLoad reports a KV pool far larger than any load.
class TimedDecodeWorker final : public wire::DecodeWorker::CallbackService {
 public:
  explicit TimedDecodeWorker(
      absl::Duration interval,
      absl::Duration first_token_delay = absl::ZeroDuration())
      : interval_(interval), first_token_delay_(first_token_delay) {}

  grpc::ServerWriteReactor<wire::DecodeResponse>* Decode(
      grpc::CallbackServerContext*, const wire::DecodeRequest* r) override {
    auto stream = std::make_shared<TimedDecodeStream>(r->request(), interval_,
                                                      first_token_delay_);
    stream->Start();
    if (first_token_delay_ > absl::ZeroDuration()) {
      timer_.Add(stream->first(), stream);
    } else if (r->request().max_tokens() > 1) {
      timer_.Add(stream->first() + interval_, stream);
    }
    return stream.get();
  }

  grpc::ServerUnaryReactor* GetLoad(grpc::CallbackServerContext* context,
                                    const wire::LoadRequest*,
                                    wire::LoadReport* report) override {
    report->set_worker_id("fake-decode");
    report->set_role("decode");
    testing_util::FillLayout(report);
    report->set_total_blocks(100'000'000);
    report->set_free_blocks(100'000'000);
    grpc::ServerUnaryReactor* reactor = context->DefaultReactor();
    reactor->Finish(grpc::Status::OK);
    return reactor;
  }

 private:
  const absl::Duration interval_;
  const absl::Duration first_token_delay_;
  TokenTimer timer_;
};

// Serves a TimedDecodeWorker on a free loopback port, prints its address
// on stdout, and runs until the process is killed (the fake-decode role of
// the benches that spawn it).
inline int RunTimedDecodeWorker(
    absl::Duration interval,
    absl::Duration first_token_delay = absl::ZeroDuration()) {
  TimedDecodeWorker worker(interval, first_token_delay);
  auto started = StartGrpcServer("127.0.0.1:0", {&worker});
  if (!started.ok()) {
    std::cerr << "fake decode worker: " << started.status() << "\n";
    return 1;
  }
  std::cout << "127.0.0.1:" << started->port << std::endl;
  // Runs until the bench kills it.
  while (true) absl::SleepFor(absl::Seconds(1));
}

}  // namespace pdserve::bench

#endif  // PDSERVE_BENCH_TIMED_DECODE_WORKER_H_
