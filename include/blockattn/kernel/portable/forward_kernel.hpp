// SPDX-License-Identifier: Apache-2.0
// The block kernel: one team per (batch, head, query tile) loops over the key
// tiles of one packed K/V block and owns the online-softmax state of its rows.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/kernel/host/amx.hpp>
#include <blockattn/kernel/impl/exp2.hpp>
#include <blockattn/kernel/impl/half_rows.hpp>
#include <blockattn/kernel/impl/mask_columns.hpp>
#include <blockattn/kernel/impl/pack.hpp>
#include <blockattn/kernel/impl/prefetch.hpp>
#include <blockattn/kernel/impl/scratch.hpp>
#include <blockattn/kernel/impl/softmax_state.hpp>
#include <blockattn/kernel/portable/forward_tiles.hpp>
#include <blockattn/kernel/portable/micro_gemm.hpp>
#include <blockattn/kernel/tile_shape.hpp>
#include <blockattn/kernel/validate.hpp>
#include <blockattn/policy/mask.hpp>
#include <blockattn/policy/score.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace blockattn::impl {

/// The functor. StaticD > 0 fixes the (padded) head dim at compile time.
/// T is the compute type (fp32 for bf16/fp16 storage); QS and OS are the
/// storage types of q and o. The unnormalised O between calls (resume /
/// !finish) lives in `o_acc`, of type T: the caller's o when OS is T.
///
/// Loop nest of one team (see include/blockattn/README.md):
///   for key tile j in block            <- operator()    (skips empty tiles)
///     S = Q_i K_j^T                    <- micro_gemm    (register tiles)
///     online softmax on rows of S      <- softmax_rows  (mask on partial tiles)
///     O_i = diag(alpha) O_i + P V_j    <- micro_gemm
template <class ExecSpace, class T, int StaticD, class Shape, class Mask, class QPos, class KPos,
          class QS = T, class OS = T>
struct ForwardKernel {
  using memory_space = typename ExecSpace::memory_space;
  using policy_type = Kokkos::TeamPolicy<ExecSpace, Kokkos::Schedule<Kokkos::Dynamic>>;
  using member_type = typename policy_type::member_type;
  using in_view = Kokkos::View<const QS****, Kokkos::LayoutStride, memory_space,
                               Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  using out_view = Kokkos::View<OS****, Kokkos::LayoutStride, memory_space,
                                Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  using acc_view = Kokkos::View<T****, Kokkos::LayoutStride, memory_space,
                                Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  using lse_view = Kokkos::View<T***, Kokkos::LayoutStride, memory_space,
                                Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  using kt_view = typename PackedKV<T, memory_space>::kt_view;
  using v_view = typename PackedKV<T, memory_space>::v_view;

  using Gemm = typename Shape::tile_gemm;
  static constexpr HostIsa isa = kernel_isa_v<ExecSpace, Shape>;
  static constexpr int BQ = Shape::block_q;
  static constexpr int BK = Shape::block_k;
  static constexpr int MR = Shape::micro_rows;
  static constexpr int NR = Shape::micro_cols;
  // Width of the P*V micro tile: the full micro tile for the compile-time head
  // dims, one granule otherwise (the padded dim is a multiple of it).
  static constexpr int NRO = forward_v_panel<Shape, StaticD>;
  // The packed block's panels (ForwardPanels): K^T panels of KP keys (NR on
  // host spaces, BK on devices); V panels of Panels::v(dp) columns (NRO on
  // host spaces, dp on devices).
  using Panels = ForwardPanels<memory_space, Shape, StaticD>;
  static constexpr int KP = Panels::kt;
  // Granularity (keys) at which partial tiles trim the P*V reduction.
  static constexpr int KG = Shape::dim_granule;
  // Rows per softmax step: 3 rows' dependent max and sum chains interleave in
  // the explicit-vector passes (host ISAs with a vector exp2; one AVX-512
  // vector per row and step leaves one row's chain latency-bound). 2 and 6
  // rows ran no faster than 3 (AVX-512 and AVX2, Emerald Rapids); 1 elsewhere.
#if BLOCKATTN_SIMD_KERNELS
  static constexpr int SR = simd_exp2_rows<isa, T, KG>() && MR % 3 == 0 ? 3 : 1;
#else
  static constexpr int SR = 1;
#endif
  static_assert(StaticD % NRO == 0,
                "BlockAttn: a static head dim must be a multiple of micro_cols");
  // The AMX forward (run_amx): bf16 inputs on a host space whose kernels are
  // the AVX-512 ones, tiles of whole 32 x 32 blocks of tile products.
  static constexpr bool amx_capable = forward_amx_capable<ExecSpace, T, Shape, QS>;
  // Query rows of the AMX path's scratch: whole 32-row blocks.
  static constexpr int BQA = (BQ + 31) / 32 * 32;
  // Software prefetch of the user's strided rows (prefetch.hpp): host spaces.
  static constexpr bool host_prefetch = is_host_space_v<ExecSpace>;

