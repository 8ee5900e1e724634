// pd-cluster-bench: what disaggregation costs and hides on this machine.
// For one request at a time, on a ~110M Llama shape (builtin:llama-110m,
// random bf16 weights), all measured in one run:
//   - TTFT through the router of a 1P1D cluster vs a colocated cluster
//     (0P1D: the decode worker prefills) vs the engine alone in-process;
//   - the KV bytes a prefill moves, the time its transfer took, and the
//     share of that time hidden behind the forward pass (the layer-wise
//     push: only the tail after the forward pass adds to TTFT);
//   - decode tokens/s of the 1P1D cluster vs the engine alone.
// The transfer figures come for each transport of --kv_transports (one
// 1P1D cluster each); --transfer_only measures nothing else. Prints
// Markdown tables of medians.
#include <algorithm>
#include <iostream>
#include <random>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "absl/time/clock.h"
#include "common/check.h"
#include "engine/generator.h"
#include "engine/model.h"
#include "tests/cluster/local_cluster.h"

ABSL_FLAG(std::string, model, "builtin:llama-110m",
          "Model every worker and the engine run");
ABSL_FLAG(std::string, prompt_lens, "128,512,2048", "Prompt lengths for TTFT");
ABSL_FLAG(int32_t, reps, 5, "Repetitions per figure (median reported)");
ABSL_FLAG(int32_t, decode_tokens, 128,
          "Tokens generated for the decode-rate figure");
ABSL_FLAG(int32_t, threads, 2,
          "CPU threads of each worker and of the engine alone");
ABSL_FLAG(std::string, backend, "cpu",
          "Engine backend of each worker and of the engine alone (cpu, cuda)");
ABSL_FLAG(std::string, kv_transports, "tcp",
          "KV transports to measure the transfer over, one 1P1D cluster each; "
          "the first "
          "also gives the 1P1D TTFT and decode figures");
ABSL_FLAG(bool, transfer_only, false,
          "Measure only the transfer table (no engine-alone, colocated or "
          "decode figures)");

