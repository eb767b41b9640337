// SPDX-License-Identifier: Apache-2.0
// Backward tile kernels (FlashAttention-2 structure, no atomics):
//   KeyKernel    one team per (batch, kv head, key tile): dK, dV of its keys,
//                looping over the query tiles of every head of its GQA group;
//   QueryKernel  one team per (batch, head, query tile): dQ of its queries,
//                looping over the key tiles.
// Both recompute P = exp(S - LSE) from the saved LSE (forward never re-runs):
//   D = rowsum(dO o O) (given), dP = dO V^T, dS = P o (dP - D),
//   dV += P^T dO, dK += scale dS^T Q, dQ += scale dS K.
// S and dP are computed twice (once per kernel): 7 tile products instead of
// FlashAttention-2's 5, in exchange for deterministic results without atomics.
// KeyKernel with `fused` (one team per (batch, kv head, slice)) computes all
// three gradients with 5 tile products, the team owning every query row of its
// GQA group so that it adds dS K into their dQ accumulators without atomics.
// Used on host spaces when there are enough (batch, kv head) pairs for the
// threads; bitwise the same results.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/kernel/buffer_cache.hpp>
#include <blockattn/kernel/impl/backward_pack.hpp>
#include <blockattn/kernel/impl/exp2.hpp>
#include <blockattn/kernel/impl/mask_columns.hpp>
#include <blockattn/kernel/impl/scratch.hpp>
#include <blockattn/kernel/portable/micro_gemm.hpp>
#include <blockattn/kernel/tile_shape.hpp>
#include <blockattn/kernel/validate.hpp>
#include <blockattn/policy/mask.hpp>
#include <blockattn/policy/score.hpp>

#include <cstdint>
#include <type_traits>

namespace blockattn::impl {

/// What both backward kernels share: views, extents, and the tile step that
/// turns S and dP of one (query tile, key tile) into P and dS in scratch.
template <class ExecSpace, class T, int StaticD, class Shape, class Mask, class QPos, class KPos,
          class GS = T>
struct BackwardCommon : BlockExtents {
  using memory_space = typename ExecSpace::memory_space;
  using policy_type = Kokkos::TeamPolicy<ExecSpace, Kokkos::Schedule<Kokkos::Dynamic>>;
  using member_type = typename policy_type::member_type;
  using Unmanaged = Kokkos::MemoryTraits<Kokkos::Unmanaged>;
  using in4 = Kokkos::View<const T****, Kokkos::LayoutStride, memory_space, Unmanaged>;
  // Gradients in their storage type GS (T, or bf16/fp16 rounded once from T).
  using out4 = Kokkos::View<GS****, Kokkos::LayoutStride, memory_space, Unmanaged>;
  using in3 = Kokkos::View<const T***, Kokkos::LayoutStride, memory_space, Unmanaged>;

  static constexpr int BQ = Shape::block_q, BK = Shape::block_k, MR = Shape::micro_rows,
                       NR = Shape::micro_cols;
  static constexpr int NRO = StaticD > 0 ? Shape::micro_cols : Shape::dim_granule;
  static constexpr HostIsa isa = kernel_isa_v<ExecSpace, Shape>;
  static_assert(BK % MR == 0,
                "BlockAttn: backward tile shape: block_k must be a multiple of micro_rows");

  PackedQueries<T, memory_space> qside;  // the packed query side: Q, dO, LSE log2 e, D
  PackedKeys<T, memory_space> kside;     // the packed key side: K^T, V^T panels, K rows
  Mask mask;
  QPos qpos;
  KPos kpos;
  int dim_padded = 0, group = 1, q_tiles = 0, k_tiles = 0, scratch_level = 0;
  bool accumulate = false;  // add to dq / dk / dv instead of overwriting
  T scale = T(1);

  KOKKOS_INLINE_FUNCTION int dp() const { return StaticD > 0 ? StaticD : dim_padded; }