  /// The head dim as stored in scratch and in the packed K/V block.
  static int pad_dim(int dim) {
    return padded_head_dim<Shape, StaticD>(dim);
  }

  in_view q;   // (batch, queries, heads, dim)
  kt_view kt;  // packed block, see PackedKV
  v_view v;
  out_view o;      // (batch, queries, heads, dim)
  acc_view o_acc;  // unnormalised O between calls (batch, queries, heads, dim)
  lse_view lse;    // (batch, heads, queries)
  // Online-softmax state between calls over several K/V blocks (ring steps):
  // resume = read O (unnormalised), m, l written by the previous call;
  // finish = normalise into O and LSE (else write the state back).
  using state_view = Kokkos::View<T***, Kokkos::LayoutRight, memory_space>;
  state_view m_state, l_state;  // (batch, heads, queries), base-2 running max and sum
  bool resume = false;
  bool finish = true;
  int league_begin = 0;  // first (batch, head, query tile) of this launch
  Mask mask;
  QPos qpos;
  KPos kpos;
  ForwardExtents ext;
  int dim_padded = 0, k_tiles = 0, group = 1;
  // The query tiles of each (batch, head), resolved (tiles > 0): tiles of BQ
  // rows, or an even split over more, shorter tiles when few tiles per thread
  // would leave threads idle (balanced_query_tiles). At most BQ rows each:
  // scratch is sized for BQ.
  QueryTiles q_split;
  T q_scale = T(1);  // softmax scale * log2(e): logits are kept in base 2

  /// Q tile, O accumulator, S/P tile, and three row vectors (m, l, alpha):
  /// cache-line aligned pieces (impl/scratch.hpp).
  KOKKOS_INLINE_FUNCTION static std::size_t scratch_lines(int dim_padded) {
    return 2 * scratch_line_bytes(sizeof(T) * BQ * dim_padded) +
           scratch_line_bytes(sizeof(T) * BQ * BK) + 3 * scratch_line_bytes(sizeof(T) * BQ);
  }
  static std::size_t scratch_bytes(int dim_padded) {
    return scratch_request(scratch_lines(dim_padded));
  }

  /// The AMX path (amx_kv set): K and V of every key tile in VNNI pairs, from
  /// the packed block (pack_amx_kv); head dim padded to amx_dim (a multiple of 32).
  const std::uint16_t* amx_kv = nullptr;
  const unsigned char* amx_v_bad = nullptr;  // per key tile: V holds an inf or NaN
  bool matrix_tiles = true;                  // AMX tile products; false: AVX512-BF16 vectors
  int amx_dim = 0;
  int amx_tiles = 0;  // key tiles per (batch, kv head) in amx_kv
  // Key tiles per super-tile of the AMX path, and its keys: 256, so that S of
  // a 32-row block (32 KB) stays in L1; 512 keys ran 8-11 % slower and 128
  // keys 7-15 % (Xeon with AMX, 1 thread, D = 128, N = 1024-4096).
  static constexpr int AG = BK >= 256 ? 1 : 256 / BK;
  static constexpr int AW = AG * BK;

