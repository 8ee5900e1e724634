// KV transport negotiation: a decode worker offers every transport it runs
// (its landing lists them); a prefill worker takes the offers it can use,
// best first by one fixed ranking, and connects to the first that answers.
//
//   decode  --kv_transport=ucx:shm,tcp   offers [ucx:shm @A, tcp @B]
//   prefill --kv_transport=tcp           ChooseKvOffers -> [tcp @B]
//
// The ranking (KvTransportRank, the only copy), best first:
//   0 cuda_ipc        GPU to GPU on one node
//   1 nccl            GPU to GPU across devices and nodes
//   2 ucx:LIST naming an RDMA transport (rc, dc, ud, ib, ...)
//   3 ucx:shm, ucx:LIST of shared-memory transports only (one host)
//   4 ucx:tcp, ucx (UCX_TLS from the environment), other ucx:LIST
//   5 tcp             the portable baseline
//   6 inproc          tests in one process
//   7 any other name
// Equal ranks keep the decode worker's order. A name this binary does not
// build never matches. An offer that cannot be reached (cuda_ipc or ucx:shm
// on another host, a dead endpoint) fails to connect, and the prefill
// worker moves on to the next (kv_transfer/kv_sender.h).
//
// Thread-safety: plain functions of their arguments.
#ifndef PDSERVE_KV_TRANSFER_NEGOTIATION_H_
#define PDSERVE_KV_TRANSFER_NEGOTIATION_H_

#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "kv_transfer/transport.h"

namespace pdserve::kv {

// Most transports one worker runs, and most offers a landing may carry.
inline constexpr size_t kMaxKvOffers = 8;

// One way to reach a decode worker's KV pool.
struct KvOffer {
  // Transport name, as the decode worker created it ("tcp", "ucx:shm").
  std::string transport;
  // What the transport's Connect takes.
  std::string endpoint;
  // The pool's region in that transport.
  RegionId region;
};

// Parses a --kv_transport value: transport names separated by commas, in
// preference order ("ucx:shm,tcp"). Since commas separate names, the UCX
// transports of a "ucx:TLS-LIST" name are joined with '+' here
// ("ucx:rc_verbs+sm" is the transport "ucx:rc_verbs,sm"). INVALID_ARGUMENT
// for an empty list or name, a name given twice, or more than kMaxKvOffers
// names. Whether each name is built is CreateKvTransport's answer.
absl::StatusOr<std::vector<std::string>> ParseKvTransportList(
    std::string_view list);

// The rank of a transport name in the table above; smaller is better.
int KvTransportRank(std::string_view name);

// The offers of a landing (`theirs`, the decode worker's order) whose
// transport is in `ours`, best first by KvTransportRank. INVALID_ARGUMENT
// when `theirs` is malformed: empty, longer than kMaxKvOffers, an offer
// without a transport name or endpoint, or a name or endpoint over 4 KiB.
// FAILED_PRECONDITION, naming both lists, when no offer is usable.
absl::StatusOr<std::vector<KvOffer>> ChooseKvOffers(
    std::span<const KvOffer> theirs, std::span<const std::string> ours);

// "'ucx:shm', 'tcp'": a list of names for messages (names may hold commas).
std::string FormatKvTransportList(std::span<const std::string> names);

}  // namespace pdserve::kv

#endif  // PDSERVE_KV_TRANSFER_NEGOTIATION_H_
