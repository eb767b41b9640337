// SPDX-License-Identifier: Apache-2.0
// The kernels of the invariant mode (ForwardOptions::invariant): a row's O
// and LSE as a function of the row's visible keys alone, not of how the keys
// were split into blocks, ranks, steps or calls.
//
//   pass 1 (bounds):  m = max over the visible keys of the base-2 logit s,
//                     b = max over the visible keys of max_d |v_d| (finite)
//   pass 2 (sums):    per canonical key tile (global positions [tT, tT + T)),
//                     its partials l_t = sum p, o_t = sum p v in fp32, keys in
//                     position order, p = 2^(s - m); each added into the row's
//                     folds (kernel/invariant/folds.hpp): exact, order-free
//   finish:           O = sum o_t / sum l_t, LSE = (m + log2 l) ln 2 (the
//                     callers then fold the sinks in as every path does:
//                     apply_sinks, kernel/sinks.hpp)
//
// m and b are maxima (order-free); with m fixed there is no rescaling, so a
// tile's partial depends on the tile's keys alone, and the folds add the
// partials exactly. Every block given to a pass must hold whole tiles (its
// keys of one canonical tile all of the sequence's keys of that tile): the
// callers check it. A tile's own arithmetic runs in one fixed order whatever
// the block, the thread count or the team that computes it: scores as
// sequential dot products over d, partials as sequential sums over the
// tile's keys.
//
// Non-finite values: a NaN logit is left out of m and makes the row's l NaN in
// pass 2; a tile partial that is not finite goes to a separate fp32 sum (nf),
// order-free for inf and NaN; O = (folds + nf) / l.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/kernel/impl/exp2.hpp>
#include <blockattn/kernel/impl/scratch.hpp>
#include <blockattn/kernel/invariant/folds.hpp>
#include <blockattn/kernel/tile_shape.hpp>
#include <blockattn/kernel/validate.hpp>
#include <blockattn/policy/mask.hpp>
#include <blockattn/policy/score.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace blockattn::impl {

/// A row set's invariant state between passes and blocks (batch, heads, rows):
/// m and b of pass 1, the folds (3 per column; columns 0 .. D-1 are O's, D is
/// l's) and the non-finite sums of pass 2.
template <class MemorySpace>
struct InvariantState {
  Kokkos::View<float***, MemorySpace> m, b;
  Kokkos::View<double****, MemorySpace> folds;  // (batch, heads, rows, 3 (D + 1))
  Kokkos::View<float****, MemorySpace> nf;      // (batch, heads, rows, D + 1)
  int dim = 0;

  InvariantState() = default;
  InvariantState(int batch, int heads, index_type rows, int d)
      : m(Kokkos::view_alloc(std::string("blockattn::invariant_m"), Kokkos::WithoutInitializing),
          batch, heads, rows),
        b("blockattn::invariant_b", batch, heads, rows),
        folds("blockattn::invariant_folds", batch, heads, rows, InvariantFolds::folds * (d + 1)),
        nf("blockattn::invariant_nf", batch, heads, rows, d + 1),
        dim(d) {
    Kokkos::deep_copy(m, -infinity<float>());
  }
  index_type rows() const { return index_type(m.extent(2)); }
};

/// The runs of one block's keys: run u is local keys [start(u), start(u) +
/// count(u)), all of one canonical tile.
template <class MemorySpace>
using InvariantRuns = Kokkos::View<int* [2], MemorySpace>;

/// Rows per team and keys per chunk of the invariant kernels (a chunk of
/// keys is loaded and transposed once per team: 32 rows amortise it; at 8
/// the loads took more time than the products).
inline constexpr int invariant_rows = 32;
inline constexpr int invariant_chunk = 16;

