// SPDX-License-Identifier: Apache-2.0
// Split-KV attention for a few query rows against a long key cache
// (FlashDecoding): the keys of every (sequence, kv head) are cut into
// `splits` ranges; one team attends one range for up to 16 query rows of the
// kv head's group (GQA: the group's heads read the keys once; on host spaces
// over sequence-major caches the rows of consecutive kv heads, DecodeGrid),
// keeping (O, m, l) in scratch, and writes an open partial state; a second
// pass merges the splits of each row (the online-softmax rules of
// softmax_state.hpp).
//
// Decode is memory bound: the kernel reads the caller's K and V in place (any
// strides; unit stride in head_dim streams; or the pages of a paged cache,
// decode_pages.hpp), never packs them, and converts
// 16-bit storage to the compute type as it reads. On host spaces with fp32
// compute and unit stride, the tile products run in explicit vectors
// (decode_simd.hpp; the run-time dispatched ISA, isa.hpp): fp32 and bf16
// read in place, fp16 tiles widened once into scratch for the team's rows;
// bf16 caches, where the host's matrix engine runs vectors (matrix_path()),
// on AVX512-BF16 dot products (decode_bf16.hpp); bf16 and 8-bit caches with
// bf16 queries, where it runs AMX tiles, a GQA group's rows (DecodeGrid::amx)
// on the tiles (decode_amx.hpp).
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/kernel/host/decode_amx.hpp>
#include <blockattn/kernel/host/decode_bf16.hpp>
#include <blockattn/kernel/host/decode_simd.hpp>
#include <blockattn/kernel/impl/exp2.hpp>
#include <blockattn/kernel/impl/half_rows.hpp>
#include <blockattn/kernel/impl/prefetch.hpp>
#include <blockattn/kernel/impl/scratch.hpp>
#include <blockattn/kernel/impl/softmax_state.hpp>
#include <blockattn/kernel/isa.hpp>
#include <blockattn/kernel/portable/decode_layout.hpp>
#include <blockattn/kernel/portable/decode_pages.hpp>
#include <blockattn/kernel/portable/decode_rows.hpp>
#include <blockattn/kernel/sinks.hpp>
#include <blockattn/kernel/tile_shape.hpp>
#include <blockattn/policy/mask.hpp>
#include <blockattn/policy/score.hpp>

#include <algorithm>
#include <cstdint>

namespace blockattn {
namespace impl {

/// The split-KV pass: one team per (sequence, kv head, row tile, split).
/// q, o: (batch, rows, heads, dim); k, v: (batch, capacity, kv_heads, dim)
/// strided, k(b, j, g, 0 .. dim) contiguous when stride(3) == 1 (checked by
/// the caller: `unit` says so). Writes the split's open state (unnormalised
/// O, base-2 m, l) to the part_* buffers, or, with one split, the normalised
/// O and LSE straight into o, lse.
template <class ExecSpace, class T, class QS, class S, class OS, class Mask, class Pos>
struct DecodeKernel {
  using mem = typename ExecSpace::memory_space;
  using member = typename Kokkos::TeamPolicy<ExecSpace>::member_type;
  Kokkos::View<const QS****, Kokkos::LayoutStride, mem, Kokkos::MemoryTraits<Kokkos::Unmanaged>> q;
  Kokkos::View<const S****, Kokkos::LayoutStride, mem, Kokkos::MemoryTraits<Kokkos::Unmanaged>> k,
      v;
  Kokkos::View<OS****, Kokkos::LayoutStride, mem, Kokkos::MemoryTraits<Kokkos::Unmanaged>> o;
  Kokkos::View<T***, Kokkos::LayoutStride, mem, Kokkos::MemoryTraits<Kokkos::Unmanaged>> lse;
  Kokkos::View<const int*, mem, Kokkos::MemoryTraits<Kokkos::Unmanaged>> lengths;
  Kokkos::View<const index_type*, mem, Kokkos::MemoryTraits<Kokkos::Unmanaged>> q_positions;
  Kokkos::View<T*, mem> part_o, part_m, part_l;  // (split, row, [dim]) when splits > 1
  sink_view<mem> sinks;  // one logit per query head folded into the normalisation (empty: none)
  Mask mask;
  Pos kpos;
  T scale_log2;  // scale * log2(e)
  DecodeGrid g;
  bool unit = true;         // k, v, q rows contiguous in head_dim
  int prefetch = 1;         // host: the next tile's rows at once (decode_prefetch_level)
  int prefetch_spread = 0;  // host: ... key by key in the vector tile products (0: at once)
  HostIsa isa = host_isa;   // host: the vector ISA of the tile products (dispatched_host_isa)
  bool bf16_dot = false;    // host, bf16: the AVX512-BF16 products (decode_bf16.hpp)
  DecodePages<mem> pages;   // where key j is: k(b, j, ...) or a paged pool's slot
  /// Key ranges of sequence b (empty: g.splits for all; DecodeOptions::sequence_splits).
  Kokkos::View<const int*, mem, Kokkos::MemoryTraits<Kokkos::Unmanaged>> seq_splits;

