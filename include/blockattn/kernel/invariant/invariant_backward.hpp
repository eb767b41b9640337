// SPDX-License-Identifier: Apache-2.0
// The backward of the invariant mode: dQ, dK, dV as functions of the
// sequence alone, not of how its rows and keys were split.
//
//   P = 2^(s - LSE log2 e),  dP = dO V^T,  dS = P o (dP - D) o score_grad,
//   dQ = scale dS K,  dK = scale dS^T Q,  dV = P^T dO,  D = rowsum(dO o O).
//
// dQ sums over keys: canonical key tiles (global positions), each tile's
// partial in fp32 in key order, the partials added exactly into folds
// (kernel/invariant/folds.hpp). dK and dV sum over queries (and over the
// query heads of a kv head): canonical query tiles per head, the same way.
// Each sum's partial depends on its tile alone; the folds' sums are exact;
// the fold exponents come from bounds over the whole sequence (maxima of
// |Q|, |K|, |V|, of dO's row sums of |dO| and of |D|: order-free), so the
// bits do not depend on the split. A tile partial beyond its bound (a score
// policy whose score_grad exceeds 1 in magnitude can do that) is counted and
// the call throws rather than lose exactness.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/kernel/impl/exp2.hpp>
#include <blockattn/kernel/impl/scratch.hpp>
#include <blockattn/kernel/invariant/folds.hpp>
#include <blockattn/kernel/invariant/invariant_forward.hpp>
#include <blockattn/kernel/invariant/invariant_kernel.hpp>
#include <blockattn/kernel/sinks.hpp>
#include <blockattn/kernel/tile_shape.hpp>
#include <blockattn/kernel/validate.hpp>
#include <blockattn/policy/mask.hpp>
#include <blockattn/policy/score.hpp>

#include <algorithm>
#include <cstdint>
#include <type_traits>

namespace blockattn::impl {

/// The maxima the fold exponents come from (finite values only).
struct InvariantGradBounds {
  float q = 0, k = 0, v = 0, do1 = 0, d = 0;
  /// Exponents of dQ's, dK's and dV's folds.
  KOKKOS_INLINE_FUNCTION int e_dq() const { return InvariantFolds::exponent_of(k * (do1 * v + d)); }
  KOKKOS_INLINE_FUNCTION int e_dk() const { return InvariantFolds::exponent_of(q * (do1 * v + d)); }
  KOKKOS_INLINE_FUNCTION int e_dv() const { return InvariantFolds::exponent_of(do1); }
};

/// Gradient folds of a set of rows: (batch, heads, rows, 3 D), and a count
/// of tile partials that exceeded their bound.
template <class MemorySpace>
struct InvariantGrads {
  // A row's columns contiguous (deposit_row_checked), whatever the space's default.
  Kokkos::View<double****, Kokkos::LayoutRight, MemorySpace> folds;
  Kokkos::View<int, MemorySpace> overflow;
  InvariantGrads() = default;
  InvariantGrads(int batch, int heads, index_type rows, int dim)
      : folds("blockattn::invariant_grad_folds", batch, heads, rows, InvariantFolds::folds * dim),
        overflow("blockattn::invariant_overflow") {}
};

/// Adds the tile partials x[d], d < n, to a row of folds f (n columns, fold
/// k at f + k n) with one e: a non-finite one into fold 0 (order-free), one
/// beyond 2^e (the bound) counted instead (returns the count). Branch-free (masks on the bits): the
/// columns run as vectors.
KOKKOS_INLINE_FUNCTION int deposit_row_checked(double* KOKKOS_RESTRICT f,
                                               const float* KOKKOS_RESTRICT x, int n, int e) {
  double* KOKKOS_RESTRICT f1 = f + n;
  double* KOKKOS_RESTRICT f2 = f + 2 * n;
  const double bound = InvariantFolds::pow2(e), m0 = 1.5 * InvariantFolds::pow2(e + 33),
               m1 = 1.5 * InvariantFolds::pow2(e + 13), m2 = 1.5 * InvariantFolds::pow2(e - 7);
  int over = 0;
  for (int d = 0; d < n; ++d) {
    const std::uint32_t u = bit_cast<std::uint32_t>(x[d]);
    const std::uint32_t keep = 0u - std::uint32_t((u & 0x7f800000u) != 0x7f800000u);
    f[d] += double(bit_cast<float>(u & ~keep));  // inf / NaN: the fold non-finite, order-free
    double y = double(bit_cast<float>(u & keep));
    const bool big = !(kmath::fabs(y) < bound);
    over += big ? 1 : 0;
    y *= big ? 0.0 : 1.0;
    double q = (m0 + y) - m0;
    f[d] += q;
    y -= q;
    q = (m1 + y) - m1;
    f1[d] += q;
    y -= q;
    q = (m2 + y) - m2;
    f2[d] += q;
  }
  return over;
}

/// One pass of the backward for a block of rows against a block of keys.
/// KeySide false: dQ of the rows of q (teams of rows, key tiles from
/// `runs`); true: dK, dV of the keys (teams of keys, query tiles from
/// `runs`). lse2: LSE log2 e of the rows; drow: D of the rows.
template <bool KeySide, class ExecSpace, class QV, class DOV, class LV, class DV, class KV,
          class VV, class Mask, class QP, class KP>
struct InvariantGradPass {
  using member = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  using mem = typename ExecSpace::memory_space;
  static constexpr int R = is_host_space_v<ExecSpace> ? invariant_host_rows : invariant_rows;
  static constexpr int C = invariant_chunk;
  static constexpr int RB = is_host_space_v<ExecSpace> ? 4 : 1;  // as InvariantPass
  static constexpr int F = InvariantFolds::folds;