/// acc[c] += sum over d in order of a[d] kt[d][c] (kt rows of KC), c < kc:
/// each acc[c] a sequential sum over d, eight d at a time per load and store
/// of acc (one at a time, the store of each partial sum and its reload were
/// a dependency chain that cost more than the products).
KOKKOS_INLINE_FUNCTION void invariant_dots(const float* KOKKOS_RESTRICT a,
                                           const float* KOKKOS_RESTRICT kt,
                                           float* KOKKOS_RESTRICT acc, int D, int kc) {
  constexpr int KC = invariant_chunk;
  int d = 0;
  for (; d + 8 <= D; d += 8) {
    const float* KOKKOS_RESTRICT k0 = kt + d * KC;
    const float a0 = a[d], a1 = a[d + 1], a2 = a[d + 2], a3 = a[d + 3], a4 = a[d + 4],
                a5 = a[d + 5], a6 = a[d + 6], a7 = a[d + 7];
    for (int c = 0; c < kc; ++c) {
      float t = acc[c];
      t += a0 * k0[c];
      t += a1 * k0[KC + c];
      t += a2 * k0[2 * KC + c];
      t += a3 * k0[3 * KC + c];
      t += a4 * k0[4 * KC + c];
      t += a5 * k0[5 * KC + c];
      t += a6 * k0[6 * KC + c];
      t += a7 * k0[7 * KC + c];
      acc[c] = t;
    }
  }
  for (; d < D; ++d) {
    const float ad = a[d];
    for (int c = 0; c < kc; ++c) acc[c] += ad * kt[d * KC + c];
  }
}

/// o[d] += sum over the visible keys c < n, in order, of p[c] v[c][d] (v rows
/// of D), and (Sum) o[D] += the sum of those p: four keys per load and store
/// of o where all four are visible (a masked key is skipped, not multiplied by
/// 0: its value may be inf or NaN).
template <bool Sum>
KOKKOS_INLINE_FUNCTION void invariant_weighted_rows(const float* KOKKOS_RESTRICT p, const char* vis,
                                                    const float* KOKKOS_RESTRICT v,
                                                    float* KOKKOS_RESTRICT o, int D, int n) {
  int c = 0;
  while (c < n) {
    if (c + 4 <= n && vis[c] && vis[c + 1] && vis[c + 2] && vis[c + 3]) {
      const float p0 = p[c], p1 = p[c + 1], p2 = p[c + 2], p3 = p[c + 3];
      const float* KOKKOS_RESTRICT v0 = v + c * D;
      for (int d = 0; d < D; ++d) {
        float t = o[d];
        t += p0 * v0[d];
        t += p1 * v0[D + d];
        t += p2 * v0[2 * D + d];
        t += p3 * v0[3 * D + d];
        o[d] = t;
      }
      if (Sum) {
        float l = o[D];
        l += p0;
        l += p1;
        l += p2;
        l += p3;
        o[D] = l;
      }
      c += 4;
      continue;
    }
    if (vis[c]) {
      const float pc = p[c];
      const float* KOKKOS_RESTRICT vr = v + c * D;
      for (int d = 0; d < D; ++d) o[d] += pc * vr[d];
      if (Sum) o[D] += pc;
    }
    ++c;
  }
}

/// One pass over a block of keys for the rows of q (Pass2 false: bounds;
/// true: sums). Teams of invariant_rows rows of one (batch, head).
template <bool Pass2, class ExecSpace, class QV, class KV, class VV, class Mask, class QP, class KP>
struct InvariantPass {
  using member = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  using mem = typename ExecSpace::memory_space;
  static constexpr int R = invariant_rows, KC = invariant_chunk;
  static constexpr int F = InvariantFolds::folds;

  BlockExtents e;
  QV q;
  KV k;
  VV v;
  Mask mask;
  QP qpos;
  KP kpos;
  float scale = 1.0f;
  InvariantRuns<mem> runs;
  InvariantState<mem> st;
  int state_batch = 0;  // batch b of q is batch state_batch + b of st
  int row_tiles = 0, level = 0;
  int chunk = KC;  // KC, as a run-time value (see the scores)