  /// dK, dV of key rows [k0, k0 + k_rows) of kv head hk from the team's
  /// sums dka, dva (rows p apart): scale dK, then write, or add (accumulate).
  KOKKOS_INLINE_FUNCTION void store_key_rows(const member_type& team, const out4& dk,
                                             const out4& dv, int b, int hk, int k0, int k_rows,
                                             const T* dka, const T* dva, int p) const {
    const T sc = scale;
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, k_rows), [&](const int c) {
      if (!accumulate) {  // fp16 rows in vectors (half_rows.hpp)
        store_scaled_row(&dk(b, k0 + c, hk, 0), dk.stride(3), dka + c * p, dim, sc);
        store_scaled_row(&dv(b, k0 + c, hk, 0), dv.stride(3), dva + c * p, dim, T(1));
        return;
      }
      for (int d = 0; d < dim; ++d) {
        const T kval = sc * dka[c * p + d], vval = dva[c * p + d];
        dk(b, k0 + c, hk, d) = GS(T(dk(b, k0 + c, hk, d)) + kval);
        dv(b, k0 + c, hk, d) = GS(T(dv(b, k0 + c, hk, d)) + vval);
      }
    });
  }

  /// Pointers to the packed query tile at row q0 of head h: Q, dO (rows of
  /// dim_padded), LSE in base 2 and D. Rows past the end are zero / -inf.
  struct QueryTile {
    const T *q, *dout, *lse2, *drow;
  };
  KOKKOS_INLINE_FUNCTION QueryTile query_tile(int b, int h, int q0) const {
    return QueryTile{&qside.q(b, h, q0, 0), &qside.dout(b, h, q0, 0), &qside.lse2(b, h, q0),
                     &qside.drow(b, h, q0)};
  }

  /// S = Q K^T into ss and dP = dO V^T into dps, then P into ss and dS into dps.
  /// h: the query head (a score policy's argument).
  KOKKOS_INLINE_FUNCTION void tile_p_ds(const member_type& team, int b, int h, int hk, int kb,
                                        int q0, int q_rows, int k0, int k_rows, TileKind kind,
                                        const T* qs, const T* dos, const T* lse2, const T* dr,
                                        T* ss, T* dps) const {
    const int p = dp();
    const T* const kt_tile = &kside.kt(b, hk, kb, 0, 0);
    const T* const vt_tile = &kside.vt(b, hk, kb, 0, 0);
    Kokkos::parallel_for(
        Kokkos::TeamThreadRange(team, 2 * (BQ / MR) * (BK / NR)), [&](const int t) {
          const int which = t / ((BQ / MR) * (BK / NR)), u = t % ((BQ / MR) * (BK / NR));
          const int r0 = (u / (BK / NR)) * MR, c0 = (u % (BK / NR)) * NR;
          if (which == 0)
            micro_gemm<MR, NR, StaticD, isa>(p, qs + r0 * p, p, kt_tile + c0, BK, ss + r0 * BK + c0,
                                             BK, static_cast<const T*>(nullptr));
          else
            micro_gemm<MR, NR, StaticD, isa>(p, dos + r0 * p, p, vt_tile + c0, BK,
                                             dps + r0 * BK + c0, BK,
                                             static_cast<const T*>(nullptr));
        });
    team.team_barrier();
    const T s2 = scale * log2e<T>;
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, BQ), [&](const int r) {
      T* const srow = ss + r * BK;
      T* const drow_ = dps + r * BK;
      const bool row_live = r < q_rows && lse2[r] != -infinity<T>();
      const T l2 = row_live ? lse2[r] : T(0), d = dr[r];
      if constexpr (has_score_mod_v<Mask>) {
        // A score policy: P = 2^(score(s) log2(e) - LSE2) on the allowed
        // pairs, dS = P (dP - D) score_grad(s), 0 elsewhere; the same three
        // cases as below (every pair, one interval of columns, a select per
        // pair). Two passes: the policy's (its calls may stay scalar: a
        // policy's data read through `this` is reloaded after every store),
        // then P and dS as without a policy (vectorised: fused into one loop
        // with ALiBi, the backward ran at 0.6x the no-policy rate).
        const index_type qp = qpos(q0 + (r < q_rows ? r : 0));
        const T sc = scale;
        T grad[BK];
        auto score_pass = [&](int lo, int hi) {
          score_row(mask, kpos, srow, grad, qp, sc, k0, lo, hi, h);
        };
        auto p_ds_pass = [&](T* __restrict__ sr, T* __restrict__ dr, const T* __restrict__ g,
                             int lo, int hi) {
          for (int c = lo; c < hi; ++c) {
            const T pv = exp2_nonpositive(sr[c] * log2e<T> - l2);
            sr[c] = pv;
            dr[c] = pv * (dr[c] - d) * g[c];
          }
        };
        if (row_live && kind == TileKind::full && k_rows == BK) {
          score_pass(0, BK);
          p_ds_pass(srow, drow_, grad, 0, BK);
          return;
        }
        if constexpr (has_allowed_keys<Mask>::value) {
          const ColumnRange cols = !row_live ? ColumnRange{0, 0}
                                   : kind == TileKind::partial
                                       ? allowed_columns(mask, qp, kpos, k0, k_rows)
                                       : ColumnRange{0, k_rows};
          for (int c = 0; c < cols.lo; ++c) srow[c] = drow_[c] = T(0);
          score_pass(cols.lo, cols.hi);
          p_ds_pass(srow, drow_, grad, cols.lo, cols.hi);
          for (int c = cols.hi; c < BK; ++c) srow[c] = drow_[c] = T(0);
        } else {
          // Every live column through both passes, then the mask as integer
          // selects (masked pairs become exactly 0, whatever they computed).
          using Bits = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
          const impl::RowMask<Mask> allow(mask, qp, row_live && kind == TileKind::partial);
          const int live = row_live ? k_rows : 0;
          score_pass(0, live);
          p_ds_pass(srow, drow_, grad, 0, live);
          for (int c = 0; c < live; ++c) {
            const Bits m = Bits(0) - static_cast<Bits>(allow(kpos(k0 + c)));
            srow[c] = bit_cast<T>(bit_cast<Bits>(srow[c]) & m);
            drow_[c] = bit_cast<T>(bit_cast<Bits>(drow_[c]) & m);
          }
          for (int c = live; c < BK; ++c) srow[c] = drow_[c] = T(0);
        }
        return;
      }
      if (row_live && kind == TileKind::full && k_rows == BK) {
#if BLOCKATTN_SIMD_KERNELS
        if constexpr (simd_exp2_rows<isa, T, BK>()) {
          simd_p_ds_row<simd_for_t<isa>>(srow, drow_, BK, s2, l2, d);
          return;
        }
#endif
        for (int c = 0; c < BK; ++c) {  // every pair allowed: straight, vectorisable
          const T pv = exp2_nonpositive(srow[c] * s2 - l2);
          srow[c] = pv;
          drow_[c] = pv * (drow_[c] - d);
        }
        return;
      }
      if constexpr (has_allowed_keys<Mask>::value) {
        // The row's keys are one interval: P and dS as above on its columns,
        // zero outside.
        const ColumnRange cols = !row_live ? ColumnRange{0, 0}
                                 : kind == TileKind::partial
                                     ? allowed_columns(mask, qpos(q0 + r), kpos, k0, k_rows)
                                     : ColumnRange{0, k_rows};
        for (int c = 0; c < cols.lo; ++c) srow[c] = drow_[c] = T(0);
        for (int c = cols.lo; c < cols.hi; ++c) {
          const T pv = exp2_nonpositive(srow[c] * s2 - l2);
          srow[c] = pv;
          drow_[c] = pv * (drow_[c] - d);
        }
        for (int c = cols.hi; c < BK; ++c) srow[c] = drow_[c] = T(0);
        return;
      }
      // Selects as integer masks (see exp2.hpp): a conditional float
      // computation stays scalar under GCC's default -ftrapping-math.
      using Bits = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
      const impl::RowMask<Mask> allow(mask, qpos(q0 + (r < q_rows ? r : 0)),
                                      row_live && kind == TileKind::partial);
      for (int c = 0; c < BK; ++c) {
        const bool keep = row_live && c < k_rows && allow(kpos(k0 + c));
        const Bits m = Bits(0) - static_cast<Bits>(keep);
        const T pv = bit_cast<T>(bit_cast<Bits>(exp2_nonpositive(srow[c] * s2 - l2)) & m);
        srow[c] = pv;
        drow_[c] = bit_cast<T>(bit_cast<Bits>(pv * (drow_[c] - d)) & m);
      }
    });
    team.team_barrier();
  }

  /// Columns [lo, hi) of a row of S through the score policy: s = score(s
  /// scale), grad = score_grad. The policy and the positions by value, the
  /// rows restrict, so that their data stay in registers (see ForwardKernel::
  /// score_row).
  KOKKOS_FORCEINLINE_FUNCTION static void score_row(const Mask m, const KPos kp, T* __restrict__ s,
                                                    T* __restrict__ grad, index_type qp, T sc,
                                                    int k0, int lo, int hi, int h) {
    for (int c = lo; c < hi; ++c) s[c] = score_and_grad(m, s[c] * sc, qp, kp(k0 + c), h, grad[c]);
  }

  /// True (on every thread of the team) when n values from p hold an inf or NaN.
  KOKKOS_INLINE_FUNCTION static bool has_nonfinite(const member_type& team, const T* p, int n) {
    int bad = 0;
    Kokkos::parallel_reduce(
        Kokkos::TeamThreadRange(team, n),
        [&](const int i, int& acc) { acc += is_nonfinite(p[i]) ? 1 : 0; }, bad);
    return bad > 0;
  }

  /// Which operands of a partial tile pair hold inf / NaN: then P = 0 and
  /// dS = 0 of masked pairs must add nothing (select, not multiply).
  struct Poisoned {
    bool q = false, dout = false, k = false;
  };
  KOKKOS_INLINE_FUNCTION Poisoned poisoned(const member_type& team, TileKind kind, const T* qs,
                                           const T* dos, const T* k_tile) const {
    Poisoned r;
    if (kind != TileKind::partial) return r;
    r.q = qs && has_nonfinite(team, qs, BQ * dp());
    r.dout = dos && has_nonfinite(team, dos, BQ * dp());
    r.k = k_tile && has_nonfinite(team, k_tile, BK * dp());
    return r;
  }

  /// c (MR x NRO, ldc) += A^T B over the BQ rows of a query tile, A (BQ x BK,
  /// query-major, column offset r0) skipping zeros: the select form of
  /// micro_gemm_at for dV += P^T dO and dK += dS^T Q.
  KOKKOS_INLINE_FUNCTION static void select_gemm_at(const T* a, const T* b, int ldb, T* c,
                                                    int ldc) {
    for (int i = 0; i < MR; ++i)
      for (int r = 0; r < BQ; ++r) {
        const T x = a[r * BK + i];
        if (x != T(0))
          for (int j = 0; j < NRO; ++j) c[i * ldc + j] += x * b[r * ldb + j];
      }
  }
  /// c (MR x NRO, ldc) += A B, A (MR x BK) rows of dS skipping zeros: the
  /// select form of micro_gemm for dQ += dS K.
  KOKKOS_INLINE_FUNCTION static void select_gemm(const T* a, const T* b, int ldb, T* c, int ldc) {
    for (int i = 0; i < MR; ++i)
      for (int k = 0; k < BK; ++k) {
        const T x = a[i * BK + k];
        if (x != T(0))
          for (int j = 0; j < NRO; ++j) c[i * ldc + j] += x * b[k * ldb + j];
      }
  }

  /// dQ (BQ, p) += dS (BQ, BK) K (BK, p) on micro tile u of a tile pair (dS
  /// query-major at dps, K rows at k_tile, dQ rows p apart at dq); the select
  /// form where K holds an inf or NaN.
  KOKKOS_INLINE_FUNCTION static void dq_micro_tile(int u, int p, const Poisoned& bad, const T* dps,
                                                   const T* k_tile, T* dq, const T* ones) {
    const int r0 = (u / (p / NRO)) * MR, c0 = (u % (p / NRO)) * NRO;
    if (bad.k)
      select_gemm(dps + r0 * BK, k_tile + c0, p, dq + r0 * p + c0, p);
    else
      micro_gemm<MR, NRO, BK, isa>(BK, dps + r0 * BK, BK, k_tile + c0, p, dq + r0 * p + c0, p,
                                   ones + r0);
  }
  /// Micro tile t of `tiles` x 2 of a tile pair: dV (BK, p) += P^T dO for t <
  /// tiles, else dK (BK, p) += dS^T Q (P at ss, dS at dps, query-major; the
  /// sums rows p apart at dva, dka); the select form where Q / dO holds an
  /// inf or NaN.
  KOKKOS_INLINE_FUNCTION static void dkv_micro_tile(int t, int tiles, int p, const Poisoned& bad,
                                                    const T* ss, const T* dps, const T* qs,
                                                    const T* dos, T* dka, T* dva) {
    const bool dv_side = t < tiles;
    const int u = dv_side ? t : t - tiles;
    const int r0 = (u / (p / NRO)) * MR, c0 = (u % (p / NRO)) * NRO;
    const T* const a = (dv_side ? ss : dps) + r0;
    const T* const b = (dv_side ? dos : qs) + c0;
    T* const c = (dv_side ? dva : dka) + r0 * p + c0;
    if (dv_side ? bad.dout : bad.q)
      select_gemm_at(a, b, p, c, p);
    else
      micro_gemm_at<MR, NRO, BQ, isa>(BQ, a, BK, b, p, c, p);
  }

  KOKKOS_INLINE_FUNCTION TileKind classify(int q0, int q_rows, int k0, int k_rows) const {
    return mask.classify(qpos(q0), qpos(q0 + q_rows - 1) + 1, kpos(k0), kpos(k0 + k_rows - 1) + 1);
  }
};

