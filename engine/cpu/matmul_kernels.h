// Internal to the CPU backend: the register-tile kernels of MatMul, each
// instruction set's in a file of its own compiled with that set's -m
// flags (engine/CMakeLists.txt). MatMul (cpu_kernels.cc, built for the
// AVX2 baseline) splits the work into tiles and calls the kernels the CPU
// runs; nothing compiled for AVX-512 runs unless the CPU has it.
#ifndef PDSERVE_ENGINE_CPU_MATMUL_KERNELS_H_
#define PDSERVE_ENGINE_CPU_MATMUL_KERNELS_H_

#include <cstddef>
#include <cstdint>

#include "engine/dtype.h"

namespace pdserve::cpu::internal {

// The largest tile: rows of x by rows of w.
inline constexpr int kMaxTileRows = 4;
inline constexpr int kMaxTileCols = 3;

// y[i * ldy + j] = sum_t x[i * k + t] * w[j * k + t] for i < MR, j < NR.
using TileFn = void (*)(const void* x, int64_t k, const std::byte* w, float* y, int64_t ldy);

// Every tile shape of one kernel.
struct TileKernels {
  TileFn tiles[kMaxTileRows][kMaxTileCols];  // [MR - 1][NR - 1]
};

// AVX2/FMA/F16C (matmul_avx2.cc): fp32 x against fp32, fp16 and bf16
// weights; for kQ8 weights, x quantized as Q8XRowBytes says.
const TileKernels& Avx2Tiles(DType weights);

// Bytes of one row of x quantized for kQ8 weights: RoundUp(k, kQ8Group)
// int8 (zero past k), then one fp32 scale per group.
inline constexpr int64_t Q8XRowBytes(int64_t k) {
  const int64_t groups = (k + kQ8Group - 1) / kQ8Group;
  return groups * (kQ8Group + 4);
}

// AVX-512 F/BW/VL/DQ and VNNI (matmul_avx512_vnni.cc): kQ8 weights
// against quantized x, 64 products a step by VPDPBUSD.
const TileKernels& Avx512VnniQ8Tiles();

// AVX512_BF16 with AVX-512 F/BW/VL/DQ (matmul_avx512_bf16.cc): bf16 x
// against bf16 weights, two products a lane (VDPBF16PS), summed in fp32;
// and x's conversion: out[i] = x[i] rounded to bf16 (to nearest even).
const TileKernels& Avx512Bf16Tiles();
void Avx512RoundToBf16(const float* x, int64_t n, uint16_t* out);

}  // namespace pdserve::cpu::internal

#endif  // PDSERVE_ENGINE_CPU_MATMUL_KERNELS_H_
