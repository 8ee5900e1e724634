// The grpc target of loadgen.h: pdserve's public API through the C++ SDK,
// one thread per request in flight (GenerationClient::Generate blocks its
// caller).
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "client/pdserve_client.h"
#include "planner/load_targets.h"

namespace pdserve::planner {
namespace {

class GrpcTarget final : public LoadTarget {
 public:
  GrpcTarget(std::unique_ptr<GenerationClient> client, std::string model)
      : client_(std::move(client)), model_(std::move(model)) {}

  ~GrpcTarget() override {
    {
      absl::MutexLock lock(&mu_);
      mu_.Await(absl::Condition(
          +[](absl::flat_hash_map<int64_t, std::thread>* running) {
            return running->empty();
          },
          &running_));
    }
    JoinFinished();
  }

  void Start(TargetRequest request, RequestRecord* record,
             std::function<void()> done) override {
    JoinFinished();
    absl::MutexLock lock(&mu_);
    const int64_t id = next_id_++;
    // The thread's own last step needs the lock, so it finds its entry.
    running_.emplace(id, std::thread([this, id, request = std::move(request),
                                      record, done = std::move(done)] {
                       Run(request, record);
                       done();
                       absl::MutexLock lock(&mu_);
                       auto it = running_.find(id);
                       finished_.push_back(std::move(it->second));
                       running_.erase(it);
                     }));
  }

 private:
  void Run(const TargetRequest& request, RequestRecord* record) {
    v1::GenerateRequest message;
    if (!model_.empty()) message.set_model(model_);
    message.mutable_token_ids()->mutable_ids()->Assign(request.prompt.begin(),
                                                       request.prompt.end());
    message.set_max_tokens(request.max_tokens);
    message.set_ignore_eos(true);
    message.mutable_sampling()->set_temperature(0);
    const SteadyTime origin = request.origin;
    const absl::Status status =
        client_->Generate(message, [&](const v1::GenerateResponse& response) {
          const double t = std::chrono::duration<double>(
                               std::chrono::steady_clock::now() - origin)
                               .count();
          record->token_s.insert(record->token_s.end(),
                                 response.token_ids_size(), t);
          return true;
        });
    record->end_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - origin)
            .count();
    record->output_tokens = static_cast<int32_t>(record->token_s.size());
    record->outcome = absl::StatusCodeToString(status.code());
    record->error = std::string(status.message());
  }

  // Joins the threads that ended (outside the lock: a join may wait for a
  // thread's last instructions after it left the lock).
  void JoinFinished() {
    std::vector<std::thread> finished;
    {
      absl::MutexLock lock(&mu_);
      finished.swap(finished_);
    }
    for (std::thread& t : finished) t.join();
  }

  const std::unique_ptr<GenerationClient> client_;
  const std::string model_;
  absl::Mutex mu_;
  int64_t next_id_ ABSL_GUARDED_BY(mu_) = 0;
  absl::flat_hash_map<int64_t, std::thread> running_ ABSL_GUARDED_BY(mu_);
  std::vector<std::thread> finished_ ABSL_GUARDED_BY(mu_);
};

}  // namespace

absl::StatusOr<std::unique_ptr<LoadTarget>> MakeGrpcTarget(
    const TargetOptions& options) {
  GenerationClient::Options client_options;
  client_options.generate_timeout = options.request_timeout;
  client_options.api_key = options.api_key;
  // One attempt: a refusal is a result of the load test, not a thing to
  // hide behind retries.
  client_options.retry.max_attempts = 1;
  std::string address = options.address;
  if (address.empty()) {
    return absl::InvalidArgumentError(
        "the grpc target needs an address, host:port");
  }
  auto client = GenerationClient::Create(address, client_options);
  if (!client.ok()) return client.status();
  return std::make_unique<GrpcTarget>(std::move(*client), options.model);
}

}  // namespace pdserve::planner