  /// Scratch of the AMX path: Q (bf16) and O (fp32) of BQA x amx_dim, S (fp32) and P
  /// (bf16) of 32 x AW, m, l, alpha; cache-line aligned pieces (impl/scratch.hpp).
  static std::size_t amx_scratch_lines(int amx_dim) {
    auto up = scratch_line_bytes;
    return up(std::size_t(2) * BQA * amx_dim) + up(std::size_t(4) * BQA * amx_dim) +
           up(std::size_t(4) * 32 * AW) + up(std::size_t(2) * 32 * AW) +
           3 * up(std::size_t(4) * BQA);
  }
  static std::size_t amx_scratch_bytes(int amx_dim) {
    return scratch_request(amx_scratch_lines(amx_dim));
  }

  KOKKOS_INLINE_FUNCTION int padded_dim() const {
    return StaticD > 0 ? StaticD : dim_padded;
  }

  KOKKOS_INLINE_FUNCTION void operator()(const member_type& team) const {
#if BLOCKATTN_HOST_AMX
    if constexpr (amx_capable) {
      if (amx_kv != nullptr) {
        AmxEntry::run([&] { run_amx(team); });
        return;
      }
    }
#endif
    run_in_isa<isa>([&] { run(team); });
  }

  /// One team's work (operator(), inside a function of the shape's ISA).
  /// A team's (batch, head, kv head) and query rows [q0, q0 + q_rows).
  /// Heavier (later) query tiles first: with causal masks they carry more tiles.
  struct TeamRows {
    int b, h, hk, q0, q_rows;
  };
  KOKKOS_INLINE_FUNCTION TeamRows team_rows(const member_type& team) const {
    const int league = team.league_rank() + league_begin;
    const int q_tiles = q_split.tiles;
    const int qt = q_tiles - 1 - league % q_tiles;
    const int h = (league / q_tiles) % ext.heads;
    const int q0 = q_split.begin(qt, MR);
    return {league / (q_tiles * ext.heads), h, h / group, q0,
            q_split.end(qt, MR, ext.queries) - q0};
  }

