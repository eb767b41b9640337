// SPDX-License-Identifier: Apache-2.0
// The decode kernel's host tile products in explicit vectors (the vector
// classes of simd_vec.hpp, fp32 arithmetic): the scores of the team's query
// rows against a tile of keys, the online-softmax step, and O = diag(a) O +
// P V for the tile's rows. Keys and values are read in place: fp32 loaded,
// bf16 widened as it is loaded (fp16 tiles are widened into scratch by the
// caller, exactly as the scalar conversion).
//
// Decode reads each key and value once per step; with GQA the group's rows
// (group x rows, up to 16) share them. The portable loops of decode_kernel.hpp
// kept each row's dot product in an array of lanes reduced once per (row,
// key), and GCC 12 kept the P V accumulators of host_pv in memory (a store
// and a reload per key and 16 columns): on a Zen 4 (2 threads, 65 536 keys,
// D = 128) a group of 8 rows ran at 0.26 (fp32) and 0.12 (bf16) of a plain
// read of the same bytes. Here:
//   scores: 4 (or 2) rows x W / 4 (or W / 2) keys per step (W = the vector
//     width), each key's vector loaded once for the rows, the W accumulators
//     over the head dim summed horizontally at once (lane_sums_to: a permute
//     tree, no scalar reduction per pair); a single row takes W keys, key by
//     key in address order;
//   softmax: the row maximum, the exponentials and their sum in vectors;
//   P V: register tiles of rows x columns, each value row loaded once for
//     the tile's rows, its accumulators in registers across the keys.
// The next tile's K and V rows are asked for (DecodePrefetch, prefetch.hpp)
// key by key as the first row group's scores reach the same key of this
// tile, which keeps memory busy through the tile's arithmetic (a burst
// before the tile stalled the core and then left memory idle).
// A key that a row does not see has P = 0 there, and 0 x (inf or NaN) in
// its value row would be NaN in that row: the portable loops skip P = 0, the
// register tile cannot per row. So the tile's outputs are tested once (x - x
// is 0 unless x is inf or NaN) and a block that came out non-finite is
// recomputed by the skipping scalar loop from its unchanged inputs: exact
// rules at no cost unless a value (or an earlier output) is inf or NaN.
#pragma once

#if defined(__NVCC__)
#pragma nv_diagnostic push
#pragma nv_diag_suppress 1675
#endif

#include <blockattn/core/half.hpp>
#include <blockattn/kernel/host/micro_gemm_simd.hpp>
#include <blockattn/kernel/impl/exp2.hpp>
#include <blockattn/kernel/impl/prefetch.hpp>

#include <cstddef>
#include <cstdint>
#include <limits>
#include <type_traits>

#if BLOCKATTN_SIMD_KERNELS
#if defined(__clang__)
#define BLOCKATTN_DECODE_UNROLL _Pragma("unroll")
#else
#define BLOCKATTN_DECODE_UNROLL _Pragma("GCC unroll 16")
#endif

