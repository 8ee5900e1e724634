// The whole cuda backend (kernels, cuBLAS loader, runner) compiled as C++
// against the CPU emulation of cuda_emulation.h and the runtime stand-ins of
// cuda_runtime_emulation.h; cuda_model_runner_test.cc, built a second time
// with PDSERVE_CUDA_EMULATION, runs it against the cpu backend without a
// GPU. Sources are included on purpose: this is their emulated build.
#define PDSERVE_CUDA_EMULATION 1
#include "tests/engine/cuda/cuda_emulation.h"
#include "tests/engine/cuda/cuda_runtime_emulation.h"
// clang-format off
#include "engine/cuda/cuda_kernels.cu"
#include "engine/cuda/cublas_api.cc"
#include "engine/cuda/cuda_model_runner.cc"
// clang-format on