namespace pdserve {
namespace {

namespace v1 = ::pdserve::v1;
namespace wire = ::pdserve::internal::v1;
using testing_util::ClusterSpec;
using testing_util::LocalCluster;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

std::vector<int32_t> Prompt(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int32_t> p = {256};
  while (static_cast<int>(p.size()) < n)
    p.push_back(static_cast<int32_t>(rng() % 256));
  return p;
}

struct StreamTiming {
  double ttft_ms = 0;
  double decode_tokens_per_s = 0;  // After the first token.
};

// Greedy, EOS ignored; times the first token and the rest.
absl::StatusOr<StreamTiming> TimeStream(v1::Generation::Stub& router,
                                        const std::vector<int32_t>& prompt,
                                        int max_tokens) {
  v1::GenerateRequest r;
  r.mutable_token_ids()->mutable_ids()->Assign(prompt.begin(), prompt.end());
  r.mutable_sampling()->set_temperature(0.0f);
  r.set_max_tokens(max_tokens);
  r.set_ignore_eos(true);
  grpc::ClientContext ctx;
  ctx.set_deadline(absl::ToChronoTime(absl::Now() + absl::Minutes(5)));
  const absl::Time start = absl::Now();
  absl::Time first, last;
  int tokens = 0;
  auto reader = router.Generate(&ctx, r);
  v1::GenerateResponse msg;
  while (reader->Read(&msg)) {
    if (tokens == 0) first = absl::Now();
    tokens += msg.token_ids_size();
    last = absl::Now();
  }
  grpc::Status s = reader->Finish();
  if (!s.ok()) return absl::InternalError(s.error_message());
  StreamTiming t;
  t.ttft_ms = absl::ToDoubleMilliseconds(first - start);
  if (tokens > 1)
    t.decode_tokens_per_s = (tokens - 1) / absl::ToDoubleSeconds(last - first);
  return t;
}

// The engine alone, in this process: TTFT and decode rate for one request.
StreamTiming TimeEngine(ModelRunner& runner, const std::vector<int32_t>& prompt,
                        int max_tokens) {
  auto g = Generator::Create(&runner, {});
  SamplingParams sp{
      .temperature = 0.0f, .max_tokens = max_tokens, .ignore_eos = true};
  PD_CHECK((*g)->Add({RequestId(1), prompt, sp}).ok());
  const absl::Time start = absl::Now();
  absl::Time first;
  int tokens = 0;
  std::vector<GenerationEvent> events;
  while ((*g)->HasWork()) {
    events.clear();
    PD_CHECK((*g)->Step(events).ok());
    for (const auto& e : events) {
      if (e.has_token && tokens++ == 0) first = absl::Now();
    }
  }
  const absl::Time end = absl::Now();
  StreamTiming t;
  t.ttft_ms = absl::ToDoubleMilliseconds(first - start);
  if (tokens > 1)
    t.decode_tokens_per_s = (tokens - 1) / absl::ToDoubleSeconds(end - first);
  return t;
}

struct TransferFigures {
  double kv_mib = 0, prefill_ms = 0, transfer_ms = 0, tail_ms = 0;
};

// Reserve on the decode worker, Prefill on the prefill worker directly, to
// read the transfer figures the router does not expose.
absl::StatusOr<TransferFigures> TimeTransfer(LocalCluster& cluster,
                                             const std::vector<int32_t>& prompt,
                                             uint64_t id) {
  auto decode = cluster.DecodeStub("decode-0");
  auto prefill = cluster.PrefillStub("prefill-0");
  wire::Landing landing;
  {
    grpc::ClientContext ctx;
    wire::ReserveRequest r;
    r.set_request_id(id);
    r.set_num_tokens(prompt.size() + 1);
    grpc::Status s = decode->Reserve(&ctx, r, &landing);
    if (!s.ok()) return absl::InternalError("Reserve: " + s.error_message());
  }
  wire::PrefillRequest r;
  wire::EngineRequest* e = r.mutable_request();
  e->set_request_id(id);
  e->mutable_prompt()->Assign(prompt.begin(), prompt.end());
  e->set_top_p(1.0f);
  e->set_max_tokens(2);
  e->set_ignore_eos(true);
  *r.mutable_landing() = landing;
  wire::PrefillResponse out;
  grpc::ClientContext ctx;
  grpc::Status s = prefill->Prefill(&ctx, r, &out);
  grpc::ClientContext release_ctx;
  wire::ReleaseRequest release;
  release.set_request_id(id);
  wire::ReleaseResponse ignored;
  (void)decode->Release(&release_ctx, release, &ignored);
  if (!s.ok()) return absl::InternalError("Prefill: " + s.error_message());
  return TransferFigures{.kv_mib = out.kv_bytes() / 1048576.0,
                         .prefill_ms = out.prefill_micros() / 1000.0,
                         .transfer_ms = out.transfer_micros() / 1000.0,
                         .tail_ms = out.transfer_tail_micros() / 1000.0};
}

int Run() {
  const std::string model_name = absl::GetFlag(FLAGS_model);
  const int reps = absl::GetFlag(FLAGS_reps);
  const int threads = absl::GetFlag(FLAGS_threads);
  const int decode_tokens = absl::GetFlag(FLAGS_decode_tokens);
  std::vector<int> lens;
  for (absl::string_view p :
       absl::StrSplit(absl::GetFlag(FLAGS_prompt_lens), ',')) {
    int n = 0;
    PD_CHECK(absl::SimpleAtoi(p, &n) && n > 0) << "bad --prompt_lens";
    lens.push_back(n);
  }
  const std::string backend = absl::GetFlag(FLAGS_backend);
  const std::string worker_args = absl::StrFormat(
      "--backend=%s --num_threads=%d --kv_cache_mb=512", backend, threads);
  auto fail = [](const absl::Status& s) {
    std::cerr << "pd-cluster-bench: " << s << "\n";
    return 1;
  };

  const std::vector<std::string> transports = absl::StrSplit(
      absl::GetFlag(FLAGS_kv_transports), ',', absl::SkipEmpty());
  PD_CHECK(!transports.empty()) << "empty --kv_transports";
  const bool transfer_only = absl::GetFlag(FLAGS_transfer_only);

  // Engine alone.
  std::vector<double> engine_ttft(lens.size());
  std::vector<double> engine_decode;
  if (!transfer_only) {
    auto model = Model::Load(model_name);
    if (!model.ok()) return fail(model.status());
    auto runner =
        CreateModelRunner(*model, {.backend = backend,
                                   .kv_cache_bytes = size_t{512} << 20,
                                   .num_threads = threads});
    if (!runner.ok()) return fail(runner.status());
    for (size_t i = 0; i < lens.size(); ++i) {
      std::vector<double> v;
      for (int r = 0; r < reps; ++r) {
        v.push_back(TimeEngine(**runner, Prompt(lens[i], r), 1).ttft_ms);
      }
      engine_ttft[i] = Median(v);
    }
    for (int r = 0; r < reps; ++r) {
      engine_decode.push_back(
          TimeEngine(**runner, Prompt(128, r), decode_tokens)
              .decode_tokens_per_s);
    }
  }

  // Colocated cluster, then 1P1D over each transport.
  std::vector<double> ttft[2];
  double cluster_decode = 0;
  // transfer[t][i]: transport t, prompt length i.
  std::vector<std::vector<TransferFigures>> transfer(transports.size());
  for (int setup = transfer_only ? 1 : 0;
       setup <= static_cast<int>(transports.size()); ++setup) {
    const bool colocated = setup == 0;
    const bool timed = !transfer_only && setup <= 1;  // Colocated, first 1P1D.
    const std::string kv_flag =
        colocated ? ""
                  : absl::StrCat(" --kv_transport=", transports[setup - 1]);
    auto cluster = LocalCluster::Start({.prefill = colocated ? 0 : 1,
                                        .decode = 1,
                                        .model = model_name,
                                        .prefill_args = worker_args + kv_flag,
                                        .decode_args = worker_args + kv_flag},
                                       PDSERVE_SOURCE_DIR, PDSERVE_BINARY_DIR);
    if (!cluster.ok()) return fail(cluster.status());
    for (size_t i = 0; i < lens.size(); ++i) {
      if (timed) {
        std::vector<double> v;
        for (int r = 0; r < reps; ++r) {
          auto t =
              TimeStream((*cluster)->router(), Prompt(lens[i], 1000 + r), 1);
          if (!t.ok()) return fail(t.status());
          v.push_back(t->ttft_ms);
        }
        ttft[setup].push_back(Median(v));
      }
      if (!colocated) {
        std::vector<TransferFigures> f;
        for (int r = 0; r < reps; ++r) {
          auto t = TimeTransfer(**cluster, Prompt(lens[i], 2000 + r),
                                (uint64_t{1} << 40) | (i * reps + r));
          if (!t.ok()) return fail(t.status());
          f.push_back(*t);
        }
        auto med = [&](double TransferFigures::*field) {
          std::vector<double> v;
          for (const auto& x : f) v.push_back(x.*field);
          return Median(v);
        };
        transfer[setup - 1].push_back({med(&TransferFigures::kv_mib),
                                       med(&TransferFigures::prefill_ms),
                                       med(&TransferFigures::transfer_ms),
                                       med(&TransferFigures::tail_ms)});
      }
    }
    if (timed && !colocated) {
      std::vector<double> v;
      for (int r = 0; r < reps; ++r) {
        auto t = TimeStream((*cluster)->router(), Prompt(128, 3000 + r),
                            decode_tokens);
        if (!t.ok()) return fail(t.status());
        v.push_back(t->decode_tokens_per_s);
      }
      cluster_decode = Median(v);
    }
  }

  auto hidden = [](const TransferFigures& f) {
    return f.transfer_ms > 0 ? 1.0 - f.tail_ms / f.transfer_ms : 0.0;
  };
  std::cout << absl::StrFormat(
      "model %s, backend %s, %d threads per worker, medians of %d\n\n",
      model_name, backend, threads, reps);
  if (!transfer_only) {
    std::cout << "1P1D over " << transports[0] << "\n\n"
              << "| prompt | engine TTFT ms | colocated TTFT ms | 1P1D TTFT ms "
                 "| 1P1D / colocated "
                 "| KV MiB | prefill ms | transfer ms | tail ms | hidden |\n"
                 "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n";
    for (size_t i = 0; i < lens.size(); ++i) {
      const TransferFigures& f = transfer[0][i];
      std::cout << absl::StrFormat(
          "| %d | %.1f | %.1f | %.1f | %.2f | %.1f | %.1f | %.1f | %.1f | "
          "%.1f%% |\n",
          lens[i], engine_ttft[i], ttft[0][i], ttft[1][i],
          ttft[1][i] / ttft[0][i], f.kv_mib, f.prefill_ms, f.transfer_ms,
          f.tail_ms, 100 * hidden(f));
    }
    const double engine_rate = Median(engine_decode);
    std::cout << absl::StrFormat(
        "\ndecode (prompt 128, %d tokens, batch 1): engine alone %.1f tok/s, "
        "1P1D cluster %.1f "
        "tok/s (%.0f%%)\n\n",
        decode_tokens, engine_rate, cluster_decode,
        100 * cluster_decode / engine_rate);
  }
  std::cout << "| prompt | transport | KV MiB | prefill ms | transfer ms | "
               "tail ms | hidden |\n"
               "|---:|---|---:|---:|---:|---:|---:|\n";
  for (size_t i = 0; i < lens.size(); ++i) {
    for (size_t t = 0; t < transports.size(); ++t) {
      const TransferFigures& f = transfer[t][i];
      std::cout << absl::StrFormat(
          "| %d | %s | %.1f | %.1f | %.1f | %.1f | %.1f%% |\n", lens[i],
          transports[t], f.kv_mib, f.prefill_ms, f.transfer_ms, f.tail_ms,
          100 * hidden(f));
    }
  }
  return 0;
}

}  // namespace
}  // namespace pdserve

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  return pdserve::Run();
}