namespace blockattn::impl {

/// x = V::width values of S at p as fp32: fp32 loaded, bf16 widened
/// exactly as it is loaded (the two storage types the kernels read in place).
/// Pinned: an fp32 vector kept in a register (V::load_pinned), for a value
/// used by several rows, which GCC would otherwise fold into each row's FMA
/// as a memory operand (a load per row); a widened bf16 vector is one anyway.
template <class V, bool Pinned = false, class S>
inline void decode_load(typename V::type& x, const S* p) {
  if constexpr (std::is_same<S, bf16>::value)
    V::load_bf16_to(x, reinterpret_cast<const std::uint16_t*>(p));
  else if constexpr (is_kv_quant_v<S>)  // 8-bit codes (their scales applied outside)
    V::load_codes_to(x, p);
  else if constexpr (Pinned)
    V::load_pinned(x, p);
  else
    V::load_to(x, p);
}

/// s[j] = q . key_j for j < nk, key_j at k + j * ldk (D floats each): one
/// row. Per W keys: W accumulators over the head dim in steps of W, their lane
/// sums at once, then the dims past the last whole vector (scalar). Keys past
/// nk in the last group repeat the group's first (computed, not stored).
/// next.row(j) as key j is reached.
template <class V, class S>
inline void decode_scores_row(const float* __restrict__ q, const S* __restrict__ k, std::size_t ldk,
                              int nk, int D, float* __restrict__ s, const DecodePrefetch& next) {
  constexpr int W = V::width;
  const int DV = D / W * W;
  for (int j0 = 0; j0 < nk; j0 += W) {
    const int n = nk - j0 < W ? nk - j0 : W;
    const S* kr[W];
    BLOCKATTN_DECODE_UNROLL
    for (int j = 0; j < W; ++j) kr[j] = k + std::size_t(j0 + (j < n ? j : 0)) * ldk;
    // Key by key, each row read in address order (the hardware prefetchers
    // follow it; the head dim outermost, 16 rows a line at a time, ran 2x
    // slower from memory on a Zen 4): the W chains are independent, and the
    // out-of-order core overlaps them.
    typename V::type acc[W];
    BLOCKATTN_DECODE_UNROLL
    for (int j = 0; j < W; ++j) {
      next.row(j0 + j);
      V::set_zero(acc[j]);
      for (int d = 0; d < DV; d += W) {
        typename V::type qv, kv;
        V::load_to(qv, q + d);
        decode_load<V>(kv, kr[j] + d);
        V::fma_to(acc[j], qv, kv);
      }
    }
    float sums[W];
    V::lane_sums_to(sums, acc);
    for (int j = 0; j < n; ++j) {
      float t = sums[j];
      for (int d = DV; d < D; ++d) t += q[d] * float(kr[j][d]);
      s[j0 + j] = t;
    }
  }
}

/// The same for RQ rows at once (q rows of D floats, s rows of lds): W / RQ
/// keys per step, the RQ x (W / RQ) accumulators over the head dim together
/// (each key's vector loaded once for the RQ rows, each row's q vector once
/// for the keys; RQ x W / RQ independent chains), their W lane sums at once.
template <class V, int RQ, class S>
inline void decode_scores_rows(const float* __restrict__ q, const S* __restrict__ k,
                               std::size_t ldk, int nk, int D, float* __restrict__ s, int lds,
                               const DecodePrefetch& next) {
  constexpr int W = V::width, KQ = W / RQ;
  static_assert(KQ * RQ == W, "decode_scores_rows: RQ must divide the vector width");
  const int DV = D / W * W;
  for (int j0 = 0; j0 < nk; j0 += KQ) {
    BLOCKATTN_DECODE_UNROLL
    for (int j = 0; j < KQ; ++j) next.row(j0 + j);
    const int n = nk - j0 < KQ ? nk - j0 : KQ;
    const S* kr[KQ];
    BLOCKATTN_DECODE_UNROLL
    for (int j = 0; j < KQ; ++j) kr[j] = k + std::size_t(j0 + (j < n ? j : 0)) * ldk;
    typename V::type acc[W];  // row r, key j at r * KQ + j
    BLOCKATTN_DECODE_UNROLL
    for (int e = 0; e < W; ++e) V::set_zero(acc[e]);
    for (int d = 0; d < DV; d += W) {
      typename V::type kv[KQ];
      BLOCKATTN_DECODE_UNROLL
      for (int j = 0; j < KQ; ++j) decode_load<V, true>(kv[j], kr[j] + d);
      BLOCKATTN_DECODE_UNROLL
      for (int r = 0; r < RQ; ++r) {
        typename V::type qv;
        V::load_pinned(qv, q + r * D + d);
        BLOCKATTN_DECODE_UNROLL
        for (int j = 0; j < KQ; ++j) V::fma_to(acc[r * KQ + j], qv, kv[j]);
      }
    }
    float sums[W];
    V::lane_sums_to(sums, acc);
    for (int r = 0; r < RQ; ++r)
      for (int j = 0; j < n; ++j) {
        float t = sums[r * KQ + j];
        for (int d = DV; d < D; ++d) t += q[r * D + d] * float(kr[j][d]);
        s[r * lds + j0 + j] = t;
      }
  }
}

/// S (nr x nk, rows of lds) = Q K^T for the nr rows of Q (rows of D floats):
/// 8 rows at a time on 8-wide vectors (one key per step: its vector loaded
/// once for 8 rows; on a Zen 3, 65 536 keys, 8 query heads on one kv head,
/// fp32: 1.2x the rate of 4 rows at a time), 4 rows, then 2, then one (where
/// the vector width allows). The first row group asks for the next tile's
/// rows (next.row) as it reaches each key; the others find the tile cached.
template <class V, class S>
inline void decode_scores_simd(const float* q, int nr, const S* k, std::size_t ldk, int nk, int D,
                               float* s, int lds, const DecodePrefetch& next) {
  constexpr int W = V::width;
  const DecodePrefetch none;
  int r = 0;
  const auto ask = [&] { return r == 0 ? next : none; };
  if constexpr (W == 8)
    for (; r + 8 <= nr; r += 8)
      decode_scores_rows<V, 8>(q + std::size_t(r) * D, k, ldk, nk, D, s + std::size_t(r) * lds, lds,
                               ask());
  if constexpr (W % 4 == 0)
    for (; r + 4 <= nr; r += 4)
      decode_scores_rows<V, 4>(q + std::size_t(r) * D, k, ldk, nk, D, s + std::size_t(r) * lds, lds,
                               ask());
  if constexpr (W % 2 == 0)
    for (; r + 2 <= nr; r += 2)
      decode_scores_rows<V, 2>(q + std::size_t(r) * D, k, ldk, nk, D, s + std::size_t(r) * lds, lds,
                               ask());
  for (; r < nr; ++r)
    decode_scores_row<V>(q + std::size_t(r) * D, k, ldk, nk, D, s + std::size_t(r) * lds, ask());
}

/// The online-softmax step of nr rows of S (rows of lds, nk scores each, base
/// 2): m' = max(m, max S), P = 2^(S - m') in place, l = a l + sum P, a =
/// 2^(m - m'); the decode kernel's scalar row loop with the maximum, the
/// exponentials and the sum in vectors (V with an exp2; the scalar loop
/// otherwise). NaN scores are skipped by the maximum and give NaN P (a row
/// with no allowed key yet and no NaN adds nothing: a = 1, P = 0).
template <class V>
inline void decode_softmax_rows(float* __restrict__ s, int lds, int nr, int nk,
                                float* __restrict__ m, float* __restrict__ l,
                                float* __restrict__ alpha) {
  constexpr int W = V::width;
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  const int nv = V::has_exp2 ? nk / W * W : 0;
  for (int r = 0; r < nr; ++r) {
    float* const sr = s + std::size_t(r) * lds;
    float mx = neg_inf;
    if (nv > 0) {
      typename V::type acc;
      V::broadcast_to(acc, &neg_inf);
      for (int j = 0; j < nv; j += W) {
        typename V::type x;
        V::load_to(x, sr + j);
        V::max_to(acc, x);
      }
      V::reduce_max_to(mx, acc);
    }
    for (int j = nv; j < nk; ++j) mx = sr[j] > mx ? sr[j] : mx;
    const float mn = mx > m[r] ? mx : m[r];
    if (mn == neg_inf) {  // no allowed key yet: nothing to add, unless a score is NaN
      bool nan = false;
      for (int j = 0; j < nk; ++j) nan = nan || sr[j] != sr[j];
      if (!nan) {
        alpha[r] = 1.0f;
        for (int j = 0; j < nk; ++j) sr[j] = 0.0f;
        continue;
      }
    }
    // A row with only NaN scores so far has mn = -inf: its P are NaN (kept).
    const float a = m[r] == neg_inf ? 0.0f : kmath::exp2(m[r] - mn);
    float sum = 0.0f;
    if constexpr (V::has_exp2) {
      if (nv > 0) {
        typename V::type mv, acc;
        V::broadcast_to(mv, &mn);
        V::set_zero(acc);
        for (int j = 0; j < nv; j += W) {
          typename V::type p;
          V::exp2_sub_to(p, sr + j, mv);
          V::store_from(sr + j, p);
          V::add_to(acc, p);
        }
        V::reduce_add_to(sum, acc);
      }
    }
    for (int j = nv; j < nk; ++j) {
      const float p = exp2_nonpositive(sr[j] - mn);  // 0 for a masked (-inf) score
      sr[j] = p;
      sum += p;
    }
    l[r] = l[r] * a + sum;
    m[r] = mn;
    alpha[r] = a;
  }
}

/// Rows r < rows, columns c < cols of O: o[r][c] = a[r] o[r][c] + sum_j
/// p[r][j] v_j[c] over the keys with p[r][j] != 0 (a key a row does not see
/// is never read for it: NaN stays out), scalar.
template <class S>
inline void decode_pv_skipping(float* o, int ldo, const float* a, const float* p, int ldp,
                               const S* v, std::size_t ldv, int nk, int rows, int cols) {
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) {
      float x = o[r * ldo + c] * a[r];
      for (int j = 0; j < nk; ++j) {
        const float pj = p[r * ldp + j];
        if (pj != 0.0f) x += pj * float(v[std::size_t(j) * ldv + c]);
      }
      o[r * ldo + c] = x;
    }
}

