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
  // A row's columns contiguous (deposit_row), whatever the space's default layout.
  Kokkos::View<double****, Kokkos::LayoutRight, MemorySpace>
      folds;                                                     // (batch, heads, rows, 3 (D + 1))
  Kokkos::View<float****, Kokkos::LayoutRight, MemorySpace> nf;  // (batch, heads, rows, D + 1)
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
/// Rows per team on host spaces: the chunk's loads (a transpose of K and
/// V's rows) amortised over more rows (32: about half the pass's time).
inline constexpr int invariant_host_rows = 128;
inline constexpr int invariant_chunk = 16;

/// acc_r[c] += sum over d in order of a_r[d] kt[d][c] (kt rows of KC), for
/// RB rows r (a_r = a + r D, acc_r = acc + r KC) and c < kc: each acc_r[c] a
/// sequential sum over d, eight d at a time per load and store of acc, the
/// RB rows' chains side by side (one row's eight dependent additions per
/// store were latency-bound: 8 flops per cycle; one at a time, the store of
/// each partial sum and its reload were a chain that cost more than the
/// products). A row's sums do not depend on RB or on the other rows.
template <int RB>
KOKKOS_INLINE_FUNCTION void invariant_dots(const float* KOKKOS_RESTRICT a,
                                           const float* KOKKOS_RESTRICT kt,
                                           float* KOKKOS_RESTRICT acc, int D, int kc) {
  constexpr int KC = invariant_chunk;
  int d = 0;
  for (; d + 8 <= D; d += 8) {
    const float* KOKKOS_RESTRICT k0 = kt + d * KC;
    float x[RB][8];
    for (int r = 0; r < RB; ++r)
      for (int i = 0; i < 8; ++i) x[r][i] = a[r * D + d + i];
    for (int c = 0; c < kc; ++c) {
      const float k0c = k0[c], k1c = k0[KC + c], k2c = k0[2 * KC + c], k3c = k0[3 * KC + c],
                  k4c = k0[4 * KC + c], k5c = k0[5 * KC + c], k6c = k0[6 * KC + c],
                  k7c = k0[7 * KC + c];
      for (int r = 0; r < RB; ++r) {
        float t = acc[r * KC + c];
        t += x[r][0] * k0c;
        t += x[r][1] * k1c;
        t += x[r][2] * k2c;
        t += x[r][3] * k3c;
        t += x[r][4] * k4c;
        t += x[r][5] * k5c;
        t += x[r][6] * k6c;
        t += x[r][7] * k7c;
        acc[r * KC + c] = t;
      }
    }
  }
  for (; d < D; ++d)
    for (int r = 0; r < RB; ++r) {
      const float ad = a[r * D + d];
      for (int c = 0; c < kc; ++c) acc[r * KC + c] += ad * kt[d * KC + c];
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

/// o_r[d] += sum over the keys c < n, in order, of p_r[c] v[c][d], and (Sum)
/// o_r[D] += sum of p_r[c], for RB rows r (p_r = p + r KC, o_r = o + r (D +
/// Sum)): every key, four per load and store of o. For V rows that are all
/// finite and P = 0 at masked keys, the same sums (and bits) as
/// invariant_weighted_rows, which skips them (0 v adds nothing to a sum
/// that starts at +0).
template <int RB, bool Sum = true>
KOKKOS_INLINE_FUNCTION void invariant_weighted_block(const float* KOKKOS_RESTRICT p,
                                                     const float* KOKKOS_RESTRICT v,
                                                     float* KOKKOS_RESTRICT o, int D, int n) {
  constexpr int KC = invariant_chunk;
  const int D1 = Sum ? D + 1 : D;
  int c = 0;
  for (; c + 4 <= n; c += 4) {
    const float* KOKKOS_RESTRICT v0 = v + c * D;
    for (int r = 0; r < RB; ++r) {
      const float p0 = p[r * KC + c], p1 = p[r * KC + c + 1], p2 = p[r * KC + c + 2],
                  p3 = p[r * KC + c + 3];
      float* KOKKOS_RESTRICT orow = o + r * D1;
      for (int d = 0; d < D; ++d) {
        float t = orow[d];
        t += p0 * v0[d];
        t += p1 * v0[D + d];
        t += p2 * v0[2 * D + d];
        t += p3 * v0[3 * D + d];
        orow[d] = t;
      }
      if (Sum) {
        float l = orow[D];
        l += p0;
        l += p1;
        l += p2;
        l += p3;
        orow[D] = l;
      }
    }
  }
  for (; c < n; ++c)
    for (int r = 0; r < RB; ++r) {
      const float pc = p[r * KC + c];
      float* KOKKOS_RESTRICT orow = o + r * D1;
      for (int d = 0; d < D; ++d) orow[d] += pc * v[c * D + d];
      if (Sum) orow[D] += pc;
    }
}

/// One pass over a block of keys for the rows of q (Pass2 false: bounds;
/// true: sums). Teams of invariant_rows rows of one (batch, head).
template <bool Pass2, class ExecSpace, class QV, class KV, class VV, class Mask, class QP, class KP>
struct InvariantPass {
  using member = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  using mem = typename ExecSpace::memory_space;
  static constexpr int R = is_host_space_v<ExecSpace> ? invariant_host_rows : invariant_rows;
  static constexpr int KC = invariant_chunk;
  // Rows per thread and step of the products: four on host spaces (their
  // chains side by side), one on devices (a row per thread).
  static constexpr int RB = is_host_space_v<ExecSpace> ? 4 : 1;
  static_assert(R % 4 == 0, "invariant_rows: a multiple of the host's row blocks");
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
  /// (Pass 2 adds into the state's folds and non-finite sums directly: each
  /// row is one team's.)
  template <class Take>
  KOKKOS_INLINE_FUNCTION static void carve(Take& t, int D, float*& qs, float*& kt, float*& vs,
                                           float*& vmax, float*& s, char*& vis, float*& ot,
                                           float*& mb) {
    qs = t.template take<float>(std::size_t(R) * D);
    kt = t.template take<float>(std::size_t(D) * KC);
    vs = t.template take<float>(std::size_t(KC) * D);
    vmax = t.template take<float>(KC);
    s = t.template take<float>(std::size_t(R) * KC);
    vis = t.template take<char>(std::size_t(R) * KC);
    ot = t.template take<float>(Pass2 ? std::size_t(R) * (D + 1) : 0);
    mb = t.template take<float>(Pass2 ? 0 : std::size_t(R) * 2);  // pass 1: m, b of each row
  }
  KOKKOS_INLINE_FUNCTION static std::size_t lines(int D) {
    ScratchCount c;
    float *a, *b2, *c2, *d2, *e2, *g, *i2;
    char* f;
    carve(c, D, a, b2, c2, d2, e2, f, g, i2);
    return c.lines;
  }
  static std::size_t scratch_bytes(int D) { return scratch_request(lines(D)); }

  KOKKOS_INLINE_FUNCTION void operator()(const member& team) const {
    const int D = e.dim, D1 = D + 1;
    const int tile = team.league_rank() % row_tiles;
    const int bh = team.league_rank() / row_tiles;
    const int bi = bh / e.heads, h = bh % e.heads;
    const int hk = h / (e.heads / e.kv_heads);
    const int sb = state_batch + bi;
    const int i0 = tile * R;
    const int rows = e.queries - i0 < R ? e.queries - i0 : R;
    ScratchLines sl(team, level, lines(D));
    float *qs, *kt, *vs, *vmax, *s, *ot, *mb;
    char* vis;
    carve(sl, D, qs, kt, vs, vmax, s, vis, ot, mb);

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
      if constexpr (!Pass2) {
        mb[2 * r] = -infinity<float>();  // m
        mb[2 * r + 1] = 0.0f;            // b
      }
    });
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
            bool bad = false;
            for (int d = 0; d < D; ++d) {
              dst[d] = float(vr[d * vst]);
              bad = bad || is_nonfinite(dst[d]);
            }
            vmax[cc] = bad ? 1.0f : 0.0f;  // pass 2: whether the V row holds inf or NaN
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
        // Scores: s[r][cc] = sum over d in order of q[r][d] k[cc][d], RB
        // rows at a time (the rows past `rows` are zeros; their keys are
        // masked). The key loop's trip count is the run-time `chunk` (= KC):
        // with a constant one GCC unrolled it and vectorised over d with
        // permutes, 20x slower than these vectors over the keys.
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, (rows + RB - 1) / RB), [&](int g) {
          const int r0 = g * RB, kc = chunk;
          for (int x = 0; x < RB * KC; ++x) s[r0 * KC + x] = 0.0f;
          invariant_dots<RB>(qs + r0 * D, kt, s + r0 * KC, D, kc);
          // V finite in the whole chunk: every key's P V is added (a masked
          // key's P is 0, which adds nothing then), for RB rows at once.
          bool finite = Pass2;
          for (int cc = 0; cc < n && finite; ++cc) finite = vmax[cc] == 0.0f;
          for (int r = r0; r < r0 + RB; ++r) {
            float* KOKKOS_RESTRICT sr = s + r * KC;
            char* vr = vis + r * KC;
            if (r >= rows) {
              for (int cc = 0; cc < KC; ++cc) {
                vr[cc] = 0;
                sr[cc] = 0.0f;
              }
              continue;
            }
            const index_type qp = qpos(i0 + r);
            for (int cc = 0; cc < n; ++cc) {
              const index_type kp = kpos(j0 + c0 + cc);
              const bool ok = mask.allowed(qp, kp);
              vr[cc] = ok ? 1 : 0;
              float x = sr[cc] * scale;
              if constexpr (has_score_mod_v<Mask>) x = ok ? mask.score(x, qp, kp, h) : x;
              sr[cc] = x * log2e<float>;
            }
            if constexpr (Pass2) {
              // P = 2^(s - m), 0 at masked keys and at s = -inf: computed for
              // every key and masked on the bits (no branch: vectors).
              const float m = st.m(sb, h, i0 + r);
              for (int cc = 0; cc < n; ++cc) {
                const float x = sr[cc];
                const std::uint32_t keep =
                    0u - std::uint32_t((vr[cc] != 0) & (bit_cast<std::uint32_t>(x) != 0xff800000u));
                sr[cc] = bit_cast<float>(bit_cast<std::uint32_t>(exp2_nonpositive(x - m)) & keep);
              }
              if (!finite) invariant_weighted_rows<true>(sr, vr, vs, ot + r * D1, D, n);
            } else {
              float m = mb[2 * r], b = mb[2 * r + 1];
              for (int cc = 0; cc < n; ++cc) {
                if (!vr[cc]) continue;
                m = sr[cc] > m ? sr[cc] : m;  // NaN: left out
                b = vmax[cc] > b ? vmax[cc] : b;
              }
              mb[2 * r] = m;
              mb[2 * r + 1] = b;
            }
          }
          if constexpr (Pass2)
            if (finite) invariant_weighted_block<RB>(s + r0 * KC, vs, ot + r0 * D1, D, n);
        });
        team.team_barrier();
      }
      if constexpr (Pass2) {
        // The tile's partials into the row's folds (non-finite ones into its
        // fp32 sums instead; 0 into the folds then, which adds nothing).
        Kokkos::parallel_for(Kokkos::TeamThreadRange(team, rows), [&](int r) {
          const int i = i0 + r;
          double* KOKKOS_RESTRICT f = &st.folds(sb, h, i, 0);
          float* KOKKOS_RESTRICT nfr = &st.nf(sb, h, i, 0);
          const float* KOKKOS_RESTRICT o = ot + r * D1;
          InvariantFolds::deposit_row(f, nfr, o, D, InvariantFolds::exponent_of(st.b(sb, h, i)));
          const float l = o[D];
          if (is_nonfinite(l))
            nfr[D] += l;
          else
            InvariantFolds::deposit(f + D, D1, double(l), InvariantFolds::exponent_of(1.0f));
        });
        team.team_barrier();
      }
    }
    if constexpr (!Pass2) {  // the bounds into the state (each row is this team's alone)
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, rows), [&](int r) {
        const int i = i0 + r;
        const float m = mb[2 * r], b = mb[2 * r + 1];
        st.m(sb, h, i) = m > st.m(sb, h, i) ? m : st.m(sb, h, i);
        st.b(sb, h, i) = b > st.b(sb, h, i) ? b : st.b(sb, h, i);
      });
    }
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