  BlockExtents e;  // queries: rows of q; keys: rows of k
  QV q;
  DOV dout;
  LV lse2;
  DV drow;
  KV k;
  VV v;
  Mask mask;
  QP qpos;
  KP kpos;
  float scale = 1.0f;
  InvariantRuns<mem> runs;
  InvariantGrads<mem> ga, gb;  // dQ (rows side); dK, dV (key side)
  InvariantGradBounds bounds;
  int tiles = 0, level = 0;
  int chunk = C;  // C, as a run-time value

  template <class Take>
  KOKKOS_INLINE_FUNCTION static void carve(Take& t, int D, float*& a, float*& b, float*& at,
                                           float*& bt, float*& ar, float*& br, float*& s,
                                           float*& dp, char*& vis, char*& bad, float*& g1,
                                           float*& g2) {
    a = t.template take<float>(std::size_t(R) * D);   // own rows: q (or k)
    b = t.template take<float>(std::size_t(R) * D);   // own rows: dO (or v)
    at = t.template take<float>(std::size_t(D) * C);  // other rows transposed: k (or q)
    bt = t.template take<float>(std::size_t(D) * C);  // v (or dO)
    ar = t.template take<float>(std::size_t(C) * D);  // other rows: k (or q)
    br = t.template take<float>(std::size_t(C) * D);  // (key side: dO)
    s = t.template take<float>(std::size_t(R) * C);   // then P
    dp = t.template take<float>(std::size_t(R) * C);  // then dS
    vis = t.template take<char>(std::size_t(R) * C);
    bad = t.template take<char>(std::size_t(C));      // the chunk's key: ar or br holds inf / NaN
    g1 = t.template take<float>(std::size_t(R) * D);  // tile partial dQ (or dK)
    g2 = t.template take<float>(std::size_t(R) * D);  // (dV)
  }
  KOKKOS_INLINE_FUNCTION static std::size_t lines(int D) {
    ScratchCount c;
    float *a, *b, *at, *bt, *ar, *br, *s, *dp, *g1, *g2;
    char *vis, *bad;
    carve(c, D, a, b, at, bt, ar, br, s, dp, vis, bad, g1, g2);
    return c.lines;
  }

