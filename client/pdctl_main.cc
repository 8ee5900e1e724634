// pdctl: the pdserve command line.
//
//   pdctl generate --server=HOST:PORT [sampling flags] [--stop=S,...] PROMPT
//   pdctl generate --local [--model=DIR|builtin:tiny] [sampling flags] PROMPT
//   pdctl tokenize --server=HOST:PORT TEXT
//   pdctl tokenize [--model=...] TEXT
//   pdctl status --server=HOST:PORT
//   pdctl convert-llama2c CHECKPOINT.bin TOKENIZER.bin OUT_DIR
//
// Remote commands take --api_key (default: $PDSERVE_API_KEY), --tls,
// --tls_root_certs=PEM_FILE, and --tls_cert=PEM_FILE --tls_key=PEM_FILE for
// a router that asks for client certificates.
#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "pdserve/v1/generation.pb.h"
#include "client/pdctl_commands.h"
#include "engine/model_files/llama2c.h"

ABSL_FLAG(std::string, server, "", "pd-router address HOST:PORT");
ABSL_FLAG(std::string, model, "",
          "Local: model directory (Hugging Face layout) or builtin:tiny (the "
          "default). Remote: model name (default: the served model)");
ABSL_FLAG(bool, local, false, "Run the model in this process instead of asking a router");
ABSL_FLAG(std::string, backend, "cpu", "Engine backend for --local");
ABSL_FLAG(int32_t, threads, 0, "CPU threads for --local (0: every core)");
ABSL_FLAG(int32_t, max_tokens, 64, "Most tokens to generate");
ABSL_FLAG(double, temperature, 0.0, "Sampling temperature; 0 is greedy");
ABSL_FLAG(int32_t, top_k, 0, "Top-k filter (0: off)");
ABSL_FLAG(double, top_p, 1.0, "Top-p (nucleus) filter");
ABSL_FLAG(double, min_p, 0.0, "Min-p filter");
ABSL_FLAG(int64_t, seed, -1, "Sampling seed (-1: random)");
ABSL_FLAG(bool, ignore_eos, false, "Keep generating past EOS");
ABSL_FLAG(bool, add_special_tokens, true, "Add BOS (as the tokenizer says) to the prompt");
ABSL_FLAG(bool, stats, false, "Print prompt size, TTFT and decode speed on stderr (--local)");
ABSL_FLAG(std::vector<std::string>, stop, {},
          "Stop strings, comma-separated (remote generate)");
ABSL_FLAG(std::string, api_key, "",
          "API key sent to the router as 'authorization: Bearer KEY' "
          "(default: $PDSERVE_API_KEY)");
ABSL_FLAG(bool, tls, false, "Connect to the router over TLS");
ABSL_FLAG(std::string, tls_root_certs, "",
          "PEM file of the root certificates for --tls (default: the "
          "system's)");
ABSL_FLAG(std::string, tls_cert, "",
          "PEM file of the client certificate chain presented to a router "
          "that asks for one (with --tls_key; implies --tls)");
ABSL_FLAG(std::string, tls_key, "", "PEM file of --tls_cert's private key");

namespace {

// The text of the file of `flag`.
absl::StatusOr<std::string> ReadFlagFile(const std::string& flag,
                                         const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read --", flag, " file '", path, "'"));
  }
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

constexpr char kUsage[] =
    "pdctl COMMAND [flags] ARGS\n"
    "  generate --server=HOST:PORT PROMPT                     stream a completion from pd-router\n"
    "  generate --local [--model=DIR|builtin:tiny] PROMPT   ... computed in this process\n"
    "  tokenize --server=HOST:PORT TEXT                       print token ids (server's tokenizer)\n"
    "  tokenize [--model=DIR|builtin:tiny] TEXT               ... and their pieces, locally\n"
    "  status --server=HOST:PORT                              health, workers and models\n"
    "  convert-llama2c CHECKPOINT TOKENIZER OUT_DIR           llama2.c -> HF directory\n"
    "remote commands: --api_key=KEY (default $PDSERVE_API_KEY), --tls, --tls_root_certs=PEM,\n"
    "  --tls_cert=PEM --tls_key=PEM";

std::string LocalModel() {
  const std::string model = absl::GetFlag(FLAGS_model);
  return model.empty() ? "builtin:tiny" : model;
}

pdserve::v1::GenerateRequest RemoteRequest(const std::string& prompt) {
  pdserve::v1::GenerateRequest r;
  r.set_model(absl::GetFlag(FLAGS_model));
  r.set_text(prompt);
  r.set_add_special_tokens(absl::GetFlag(FLAGS_add_special_tokens));
  r.set_max_tokens(static_cast<uint32_t>(std::max(0, absl::GetFlag(FLAGS_max_tokens))));
  pdserve::v1::SamplingParams* s = r.mutable_sampling();
  s->set_temperature(static_cast<float>(absl::GetFlag(FLAGS_temperature)));
  s->set_top_k(absl::GetFlag(FLAGS_top_k));
  s->set_top_p(static_cast<float>(absl::GetFlag(FLAGS_top_p)));
  s->set_min_p(static_cast<float>(absl::GetFlag(FLAGS_min_p)));
  if (absl::GetFlag(FLAGS_seed) >= 0) s->set_seed(static_cast<uint64_t>(absl::GetFlag(FLAGS_seed)));
  r.set_ignore_eos(absl::GetFlag(FLAGS_ignore_eos));
  for (const std::string& stop : absl::GetFlag(FLAGS_stop)) r.add_stop(stop);
  return r;
}

// The SDK options of the remote commands, from the flags.
absl::StatusOr<pdserve::GenerationClient::Options> ClientOptions() {
  pdserve::GenerationClient::Options options;
  options.api_key = absl::GetFlag(FLAGS_api_key);
  if (const char* env = std::getenv("PDSERVE_API_KEY");
      options.api_key.empty() && env != nullptr) {
    options.api_key = env;
  }
  options.tls = absl::GetFlag(FLAGS_tls);
  if (const std::string path = absl::GetFlag(FLAGS_tls_root_certs);
      !path.empty()) {
    absl::StatusOr<std::string> pem = ReadFlagFile("tls_root_certs", path);
    if (!pem.ok()) return pem.status();
    options.tls = true;
    options.tls_root_certificates = *std::move(pem);
  }
  const std::string cert = absl::GetFlag(FLAGS_tls_cert);
  const std::string key = absl::GetFlag(FLAGS_tls_key);
  if (cert.empty() != key.empty()) {
    return absl::InvalidArgumentError(cert.empty()
                                          ? "--tls_cert is required with --tls_key"
                                          : "--tls_key is required with --tls_cert");
  }
  if (!cert.empty()) {
    absl::StatusOr<std::string> chain = ReadFlagFile("tls_cert", cert);
    if (!chain.ok()) return chain.status();
    absl::StatusOr<std::string> pem_key = ReadFlagFile("tls_key", key);
    if (!pem_key.ok()) return pem_key.status();
    options.tls = true;
    options.tls_certificate_chain = *std::move(chain);
    options.tls_private_key = *std::move(pem_key);
  }
  return options;
}

int Fail(const absl::Status& status) {
  std::cerr << "pdctl: " << status << "\n";
  return 1;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() < 2) {
    std::cerr << kUsage << "\n";
    return 2;
  }
  const std::string command = args[1];
  const std::vector<std::string> rest(args.begin() + 2, args.end());

