#include "planner/workload.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <numbers>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "absl/strings/string_view.h"
#include "absl/time/time.h"
#include "common/check.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace pdserve::planner {
namespace {

// The standard library's distributions (uniform_int, normal, gamma, ...)
// are implementation-defined: libstdc++ and libc++ turn the same engine
// state into different numbers. A workload must be the same on every
// machine, so only the engine (std::mt19937_64, fully specified) comes from
// the standard and the transforms below are our own.

// Uniform in (0, 1), never 0 or 1, so that its log is finite.
double UniformOpen(std::mt19937_64& rng) {
  return (static_cast<double>(rng() >> 11) + 0.5) * 0x1.0p-53;
}

// Uniform in [0, n), n > 0, unbiased: the draws below 2^64 mod n are
// rejected, which leaves a multiple of n equally likely values.
uint64_t UniformBelow(std::mt19937_64& rng, uint64_t n) {
  const uint64_t reject_below = (0 - n) % n;
  while (true) {
    const uint64_t x = rng();
    if (x >= reject_below) return x % n;
  }
}

// Box–Muller; one of the pair is dropped so that Sample stays const.
double StandardNormal(std::mt19937_64& rng) {
  const double u1 = UniformOpen(rng);
  const double u2 = UniformOpen(rng);
  return std::sqrt(-2 * std::log(u1)) * std::cos(2 * std::numbers::pi * u2);
}

// Gamma(shape, scale 1): Marsaglia and Tsang, "A simple method for
// generating gamma variables" (2000), with the boost U^(1/shape) for
// shape < 1 from its section 6.
double StandardGamma(std::mt19937_64& rng, double shape) {
  if (shape < 1) {
    const double u = UniformOpen(rng);
    return StandardGamma(rng, shape + 1) * std::pow(u, 1 / shape);
  }
  const double d = shape - 1.0 / 3;
  const double c = 1 / std::sqrt(9 * d);
  while (true) {
    double x, v;
    do {
      x = StandardNormal(rng);
      v = 1 + c * x;
    } while (v <= 0);
    v = v * v * v;
    const double u = UniformOpen(rng);
    if (u < 1 - 0.0331 * x * x * x * x) return d * v;
    if (std::log(u) < 0.5 * x * x + d * (1 - v + std::log(v))) return d * v;
  }
}

// The one rounding of a prompt to blocks (the last one may be partial).
int64_t BlocksFor(int64_t tokens, int64_t block_tokens) {
  return (tokens + block_tokens - 1) / block_tokens;
}

// Block id spaces. Ids that stand for content no other prompt has (unique
// synthetic blocks, Azure prompts, blocks a scaled trace prompt has beyond
// its hash_ids) count up from 0 with the top bit set; synthetic shared
// prefixes have the top two bits 01; trace hash_ids must stay below 2^62.
// So no two spaces can collide.
constexpr uint64_t kFreshIdBase = uint64_t{1} << 63;
constexpr uint64_t kPrefixIdBase = uint64_t{1} << 62;
constexpr uint64_t kMaxTraceId = kPrefixIdBase - 1;

// The id of block `block` of shared prefix `prefix` (both < 2^31).
uint64_t PrefixBlockId(uint64_t prefix, uint64_t block) {
  return kPrefixIdBase | (prefix << 31) | block;
}

absl::string_view ToAbsl(std::string_view s) {
  return absl::string_view(s.data(), s.size());
}

absl::StatusOr<int32_t> ParsePositiveInt(absl::string_view text,
                                         absl::string_view what) {
  int32_t value = 0;
  if (!absl::SimpleAtoi(text, &value)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " '", text, "' is not an integer"));
  }
  if (value < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " ", value, " is not positive"));
  }
  return value;
}

absl::StatusOr<double> ParseFinite(absl::string_view text,
                                   absl::string_view what) {
  double value = 0;
  if (!absl::SimpleAtod(text, &value) || !std::isfinite(value)) {
    return absl::InvalidArgumentError(
        absl::StrCat(what, " '", text, "' is not a finite number"));
  }
  return value;
}

}  // namespace

