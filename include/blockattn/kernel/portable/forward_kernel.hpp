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
#include <blockattn/kernel/impl/softmax_state.hpp>
#include <blockattn/kernel/portable/micro_gemm.hpp>
#include <blockattn/kernel/tile_shape.hpp>
#include <blockattn/kernel/validate.hpp>
#include <blockattn/policy/mask.hpp>
#include <blockattn/policy/score.hpp>

#include <cstddef>
#include <cstdint>
#include <type_traits>

namespace blockattn::impl {

/// Sizes of one forward problem (kernel/validate.hpp).
using ForwardExtents = BlockExtents;

/// How a forward launch cuts the queries of each (batch, head) into team
/// tiles: tile qt holds the row groups (micro_rows rows each, or `granule`)
/// [qt * groups / tiles, (qt + 1) * groups / tiles), the last one clipped to
/// the queries. `tiles` = 0 means tiles of block_q rows (`rows`); `even`
/// spreads all groups over `tiles` tiles whose heights differ by at most one
/// group. Every tile holds at most block_q rows (checked at the launch).
struct QueryTiles {
  int tiles = 0;    // per (batch, head); 0: tiles of block_q rows
  int groups = 0;   // row groups spread over the tiles
  int granule = 0;  // rows per group; 0: the kernel's micro_rows

  /// Tiles of `rows` rows (a multiple of micro_rows; the last one partial).
  static QueryTiles rows(int queries, int rows, int micro_rows) {
    const int t = (queries + rows - 1) / rows;
    return {t, t * (rows / micro_rows)};
  }
  /// `tiles` tiles of (nearly) equal height.
  static QueryTiles even(int queries, int tiles, int micro_rows) {
    return {tiles, (queries + micro_rows - 1) / micro_rows};
  }
  /// The concrete split of `queries` queries (resolves tiles = 0).
  QueryTiles resolved(int queries, int block_q, int micro_rows) const {
    return tiles > 0 ? *this : rows(queries, block_q, micro_rows);
  }
  /// The same split in groups of `rows` rows (the matrix engine's 32-row blocks).
  QueryTiles with_granule(int rows) const {
    QueryTiles t = *this;
    if (t.tiles > 0) t.granule = rows;
    return t;
  }
  /// Rows per group for a kernel whose micro tiles have micro_rows rows.
  KOKKOS_INLINE_FUNCTION int rows_per_group(int micro_rows) const {
    return granule > 0 ? granule : micro_rows;
  }
  /// First query row of tile qt, and one past its last.
  KOKKOS_INLINE_FUNCTION int begin(int qt, int micro_rows) const {
    return rows_per_group(micro_rows) * static_cast<int>(std::int64_t(qt) * groups / tiles);
  }
  KOKKOS_INLINE_FUNCTION int end(int qt, int micro_rows, int queries) const {
    const int stop = begin(qt + 1, micro_rows);
    return stop < queries ? stop : queries;
  }
};

/// Width of the forward's P*V micro tile, and so of the packed V panels: the
/// full micro tile for the compile-time head dims, one granule otherwise.
template <class Shape, int StaticD>
inline constexpr int forward_v_panel = StaticD > 0 ? Shape::micro_cols : Shape::dim_granule;

/// How the forward kernel of Shape and StaticD in MemorySpace reads a packed
/// K/V block: keys per K^T panel (`kt`) and head-dim columns per V panel (`v`).
///  - Host spaces: a panel is as wide as the micro tile that reads it, so one
///    thread's micro tile streams one contiguous panel (4c5ef8f).
///  - Devices: one panel spans the tile, K^T (dim_padded x block_k) and V
///    (block_k x dim_padded) row-major. The threads of a team take adjacent
///    micro tiles, so adjacent threads then read adjacent values of one row
///    (coalesced); with micro-tile panels they read values dim_padded x
///    micro_cols apart, and the forward ran 4.2-4.5x slower on an H100 (fp32,
///    D = 128: 1.25-1.47 against 5.2-6.6 TFLOP/s).
template <class MemorySpace, class Shape, int StaticD>
struct ForwardPanels {
  static constexpr bool host = std::is_same<MemorySpace, Kokkos::HostSpace>::value;
  static constexpr int kt = host ? Shape::micro_cols : Shape::block_k;
  KOKKOS_INLINE_FUNCTION static constexpr int v(int dim_padded) {
    return host ? forward_v_panel<Shape, StaticD> : dim_padded;
  }
};

/// A packed K/V block (PackedKV) laid out for the forward kernel of Shape and
/// StaticD in MemorySpace (ForwardPanels).
template <class T, class MemorySpace, class Shape, int StaticD, class Buffers = NoCallBuffers>
PackedKV<T, MemorySpace> allocate_forward_kv(int batch, int kv_heads, int keys, int dim_padded,
                                             Buffers* buffers = nullptr) {
  using Panels = ForwardPanels<MemorySpace, Shape, StaticD>;
  return allocate_packed_kv<T, MemorySpace>(batch, kv_heads, keys, dim_padded, Shape::block_k,
                                            Panels::kt, Panels::v(dim_padded), buffers);
}

/// Whether the forward kernel of (ExecSpace, T, Shape) with queries stored as
/// QS has the AMX path (run_amx): bf16 inputs on a host space whose kernels
/// are the AVX-512 ones, query and key tiles of whole 32-row blocks.
template <class ExecSpace, class T, class Shape, class QS>
inline constexpr bool forward_amx_capable =
    BLOCKATTN_HOST_AMX&& kernel_isa_v<ExecSpace, Shape> ==
        HostIsa::avx512&& std::is_same<T, float>::value&& std::is_same<QS, bf16>::value&&
                Shape::block_q %
            32 ==
        0 &&
    Shape::block_k % 32 == 0;

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

