#include "router/api_keys.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"

namespace pdserve {
namespace {

constexpr size_t kMaxKeyLength = 256;

// Why `key` cannot be a key, or "" when it can.
std::string KeyProblem(absl::string_view key) {
  if (key.empty()) return "is empty";
  if (key.size() > kMaxKeyLength) {
    return absl::StrCat("is longer than ", kMaxKeyLength, " characters");
  }
  for (char c : key) {
    // Printable ASCII is 0x21..0x7e once space is excluded.
    if (c < 0x21 || c > 0x7e || c == ',') {
      return "has a character other than printable ASCII without space and ','";
    }
  }
  return "";
}

// Equal contents, in time that depends on the length of `secret` only: no
// early exit at the first differing byte.
bool ConstantTimeEquals(absl::string_view given, absl::string_view secret) {
  unsigned char diff = given.size() == secret.size() ? 0 : 1;
  for (size_t i = 0; i < secret.size(); ++i) {
    const unsigned char g =
        i < given.size() ? static_cast<unsigned char>(given[i]) : 0;
    diff |= g ^ static_cast<unsigned char>(secret[i]);
  }
  return diff == 0;
}

constexpr absl::string_view kWhatToSend =
    "send the gRPC metadata (or HTTP header) 'authorization: Bearer <key>' "
    "with a key the server was started with (pd-router --api_key or "
    "--api_key_file)";

}  // namespace

absl::StatusOr<ApiKeys> ApiKeys::Create(const std::vector<std::string>& keys) {
  std::vector<std::string> distinct;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (std::string problem = KeyProblem(keys[i]); !problem.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("API key ", i + 1, " of ", keys.size(), " ", problem));
    }
    if (std::find(distinct.begin(), distinct.end(), keys[i]) ==
        distinct.end()) {
      distinct.push_back(keys[i]);
    }
  }
  return ApiKeys(std::move(distinct));
}

absl::Status ApiKeys::Check(std::string_view header_value) const {
  if (keys_.empty()) return absl::OkStatus();
  // Debian's Abseil has its own string_view.
  const absl::string_view value(header_value.data(), header_value.size());
  if (value.empty()) {
    return absl::UnauthenticatedError(
        absl::StrCat("this server requires an API key: ", kWhatToSend));
  }
  constexpr absl::string_view kScheme = "Bearer ";
  if (value.size() <= kScheme.size() ||
      !absl::EqualsIgnoreCase(value.substr(0, kScheme.size()), kScheme)) {
    return absl::UnauthenticatedError(absl::StrCat(
        "the authorization value is not 'Bearer <key>': ", kWhatToSend));
  }
  const absl::string_view given =
      absl::StripAsciiWhitespace(value.substr(kScheme.size()));
  bool match = false;
  for (const std::string& key : keys_) {
    // Every key is compared: no early exit on a match either.
    match |= ConstantTimeEquals(given, key);
  }
  if (match) return absl::OkStatus();
  return absl::UnauthenticatedError(
      absl::StrCat("the API key is not valid: ", kWhatToSend));
}

absl::StatusOr<std::vector<std::string>> ReadApiKeyFile(
    const std::string& path) {
  std::error_code ignored;
  if (std::filesystem::is_directory(path, ignored)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "cannot read the API key file '", path, "': it is a directory"));
  }
  std::ifstream in(path);
  if (!in) {
    const int error = errno;
    const std::string why = absl::StrCat("cannot read the API key file '", path,
                                         "': ", std::strerror(error));
    if (error == ENOENT) return absl::NotFoundError(why);
    if (error == EACCES) return absl::PermissionDeniedError(why);
    return absl::InvalidArgumentError(why);
  }
  std::stringstream contents;
  contents << in.rdbuf();
  if (in.bad()) {
    return absl::InvalidArgumentError(
        absl::StrCat("cannot read the API key file '", path, "'"));
  }
  std::vector<std::string> keys;
  int line_number = 0;
  for (absl::string_view line : absl::StrSplit(contents.str(), '\n')) {
    ++line_number;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line.front() == '#') continue;
    if (std::string problem = KeyProblem(line); !problem.empty()) {
      return absl::InvalidArgumentError(absl::StrCat("the API key file '", path,
                                                     "' line ", line_number,
                                                     ": the key ", problem));
    }
    keys.emplace_back(line);
  }
  if (keys.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the API key file '", path,
        "' has no key (one key per line; blank lines and #comments are "
        "ignored)"));
  }
  return keys;
}

}  // namespace pdserve
