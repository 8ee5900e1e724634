// ApiKeys: the API keys pd-router accepts, and the one check that both of
// its front doors (gRPC metadata and the HTTP header) run on a request's
// `authorization` value.
//
//   auto keys = ApiKeys::Create({"k1", "k2"});
//   absl::Status s = keys->Check("Bearer k1");   // OK
//   s = keys->Check("");                          // UNAUTHENTICATED
//
// A set with no key is open: Check passes everything, enabled() is false.
// With keys, a request must carry `authorization: Bearer <key>` for one of
// them ("Bearer" in any letter case, as HTTP allows); anything else is
// UNAUTHENTICATED with a message telling what to send. Keys are compared in
// time that does not depend on where a guess first differs, and every key
// is compared, so the time of a rejection tells nothing about the keys but
// their lengths. No message ever contains a key or the value sent.
//
// A key is 1..256 printable ASCII characters other than space and ','
// (',' separates keys in --api_key; a gRPC metadata value must be printable
// ASCII).
//
// Thread-safety: immutable after Create; Check from any thread.
#ifndef PDSERVE_ROUTER_API_KEYS_H_
#define PDSERVE_ROUTER_API_KEYS_H_

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace pdserve {

class ApiKeys {
 public:
  // The open set: no key, every request passes.
  ApiKeys() = default;

  // A set of `keys` (duplicates count once; empty: the open set).
  // INVALID_ARGUMENT naming the position of a key that is empty, too long
  // or has a character a key may not have.
  static absl::StatusOr<ApiKeys> Create(const std::vector<std::string>& keys);

  // Whether any key is set (requests need one).
  bool enabled() const { return !keys_.empty(); }
  // How many distinct keys.
  size_t size() const { return keys_.size(); }

  // Checks the value of a request's `authorization` (gRPC metadata or HTTP
  // header; empty when the request has none). OK when the set is open or
  // the value is "Bearer <key>" for a key of the set; UNAUTHENTICATED
  // otherwise.
  absl::Status Check(std::string_view authorization_header_value) const;

 private:
  explicit ApiKeys(std::vector<std::string> keys) : keys_(std::move(keys)) {}

  std::vector<std::string> keys_;
};

// Reads an API key file: one key per line; blank lines and lines starting
// with '#' (after leading spaces) are ignored; spaces around a key are
// trimmed. NOT_FOUND / PERMISSION_DENIED / INVALID_ARGUMENT for a file that
// cannot be read; INVALID_ARGUMENT for a file with no key, or with a line
// that is not a valid key (naming the line, not showing it).
absl::StatusOr<std::vector<std::string>> ReadApiKeyFile(
    const std::string& path);

}  // namespace pdserve

#endif  // PDSERVE_ROUTER_API_KEYS_H_
