// Host stand-ins for the CUDA runtime and cuBLAS calls the cuda backend's
// runner makes, for cuda_model_runner_emulated_test: "device" memory is
// host memory, a stream runs everything at once (kernels through
// cuda_emulation.h), there is one device, graph capture is refused (the
// runner falls back to eager steps), and cublasGemmEx computes what the
// cuBLAS documentation says (column-major operands, op(A) . op(B)).
// Include after cuda_emulation.h, before the runner's sources; the macros
// below redirect the calls that follow.
#ifndef PDSERVE_TESTS_ENGINE_CUDA_CUDA_RUNTIME_EMULATION_H_
#define PDSERVE_TESTS_ENGINE_CUDA_CUDA_RUNTIME_EMULATION_H_

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <string>

namespace pdserve::emu {

inline cudaError_t Malloc(void** p, size_t bytes) {
  *p = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
  return *p != nullptr ? cudaSuccess : cudaErrorMemoryAllocation;
}
inline cudaError_t Free(void* p) {
  std::free(p);
  return cudaSuccess;
}
inline cudaError_t Memcpy(void* dst, const void* src, size_t n,
                          cudaMemcpyKind) {
  if (n > 0) std::memmove(dst, src, n);
  return cudaSuccess;
}
inline cudaError_t MemcpyAsync(void* dst, const void* src, size_t n,
                               cudaMemcpyKind k, cudaStream_t = nullptr) {
  return Memcpy(dst, src, n, k);
}
inline cudaError_t Memset(void* p, int v, size_t n) {
  std::memset(p, v, n);
  return cudaSuccess;
}
inline cudaError_t GetDevice(int* d) {
  *d = 0;
  return cudaSuccess;
}
inline cudaError_t SetDevice(int) { return cudaSuccess; }
inline cudaError_t GetDeviceCount(int* n) {
  *n = 1;
  return cudaSuccess;
}
inline cudaError_t DeviceGetAttribute(int* v, cudaDeviceAttr attr, int) {
  switch (attr) {
    case cudaDevAttrMultiProcessorCount:
      *v = 4;  // Few SMs: decode splits the context, as on a big GPU.
      break;
    case cudaDevAttrComputeCapabilityMajor:
      *v = 9;
      break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *v = 227 * 1024;
      break;
    default:
      *v = 0;
  }
  return cudaSuccess;
}
inline cudaError_t StreamCreateWithFlags(cudaStream_t* s, unsigned) {
  *s = reinterpret_cast<cudaStream_t>(uintptr_t{1});
  return cudaSuccess;
}
inline cudaError_t Ok(...) { return cudaSuccess; }
inline cudaError_t Refuse(...) { return cudaErrorNotSupported; }

// cuBLAS.
inline cublasStatus_t BlasCreate(cublasHandle_t* h) {
  *h = reinterpret_cast<cublasHandle_t>(uintptr_t{1});
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t BlasDestroy(cublasHandle_t) {
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t BlasSetStream(cublasHandle_t, cudaStream_t) {
  return CUBLAS_STATUS_SUCCESS;
}
inline cublasStatus_t BlasSetWorkspace(cublasHandle_t, void*, size_t) {
  return CUBLAS_STATUS_SUCCESS;
}
inline const char* BlasStatusString(cublasStatus_t) {
  return "emulated cuBLAS error";
}
inline float Bf16At(const void* p, int64_t i) {
  uint16_t h;
  std::memcpy(&h, static_cast<const char*>(p) + 2 * i, 2);
  uint32_t u = uint32_t{h} << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
// C = alpha op(A) op(B) + beta C, column-major; bf16 A and B, fp32 C.
inline cublasStatus_t BlasGemmEx(cublasHandle_t, cublasOperation_t ta,
                                 cublasOperation_t tb, int m, int n, int k,
                                 const void* alpha, const void* a,
                                 cudaDataType at, int lda, const void* b,
                                 cudaDataType bt, int ldb, const void* beta,
                                 void* c, cudaDataType ct, int ldc,
                                 cublasComputeType_t, cublasGemmAlgo_t) {
  if (at != CUDA_R_16BF || bt != CUDA_R_16BF || ct != CUDA_R_32F) {
    return CUBLAS_STATUS_NOT_SUPPORTED;
  }
  const float al = *static_cast<const float*>(alpha);
  const float be = *static_cast<const float*>(beta);
  float* cf = static_cast<float*>(c);
  for (int j = 0; j < n; ++j) {
    for (int i = 0; i < m; ++i) {
      double s = 0.0;
      for (int l = 0; l < k; ++l) {
        const float av = ta == CUBLAS_OP_N ? Bf16At(a, i + int64_t{l} * lda)
                                           : Bf16At(a, l + int64_t{i} * lda);
        const float bv = tb == CUBLAS_OP_N ? Bf16At(b, l + int64_t{j} * ldb)
                                           : Bf16At(b, j + int64_t{l} * ldb);
        s += double{av} * bv;
      }
      float& out = cf[i + int64_t{j} * ldc];
      out = static_cast<float>(al * s + (be != 0.0f ? be * out : 0.0f));
    }
  }
  return CUBLAS_STATUS_SUCCESS;
}
inline void* Dlopen(const char*, int) {
  return reinterpret_cast<void*>(uintptr_t{1});
}
inline void* Dlsym(void*, const char* name) {
  const std::string n = name;
  if (n == "cublasCreate_v2") return reinterpret_cast<void*>(&BlasCreate);
  if (n == "cublasDestroy_v2") return reinterpret_cast<void*>(&BlasDestroy);
  if (n == "cublasSetStream_v2") return reinterpret_cast<void*>(&BlasSetStream);
  if (n == "cublasSetWorkspace_v2")
    return reinterpret_cast<void*>(&BlasSetWorkspace);
  if (n == "cublasGemmEx") return reinterpret_cast<void*>(&BlasGemmEx);
  if (n == "cublasGetStatusString")
    return reinterpret_cast<void*>(&BlasStatusString);
  return nullptr;
}

}  // namespace pdserve::emu

#define cudaMalloc ::pdserve::emu::Malloc
#define cudaFree ::pdserve::emu::Free
#define cudaMallocHost ::pdserve::emu::Malloc
#define cudaFreeHost ::pdserve::emu::Free
#define cudaMemcpy ::pdserve::emu::Memcpy
#define cudaMemcpyAsync ::pdserve::emu::MemcpyAsync
#define cudaMemset ::pdserve::emu::Memset
#define cudaGetDevice ::pdserve::emu::GetDevice
#define cudaSetDevice ::pdserve::emu::SetDevice
#define cudaGetDeviceCount ::pdserve::emu::GetDeviceCount
#define cudaDeviceGetAttribute ::pdserve::emu::DeviceGetAttribute
#define cudaStreamCreateWithFlags ::pdserve::emu::StreamCreateWithFlags
#define cudaStreamDestroy ::pdserve::emu::Ok
#define cudaStreamSynchronize ::pdserve::emu::Ok
#define cudaDeviceSynchronize ::pdserve::emu::Ok
#define cudaGetLastError ::pdserve::emu::Ok
#define cudaStreamBeginCapture ::pdserve::emu::Refuse
#define cudaStreamEndCapture ::pdserve::emu::Refuse
#define cudaGraphInstantiate ::pdserve::emu::Refuse
#define cudaGraphLaunch ::pdserve::emu::Refuse
#define cudaGraphDestroy ::pdserve::emu::Ok
#define cudaGraphExecDestroy ::pdserve::emu::Ok
#define dlopen ::pdserve::emu::Dlopen
#define dlsym ::pdserve::emu::Dlsym

#endif  // PDSERVE_TESTS_ENGINE_CUDA_CUDA_RUNTIME_EMULATION_H_
