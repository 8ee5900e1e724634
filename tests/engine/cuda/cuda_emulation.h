// A CPU emulation of the part of the CUDA execution model that
// engine/cuda/cuda_kernels.cu uses, so that its kernels run, unchanged, in
// CI without a GPU (cuda_kernels_emulated_test): every thread of a block is
// a std::thread; __syncthreads and __syncwarp are barriers; warp shuffles,
// the warp-wide `mma.sync` and `ldmatrix` go through per-warp slots between
// two barriers, each lane's registers in the layouts the PTX ISA documents
// for them; `cp.async` copies at once; blocks of a grid run one after
// another on one team of threads.
//
// What it checks: the kernels' index arithmetic, masking, tiling, online
// softmax, context splits and combine, and which lane holds which element
// of an mma or ldmatrix fragment, as documented. What it cannot: timing,
// memory-model subtleties, the tensor cores' own rounding, and anything
// the hardware does differently from the documentation. Include it before the
// .cu file, with PDSERVE_CUDA_EMULATION defined.
#ifndef PDSERVE_TESTS_ENGINE_CUDA_CUDA_EMULATION_H_
#define PDSERVE_TESTS_ENGINE_CUDA_CUDA_EMULATION_H_

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace pdserve::emu {

struct Block {
  Block(int threads, size_t dynamic_bytes)
      : barrier(threads), dynamic(dynamic_bytes + 128) {
    for (int w = 0; w < threads / 32; ++w) {
      warp_barriers.push_back(std::make_unique<std::barrier<>>(32));
    }
    slots.resize(threads);
    words.resize(threads * kWordsPerLane);
    pointers.resize(threads);
  }
  static constexpr int kWordsPerLane = 10;  // An mma's a, b and c.
  std::barrier<> barrier;
  std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
  std::vector<float> slots;           // One per thread, for shuffles.
  std::vector<uint32_t> words;        // kWordsPerLane per thread, for mma.
  std::vector<const void*> pointers;  // One per thread, for ldmatrix.
  std::vector<std::byte> dynamic;
  std::mutex statics_mu;
  std::map<int, std::vector<std::byte>> statics;  // By source line.
};

struct ThreadState {
  uint3 thread{}, block{};
  dim3 block_dim, grid_dim;
  Block* ctx = nullptr;
};
inline thread_local ThreadState tls;

inline void SyncThreads() { tls.ctx->barrier.arrive_and_wait(); }
inline void SyncWarp() {
  tls.ctx->warp_barriers[tls.thread.x / 32]->arrive_and_wait();
}
inline float Shuffle(float v, int src_lane) {
  const int warp_base = tls.thread.x / 32 * 32;
  tls.ctx->slots[tls.thread.x] = v;
  SyncWarp();
  const float r = tls.ctx->slots[warp_base + (src_lane & 31)];
  SyncWarp();
  return r;
}

inline float Bf16Half(uint32_t word, int half) {
  const uint32_t bits = half == 0 ? word << 16 : word & 0xffff0000u;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32, d = a b + d. Lane
// L (g = L / 4, t = L % 4) holds, in its registers' low half first:
// a[0] A(g, 2t..2t+1), a[1] A(g+8, 2t..), a[2] A(g, 2t+8..), a[3]
// A(g+8, 2t+8..); b[0] B(2t..2t+1, g), b[1] B(2t+8.., g); d[0..1] D(g,
// 2t..2t+1), d[2..3] D(g+8, 2t..2t+1).
inline void MmaM16n8k16(float (&d)[4], const uint32_t (&a)[4],
                        const uint32_t (&b)[2]) {
  Block& ctx = *tls.ctx;
  const int lane = tls.thread.x % 32, warp_base = tls.thread.x / 32 * 32;
  uint32_t* mine = &ctx.words[tls.thread.x * Block::kWordsPerLane];
  for (int i = 0; i < 4; ++i) mine[i] = a[i];
  for (int i = 0; i < 2; ++i) mine[4 + i] = b[i];
  SyncWarp();
  auto word = [&](int l, int i) {
    return ctx.words[(warp_base + l) * Block::kWordsPerLane + i];
  };
  auto a_at = [&](int r, int k) {
    const int reg = (r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
    return Bf16Half(word((r % 8) * 4 + (k % 8) / 2, reg), k % 2);
  };
  auto b_at = [&](int k, int n) {
    return Bf16Half(word(n * 4 + (k % 8) / 2, 4 + (k >= 8 ? 1 : 0)), k % 2);
  };
  const int g = lane / 4, t = lane % 4;
  float out[4];
  for (int i = 0; i < 4; ++i) {
    const int r = g + (i >= 2 ? 8 : 0), n = 2 * t + i % 2;
    float s = d[i];
    for (int k = 0; k < 16; ++k) s += a_at(r, k) * b_at(k, n);
    out[i] = s;
  }
  SyncWarp();
  for (int i = 0; i < 4; ++i) d[i] = out[i];
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lanes 8i..8i+7 give
// the rows of matrix i (8 bf16 each); r[i] of lane L gets matrix i's
// elements (row L / 4, columns 2 (L % 4) and 2 (L % 4) + 1), or with
// .trans (rows 2 (L % 4) and 2 (L % 4) + 1, column L / 4).
inline void LdMatrix(uint32_t (&r)[4], const void* row, bool trans) {
  Block& ctx = *tls.ctx;
  const int lane = tls.thread.x % 32, warp_base = tls.thread.x / 32 * 32;
  ctx.pointers[tls.thread.x] = row;
  SyncWarp();
  for (int i = 0; i < 4; ++i) {
    // Matrix i's element (a, b), or (b, a) with .trans.
    auto at = [&](int a, int b) -> uint32_t {
      return static_cast<const uint16_t*>(
          ctx.pointers[warp_base + 8 * i + (trans ? b : a)])[trans ? a : b];
    };
    r[i] = at(lane / 4, 2 * (lane % 4)) | at(lane / 4, 2 * (lane % 4) + 1)
                                              << 16;
  }
  SyncWarp();
}
inline void LdMatrixX4(uint32_t (&r)[4], const void* row) {
  LdMatrix(r, row, false);
}
inline void LdMatrixX4Trans(uint32_t (&r)[4], const void* row) {
  LdMatrix(r, row, true);
}

// cp.async.cg.shared.global of 16 bytes, zero-filled when !valid: the copy
// is done at once, so committing and waiting have nothing to do.
inline void CpAsync16(void* shared, const void* global, bool valid) {
  if (valid) {
    std::memcpy(shared, global, 16);
  } else {
    std::memset(shared, 0, 16);
  }
}
inline void CpAsyncCommit() {}
inline void CpAsyncWaitAll() {}

template <typename T>
T* DynamicShared() {
  auto addr = reinterpret_cast<uintptr_t>(tls.ctx->dynamic.data());
  return reinterpret_cast<T*>((addr + 127) / 128 * 128);
}

template <typename T>
T* StaticShared(int key, size_t n) {
  std::lock_guard<std::mutex> lock(tls.ctx->statics_mu);
  std::vector<std::byte>& v = tls.ctx->statics[key];
  if (v.empty()) v.resize(n * sizeof(T));
  return reinterpret_cast<T*>(v.data());
}

// Runs the grid's blocks one after another on one team of blockDim.x
// threads (started once per launch).
template <typename... KArgs, typename... Args>
void Launch(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
            Args&&... args) {
  const int threads = static_cast<int>(block.x);
  const int64_t blocks = int64_t{grid.x} * grid.y * grid.z;
  Block ctx(threads, smem);
  std::vector<std::thread> team;
  team.reserve(threads);
  for (int t = 0; t < threads; ++t) {
    team.emplace_back([&, t] {
      tls.thread = {static_cast<unsigned>(t), 0, 0};
      tls.block_dim = block;
      tls.grid_dim = grid;
      tls.ctx = &ctx;
      for (int64_t b = 0; b < blocks; ++b) {
        tls.block = {static_cast<unsigned>(b % grid.x),
                     static_cast<unsigned>(b / grid.x % grid.y),
                     static_cast<unsigned>(b / (int64_t{grid.x} * grid.y))};
        kernel(args...);
        ctx.barrier.arrive_and_wait();  // The block is done everywhere.
      }
    });
  }
  for (std::thread& th : team) th.join();
}

}  // namespace pdserve::emu

// The built-ins the kernels use.
#undef threadIdx
#undef blockIdx
#undef blockDim
#undef gridDim
#define threadIdx (::pdserve::emu::tls.thread)
#define blockIdx (::pdserve::emu::tls.block)
#define blockDim (::pdserve::emu::tls.block_dim)
#define gridDim (::pdserve::emu::tls.grid_dim)
inline void __syncthreads() { ::pdserve::emu::SyncThreads(); }
inline void __syncwarp(unsigned = 0xffffffffu) { ::pdserve::emu::SyncWarp(); }
inline float __shfl_xor_sync(unsigned, float v, int mask) {
  return ::pdserve::emu::Shuffle(v, (::pdserve::emu::tls.thread.x % 32) ^ mask);
}
inline float __shfl_sync(unsigned, float v, int src) {
  return ::pdserve::emu::Shuffle(v, src);
}
inline float __uint_as_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
#undef __launch_bounds__
#define __launch_bounds__(...)
inline float EmuRsqrt(float x) { return 1.0f / std::sqrt(x); }
#define rsqrtf EmuRsqrt
using std::max;
using std::min;

#define PD_LAUNCH(kernel, grid, block, smem, stream, ...) \
  ::pdserve::emu::Launch(kernel, dim3(grid), dim3(block), smem, __VA_ARGS__)
#define PD_LAUNCH_ERROR() cudaSuccess
#define PD_SHARED_ARRAY(type, name, n) \
  type* name = ::pdserve::emu::StaticShared<type>(__LINE__, n)
#define PD_DYNAMIC_SHARED(type, name) \
  type* name = ::pdserve::emu::DynamicShared<type>()

#endif  // PDSERVE_TESTS_ENGINE_CUDA_CUDA_EMULATION_H_