  /// Host spaces with fp32 compute: the explicit-vector tile products
  /// (decode_simd.hpp) where the keys and values have unit stride.
  static constexpr bool host_vectors = is_host_space_v<ExecSpace> && std::is_same<T, float>::value;
  /// Their fp16 K and V tiles widened to fp32 in scratch, one at a time
  /// (fp32 and bf16 are read in place, bf16 widened as it is loaded).
  static constexpr bool widened_tiles = host_vectors && std::is_same<S, fp16>::value;
  /// 8-bit K and V (core/quant.hpp): each row times its scale (pages.kscale,
  /// pages.vscale); the host vector products read the codes in place
  /// (widened in registers, decode_load) and the scales multiply each key's
  /// scores and each value's P.
  static constexpr bool quant = is_kv_quant_v<S>;
  /// k's or v's value (b, key j, kv head g, dim d) in the compute type.
  template <class KV, class SV>
  KOKKOS_INLINE_FUNCTION T kv_at(const KV& kv, const SV& sc, int b, std::int64_t j, int g,
                                 int d) const {
    if constexpr (quant)
      return T(dequantize(pages.at(kv, b, j, g, d))) * T(pages.scale(sc, b, j, g));
    else
      return T(to_compute(pages.at(kv, b, j, g, d)));
  }
  /// Row j of kv (kv head g) into fp32 at out: widened, or dequantized.
  template <class KV, class SV>
  KOKKOS_INLINE_FUNCTION void widen_row(float* out, const KV& kv, const SV& sc, int b,
                                        std::int64_t j, int g, int D) const {
    if constexpr (quant)
      dequant_row(out, pages.row(kv, b, j, g), pages.scale(sc, b, j, g), D);
    else
      load_row(out, pages.row(kv, b, j, g), 1, D);
  }
  /// bf16 q, k and v: the AVX512-BF16 products can run (where bf16_dot says).
#if BLOCKATTN_DECODE_BF16
  static constexpr bool bf16_dot_capable =
      host_vectors && std::is_same<S, bf16>::value && std::is_same<QS, bf16>::value;
#else
  static constexpr bool bf16_dot_capable = false;
#endif
  /// P in bf16 on the dot products: rows of p16_stride.
  KOKKOS_INLINE_FUNCTION static int p16_stride(const DecodeGrid& g) {
    return (g.key_tile + 15) / 16 * 16;
  }
  /// bf16 q and a bf16 or 8-bit cache: the AMX tile products can run (where g.amx says).
#if BLOCKATTN_DECODE_AMX
  static constexpr bool amx_capable =
      host_vectors && std::is_same<QS, bf16>::value && (std::is_same<S, bf16>::value || quant);
#else
  static constexpr bool amx_capable = false;
#endif

