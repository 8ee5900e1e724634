// In-process fake prefill and decode workers for router tests: real gRPC
// servers on loopback speaking pdserve.internal.v1, with no model behind
// them. Both "sample" the same script: the token at step k of a request is
// byte k of `script` (a builtin:tiny byte token), then EOS (257) — or, with
// ignore_eos, the script again from its start. So the expected text of a
// request is known, and prefill-then-decode equals decode alone.
//
// Faults are set per worker through its Behavior; counters say what the
// router did. Thread-safety: everything may be called from any thread.
#ifndef PDSERVE_TESTS_ROUTER_FAKE_WORKERS_H_
#define PDSERVE_TESTS_ROUTER_FAKE_WORKERS_H_

#include <atomic>
#include <cstdint>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "common/drain.h"
#include "grpcpp/grpcpp.h"
#include "pdserve/internal/v1/worker.grpc.pb.h"

namespace pdserve::testing_util {

namespace wire = ::pdserve::internal::v1;

inline constexpr int32_t kTinyEos = 257;

// The token at `step` of a request under `script`.
inline int32_t ScriptToken(const std::string& script, int64_t step,
                           bool ignore_eos) {
  if (step < static_cast<int64_t>(script.size())) {
    return static_cast<uint8_t>(script[step]);
  }
  if (!ignore_eos || script.empty()) return kTinyEos;
  return static_cast<uint8_t>(script[step % script.size()]);
}

inline wire::SampledToken ScriptSample(const std::string& script, int64_t step,
                                       const wire::EngineRequest& request) {
  wire::SampledToken t;
  t.set_token_id(ScriptToken(script, step, request.ignore_eos()));
  t.set_logprob(-0.5f * static_cast<float>(step + 1));
  for (uint32_t i = 0; i < request.logprobs(); ++i) {
    wire::TokenLogprob* top = t.add_top();
    top->set_token_id(static_cast<int32_t>(i));
    top->set_logprob(-static_cast<float>(i));
  }
  return t;
}

// The finish reason after the token of `step`.
inline wire::FinishReason ScriptFinish(const wire::EngineRequest& request,
                                       int32_t token, int64_t step) {
  if (token == kTinyEos && !request.ignore_eos())
    return wire::FINISH_REASON_STOP;
  for (int32_t id : request.stop_token_ids()) {
    if (id == token) return wire::FINISH_REASON_STOP;
  }
  if (step + 1 >= request.max_tokens()) return wire::FINISH_REASON_LENGTH;
  return wire::FINISH_REASON_UNSPECIFIED;
}

// What a worker answers for EngineRequest.prompt_logprobs: position i of
// the prompt gets its token with logprob -i and as many alternatives as
// asked (ids 0, 1, ...).
inline void ScriptPromptLogprobs(
    const wire::EngineRequest& request,
    google::protobuf::RepeatedPtrField<wire::SampledToken>* out) {
  if (!request.has_prompt_logprobs()) return;
  for (int i = 1; i < request.prompt_size(); ++i) {
    wire::SampledToken* t = out->Add();
    t->set_token_id(request.prompt(i));
    t->set_logprob(-static_cast<float>(i));
    for (uint32_t k = 0; k < request.prompt_logprobs(); ++k) {
      wire::TokenLogprob* top = t->add_top();
      top->set_token_id(static_cast<int32_t>(k));
      top->set_logprob(-static_cast<float>(k));
    }
  }
}

inline void FillLayout(wire::LoadReport* report) {
  wire::KvLayout* l = report->mutable_layout();
  l->set_num_layers(4);
  l->set_num_kv_heads(2);
  l->set_head_dim(32);
  l->set_block_size(16);
  l->set_dtype("f32");
  report->set_model("builtin:tiny");
}

template <typename Service>
class FakeServer {
 public:
  explicit FakeServer(Service* service) {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port_);
    builder.RegisterService(service);
    server_ = builder.BuildAndStart();
  }
  ~FakeServer() { Stop(); }
  void Stop() {
    if (server_) {
      server_->Shutdown(absl::ToChronoTime(absl::Now()));
      server_->Wait();
      server_.reset();
    }
  }
  std::string address() const { return absl::StrCat("127.0.0.1:", port_); }

 private:
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

// What a draining worker answers new work (common/drain.h).
inline grpc::Status DrainingRefusal(absl::string_view role) {
  return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                      std::string(DrainingError(role).message()));
}

class FakeDecodeWorker final : public wire::DecodeWorker::Service {
 public:
  struct Behavior {
    std::string script = "Hello, world!";
    std::string role = "decode";
    uint32_t free_blocks = 1000;
    // The pool the router admits requests against.
    uint32_t total_blocks = 1000;
    // Reserve answers this code (OK: a landing) ...
    grpc::StatusCode reserve_code = grpc::StatusCode::OK;
    // ... after this long.
    absl::Duration reserve_delay = absl::ZeroDuration();
    // Decode fails with UNAVAILABLE after this many tokens (-1: never).
    int fail_decode_after = -1;
    // Decode fails with UNAVAILABLE before it takes the reservation, as a
    // call the network lost on its way does.
    bool decode_unreached = false;
    absl::Duration token_delay = absl::ZeroDuration();
    // Tokens per DecodeResponse.
    int tokens_per_message = 1;
    // Refuses Reserve and local Decode calls as a draining worker does
    // (common/drain.h); report_draining: its load reports say draining.
    bool draining = false;
    bool report_draining = false;
  };