  KOKKOS_INLINE_FUNCTION void run(const member_type& team) const {
    const int dp = padded_dim();
    const TeamRows tr = team_rows(team);
    const int b = tr.b, h = tr.h, hk = tr.hk, q0 = tr.q0, q_rows = tr.q_rows;

    ScratchLines scratch(team, scratch_level, scratch_lines(dp));
    T* const qs = scratch.take<T>(std::size_t(BQ) * dp);
    T* const os = scratch.take<T>(std::size_t(BQ) * dp);
    T* const ss = scratch.take<T>(std::size_t(BQ) * BK);
    T* const m = scratch.take<T>(BQ);
    T* const l = scratch.take<T>(BQ);
    T* const alpha = scratch.take<T>(BQ);

    // Rows of micro tiles that hold a query (the last tile of a sequence is
    // partial): the rest of the tile is never computed.
    const int q_live = (q_rows + MR - 1) / MR * MR;
    // Q tile (q_live, dp), pre-scaled; the online-softmax state of its rows
    // either fresh (O = 0, m = -inf, l = 0) or resumed from an earlier block.
    // Rows are read through a pointer and the view's stride (one index
    // computation per row, not per element; unit stride, the common case,
    // vectorises). On the host, every row is asked for first (prefetch.hpp):
    // one head's rows are heads * dim apart, past the hardware prefetchers.
    if (host_prefetch && q.stride(3) == 1)
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, q_rows), [&](const int r) {
        prefetch_span(&q(b, q0 + r, h, 0), sizeof(QS) * ext.dim);
        if (resume) prefetch_span(&o_acc(b, q0 + r, h, 0), sizeof(T) * ext.dim);
      });
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, q_live), [&](const int r) {
      const bool row_in = r < q_rows;
      const bool load = resume && row_in;
      const int n = row_in ? ext.dim : 0;
      T* const qd = qs + r * dp;
      T* const od = os + r * dp;
      if (n > 0) copy_row(qd, &q(b, q0 + r, h, 0), q.stride(3), n, q_scale);
      for (int d = n; d < dp; ++d) qd[d] = T(0);
      const int n_o = load ? n : 0;
      if (n_o > 0) copy_row(od, &o_acc(b, q0 + r, h, 0), o_acc.stride(3), n_o, T(1));
      for (int d = n_o; d < dp; ++d) od[d] = T(0);
      m[r] = load ? m_state(b, h, q0 + r) : -infinity<T>();
      l[r] = load ? l_state(b, h, q0 + r) : T(0);
    });
    team.team_barrier();

    const index_type q_begin = qpos(q0), q_end = qpos(q0 + q_rows - 1) + 1;
    const T* const v_head = &v(b, hk, 0, 0);
    for (int kb = 0; kb < k_tiles; ++kb) {
      const int k0 = kb * BK;
      const int k_rows = ext.keys - k0 < BK ? ext.keys - k0 : BK;
      const TileKind kind = mask.classify(q_begin, q_end, kpos(k0), kpos(k0 + k_rows - 1) + 1);
      if (kind == TileKind::empty) continue;

      const T* const kt_tile = &kt(b, hk, kb, 0, 0);
      const T* const v_tile = v_head + static_cast<std::ptrdiff_t>(k0) * dp;
      const Tile tile{kind, q0, q_rows, k0, k_rows, dp,    kt_tile, v_tile,
                      qs,   os, ss,     m,  l,      alpha, h};
      // A non-finite V row: P = 0 (masked) times inf / NaN must add nothing, so
      // the P*V of a partial tile then selects instead of multiplying (rare).
      const bool select_pv = kind == TileKind::partial && tile_has_nonfinite(team, v_tile, BK * dp);
      // S (BQ, BK) = Q (BQ, dp) * K^T (dp, BK)
      Kokkos::parallel_for(
          Kokkos::TeamThreadRange(team, (q_live / MR) * (BK / NR)),
          [&](const int t) { score_micro_tile(tile, (t / (BK / NR)) * MR, (t % (BK / NR)) * NR); });
      team.team_barrier();
      // Online softmax on the rows of S (masked in partial tiles): S becomes P,
      // SR rows at a time.
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, q_live / SR),
                           [&](const int g) { softmax_tile_rows(tile, g * SR); });
      team.team_barrier();
      // O (BQ, dp) = diag(alpha) O + P (BQ, BK) * V (BK, dp)
      Kokkos::parallel_for(
          Kokkos::TeamThreadRange(team, (q_live / MR) * (dp / NRO)), [&](const int t) {
            pv_micro_tile(tile, select_pv, (t / (dp / NRO)) * MR, (t % (dp / NRO)) * NRO);
          });
      team.team_barrier();
    }

    store_rows(team, b, h, q0, q_rows, os, dp, m, l);
  }

  /// The end of a team: O (rows `ld` apart in os) and the state of its rows,
  /// normalised (finish) or kept for the next block.
  KOKKOS_INLINE_FUNCTION void store_rows(const member_type& team, int b, int h, int q0, int q_rows,
                                         const T* os, int ld, const T* m, const T* l) const {
    // The rows about to be written, asked for first (as the Q rows in run()).
    if (host_prefetch && finish && o.stride(3) == 1)
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, q_rows), [&](const int r) {
        prefetch_span(&o(b, q0 + r, h, 0), sizeof(OS) * ext.dim, true);
      });
    if (host_prefetch && !finish && o_acc.stride(3) == 1)
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, q_rows), [&](const int r) {
        prefetch_span(&o_acc(b, q0 + r, h, 0), sizeof(T) * ext.dim, true);
      });
    if (!finish) {
      // More blocks follow: keep the unnormalised O in `o` and (m, l) in the state.
      Kokkos::parallel_for(Kokkos::TeamThreadRange(team, q_rows), [&](const int r) {
        store_row(&o_acc(b, q0 + r, h, 0), o_acc.stride(3), os + r * ld, ext.dim, T(1));
        m_state(b, h, q0 + r) = m[r];
        l_state(b, h, q0 + r) = l[r];
      });
      return;
    }
    // Normalise and write back. Rows that saw no allowed key: O = 0, LSE = -inf;
    // rows whose allowed logits held a NaN (l = NaN): O and LSE NaN.
    Kokkos::parallel_for(Kokkos::TeamThreadRange(team, q_rows), [&](const int r) {
      const T inv_l = SoftmaxRow<T>::inverse_sum(l[r]);
      store_row(&o(b, q0 + r, h, 0), o.stride(3), os + r * ld, ext.dim, inv_l);
      lse(b, h, q0 + r) = SoftmaxRow<T>::lse(m[r], l[r]);
    });
  }