/// RB rows x CB vectors of O in registers across the nk keys; a non-finite
/// result sends the block to decode_pv_skipping (see the header comment).
template <class V, int RB, int CB, class S>
inline void decode_pv_block(float* __restrict__ o, int ldo, const float* __restrict__ a,
                            const float* __restrict__ p, int ldp, const S* __restrict__ v,
                            std::size_t ldv, int nk) {
  constexpr int W = V::width;
  typename V::type acc[RB][CB];
  BLOCKATTN_DECODE_UNROLL
  for (int r = 0; r < RB; ++r) {
    typename V::type ar;
    V::broadcast_to(ar, a + r);
    BLOCKATTN_DECODE_UNROLL
    for (int c = 0; c < CB; ++c) {
      typename V::type x;
      V::load_to(x, o + r * ldo + c * W);
      V::mul_to(acc[r][c], ar, x);
    }
  }
  for (int j = 0; j < nk; ++j) {
    typename V::type vv[CB];
    BLOCKATTN_DECODE_UNROLL
    for (int c = 0; c < CB; ++c) decode_load<V, true>(vv[c], v + std::size_t(j) * ldv + c * W);
    BLOCKATTN_DECODE_UNROLL
    for (int r = 0; r < RB; ++r) {
      typename V::type pr;
      V::broadcast_to(pr, p + r * ldp + j);
      BLOCKATTN_DECODE_UNROLL
      for (int c = 0; c < CB; ++c) V::fma_to(acc[r][c], pr, vv[c]);
    }
  }
  // x - x is 0 for finite x and NaN otherwise; their sum is NaN iff one is.
  typename V::type bad;
  V::set_zero(bad);
  BLOCKATTN_DECODE_UNROLL
  for (int r = 0; r < RB; ++r) {
    BLOCKATTN_DECODE_UNROLL
    for (int c = 0; c < CB; ++c) {
      typename V::type z;
      V::sub_to(z, acc[r][c], acc[r][c]);
      V::add_to(bad, z);
    }
  }
  float flag;
  V::reduce_add_to(flag, bad);
  if (flag != flag) {
    decode_pv_skipping(o, ldo, a, p, ldp, v, ldv, nk, RB, CB * W);
    return;
  }
  BLOCKATTN_DECODE_UNROLL
  for (int r = 0; r < RB; ++r) {
    BLOCKATTN_DECODE_UNROLL
    for (int c = 0; c < CB; ++c) V::store_from(o + r * ldo + c * W, acc[r][c]);
  }
}

