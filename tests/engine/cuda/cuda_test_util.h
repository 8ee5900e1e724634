// Helpers for the cuda backend's tests: the device check every test starts
// with and small typed device buffers. With PDSERVE_CUDA_EMULATION (the
// kernels emulated on the CPU, cuda_emulation.h) there is no device: the
// check passes and "device" buffers are host memory.
#ifndef PDSERVE_TESTS_ENGINE_CUDA_CUDA_TEST_UTIL_H_
#define PDSERVE_TESTS_ENGINE_CUDA_CUDA_TEST_UTIL_H_

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "engine/dtype.h"
#include "gtest/gtest.h"

#ifdef PDSERVE_CUDA_EMULATION
#include "tests/engine/cuda/cuda_emulation.h"
#include "tests/engine/cuda/cuda_runtime_emulation.h"
#define PD_REQUIRE_CUDA_DEVICE() \
  do {                           \
  } while (0)
// Skips a test that the emulation would take minutes over.
#define PD_SKIP_UNDER_EMULATION(why) GTEST_SKIP() << "emulated: " << why
#else
#define PD_SKIP_UNDER_EMULATION(why) \
  do {                               \
  } while (0)
#include "engine/cuda/cuda_model_runner.h"
// Skips the test (GTEST_SKIP) when this machine has no CUDA device.
#define PD_REQUIRE_CUDA_DEVICE()                                    \
  do {                                                              \
    if (::pdserve::CudaDeviceCount() == 0) {                        \
      GTEST_SKIP() << "no CUDA device (cudaGetDeviceCount() == 0)"; \
    }                                                               \
  } while (0)
#endif

namespace pdserve::testing_util {

#ifdef PDSERVE_CUDA_EMULATION
// Emulated kernels run on the host: a "device" vector is host memory.
template <typename T>
class DeviceVector {
 public:
  explicit DeviceVector(size_t n) : data_(std::max<size_t>(n, 1)), size_(n) {}
  explicit DeviceVector(const std::vector<T>& host)
      : DeviceVector(host.size()) {
    std::copy(host.begin(), host.end(), data_.begin());
  }
  T* get() { return data_.data(); }
  std::vector<T> Download() const {
    return std::vector<T>(data_.begin(), data_.begin() + size_);
  }

 private:
  std::vector<T> data_;
  size_t size_;
};
#else
// A device copy of a host vector; Download() brings it back.
template <typename T>
class DeviceVector {
 public:
  explicit DeviceVector(size_t n) : size_(n) {
    EXPECT_EQ(cudaMalloc(&ptr_, std::max<size_t>(n, 1) * sizeof(T)),
              cudaSuccess);
    EXPECT_EQ(cudaMemset(ptr_, 0, std::max<size_t>(n, 1) * sizeof(T)),
              cudaSuccess);
  }
  explicit DeviceVector(const std::vector<T>& host)
      : DeviceVector(host.size()) {
    EXPECT_EQ(cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T),
                         cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  DeviceVector(const DeviceVector&) = delete;
  DeviceVector& operator=(const DeviceVector&) = delete;
  ~DeviceVector() { cudaFree(ptr_); }

  T* get() const { return ptr_; }
  std::vector<T> Download() const {
    std::vector<T> host(size_);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(cudaMemcpy(host.data(), ptr_, size_ * sizeof(T),
                         cudaMemcpyDeviceToHost),
              cudaSuccess);
    return host;
  }

 private:
  T* ptr_ = nullptr;
  size_t size_;
};
#endif

inline std::vector<uint16_t> ToBf16Bits(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = FloatToBf16(v[i]);
  return out;
}

inline std::vector<float> FromBf16Bits(const std::vector<uint16_t>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = Bf16ToFloat(v[i]);
  return out;
}

// Rounds every value to the nearest bf16 (what the device will see).
inline std::vector<float> RoundToBf16(std::vector<float> v) {
  for (float& x : v) x = Bf16ToFloat(FloatToBf16(x));
  return v;
}

}  // namespace pdserve::testing_util

#endif  // PDSERVE_TESTS_ENGINE_CUDA_CUDA_TEST_UTIL_H_