  using Scratch = DecodeScratch<T>;
  /// The pieces for g, taken from `from` (ScratchLines, or ScratchCount: the size).
  template <class From>
  KOKKOS_INLINE_FUNCTION static Scratch carve(From& from, const DecodeGrid& g) {
    return Scratch::carve(from, g, widened_tiles, bf16_dot_capable, amx_capable && g.amx,
                          p16_stride(g));
  }
  KOKKOS_INLINE_FUNCTION static std::size_t scratch_lines(const DecodeGrid& g) {
    ScratchCount c;
    carve(c, g);
    return c.lines;
  }
  static std::size_t scratch_bytes(const DecodeGrid& g) {
    return scratch_request(scratch_lines(g));
  }

  /// The scores of the tile's rows against keys [j0, j0 + nk) by the team:
  /// one (row, key) pair per thread.
  KOKKOS_INLINE_FUNCTION void scores_generic(const member& m, int b, std::int64_t j0, int nk,
                                             int nr, int r0, index_type q0, TileKind kind,
                                             const T* qs, T* ss) const {
    const int D = g.dim, KT = g.key_tile;
    Kokkos::parallel_for(Kokkos::TeamThreadRange(m, nr * nk), [&](const int e) {
      const int r = e / nk, j = e % nk;
      const int kvh = (r0 + r) / (g.group * g.rows);
      const index_type kp = kpos(j0 + j);
      const index_type qp = q0 + (r0 + r) % g.rows;
      T s;
      if (kind == TileKind::partial && !mask.allowed(qp, kp)) {
        s = -infinity<T>();
      } else if (unit && !quant) {
        s = decode_dot(qs + std::size_t(r) * D, pages.row(k, b, j0 + j, kvh), D);
      } else {
        s = T(0);
        for (int d = 0; d < D; ++d)
          s += qs[std::size_t(r) * D + d] * kv_at(k, pages.kscale, b, j0 + j, kvh, d);
      }
      if constexpr (has_score_mod_v<Mask>)  // the allowed pairs' logits through the policy
        if (kind != TileKind::partial || mask.allowed(qp, kp))
          s = mask.score(s * ln2<T>, qp, kp, (r0 + r) / g.rows) * log2e<T>;
      ss[std::size_t(r) * KT + j] = s;
    });
  }

  KOKKOS_INLINE_FUNCTION void operator()(const member& m) const {
#if BLOCKATTN_SIMD_KERNELS
    if constexpr (host_vectors) {
      if (unit) {
#if BLOCKATTN_DECODE_AMX
        if constexpr (amx_capable)
          if (g.amx) {  // matrix_path() said tiles: the CPU has AMX and AVX-512
            AmxEntry::run([&] { run<DecodeVec512, false, true>(m); });
            return;
          }
#endif
#if BLOCKATTN_DECODE_BF16
        if constexpr (bf16_dot_capable)
          if (bf16_dot) {  // matrix_path() said vectors: the dispatched ISA is AVX-512
            AmxEntry::run([&] { run<DecodeVec512, true>(m); });
            return;
          }
#endif
#if BLOCKATTN_HOST_DISPATCH
        if constexpr (host_isa_targeted(HostIsa::avx512))
          if (isa == HostIsa::avx512) {
            HostIsaEntry<HostIsa::avx512>::run([&] { run<simd_for_t<HostIsa::avx512>>(m); });
            return;
          }
        if constexpr (host_isa_targeted(HostIsa::avx2))
          if (isa == HostIsa::avx2) {
            HostIsaEntry<HostIsa::avx2>::run([&] { run<simd_for_t<HostIsa::avx2>>(m); });
            return;
          }
#endif
        if constexpr (!std::is_void<simd_for_t<host_isa>>::value) {
          run<simd_for_t<host_isa>>(m);
          return;
        }
      }
    }
#endif
    run<void>(m);
  }

