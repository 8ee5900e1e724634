// StrongId: a typed integer id, so a BlockId cannot be passed where a
// RequestId is expected. Trivially copyable; the same size as its value.
#ifndef PDSERVE_COMMON_STRONG_ID_H_
#define PDSERVE_COMMON_STRONG_ID_H_

#include <compare>
#include <cstdint>
#include <functional>

namespace pdserve {

template <typename Tag, typename T = int32_t>
struct StrongId {
  using ValueType = T;
  T value{};

  constexpr StrongId() = default;
  constexpr explicit StrongId(T v) : value(v) {}
  constexpr auto operator<=>(const StrongId&) const = default;

  template <typename H>
  friend H AbslHashValue(H h, const StrongId& id) {
    return H::combine(std::move(h), id.value);
  }
};

}  // namespace pdserve

template <typename Tag, typename T>
struct std::hash<pdserve::StrongId<Tag, T>> {
  size_t operator()(const pdserve::StrongId<Tag, T>& id) const {
    return std::hash<T>()(id.value);
  }
};

#endif  // PDSERVE_COMMON_STRONG_ID_H_
