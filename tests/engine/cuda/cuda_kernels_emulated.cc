// The cuda backend's kernels compiled as C++ against the CPU emulation of
// cuda_emulation.h; cuda_kernels_test.cc, built a second time with
// PDSERVE_CUDA_EMULATION, runs them against the CPU kernels without a GPU.
#define PDSERVE_CUDA_EMULATION 1
#include "tests/engine/cuda/cuda_emulation.h"
// Included as a source on purpose: the emulated build of the same file.
#include "engine/cuda/cuda_kernels.cu"