absl::StatusOr<LengthDistribution> LengthDistribution::Parse(
    std::string_view spec_text) {
  const absl::string_view spec = absl::StripAsciiWhitespace(ToAbsl(spec_text));
  // Every error names the spec and says what the forms are.
  auto bad = [&](const absl::Status& why) {
    return absl::InvalidArgumentError(
        absl::StrCat("length distribution '", spec, "': ", why.message(),
                     " (forms: \"512\", \"uniform:LO:HI\", "
                     "\"normal:MEAN:STDDEV\", \"hist:V=W,V=W,...\")"));
  };
  const std::vector<absl::string_view> parts = absl::StrSplit(spec, ':');
  LengthDistribution d;
  if (parts.size() == 1) {
    absl::StatusOr<int32_t> value = ParsePositiveInt(parts[0], "fixed length");
    if (!value.ok()) return bad(value.status());
    d.kind_ = Kind::kFixed;
    d.a_ = d.b_ = *value;
    d.spec_ = absl::StrCat(*value);
    return d;
  }
  const absl::string_view kind = parts[0];
  if (kind == "uniform") {
    if (parts.size() != 3)
      return bad(absl::InvalidArgumentError("uniform takes LO:HI"));
    absl::StatusOr<int32_t> lo = ParsePositiveInt(parts[1], "uniform LO");
    if (!lo.ok()) return bad(lo.status());
    absl::StatusOr<int32_t> hi = ParsePositiveInt(parts[2], "uniform HI");
    if (!hi.ok()) return bad(hi.status());
    if (*lo > *hi)
      return bad(absl::InvalidArgumentError("LO is greater than HI"));
    d.kind_ = Kind::kUniform;
    d.a_ = *lo;
    d.b_ = *hi;
    d.spec_ = absl::StrCat("uniform:", *lo, ":", *hi);
    return d;
  }
  if (kind == "normal") {
    if (parts.size() != 3)
      return bad(absl::InvalidArgumentError("normal takes MEAN:STDDEV"));
    absl::StatusOr<double> mean = ParseFinite(parts[1], "normal MEAN");
    if (!mean.ok()) return bad(mean.status());
    absl::StatusOr<double> stddev = ParseFinite(parts[2], "normal STDDEV");
    if (!stddev.ok()) return bad(stddev.status());
    if (*mean <= 0)
      return bad(absl::InvalidArgumentError("MEAN is not positive"));
    if (*stddev < 0)
      return bad(absl::InvalidArgumentError("STDDEV is negative"));
    if (*mean + 6 * *stddev > std::numeric_limits<int32_t>::max()) {
      return bad(absl::InvalidArgumentError(
          "MEAN + 6 * STDDEV does not fit in 32 bits"));
    }
    d.kind_ = Kind::kNormal;
    d.a_ = *mean;
    d.b_ = *stddev;
    d.spec_ = absl::StrFormat("normal:%g:%g", *mean, *stddev);
    return d;
  }
  if (kind == "hist") {
    if (parts.size() != 2 || parts[1].empty()) {
      return bad(absl::InvalidArgumentError("hist takes V=W,V=W,..."));
    }
    double total = 0;
    std::vector<std::string> normalised;
    for (absl::string_view item : absl::StrSplit(parts[1], ',')) {
      const std::vector<absl::string_view> pair = absl::StrSplit(item, '=');
      if (pair.size() != 2) {
        return bad(absl::InvalidArgumentError(
            absl::StrCat("'", item, "' is not V=W")));
      }
      absl::StatusOr<int32_t> value = ParsePositiveInt(pair[0], "hist value");
      if (!value.ok()) return bad(value.status());
      absl::StatusOr<double> weight = ParseFinite(pair[1], "hist weight");
      if (!weight.ok()) return bad(weight.status());
      if (*weight <= 0) {
        return bad(absl::InvalidArgumentError(
            absl::StrCat("hist weight of ", *value, " is not positive")));
      }
      d.values_.push_back(*value);
      d.weights_.push_back(*weight);
      total += *weight;
      normalised.push_back(absl::StrFormat("%d=%g", *value, *weight));
    }
    // Stored as probabilities, so that Sample needs no sum.
    for (double& w : d.weights_) w /= total;
    d.kind_ = Kind::kHistogram;
    d.spec_ = absl::StrCat("hist:", absl::StrJoin(normalised, ","));
    return d;
  }
  return bad(
      absl::InvalidArgumentError(absl::StrCat("unknown kind '", kind, "'")));
}

