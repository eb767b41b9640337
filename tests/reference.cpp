// SPDX-License-Identifier: Apache-2.0
// The fp64 reference's loops (reference_core.hpp), compiled at -O3 with
// -ffp-contract=off whatever the tests' optimisation level
// (tests/CMakeLists.txt). Every sum is taken in the definition's order (over
// x for a dot product, over keys for P V and the gradients); the loops are
// only arranged so that the compiler vectorizes across independent sums.
#include "reference_core.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

namespace blockattn::test {

namespace {

/// The keys (or values) of one batch and kv head transposed, t[x * n + j]: a
/// row of dot products with them is a vector loop over keys, each key's sum
/// still taken over x in order, one rounded product at a time (the file is
/// compiled without floating-point contraction: tests/CMakeLists.txt).
struct Transposed {
  std::vector<double> t;
  int n = 0;
  void load(const HostTensor& k, int b, int hk) {
    n = k.n;
    t.resize(std::size_t(k.d) * std::size_t(k.n));
    for (int j = 0; j < k.n; ++j)
      for (int x = 0; x < k.d; ++x) t[std::size_t(x) * k.n + j] = k(b, j, hk, x);
  }
  const double* row(int x) const { return t.data() + std::size_t(x) * n; }
};

/// Row i of head h: s[j] = scale q_i . k_j (kt: the head's keys, transposed)
/// with the score policy applied, -inf where the mask hides the pair; raw[j]
/// (when given) before the policy. Returns the row's largest logit (-inf: it
/// sees nothing); raises cond_max to scale * sum |q k| and *abs_max (when
/// given) to |s[j]|. dot and cond: scratch of k.n.
double logit_row(const HostTensor& q, const Transposed& kt, const ReferenceMask& mask, double scale,
                 int b, int h, int i, std::vector<double>& s, std::vector<double>* raw,
                 double& cond_max, std::vector<double>& dot, std::vector<double>& cond,
                 double* abs_max = nullptr) {
  const int nk = kt.n;
  const unsigned char* allowed = mask.allowed.data() + std::size_t(i) * std::size_t(nk);
  int lo = 0, hi = nk;  // the span of the allowed keys
  while (lo < hi && !allowed[lo]) ++lo;
  while (hi > lo && !allowed[hi - 1]) --hi;
  std::fill(dot.begin() + lo, dot.begin() + hi, 0.0);
  std::fill(cond.begin() + lo, cond.begin() + hi, 0.0);
  for (int x = 0; x < q.d; ++x) {
    const double qx = q(b, i, h, x);
    const double* kx = kt.row(x);
    for (int j = lo; j < hi; ++j) {
      const double t = qx * kx[j];
      dot[std::size_t(j)] += t;
      cond[std::size_t(j)] += std::abs(t);
    }
  }
  double mx = -std::numeric_limits<double>::infinity();
  for (int j = 0; j < nk; ++j) {
    if (!allowed[j]) {
      s[j] = -std::numeric_limits<double>::infinity();
      continue;
    }
    s[j] = scale * dot[std::size_t(j)];
    if (raw != nullptr) (*raw)[j] = s[j];
    if (mask.score) s[j] = mask.score(s[j], i, j, h);
    if (abs_max != nullptr) *abs_max = std::max(*abs_max, std::abs(s[j]));
    cond_max = std::max(cond_max, std::abs(scale) * cond[std::size_t(j)]);
    mx = std::max(mx, s[j]);
  }
  return mx;
}

/// exp(s - mx) (exactly 0 for a hidden pair's -inf, without the call).
inline double exp_shifted(double s, double mx) {
  return s == -std::numeric_limits<double>::infinity() ? 0.0 : std::exp(s - mx);
}

}  // namespace

ReferenceResult reference_attention_table(const HostTensor& q, const HostTensor& k,
                                          const HostTensor& v, const ReferenceMask& mask,
                                          double scale, const std::vector<double>* sinks) {
  ReferenceResult r;
  r.o = HostTensor(q.b, q.n, q.h, q.d);
  r.lse.assign(std::size_t(q.b) * q.h * q.n, -std::numeric_limits<double>::infinity());
  const int group = q.h / k.h;
  std::vector<double> s(k.n), dot(k.n), cond(k.n), acc(std::size_t(q.d));
  Transposed kt;
  for (int b = 0; b < q.b; ++b)
    for (int h = 0; h < q.h; ++h) {
      if (h % group == 0) kt.load(k, b, h / group);
      for (int i = 0; i < q.n; ++i) {
        double mx = logit_row(q, kt, mask, scale, b, h, i, s, nullptr, r.max_dot_condition, dot,
                              cond, &r.max_abs_logit);
        const double sink = sinks ? (*sinks)[std::size_t(h)] : -HUGE_VAL;
        if (sinks && mx == -HUGE_VAL) r.lse[(std::size_t(b) * q.h + h) * q.n + i] = sink;
        if (mx == -std::numeric_limits<double>::infinity()) continue;  // O row stays 0
        mx = std::max(mx, sink);
        double sum = sinks ? std::exp(sink - mx) : 0.0;
        for (int j = 0; j < k.n; ++j) sum += (s[j] = exp_shifted(s[j], mx));
        // O = sum_j s[j] v_j, every j (a masked key's 0 times a non-finite v
        // is NaN, as in the definition), each element's sum in the order of j.
        std::fill(acc.begin(), acc.end(), 0.0);
        for (int j = 0; j < k.n; ++j) {
          const double* vj = v.row(b, j, h / group);
          for (int x = 0; x < q.d; ++x) acc[std::size_t(x)] += s[j] * vj[x];
        }
        for (int x = 0; x < q.d; ++x) r.o(b, i, h, x) = acc[std::size_t(x)] / sum;
        r.lse[(std::size_t(b) * q.h + h) * q.n + i] = mx + std::log(sum);
      }
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
  std::vector<double> p(k.n), dp(k.n), raw(k.n), dot(k.n), cond(k.n);
  Transposed kt, vt;
  g.dsink.assign(std::size_t(q.h), 0.0);
  for (int b = 0; b < q.b; ++b)
    for (int h = 0; h < q.h; ++h) {
      const int hk = h / group;
      if (h % group == 0) {
        kt.load(k, b, hk);
        vt.load(v, b, hk);
      }
      for (int i = 0; i < q.n; ++i) {
        double mx = logit_row(q, kt, mask, scale, b, h, i, p, &raw, g.max_dot_condition, dot, cond);
        if (mx == -std::numeric_limits<double>::infinity()) continue;  // no gradient
        const double sink = sinks ? (*sinks)[std::size_t(h)] : -HUGE_VAL;
        mx = std::max(mx, sink);
        double sum = sinks ? std::exp(sink - mx) : 0.0;
        const double sink_term = sum;
        for (int j = 0; j < k.n; ++j) sum += (p[j] = exp_shifted(p[j], mx));
        // dP_ij = dO_i . v_j for every key (a hidden key's non-finite v makes
        // the row's D NaN, as in the definition), each summed over x in order.
        std::fill(dp.begin(), dp.end(), 0.0);
        for (int x = 0; x < q.d; ++x) {
          const double dx = dout(b, i, h, x);
          const double* vx = vt.row(x);
          for (int j = 0; j < k.n; ++j) dp[std::size_t(j)] += dx * vx[j];
        }
        double drow = 0.0;
        for (int j = 0; j < k.n; ++j) {
          p[j] /= sum;
          drow += p[j] * dp[j];
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
          // One loop per output (each a vector loop over x).
          const double pj = p[j], sds = scale * ds, sads = scale * ads;
          const double *doi = dout.row(b, i, h), *kj = k.row(b, j, hk), *qi = q.row(b, i, h);
          double* out = g.dv.row(b, j, hk);
          for (int x = 0; x < q.d; ++x) out[x] += pj * doi[x];
          out = g.dq.row(b, i, h);
          for (int x = 0; x < q.d; ++x) out[x] += sds * kj[x];
          out = g.dk.row(b, j, hk);
          for (int x = 0; x < q.d; ++x) out[x] += sds * qi[x];
          if (terms) {
            out = g.abs_dv.row(b, j, hk);
            for (int x = 0; x < q.d; ++x) out[x] += pj * std::abs(doi[x]);
            out = g.abs_dq.row(b, i, h);
            for (int x = 0; x < q.d; ++x) out[x] += sads * std::abs(kj[x]);
            out = g.abs_dk.row(b, j, hk);
            for (int x = 0; x < q.d; ++x) out[x] += sads * std::abs(qi[x]);
          }
        }
      }
    }
  return g;
}

}  // namespace blockattn::test