  /// The team's scratch pieces (one carve: sizes them and takes them).
  template <class Take>
  KOKKOS_INLINE_FUNCTION static void carve(Take& t, int D, float*& qs, float*& kt, float*& vs,
                                           float*& vmax, float*& s, char*& vis, float*& ot,
                                           double*& fo, float*& nf) {
    const int D1 = D + 1;
    qs = t.template take<float>(std::size_t(R) * D);
    kt = t.template take<float>(std::size_t(D) * KC);
    vs = t.template take<float>(std::size_t(KC) * D);
    vmax = t.template take<float>(KC);
    s = t.template take<float>(std::size_t(R) * KC);
    vis = t.template take<char>(std::size_t(R) * KC);
    ot = t.template take<float>(std::size_t(R) * D1);
    fo = t.template take<double>(std::size_t(R) * F * D1);
    nf = t.template take<float>(std::size_t(R) * D1);
  }
  static std::size_t scratch_bytes(int D) {
    ScratchCount c;
    float *a, *b2, *c2, *d2, *e2, *g, *i2;
    char* f;
    double* h;
    carve(c, D, a, b2, c2, d2, e2, f, g, h, i2);
    return scratch_request(c.lines);
  }

  KOKKOS_INLINE_FUNCTION void operator()(const member& team) const {
    const int D = e.dim, D1 = D + 1;
    const int tile = team.league_rank() % row_tiles;
    const int bh = team.league_rank() / row_tiles;
    const int bi = bh / e.heads, h = bh % e.heads;
    const int hk = h / (e.heads / e.kv_heads);
    const int sb = state_batch + bi;
    const int i0 = tile * R;
    const int rows = e.queries - i0 < R ? e.queries - i0 : R;
    ScratchLines sl(team, level, [&] {
      ScratchCount c;
      float *a, *b2, *c2, *d2, *e2, *g, *i2;
      char* f;
      double* hh;
      carve(c, D, a, b2, c2, d2, e2, f, g, hh, i2);
      return c.lines;
    }());
    float *qs, *kt, *vs, *vmax, *s, *ot, *nf;
    char* vis;
    double* fo;
    carve(sl, D, qs, kt, vs, vmax, s, vis, ot, fo, nf);

    // Loads run a row (or key) per thread, its d in order: no division per
    // element (an idiv per value cost more than the arithmetic).
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, R), [&](int r) {
      float* KOKKOS_RESTRICT dst = qs + r * D;
      if (r < rows) {
        const auto* src = &q(bi, i0 + r, h, 0);
        const std::ptrdiff_t st3 = std::ptrdiff_t(q.stride(3));
        for (int d = 0; d < D; ++d) dst[d] = float(src[d * st3]);
      } else {
        for (int d = 0; d < D; ++d) dst[d] = 0.0f;
      }
      if constexpr (Pass2) {
        for (int x = 0; x < F * D1; ++x) fo[r * F * D1 + x] = 0.0;
        for (int d = 0; d < D1; ++d) nf[r * D1 + d] = 0.0f;
      }
    });
    // Row state: pass 1 keeps its maxima in nf's first two columns.
    if constexpr (!Pass2) {
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, R), [&](int r) {
        nf[r * D1] = -infinity<float>();  // m
        nf[r * D1 + 1] = 0.0f;            // b (D >= 1)
      });
    }
    team.team_barrier();
    const index_type qlo = qpos(i0), qhi = qpos(i0 + rows - 1) + 1;
    const int nruns = int(runs.extent(0));
    for (int u = 0; u < nruns; ++u) {
      const int j0 = runs(u, 0), cnt = runs(u, 1);
      if (mask.classify(qlo, qhi, kpos(j0), kpos(j0 + cnt - 1) + 1) == TileKind::empty) continue;
      if constexpr (Pass2) {
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, R), [&](int r) {
          for (int d = 0; d < D1; ++d) ot[r * D1 + d] = 0.0f;
        });
      }
      for (int c0 = 0; c0 < cnt; c0 += KC) {
        const int n = cnt - c0 < KC ? cnt - c0 : KC;
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, KC), [&](int cc) {
          if (cc >= n) {
            for (int d = 0; d < D; ++d) kt[d * KC + cc] = 0.0f;
            return;
          }
          const int j = j0 + c0 + cc;
          const auto* kr = &k(bi, j, hk, 0);
          const auto* vr = &v(bi, j, hk, 0);
          const std::ptrdiff_t ks = std::ptrdiff_t(k.stride(3)), vst = std::ptrdiff_t(v.stride(3));
          for (int d = 0; d < D; ++d) kt[d * KC + cc] = float(kr[d * ks]);
          if constexpr (Pass2) {
            float* KOKKOS_RESTRICT dst = vs + cc * D;
            for (int d = 0; d < D; ++d) dst[d] = float(vr[d * vst]);
          } else {
            float mx = 0.0f;
            for (int d = 0; d < D; ++d) {
              const float a = kmath::fabs(float(vr[d * vst]));
              mx = a > mx && !is_nonfinite(a) ? a : mx;
            }
            vmax[cc] = mx;
          }
        });
        team.team_barrier();
        // Scores: s[r][cc] = sum over d in order of q[r][d] k[cc][d]. The
        // key loop's trip count is the run-time `chunk` (= KC): with a
        // constant one GCC unrolled it and vectorised over d with permutes,
        // 20x slower than these vectors over the keys.
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, rows), [&](int r) {
          float* KOKKOS_RESTRICT sr = s + r * KC;
          const int kc = chunk;
          for (int cc = 0; cc < kc; ++cc) sr[cc] = 0.0f;
          const float* KOKKOS_RESTRICT qr = qs + r * D;
          invariant_dots(qr, kt, sr, D, kc);
          const index_type qp = qpos(i0 + r);
          for (int cc = 0; cc < n; ++cc) {
            const index_type kp = kpos(j0 + c0 + cc);
            const bool ok = mask.allowed(qp, kp);
            vis[r * KC + cc] = ok ? 1 : 0;
            float x = sr[cc] * scale;
            if constexpr (has_score_mod_v<Mask>) x = ok ? mask.score(x, qp, kp, h) : x;
            sr[cc] = x * log2e<float>;
          }
          if constexpr (Pass2) {
            const float m = st.m(sb, h, i0 + r);
            float* KOKKOS_RESTRICT o = ot + r * D1;
            for (int cc = 0; cc < n; ++cc) {
              const float x = sr[cc];
              sr[cc] = x == -infinity<float>() ? 0.0f : exp2_nonpositive(x - m);  // P
            }
            invariant_weighted_rows<true>(sr, vis + r * KC, vs, o, D, n);
          } else {
            float m = nf[r * D1], b = nf[r * D1 + 1];
            for (int cc = 0; cc < n; ++cc) {
              if (!vis[r * KC + cc]) continue;
              m = sr[cc] > m ? sr[cc] : m;  // NaN: left out
              b = vmax[cc] > b ? vmax[cc] : b;
            }
            nf[r * D1] = m;
            nf[r * D1 + 1] = b;
          }
        });
        team.team_barrier();
      }
      if constexpr (Pass2) {
        // The tile's partials into the folds.
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, rows), [&](int r) {
          const int ev = InvariantFolds::exponent_of(st.b(sb, h, i0 + r));
          const int el = InvariantFolds::exponent_of(1.0f);
          double* f = fo + r * F * D1;
          for (int d = 0; d < D1; ++d) {
            const float x = ot[r * D1 + d];
            if (is_nonfinite(x))
              nf[r * D1 + d] += x;
            else
              InvariantFolds::deposit(f + d, D1, double(x), d == D ? el : ev);
          }
        });
        team.team_barrier();
      }
    }
    // Into the state (each row is this team's alone).
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, rows), [&](int r) {
      const int i = i0 + r;
      if constexpr (Pass2) {
        for (int x = 0; x < F * D1; ++x) st.folds(sb, h, i, x) += fo[r * F * D1 + x];
        for (int d = 0; d < D1; ++d) st.nf(sb, h, i, d) += nf[r * D1 + d];
      } else {
        const float m = nf[r * D1], b = nf[r * D1 + 1];
        st.m(sb, h, i) = m > st.m(sb, h, i) ? m : st.m(sb, h, i);
        st.b(sb, h, i) = b > st.b(sb, h, i) ? b : st.b(sb, h, i);
      }
    });
  }
};