  /// One team's work; V: the vector class of the host tile products (void:
  /// the portable loops); Dot: the bf16 tile products (decode_bf16.hpp);
  /// Amx: the AMX tile products (decode_amx.hpp; the rows of one kv head).
  template <class V, bool Dot = false, bool Amx = false>
  KOKKOS_INLINE_FUNCTION void run(const member& m) const {
    std::int64_t t = m.league_rank();
    const int split = int(t % g.splits);
    t /= g.splits;
    const int rt = int(t % g.row_tiles);
    t /= g.row_tiles;
    const int kv_first = g.cross_heads ? 0 : int(t % g.kv_heads);
    const int b = g.cross_heads ? int(t) : int(t / g.kv_heads);
    const int splits = seq_splits.data() ? seq_splits(b) : g.splits;
    if (split >= splits) return;  // past this sequence's ranges (sequence_splits)
    const int D = g.dim, KT = g.key_tile, R = g.row_tile;
    const int group_rows = g.group * g.rows;
    // Rows r0 .. r0 + nr - 1 of the sequence's (DecodeGrid), of kv heads
    // kvh_lo .. kvh_hi.
    const int r0 = kv_first * group_rows + rt * R;
    const int nr = rt * R + R <= g.span_rows() ? R : g.span_rows() - rt * R;
    const int kvh_lo = r0 / group_rows, kvh_hi = (r0 + nr - 1) / group_rows;
    // f(kv head, its first row in the tile, its rows) for each kv head's run
    // of the tile's rows.
    const auto for_each_kv_head = [&](auto&& f) {
      for (int kvh = kvh_lo; kvh <= kvh_hi; ++kvh) {
        const int lo = kvh * group_rows - r0 > 0 ? kvh * group_rows - r0 : 0;
        const int hi = (kvh + 1) * group_rows - r0 < nr ? (kvh + 1) * group_rows - r0 : nr;
        f(kvh, lo, hi - lo);
      }
    };
    // f(first, count) for each run of adjacent slots of keys [j0, j0 + nk)
    // (the tile itself unless the cache is paged).
    [[maybe_unused]] const auto for_each_run = [&](const std::int64_t j0, const int nk, auto&& f) {
      for (int a = 0; a < nk;) {
        const std::int64_t e = pages.run_end(j0 + a) - j0;
        const int c = int(e < nk ? e : nk) - a;
        f(a, c);
        a += c;
      }
    };

    ScratchLines lines(m, 0, scratch_lines(g));
    const Scratch sp = carve(lines, g);
    T* const qs = sp.qs;
    T* const os = sp.os;
    T* const ss = sp.ss;
    T* const ms = sp.ms;     // R: running max (base 2)
    T* const ls = ms + R;    // R: running sum
    T* const as = ls + R;    // R: this tile's rescale factor
    T* const ones = as + R;  // R: 1 (a paged tile's later runs)
    [[maybe_unused]] T* const kvw = sp.kvw;
    // Dot: R x D q as stored, then R x p16_stride(g) P in bf16.
    [[maybe_unused]] std::uint16_t* const q16 = sp.q16;
    [[maybe_unused]] std::uint16_t* const p16 = sp.p16;
#if BLOCKATTN_DECODE_AMX
    [[maybe_unused]] const DecodeAmxScratch amx_sc{sp.amx, D, KT};
#endif

    const int len = lengths(b);
    // The split's keys from a multiple of 16 (tiles, and so the bf16 dot
    // products' key pairs, start where a paged cache's pages do).
    const std::int64_t k_begin = (std::int64_t(len) * split / splits) & ~std::int64_t(15);
    const std::int64_t k_end =
        split + 1 == splits ? len : (std::int64_t(len) * (split + 1) / splits) & ~std::int64_t(15);
    const index_type q0 = q_positions(b);

    // Row r of the tile: head (r0 + r) / rows, query (r0 + r) % rows.
    if constexpr (is_host_space_v<ExecSpace>) {
      // A row at a time (its indices once: per element, their divisions cost
      // a team of 256 in-cache keys as much as its products).
      Kokkos::parallel_for(Kokkos::TeamThreadRange(m, nr), [&](const int r) {
        const int h = (r0 + r) / g.rows, i = (r0 + r) % g.rows;
        T* const qr = qs + std::size_t(r) * D;
        T* const orow = os + std::size_t(r) * D;
        for (int d = 0; d < D; ++d) {
          qr[d] = T(to_compute(q(b, i, h, d))) * scale_log2;
          orow[d] = T(0);
        }
        if constexpr (Dot || Amx)
          for (int d = 0; d < D; ++d) q16[std::size_t(r) * D + d] = q(b, i, h, d).bits;
      });
    } else {
      Kokkos::parallel_for(Kokkos::TeamThreadRange(m, nr * D), [&](const int e) {
        const int r = e / D, d = e % D;
        const int h = (r0 + r) / g.rows, i = (r0 + r) % g.rows;
        qs[std::size_t(r) * D + d] = T(to_compute(q(b, i, h, d))) * scale_log2;
        os[std::size_t(r) * D + d] = T(0);
      });
    }
    Kokkos::parallel_for(Kokkos::TeamThreadRange(m, nr), [&](const int r) {
      ms[r] = -infinity<T>();
      ls[r] = T(0);
      ones[r] = T(1);
    });
    m.team_barrier();
#if BLOCKATTN_DECODE_AMX
    if constexpr (Amx) {  // the team's rows (one kv head) as Q^T tiles
      amx_configure();
      decode_amx_pack_q(q16, nr, D, amx_sc.qb());
    }
#endif

    // The query positions of the tile's rows, for classify.
    index_type qlo = q0 + g.rows, qhi = q0;
    for (int r = 0; r < nr; ++r) {
      const index_type p = q0 + (r0 + r) % g.rows;
      qlo = p < qlo ? p : qlo;
      qhi = p + 1 > qhi ? p + 1 : qhi;
    }

    for (std::int64_t j0 = k_begin; j0 < k_end; j0 += KT) {
      const int nk = int(k_end - j0 < KT ? k_end - j0 : KT);
      const TileKind kind = mask.classify(qlo, qhi, kpos(j0), kpos(j0 + nk - 1) + 1);
      if (kind == TileKind::empty) continue;
      [[maybe_unused]] DecodePrefetch next;  // the next tile's rows (host, unit strides)
      // Scores S = q k^T (base 2, scaled), masked to -inf.
      if constexpr (is_host_space_v<ExecSpace>) {
        if (unit && (!quant || !std::is_void<V>::value)) {  // 8-bit: the vectors' widened tiles
          // The next tile's keys and values (prefetch.hpp): decode streams K
          // and V once, and the prefetch keeps the loads ahead of this tile's
          // arithmetic (at the level decode_prefetch_level picked): asked for
          // key by key by the vector products that read K in place, else at
          // once here. The tiles ask for the next tile's rows into the
          // second-level cache, half during the scores and half during P V
          // (a Sapphire Rapids, bf16, 65 536 keys, D = 128, 1 and 2 threads:
          // 1.01-1.06x the rate of one first-level burst before the tile for
          // 8 query heads on 1 and 32 on 8, bench_decode, alternated; 1.04-1.1x
          // for 8 on 1 streaming from memory, 4 sequences; asking into the
          // first level ran 0.95-1.0x, a burst into the second 0.98x, none
          // 0.9x from memory and 1.1x from the last-level cache).
          const bool spread =
              !std::is_void<V>::value && !Dot && !widened_tiles && prefetch_spread != 0;
          next.level = spread ? (Amx ? 2 : prefetch_spread) : prefetch;
          if (next.level != 0 && j0 + KT < k_end) {
            // The rows of the tile's kv heads (adjacent where they are several:
            // decode_grid's cross_heads).
            if (pages.paged) {
              next.pages = &pages.table(b, 0);
              next.page_step = std::ptrdiff_t(pages.table.stride(1));
              next.first = j0 + KT;
              next.shift = pages.shift;
              next.k_page = std::size_t(k.stride(0)) * sizeof(S);
              next.v_page = std::size_t(v.stride(0)) * sizeof(S);
              next.k = reinterpret_cast<const char*>(&k(0, 0, kvh_lo, 0));
              next.v = reinterpret_cast<const char*>(&v(0, 0, kvh_lo, 0));
            } else {
              next.k = reinterpret_cast<const char*>(&k(b, int(j0 + KT), kvh_lo, 0));
              next.v = reinterpret_cast<const char*>(&v(b, int(j0 + KT), kvh_lo, 0));
            }
            next.k_stride = std::size_t(k.stride(1)) * sizeof(S);
            next.v_stride = std::size_t(v.stride(1)) * sizeof(S);
            next.bytes = std::size_t(kvh_hi - kvh_lo + 1) * std::size_t(D) * sizeof(S);
            next.rows = int(k_end - (j0 + KT) < KT ? k_end - (j0 + KT) : KT);
            if (!spread) {
              next.all();
              next.rows = 0;
            }
          }
          // Each kv head's rows against its keys, a run of adjacent rows at a
          // time (the tile, or its pages: decode_pages.hpp); the first asks
          // for the next tile's rows (next.row) as it goes.
          for_each_kv_head([&](const int kvh, const int lo, const int n) {
            if constexpr (Amx) {
#if BLOCKATTN_DECODE_AMX
              for_each_run(j0, nk, [&](const int a, const int c) {
                DecodePrefetch ask = kvh == kvh_lo ? next : DecodePrefetch{};
                ask.offset = a / 2;
                decode_scores_amx(amx_sc, n, pages.row(k, b, j0 + a, kvh), std::size_t(k.stride(1)),
                                  c, scale_log2, ss + std::size_t(lo) * KT + a, KT, ask);
              });
#endif
            } else if constexpr (Dot) {
#if BLOCKATTN_DECODE_BF16
              for_each_run(j0, nk, [&](const int a, const int c) {
                decode_scores_bf16(q16 + std::size_t(lo) * D, n,
                                   &pages.row(k, b, j0 + a, kvh)->bits, std::size_t(k.stride(1)), c,
                                   D, scale_log2, ss + std::size_t(lo) * KT + a, KT);
              });
#endif
            } else if constexpr (!std::is_void<V>::value) {
#if BLOCKATTN_SIMD_KERNELS
              if constexpr (widened_tiles) {
                for (int j = 0; j < nk; ++j)
                  widen_row(kvw + std::size_t(j) * D, k, pages.kscale, b, j0 + j, kvh, D);
                decode_scores_simd<V>(qs + std::size_t(lo) * D, n, static_cast<const T*>(kvw),
                                      std::size_t(D), nk, D, ss + std::size_t(lo) * KT, KT,
                                      DecodePrefetch{});
              } else {
                for_each_run(j0, nk, [&](const int a, const int c) {
                  DecodePrefetch ask = kvh == kvh_lo ? next : DecodePrefetch{};
                  ask.offset = a;
                  decode_scores_simd<V>(qs + std::size_t(lo) * D, n, pages.row(k, b, j0 + a, kvh),
                                        std::size_t(k.stride(1)), c, D,
                                        ss + std::size_t(lo) * KT + a, KT, ask);
                });
              }
#endif
            } else {
              const auto key = [&](int j) -> const S* { return pages.row(k, b, j0 + j, kvh); };
              for (int r = lo; r < lo + n; ++r)
                host_scores<T, S>(qs + std::size_t(r) * D, key, nk, D, ss + std::size_t(r) * KT);
            }
          });
          if constexpr (quant)  // each key's scores times its scale
            for_each_kv_head([&](const int kvh, const int lo, const int n) {
              for (int j = 0; j < nk; ++j) {
                const T sc = T(pages.scale(pages.kscale, b, j0 + j, kvh));
                for (int r = lo; r < lo + n; ++r) ss[std::size_t(r) * KT + j] *= sc;
              }
            });
          if constexpr (has_score_mod_v<Mask>)
            for (int r = 0; r < nr; ++r) {
              const index_type qp = q0 + (r0 + r) % g.rows;
              const int h = (r0 + r) / g.rows;
              T* const sr = ss + std::size_t(r) * KT;
              for (int j = 0; j < nk; ++j)
                sr[j] = mask.score(sr[j] * ln2<T>, qp, kpos(j0 + j), h) * log2e<T>;
            }
          if (kind == TileKind::partial)
            for (int r = 0; r < nr; ++r) {
              const index_type qp = q0 + (r0 + r) % g.rows;
              for (int j = 0; j < nk; ++j)
                if (!mask.allowed(qp, kpos(j0 + j))) ss[std::size_t(r) * KT + j] = -infinity<T>();
            }
        } else {
          scores_generic(m, b, j0, nk, nr, r0, q0, kind, qs, ss);
        }
      } else {
        scores_generic(m, b, j0, nk, nr, r0, q0, kind, qs, ss);
      }
      m.team_barrier();
      // Online softmax per row: m' = max(m, max S), P = 2^(S - m'), l = a l + sum P.
#if BLOCKATTN_SIMD_KERNELS
      if constexpr (!std::is_void<V>::value) {  // run<V> runs for unit strides only
        decode_softmax_rows<V>(ss, KT, nr, nk, ms, ls, as);
      } else
#endif
      {
        Kokkos::parallel_for(Kokkos::TeamThreadRange(m, nr), [&](const int r) {
          T* sr = ss + std::size_t(r) * KT;
          T mx = -infinity<T>();
          for (int j = 0; j < nk; ++j) mx = sr[j] > mx ? sr[j] : mx;
          bool nan = false;
          for (int j = 0; j < nk; ++j) nan = nan || sr[j] != sr[j];
          const T mn = mx > ms[r] ? mx : ms[r];
          if (mn == -infinity<T>() && !nan) {  // no allowed key yet: nothing to add
            as[r] = T(1);
            for (int j = 0; j < nk; ++j) sr[j] = T(0);
            return;
          }
          // A row with only NaN scores so far has mn = -inf: its P are NaN (kept).
          const T a = ms[r] == -infinity<T>() ? T(0) : kmath::exp2(ms[r] - mn);
          T sum = T(0);
          for (int j = 0; j < nk; ++j) {
            const T p = exp2_nonpositive(sr[j] - mn);  // 0 for a masked (-inf) score
            sr[j] = p;
            sum += p;
          }
          ls[r] = ls[r] * a + sum;
          ms[r] = mn;
          as[r] = a;
        });
      }
      m.team_barrier();
      // O = a O + P V.
      if constexpr (is_host_space_v<ExecSpace>) {
        if (unit && (!quant || !std::is_void<V>::value)) {
          if constexpr (quant)  // each value's P times its scale (l has the P)
            for_each_kv_head([&](const int kvh, const int lo, const int n) {
              for (int j = 0; j < nk; ++j) {
                const T sc = T(pages.scale(pages.vscale, b, j0 + j, kvh));
                for (int r = lo; r < lo + n; ++r) ss[std::size_t(r) * KT + j] *= sc;
              }
            });
          // O = a O + P V run by run: the later runs rescale by 1 (exact).
          for_each_kv_head([&](const int kvh, const int lo, const int n) {
            if constexpr (Amx) {
#if BLOCKATTN_DECODE_AMX
              // The whole tile at once (its sums whatever pages hold it).
              const auto vrow = [&](const int j) { return pages.row(v, b, j0 + j, kvh); };
              decode_pv_amx<S>(amx_sc, os + std::size_t(lo) * D, as + lo, ss + std::size_t(lo) * KT,
                               KT, n, vrow, nk, kvh == kvh_lo ? next : DecodePrefetch{});
#endif
            } else if constexpr (Dot) {
#if BLOCKATTN_DECODE_BF16
              for_each_run(j0, nk, [&](const int a, const int c) {
                decode_pv_bf16(os + std::size_t(lo) * D, (a == 0 ? as : ones) + lo,
                               ss + std::size_t(lo) * KT + a, KT, n,
                               &pages.row(v, b, j0 + a, kvh)->bits, std::size_t(v.stride(1)), c, D,
                               p16 + std::size_t(lo) * p16_stride(g), p16_stride(g));
              });
#endif
            } else if constexpr (!std::is_void<V>::value) {
#if BLOCKATTN_SIMD_KERNELS
              if constexpr (widened_tiles) {
                for (int j = 0; j < nk; ++j)
                  widen_row(kvw + std::size_t(j) * D, v, pages.vscale, b, j0 + j, kvh, D);
                decode_pv_simd<V>(os + std::size_t(lo) * D, as + lo, ss + std::size_t(lo) * KT, KT,
                                  n, static_cast<const T*>(kvw), std::size_t(D), nk, D);
              } else {
                for_each_run(j0, nk, [&](const int a, const int c) {
                  decode_pv_simd<V>(os + std::size_t(lo) * D, (a == 0 ? as : ones) + lo,
                                    ss + std::size_t(lo) * KT + a, KT, n,
                                    pages.row(v, b, j0 + a, kvh), std::size_t(v.stride(1)), c, D);
                });
              }
#endif
            } else {
              const auto value = [&](int j) -> const S* { return pages.row(v, b, j0 + j, kvh); };
              for (int r = lo; r < lo + n; ++r)
                host_pv<T, S>(os + std::size_t(r) * D, as[r], ss + std::size_t(r) * KT, value, nk,
                              D);
            }
          });
        } else {
          for (int r = 0; r < nr; ++r) {
            const int kvh = (r0 + r) / group_rows;
            T* orow = os + std::size_t(r) * D;
            const T* pr = ss + std::size_t(r) * KT;
            for (int d = 0; d < D; ++d) {
              T acc = orow[d] * as[r];
              for (int j = 0; j < nk; ++j)
                if (pr[j] != T(0)) acc += pr[j] * kv_at(v, pages.vscale, b, j0 + j, kvh, d);
              orow[d] = acc;
            }
          }
        }
      } else {
        Kokkos::parallel_for(Kokkos::TeamThreadRange(m, nr * D), [&](const int e) {
          const int r = e / D, d = e % D;
          const int kvh = (r0 + r) / group_rows;
          const T* pr = ss + std::size_t(r) * KT;
          T acc = os[e] * as[r];
          for (int j = 0; j < nk; ++j)
            if (pr[j] != T(0)) acc += pr[j] * kv_at(v, pages.vscale, b, j0 + j, kvh, d);
          os[e] = acc;
        });
      }
      m.team_barrier();
    }

#if BLOCKATTN_DECODE_AMX
    if constexpr (Amx) amx_release();
#endif
    // Out: the open state of this split, or the normalised row.
    Kokkos::parallel_for(Kokkos::TeamThreadRange(m, nr), [&](const int r) {
      const int h = (r0 + r) / g.rows, i = (r0 + r) % g.rows;
      const T* orow = os + std::size_t(r) * D;
      if (splits == 1) {
        // The sink in the normalisation: O rounded once into a 16-bit o.
        T f;
        lse(b, h, i) = fold_sink(SoftmaxRow<T>::lse(ms[r], ls[r]), sink_of<T>(sinks, h), f);
        const T inv = SoftmaxRow<T>::inverse_sum(ls[r]);
        for (int d = 0; d < D; ++d) o(b, i, h, d) = OS(orow[d] * inv * f);
      } else {
        const std::int64_t row = (std::int64_t(b) * g.heads + h) * g.rows + i;
        const std::int64_t at = std::int64_t(split) * g.state_rows() + row;
        part_m(at) = ms[r];
        part_l(at) = ls[r];
        for (int d = 0; d < D; ++d) part_o(at * D + d) = orow[d];
      }
    });
  }
};

}  // namespace impl
}  // namespace blockattn
