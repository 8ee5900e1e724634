// What one forward pass of a Llama-shaped model costs: FLOPs of a prefill
// and bytes a decode step must read. Shared by the benchmarks that turn
// times into FLOP/s and bandwidth (pd-engine-bench has its own copy from
// before this header; it should move here).
#ifndef PDSERVE_BENCH_MODEL_COST_H_
#define PDSERVE_BENCH_MODEL_COST_H_

#include <algorithm>
#include <cstdint>
#include <vector>

#include "engine/model_files/model_config.h"

namespace pdserve::bench {

inline double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Parameters of the matrices one token passes through in one layer.
inline double LayerMatrixParams(const ModelConfig& c) {
  const double q = static_cast<double>(c.num_heads) * c.head_dim;
  const double kv = static_cast<double>(c.num_kv_heads) * c.head_dim;
  return c.hidden_size * (q + 2 * kv) + q * c.hidden_size +
         3.0 * c.hidden_size * c.intermediate_size;
}

// FLOPs of one forward over `n` new tokens at positions [start, start + n)
// with logits for the last one: the matrix products plus attention
// (QK^T and PV over the causal triangle).
inline double ForwardFlops(const ModelConfig& c, int64_t start, int64_t n) {
  const double q = static_cast<double>(c.num_heads) * c.head_dim;
  // Keys seen, summed over the new tokens.
  const double keys =
      static_cast<double>(n) * start + static_cast<double>(n) * (n + 1) / 2;
  return c.num_layers *
             (2.0 * LayerMatrixParams(c) * n + 2.0 * 2.0 * q * keys) +
         2.0 * c.hidden_size * c.vocab_size;
}

// Bytes a decode step of `batch` sequences of `context` positions reads:
// every weight matrix once (element size `weight_bytes`) plus each
// sequence's K and V (`kv_bytes_per_token` over all layers).
inline double DecodeBytes(const ModelConfig& c, int64_t batch, int64_t context,
                          double weight_bytes, double kv_bytes_per_token) {
  const double params = c.num_layers * LayerMatrixParams(c) +
                        static_cast<double>(c.vocab_size) * c.hidden_size;
  return params * weight_bytes +
         static_cast<double>(batch) * context * kv_bytes_per_token;
}

}  // namespace pdserve::bench

#endif  // PDSERVE_BENCH_MODEL_COST_H_