  FakeDecodeWorker() : server_(this) {}
  ~FakeDecodeWorker() override { server_.Stop(); }

  std::string address() const { return server_.address(); }
  void Stop() { server_.Stop(); }
  void set_behavior(const Behavior& b) {
    absl::MutexLock lock(&mu_);
    behavior_ = b;
  }
  Behavior behavior() const {
    absl::MutexLock lock(&mu_);
    return behavior_;
  }
  int reservations() const {
    absl::MutexLock lock(&mu_);
    return static_cast<int>(reserved_.size());
  }
  // The requests of every Decode call so far, in arrival order.
  std::vector<wire::DecodeRequest> decode_requests() const {
    absl::MutexLock lock(&mu_);
    return decode_requests_;
  }

  std::atomic<int> reserves{0}, releases{0}, decodes{0}, decodes_local{0},
      decodes_cancelled{0}, decodes_done{0}, load_reports{0};

  // Waits (up to 5 s) until the router polled twice more: a behavior set
  // before the call is in its view of the worker.
  bool AwaitFreshReport() const {
    const int seen = load_reports;
    for (int i = 0; i < 500 && load_reports < seen + 2; ++i) {
      absl::SleepFor(absl::Milliseconds(10));
    }
    return load_reports >= seen + 2;
  }

  grpc::Status Reserve(grpc::ServerContext*, const wire::ReserveRequest* r,
                       wire::Landing* landing) override {
    ++reserves;
    const Behavior b = behavior();
    absl::SleepFor(b.reserve_delay);
    if (b.draining) return DrainingRefusal("decode");
    if (b.reserve_code != grpc::StatusCode::OK) {
      return grpc::Status(b.reserve_code, "fake: no blocks");
    }
    absl::MutexLock lock(&mu_);
    if (!reserved_.emplace(r->request_id(), r->num_tokens()).second) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "fake: duplicate id");
    }
    landing->set_decode_worker_id("fake-decode");
    wire::KvOffer* offer = landing->add_offers();
    offer->set_transport("tcp");
    offer->set_endpoint("127.0.0.1:1");
    for (uint32_t i = 0; i < (r->num_tokens() + 15) / 16; ++i)
      landing->add_block_ids(i);
    return grpc::Status::OK;
  }

  grpc::Status Release(grpc::ServerContext*, const wire::ReleaseRequest* r,
                       wire::ReleaseResponse*) override {
    ++releases;
    absl::MutexLock lock(&mu_);
    reserved_.erase(r->request_id());
    return grpc::Status::OK;
  }

  grpc::Status Decode(
      grpc::ServerContext* context, const wire::DecodeRequest* r,
      grpc::ServerWriter<wire::DecodeResponse>* writer) override {
    ++decodes;
    const Behavior b = behavior();
    const wire::EngineRequest& req = r->request();
    {
      absl::MutexLock lock(&mu_);
      decode_requests_.push_back(*r);
    }
    if (b.decode_unreached) {
      return grpc::Status(grpc::StatusCode::UNAVAILABLE, "fake: connection lost");
    }
    int64_t step = 0;
    if (r->has_first_token()) {
      absl::MutexLock lock(&mu_);
      auto it = reserved_.find(req.request_id());
      if (it == reserved_.end()) {
        return grpc::Status(grpc::StatusCode::NOT_FOUND,
                            "fake: no reservation");
      }
      if (it->second < req.prompt_size() + req.max_tokens()) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            "fake: reservation too small");
      }
      if (r->first_token().token_id() !=
          ScriptToken(b.script, 0, req.ignore_eos())) {
        return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                            "fake: wrong first token");
      }
      reserved_.erase(it);
      step = 1;
    } else {
      if (b.draining) return DrainingRefusal("decode");
      ++decodes_local;
    }
    int sent = 0;
    for (;;) {
      wire::DecodeResponse response;
      wire::FinishReason finish = wire::FINISH_REASON_UNSPECIFIED;
      for (int i = 0; i < b.tokens_per_message &&
                      finish == wire::FINISH_REASON_UNSPECIFIED;
           ++i) {
        if (b.fail_decode_after >= 0 && sent >= b.fail_decode_after) {
          if (response.tokens_size() > 0) writer->Write(response);
          return grpc::Status(grpc::StatusCode::UNAVAILABLE,
                              "fake: decode worker lost");
        }
        if (step == 0) {
          ScriptPromptLogprobs(req, response.mutable_prompt_logprobs());
        }
        *response.add_tokens() = ScriptSample(b.script, step, req);
        finish =
            ScriptFinish(req, response.tokens().rbegin()->token_id(), step);
        ++step;
        ++sent;
      }
      response.set_finish_reason(finish);
      if (b.token_delay > absl::ZeroDuration()) {
        // Sleep in slices so cancellation is seen quickly.
        const absl::Time until = absl::Now() + b.token_delay;
        while (absl::Now() < until && !context->IsCancelled()) {
          absl::SleepFor(absl::Milliseconds(2));
        }
      }
      if (context->IsCancelled()) {
        ++decodes_cancelled;
        return grpc::Status(grpc::StatusCode::CANCELLED, "fake: cancelled");
      }
      if (!writer->Write(response)) {
        ++decodes_cancelled;
        return grpc::Status(grpc::StatusCode::CANCELLED, "fake: write failed");
      }
      if (finish != wire::FINISH_REASON_UNSPECIFIED) break;
    }
    ++decodes_done;
    return grpc::Status::OK;
  }

  grpc::Status GetLoad(grpc::ServerContext*, const wire::LoadRequest*,
                       wire::LoadReport* report) override {
    const Behavior b = behavior();
    report->set_worker_id("fake-decode");
    report->set_role(b.role);
    FillLayout(report);
    report->set_total_blocks(b.total_blocks);
    report->set_free_blocks(b.free_blocks);
    report->set_draining(b.report_draining);
    ++load_reports;
    absl::MutexLock lock(&mu_);
    report->set_reservations(static_cast<uint32_t>(reserved_.size()));
    return grpc::Status::OK;
  }

 private:
  mutable absl::Mutex mu_;
  Behavior behavior_ ABSL_GUARDED_BY(mu_);
  absl::flat_hash_map<uint64_t, uint32_t> reserved_ ABSL_GUARDED_BY(mu_);
  std::vector<wire::DecodeRequest> decode_requests_ ABSL_GUARDED_BY(mu_);
  FakeServer<FakeDecodeWorker> server_;  // Last: stopped before the rest goes.
};

