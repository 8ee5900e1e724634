// The cuBLAS entry points the cuda backend uses, resolved with dlopen on
// first use instead of linked: libcublasLt is half a gigabyte and mapping
// it costs every process about 0.2 s at start, which binaries and test
// processes that never create a cuda runner should not pay.
//
// Thread-safe; the table lives for the process.
#ifndef PDSERVE_ENGINE_CUDA_CUBLAS_API_H_
#define PDSERVE_ENGINE_CUDA_CUBLAS_API_H_

#include <cublas_v2.h>

#include <string>

namespace pdserve::cuda {

struct CublasApi {
  cublasStatus_t (*create)(cublasHandle_t* handle);
  cublasStatus_t (*destroy)(cublasHandle_t handle);
  cublasStatus_t (*set_stream)(cublasHandle_t handle, cudaStream_t stream);
  cublasStatus_t (*set_workspace)(cublasHandle_t handle, void* workspace,
                                  size_t bytes);
  cublasStatus_t (*gemm_ex)(cublasHandle_t handle, cublasOperation_t transa,
                            cublasOperation_t transb, int m, int n, int k,
                            const void* alpha, const void* a,
                            cudaDataType a_type, int lda, const void* b,
                            cudaDataType b_type, int ldb, const void* beta,
                            void* c, cudaDataType c_type, int ldc,
                            cublasComputeType_t compute, cublasGemmAlgo_t algo);
  const char* (*status_string)(cublasStatus_t status);
};

// The loaded table, or nullptr when libcublas cannot be loaded (then
// *error, when given, says why). Loads once; later calls are cheap.
const CublasApi* Cublas(std::string* error = nullptr);

}  // namespace pdserve::cuda

#endif  // PDSERVE_ENGINE_CUDA_CUBLAS_API_H_