/// Which gradients a BackwardKernel computes.
enum class BackwardSide { queries, keys };

/// The backward kernels, a team per tile of one side:
///
/// BackwardSide::queries (QueryKernel): dQ of one query tile over all key
/// tiles, a team per (batch, head, query tile).
///
/// BackwardSide::keys (KeyKernel): dK and dV of key tiles of one (batch, kv
/// head) over all query tiles of its GQA group: a team per (batch, kv head,
/// slice) takes the key tiles slice, slice + slices, .. (slices = k_tiles: a
/// team per key tile). With `fused`, dQ too, with 5 tile products per tile
/// pair (S, dP, dV += P^T dO, dK += dS^T Q, dQ += dS K): dQ accumulates in
/// `dqacc` (slices x batch, head, queries_padded, dim_padded; zero on entry,
/// unscaled), which finish_dq() sums over the slices and scales into dq; each
/// slice has its own dQ accumulator (several slices: for fewer (batch, kv
/// head) pairs than threads). Every sum of dK and dV runs in one order (heads,
/// then query tiles ascending, the same micro tiles) whatever the slices and
/// `fused`, and with one slice dQ's runs in QueryKernel's (key tiles
/// ascending): the fused results are bitwise those of the two-kernel path;
/// with several slices dQ adds the slices' partial sums.
template <BackwardSide Side, class ExecSpace, class T, int StaticD, class Shape, class Mask,
          class QPos, class KPos, class GS = T>
