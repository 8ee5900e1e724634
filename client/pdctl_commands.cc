#include "client/pdctl_commands.h"

#include <chrono>

#include "absl/strings/str_format.h"
#include "client/pdserve_client.h"
#include "common/status_macros.h"
#include "engine/generator.h"
#include "engine/model.h"
#include "engine/model_files/model_info.h"
#include "engine/model_runner.h"
#include "engine/tokenizer.h"

namespace pdserve {

absl::Status GenerateLocal(const LocalGenerateOptions& options,
                           const std::string& prompt, std::ostream& out,
                           std::ostream& err) {
  PD_ASSIGN_OR_RETURN(std::shared_ptr<const Model> model,
                      Model::Load(options.model));
  const Tokenizer* tokenizer = model->tokenizer();
  if (tokenizer == nullptr) {
    return absl::FailedPreconditionError(
        absl::StrCat("model '", options.model,
                     "' has no tokenizer.json; cannot encode text"));
  }
  PD_ASSIGN_OR_RETURN(std::vector<int32_t> ids,
                      tokenizer->Encode(prompt, options.add_bos));
  if (ids.empty())
    return absl::InvalidArgumentError("prompt encodes to no tokens");

  ModelRunnerOptions runner_options;
  runner_options.backend = options.backend;
  runner_options.num_threads = options.num_threads;
  const int32_t context =
      static_cast<int32_t>(ids.size()) + options.sampling.max_tokens;
  runner_options.num_kv_blocks =
      (context + runner_options.block_size - 1) / runner_options.block_size;
  PD_ASSIGN_OR_RETURN(std::unique_ptr<ModelRunner> runner,
                      CreateModelRunner(model, runner_options));
  PD_ASSIGN_OR_RETURN(
      std::unique_ptr<Generator> generator,
      Generator::Create(runner.get(), GeneratorOptions{.max_batch_tokens = 512,
                                                       .max_running = 1}));
  PD_RETURN_IF_ERROR(generator->Add(
      {.id = RequestId(1), .prompt = ids, .sampling = options.sampling}));

  out << prompt << std::flush;
  IncrementalDetokenizer detok(*tokenizer, /*skip_special_tokens=*/true);
  std::vector<GenerationEvent> events;
  const auto start = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point first_token;
  int generated = 0;
  FinishReason finish = FinishReason::kNone;
  while (generator->HasWork()) {
    events.clear();
    PD_RETURN_IF_ERROR(generator->Step(events));
    for (const GenerationEvent& e : events) {
      if (e.has_token) {
        if (generated++ == 0) first_token = std::chrono::steady_clock::now();
        PD_ASSIGN_OR_RETURN(std::string delta, detok.Append(e.token.token));
        out << delta << std::flush;
      }
      if (e.finish != FinishReason::kNone) finish = e.finish;
    }
  }
  out << detok.Flush() << "\n";
  if (options.print_stats) {
    const auto end = std::chrono::steady_clock::now();
    const double ttft =
        std::chrono::duration<double>(first_token - start).count();
    const double decode =
        std::chrono::duration<double>(end - first_token).count();
    err << absl::StrFormat(
        "[%s] prompt %d tokens, generated %d (%s); TTFT %.1f ms, decode %.1f "
        "tokens/s\n",
        model->name(), ids.size(), generated,
        finish == FinishReason::kStop ? "stop" : "length", ttft * 1e3,
        generated > 1 ? (generated - 1) / decode : 0.0);
  }
  return absl::OkStatus();
}

absl::Status Tokenize(const std::string& model_spec, const std::string& text,
                      bool add_special_tokens, std::ostream& out) {
  PD_ASSIGN_OR_RETURN(std::shared_ptr<const ModelInfo> model,
                      LoadModelInfo(model_spec));
  if (model->tokenizer() == nullptr) {
    return absl::FailedPreconditionError("model has no tokenizer.json");
  }
  PD_ASSIGN_OR_RETURN(std::vector<int32_t> ids,
                      model->tokenizer()->Encode(text, add_special_tokens));
  for (int32_t id : ids) {
    out << id << "\t" << model->tokenizer()->TokenText(id) << "\n";
  }
  return absl::OkStatus();
}

absl::Status GenerateRemote(const std::string& server,
                            const v1::GenerateRequest& request,
                            std::ostream& out, std::ostream& err,
                            const GenerationClient::Options& options) {
  PD_ASSIGN_OR_RETURN(std::unique_ptr<GenerationClient> client,
                      GenerationClient::Create(server, options));
  if (request.has_text()) out << request.text() << std::flush;
  v1::GenerateResponse last;
  const absl::Status status =
      client->Generate(request, [&](const v1::GenerateResponse& r) {
        out << r.text() << std::flush;
        if (r.finish_reason() != v1::FINISH_REASON_UNSPECIFIED) last = r;
        return true;
      });
  out << "\n" << std::flush;
  if (!status.ok()) return status;
  err << absl::StrFormat(
      "[finish: %s, prompt_tokens: %d, completion_tokens: %d]\n",
      last.finish_reason() == v1::FINISH_REASON_STOP ? "stop" : "length",
      last.usage().prompt_tokens(), last.usage().completion_tokens());
  return absl::OkStatus();
}

absl::Status TokenizeRemote(const std::string& server, const std::string& text,
                            bool add_special_tokens, std::ostream& out,
                            const GenerationClient::Options& options) {
  PD_ASSIGN_OR_RETURN(std::unique_ptr<GenerationClient> client,
                      GenerationClient::Create(server, options));
  v1::TokenizeRequest request;
  request.set_text(text);
  request.set_add_special_tokens(add_special_tokens);
  PD_ASSIGN_OR_RETURN(v1::TokenizeResponse response, client->Tokenize(request));
  for (int32_t id : response.token_ids()) out << id << "\n";
  return absl::OkStatus();
}

absl::Status ServerStatus(const std::string& server, std::ostream& out,
                          const GenerationClient::Options& options) {
  PD_ASSIGN_OR_RETURN(std::unique_ptr<GenerationClient> client,
                      GenerationClient::Create(server, options));
  PD_ASSIGN_OR_RETURN(v1::HealthResponse health, client->Health());
  // Every field always printed (scripts grep for them, zeros included).
  out << "serving: " << (health.serving() ? "true" : "false")
      << " prefill_workers: " << health.prefill_workers()
      << " decode_workers: " << health.decode_workers() << "\n";
  for (const v1::WorkerStatus& w : health.workers()) {
    out << "worker: " << w.id() << " role: " << w.role()
        << " healthy: " << (w.healthy() ? "true" : "false") << "\n";
    for (const v1::KvTransportUsage& t : w.kv_transports()) {
      out << "  kv_transport: " << t.transport() << " pushes: " << t.pushes()
          << " bytes: " << t.bytes() << " fallbacks: " << t.fallbacks() << "\n";
    }
  }
  // Health is printed before ListModels is asked: a router with API keys
  // answers Health without one, so the lines above serve as a probe
  // (deploy/local/cluster.sh) even when the models need a key.
  out << std::flush;
  PD_ASSIGN_OR_RETURN(v1::ListModelsResponse models, client->ListModels());
  for (const v1::ModelInfo& m : models.models()) {
    out << "model: " << m.name() << " context_length: " << m.context_length()
        << " vocab_size: " << m.vocab_size() << "\n";
  }
  return absl::OkStatus();
}

}  // namespace pdserve
