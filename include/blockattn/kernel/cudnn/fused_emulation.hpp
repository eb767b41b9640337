// SPDX-License-Identifier: Apache-2.0
// A host emulation of the fused call (kernel/fused.hpp) with cuDNN's
// semantics: the band as cuDNN reads it (CudnnBand: top-left alignment,
// right and left bounds), fp32 arithmetic from 16-bit storage, O rounded
// once, LSE in fp32 and the natural log; backward from the given O, dO and
// LSE, gradients written (not added). Built with -DBLOCKATTN_EMULATE_FUSED
// (tests only), so that CI runs every path around the vendor call.
#pragma once

#include <blockattn/core/half.hpp>
#include <blockattn/kernel/fused.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace blockattn::impl {

/// Whether cuDNN's band lets row i see key j.
inline bool fused_band_allows(const CudnnBand& b, std::int64_t i, std::int64_t j) {
  return (!b.has_right || j <= i + b.right_bound) && (!b.has_left || j > i - b.left_bound);
}

template <class V>
struct EmulatedTensor {
  const FusedTensor& t;
  V* at(std::int64_t b, std::int64_t h, std::int64_t s, std::int64_t d) const {
    return const_cast<V*>(static_cast<const V*>(t.data)) + b * t.stride[0] + h * t.stride[1] +
           s * t.stride[2] + d * t.stride[3];
  }
  float get(std::int64_t b, std::int64_t h, std::int64_t s, std::int64_t d) const {
    return float(*at(b, h, s, d));
  }
};

template <class V>
void emulated_forward(const FusedForwardCall& c) {
  const FusedProblem& p = c.p;
  const EmulatedTensor<V> q{c.q}, k{c.k}, v{c.v}, o{c.o};
  const EmulatedTensor<float> lse{c.lse};
  const std::int64_t group = p.heads / p.kv_heads;
  std::vector<float> s(std::size_t(p.keys)), acc(std::size_t(p.dim));
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads; ++h)
      for (std::int64_t i = 0; i < p.queries; ++i) {
        const std::int64_t kh = h / group;
        float m = -std::numeric_limits<float>::infinity();
        bool any = false;
        for (std::int64_t j = 0; j < p.keys; ++j) {
          if (!fused_band_allows(p.band, i, j)) continue;
          float dot = 0.0f;
          for (std::int64_t d = 0; d < p.dim; ++d) dot += q.get(b, h, i, d) * k.get(b, kh, j, d);
          s[std::size_t(j)] = p.scale * dot;
          m = std::fmax(m, s[std::size_t(j)]);
          any = true;
        }
        float l = 0.0f;
        for (auto& a : acc) a = 0.0f;
        for (std::int64_t j = 0; any && j < p.keys; ++j) {
          if (!fused_band_allows(p.band, i, j)) continue;
          const float e = std::exp(s[std::size_t(j)] - m);
          l += e;
          for (std::int64_t d = 0; d < p.dim; ++d) acc[std::size_t(d)] += e * v.get(b, kh, j, d);
        }
        for (std::int64_t d = 0; d < p.dim; ++d)
          *o.at(b, h, i, d) = V(any ? acc[std::size_t(d)] / l : 0.0f);
        *lse.at(b, h, i, 0) = any ? m + std::log(l) : -std::numeric_limits<float>::infinity();
      }
}

template <class V>
void emulated_backward(const FusedBackwardCall& c) {
  const FusedProblem& p = c.p;
  const EmulatedTensor<V> q{c.q}, k{c.k}, v{c.v}, o{c.o}, dout{c.dout}, dq{c.dq}, dk{c.dk},
      dv{c.dv};
  const EmulatedTensor<float> lse{c.lse};
  const std::int64_t group = p.heads / p.kv_heads;
  const auto n = [](std::int64_t a, std::int64_t b) { return std::size_t(a * b); };
  std::vector<float> gq(n(p.queries, p.dim)), gk(n(p.keys, p.dim)), gv(n(p.keys, p.dim));
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t kh = 0; kh < p.kv_heads; ++kh) {
      for (auto& x : gk) x = 0.0f;
      for (auto& x : gv) x = 0.0f;
      for (std::int64_t h = kh * group; h < (kh + 1) * group; ++h) {
        for (auto& x : gq) x = 0.0f;
        for (std::int64_t i = 0; i < p.queries; ++i) {
          const float li = lse.get(b, h, i, 0);
          float D = 0.0f;
          for (std::int64_t d = 0; d < p.dim; ++d) D += dout.get(b, h, i, d) * o.get(b, h, i, d);
          for (std::int64_t j = 0; j < p.keys; ++j) {
            if (!fused_band_allows(p.band, i, j)) continue;
            float dot = 0.0f, dp = 0.0f;
            for (std::int64_t d = 0; d < p.dim; ++d) {
              dot += q.get(b, h, i, d) * k.get(b, kh, j, d);
              dp += dout.get(b, h, i, d) * v.get(b, kh, j, d);
            }
            const float pr = std::isinf(li) && li < 0 ? 0.0f : std::exp(p.scale * dot - li);
            const float ds = pr * (dp - D);
            for (std::int64_t d = 0; d < p.dim; ++d) {
              gv[n(j, p.dim) + std::size_t(d)] += pr * dout.get(b, h, i, d);
              gq[n(i, p.dim) + std::size_t(d)] += p.scale * ds * k.get(b, kh, j, d);
              gk[n(j, p.dim) + std::size_t(d)] += p.scale * ds * q.get(b, h, i, d);
            }
          }
        }
        for (std::int64_t i = 0; i < p.queries; ++i)
          for (std::int64_t d = 0; d < p.dim; ++d)
            *dq.at(b, h, i, d) = V(gq[n(i, p.dim) + std::size_t(d)]);
      }
      for (std::int64_t j = 0; j < p.keys; ++j)
        for (std::int64_t d = 0; d < p.dim; ++d) {
          *dk.at(b, kh, j, d) = V(gk[n(j, p.dim) + std::size_t(d)]);
          *dv.at(b, kh, j, d) = V(gv[n(j, p.dim) + std::size_t(d)]);
        }
    }
}

}  // namespace blockattn::impl