struct BackwardKernel : BackwardCommon<ExecSpace, T, StaticD, Shape, Mask, QPos, KPos, GS> {
  using Base = BackwardCommon<ExecSpace, T, StaticD, Shape, Mask, QPos, KPos, GS>;
  using Base::BK;
  using Base::BQ;
  using Base::MR;
  using Base::NRO;
  using typename Base::member_type;
  using typename Base::out4;
  out4 dq;      // queries: (batch, queries, heads, dim)
  out4 dk, dv;  // keys: (batch, keys, kv_heads, dim)
  typename PackedQueries<T, typename Base::memory_space>::row_view dqacc;
  int slices = 1;      // keys: teams per (batch, kv head), each with its own dQ accumulator
  bool fused = false;  // keys: dQ too (into dqacc)

  /// The team's scratch pieces on cache lines (impl/scratch.hpp): S/P and
  /// dP/dS tiles, one accumulator (dQ: BQ rows; dK and dV: BK rows each), and
  /// the ones of dQ's product (queries; the fused keys kernel: with_dq).
  KOKKOS_INLINE_FUNCTION static std::size_t scratch_lines(int dim_padded, bool with_dq) {
    const std::size_t tile = scratch_line_bytes(sizeof(T) * BQ * BK);
    const std::size_t ones = scratch_line_bytes(sizeof(T) * BQ);
    if (Side == BackwardSide::queries)
      return 2 * tile + scratch_line_bytes(sizeof(T) * BQ * dim_padded) + ones;
    return 2 * tile + 2 * scratch_line_bytes(sizeof(T) * BK * dim_padded) + (with_dq ? ones : 0);
  }
  /// Team scratch bytes; with_dq: a fused keys kernel.
  static std::size_t scratch_bytes(int dim_padded, bool with_dq) {
    return scratch_request(scratch_lines(dim_padded, with_dq));
  }

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
    run_in_isa<Base::isa>([&] { run(team); });
  }

  /// One team's work (operator(), inside a function of the shape's ISA).
  KOKKOS_INLINE_FUNCTION void run(const member_type& team) const {
    if constexpr (Side == BackwardSide::queries)
      run_queries(team);
    else
      run_keys(team);
  }

  /// dQ of one query tile over all key tiles.
  KOKKOS_INLINE_FUNCTION void run_queries(const member_type& team) const {
    const int p = this->dp();
    const int league = team.league_rank();
    const int qt = this->q_tiles - 1 - league % this->q_tiles;
    const int h = (league / this->q_tiles) % this->heads;
    const int b = league / (this->q_tiles * this->heads);
    const int hk = h / this->group;
    const int q0 = qt * BQ, q_rows = this->queries - q0 < BQ ? this->queries - q0 : BQ;
    ScratchLines sp(team, this->scratch_level, scratch_lines(p, false));
    T* ss = sp.take<T>(std::size_t(BQ) * BK);
    T* dps = sp.take<T>(std::size_t(BQ) * BK);
    T* dqa = sp.take<T>(std::size_t(BQ) * p);
    T* ones = sp.take<T>(BQ);
    const auto qt_ = this->query_tile(b, h, q0);
    const T *qs = qt_.q, *dos = qt_.dout, *lse2 = qt_.lse2, *dr = qt_.drow;
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, BQ), [&](const int r) {
      ones[r] = T(1);
      for (int d = 0; d < p; ++d) dqa[r * p + d] = T(0);
    });
    team.team_barrier();
    const T* const k_head = &this->kside.k(b, hk, 0, 0);
    for (int kb = 0; kb < this->k_tiles; ++kb) {
      const int k0 = kb * BK, k_rows = this->keys - k0 < BK ? this->keys - k0 : BK;
      const TileKind kind = this->classify(q0, q_rows, k0, k_rows);
      if (kind == TileKind::empty) continue;
      this->tile_p_ds(team, b, h, hk, kb, q0, q_rows, k0, k_rows, kind, qs, dos, lse2, dr, ss, dps);
      // dQ (BQ, p) += dS (BQ, BK) K (BK, p)
      const T* const k_tile = k_head + static_cast<std::ptrdiff_t>(k0) * p;
      const auto bad = this->poisoned(team, kind, nullptr, nullptr, k_tile);
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, (BQ / MR) * (p / NRO)), [&](const int t) {
        Base::dq_micro_tile(t, p, bad, dps, k_tile, dqa, ones);
      });
      team.team_barrier();
    }
    const T sc = this->scale;
    const bool acc = this->accumulate;
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, q_rows), [&](const int r) {
      if (!acc)
        return store_scaled_row(&dq(b, q0 + r, h, 0), dq.stride(3), dqa + r * p, this->dim, sc);
      for (int d = 0; d < this->dim; ++d) {
        const T val = sc * dqa[r * p + d];
        dq(b, q0 + r, h, d) = GS(T(dq(b, q0 + r, h, d)) + val);
      }
    });
  }

  /// dK and dV (and with `fused` dQ) of a team's key tiles.
  KOKKOS_INLINE_FUNCTION void run_keys(const member_type& team) const {
    const int p = this->dp();
    const int slice = team.league_rank() % slices;
    const int pair = team.league_rank() / slices;
    const int hk = pair % this->kv_heads;
    const int b = pair / this->kv_heads;
    ScratchLines sp(team, this->scratch_level, scratch_lines(p, fused));
    T* ss = sp.take<T>(std::size_t(BQ) * BK);
    T* dps = sp.take<T>(std::size_t(BQ) * BK);
    T* dka = sp.take<T>(std::size_t(BK) * p);
    T* dva = sp.take<T>(std::size_t(BK) * p);
    T* ones = fused ? sp.take<T>(BQ) : nullptr;
    if (fused)
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, BQ), [&](const int r) { ones[r] = T(1); });
    const T* const k_head = &this->kside.k(b, hk, 0, 0);
    for (int kb = slice; kb < this->k_tiles; kb += slices) {
      const int k0 = kb * BK, k_rows = this->keys - k0 < BK ? this->keys - k0 : BK;
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, BK * p), [&](const int i) {
        dka[i] = T(0);
        dva[i] = T(0);
      });
      team.team_barrier();
      const T* const k_tile = k_head + static_cast<std::ptrdiff_t>(k0) * p;
      for (int g = 0; g < this->group; ++g) {
        const int h = hk * this->group + g;
        for (int qt = 0; qt < this->q_tiles; ++qt) {
          const int q0 = qt * BQ, q_rows = this->queries - q0 < BQ ? this->queries - q0 : BQ;
          const TileKind kind = this->classify(q0, q_rows, k0, k_rows);
          if (kind == TileKind::empty) continue;
          const auto qt_ = this->query_tile(b, h, q0);
          const T *qs = qt_.q, *dos = qt_.dout;
          this->tile_p_ds(team, b, h, hk, kb, q0, q_rows, k0, k_rows, kind, qs, dos, qt_.lse2,
                          qt_.drow, ss, dps);
          const auto bad = this->poisoned(team, kind, qs, dos, fused ? k_tile : nullptr);
          T* const dq_tile = fused ? &dqacc(slice * this->batch + b, h, q0, 0) : nullptr;
          const int kv_tiles = (BK / MR) * (p / NRO), q_tiles_ = fused ? (BQ / MR) * (p / NRO) : 0;
          Kokkos::parallel_for(
              Kokkos::TeamThreadRange(team, 2 * kv_tiles + q_tiles_), [&](const int t) {
                if (t < 2 * kv_tiles)
                  Base::dkv_micro_tile(t, kv_tiles, p, bad, ss, dps, qs, dos, dka, dva);
                else
                  Base::dq_micro_tile(t - 2 * kv_tiles, p, bad, dps, k_tile, dq_tile, ones);
              });
          team.team_barrier();
        }
      }
      this->store_key_rows(team, dk, dv, b, hk, k0, k_rows, dka, dva, p);
      team.team_barrier();
    }
  }
};

