// SPDX-License-Identifier: Apache-2.0
// The AMX path of the portable forward kernel (ForwardKernel::run_amx and its
// helpers, portable/forward_kernel.hpp): bf16 operands on a host space whose
// kernels are the AVX-512 ones, tiles of whole 32-row blocks, the tile
// products of host/amx.hpp.
#pragma once

#include <blockattn/kernel/host/amx.hpp>
#include <blockattn/kernel/portable/forward_kernel.hpp>

#include <cstdint>
#include <type_traits>

namespace blockattn::impl {

#if BLOCKATTN_HOST_AMX
/// One team's work on AMX tiles (host spaces: one thread per team). Per
/// super-tile of AG key tiles (AW = AG * BK keys: 256 for BK = 128) and per
/// block of 32 query rows: S = Q K^T as 32 x 32 blocks of tile products
/// (amx.hpp) over the key tiles the mask leaves to the block; the fp32
/// online softmax over the whole super-tile row (one rescale of O per AW
/// keys); O += P V with P in bf16, one C tile load and store per AW keys.
template <class ExecSpace, class T, int StaticD, class Shape, class Mask, class QPos, class KPos,
          class QS, class OS>
void ForwardKernel<ExecSpace, T, StaticD, Shape, Mask, QPos, KPos, QS, OS>::run_amx(
    const member_type& team) const {
  const int da = amx_dim;  // amx_kv's and the scratch's head dim: a multiple of 32
  const TeamRows tr = team_rows(team);
  const int b = tr.b, h = tr.h, hk = tr.hk, q0 = tr.q0, q_rows = tr.q_rows;
  const int q_live = (q_rows + 31) / 32 * 32;

  ScratchLines scratch(team, scratch_level, amx_scratch_lines(da));
  auto* const qb = scratch.take<std::uint16_t>(std::size_t(BQA) * da);
  T* const os = scratch.take<T>(std::size_t(BQA) * da);
  T* const ss = scratch.take<T>(std::size_t(32) * AW);
  auto* const pb = scratch.take<std::uint16_t>(std::size_t(32) * AW);
  T* const m = scratch.take<T>(BQA);
  T* const l = scratch.take<T>(BQA);
  T* const alpha = scratch.take<T>(BQA);

  // Q rows as stored (bf16 bits: exact; the scale goes to S), zero padded
  // to da columns and q_live rows; O and (m, l) fresh or resumed.
  const std::size_t qs_d = q.stride(3);
  if (qs_d == 1)
    for (int r = 0; r < q_rows; ++r) {
      prefetch_span(&q(b, q0 + r, h, 0), sizeof(QS) * ext.dim);
      if (resume) prefetch_span(&o_acc(b, q0 + r, h, 0), sizeof(T) * ext.dim);
    }
  for (int r = 0; r < q_live; ++r) {
    const bool row_in = r < q_rows;
    const int n = row_in ? ext.dim : 0;
    std::uint16_t* const qd = qb + std::size_t(r) * da;
    if (n > 0) {
      const QS* const src = &q(b, q0 + r, h, 0);
      if (qs_d == 1)
        std::memcpy(qd, src, sizeof(std::uint16_t) * std::size_t(n));
      else
        for (int d = 0; d < n; ++d) qd[d] = bf16_storage_bits(src[std::size_t(d) * qs_d]);
    }
    for (int d = n; d < da; ++d) qd[d] = 0;
    const bool load = resume && row_in;
    T* const od = os + std::size_t(r) * da;
    const int n_o = load ? n : 0;
    if (n_o > 0) copy_row(od, &o_acc(b, q0 + r, h, 0), o_acc.stride(3), n_o, T(1));
    for (int d = n_o; d < da; ++d) od[d] = T(0);
    m[r] = load ? m_state(b, h, q0 + r) : -infinity<T>();
    l[r] = load ? l_state(b, h, q0 + r) : T(0);
  }

  const std::size_t kp = std::size_t(amx_tiles) * BK;  // keys of amx_kv per (batch, kv head)
  const std::size_t head = std::size_t(b) * ext.kv_heads + hk;
  const std::uint16_t* const kbase = amx_kv + head * 2 * kp * da;
  const std::uint16_t* const vbase = kbase + kp * da;
  const unsigned char* const v_bad = amx_v_bad + head * amx_tiles;
  // Whether the box (query rows r0 .. r0 + 31, keys c0 .. c0 + 31 of the
  // tile at k0) holds no allowed pair (or no key).
  auto box_empty = [&](int r0, int k0, int k_rows, int c0) {
    if (c0 >= k_rows) return true;
    const int r1 = (r0 + 32 < q_rows ? r0 + 32 : q_rows) - 1;
    const int c1 = (c0 + 32 < k_rows ? c0 + 32 : k_rows) - 1;
    return mask.classify(qpos(q0 + r0), qpos(q0 + r1) + 1, kpos(k0 + c0), kpos(k0 + c1) + 1) ==
           TileKind::empty;
  };
  if (matrix_tiles) amx_configure();
  // C (32 x 32) [+]= A B: tile products, or AVX512-BF16 vectors.
  auto block = [&](int chunks, const std::uint16_t* a, int lda, const std::uint16_t* b0,
                   const std::uint16_t* b1, T* c, int ldc, bool load_c) {
    if (matrix_tiles)
      amx_block(chunks, a, lda, b0, b1, c, ldc, load_c);
    else
      bf16_vector_block(chunks, a, lda, b0, b1, c, ldc, load_c);
  };
  for (int st = 0; st < k_tiles; st += AG) {
    const int tiles = k_tiles - st < AG ? k_tiles - st : AG;
    for (int r0 = 0; r0 < q_live; r0 += 32) {
      const int r1 = (r0 + 32 < q_rows ? r0 + 32 : q_rows) - 1;
      const index_type qb0 = qpos(q0 + r0), qb1 = qpos(q0 + r1) + 1;
      // The key tiles of the super-tile this row block meets: [g_lo, g_hi).
      TileKind kinds[AG];
      int g_lo = -1, g_hi = -1;
      bool select_pv = false;
      for (int g = 0; g < tiles; ++g) {
        const int k0 = (st + g) * BK;
        const int k_rows = ext.keys - k0 < BK ? ext.keys - k0 : BK;
        kinds[g] = mask.classify(qb0, qb1, kpos(k0), kpos(k0 + k_rows - 1) + 1);
        if (kinds[g] == TileKind::empty) continue;
        if (g_lo < 0) g_lo = g;
        g_hi = g + 1;
      }
      if (g_lo < 0) continue;
      const int w = (g_hi - g_lo) * BK;  // columns of S: keys from kbeg
      const int kbeg = (st + g_lo) * BK;
      // S = Q K^T (unscaled) tile by tile; boxes the mask rules out
      // entirely are left to the mask pass, tiles it rules out to -inf.
      for (int g = g_lo; g < g_hi; ++g) {
        const int k0 = (st + g) * BK;
        const int k_rows = ext.keys - k0 < BK ? ext.keys - k0 : BK;
        T* const seg = ss + (g - g_lo) * BK;
        // A V row with an inf or NaN where P may be 0 (not a full tile):
        // P V selects instead of multiplying (rare).
        select_pv = select_pv || (kinds[g] != TileKind::full && v_bad[st + g] != 0);
        if (kinds[g] == TileKind::empty) {
          for (int r = 0; r < 32; ++r)
            for (int c = 0; c < BK; ++c) seg[r * AW + c] = -infinity<T>();
          continue;
        }
        const bool partial = kinds[g] == TileKind::partial;
        for (int c0 = 0; c0 < BK; c0 += 32) {
          if (partial && box_empty(r0, k0, k_rows, c0)) continue;
          const std::uint16_t* const kc = kbase + std::size_t(k0 + c0) * da;
          block(da / 32, qb + std::size_t(r0) * da, da, kc, kc + 16 * da, seg + c0, AW, false);
        }
      }
      // Per row: scale (base-2 logits), policy, mask, online softmax: S
      // becomes P.
      for (int r = r0; r < r0 + 32; ++r) {
        const int rq = r < q_rows ? r : q_rows - 1;
        const index_type qp = qpos(q0 + rq);
        T* const srow = ss + (r - r0) * AW;
        // A policy sees scaled logits (its pass scales the unscaled S of
        // the tiles it meets; empty ones stay -inf); otherwise the
        // exponent pass scales.
        for (int g = g_lo; g < g_hi; ++g) {
          if (kinds[g] == TileKind::empty) continue;
          const int k0 = (st + g) * BK;
          const int k_rows = ext.keys - k0 < BK ? ext.keys - k0 : BK;
          T* const seg = srow + (g - g_lo) * BK;
          if constexpr (has_score_mod_v<Mask>)
            score_row(mask, kpos, seg, qp, k0, k_rows, h, q_scale * ln2<T>);
          mask_segment(seg, qp, kinds[g] == TileKind::partial, k0, k_rows);
        }
      }
      // P in bf16 straight from the exponent pass (in fp32 for the select path).
      const T pass_scale = has_score_mod_v<Mask> ? T(1) : q_scale;
      for (int r = r0; r < r0 + 32; r += 4)
        softmax_wide_rows(ss + (r - r0) * AW, w, pass_scale, m + r, l + r, alpha + r,
                          select_pv ? nullptr : pb + (r - r0) * AW);
      if (select_pv) {
        // O = diag(alpha) O + sum of p v over p != 0, in fp32 from the
        // VNNI V: V(key, d) at (d / 16) kp 16 + (key / 2) 32 + (d % 16) 2 + key % 2.
        for (int r = r0; r < r0 + 32; ++r) {
          T* const orow = os + std::size_t(r) * da;
          const T* const prow = ss + (r - r0) * AW;
          for (int d = 0; d < da; ++d) orow[d] *= alpha[r];
          for (int c = 0; c < w; ++c) {
            if (prow[c] == T(0)) continue;
            const int key = kbeg + c;
            const std::uint16_t* const vk = vbase + std::size_t(key / 2) * 32 + key % 2;
            for (int d = 0; d < da; ++d)
              orow[d] +=
                  prow[c] *
                  bits_float(std::uint32_t(vk[std::size_t(d / 16) * kp * 16 + (d % 16) * 2]) << 16);
          }
        }
        continue;
      }
      // O rows times alpha; then O += P V over the 32-key chunks some row of
      // the block may see.
      for (int r = r0; r < r0 + 32; ++r) amx_scale_o(os + std::size_t(r) * da, da, alpha[r]);
      auto chunk_empty = [&](int c) {
        const int g = g_lo + c * 32 / BK;
        const int k0 = (st + g) * BK;
        const int k_rows = ext.keys - k0 < BK ? ext.keys - k0 : BK;
        const int c0 = (c * 32) % BK;
        return kinds[g] == TileKind::empty ||
               (kinds[g] == TileKind::partial ? box_empty(r0, k0, k_rows, c0) : c0 >= k_rows);
      };
      int lo = 0, hi = w / 32;
      while (lo < hi && chunk_empty(lo)) ++lo;
      while (hi > lo && chunk_empty(hi - 1)) --hi;
      if (lo == hi) continue;
      const std::size_t kv0 = std::size_t(kbeg + 32 * lo) * 16;
      for (int nb = 0; nb < da / 32; ++nb)
        block(hi - lo, pb + 32 * lo, AW, vbase + std::size_t(2 * nb) * kp * 16 + kv0,
              vbase + std::size_t(2 * nb + 1) * kp * 16 + kv0, os + std::size_t(r0) * da + nb * 32,
              da, true);
    }
  }
  if (matrix_tiles) amx_release();
  if constexpr (std::is_same<OS, bf16>::value) {
    if (finish && o.stride(3) == 1) {
      // Normalised bf16 rows, rounded as bf16(float) rounds, 16 at a time.
      for (int r = 0; r < q_rows; ++r)
        prefetch_span(&o(b, q0 + r, h, 0), sizeof(OS) * ext.dim, true);
      for (int r = 0; r < q_rows; ++r) {
        const T inv_l = SoftmaxRow<T>::inverse_sum(l[r]);
        amx_store_bf16_row(&o(b, q0 + r, h, 0).bits, os + std::size_t(r) * da, ext.dim, inv_l);
        lse(b, h, q0 + r) = SoftmaxRow<T>::lse(m[r], l[r]);
      }
      return;
    }
  }
  store_rows(team, b, h, q0, q_rows, os, da, m, l);
}

/// The online-softmax update of four rows of w unscaled logits (rows AW
/// apart; x = fl(s * scale) the base-2 logit), as softmax_row over BK
/// columns: m' = max(m, max x); p = 2^(x - m'); alpha = 2^(m - m');
/// l' = alpha l + sum p. (max x = fl(scale * max s): scale > 0 and rounding
/// is monotonic.)
/// With p16: P goes there in bf16 (rows AW apart) instead of into s.
/// (Compiled for the AMX target: its AVX-512 values never cross a call of
/// another target, which a build below AVX-512 rejects: -Wpsabi.)
template <class ExecSpace, class T, int StaticD, class Shape, class Mask, class QPos, class KPos,
          class QS, class OS>
BLOCKATTN_TARGET_AMX void ForwardKernel<ExecSpace, T, StaticD, Shape, Mask, QPos, KPos, QS,
                                        OS>::softmax_wide_rows(T* __restrict__ s, int w, T scale,
                                                               T* m, T* l, T* alpha,
                                                               std::uint16_t* __restrict__ p16) {
  if constexpr (simd_exp2_rows<isa, T, Shape::dim_granule>()) {
    using V = simd_for_t<isa>;
    constexpr int R = 4;
    const T none[R] = {-infinity<T>(), -infinity<T>(), -infinity<T>(), -infinity<T>()};
    T raw[R], m_new[R];
    simd_row_max_group<V, Shape::dim_granule, R>(s, AW, w, none, raw);
    for (int r = 0; r < R; ++r) {
      const T x = raw[r] * scale;
      m_new[r] = x > m[r] ? x : m[r];
    }
    typename V::type mv[R], acc[R], sv;
    V::broadcast_to(sv, &scale);
    for (int r = 0; r < R; ++r) {
      V::broadcast_to(mv[r], m_new + r);
      V::set_zero(acc[r]);
    }
    bool finite = true;
    for (int r = 0; r < R; ++r) finite = finite && m_new[r] != -infinity<T>();
    if (finite) {
      for (int c = 0; c < w; c += V::width)
        for (int r = 0; r < R; ++r) {
          T* const sr = s + r * AW + c;
          typename V::type x = V::load(sr);
          x = V::sub(V::mul(x, sv), mv[r]);
          const typename V::type p = V::exp2_nonpositive(x);
          if (p16 != nullptr)
            amx_store_p16(p16 + r * AW + c, p);
          else
            V::store(sr, p);
          V::add_to(acc[r], p);
        }
    }
    for (int r = 0; r < R; ++r) {
      T* const row = s + r * AW;
      if (m_new[r] == -infinity<T>()) {
        // No finite allowed logit: masked (-inf) or NaN (the max skips NaN).
        bool nan_seen = false;
        for (int c = 0; c < w; ++c) {
          nan_seen = nan_seen || row[c] != row[c];
          row[c] = T(0);
        }
        if (p16 != nullptr) std::memset(p16 + r * AW, 0, sizeof(std::uint16_t) * std::size_t(w));
        if (nan_seen) l[r] = quiet_nan<T>();
        alpha[r] = T(1);
        continue;
      }
      T sum = T(0);
      if (finite) {
        V::reduce_add_to(sum, acc[r]);
      } else {
        typename V::type a1;
        V::set_zero(a1);
        for (int c = 0; c < w; c += V::width) {
          const typename V::type p =
              V::exp2_nonpositive(V::sub(V::mul(V::load(row + c), sv), mv[r]));
          if (p16 != nullptr)
            amx_store_p16(p16 + r * AW + c, p);
          else
            V::store(row + c, p);
          V::add_to(a1, p);
        }
        V::reduce_add_to(sum, a1);
      }
      alpha[r] = exp2_nonpositive(m[r] - m_new[r]);
      l[r] = alpha[r] * l[r] + sum;
      m[r] = m_new[r];
    }
  }
}

/// The bits of a bf16 value as stored.
template <class ExecSpace, class T, int StaticD, class Shape, class Mask, class QPos, class KPos,
          class QS, class OS>
KOKKOS_FORCEINLINE_FUNCTION std::uint16_t
ForwardKernel<ExecSpace, T, StaticD, Shape, Mask, QPos, KPos, QS, OS>::bf16_storage_bits(
    const QS& x) {
  if constexpr (std::is_same<QS, bf16>::value) {
    return x.bits;
  } else {
    return bf16_upper_bits(float(x));
  }
}
#endif  // BLOCKATTN_HOST_AMX

}  // namespace blockattn::impl