/// Columns [0, D) of RB rows: blocks of CB vectors, then single vectors,
/// then the columns past the last whole vector (scalar).
template <class V, int RB, int CB, class S>
inline void decode_pv_rows(float* o, const float* a, const float* p, int ldp, const S* v,
                           std::size_t ldv, int nk, int D) {
  constexpr int W = V::width;
  const int DV = D / W * W;
  int c = 0;
  for (; c + CB * W <= DV; c += CB * W)
    decode_pv_block<V, RB, CB>(o + c, D, a, p, ldp, v + c, ldv, nk);
  for (; c < DV; c += W) decode_pv_block<V, RB, 1>(o + c, D, a, p, ldp, v + c, ldv, nk);
  if (DV < D) decode_pv_skipping(o + DV, D, a, p, ldp, v + DV, ldv, nk, RB, D - DV);
}

/// O (nr x D, rows of D floats) = diag(a) O + P V over nk keys: P (nr x nk,
/// rows of ldp), value row j at v + j * ldv. Register tiles of 4 rows x 4
/// vectors; on 16-register ISAs 4 rows x 3 vectors (all 16 registers: each
/// value vector loaded, and a bf16 one widened, once per 4 rows; on a Zen 3,
/// 65 536 keys, D = 128, GQA 32/8 and 8/1, fp32 and bf16: 1.04-1.14x the
/// rate of 2 rows x 4 vectors), then 2 rows x 4 vectors.
template <class V, class S>
inline void decode_pv_simd(float* o, const float* a, const float* p, int ldp, int nr, const S* v,
                           std::size_t ldv, int nk, int D) {
  constexpr int RB = V::registers >= 32 ? 4 : 2;
  int r = 0;
  if constexpr (V::registers < 32)
    for (; r + 4 <= nr; r += 4)
      decode_pv_rows<V, 4, 3>(o + std::size_t(r) * D, a + r, p + std::size_t(r) * ldp, ldp, v, ldv,
                              nk, D);
  for (; r + RB <= nr; r += RB)
    decode_pv_rows<V, RB, 4>(o + std::size_t(r) * D, a + r, p + std::size_t(r) * ldp, ldp, v, ldv,
                             nk, D);
  for (; r < nr; ++r)
    decode_pv_rows<V, 1, 4>(o + std::size_t(r) * D, a + r, p + std::size_t(r) * ldp, ldp, v, ldv,
                            nk, D);
}

}  // namespace blockattn::impl

#undef BLOCKATTN_DECODE_UNROLL
#endif  // BLOCKATTN_SIMD_KERNELS

#if defined(__NVCC__)
#pragma nv_diagnostic pop
#endif