int32_t LengthDistribution::Sample(std::mt19937_64& rng) const {
  switch (kind_) {
    case Kind::kFixed:
      return static_cast<int32_t>(a_);
    case Kind::kUniform:
      return static_cast<int32_t>(a_) +
             static_cast<int32_t>(
                 UniformBelow(rng, static_cast<uint64_t>(b_ - a_) + 1));
    case Kind::kNormal: {
      const double upper = std::max(1.0, std::floor(a_ + 6 * b_));
      const double x = std::round(a_ + b_ * StandardNormal(rng));
      return static_cast<int32_t>(std::clamp(x, 1.0, upper));
    }
    case Kind::kHistogram: {
      double u = UniformOpen(rng);
      for (size_t i = 0; i < values_.size(); ++i) {
        if (u < weights_[i]) return values_[i];
        u -= weights_[i];
      }
      // The probabilities' rounding can leave u just above the last one.
      return values_.back();
    }
  }
  return 1;
}

double LengthDistribution::Mean() const {
  switch (kind_) {
    case Kind::kFixed:
    case Kind::kNormal:
      return a_;
    case Kind::kUniform:
      return (a_ + b_) / 2;
    case Kind::kHistogram: {
      double mean = 0;
      for (size_t i = 0; i < values_.size(); ++i)
        mean += values_[i] * weights_[i];
      return mean;
    }
  }
  return a_;
}

absl::StatusOr<Workload> MakeSyntheticWorkload(
    const SyntheticOptions& options) {
  if (options.num_requests <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("synthetic workload: num_requests ", options.num_requests,
                     " is not positive"));
  }
  if (options.block_tokens <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("synthetic workload: block_tokens ", options.block_tokens,
                     " is not positive"));
  }
  if (options.shared_prefix_tokens < 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("synthetic workload: shared_prefix_tokens ",
                     options.shared_prefix_tokens, " is negative"));
  }
  if (options.shared_prefix_tokens > 0 && options.num_prefixes <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("synthetic workload: num_prefixes ", options.num_prefixes,
                     " is not positive"));
  }
  Workload workload;
  workload.block_tokens = options.block_tokens;
  workload.requests.reserve(options.num_requests);
  std::mt19937_64 rng(options.seed);
  uint64_t next_fresh_id = kFreshIdBase;
  for (int32_t i = 0; i < options.num_requests; ++i) {
    WorkloadRequest request;
    request.input_tokens = options.input.Sample(rng);
    request.output_tokens = options.output.Sample(rng);
    int64_t prefix = -1;
    if (options.shared_prefix_tokens > 0) {
      prefix = static_cast<int64_t>(UniformBelow(rng, options.num_prefixes));
    }
    const int64_t blocks =
        BlocksFor(request.input_tokens, options.block_tokens);
    request.block_ids.reserve(blocks);
    for (int64_t b = 0; b < blocks; ++b) {
      // A block is the prefix's only if every token of it in this prompt
      // is a prefix token; a block straddling the prefix's end holds this
      // prompt's own tokens too, so it is this prompt's alone.
      const int64_t block_end = std::min<int64_t>(
          (b + 1) * options.block_tokens, request.input_tokens);
      if (prefix >= 0 && block_end <= options.shared_prefix_tokens) {
        request.block_ids.push_back(PrefixBlockId(prefix, b));
      } else {
        request.block_ids.push_back(next_fresh_id++);
      }
    }
    workload.requests.push_back(std::move(request));
  }
  workload.description = absl::StrFormat(
      "synthetic: %d requests, input %s, output %s", options.num_requests,
      options.input.spec(), options.output.spec());
  if (options.shared_prefix_tokens > 0) {
    absl::StrAppendFormat(&workload.description,
                          ", %d-token prefix shared from %d",
                          options.shared_prefix_tokens, options.num_prefixes);
  }
  absl::StrAppendFormat(&workload.description, ", seed %d", options.seed);
  return workload;
}

namespace {

// One request of a trace as read, before scaling.
struct TraceRow {
  double time_s = 0;  // Trace seconds.
  int64_t input_tokens = 0;
  int64_t output_tokens = 0;
  std::vector<uint64_t> hash_ids;  // Empty: no prefix information.
};

absl::Status LineError(const std::string& path, int64_t line,
                       absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(path, ":", line, ": ", what));
}

// A length field of a trace: a non-negative integer that fits in 32 bits.
absl::StatusOr<int64_t> CheckLength(int64_t value, absl::string_view name) {
  if (value < 0)
    return absl::InvalidArgumentError(
        absl::StrCat(name, " ", value, " is negative"));
  if (value > std::numeric_limits<int32_t>::max()) {
    return absl::InvalidArgumentError(
        absl::StrCat(name, " ", value, " is too large"));
  }
  return value;
}

