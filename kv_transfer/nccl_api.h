// The NCCL entry points the nccl transport uses, resolved with dlopen on
// first use instead of linked (as engine/cuda does with cuBLAS): binaries
// start, and every test that does not use nccl runs, on machines without
// libnccl. Thread-safe; the table lives for the process. Internal to
// kv_transfer/.
#ifndef PDSERVE_KV_TRANSFER_NCCL_API_H_
#define PDSERVE_KV_TRANSFER_NCCL_API_H_

#include <nccl.h>

#include <string>

namespace pdserve::kv {

// Non-blocking communicators (ncclConfig_t::blocking = 0) came in 2.14.
constexpr int kMinNcclVersion = 21400;

struct NcclApi {
  int version = 0;  // ncclGetVersion, e.g. 22809 for 2.28.9.
  ncclResult_t (*get_unique_id)(ncclUniqueId* id);
  ncclResult_t (*comm_init_rank_config)(ncclComm_t* comm, int nranks,
                                        ncclUniqueId id, int rank,
                                        ncclConfig_t* config);
  ncclResult_t (*comm_abort)(ncclComm_t comm);
  ncclResult_t (*comm_get_async_error)(ncclComm_t comm, ncclResult_t* error);
  const char* (*get_error_string)(ncclResult_t result);
  const char* (*get_last_error)(ncclComm_t comm);
  ncclResult_t (*group_start)();
  ncclResult_t (*group_end)();
  ncclResult_t (*send)(const void* buff, size_t count, ncclDataType_t type,
                       int peer, ncclComm_t comm, cudaStream_t stream);
  ncclResult_t (*recv)(void* buff, size_t count, ncclDataType_t type, int peer,
                       ncclComm_t comm, cudaStream_t stream);
};

// The loaded table, or nullptr when libnccl cannot be loaded or is older
// than kMinNcclVersion (then *error, when given, says why). Loads once.
const NcclApi* Nccl(std::string* error = nullptr);

}  // namespace pdserve::kv

#endif  // PDSERVE_KV_TRANSFER_NCCL_API_H_