/// One pass over a block of keys (k, v at positions kpos; runs: its tiles)
/// for the rows of q at positions qpos.
template <bool Pass2, class ExecSpace, class QV, class KV, class VV, class Mask, class QP, class KP>
void invariant_pass(const ExecSpace& exec, const BlockExtents& e, const QV& q, const KV& k,
                    const VV& v, const Mask& mask, const QP& qpos, const KP& kpos, float scale,
                    const InvariantRuns<typename ExecSpace::memory_space>& runs,
                    const InvariantState<typename ExecSpace::memory_space>& st,
                    int state_batch = 0) {
  if (e.queries <= 0 || runs.extent(0) == 0) return;
  using K = InvariantPass<Pass2, ExecSpace, QV, KV, VV, Mask, QP, KP>;
  K f;
  f.e = e;
  f.q = q;
  f.k = k;
  f.v = v;
  f.mask = mask;
  f.qpos = qpos;
  f.kpos = kpos;
  f.scale = scale;
  f.runs = runs;
  f.st = st;
  f.state_batch = state_batch;
  f.row_tiles = (e.queries + K::R - 1) / K::R;
  const int league = e.batch * e.heads * f.row_tiles;
  Kokkos::TeamPolicy<ExecSpace> policy = is_host_space_v<ExecSpace>
                                             ? Kokkos::TeamPolicy<ExecSpace>(exec, league, 1)
                                             : Kokkos::TeamPolicy<ExecSpace>(exec, league, 32);
  const std::size_t bytes = K::scratch_bytes(e.dim);
  f.level = bytes <= std::size_t(policy.scratch_size_max(0)) ? 0 : 1;
  policy.set_scratch_size(f.level, Kokkos::PerTeam(bytes));
  Kokkos::parallel_for(Pass2 ? "blockattn::invariant_sums" : "blockattn::invariant_bounds", policy,
                       f);
}