absl::StatusOr<int64_t> JsonLength(const nlohmann::json& object,
                                   const char* name) {
  const auto it = object.find(name);
  if (it == object.end())
    return absl::InvalidArgumentError(absl::StrCat("no field '", name, "'"));
  if (!it->is_number_integer()) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", name, "' is not an integer"));
  }
  if (it->is_number_unsigned() &&
      it->get<uint64_t>() >
          static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", name, "' is too large"));
  }
  return CheckLength(it->get<int64_t>(), name);
}

// Mooncake: {"timestamp": ms, "input_length": n, "output_length": m,
// "hash_ids": [...]} per line; hash_ids may be left out.
absl::StatusOr<TraceRow> ParseMooncakeLine(const std::string& text) {
  const nlohmann::json object =
      nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (object.is_discarded() || !object.is_object()) {
    return absl::InvalidArgumentError("not a JSON object");
  }
  TraceRow row;
  const auto timestamp = object.find("timestamp");
  if (timestamp == object.end())
    return absl::InvalidArgumentError("no field 'timestamp'");
  if (!timestamp->is_number())
    return absl::InvalidArgumentError("'timestamp' is not a number");
  row.time_s = timestamp->get<double>() / 1000;
  if (row.time_s < 0)
    return absl::InvalidArgumentError("'timestamp' is negative");
  PD_ASSIGN_OR_RETURN(row.input_tokens, JsonLength(object, "input_length"));
  PD_ASSIGN_OR_RETURN(row.output_tokens, JsonLength(object, "output_length"));
  if (const auto ids = object.find("hash_ids"); ids != object.end()) {
    if (!ids->is_array())
      return absl::InvalidArgumentError("'hash_ids' is not an array");
    row.hash_ids.reserve(ids->size());
    for (const nlohmann::json& id : *ids) {
      if (!id.is_number_unsigned() || id.get<uint64_t>() > kMaxTraceId) {
        return absl::InvalidArgumentError(absl::StrCat(
            "'hash_ids' holds ", id.dump(), ", not an integer in [0, 2^62)"));
      }
      row.hash_ids.push_back(id.get<uint64_t>());
    }
  }
  return row;
}

absl::StatusOr<std::vector<TraceRow>> ReadMooncake(const std::string& path,
                                                   std::istream& in) {
  std::vector<TraceRow> rows;
  std::string text;
  for (int64_t line = 1; std::getline(in, text); ++line) {
    if (absl::StripAsciiWhitespace(text).empty()) continue;
    absl::StatusOr<TraceRow> row = ParseMooncakeLine(text);
    if (!row.ok()) return LineError(path, line, row.status().message());
    rows.push_back(*std::move(row));
  }
  return rows;
}

// Azure: a header naming TIMESTAMP, ContextTokens and GeneratedTokens (in
// any order), then one row per request; TIMESTAMP is a date and time such
// as "2023-11-16 18:15:46.6805900", read as UTC.
absl::StatusOr<std::vector<TraceRow>> ReadAzure(const std::string& path,
                                                std::istream& in) {
  std::string text;
  if (!std::getline(in, text)) return LineError(path, 1, "no header");
  const std::vector<std::string> header =
      absl::StrSplit(absl::StripAsciiWhitespace(text), ',');
  const char* const kColumns[] = {"TIMESTAMP", "ContextTokens",
                                  "GeneratedTokens"};
  size_t column[3];
  for (int c = 0; c < 3; ++c) {
    const auto it = std::find_if(
        header.begin(), header.end(), [&](const std::string& name) {
          return absl::StripAsciiWhitespace(name) == kColumns[c];
        });
    if (it == header.end()) {
      return LineError(
          path, 1, absl::StrCat("no column '", kColumns[c], "' in the header"));
    }
    column[c] = it - header.begin();
  }
  const size_t num_columns = *std::max_element(column, column + 3) + 1;

  std::vector<TraceRow> rows;
  std::vector<absl::Time> times;
  for (int64_t line = 2; std::getline(in, text); ++line) {
    const absl::string_view stripped = absl::StripAsciiWhitespace(text);
    if (stripped.empty()) continue;
    const std::vector<absl::string_view> fields = absl::StrSplit(stripped, ',');
    if (fields.size() < num_columns) {
      return LineError(
          path, line,
          absl::StrCat(fields.size(), " fields, expected ", header.size()));
    }
    const absl::string_view stamp =
        absl::StripAsciiWhitespace(fields[column[0]]);
    absl::Time time;
    std::string why;
    if (!absl::ParseTime("%Y-%m-%d %H:%M:%E*S", stamp, absl::UTCTimeZone(),
                         &time, &why)) {
      return LineError(path, line,
                       absl::StrCat("TIMESTAMP '", stamp,
                                    "' is not a date and time (", why, ")"));
    }
    TraceRow row;
    for (int c = 1; c < 3; ++c) {
      const absl::string_view field =
          absl::StripAsciiWhitespace(fields[column[c]]);
      int64_t value = 0;
      if (!absl::SimpleAtoi(field, &value)) {
        return LineError(
            path, line,
            absl::StrCat(kColumns[c], " '", field, "' is not an integer"));
      }
      absl::StatusOr<int64_t> length = CheckLength(value, kColumns[c]);
      if (!length.ok()) return LineError(path, line, length.status().message());
      (c == 1 ? row.input_tokens : row.output_tokens) = *length;
    }
    rows.push_back(std::move(row));
    times.push_back(time);
  }
  // Seconds since the earliest row (the first, in the published trace).
  if (!times.empty()) {
    const absl::Time origin = *std::min_element(times.begin(), times.end());
    for (size_t i = 0; i < rows.size(); ++i) {
      rows[i].time_s = absl::ToDoubleSeconds(times[i] - origin);
    }
  }
  return rows;
}