  /// P and dS of (row i of q, key j) from s = q.k and dp = dO.v.
  KOKKOS_INLINE_FUNCTION void p_ds(float& s, float& dp, index_type qp, index_type kp, int h,
                                   float l2, float d) const {
    float x = s * scale, g = 1.0f;
    if constexpr (has_score_mod_v<Mask>) x = score_and_grad(mask, x, qp, kp, h, g);
    const float s2 = x * log2e<float>;
    const float p = l2 == -infinity<float>() ? 0.0f : exp2_nonpositive(s2 - l2);
    s = p;
    dp = p * (dp - d) * g;
  }

  KOKKOS_INLINE_FUNCTION void operator()(const member& team) const {
    const int D = e.dim;
    const int group = e.heads / e.kv_heads;
    const int tile = team.league_rank() % tiles;
    const int bh = team.league_rank() / tiles;
    // Rows side: (batch, head); key side: (batch, kv head).
    const int nh = KeySide ? e.kv_heads : e.heads;
    const int bi = bh / nh, hh = bh % nh;
    const int own = KeySide ? e.keys : e.queries, other = KeySide ? e.queries : e.keys;
    (void)other;
    const int r0 = tile * R;
    const int rows = own - r0 < R ? own - r0 : R;
    ScratchLines sl(team, level, lines(D));
    float *a, *b, *at, *bt, *ar, *br, *s, *dp, *g1, *g2;
    char *vis, *bad;
    carve(sl, D, a, b, at, bt, ar, br, s, dp, vis, bad, g1, g2);
    // A row per thread, its d in order (no division per element).
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, R), [&](int r) {
      for (int d = 0; d < D; ++d) {
        a[r * D + d] = r >= rows ? 0.0f
                       : KeySide ? float(k(bi, r0 + r, hh, d))
                                 : float(q(bi, r0 + r, hh, d));
        b[r * D + d] = r >= rows ? 0.0f
                       : KeySide ? float(v(bi, r0 + r, hh, d))
                                 : float(dout(bi, r0 + r, hh, d));
      }
    });
    team.team_barrier();
    const index_type own_lo = KeySide ? kpos(r0) : qpos(r0);
    const index_type own_hi = (KeySide ? kpos(r0 + rows - 1) : qpos(r0 + rows - 1)) + 1;
    const int heads_here = KeySide ? group : 1;
    const int nruns = int(runs.extent(0));
    for (int hx = 0; hx < heads_here; ++hx) {
      const int h = KeySide ? hh * group + hx : hh;  // the query head
      const int hk = KeySide ? hh : hh / group;      // the kv head
      for (int u = 0; u < nruns; ++u) {
        const int j0 = runs(u, 0), cnt = runs(u, 1);
        const index_type lo = KeySide ? qpos(j0) : kpos(j0);
        const index_type hi = (KeySide ? qpos(j0 + cnt - 1) : kpos(j0 + cnt - 1)) + 1;
        const TileKind kind =
            KeySide ? mask.classify(lo, hi, own_lo, own_hi) : mask.classify(own_lo, own_hi, lo, hi);
        if (kind == TileKind::empty) continue;
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, R), [&](int r) {
          for (int d = 0; d < D; ++d) g1[r * D + d] = g2[r * D + d] = 0.0f;
        });
        for (int c0 = 0; c0 < cnt; c0 += C) {
          const int n = cnt - c0 < C ? cnt - c0 : C;
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, C), [&](int cc) {
            const int j = j0 + c0 + cc;
            bool nonfinite = false;
            for (int d = 0; d < D; ++d) {
              if (cc >= n) {
                at[d * C + cc] = bt[d * C + cc] = 0.0f;
              } else if (KeySide) {
                const float qv = float(q(bi, j, h, d)), dv = float(dout(bi, j, h, d));
                at[d * C + cc] = qv;
                bt[d * C + cc] = dv;
                ar[cc * D + d] = qv;
                br[cc * D + d] = dv;
                nonfinite = nonfinite || is_nonfinite(qv) || is_nonfinite(dv);
              } else {
                const float kv = float(k(bi, j, hk, d));
                at[d * C + cc] = kv;
                bt[d * C + cc] = float(v(bi, j, hk, d));
                ar[cc * D + d] = kv;
                nonfinite = nonfinite || is_nonfinite(kv);
              }
            }
            bad[cc] = nonfinite ? 1 : 0;
          });
          team.team_barrier();
          // RB rows at a time (rows past `rows` are zeros, their keys masked).
          Kokkos::parallel_for(Kokkos::TeamThreadRange(team, (rows + RB - 1) / RB), [&](int grp) {
            const int rg = grp * RB, kc = chunk;  // C at run time (see the forward's scores)
            for (int x = 0; x < RB * C; ++x) s[rg * C + x] = dp[rg * C + x] = 0.0f;
            // s = q.k and dp = dO.v, each a sequential sum over d (key side:
            // a = k, b = v against at = q, bt = dO; the same products).
            invariant_dots<RB>(a + rg * D, at, s + rg * C, D, kc);
            invariant_dots<RB>(b + rg * D, bt, dp + rg * C, D, kc);
            // The chunk's rows all finite: every key's product is added (P
            // and dS are 0 at masked keys, which adds nothing then).
            bool finite = true;
            for (int cc = 0; cc < n && finite; ++cc) finite = !bad[cc];
            for (int r = rg; r < rg + RB; ++r) {
              float* sr = s + r * C;
              float* pr = dp + r * C;
              for (int cc = 0; cc < n; ++cc) {
                const int i = KeySide ? j0 + c0 + cc : r0 + r;  // the query row
                const int j = KeySide ? r0 + r : j0 + c0 + cc;  // the key row
                const bool ok = r < rows && mask.allowed(qpos(i), kpos(j));
                vis[r * C + cc] = ok ? 1 : 0;
                if (ok)
                  p_ds(sr[cc], pr[cc], qpos(i), kpos(j), h, lse2(bi, h, i), drow(bi, h, i));
                else
                  sr[cc] = pr[cc] = 0.0f;
              }
              if (!finite) {
                invariant_weighted_rows<false>(pr, vis + r * C, ar, g1 + r * D, D, n);  // dS k (q)
                if (KeySide) invariant_weighted_rows<false>(sr, vis + r * C, br, g2 + r * D, D, n);
              }
            }
            if (finite) {
              invariant_weighted_block<RB, false>(dp + rg * C, ar, g1 + rg * D, D, n);
              if (KeySide) invariant_weighted_block<RB, false>(s + rg * C, br, g2 + rg * D, D, n);
            }
          });
          team.team_barrier();
        }
        // The tile's partials into the rows' folds (each row is this
        // team's alone).
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, rows), [&](int r) {
          const int e1 = KeySide ? bounds.e_dk() : bounds.e_dq(), e2 = bounds.e_dv();
          int over = deposit_row_checked(&ga.folds(bi, hh, r0 + r, 0), g1 + r * D, D, e1);
          if (KeySide) over += deposit_row_checked(&gb.folds(bi, hh, r0 + r, 0), g2 + r * D, D, e2);
          if (over > 0) Kokkos::atomic_add(&ga.overflow(), over);
        });
        team.team_barrier();
      }
    }
  }
};