  const std::string server = absl::GetFlag(FLAGS_server);
  const absl::StatusOr<pdserve::GenerationClient::Options> client = ClientOptions();
  if (!client.ok()) return Fail(client.status());
  if (command == "generate") {
    if (rest.empty()) return Fail(absl::InvalidArgumentError("generate needs a PROMPT"));
    if (!absl::GetFlag(FLAGS_local)) {
      if (server.empty()) {
        return Fail(absl::InvalidArgumentError("generate needs --server=HOST:PORT or --local"));
      }
      const absl::Status s = pdserve::GenerateRemote(
          server, RemoteRequest(absl::StrJoin(rest, " ")), std::cout, std::cerr, *client);
      return s.ok() ? 0 : Fail(s);
    }
    pdserve::LocalGenerateOptions o;
    o.model = LocalModel();
    o.backend = absl::GetFlag(FLAGS_backend);
    o.num_threads = absl::GetFlag(FLAGS_threads);
    o.add_bos = absl::GetFlag(FLAGS_add_special_tokens);
    o.print_stats = absl::GetFlag(FLAGS_stats);
    o.sampling.max_tokens = absl::GetFlag(FLAGS_max_tokens);
    o.sampling.temperature = static_cast<float>(absl::GetFlag(FLAGS_temperature));
    o.sampling.top_k = absl::GetFlag(FLAGS_top_k);
    o.sampling.top_p = static_cast<float>(absl::GetFlag(FLAGS_top_p));
    o.sampling.min_p = static_cast<float>(absl::GetFlag(FLAGS_min_p));
    o.sampling.ignore_eos = absl::GetFlag(FLAGS_ignore_eos);
    if (absl::GetFlag(FLAGS_seed) >= 0) o.sampling.seed = absl::GetFlag(FLAGS_seed);
    const absl::Status s =
        pdserve::GenerateLocal(o, absl::StrJoin(rest, " "), std::cout, std::cerr);
    return s.ok() ? 0 : Fail(s);
  }
  if (command == "tokenize") {
    if (rest.empty()) return Fail(absl::InvalidArgumentError("tokenize needs TEXT"));
    const absl::Status s =
        server.empty()
            ? pdserve::Tokenize(LocalModel(), absl::StrJoin(rest, " "),
                                absl::GetFlag(FLAGS_add_special_tokens), std::cout)
            : pdserve::TokenizeRemote(server, absl::StrJoin(rest, " "),
                                      absl::GetFlag(FLAGS_add_special_tokens), std::cout,
                                      *client);
    return s.ok() ? 0 : Fail(s);
  }
  if (command == "status") {
    if (server.empty()) return Fail(absl::InvalidArgumentError("status needs --server=HOST:PORT"));
    const absl::Status s = pdserve::ServerStatus(server, std::cout, *client);
    return s.ok() ? 0 : Fail(s);
  }
  if (command == "convert-llama2c") {
    if (rest.size() != 3) {
      return Fail(absl::InvalidArgumentError("usage: convert-llama2c CHECKPOINT TOKENIZER OUT_DIR"));
    }
    const absl::Status s = pdserve::ConvertLlama2cToHf(rest[0], rest[1], rest[2]);
    if (s.ok()) std::cout << "wrote " << rest[2] << "\n";
    return s.ok() ? 0 : Fail(s);
  }
  std::cerr << "pdctl: unknown command '" << command << "'\n" << kUsage << "\n";
  return 2;
}