// A trace length divided by the scale: rounded up, at least 1, clipped.
int32_t ScaleLength(int64_t length, double scale, int32_t max_length) {
  const double scaled =
      std::max(1.0, std::ceil(static_cast<double>(length) / scale));
  const double clip =
      max_length > 0 ? max_length : std::numeric_limits<int32_t>::max();
  return static_cast<int32_t>(std::min(scaled, clip));
}

}  // namespace

absl::StatusOr<Workload> LoadTraceWorkload(const TraceOptions& options) {
  const std::string& path = options.path;
  auto bad_option = [&](absl::string_view what) {
    return absl::InvalidArgumentError(absl::StrCat("trace ", path, ": ", what));
  };
  if (!(options.length_scale > 0) || !std::isfinite(options.length_scale)) {
    return bad_option(absl::StrCat("length_scale ", options.length_scale,
                                   " is not positive"));
  }
  if (!(options.time_scale > 0) || !std::isfinite(options.time_scale)) {
    return bad_option(
        absl::StrCat("time_scale ", options.time_scale, " is not positive"));
  }
  if (!(options.start_s >= 0) || !std::isfinite(options.start_s)) {
    return bad_option(absl::StrCat("start_s ", options.start_s,
                                   " is not a time in the trace"));
  }
  if (!(options.duration_s > 0)) {
    return bad_option(
        absl::StrCat("duration_s ", options.duration_s, " is not positive"));
  }
  if (options.max_requests < 0 || options.max_input_tokens < 0 ||
      options.max_output_tokens < 0) {
    return bad_option(
        "max_requests, max_input_tokens and max_output_tokens must not be "
        "negative");
  }
  const bool mooncake = absl::EndsWith(path, ".jsonl");
  if (!mooncake && !absl::EndsWith(path, ".csv")) {
    return bad_option("unknown format (.jsonl: Mooncake, .csv: Azure)");
  }
  std::ifstream in(path);
  if (!in) {
    const int error = errno;
    const std::string why =
        absl::StrCat("cannot read trace ", path, ": ", std::strerror(error));
    if (error == ENOENT) return absl::NotFoundError(why);
    return absl::InvalidArgumentError(why);
  }
  absl::StatusOr<std::vector<TraceRow>> rows =
      mooncake ? ReadMooncake(path, in) : ReadAzure(path, in);
  if (!rows.ok()) return rows.status();
  if (in.bad()) {
    return absl::InvalidArgumentError(absl::StrCat("cannot read trace ", path));
  }
  // Both published traces are in time order already; a stable sort keeps
  // the order of equal times.
  std::stable_sort(
      rows->begin(), rows->end(),
      [](const TraceRow& a, const TraceRow& b) { return a.time_s < b.time_s; });

  Workload workload;
  workload.block_tokens = static_cast<int32_t>(
      std::clamp(std::round(512 / options.length_scale), 1.0,
                 double{std::numeric_limits<int32_t>::max()}));
  const double end_s =
      options.start_s + options.duration_s;  // May be infinite.
  uint64_t next_fresh_id = kFreshIdBase;
  for (const TraceRow& row : *rows) {
    if (row.time_s < options.start_s || row.time_s >= end_s) continue;
    if (options.max_requests > 0 &&
        workload.requests.size() >= static_cast<size_t>(options.max_requests)) {
      break;
    }
    WorkloadRequest request;
    request.arrival_s = (row.time_s - options.start_s) * options.time_scale;
    request.input_tokens = ScaleLength(row.input_tokens, options.length_scale,
                                       options.max_input_tokens);
    request.output_tokens = ScaleLength(row.output_tokens, options.length_scale,
                                        options.max_output_tokens);
    // The trace's ids, cut to this many blocks, or extended with fresh
    // ones when rounding left the scaled prompt a block more than it has.
    const size_t blocks =
        BlocksFor(request.input_tokens, workload.block_tokens);
    const size_t kept = std::min(blocks, row.hash_ids.size());
    request.block_ids.assign(row.hash_ids.begin(), row.hash_ids.begin() + kept);
    while (request.block_ids.size() < blocks)
      request.block_ids.push_back(next_fresh_id++);
    workload.requests.push_back(std::move(request));
  }

  const double span_s =
      workload.requests.empty() ? 0 : workload.requests.back().arrival_s;
  workload.description =
      absl::StrFormat("%s, lengths / %g, time x %g",
                      std::filesystem::path(path).filename().string(),
                      options.length_scale, options.time_scale);
  if (options.start_s > 0 || std::isfinite(options.duration_s)) {
    absl::StrAppendFormat(&workload.description, ", trace [%g s, %g s)",
                          options.start_s, end_s);
  }
  absl::StrAppendFormat(&workload.description, ", %d requests over %.0f s",
                        workload.requests.size(), span_s);
  return workload;
}