/// One backward pass (see InvariantGradPass): rows side (KeySide false) adds
/// dQ folds of q's rows into ga; key side adds dK into ga and dV into gb.
template <bool KeySide, class ExecSpace, class QV, class DOV, class LV, class DV, class KV,
          class VV, class Mask, class QP, class KP>
void invariant_grad_pass(const ExecSpace& exec, const BlockExtents& e, const QV& q, const DOV& dout,
                         const LV& lse2, const DV& drow, const KV& k, const VV& v, const Mask& mask,
                         const QP& qpos, const KP& kpos, float scale,
                         const InvariantRuns<typename ExecSpace::memory_space>& runs,
                         const InvariantGradBounds& bounds,
                         const InvariantGrads<typename ExecSpace::memory_space>& ga,
                         const InvariantGrads<typename ExecSpace::memory_space>& gb) {
  const int own = KeySide ? e.keys : e.queries;
  if (own <= 0 || runs.extent(0) == 0) return;
  using K = InvariantGradPass<KeySide, ExecSpace, QV, DOV, LV, DV, KV, VV, Mask, QP, KP>;
  K f;
  f.e = e;
  f.q = q;
  f.dout = dout;
  f.lse2 = lse2;
  f.drow = drow;
  f.k = k;
  f.v = v;
  f.mask = mask;
  f.qpos = qpos;
  f.kpos = kpos;
  f.scale = scale;
  f.runs = runs;
  f.ga = ga;
  f.gb = gb;
  f.bounds = bounds;
  f.tiles = (own + K::R - 1) / K::R;
  const int league = e.batch * (KeySide ? e.kv_heads : e.heads) * f.tiles;
  Kokkos::TeamPolicy<ExecSpace> policy = is_host_space_v<ExecSpace>
                                             ? Kokkos::TeamPolicy<ExecSpace>(exec, league, 1)
                                             : Kokkos::TeamPolicy<ExecSpace>(exec, league, 32);
  const std::size_t bytes = scratch_request(K::lines(e.dim));
  f.level = bytes <= std::size_t(policy.scratch_size_max(0)) ? 0 : 1;
  policy.set_scratch_size(f.level, Kokkos::PerTeam(bytes));
  Kokkos::parallel_for(KeySide ? "blockattn::invariant_dkdv" : "blockattn::invariant_dq", policy,
                       f);
}

}  // namespace blockattn::impl

