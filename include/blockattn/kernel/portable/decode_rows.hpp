// SPDX-License-Identifier: Apache-2.0
// The decode kernel's scalar helpers (portable/decode_kernel.hpp): 16-bit
// values to the compute type, one row's dot product, and the host's portable
// tile products (scores and P V of one row over a tile's keys, the keys and
// values found through key(j) and value(j)).
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/core/quant.hpp>

namespace blockattn {
namespace impl {

template <class T>
KOKKOS_INLINE_FUNCTION T to_compute(const T& x) {
  return x;
}
KOKKOS_INLINE_FUNCTION float to_compute(const bf16& x) {
  return float(x);
}
KOKKOS_INLINE_FUNCTION float to_compute(const fp16& x) {
  return float(x);
}

/// out[d] = code d of an 8-bit row times its scale s, d < n (a loop the
/// compiler vectorises: the fp8 codes are widened by bit moves, dequantize).
template <class S>
KOKKOS_INLINE_FUNCTION void dequant_row(float* out, const S* in, float s, int n) {
  for (int d = 0; d < n; ++d) out[d] = dequantize(in[d]) * s;
}

/// q . k over n values with independent lane sums (vectorises without
/// reassociation flags); k in storage type S, converted as read.
template <class T, class S>
KOKKOS_INLINE_FUNCTION T decode_dot(const T* q, const S* k, int n) {
  constexpr int L = sizeof(T) == 4 ? 16 : 8;
  T acc[L];
  for (int l = 0; l < L; ++l) acc[l] = T(0);
  int d = 0;
  for (; d + L <= n; d += L)
    for (int l = 0; l < L; ++l) acc[l] += q[d + l] * T(to_compute(k[d + l]));
  T s = T(0);
  for (; d < n; ++d) s += q[d] * T(to_compute(k[d]));
  for (int l = 0; l < L; ++l) s += acc[l];
  return s;
}

/// Host: the scores q . k_j of one row against nk keys (key(j) -> const S*,
/// head_dim contiguous), four keys at a time (eight independent FMA chains).
template <class T, class S, class Key>
KOKKOS_INLINE_FUNCTION void host_scores(const T* q, const Key& key, int nk, int D, T* out) {
  constexpr int L = sizeof(T) == 4 ? 16 : 8;
  int j = 0;
  for (; j + 4 <= nk; j += 4) {
    const S* k0 = key(j);
    const S* k1 = key(j + 1);
    const S* k2 = key(j + 2);
    const S* k3 = key(j + 3);
    T a0[L], a1[L], a2[L], a3[L];
    for (int l = 0; l < L; ++l) a0[l] = a1[l] = a2[l] = a3[l] = T(0);
    int d = 0;
    for (; d + L <= D; d += L)
      for (int l = 0; l < L; ++l) {
        const T x = q[d + l];
        a0[l] += x * T(to_compute(k0[d + l]));
        a1[l] += x * T(to_compute(k1[d + l]));
        a2[l] += x * T(to_compute(k2[d + l]));
        a3[l] += x * T(to_compute(k3[d + l]));
      }
    T s0 = T(0), s1 = T(0), s2 = T(0), s3 = T(0);
    for (; d < D; ++d) {
      s0 += q[d] * T(to_compute(k0[d]));
      s1 += q[d] * T(to_compute(k1[d]));
      s2 += q[d] * T(to_compute(k2[d]));
      s3 += q[d] * T(to_compute(k3[d]));
    }
    for (int l = 0; l < L; ++l) {
      s0 += a0[l];
      s1 += a1[l];
      s2 += a2[l];
      s3 += a3[l];
    }
    out[j] = s0;
    out[j + 1] = s1;
    out[j + 2] = s2;
    out[j + 3] = s3;
  }
  for (; j < nk; ++j) out[j] = decode_dot(q, key(j), D);
}

/// Host: o = a o + sum_j p_j v_j over nk keys (value(j) -> const S*), the
/// output in registers across the keys, C columns at a time.
template <class T, class S, class Value>
KOKKOS_INLINE_FUNCTION void host_pv(T* o, T a, const T* p, const Value& value, int nk, int D) {
  constexpr int C = sizeof(T) == 4 ? 64 : 32;
  int d0 = 0;
  for (; d0 + C <= D; d0 += C) {
    T acc[C];
    for (int l = 0; l < C; ++l) acc[l] = o[d0 + l] * a;
    for (int j = 0; j < nk; ++j) {
      const T pj = p[j];
      if (pj == T(0)) continue;  // a masked key: its value is never read (NaN stays out)
      const S* vr = value(j) + d0;
      for (int l = 0; l < C; ++l) acc[l] += pj * T(to_compute(vr[l]));
    }
    for (int l = 0; l < C; ++l) o[d0 + l] = acc[l];
  }
  for (int d = d0; d < D; ++d) {
    T acc = o[d] * a;
    for (int j = 0; j < nk; ++j)
      if (p[j] != T(0)) acc += p[j] * T(to_compute(value(j)[d]));
    o[d] = acc;
  }
}

}  // namespace impl
}  // namespace blockattn
