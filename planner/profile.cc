#include "planner/profile.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <limits>
#include <sstream>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"

namespace pdserve::planner {
namespace {

using Json = nlohmann::json;

absl::Status FieldError(absl::string_view field, absl::string_view problem) {
  return absl::InvalidArgumentError(absl::StrCat("profile: field '", field, "' ", problem));
}

// Every field is required: a profile is written by `pd-plan profile`, and a
// field silently defaulted would simulate another machine.
absl::StatusOr<const Json*> Field(const Json& j, absl::string_view prefix, const char* name) {
  auto it = j.find(name);
  if (it == j.end()) return FieldError(absl::StrCat(prefix, name), "is missing");
  return &*it;
}

absl::Status ReadString(const Json& j, absl::string_view prefix, const char* name,
                        std::string& out) {
  PD_ASSIGN_OR_RETURN(const Json* v, Field(j, prefix, name));
  if (!v->is_string()) return FieldError(absl::StrCat(prefix, name), "must be a string");
  out = v->get<std::string>();
  return absl::OkStatus();
}

// A JSON value as an integer of type Int (in its range) or as a double;
// `where` names it in the error.
template <typename Int>
absl::Status NumberValue(const Json& v, absl::string_view where, Int& out) {
  if (!v.is_number_integer()) return FieldError(where, "must be an integer");
  // An unsigned JSON integer beyond int64 reads as negative here, and is
  // refused below as out of range.
  const int64_t x = v.get<int64_t>();
  if (x < std::numeric_limits<Int>::min() || x > std::numeric_limits<Int>::max()) {
    return FieldError(where, "is out of range");
  }
  out = static_cast<Int>(x);
  return absl::OkStatus();
}

absl::Status NumberValue(const Json& v, absl::string_view where, double& out) {
  if (!v.is_number()) return FieldError(where, "must be a number");
  out = v.get<double>();
  return absl::OkStatus();
}

template <typename Int>
absl::Status ReadInt(const Json& j, absl::string_view prefix, const char* name, Int& out) {
  PD_ASSIGN_OR_RETURN(const Json* v, Field(j, prefix, name));
  return NumberValue(*v, absl::StrCat(prefix, name), out);
}

absl::Status ReadDouble(const Json& j, absl::string_view prefix, const char* name, double& out) {
  PD_ASSIGN_OR_RETURN(const Json* v, Field(j, prefix, name));
  return NumberValue(*v, absl::StrCat(prefix, name), out);
}

// An array of numbers, each as NumberValue reads it.
template <typename Value>
absl::Status ReadArray(const Json& j, absl::string_view prefix, const char* name,
                       std::vector<Value>& out) {
  PD_ASSIGN_OR_RETURN(const Json* v, Field(j, prefix, name));
  if (!v->is_array()) return FieldError(absl::StrCat(prefix, name), "must be an array");
  out.assign(v->size(), Value{});
  for (size_t i = 0; i < v->size(); ++i) {
    PD_RETURN_IF_ERROR(NumberValue((*v)[i], absl::StrCat(prefix, name, "[", i, "]"), out[i]));
  }
  return absl::OkStatus();
}

bool NonNegative(double x) { return std::isfinite(x) && x >= 0; }

}  // namespace

std::pair<size_t, double> StepCost::DenseSegment(int64_t tokens) const {
  const auto upper = std::upper_bound(dense_tokens.begin() + 1, dense_tokens.end() - 1, tokens);
  const size_t i = static_cast<size_t>(upper - dense_tokens.begin());
  const double x0 = dense_tokens[i - 1], x1 = dense_tokens[i];
  return {i, (static_cast<double>(tokens) - x0) / (x1 - x0)};
}

double StepCost::Dense(int64_t tokens) const {
  if (dense_tokens.empty()) return 0;
  if (dense_tokens.size() == 1) return dense_s[0];
  const auto [i, f] = DenseSegment(tokens);
  return std::max(0.0, (1 - f) * dense_s[i - 1] + f * dense_s[i]);
}

Profile WithDrift(Profile p, double prefill, double decode) {
  p.prefill_engine_scale *= prefill;
  p.prefill_cpu_per_request_s *= prefill;
  p.prefill_cpu_per_kv_byte_s *= prefill;
  p.decode_engine_scale *= decode;
  p.decode_batch_scale *= decode;
  p.decode_step_overhead_s *= decode;
  p.decode_sequence_overhead_s *= decode;
  p.decode_cpu_per_token_s *= decode;
  return p;
}

std::string ProfileSpeedWarning(const Profile& p) {
  const double off = std::abs(p.probe_ratio - 1);
  if (!(off > 0.25)) return "";
  return absl::StrFormat(
      "the drift probe right after the fit ran %.0f%% %s than the fitted model: the machine's "
      "speed changed while it was profiled, and predictions from this profile can be off by as "
      "much (docs/capacity_planning.md, run 11). Profile again when the machine is quiet.",
      off * 100, p.probe_ratio < 1 ? "faster" : "slower");
}

absl::Status ValidateProfile(const Profile& p) {
  if (p.threads < 1) return FieldError("threads", "must be at least 1");
  if (p.block_size < 1) return FieldError("block_size", "must be at least 1");
  if (p.max_running < 1) return FieldError("max_running", "must be at least 1");
  if (p.max_batch_tokens < p.max_running) {
    return FieldError("max_batch_tokens", "must be at least max_running (the engine refuses less)");
  }
  if (p.prefill_kv_blocks < 0) return FieldError("prefill_kv_blocks", "must not be negative");
  if (p.decode_kv_blocks < 1) return FieldError("decode_kv_blocks", "must be at least 1");
  if (p.prefill_kv_blocks > std::numeric_limits<int32_t>::max() ||
      p.decode_kv_blocks > std::numeric_limits<int32_t>::max()) {
    return FieldError(
        p.prefill_kv_blocks > p.decode_kv_blocks ? "prefill_kv_blocks" : "decode_kv_blocks",
        "is beyond what a KV pool holds (2^31 - 1 blocks)");
  }
  if (p.max_context < 0) return FieldError("max_context", "must not be negative");
  const std::pair<const char*, double> costs[] = {
      {"step.base_s", p.step.base_s},
      {"step.per_token_s", p.step.per_token_s},
      {"step.per_sequence_s", p.step.per_sequence_s},
      {"step.per_attention_s", p.step.per_attention_s},
      {"step.per_decode_attention_s", p.step.per_decode_attention_s},
      {"step.decode_cache_tokens", p.step.decode_cache_tokens},
      {"step.per_decode_kv_beyond_cache_s", p.step.per_decode_kv_beyond_cache_s},
      {"kv_bytes_per_token", p.kv_bytes_per_token},
      {"colocated_first_token_s", p.colocated_first_token_s},
      {"disaggregated_first_token_s", p.disaggregated_first_token_s},
      {"disaggregated_token_delivery_s", p.disaggregated_token_delivery_s},
      {"token_delivery_s", p.token_delivery_s},
      {"decode_step_overhead_s", p.decode_step_overhead_s},
      {"decode_sequence_overhead_s", p.decode_sequence_overhead_s},
      {"prefill_cpu_per_request_s", p.prefill_cpu_per_request_s},
      {"prefill_cpu_per_kv_byte_s", p.prefill_cpu_per_kv_byte_s},
      {"decode_cpu_per_token_s", p.decode_cpu_per_token_s},
      {"worker_cpus", p.worker_cpus},
  };
  for (const auto& [name, value] : costs) {
    if (!NonNegative(value)) return FieldError(name, "must be a non-negative number");
  }
  if (p.step.dense_tokens.size() != p.step.dense_s.size()) {
    return FieldError("step.dense_s", "must have one cost for each of step.dense_tokens");
  }
  for (size_t i = 0; i < p.step.dense_tokens.size(); ++i) {
    if (p.step.dense_tokens[i] < 1 ||
        (i > 0 && p.step.dense_tokens[i] <= p.step.dense_tokens[i - 1])) {
      return FieldError("step.dense_tokens", "must be ascending row counts of at least 1");
    }
    if (!NonNegative(p.step.dense_s[i])) {
      return FieldError(absl::StrCat("step.dense_s[", i, "]"), "must be a non-negative number");
    }
  }
  if (!(std::isfinite(p.poll_interval_s) && p.poll_interval_s > 0)) {
    return FieldError("poll_interval_s", "must be a positive number");
  }
  if (!(std::isfinite(p.probe_ratio) && p.probe_ratio > 0)) {
    return FieldError("probe_ratio", "must be a positive number");
  }
  for (const auto& [name, scale] : {std::pair{"prefill_engine_scale", p.prefill_engine_scale},
                                     std::pair{"decode_engine_scale", p.decode_engine_scale},
                                     std::pair{"decode_batch_scale", p.decode_batch_scale}}) {
    if (!(std::isfinite(scale) && scale > 0)) return FieldError(name, "must be a positive number");
  }
  for (size_t i = 0; i < p.transfers.size(); ++i) {
    const TransferCost& t = p.transfers[i];
    const std::string where = absl::StrCat("transfers[", i, "].");
    if (t.transport.empty()) return FieldError(absl::StrCat(where, "transport"), "is empty");
    if (!NonNegative(t.latency_s)) {
      return FieldError(absl::StrCat(where, "latency_s"), "must be a non-negative number");
    }
    if (!(std::isfinite(t.bytes_per_s) && t.bytes_per_s > 0)) {
      return FieldError(absl::StrCat(where, "bytes_per_s"), "must be a positive number");
    }
    for (size_t k = 0; k < i; ++k) {
      if (p.transfers[k].transport == t.transport) {
        return FieldError(absl::StrCat(where, "transport"),
                          absl::StrCat("'", t.transport, "' is listed twice"));
      }
    }
  }
  return absl::OkStatus();
}

nlohmann::json ToJson(const Profile& p) {
  Json transfers = Json::array();
  for (const TransferCost& t : p.transfers) {
    transfers.push_back(
        {{"transport", t.transport}, {"latency_s", t.latency_s}, {"bytes_per_s", t.bytes_per_s}});
  }
  return {
      {"model", p.model},
      {"machine", p.machine},
      {"cpu_share", p.cpu_share},
      {"worker_cpus", p.worker_cpus},
      {"threads", p.threads},
      {"block_size", p.block_size},
      {"max_batch_tokens", p.max_batch_tokens},
      {"max_running", p.max_running},
      {"prefill_kv_blocks", p.prefill_kv_blocks},
      {"decode_kv_blocks", p.decode_kv_blocks},
      {"max_context", p.max_context},
      {"step",
       {{"base_s", p.step.base_s},
        {"per_token_s", p.step.per_token_s},
        {"per_sequence_s", p.step.per_sequence_s},
        {"per_attention_s", p.step.per_attention_s},
        {"per_decode_attention_s", p.step.per_decode_attention_s},
        {"decode_cache_tokens", p.step.decode_cache_tokens},
        {"per_decode_kv_beyond_cache_s", p.step.per_decode_kv_beyond_cache_s},
        {"dense_tokens", p.step.dense_tokens},
        {"dense_s", p.step.dense_s}}},
      {"kv_bytes_per_token", p.kv_bytes_per_token},
      {"transfers", std::move(transfers)},
      {"colocated_first_token_s", p.colocated_first_token_s},
      {"disaggregated_first_token_s", p.disaggregated_first_token_s},
      {"disaggregated_token_delivery_s", p.disaggregated_token_delivery_s},
      {"token_delivery_s", p.token_delivery_s},
      {"decode_step_overhead_s", p.decode_step_overhead_s},
      {"decode_sequence_overhead_s", p.decode_sequence_overhead_s},
      {"prefill_cpu_per_request_s", p.prefill_cpu_per_request_s},
      {"prefill_cpu_per_kv_byte_s", p.prefill_cpu_per_kv_byte_s},
      {"decode_cpu_per_token_s", p.decode_cpu_per_token_s},
      {"prefill_engine_scale", p.prefill_engine_scale},
      {"decode_engine_scale", p.decode_engine_scale},
      {"decode_batch_scale", p.decode_batch_scale},
      {"poll_interval_s", p.poll_interval_s},
      {"probe_ratio", p.probe_ratio},
  };
}

absl::StatusOr<Profile> ProfileFromJson(const nlohmann::json& j) {
  if (!j.is_object()) return absl::InvalidArgumentError("profile: not a JSON object");
  Profile p;
  PD_RETURN_IF_ERROR(ReadString(j, "", "model", p.model));
  PD_RETURN_IF_ERROR(ReadString(j, "", "machine", p.machine));
  PD_RETURN_IF_ERROR(ReadString(j, "", "cpu_share", p.cpu_share));
  PD_RETURN_IF_ERROR(ReadDouble(j, "", "worker_cpus", p.worker_cpus));
  PD_RETURN_IF_ERROR(ReadInt(j, "", "threads", p.threads));
  PD_RETURN_IF_ERROR(ReadInt(j, "", "block_size", p.block_size));
  PD_RETURN_IF_ERROR(ReadInt(j, "", "max_batch_tokens", p.max_batch_tokens));
  PD_RETURN_IF_ERROR(ReadInt(j, "", "max_running", p.max_running));
  PD_RETURN_IF_ERROR(ReadInt(j, "", "prefill_kv_blocks", p.prefill_kv_blocks));
  PD_RETURN_IF_ERROR(ReadInt(j, "", "decode_kv_blocks", p.decode_kv_blocks));
  PD_RETURN_IF_ERROR(ReadInt(j, "", "max_context", p.max_context));
  PD_ASSIGN_OR_RETURN(const Json* step, Field(j, "", "step"));
  if (!step->is_object()) return FieldError("step", "must be an object");
  PD_RETURN_IF_ERROR(ReadDouble(*step, "step.", "base_s", p.step.base_s));
  PD_RETURN_IF_ERROR(ReadDouble(*step, "step.", "per_token_s", p.step.per_token_s));
  PD_RETURN_IF_ERROR(ReadDouble(*step, "step.", "per_sequence_s", p.step.per_sequence_s));
  PD_RETURN_IF_ERROR(ReadDouble(*step, "step.", "per_attention_s", p.step.per_attention_s));
  PD_RETURN_IF_ERROR(
      ReadDouble(*step, "step.", "per_decode_attention_s", p.step.per_decode_attention_s));
  PD_RETURN_IF_ERROR(
      ReadDouble(*step, "step.", "decode_cache_tokens", p.step.decode_cache_tokens));
  PD_RETURN_IF_ERROR(ReadDouble(*step, "step.", "per_decode_kv_beyond_cache_s",
                                p.step.per_decode_kv_beyond_cache_s));
  PD_RETURN_IF_ERROR(ReadArray(*step, "step.", "dense_tokens", p.step.dense_tokens));
  PD_RETURN_IF_ERROR(ReadArray(*step, "step.", "dense_s", p.step.dense_s));
  PD_RETURN_IF_ERROR(ReadDouble(j, "", "kv_bytes_per_token", p.kv_bytes_per_token));
  PD_ASSIGN_OR_RETURN(const Json* transfers, Field(j, "", "transfers"));
  if (!transfers->is_array()) return FieldError("transfers", "must be an array");
  for (size_t i = 0; i < transfers->size(); ++i) {
    const Json& t = (*transfers)[i];
    const std::string where = absl::StrCat("transfers[", i, "].");
    if (!t.is_object()) {
      return FieldError(absl::StrCat("transfers[", i, "]"), "must be an object");
    }
    TransferCost& cost = p.transfers.emplace_back();
    PD_RETURN_IF_ERROR(ReadString(t, where, "transport", cost.transport));
    PD_RETURN_IF_ERROR(ReadDouble(t, where, "latency_s", cost.latency_s));
    PD_RETURN_IF_ERROR(ReadDouble(t, where, "bytes_per_s", cost.bytes_per_s));
  }
  PD_RETURN_IF_ERROR(ReadDouble(j, "", "colocated_first_token_s", p.colocated_first_token_s));
  PD_RETURN_IF_ERROR(
      ReadDouble(j, "", "disaggregated_first_token_s", p.disaggregated_first_token_s));
  PD_RETURN_IF_ERROR(ReadDouble(j, "", "disaggregated_token_delivery_s",
                                p.disaggregated_token_delivery_s));
  PD_RETURN_IF_ERROR(ReadDouble(j, "", "token_delivery_s", p.token_delivery_s));
  PD_RETURN_IF_ERROR(ReadDouble(j, "", "decode_step_overhead_s", p.decode_step_overhead_s));
  PD_RETURN_IF_ERROR(
      ReadDouble(j, "", "decode_sequence_overhead_s", p.decode_sequence_overhead_s));
  PD_RETURN_IF_ERROR(
      ReadDouble(j, "", "prefill_cpu_per_request_s", p.prefill_cpu_per_request_s));
  PD_RETURN_IF_ERROR(
      ReadDouble(j, "", "prefill_cpu_per_kv_byte_s", p.prefill_cpu_per_kv_byte_s));
  PD_RETURN_IF_ERROR(ReadDouble(j, "", "decode_cpu_per_token_s", p.decode_cpu_per_token_s));
  PD_RETURN_IF_ERROR(
      ReadDouble(j, "", "prefill_engine_scale", p.prefill_engine_scale));
  PD_RETURN_IF_ERROR(ReadDouble(j, "", "decode_engine_scale", p.decode_engine_scale));
  PD_RETURN_IF_ERROR(ReadDouble(j, "", "decode_batch_scale", p.decode_batch_scale));
  PD_RETURN_IF_ERROR(ReadDouble(j, "", "poll_interval_s", p.poll_interval_s));
  PD_RETURN_IF_ERROR(ReadDouble(j, "", "probe_ratio", p.probe_ratio));
  PD_RETURN_IF_ERROR(ValidateProfile(p));
  return p;
}

absl::StatusOr<Profile> ReadProfile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat("profile ", path, ": cannot open"));
  std::stringstream text;
  text << in.rdbuf();
  const Json j = Json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    return absl::InvalidArgumentError(absl::StrCat("profile ", path, ": not valid JSON"));
  }
  absl::StatusOr<Profile> profile = ProfileFromJson(j);
  if (!profile.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", profile.status().message()));
  }
  return profile;
}

absl::Status WriteProfile(const std::string& path, const Profile& profile) {
  std::ofstream out(path);
  if (!out) return absl::InvalidArgumentError(absl::StrCat("profile ", path, ": cannot write"));
  out << ToJson(profile).dump(2) << "\n";
  out.close();
  if (!out) return absl::InvalidArgumentError(absl::StrCat("profile ", path, ": write failed"));
  return absl::OkStatus();
}

}  // namespace pdserve::planner
