#include "kv_transfer/nccl_api.h"

#include <dlfcn.h>

#include "absl/strings/str_cat.h"

namespace pdserve::kv {
namespace {

// The soname of NCCL 2, then the same file in the toolkit the build found
// (for systems whose loader path lacks it).
constexpr const char* kLibraryNames[] = {
    "libnccl.so.2",
#ifdef PDSERVE_CUDA_LIBRARY_DIR
    PDSERVE_CUDA_LIBRARY_DIR "/libnccl.so.2",
#endif
};

struct Loaded {
  NcclApi api{};
  bool ok = false;
  std::string error;
};

template <typename Fn>
bool Resolve(void* lib, const char* name, Fn& fn, std::string& error) {
  fn = reinterpret_cast<Fn>(dlsym(lib, name));
  if (fn == nullptr) error = std::string("libnccl has no ") + name;
  return fn != nullptr;
}

Loaded Load() {
  Loaded l;
  void* lib = nullptr;
  for (const char* name : kLibraryNames) {
    lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
    if (lib != nullptr) break;
    const char* why = dlerror();
    l.error = why != nullptr ? why : name;
  }
  if (lib == nullptr) return l;
  NcclApi& a = l.api;
  ncclResult_t (*get_version)(int*) = nullptr;
  l.ok =
      Resolve(lib, "ncclGetVersion", get_version, l.error) &&
      Resolve(lib, "ncclGetUniqueId", a.get_unique_id, l.error) &&
      Resolve(lib, "ncclCommInitRankConfig", a.comm_init_rank_config,
              l.error) &&
      Resolve(lib, "ncclCommAbort", a.comm_abort, l.error) &&
      Resolve(lib, "ncclCommGetAsyncError", a.comm_get_async_error, l.error) &&
      Resolve(lib, "ncclGetErrorString", a.get_error_string, l.error) &&
      Resolve(lib, "ncclGetLastError", a.get_last_error, l.error) &&
      Resolve(lib, "ncclGroupStart", a.group_start, l.error) &&
      Resolve(lib, "ncclGroupEnd", a.group_end, l.error) &&
      Resolve(lib, "ncclSend", a.send, l.error) &&
      Resolve(lib, "ncclRecv", a.recv, l.error);
  if (l.ok &&
      (get_version(&a.version) != ncclSuccess || a.version < kMinNcclVersion)) {
    l.ok = false;
    l.error = absl::StrCat("libnccl version ", a.version, " is older than ",
                           kMinNcclVersion);
  }
  // The library stays loaded for the process: the table points into it.
  return l;
}

}  // namespace

const NcclApi* Nccl(std::string* error) {
  static const Loaded* const loaded = new Loaded(Load());
  if (!loaded->ok) {
    if (error != nullptr) *error = loaded->error;
    return nullptr;
  }
  return &loaded->api;
}

}  // namespace pdserve::kv