#if BLOCKATTN_HOST_AMX
  /// One team's work on AMX tiles (portable/forward_amx.hpp).
  void run_amx(const member_type& team) const;
  /// The online-softmax update of four rows of a super-tile (forward_amx.hpp).
  BLOCKATTN_TARGET_AMX static void softmax_wide_rows(T* __restrict__ s, int w, T scale, T* m, T* l,
                                                     T* alpha, std::uint16_t* __restrict__ p16);
  /// The bits of a bf16 value as stored.
  KOKKOS_FORCEINLINE_FUNCTION static std::uint16_t bf16_storage_bits(const QS& x);
#endif

  /// dst[d] = scale * src[d * stride] for d < n (src in a user view's type).
  template <class S>
  KOKKOS_FORCEINLINE_FUNCTION static void copy_row(T* __restrict__ dst, const S* src,
                                                   std::size_t stride, int n, T scale) {
    if constexpr (std::is_same<S, fp16>::value && std::is_same<T, float>::value) {
      if (stride == 1) return widen_fp16_row(dst, src, n, scale);  // half_rows.hpp
    }
    if (stride == 1)
      for (int d = 0; d < n; ++d) dst[d] = scale * T(src[d]);
    else
      for (int d = 0; d < n; ++d) dst[d] = scale * T(src[std::size_t(d) * stride]);
  }
  /// dst[d * stride] = S(src[d] * scale) for d < n (fp16 rows in vectors:
  /// half_rows.hpp).
  template <class S>
  KOKKOS_FORCEINLINE_FUNCTION static void store_row(S* dst, std::size_t stride,
                                                    const T* __restrict__ src, int n, T scale) {
    store_scaled_row(dst, std::ptrdiff_t(stride), src, n, scale);
  }

  struct KeyRange {
    int begin, end;
  };

  /// One key tile of one team: where its operands live.
  struct Tile {
    TileKind kind;
    int q0, q_rows, k0, k_rows, dp;
    const T* kt;  // packed K^T tile: BK / KP panels of (dp, KP) (kt_tile_offset)
    const T* v;   // packed V tile: panels of (BK, Panels::v(dp)) (v_tile_offset)
    const T* qs;  // Q tile (BQ, dp), scratch
    T* os;        // O accumulator (BQ, dp), scratch
    T* ss;        // S / P tile (BQ, BK), scratch
    T* m;
    T* l;
    T* alpha;
    int h;  // query head (a score policy's argument)
  };

  /// S micro tile (r0, c0) = Q rows r0.. times K^T columns c0... In a partial
  /// tile, a micro tile the mask rules out entirely is not computed: the mask
  /// pass overwrites all of it with -inf.
  KOKKOS_FORCEINLINE_FUNCTION void score_micro_tile(const Tile& t, int r0, int c0) const {
    if (t.kind == TileKind::partial && r0 < t.q_rows && c0 < t.k_rows) {
      const int r1 = (r0 + MR < t.q_rows ? r0 + MR : t.q_rows) - 1;
      const int c1 = (c0 + NR < t.k_rows ? c0 + NR : t.k_rows) - 1;
      if (mask.classify(qpos(t.q0 + r0), qpos(t.q0 + r1) + 1, kpos(t.k0 + c0),
                        kpos(t.k0 + c1) + 1) == TileKind::empty)
        return;
    }
    // The K^T tile is packed in panels of KP keys (NR on host spaces).
    const T* const kt_panel = t.kt + kt_tile_offset(0, c0, t.dp, KP);
    Gemm::template apply<MR, NR, StaticD>(t.dp, t.qs + r0 * t.dp, t.dp, kt_panel, KP,
                                          t.ss + r0 * BK + c0, BK, static_cast<const T*>(nullptr));
  }

  /// Rows r0 .. r0 + SR - 1 of S: the mask (partial tiles, or keys past the
  /// block's end), then the online-softmax update, leaving P in S.
  KOKKOS_FORCEINLINE_FUNCTION void softmax_tile_rows(const Tile& t, int r0) const {
    if constexpr (has_score_mod_v<Mask>)
      for (int r = r0; r < r0 + SR; ++r) score_tile_row(t, r);
    for (int r = r0; r < r0 + SR; ++r) mask_tile_row(t, r);
#if BLOCKATTN_SIMD_KERNELS
    if constexpr (SR > 1) {
      softmax_row_group(t.ss + r0 * BK, t.m + r0, t.l + r0, t.alpha + r0);
      return;
    }
#endif
    for (int r = r0; r < r0 + SR; ++r) softmax_row(t.ss + r * BK, t.m[r], t.l[r], t.alpha[r]);
  }

  /// Row r of S through the score policy (before the mask, which then
  /// overwrites the pairs it rules out): s' = score(s) on natural logits.
  KOKKOS_FORCEINLINE_FUNCTION void score_tile_row(const Tile& t, int r) const {
    const int rq = r < t.q_rows ? r : t.q_rows - 1;
    score_row(mask, kpos, t.ss + r * BK, qpos(t.q0 + rq), t.k0, t.k_rows, t.h);
  }
  /// s' = score(s f) log2(e) for base-2 logits s (f = ln 2), or for the
  /// unscaled products of the matrix engine's path (f = its scale times ln 2:
  /// one pass scales and scores). The policy and the positions by value, the
  /// row restrict: read through `this`, GCC reloads the policy's data after
  /// every store to the row and the loop stays scalar (SoftCap's forward ran
  /// at 0.6x the no-policy rate on AVX2 so).
  KOKKOS_FORCEINLINE_FUNCTION static void score_row(const Mask m, const KPos kp, T* __restrict__ s,
                                                    index_type qp, int k0, int n, int h,
                                                    T f = ln2<T>) {
    for (int c = 0; c < n; ++c) s[c] = m.score(s[c] * f, qp, kp(k0 + c), h) * log2e<T>;
  }

  /// Row r of S: -inf where the mask (partial tiles) or the block's end rules
  /// a key out.
  KOKKOS_FORCEINLINE_FUNCTION void mask_tile_row(const Tile& t, int r) const {
    // Rows past the last query (the rest of its micro tile; their results are
    // never stored) take the last query's position: the position map is only
    // read inside the sequence (a table ends there).
    const int rq = r < t.q_rows ? r : t.q_rows - 1;
    mask_segment(t.ss + r * BK, qpos(t.q0 + rq), t.kind == TileKind::partial, t.k0, t.k_rows);
  }

  /// BK columns of a row at query position qp against the key tile at k0
  /// (k_rows keys): -inf where the mask (partial tiles) or the tile's end
  /// rules a key out.
  KOKKOS_FORCEINLINE_FUNCTION void mask_segment(T* srow, index_type qp, bool partial, int k0,
                                                int k_rows) const {
    if constexpr (has_allowed_keys<Mask>::value) {
      // The row's keys are one interval: -inf outside its columns.
      if (partial || k_rows < BK) {
        const ColumnRange cols =
            partial ? allowed_columns(mask, qp, kpos, k0, k_rows) : ColumnRange{0, k_rows};
        for (int c = 0; c < cols.lo; ++c) srow[c] = -infinity<T>();
        for (int c = cols.hi; c < BK; ++c) srow[c] = -infinity<T>();
      }
    } else if (partial || k_rows < BK) {
      const impl::RowMask<Mask> allow(mask, qp, partial);
      for (int c = 0; c < BK; ++c) {
        const bool keep = c < k_rows && allow(kpos(k0 + c));
        srow[c] = keep_or_neg_inf(keep, srow[c]);
      }
    }
  }

  /// O micro tile (r0, c0) = diag(alpha) O + P rows r0.. times V columns c0..
  /// (only the keys some of its rows may see, in a partial tile; select_pv:
  /// scalar selects, for a V tile that holds an inf or NaN).
  KOKKOS_FORCEINLINE_FUNCTION void pv_micro_tile(const Tile& t, bool select_pv, int r0,
                                                 int c0) const {
    const int dp = t.dp;
    // The V tile is packed in panels of vp columns (NRO on host spaces, dp on
    // devices); the micro tile's columns start here, rows vp apart.
    const int vp = Panels::v(dp);
    const T* const v_panel = t.v + v_tile_offset(0, c0, BK, vp);
    if (t.kind == TileKind::full) {
      Gemm::template apply<MR, NRO, BK>(BK, t.ss + r0 * BK, BK, v_panel, vp, t.os + r0 * dp + c0,
                                        dp, t.alpha + r0);
    } else if (select_pv) {
      for (int i = 0; i < MR; ++i) {
        T* const orow = t.os + (r0 + i) * dp + c0;
        const T* const prow = t.ss + (r0 + i) * BK;
        for (int j = 0; j < NRO; ++j) orow[j] *= t.alpha[r0 + i];
        for (int c = 0; c < t.k_rows; ++c)
          if (prow[c] != T(0))
            for (int j = 0; j < NRO; ++j) orow[j] += prow[c] * v_panel[c * vp + j];
      }
    } else {
      const KeyRange keys = live_keys(r0, t.q0, t.q_rows, t.k0, t.k_rows);
      Gemm::template apply<MR, NRO, 0>(keys.end - keys.begin, t.ss + r0 * BK + keys.begin, BK,
                                       v_panel + keys.begin * vp, vp, t.os + r0 * dp + c0, dp,
                                       t.alpha + r0);
    }
  }

  /// True (on every thread of the team) when n values from p hold an inf or NaN.
  KOKKOS_INLINE_FUNCTION static bool tile_has_nonfinite(const member_type& team, const T* p,
                                                        int n) {
    int bad = 0;
    Kokkos::parallel_reduce(
        Kokkos::TeamThreadRange(team, n),
        [&](const int i, int& acc) { acc += is_nonfinite(p[i]) ? 1 : 0; }, bad);
    return bad > 0;
  }

  /// In a partial tile, the keys [begin, end) (granularity KG) that some row
  /// r0 .. r0 + MR - 1 may see: P is 0 outside, so P*V skips them. An empty
  /// range only rescales the accumulator.
  KOKKOS_INLINE_FUNCTION KeyRange live_keys(int r0, int q0, int q_rows, int k0, int k_rows) const {
    if (r0 >= q_rows) return {0, 0};
    const int r1 = (r0 + MR < q_rows ? r0 + MR : q_rows) - 1;
    const index_type qb = qpos(q0 + r0), qe = qpos(q0 + r1) + 1;
    auto empty = [&](int c) {
      const int c1 = (c + KG < k_rows ? c + KG : k_rows) - 1;
      return c >= k_rows ||
             mask.classify(qb, qe, kpos(k0 + c), kpos(k0 + c1) + 1) == TileKind::empty;
    };
    int lo = 0, hi = BK;
    while (lo < hi && empty(lo)) lo += KG;
    while (hi > lo && empty(hi - KG)) hi -= KG;
    return {lo, hi};
  }

  /// x if keep, else -inf, as integer masking: a float select under a
  /// condition stays scalar with GCC's default -ftrapping-math.
  KOKKOS_FORCEINLINE_FUNCTION static T keep_or_neg_inf(bool keep, T x) {
    using Bits = std::conditional_t<sizeof(T) == 4, std::uint32_t, std::uint64_t>;
    const Bits m = Bits(0) - static_cast<Bits>(keep);
    return bit_cast<T>((bit_cast<Bits>(x) & m) | (bit_cast<Bits>(-infinity<T>()) & ~m));
  }

  /// Online-softmax update of one row (base-2 logits in `s`, overwritten by P):
  ///   m' = max(m, max_c s_c);  p_c = 2^(s_c - m');  alpha = 2^(m - m');  l' = alpha l + sum p.
  /// A row with no allowed key so far keeps m = -inf, l = 0 and P = 0 (never
  /// computes -inf - -inf). A NaN logit gives p = NaN and l = NaN.
  /// The max and the sum run in `lanes` independent partial results so that
  /// host compilers vectorise them without reassociating (no -ffast-math);
  /// the explicit vector passes add the partial sums pairwise, the scalar
  /// loop in lane order.
  KOKKOS_FORCEINLINE_FUNCTION static void softmax_row(T* __restrict__ s, T& m, T& l, T& alpha) {
    constexpr int lanes = Shape::dim_granule;
    static_assert(BK % lanes == 0, "BlockAttn: block_k must be a multiple of dim_granule");
    T row_max = m;
    bool vector_max = false;
#if BLOCKATTN_SIMD_KERNELS
    if constexpr (simd_rows<isa, T, lanes>()) {
      row_max = simd_row_max<simd_for_t<isa>, lanes>(s, BK, m);
      vector_max = true;
    }
#endif
    if (!vector_max) {
      T part[lanes];
      for (int j = 0; j < lanes; ++j) part[j] = -infinity<T>();
      for (int c = 0; c < BK; c += lanes)
        for (int j = 0; j < lanes; ++j) part[j] = s[c + j] > part[j] ? s[c + j] : part[j];
      for (int j = 0; j < lanes; ++j) row_max = part[j] > row_max ? part[j] : row_max;
    }
    softmax_row_update(s, row_max, m, l, alpha);
  }

  /// The rest of softmax_row for a row whose new max is m_new.
  KOKKOS_FORCEINLINE_FUNCTION static void softmax_row_update(T* __restrict__ s, T m_new, T& m, T& l,
                                                             T& alpha) {
    constexpr int lanes = Shape::dim_granule;
    if (m_new == -infinity<T>()) {
      // No finite allowed logit: masked (-inf) or NaN (the max skips NaN).
      // A NaN makes l NaN, which stays NaN through later tiles and blocks.
      bool nan_seen = false;
      for (int c = 0; c < BK; ++c) {
        nan_seen = nan_seen || s[c] != s[c];
        s[c] = T(0);
      }
      if (nan_seen) l = quiet_nan<T>();
      alpha = T(1);
      return;
    }
    // P and its row sum in one pass (0 + p is exactly p: the same sums as
    // summing after the exp pass).
    T sum = T(0);
    bool vector_exp = false;
#if BLOCKATTN_SIMD_KERNELS
    if constexpr (simd_exp2_rows<isa, T, lanes>()) {
      sum = simd_exp2_row<simd_for_t<isa>, lanes>(s, BK, m_new);
      vector_exp = true;
    }
#endif
    if (!vector_exp) {
      T part[lanes];
      for (int j = 0; j < lanes; ++j) part[j] = T(0);
      for (int c = 0; c < BK; c += lanes)
        for (int j = 0; j < lanes; ++j) {
          const T p = exp2_nonpositive(s[c + j] - m_new);
          s[c + j] = p;
          part[j] += p;
        }
      for (int j = 0; j < lanes; ++j) sum += part[j];
    }
    alpha = exp2_nonpositive(m - m_new);
    l = alpha * l + sum;
    m = m_new;
  }