namespace blockattn::impl {

/// D = rowsum(dO o O) in fp32 (sequential over d) and LSE log2 e, of every
/// row: (batch, heads, rows).
template <class ExecSpace, class OV, class DOV, class LV, class RV>
void invariant_row_terms(const ExecSpace& exec, const OV& o, const DOV& dout, const LV& lse,
                         const RV& drow, const RV& lse2) {
  const int B = int(o.extent(0)), N = int(o.extent(1)), H = int(o.extent(2)), D = int(o.extent(3));
  if (B * N * H == 0) return;
  Kokkos::parallel_for(
      "blockattn::invariant_rows",
      Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<3>>(exec, {0, 0, 0}, {B, H, N}),
      KOKKOS_LAMBDA(int b, int h, int i) {
        float s = 0.0f;
        for (int d = 0; d < D; ++d) s += float(dout(b, i, h, d)) * float(o(b, i, h, d));
        drow(b, h, i) = s;
        lse2(b, h, i) = float(lse(b, h, i)) * log2e<float>;
      });
}

/// max |x| over the finite entries of a rank-4 View (rows = true: the
/// largest row sum of |x| over the last extent, as dO's bound).
template <class ExecSpace, class X>
float invariant_max_abs(const ExecSpace& exec, const X& x, bool rows = false) {
  const std::int64_t n0 = x.extent(0), n1 = x.extent(1), n2 = x.extent(2), n3 = x.extent(3);
  const std::int64_t n = n0 * n1 * n2 * (rows ? 1 : n3);
  float m = 0.0f;
  if (n == 0) return m;
  Kokkos::parallel_reduce(
      "blockattn::invariant_bound",
      Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(exec, 0, n),
      KOKKOS_LAMBDA(const std::int64_t t, float& acc) {
        float a = 0.0f;
        if (rows) {
          const std::int64_t i2 = t % n2, i1 = (t / n2) % n1, i0 = t / (n1 * n2);
          for (std::int64_t d = 0; d < n3; ++d) {
            const float y = kmath::fabs(float(x(i0, i1, i2, d)));
            a += is_nonfinite(y) ? 0.0f : y;
          }
        } else {
          const std::int64_t i3 = t % n3, i2 = (t / n3) % n2, i1 = (t / (n2 * n3)) % n1,
                             i0 = t / (n1 * n2 * n3);
          const float y = kmath::fabs(float(x(i0, i1, i2, i3)));
          a = is_nonfinite(y) ? 0.0f : y;
        }
        acc = a > acc ? a : acc;
      },
      Kokkos::Max<float>(m));
  return m;
}

/// The local maxima of a backward call (q, k, v, dO and the rows' D).
template <class ExecSpace, class QV, class KV, class VV, class DOV, class RV>
InvariantGradBounds invariant_local_bounds(const ExecSpace& exec, const QV& q, const KV& k,
                                           const VV& v, const DOV& dout, const RV& drow) {
  InvariantGradBounds b;
  b.q = invariant_max_abs(exec, q);
  b.k = invariant_max_abs(exec, k);
  b.v = invariant_max_abs(exec, v);
  b.do1 = invariant_max_abs(exec, dout, true);
  const auto d4 = Kokkos::View<const float****, typename RV::memory_space,
                               Kokkos::MemoryTraits<Kokkos::Unmanaged>>(
      drow.data(), drow.extent(0), drow.extent(1), drow.extent(2), 1);
  b.d = invariant_max_abs(exec, d4);
  return b;
}

/// g = factor * (the folds' value) for every (batch, row, head, d).
template <class ExecSpace, class GV>
void invariant_grad_finish(const ExecSpace& exec,
                           const InvariantGrads<typename ExecSpace::memory_space>& src, const GV& g,
                           double factor) {
  const int B = int(g.extent(0)), N = int(g.extent(1)), H = int(g.extent(2)), D = int(g.extent(3));
  if (B * N * H == 0) return;
  using G = typename GV::non_const_value_type;
  const auto folds = src.folds;
  Kokkos::parallel_for(
      "blockattn::invariant_grad_finish",
      Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<3>>(exec, {0, 0, 0}, {B, H, N}),
      KOKKOS_LAMBDA(int b, int h, int i) {
        const double* f = &folds(b, h, i, 0);
        const int stride = int(&folds(b, h, i, 1) - f);
        for (int d = 0; d < D; ++d)
          g(b, i, h, d) = G(float(factor * InvariantFolds::value(f + d * stride, D * stride)));
      });
}

/// dL/dsink[h] = - sum over rows of e^(sink[h] - LSE) D, into per-head
/// folds (heads, 3): each row's term added exactly (atomics of exact adds:
/// order-free). e: the exponent of the largest |D|.
template <class ExecSpace, class LV, class RV, class FV>
void invariant_sink_terms(const ExecSpace& exec, const SinkLogits& sinks, const LV& lse,
                          const RV& drow, const FV& folds, int e) {
  const int B = int(lse.extent(0)), H = int(lse.extent(1)), N = int(lse.extent(2));
  if (B * N * H == 0) return;
  const auto sk = sink_view<typename ExecSpace::memory_space>(sinks.data(), sinks.extent(0));
  Kokkos::parallel_for(
      "blockattn::invariant_sink_terms",
      Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<3>>(exec, {0, 0, 0}, {B, H, N}),
      KOKKOS_LAMBDA(int b, int h, int i) {
        const float t = -kmath::exp(sk(h) - float(lse(b, h, i))) * drow(b, h, i);
        if (is_nonfinite(t)) {
          Kokkos::atomic_add(&folds(h, 0), double(t));
          return;
        }
        double x = t, m = 1.5 * InvariantFolds::pow2(e + 33), q = (m + x) - m;
        Kokkos::atomic_add(&folds(h, 0), q);
        x -= q;
        m = 1.5 * InvariantFolds::pow2(e + 13);
        q = (m + x) - m;
        Kokkos::atomic_add(&folds(h, 1), q);
        x -= q;
        m = 1.5 * InvariantFolds::pow2(e - 7);
        q = (m + x) - m;
        Kokkos::atomic_add(&folds(h, 2), q);
      });
}

/// The sink folds' values into sink_grad (fp32 per head).
template <class ExecSpace, class FV>
void invariant_sink_finish(const ExecSpace& exec, const FV& folds, const SinkGradient& out) {
  const int H = int(folds.extent(0));
  const auto o = out;
  Kokkos::parallel_for(
      "blockattn::invariant_sink_finish", Kokkos::RangePolicy<ExecSpace>(exec, 0, H),
      KOKKOS_LAMBDA(int h) { o(h) = float(folds(h, 0) + (folds(h, 1) + folds(h, 2))); });
}

/// The overflow counts of a call's gradient folds (host).
template <class MemorySpace>
int invariant_overflows(const InvariantGrads<MemorySpace>& g) {
  int n = 0;
  Kokkos::deep_copy(n, g.overflow);
  return n;
}

inline void fail_invariant_overflow(const char* fn, long count) {
  fail(fn, "the invariant backward: ", count,
       " tile partial(s) exceeded the bound their exact sums were sized for (|Q|, |K|, |V|, "
       "dO's row sums and |D|, with |score_grad| <= 1); a score policy whose score_grad "
       "exceeds 1 in magnitude is not supported by the invariant backward");
}

/// attention_backward with options.invariant (after its checks).
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV, class DOV, class DQV,
          class DKV, class DVV, class Mask, class QP, class KP>
void invariant_backward(const char* fn, const ExecSpace& exec, const BlockExtents& e, const QV& q,
                        const KV& k, const VV& v, const OV& o, const LV& lse, const DOV& dout,
                        const DQV& dq, const DKV& dk, const DVV& dv, const Mask& mask,
                        const QP& qpos, const KP& kpos, float scale, const ForwardOptions& opts) {
  using V = typename OV::non_const_value_type;
  using mem = typename ExecSpace::memory_space;
  check_invariant<V>(fn, opts.invariant_tile, std::max(e.keys, e.queries));
  Kokkos::View<float***, mem> drow("blockattn::invariant_d", e.batch, e.heads, e.queries),
      lse2("blockattn::invariant_lse2", e.batch, e.heads, e.queries);
  invariant_row_terms(exec, o, dout, lse, drow, lse2);
  const InvariantGradBounds bounds = invariant_local_bounds(exec, q, k, v, dout, drow);
  InvariantGrads<mem> gq(e.batch, e.heads, e.queries, e.dim),
      gk(e.batch, e.kv_heads, e.keys, e.dim), gv(e.batch, e.kv_heads, e.keys, e.dim);
  const auto key_runs =
      invariant_runs_view(exec, invariant_runs(kpos, e.keys, opts.invariant_tile));
  const auto q_runs =
      invariant_runs_view(exec, invariant_runs(qpos, e.queries, opts.invariant_tile));
  invariant_grad_pass<false>(exec, e, q, dout, lse2, drow, k, v, mask, qpos, kpos, scale, key_runs,
                             bounds, gq, gq);
  invariant_grad_pass<true>(exec, e, q, dout, lse2, drow, k, v, mask, qpos, kpos, scale, q_runs,
                            bounds, gk, gv);
  exec.fence();
  const int over = invariant_overflows(gq) + invariant_overflows(gk);
  if (over > 0) fail_invariant_overflow(fn, over);
  invariant_grad_finish(exec, gq, dq, double(scale));
  invariant_grad_finish(exec, gk, dk, double(scale));
  invariant_grad_finish(exec, gv, dv, 1.0);
  if (opts.sink_grad.data() != nullptr) {
    Kokkos::View<double**, mem> sf("blockattn::invariant_sink_folds", e.heads, 3);
    invariant_sink_terms(exec, opts.sinks, lse, drow, sf, InvariantFolds::exponent_of(bounds.d));
    invariant_sink_finish(exec, sf, opts.sink_grad);
  }
  exec.fence();
}

}  // namespace blockattn::impl
