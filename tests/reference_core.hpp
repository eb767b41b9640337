// SPDX-License-Identifier: Apache-2.0
// fp64 naive attention on the host, the oracle of every test: its loops, over
// a mask tabulated by reference.hpp. Compiled once, at -O3 without
// floating-point contraction, in reference.cpp (the blockattn_test_reference
// library), so that it runs at full speed in test files built at -O0
// (BLOCKATTN_TEST_OPT) and rounds every product before its sum on every
// compiler and ISA; no BlockAttn header here.
#pragma once

#include <cstdint>
#include <functional>
#include <random>
#include <vector>

namespace blockattn::test {

/// Row-major host tensors in the library's (batch, seq, heads, dim) order.
struct HostTensor {
  int b = 0, n = 0, h = 0, d = 0;
  std::vector<double> data;
  HostTensor() = default;
  HostTensor(int b_, int n_, int h_, int d_)
      : b(b_), n(n_), h(h_), d(d_), data(std::size_t(b_) * n_ * h_ * d_, 0.0) {}
  double& operator()(int i, int j, int k, int l) {
    return data[((std::size_t(i) * n + j) * h + k) * d + l];
  }
  double operator()(int i, int j, int k, int l) const {
    return data[((std::size_t(i) * n + j) * h + k) * d + l];
  }
  /// The d values of (i, j, k), contiguous.
  const double* row(int i, int j, int k) const {
    return data.data() + ((std::size_t(i) * n + j) * h + k) * d;
  }
  double* row(int i, int j, int k) { return data.data() + ((std::size_t(i) * n + j) * h + k) * d; }
};

inline HostTensor random_tensor(int b, int n, int h, int d, std::mt19937_64& rng,
                                double amplitude = 1.0) {
  HostTensor t(b, n, h, d);
  std::uniform_real_distribution<double> dist(-amplitude, amplitude);
  for (auto& x : t.data) x = dist(rng);
  return t;
}

struct ReferenceResult {
  HostTensor o;                    // (b, nq, h, d)
  std::vector<double> lse;         // (b, h, nq)
  double max_abs_logit = 0.0;      // max |scale * q.k| over allowed pairs
  double max_dot_condition = 0.0;  // max scale * sum_d |q_d k_d| over allowed pairs
};

struct ReferenceGrads {
  HostTensor dq, dk, dv;
  /// With `terms`: each element's sum of the absolute values of its terms,
  /// |dQ|_i = scale sum_j |dS|_ij |K_j|, |dK|_j = scale sum_i |dS|_ij |Q_i|,
  /// |dV|_j = sum_i P_ij |dO_i|, with |dS|_ij = P_ij (|dP_ij| + |D_i|) (dS's
  /// two terms, D = rowsum(dO o O)): it bounds every partial sum of the terms
  /// (a block pair's, a band piece's), so rounding each of those once, or D
  /// to a relative u, adds at most u times it (the fused backward's bound,
  /// docs/numerics.md).
  HostTensor abs_dq, abs_dk, abs_dv;
  std::vector<double> dsink;  // dL/dsinks, per head (with sinks)
  double max_dot_condition = 0.0;
};

/// A mask over (query row i, key row j) of one call: allowed[i * nk + j], and
/// a score policy's s' = score(s, i, j, head) and ds'/ds on the allowed pairs
/// (empty: none). reference.hpp builds it from a mask policy and the offsets.
struct ReferenceMask {
  int nq = 0, nk = 0;
  std::vector<unsigned char> allowed;
  std::function<double(double, int, int, int)> score, score_grad;
};

ReferenceResult reference_attention_table(const HostTensor& q, const HostTensor& k,
                                          const HostTensor& v, const ReferenceMask& mask,
                                          double scale, const std::vector<double>* sinks);

ReferenceGrads reference_backward_table(const HostTensor& q, const HostTensor& k,
                                        const HostTensor& v, const HostTensor& dout,
                                        const ReferenceMask& mask, double scale,
                                        const HostTensor* o_used, const std::vector<double>* sinks,
                                        bool terms = false);

}  // namespace blockattn::test