template <class ExecSpace, class T, int StaticD, class Shape, class Mask, class QPos, class KPos,
          class GS = T>
using QueryKernel =
    BackwardKernel<BackwardSide::queries, ExecSpace, T, StaticD, Shape, Mask, QPos, KPos, GS>;
template <class ExecSpace, class T, int StaticD, class Shape, class Mask, class QPos, class KPos,
          class GS = T>
using KeyKernel =
    BackwardKernel<BackwardSide::keys, ExecSpace, T, StaticD, Shape, Mask, QPos, KPos, GS>;

/// dq = [dq +] scale * (sum over the slices of dqacc) on the valid rows (the
/// first `queries` of dq, which may have more) and columns (the fused KeyKernel's dQ;
/// slice s holds rows s * batch .. of dqacc; slices added in ascending order).
template <class ExecSpace, class T, class AccView, class DQV>
void finish_dq(const ExecSpace& exec, const AccView& dqacc, const DQV& dq, int queries, T scale,
               bool accumulate, int slices = 1) {
  using GS = typename DQV::non_const_value_type;
  const int heads = int(dq.extent(2)), dim = int(dq.extent(3)), batch = int(dq.extent(0));
  const std::int64_t rows = std::int64_t(dq.extent(0)) * heads * queries;
  Kokkos::parallel_for(
      "blockattn::backward_finish_dq",
      Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(exec, 0, rows),
      KOKKOS_LAMBDA(const std::int64_t row) {
        const int i = int(row % queries), h = int((row / queries) % heads),
                  b = int(row / (std::int64_t(queries) * heads));
        if (slices == 1 && !accumulate && dqacc.stride(3) == 1)  // fp16 rows: half_rows.hpp
          return store_scaled_row(&dq(b, i, h, 0), dq.stride(3), &dqacc(b, h, i, 0), dim, scale);
        for (int d = 0; d < dim; ++d) {
          T sum = dqacc(b, h, i, d);
          for (int s = 1; s < slices; ++s) sum += dqacc(s * batch + b, h, i, d);
          const T val = scale * sum;
          dq(b, i, h, d) = GS(accumulate ? T(dq(b, i, h, d)) + val : val);
        }
      });
}

}  // namespace blockattn::impl
