// SPDX-License-Identifier: Apache-2.0
// The fp64 reference's loops (reference_core.hpp), compiled at -O2 whatever
// the tests' optimisation level (tests/CMakeLists.txt).
#include "reference_core.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

namespace blockattn::test {

namespace {

/// Row i of head h (kv head hk): s[j] = scale q_i . k_j with the score policy
/// applied, -inf where the mask hides the pair; raw[j] (when given) before the
/// policy. Returns the row's largest logit (-inf: it sees nothing); raises
/// cond_max to scale * sum |q k| and *abs_max (when given) to |s[j]|.
double logit_row(const HostTensor& q, const HostTensor& k, const ReferenceMask& mask, double scale,
                 int b, int h, int i, int hk, std::vector<double>& s, std::vector<double>* raw,
                 double& cond_max, double* abs_max = nullptr) {
  double mx = -std::numeric_limits<double>::infinity();
  for (int j = 0; j < k.n; ++j) {
    if (!mask.allowed[std::size_t(i) * k.n + j]) {
      s[j] = -std::numeric_limits<double>::infinity();
      continue;
    }
    double acc = 0.0, cond = 0.0;
    for (int x = 0; x < q.d; ++x) {
      acc += q(b, i, h, x) * k(b, j, hk, x);
      cond += std::abs(q(b, i, h, x) * k(b, j, hk, x));
    }
    s[j] = scale * acc;
    if (raw != nullptr) (*raw)[j] = s[j];
    if (mask.score) s[j] = mask.score(s[j], i, j, h);
    if (abs_max != nullptr) *abs_max = std::max(*abs_max, std::abs(s[j]));
    cond_max = std::max(cond_max, std::abs(scale) * cond);
    mx = std::max(mx, s[j]);
  }
  return mx;
}

}  // namespace

ReferenceResult reference_attention_table(const HostTensor& q, const HostTensor& k,
                                          const HostTensor& v, const ReferenceMask& mask,
                                          double scale, const std::vector<double>* sinks) {
  ReferenceResult r;
  r.o = HostTensor(q.b, q.n, q.h, q.d);
  r.lse.assign(std::size_t(q.b) * q.h * q.n, -std::numeric_limits<double>::infinity());
  const int group = q.h / k.h;
  std::vector<double> s(k.n);
  for (int b = 0; b < q.b; ++b)
    for (int h = 0; h < q.h; ++h)
      for (int i = 0; i < q.n; ++i) {
        double mx = logit_row(q, k, mask, scale, b, h, i, h / group, s, nullptr,
                              r.max_dot_condition, &r.max_abs_logit);
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

ReferenceGrads reference_backward_table(const HostTensor& q, const HostTensor& k,
                                        const HostTensor& v, const HostTensor& dout,
                                        const ReferenceMask& mask, double scale,
                                        const HostTensor* o_used, const std::vector<double>* sinks,
                                        bool terms) {
  ReferenceGrads g;
  g.dq = HostTensor(q.b, q.n, q.h, q.d);
  g.dk = HostTensor(k.b, k.n, k.h, k.d);
  g.dv = HostTensor(v.b, v.n, v.h, v.d);
  if (terms) {
    g.abs_dq = g.dq;
    g.abs_dk = g.dk;
    g.abs_dv = g.dv;
  }
  const int group = q.h / k.h;
  std::vector<double> p(k.n), dp(k.n), raw(k.n);
  g.dsink.assign(std::size_t(q.h), 0.0);
  for (int b = 0; b < q.b; ++b)
    for (int h = 0; h < q.h; ++h) {
      const int hk = h / group;
      for (int i = 0; i < q.n; ++i) {
        double mx = logit_row(q, k, mask, scale, b, h, i, hk, p, &raw, g.max_dot_condition);
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
          // dS's two terms' absolute values (P dP and P D: a provider may
          // form D from its own O, or from a proxy of it).
          double ads = p[j] * (std::abs(dp[j]) + std::abs(drow));
          if (mask.score_grad) {
            const double f = mask.score_grad(raw[j], i, j, h);
            ds *= f;
            ads *= std::abs(f);
          }
          for (int x = 0; x < q.d; ++x) {
            g.dv(b, j, hk, x) += p[j] * dout(b, i, h, x);
            g.dq(b, i, h, x) += scale * ds * k(b, j, hk, x);
            g.dk(b, j, hk, x) += scale * ds * q(b, i, h, x);
          }
          if (terms)
            for (int x = 0; x < q.d; ++x) {
              g.abs_dv(b, j, hk, x) += p[j] * std::abs(dout(b, i, h, x));
              g.abs_dq(b, i, h, x) += scale * ads * std::abs(k(b, j, hk, x));
              g.abs_dk(b, j, hk, x) += scale * ads * std::abs(q(b, i, h, x));
            }
        }
      }
    }
  return g;
}

}  // namespace blockattn::test