class FakePrefillWorker final : public wire::PrefillWorker::Service {
 public:
  struct Behavior {
    std::string script = "Hello, world!";
    // Prefill fails with this code (OK: it works) ...
    grpc::StatusCode fail_code = grpc::StatusCode::OK;
    // ... this many times (-1: always).
    int fail_times = -1;
    uint64_t pending_prompt_tokens = 0;
    absl::Duration delay = absl::ZeroDuration();
    // As FakeDecodeWorker's, for Prefill calls.
    bool draining = false;
    bool report_draining = false;
  };

  FakePrefillWorker() : server_(this) {}
  ~FakePrefillWorker() override { server_.Stop(); }

  std::string address() const { return server_.address(); }
  void Stop() { server_.Stop(); }
  void set_behavior(const Behavior& b) {
    absl::MutexLock lock(&mu_);
    behavior_ = b;
    failures_ = 0;
  }

  std::atomic<int> prefills{0}, prefills_ok{0};

  grpc::Status Prefill(grpc::ServerContext* context,
                       const wire::PrefillRequest* r,
                       wire::PrefillResponse* response) override {
    ++prefills;
    Behavior b;
    bool fail = false;
    {
      absl::MutexLock lock(&mu_);
      b = behavior_;
      if (b.draining) return DrainingRefusal("prefill");
      if (b.fail_code != grpc::StatusCode::OK &&
          (b.fail_times < 0 || failures_ < b.fail_times)) {
        ++failures_;
        fail = true;
      }
    }
    const absl::Time until = absl::Now() + b.delay;
    while (absl::Now() < until && !context->IsCancelled())
      absl::SleepFor(absl::Milliseconds(2));
    if (context->IsCancelled())
      return grpc::Status(grpc::StatusCode::CANCELLED, "fake: cancelled");
    if (fail) return grpc::Status(b.fail_code, "fake: prefill failed");
    if (r->landing().block_ids_size() == 0) {
      return grpc::Status(grpc::StatusCode::INVALID_ARGUMENT,
                          "fake: empty landing");
    }
    *response->mutable_first_token() = ScriptSample(b.script, 0, r->request());
    ScriptPromptLogprobs(r->request(), response->mutable_prompt_logprobs());
    response->set_finish_reason(
        ScriptFinish(r->request(), response->first_token().token_id(), 0));
    ++prefills_ok;
    return grpc::Status::OK;
  }

  grpc::Status GetLoad(grpc::ServerContext*, const wire::LoadRequest*,
                       wire::LoadReport* report) override {
    absl::MutexLock lock(&mu_);
    report->set_worker_id("fake-prefill");
    report->set_role("prefill");
    FillLayout(report);
    report->set_pending_prompt_tokens(behavior_.pending_prompt_tokens);
    report->set_draining(behavior_.report_draining);
    wire::KvTransportCounters* tcp = report->add_kv_transports();
    tcp->set_transport("tcp");
    tcp->set_pushes(3);
    tcp->set_bytes(4096);
    tcp->set_fallbacks(1);
    return grpc::Status::OK;
  }

 private:
  mutable absl::Mutex mu_;
  Behavior behavior_ ABSL_GUARDED_BY(mu_);
  int failures_ ABSL_GUARDED_BY(mu_) = 0;
  FakeServer<FakePrefillWorker> server_;
};

}  // namespace pdserve::testing_util

#endif  // PDSERVE_TESTS_ROUTER_FAKE_WORKERS_H_