/// O and LSE of every row from its state.
template <class ExecSpace, class OV, class LV>
struct InvariantFinish {
  using mem = typename ExecSpace::memory_space;
  using V = typename OV::non_const_value_type;
  using L = typename LV::non_const_value_type;
  InvariantState<mem> st;
  OV o;
  LV lse;
  int heads = 0;

  KOKKOS_INLINE_FUNCTION void operator()(int bh, int i) const {
    const int bi = bh / heads, h = bh % heads, D = st.dim, D1 = D + 1;
    const double* f = &st.folds(bi, h, i, 0);
    const int stride = int(&st.folds(bi, h, i, 1) - f);
    const double l =
        InvariantFolds::value(f + D * stride, D1 * stride) + double(st.nf(bi, h, i, D));
    const double m = double(st.m(bi, h, i));
    double lse_n, scale_o;
    if (l != l) {
      lse_n = l;
      scale_o = l;
    } else if (l == 0.0) {
      lse_n = -infinity<double>();
      scale_o = 0.0;
    } else {
      lse_n = (m + kmath::log2(l)) * ln2<double>;
      scale_o = 1.0 / l;
    }
    for (int d = 0; d < D; ++d) {
      const double x =
          InvariantFolds::value(f + d * stride, D1 * stride) + double(st.nf(bi, h, i, d));
      o(bi, i, h, d) = V(float(scale_o == 0.0 ? 0.0 : x * scale_o));
    }
    lse(bi, h, i) = L(lse_n);
  }
};

template <class ExecSpace, class OV, class LV>
void invariant_finish(const ExecSpace& exec,
                      const InvariantState<typename ExecSpace::memory_space>& st, const OV& o,
                      const LV& lse, int heads) {
  const int batch = int(st.m.extent(0));
  const int rows = int(st.m.extent(2));
  if (rows <= 0 || batch <= 0 || heads <= 0) return;
  InvariantFinish<ExecSpace, OV, LV> f;
  f.st = st;
  f.o = o;
  f.lse = lse;
  f.heads = heads;
  Kokkos::parallel_for(
      "blockattn::invariant_finish",
      Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<2>>(exec, {0, 0}, {batch * heads, rows}), f);
}

}  // namespace blockattn::impl
