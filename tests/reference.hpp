// SPDX-License-Identifier: Apache-2.0
// fp64 naive attention on the host: the oracle of every forward test.
#pragma once

#include <blockattn/blockattn.hpp>

#include <cmath>
#include <limits>
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

/// O and LSE in fp64 straight from the definition, for any mask policy and
/// position offsets. Inputs are taken as given (already rounded to the test's
/// value type), so the result is the exact answer for those inputs.
/// A score policy on the mask (policy/score.hpp) changes the logits of the
/// allowed pairs; `sinks` (one logit per head) joins every row's denominator.
template <class Mask>
ReferenceResult reference_attention(const HostTensor& q, const HostTensor& k, const HostTensor& v,
                                    const Mask& mask, double scale, index_type q_offset = 0,
                                    index_type k_offset = 0,
                                    const std::vector<double>* sinks = nullptr) {
  ReferenceResult r;
  r.o = HostTensor(q.b, q.n, q.h, q.d);
  r.lse.assign(std::size_t(q.b) * q.h * q.n, -std::numeric_limits<double>::infinity());
  const int group = q.h / k.h;
  std::vector<double> s(k.n);
  for (int b = 0; b < q.b; ++b)
    for (int h = 0; h < q.h; ++h)
      for (int i = 0; i < q.n; ++i) {
        double mx = -std::numeric_limits<double>::infinity();
        for (int j = 0; j < k.n; ++j) {
          if (!mask.allowed(q_offset + i, k_offset + j)) {
            s[j] = -std::numeric_limits<double>::infinity();
            continue;
          }
          double acc = 0.0, cond = 0.0;
          for (int x = 0; x < q.d; ++x) {
            acc += q(b, i, h, x) * k(b, j, h / group, x);
            cond += std::abs(q(b, i, h, x) * k(b, j, h / group, x));
          }
          s[j] = scale * acc;
          if constexpr (impl::has_score_mod_v<Mask>)
            s[j] = mask.score(s[j], q_offset + i, k_offset + j, h);
          r.max_abs_logit = std::max(r.max_abs_logit, std::abs(s[j]));
          r.max_dot_condition = std::max(r.max_dot_condition, std::abs(scale) * cond);
          mx = std::max(mx, s[j]);
        }
        const double sink = sinks ? (*sinks)[std::size_t(h)] : -HUGE_VAL;
        if (sinks && mx == -HUGE_VAL) r.lse[(std::size_t(b) * q.h + h) * q.n + i] = sink;
        if (mx == -std::numeric_limits<double>::infinity()) continue;  // O row stays 0
        mx = std::max(mx, sink);
        double sum = sinks ? std::exp(sink - mx) : 0.0;
        for (int j = 0; j < k.n; ++j) sum += (s[j] = std::exp(s[j] - mx));
        for (int x = 0; x < q.d; ++x) {
          double acc = 0.0;
          for (int j = 0; j < k.n; ++j) acc += s[j] * v(b, j, h / group, x);
          r.o(b, i, h, x) = acc / sum;
        }
        r.lse[(std::size_t(b) * q.h + h) * q.n + i] = mx + std::log(sum);
      }
  return r;
}

}  // namespace blockattn::test

namespace blockattn::test {

struct ReferenceGrads {
  HostTensor dq, dk, dv;
  std::vector<double> dsink;  // dL/dsinks, per head (with sinks)
  double max_dot_condition = 0.0;
};

/// Gradients of L = sum(dO o O) in fp64 straight from the definition:
/// P = softmax(masked scale Q K^T), dV = P^T dO, dP = dO V^T,
/// dS = P o (dP - rowsum(P o dP)), dQ = scale dS K, dK = scale dS^T Q.
/// With `o_used`, rowsum(P o dP) = rowsum(dO o O) is formed from that O
/// instead (the O a 16-bit forward returned, rounded, as the kernels use it).
template <class Mask>
ReferenceGrads reference_backward(const HostTensor& q, const HostTensor& k, const HostTensor& v,
                                  const HostTensor& dout, const Mask& mask, double scale,
                                  index_type q_offset = 0, index_type k_offset = 0,
                                  const HostTensor* o_used = nullptr,
                                  const std::vector<double>* sinks = nullptr) {
  ReferenceGrads g;
  g.dq = HostTensor(q.b, q.n, q.h, q.d);
  g.dk = HostTensor(k.b, k.n, k.h, k.d);
  g.dv = HostTensor(v.b, v.n, v.h, v.d);
  const int group = q.h / k.h;
  std::vector<double> p(k.n), dp(k.n), raw(k.n);
  g.dsink.assign(std::size_t(q.h), 0.0);
  for (int b = 0; b < q.b; ++b)
    for (int h = 0; h < q.h; ++h) {
      const int hk = h / group;
      for (int i = 0; i < q.n; ++i) {
        double mx = -std::numeric_limits<double>::infinity();
        for (int j = 0; j < k.n; ++j) {
          if (!mask.allowed(q_offset + i, k_offset + j)) {
            p[j] = -std::numeric_limits<double>::infinity();
            continue;
          }
          double acc = 0.0, cond = 0.0;
          for (int x = 0; x < q.d; ++x) {
            acc += q(b, i, h, x) * k(b, j, hk, x);
            cond += std::abs(q(b, i, h, x) * k(b, j, hk, x));
          }
          p[j] = raw[j] = scale * acc;
          if constexpr (impl::has_score_mod_v<Mask>)
            p[j] = mask.score(raw[j], q_offset + i, k_offset + j, h);
          g.max_dot_condition = std::max(g.max_dot_condition, std::abs(scale) * cond);
          mx = std::max(mx, p[j]);
        }
        if (mx == -std::numeric_limits<double>::infinity()) continue;  // no gradient
        const double sink = sinks ? (*sinks)[std::size_t(h)] : -HUGE_VAL;
        mx = std::max(mx, sink);
        double sum = sinks ? std::exp(sink - mx) : 0.0;
        const double sink_term = sum;
        for (int j = 0; j < k.n; ++j) sum += (p[j] = std::exp(p[j] - mx));
        double drow = 0.0;
        for (int j = 0; j < k.n; ++j) {
          p[j] /= sum;
          double acc = 0.0;
          for (int x = 0; x < q.d; ++x) acc += dout(b, i, h, x) * v(b, j, hk, x);
          dp[j] = acc;
          drow += p[j] * acc;
        }
        if (o_used != nullptr) {
          drow = 0.0;
          for (int x = 0; x < q.d; ++x) drow += dout(b, i, h, x) * (*o_used)(b, i, h, x);
        }
        g.dsink[std::size_t(h)] -= sink_term / sum * drow;
        for (int j = 0; j < k.n; ++j) {
          if (p[j] == 0.0) continue;
          double ds = p[j] * (dp[j] - drow);
          if constexpr (impl::has_score_mod_v<Mask>)
            ds *= mask.score_grad(raw[j], q_offset + i, k_offset + j, h);
          for (int x = 0; x < q.d; ++x) {
            g.dv(b, j, hk, x) += p[j] * dout(b, i, h, x);
            g.dq(b, i, h, x) += scale * ds * k(b, j, hk, x);
            g.dk(b, j, hk, x) += scale * ds * q(b, i, h, x);
          }
        }
      }
    }
  return g;
}

}  // namespace blockattn::test