absl::Status AssignArrivals(const ArrivalOptions& options, Workload& workload) {
  if (!(options.rate > 0)) {
    return absl::InvalidArgumentError(
        absl::StrCat("arrival rate ", options.rate,
                     " is not a positive number of requests/s"));
  }
  if (!(options.burstiness > 0) || !std::isfinite(options.burstiness)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "burstiness ", options.burstiness, " is not a positive number"));
  }
  if (std::isinf(options.rate)) {
    for (WorkloadRequest& request : workload.requests) request.arrival_s = 0;
    return absl::OkStatus();
  }
  std::mt19937_64 rng(options.seed);
  double t = 0;
  for (WorkloadRequest& request : workload.requests) {
    request.arrival_s = t;
    // Gamma with shape k and scale 1 / (k * rate) has mean 1 / rate and
    // coefficient of variation 1 / sqrt(k); k = 1 is the exponential.
    const double k = options.burstiness;
    const double gap =
        k == 1 ? -std::log(UniformOpen(rng)) : StandardGamma(rng, k) / k;
    t += gap / options.rate;
  }
  return absl::OkStatus();
}

std::vector<int32_t> PromptTokens(const Workload& workload,
                                  const WorkloadRequest& request,
                                  const PromptOptions& options) {
  PD_CHECK(options.min_token <= options.max_token)
      << "min_token " << options.min_token << " > max_token "
      << options.max_token;
  PD_CHECK(workload.block_tokens > 0);
  PD_CHECK(static_cast<int64_t>(request.block_ids.size()) >=
           BlocksFor(request.input_tokens, workload.block_tokens))
      << request.block_ids.size() << " block ids for " << request.input_tokens
      << " tokens";
  const uint64_t span = static_cast<uint64_t>(
      static_cast<int64_t>(options.max_token) - options.min_token + 1);
  std::vector<int32_t> tokens;
  tokens.reserve(std::max(request.input_tokens, 0));
  for (uint64_t id : request.block_ids) {
    if (tokens.size() >= static_cast<size_t>(request.input_tokens)) break;
    std::mt19937_64 block_rng(id);
    for (int32_t i = 0;
         i < workload.block_tokens &&
         tokens.size() < static_cast<size_t>(request.input_tokens);
         ++i) {
      tokens.push_back(options.min_token +
                       static_cast<int32_t>(UniformBelow(block_rng, span)));
    }
  }
  return tokens;
}

}  // namespace pdserve::planner
