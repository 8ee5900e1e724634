#include "engine/cuda/cublas_api.h"

#include <dlfcn.h>

#include <mutex>
#include <string>

#include "engine/cuda/cuda_kernels.h"

namespace pdserve::cuda {
namespace {

#define PD_STRINGIFY_INNER_(x) #x
#define PD_STRINGIFY_(x) PD_STRINGIFY_INNER_(x)

// The soname of the cuBLAS the headers came from, then the same file in
// the toolkit the build found (for systems whose loader path lacks it).
constexpr const char* kLibraryNames[] = {
    "libcublas.so." PD_STRINGIFY_(CUBLAS_VER_MAJOR),
#ifdef PDSERVE_CUDA_LIBRARY_DIR
    PDSERVE_CUDA_LIBRARY_DIR "/libcublas.so." PD_STRINGIFY_(CUBLAS_VER_MAJOR),
#endif
};

struct Loaded {
  CublasApi api{};
  bool ok = false;
  std::string error;
};

template <typename Fn>
bool Resolve(void* lib, const char* name, Fn& fn, std::string& error) {
  fn = reinterpret_cast<Fn>(dlsym(lib, name));
  if (fn == nullptr) error = std::string("libcublas has no ") + name;
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
  CublasApi& a = l.api;
  l.ok = Resolve(lib, "cublasCreate_v2", a.create, l.error) &&
         Resolve(lib, "cublasDestroy_v2", a.destroy, l.error) &&
         Resolve(lib, "cublasSetStream_v2", a.set_stream, l.error) &&
         Resolve(lib, "cublasSetWorkspace_v2", a.set_workspace, l.error) &&
         Resolve(lib, "cublasGemmEx", a.gemm_ex, l.error) &&
         Resolve(lib, "cublasGetStatusString", a.status_string, l.error);
  // The library stays loaded for the process: the table points into it.
  return l;
}

}  // namespace

const CublasApi* Cublas(std::string* error) {
  static const Loaded* const loaded = new Loaded(Load());
  if (!loaded->ok) {
    if (error != nullptr) *error = loaded->error;
    return nullptr;
  }
  return &loaded->api;
}

cublasStatus_t Gemm(cublasHandle_t handle, const uint16_t* x, int64_t m,
                    const uint16_t* w, int64_t n, int64_t k, float* y,
                    float beta) {
  if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
  const CublasApi* blas = Cublas();
  if (blas == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
  const float alpha = 1.0f;
  // Column-major view: y^T [n][m] = w [k][n]^T . x^T [k][m].
  return blas->gemm_ex(
      handle, CUBLAS_OP_T, CUBLAS_OP_N, static_cast<int>(n),
      static_cast<int>(m), static_cast<int>(k), &alpha, w, CUDA_R_16BF,
      static_cast<int>(k), x, CUDA_R_16BF, static_cast<int>(k), &beta, y,
      CUDA_R_32F, static_cast<int>(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

}  // namespace pdserve::cuda