  static std::size_t scratch_bytes(int dim_padded) {
    // Q tile, O accumulator, S/P tile, and three row vectors (m, l, alpha).
    const std::size_t elems = std::size_t(2) * BQ * dim_padded + std::size_t(BQ) * BK + 3 * BQ;
    return elems * sizeof(T);
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

  /// Scratch of the AMX path: Q (bf16) and O (fp32) of BQA x amx_dim, S (fp32)
  /// and P (bf16) of 32 x AW, m, l, alpha; 64-byte aligned pieces.
  static std::size_t amx_scratch_bytes(int amx_dim) {
    auto up = [](std::size_t b) { return (b + 63) / 64 * 64; };
    return up(std::size_t(2) * BQA * amx_dim) + up(std::size_t(4) * BQA * amx_dim) +
           up(std::size_t(4) * 32 * AW) + up(std::size_t(2) * 32 * AW) +
           3 * up(std::size_t(4) * BQA);
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
#if BLOCKATTN_HOST_DISPATCH
    if constexpr (host_isa_targeted(isa)) {
      HostIsaEntry<isa>::run([&] { run(team); });
      return;
    }
#endif
    run(team);
  }

  /// One team's work (operator(), inside a function of the shape's ISA).
  KOKKOS_INLINE_FUNCTION void run(const member_type& team) const {
    const int dp = padded_dim();
    // Heavier (later) query tiles first: with causal masks they carry more tiles.
    const int league = team.league_rank() + league_begin;
    const int q_tiles = q_split.tiles;
    const int qt = q_tiles - 1 - league % q_tiles;
    const int h = (league / q_tiles) % ext.heads;
    const int b = league / (q_tiles * ext.heads);
    const int hk = h / group;
    const int q0 = q_split.begin(qt, MR);
    const int q_rows = q_split.end(qt, MR, ext.queries) - q0;

    const int level = scratch_level;
    T* const qs = static_cast<T*>(team.team_scratch(level).get_shmem(sizeof(T) * BQ * dp));
    T* const os = static_cast<T*>(team.team_scratch(level).get_shmem(sizeof(T) * BQ * dp));
    T* const ss = static_cast<T*>(team.team_scratch(level).get_shmem(sizeof(T) * BQ * BK));
    T* const m = static_cast<T*>(team.team_scratch(level).get_shmem(sizeof(T) * BQ));
    T* const l = static_cast<T*>(team.team_scratch(level).get_shmem(sizeof(T) * BQ));
    T* const alpha = static_cast<T*>(team.team_scratch(level).get_shmem(sizeof(T) * BQ));

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
  /// One team's work on AMX tiles (host spaces: one thread per team). Per
  /// super-tile of AG key tiles (AW = AG * BK keys: 256 for BK = 128) and per
  /// block of 32 query rows: S = Q K^T as 32 x 32 blocks of tile products
  /// (amx.hpp) over the key tiles the mask leaves to the block; the fp32
  /// online softmax over the whole super-tile row (one rescale of O per AW
  /// keys); O += P V with P in bf16, one C tile load and store per AW keys.
  void run_amx(const member_type& team) const {
    const int da = amx_dim;  // amx_kv's and the scratch's head dim: a multiple of 32
    const int league = team.league_rank() + league_begin;
    const int q_tiles = q_split.tiles;
    const int qt = q_tiles - 1 - league % q_tiles;
    const int h = (league / q_tiles) % ext.heads;
    const int b = league / (q_tiles * ext.heads);
    const int hk = h / group;
    const int q0 = q_split.begin(qt, MR);
    const int q_rows = q_split.end(qt, MR, ext.queries) - q0;
    const int q_live = (q_rows + 31) / 32 * 32;

    const int level = scratch_level;
    auto take = [&](std::size_t bytes) {
      return team.team_scratch(level).get_shmem((bytes + 63) / 64 * 64);
    };
    auto* const qb = static_cast<std::uint16_t*>(take(std::size_t(2) * BQA * da));
    T* const os = static_cast<T*>(take(std::size_t(4) * BQA * da));
    T* const ss = static_cast<T*>(take(std::size_t(4) * 32 * AW));
    auto* const pb = static_cast<std::uint16_t*>(take(std::size_t(2) * 32 * AW));
    T* const m = static_cast<T*>(take(std::size_t(4) * BQA));
    T* const l = static_cast<T*>(take(std::size_t(4) * BQA));
    T* const alpha = static_cast<T*>(take(std::size_t(4) * BQA));

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
                    bits_float(std::uint32_t(vk[std::size_t(d / 16) * kp * 16 + (d % 16) * 2])
                               << 16);
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
                vbase + std::size_t(2 * nb + 1) * kp * 16 + kv0,
                os + std::size_t(r0) * da + nb * 32, da, true);
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
  BLOCKATTN_TARGET_AMX static void softmax_wide_rows(T* __restrict__ s, int w, T scale, T* m, T* l,
                                                     T* alpha, std::uint16_t* __restrict__ p16) {
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
  KOKKOS_FORCEINLINE_FUNCTION static std::uint16_t bf16_storage_bits(const QS& x) {
    if constexpr (std::is_same<QS, bf16>::value) {
      return x.bits;
    } else {
      return bf16_upper_bits(float(x));
    }
  }
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
