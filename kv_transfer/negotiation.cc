#include "kv_transfer/negotiation.h"

#include <algorithm>
#include <initializer_list>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"

namespace pdserve::kv {
namespace {

// Longest transport name or endpoint a landing may carry (a UCX endpoint
// is a worker address in hex: a few hundred bytes).
constexpr size_t kMaxOfferField = 4096;

// Whether a UCX transport list names one of `families` ("rc" matches "rc",
// "rc_verbs", "rc_mlx5", ...).
bool AnyTl(const std::vector<std::string>& tls,
           std::initializer_list<std::string_view> families) {
  for (std::string_view tl : tls) {
    for (std::string_view f : families) {
      if (tl == f ||
          (tl.starts_with(f) && tl.size() > f.size() && tl[f.size()] == '_')) {
        return true;
      }
    }
  }
  return false;
}

bool AllTl(const std::vector<std::string>& tls,
           std::initializer_list<std::string_view> families) {
  return std::all_of(tls.begin(), tls.end(), [&](const std::string& tl) {
    return AnyTl({tl}, families);
  });
}

}  // namespace

absl::StatusOr<std::vector<std::string>> ParseKvTransportList(
    std::string_view list_view) {
  const std::string list(list_view);
  std::vector<std::string> names;
  const std::vector<std::string> items = absl::StrSplit(list, ',');
  for (const std::string& item : items) {
    if (item.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("KV transport list '", list, "' has an empty name"));
    }
    std::string name = item;
    if (name.starts_with("ucx:")) absl::StrReplaceAll({{"+", ","}}, &name);
    if (std::find(names.begin(), names.end(), name) != names.end()) {
      return absl::InvalidArgumentError(absl::StrCat(
          "KV transport list '", list, "' names '", name, "' twice"));
    }
    names.push_back(std::move(name));
  }
  if (names.size() > kMaxKvOffers) {
    return absl::InvalidArgumentError(
        absl::StrCat("KV transport list '", list, "' has ", names.size(),
                     " names; at most ", kMaxKvOffers));
  }
  return names;
}

int KvTransportRank(std::string_view name) {
  if (name == "cuda_ipc") return 0;
  if (name == "nccl") return 1;
  if (name == "ucx" || name == "ucx:tcp") return 4;
  if (name == "ucx:shm") return 3;
  if (name.starts_with("ucx:")) {
    const std::vector<std::string> tls =
        absl::StrSplit(std::string(name.substr(4)), ',', absl::SkipEmpty());
    if (AnyTl(tls, {"rc", "dc", "ud", "ib"})) return 2;
    if (!tls.empty() && AllTl(tls, {"sm", "shm", "posix", "sysv", "xpmem",
                                    "cma", "knem", "self"})) {
      return 3;
    }
    return 4;
  }
  if (name == "tcp") return 5;
  if (name == "inproc") return 6;
  return 7;
}

absl::StatusOr<std::vector<KvOffer>> ChooseKvOffers(
    std::span<const KvOffer> theirs, std::span<const std::string> ours) {
  if (theirs.empty()) {
    return absl::InvalidArgumentError("the landing offers no KV transport");
  }
  if (theirs.size() > kMaxKvOffers) {
    return absl::InvalidArgumentError(
        absl::StrCat("the landing offers ", theirs.size(),
                     " KV transports; at most ", kMaxKvOffers));
  }
  std::vector<std::string> their_names;
  for (const KvOffer& offer : theirs) {
    if (offer.transport.empty() || offer.endpoint.empty()) {
      return absl::InvalidArgumentError(
          "a KV offer of the landing lacks a transport name or an endpoint");
    }
    if (offer.transport.size() > kMaxOfferField ||
        offer.endpoint.size() > kMaxOfferField) {
      return absl::InvalidArgumentError(absl::StrCat(
          "a KV offer of the landing has a transport name or endpoint over ",
          kMaxOfferField, " bytes"));
    }
    their_names.push_back(offer.transport);
  }
  std::vector<KvOffer> usable;
  for (const KvOffer& offer : theirs) {
    if (std::find(ours.begin(), ours.end(), offer.transport) != ours.end()) {
      usable.push_back(offer);
    }
  }
  if (usable.empty()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "no common KV transport: the decode worker offers ",
        FormatKvTransportList(their_names), "; this prefill worker runs ",
        FormatKvTransportList(ours)));
  }
  std::stable_sort(
      usable.begin(), usable.end(), [](const KvOffer& a, const KvOffer& b) {
        return KvTransportRank(a.transport) < KvTransportRank(b.transport);
      });
  return usable;
}

std::string FormatKvTransportList(std::span<const std::string> names) {
  return absl::StrCat("'", absl::StrJoin(names.begin(), names.end(), "', '"),
                      "'");
}

}  // namespace pdserve::kv