#if BLOCKATTN_SIMD_KERNELS
  /// softmax_row on the SR rows from s (row stride BK), their max and
  /// exponent passes interleaved (simd_row_max_group, simd_exp2_row_group):
  /// each row's values bitwise softmax_row's.
  KOKKOS_FORCEINLINE_FUNCTION static void softmax_row_group(T* __restrict__ s, T* m, T* l,
                                                            T* alpha) {
    if constexpr (SR > 1) {
      using V = simd_for_t<isa>;
      constexpr int lanes = Shape::dim_granule;
      T m_new[SR], sum[SR];
      simd_row_max_group<V, lanes, SR>(s, BK, BK, m, m_new);
      bool finite = true;
      for (int r = 0; r < SR; ++r) finite = finite && m_new[r] != -infinity<T>();
      if (!finite) {  // a row without a finite allowed logit (rare): row by row
        for (int r = 0; r < SR; ++r) softmax_row_update(s + r * BK, m_new[r], m[r], l[r], alpha[r]);
        return;
      }
      simd_exp2_row_group<V, lanes, SR>(s, BK, BK, m_new, sum);
      for (int r = 0; r < SR; ++r) {
        alpha[r] = exp2_nonpositive(m[r] - m_new[r]);
        l[r] = alpha[r] * l[r] + sum[r];
        m[r] = m_new[r];
      }
    }
  }
#endif

  int scratch_level = 0;
};

}  // namespace blockattn::impl

// The AMX path of the functor (its member functions, defined apart).
#include <blockattn/kernel/portable/forward_amx.hpp>
