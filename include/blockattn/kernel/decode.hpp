// SPDX-License-Identifier: Apache-2.0
// Serving on one device: split-KV decode (a few query rows per sequence
// against a long key cache, the keys cut over teams and merged) and the
// public merge of partial results (O, LSE) over disjoint key sets.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/errors.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/kernel/invariant/invariant_forward.hpp>
#include <blockattn/kernel/options.hpp>
#include <blockattn/kernel/portable/decode_kernel.hpp>
#include <blockattn/kernel/portable/decode_merge.hpp>
#include <blockattn/kernel/tile_shape.hpp>
#include <blockattn/kernel/validate.hpp>
#include <blockattn/policy/mask.hpp>
#include <blockattn/policy/positions.hpp>
#include <blockattn/policy/score.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

namespace blockattn {

/// Run-time options of attention_decode.
struct DecodeOptions {
  /// Softmax scale; NaN (the default) means 1 / sqrt(head_dim).
  double scale = std::numeric_limits<double>::quiet_NaN();
  /// Key ranges per (sequence, kv head); 0: chosen from the device's
  /// concurrency and the longest cache (at most 64).
  int splits = 0;
  /// The longest cache length if the caller knows it (>= every lengths(b));
  /// -1: read from `lengths` (a reduction, which waits for the device).
  index_type max_length = -1;
  /// Key ranges of each sequence (batch entries of 1 .. 64), in the
  /// execution space's memory; empty: `splits` (or the automatic choice) for
  /// every sequence. A sequence's results depend on its own ranges, rows and
  /// keys only: sequences given the ranges calls of their own would take
  /// get those calls' bits in one launch.
  Kokkos::View<const int*, Kokkos::AnonymousSpace> sequence_splits;
  /// Attention sinks (kernel/sinks.hpp): one fp32 logit per query head, in
  /// the execution space's memory, folded into the rows' results. Empty: none.
  SinkLogits sinks;
  /// bf16 caches on host spaces: the tile products on AVX512-BF16 dot
  /// products where the host matrix engine runs vectors for this setting
  /// (HostMatrix; automatic: AMD Zen 4 and later, BLOCKATTN_HOST_MATRIX), P
  /// rounded to bf16 before P V as in the forward's engine; off: the fp32
  /// vector products (bf16 widened as it is loaded). AMX tiles do not run
  /// decode: on AMX CPUs automatic keeps the fp32 vectors.
  HostMatrix host_matrix = HostMatrix::automatic;
  /// The invariant mode (ForwardOptions::invariant, docs/numerics.md): each
  /// row's O and LSE the bits of attention_forward's invariant mode (and of
  /// prefill_attention's, decode_attention's) with the same invariant_tile
  /// over the same keys, however long the cache. Runs sequence by sequence
  /// on the invariant kernels (splits, sequence_splits and host_matrix do
  /// not apply); o of the storage type for the bits of attention_forward's
  /// 16-bit output. 8-bit caches have none (attention_decode_quantized throws).
  bool invariant = false;
  int invariant_tile = 64;
};

namespace impl {

/// q, k, v of one value type S; o of S or of its compute type (fp32 partials
/// of 16-bit inputs, for a merge that rounds once); lse of the compute type.
template <class QV, class KV, class VV, class OV, class LV>
constexpr bool decode_views_ok() {
  if constexpr (Kokkos::is_view<QV>::value && Kokkos::is_view<KV>::value &&
                Kokkos::is_view<VV>::value && Kokkos::is_view<OV>::value &&
                Kokkos::is_view<LV>::value) {
    using S = value_of<QV>;
    using O = value_of<OV>;
    return QV::rank == 4 && KV::rank == 4 && VV::rank == 4 && OV::rank == 4 && LV::rank == 3 &&
           is_value_type_v<S> && std::is_same<value_of<KV>, S>::value &&
           std::is_same<value_of<VV>, S>::value &&
           (std::is_same<O, S>::value || std::is_same<O, compute_t<S>>::value) &&
           std::is_same<value_of<LV>, compute_t<S>>::value &&
           !std::is_const<typename OV::value_type>::value &&
           !std::is_const<typename LV::value_type>::value;
  } else {
    return false;
  }
}

template <class QV, class KV, class VV, class OV, class LV>
constexpr void check_decode_view_types() {
  static_assert(decode_views_ok<QV, KV, VV, OV, LV>(),
                "BlockAttn: attention_decode takes Kokkos::Views q, k, v, o (rank 4) and lse "
                "(rank 3); q, k, v of one value type (float, double, bf16, fp16), o of it or of "
                "its compute type, lse of the compute type (float for float, bf16, fp16)");
}

/// Whether attention_decode on ExecSpace over S storage (unit stride in the
/// head dim) runs the AVX512-BF16 dot products (host/decode_bf16.hpp) for
/// `setting`: bf16 on a host space where the host matrix engine runs vectors.
template <class ExecSpace, class S>
bool decode_uses_bf16_dot(HostMatrix setting) {
#if BLOCKATTN_DECODE_BF16
  if constexpr (is_host_space_v<ExecSpace> && std::is_same<S, bf16>::value)
    return matrix_path(setting) == MatrixPath::vectors;
#endif
  (void)setting;
  return false;
}

/// Whether attention_decode on ExecSpace with QS queries over S storage can
/// run a GQA group's rows on AMX tiles (host/decode_amx.hpp) for `setting`:
/// bf16 queries, a bf16 or 8-bit cache, a host space whose matrix engine
/// runs tiles (the launch also asks for unit strides, a head dim of whole
/// 32-element chunks, 2 or more rows per kv head and teams of one kv head).
template <class ExecSpace, class QS, class S>
bool decode_may_use_amx(HostMatrix setting) {
#if BLOCKATTN_DECODE_AMX
  if constexpr (is_host_space_v<ExecSpace> && std::is_same<QS, bf16>::value &&
                (std::is_same<S, bf16>::value || is_kv_quant_v<S>))
    return matrix_path(setting) == MatrixPath::tiles;
#endif
  (void)setting;
  return false;
}

/// Whether bf16 decode may round P to bf16 before P V (the dot products or
/// the tiles) for `setting`: the tests' bound.
template <class ExecSpace, class S>
bool decode_rounds_p(HostMatrix setting) {
  return decode_uses_bf16_dot<ExecSpace, S>(setting) ||
         decode_may_use_amx<ExecSpace, bf16, S>(setting);
}

/// The smallest and largest of `len` (waits for exec). A function of its own:
/// nvcc takes no extended lambda that first captures inside `if constexpr`.
template <class ExecSpace, class LenV>
void length_range(const ExecSpace& exec, const LenV& len, int& lo, int& hi) {
  lo = 0;
  hi = 0;
  Kokkos::parallel_reduce(
      "blockattn::decode_lengths", Kokkos::RangePolicy<ExecSpace>(exec, 0, int(len.extent(0))),
      KOKKOS_LAMBDA(const int b, int& mn, int& mx) {
        mn = len(b) < mn ? len(b) : mn;
        mx = len(b) > mx ? len(b) : mx;
      },
      Kokkos::Min<int>(lo), Kokkos::Max<int>(hi));
}

/// The work cut of one decode call (host side).
template <class T, class ExecSpace>
DecodeGrid decode_grid(const ExecSpace& exec, const BlockExtents& e, index_type max_len,
                       int requested_splits, bool cross_heads = false) {
  DecodeGrid g;
  g.cross_heads = cross_heads;
  g.batch = e.batch;
  g.heads = e.heads;
  g.kv_heads = e.kv_heads;
  g.rows = e.queries;
  g.dim = e.dim;
  g.group = e.heads / e.kv_heads;
  g.key_tile = 32;
  const int span = g.span_rows();
  // Rows per team: as many as keep the team's scratch (2 x rows x dim values)
  // near 32 KB, at most 16.
  const int per_row = 2 * e.dim + g.key_tile + 3;
  const int cap = std::max(1, int(32768 / (sizeof(T) * std::size_t(per_row))));
  g.row_tile = std::min({span, 16, cap});
  g.row_tiles = (span + g.row_tile - 1) / g.row_tile;
  constexpr bool host = is_host_space_v<ExecSpace>;
  g.team_size = host ? 1 : 128;
  if (requested_splits > 0) {
    g.splits = std::min(requested_splits, max_decode_splits);
  } else {
    const std::int64_t base = g.league() / g.splits;
    const std::int64_t target = host ? 4 * std::int64_t(exec.concurrency())
                                     : std::max<std::int64_t>(1, exec.concurrency() / 64);
    const std::int64_t by_work = (target + base - 1) / base;
    const std::int64_t by_keys = std::max<std::int64_t>(1, (max_len + 255) / 256);
    g.splits = int(std::max<std::int64_t>(
        1, std::min<std::int64_t>({by_work, by_keys, std::int64_t(max_decode_splits)})));
  }
  return g;
}
}  // namespace impl

namespace impl {
/// A host copy of DecodeOptions::sequence_splits (in Mem).
template <class Mem>
auto sequence_splits_on_host(const Kokkos::View<const int*, Kokkos::AnonymousSpace>& s) {
  const Kokkos::View<const int*, Mem, Kokkos::MemoryTraits<Kokkos::Unmanaged>> d(s.data(),
                                                                                 s.extent(0));
  return Kokkos::create_mirror_view_and_copy(Kokkos::HostSpace(), d);
}

/// Whether a decode team's rows span kv heads: host spaces, keys and values
/// sequence-major with unit stride ((batch, keys, kv_heads, dim), each
/// key's kv heads adjacent).
template <class ExecSpace, class KV, class VV>
bool decode_cross_heads(const KV& k, const VV& v, int kv_heads, int dim) {
  const bool unit = k.extent(3) <= 1 || (k.stride(3) == 1 && v.stride(3) == 1);
  return is_host_space_v<ExecSpace> && unit && kv_heads > 1 &&
         std::size_t(k.stride(2)) == std::size_t(dim) &&
         std::size_t(v.stride(2)) == std::size_t(dim);
}

/// What decode_checks read for the launch: the longest cache
/// (opts.max_length, or read from lengths) and the most key ranges of any
/// sequence (opts.sequence_splits; 0 without).
struct DecodeChecked {
  index_type max_len = 0;
  int most_splits = 0;
};

/// The checks attention_decode and attention_decode_paged share (after
/// validate_forward's): lengths, q_positions, splits, mask and sinks; the
/// longest cache at most `capacity` (named `cap_name`).
template <class ExecSpace, class QV, class LenV, class PosV, class Mask>
DecodeChecked decode_checks(const ExecSpace& exec, const char* fn, const BlockExtents& e,
                            const QV& q, const LenV& lengths, const PosV& q_positions,
                            const Mask& mask, const DecodeOptions& opts, const char* cap_name,
                            index_type capacity) {
  using mem = typename ExecSpace::memory_space;
  if (e.queries == 0) fail(fn, "argument 'q' has extent(1) (rows) = 0, expected >= 1");
  require_accessible<ExecSpace, typename LenV::memory_space>(fn, "lengths");
  require_accessible<ExecSpace, typename PosV::memory_space>(fn, "q_positions");
  require_extent(fn, "lengths", lengths, 0, "batch", q.extent(0), "the batch of q");
  require_extent(fn, "q_positions", q_positions, 0, "batch", q.extent(0), "the batch of q");
  if (opts.splits < 0 || opts.splits > max_decode_splits)
    fail(fn, "argument 'opts.splits' is ", opts.splits, ", expected 0 (automatic) .. ",
         max_decode_splits);
  int most_splits = 0;
  if (opts.sequence_splits.data() != nullptr) {
    require_extent(fn, "opts.sequence_splits", opts.sequence_splits, 0, "batch", q.extent(0),
                   "the batch of q");
    const auto h = sequence_splits_on_host<mem>(opts.sequence_splits);
    for (std::size_t b = 0; b < h.extent(0); ++b) {
      if (h(b) < 1 || h(b) > max_decode_splits)
        fail(fn, "argument 'opts.sequence_splits' holds ", h(b), " at ", b, ", expected 1 .. ",
             max_decode_splits);
      most_splits = std::max(most_splits, h(b));
    }
  }
  index_type max_len = opts.max_length;
  if (max_len < 0) {
    int lo = 0, hi = 0;
    length_range(exec,
                 Kokkos::View<const int*, mem, Kokkos::MemoryTraits<Kokkos::Unmanaged>>(lengths),
                 lo, hi);
    if (lo < 0) fail(fn, "argument 'lengths' holds ", lo, ", expected >= 0");
    max_len = hi;
  }
  if (max_len > capacity)
    fail(fn, "argument 'lengths' holds ", max_len, " keys, expected at most ", cap_name, " = ",
         capacity, " (the cache's capacity)");
  if (const std::string why = score_check(mask, e.heads); !why.empty())
    fail(fn, "argument 'mask': ", why);
  check_sinks(fn, opts.sinks, SinkGradient(), e.heads, false);
  return DecodeChecked{max_len, most_splits};
}

/// The launch of attention_decode (and of attention_decode_paged: k, v the
/// pools, `pages` the block table), after the checks (e, `checked`).
template <class ExecSpace, class QV, class KV, class VV, class LenV, class PosV, class OV, class LV,
          class Mask, class KPos>
void decode_launch(const ExecSpace& exec, const BlockExtents& e, const DecodeChecked& checked,
                   const QV& q, const KV& k, const VV& v, const LenV& lengths,
                   const PosV& q_positions, const OV& o, const LV& lse, const Mask& mask,
                   const KPos& kpos, const DecodeOptions& opts,
                   const DecodePages<typename ExecSpace::memory_space>& pages) {
  using QS = typename QV::non_const_value_type;
  using S = typename KV::non_const_value_type;  // QS, or an 8-bit type (pages.kscale)
  using OS = typename OV::non_const_value_type;
  using T = compute_t<QS>;
  using mem = typename ExecSpace::memory_space;
  const T scale = impl::softmax_scale<T>(opts.scale, e.dim);
  const bool unit = k.extent(3) <= 1 || (k.stride(3) == 1 && v.stride(3) == 1);
  // Host, sequence-major rows ((batch, keys, kv_heads, dim), each key's kv
  // heads adjacent): a team's rows run over kv heads, and it reads each key's
  // rows of its kv heads at once. Per kv head, a team read D values out of
  // every kv_heads x D; on a Zen 3 (65 536 keys, 8/8, 32/8 and 16/16 heads,
  // fp32 and bf16, 1 and 2 threads) the teams over kv heads ran 1.4-1.9x
  // faster.
  const bool cross_heads = impl::decode_cross_heads<ExecSpace>(k, v, e.kv_heads, e.dim);
  impl::DecodeGrid g = impl::decode_grid<T>(exec, e, checked.max_len, opts.splits, cross_heads);
  Kokkos::View<const int*, mem, Kokkos::MemoryTraits<Kokkos::Unmanaged>> seq_splits;
  if (opts.sequence_splits.data() != nullptr) {
    // The launch covers the most ranges of any sequence; each team past its
    // sequence's ranges returns at once.
    g.splits = checked.most_splits;
    seq_splits = decltype(seq_splits)(opts.sequence_splits.data(), opts.sequence_splits.extent(0));
  }

  impl::DecodeKernel<ExecSpace, T, QS, S, OS, Mask, KPos> kern;
  kern.q = q;
  kern.k = k;
  kern.v = v;
  kern.o = o;
  kern.lse = lse;
  kern.lengths = lengths;
  kern.q_positions = q_positions;
  kern.mask = mask;
  kern.kpos = kpos;
  kern.pages = pages;
  kern.seq_splits = seq_splits;
  if (opts.sinks.data() != nullptr)
    kern.sinks = impl::sink_view<mem>(opts.sinks.data(), opts.sinks.extent(0));
  kern.scale_log2 = scale * impl::log2e<T>;
  kern.unit = unit;
  if constexpr (impl::is_host_space_v<ExecSpace>) {
    const bool stream = kern.unit && std::size_t(k.stride(1)) == std::size_t(e.dim) &&
                        std::size_t(v.stride(1)) == std::size_t(e.dim);
    kern.isa = impl::dispatched_host_isa();
    // One row per kv head over keys that stream (heads-major, contiguous):
    // the read bounds the step, and the fp32 vectors ran it 5-8 % faster
    // than the dot products on a 2-core Zen 4 (bf16, 8 heads at D = 128,
    // 16 at D = 64, 65 536 keys); the other shapes measured ran 1.03-1.8x
    // faster on the dot products (GQA groups 1.2-1.8x; decode_bf16.hpp).
    kern.bf16_dot = std::is_same<QS, S>::value &&
                    impl::decode_uses_bf16_dot<ExecSpace, S>(opts.host_matrix) &&
                    !(stream && g.group * g.rows == 1);
    // A GQA group's rows (2 or more per kv head) on AMX tiles: each tile
    // product serves all the group's rows (the vectors pay a dot product and
    // a horizontal sum per row and key); tiles of 128 keys. 8-bit codes are
    // widened to bf16 first (K's through scratch): from 8 rows per kv head
    // (8 query heads on 1: 1.2-1.45x the vectors' rate), not below (32 on
    // 8: 0.6-0.7x; 65 536 keys, 1 thread, a Sapphire Rapids).
    g.amx = kern.unit && !cross_heads && g.group * g.rows >= (is_kv_quant_v<S> ? 8 : 2) &&
            impl::decode_amx_dim(e.dim) &&
            impl::decode_may_use_amx<ExecSpace, QS, S>(opts.host_matrix);
    if (g.amx) g.key_tile = 128;
    // bf16 rows that stream, on the fp32 vectors: tiles of 128 keys (each
    // tile's fixed work over 4x the keys; a Zen 3, 65 536 keys, 8/8, 16/16
    // and 32/8 heads, D = 64 and 128: 1.0-1.23x the rate of 32-key tiles;
    // fp32 tiles of 64 or 128 keys ran 0.88-1.05x, so fp32 keeps 32).
    if ((std::is_same<S, bf16>::value || is_kv_quant_v<S>)&&stream && !kern.bf16_dot)
      g.key_tile = 128;
    const std::size_t tile_bytes = 2 * std::size_t(g.key_tile) * std::size_t(e.dim) * sizeof(S);
    kern.prefetch = impl::decode_prefetch_level(stream, tile_bytes, false, kern.bf16_dot);
    // Spread over the tile products where the rows stream or a team reads
    // its kv heads' adjacent rows (cross_heads); other strided rows keep
    // the burst (per kv head, sequence-major rows ran 0.77-1.2x its rate
    // spread on a Zen 3, bench_decode, fp32 and bf16).
    kern.prefetch_spread =
        stream || cross_heads ? impl::decode_prefetch_level(true, tile_bytes, true) : 0;
  }
  if (g.splits > 1) {
    const std::int64_t n = g.splits * g.state_rows();
    kern.part_o = Kokkos::View<T*, mem>(
        Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::decode_o"), n * e.dim);
    kern.part_m = Kokkos::View<T*, mem>(
        Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::decode_m"), n);
    kern.part_l = Kokkos::View<T*, mem>(
        Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::decode_l"), n);
  }
  kern.g = g;
  using Policy = Kokkos::TeamPolicy<ExecSpace, Kokkos::Schedule<Kokkos::Dynamic>>;
  Policy policy(exec, int(g.league()), g.team_size);
  policy.set_scratch_size(0, Kokkos::PerTeam(kern.scratch_bytes(g)));
  Kokkos::parallel_for("blockattn::decode", policy, kern);
  if (g.splits > 1) {
    impl::DecodeMerge<ExecSpace, T, OS> merge{kern.o,      kern.lse, kern.part_o, kern.part_m,
                                              kern.part_l, g,        kern.sinks,  seq_splits};
    Kokkos::parallel_for(
        "blockattn::decode_merge",
        Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(exec, 0, g.state_rows()),
        merge);
  }
}
}  // namespace impl

/// Attention of a few query rows per sequence against a key cache, the keys
/// of each (sequence, kv head) split over teams and merged (FlashDecoding).
///
///   q           (batch, rows, heads, head_dim)      the new tokens' queries
///   k, v        (batch, capacity, kv_heads, head_dim)  any layout; slots
///               0 .. lengths(b) - 1 of sequence b are its cached keys
///   lengths     View<int*> (batch): cached keys per sequence (0: none)
///   q_positions View<index_type*> (batch): global position of row 0 of
///               sequence b (its rows are q_positions(b) + i)
///   o, lse      (batch, rows, heads, head_dim), (batch, heads, rows)
///   mask        on global positions: query q_positions(b) + i, key kpos(j)
///   kpos        slot j -> global position (strictly increasing); default j
///
/// A row that sees no key (an empty cache, or a mask that allows none) gets
/// O = 0 and LSE = -inf (LSE = its head's sink with opts.sinks); NaN in a
/// visible key or query makes the row NaN. Sinks are folded into the
/// normalisation: a 16-bit o is rounded once.
/// Value types as attention_forward (q, k, v, o alike; lse of compute type).
/// Work is enqueued on `exec` (a reduction over `lengths` waits for it
/// unless opts.max_length is given).
template <class ExecSpace, class QV, class KV, class VV, class LenV, class PosV, class OV, class LV,
          class Mask = FullMask, class KPos = OffsetPositions,
          class = std::enable_if_t<Kokkos::is_execution_space<ExecSpace>::value>>
void attention_decode(const ExecSpace& exec, const QV& q, const KV& k, const VV& v,
                      const LenV& lengths, const PosV& q_positions, const OV& o, const LV& lse,
                      const Mask& mask = {}, const KPos& kpos = {},
                      const DecodeOptions& opts = {}) {
  impl::check_decode_view_types<QV, KV, VV, OV, LV>();
  impl::check_mask_policy<Mask>();
  impl::check_position_map<KPos>();
  static_assert(Kokkos::is_view<LenV>::value && LenV::rank == 1 &&
                    std::is_same<typename LenV::non_const_value_type, int>::value,
                "BlockAttn: attention_decode's lengths must be a rank-1 View of int (batch)");
  static_assert(Kokkos::is_view<PosV>::value && PosV::rank == 1 &&
                    std::is_same<typename PosV::non_const_value_type, index_type>::value,
                "BlockAttn: attention_decode's q_positions must be a rank-1 View of "
                "blockattn::index_type (batch)");
  if constexpr (impl::decode_views_ok<QV, KV, VV, OV, LV>() && is_mask_policy_v<Mask>) {
    using mem = typename ExecSpace::memory_space;
    const char* fn = "attention_decode";
    // k may have no slot (an empty cache): only q's extents must be positive.
    const BlockExtents e = impl::validate_forward<ExecSpace>(fn, q, k, v, o, lse, opts.scale, true);
    const impl::DecodeChecked checked = impl::decode_checks(
        exec, fn, e, q, lengths, q_positions, mask, opts, "k.extent(1)", index_type(k.extent(1)));
    if (opts.invariant)
      return impl::invariant_decode(fn, exec, e, q, k, v, lengths, q_positions, o, lse, mask, kpos,
                                    opts, impl::DecodePages<mem>{});
    impl::decode_launch(exec, e, checked, q, k, v, lengths, q_positions, o, lse, mask, kpos, opts,
                        impl::DecodePages<mem>{});
  }
}

/// Same, on a default-constructed instance of the Views' execution space.
template <class QV, class KV, class VV, class LenV, class PosV, class OV, class LV,
          class Mask = FullMask, class KPos = OffsetPositions,
          class = std::enable_if_t<Kokkos::is_view<QV>::value>>
void attention_decode(const QV& q, const KV& k, const VV& v, const LenV& lengths,
                      const PosV& q_positions, const OV& o, const LV& lse, const Mask& mask = {},
                      const KPos& kpos = {}, const DecodeOptions& opts = {}) {
  attention_decode(typename OV::execution_space{}, q, k, v, lengths, q_positions, o, lse, mask,
                   kpos, opts);
}

namespace impl {
/// Row (b, i, h) of the merge of `parts` partial results: get_o(s, d),
/// get_lse(s) read part s. LSE = -inf parts add nothing, a NaN LSE makes the
/// row NaN, no part with a key gives O = 0, LSE = -inf. `sink` (the head's
/// sink logit, -inf: none) is folded into the normalisation (fold_sink): one
/// more part with LSE = sink and O = 0, and set_o gets O once.
template <class T, class GetO, class GetL, class SetO>
KOKKOS_INLINE_FUNCTION T merge_row(int parts, int dim, const GetO& get_o, const GetL& get_lse,
                                   const SetO& set_o, T sink) {
  T mx = -infinity<T>();
  bool nan = false;
  for (int s = 0; s < parts; ++s) {
    const T l = get_lse(s);
    if (l != l) nan = true;
    mx = l > mx ? l : mx;
  }
  T f;
  if (nan) {
    for (int d = 0; d < dim; ++d) set_o(d, quiet_nan<T>());
    return quiet_nan<T>();
  }
  if (mx == -infinity<T>()) {
    for (int d = 0; d < dim; ++d) set_o(d, T(0));
    return fold_sink(-infinity<T>(), sink, f);
  }
  T sum = T(0);
  for (int s = 0; s < parts; ++s) sum += kmath::exp(get_lse(s) - mx);
  const T out = fold_sink(mx + kmath::log(sum), sink, f);
  const T inv = T(1) / sum;
  for (int d = 0; d < dim; ++d) {
    T acc = T(0);
    for (int s = 0; s < parts; ++s) {
      const T w = kmath::exp(get_lse(s) - mx);
      if (w != T(0)) acc += w * T(to_compute(get_o(s, d)));
    }
    set_o(d, acc * inv * f);
  }
  return out;
}
/// Same without a sink.
template <class T, class GetO, class GetL, class SetO>
KOKKOS_INLINE_FUNCTION T merge_row(int parts, int dim, const GetO& get_o, const GetL& get_lse,
                                   const SetO& set_o) {
  return merge_row<T>(parts, dim, get_o, get_lse, set_o, -infinity<T>());
}

template <class OPV, class LPV, class OV, class LV>
constexpr void check_merge_views() {
  static_assert(Kokkos::is_view<OPV>::value && Kokkos::is_view<LPV>::value &&
                    Kokkos::is_view<OV>::value && Kokkos::is_view<LV>::value,
                "BlockAttn: merge_attention takes Kokkos::Views");
}
}  // namespace impl

/// Merges `n` partial results of the same query rows over disjoint key sets
/// (each a normalised O and its natural-log LSE, e.g. one per rank or per
/// key split) into the result over all their keys:
///   M = max_s lse_s,  O = sum_s e^(lse_s - M) O_s / sum_s e^(lse_s - M),
///   LSE = M + ln sum_s e^(lse_s - M).
///   o_parts   (n, batch, rows, heads, head_dim)
///   lse_parts (n, batch, heads, rows)          compute type of the values
///   o, lse    (batch, rows, heads, head_dim), (batch, heads, rows)
/// Exact for parts that saw no key (LSE = -inf adds nothing; none with a key:
/// O = 0, LSE = -inf); a part with LSE = NaN makes the row NaN. The order of
/// the parts does not change the result beyond rounding (the sum is in the
/// order of the parts). Enqueued on `exec`.
template <class ExecSpace, class OPV, class LPV, class OV, class LV>
void merge_attention(const ExecSpace& exec, const OPV& o_parts, const LPV& lse_parts, const OV& o,
                     const LV& lse) {
  impl::check_merge_views<OPV, LPV, OV, LV>();
  static_assert(OPV::rank == 5 && LPV::rank == 4 && OV::rank == 4 && LV::rank == 3,
                "BlockAttn: merge_attention takes o_parts (n, batch, rows, heads, head_dim), "
                "lse_parts (n, batch, heads, rows), o (batch, rows, heads, head_dim), lse "
                "(batch, heads, rows)");
  using S = typename OV::non_const_value_type;
  using T = compute_t<S>;
  static_assert(std::is_same<typename LV::non_const_value_type, T>::value &&
                    std::is_same<typename LPV::non_const_value_type, T>::value,
                "BlockAttn: lse and lse_parts must have the compute type of o's values");
  const char* fn = "merge_attention";
  impl::require_accessible<ExecSpace, typename OPV::memory_space>(fn, "o_parts");
  impl::require_accessible<ExecSpace, typename LPV::memory_space>(fn, "lse_parts");
  impl::require_accessible<ExecSpace, typename OV::memory_space>(fn, "o");
  impl::require_accessible<ExecSpace, typename LV::memory_space>(fn, "lse");
  const char* names[4] = {"batch", "rows", "heads", "head_dim"};
  for (int d = 0; d < 4; ++d)
    impl::require_extent(fn, "o_parts", o_parts, d + 1, names[d], o.extent(d),
                         "the same extent of o");
  impl::require_extent(fn, "lse_parts", lse_parts, 0, "parts", o_parts.extent(0),
                       "o_parts.extent(0)");
  impl::require_extent(fn, "lse_parts", lse_parts, 1, "batch", o.extent(0), "o.extent(0)");
  impl::require_extent(fn, "lse_parts", lse_parts, 2, "heads", o.extent(2), "o.extent(2)");
  impl::require_extent(fn, "lse_parts", lse_parts, 3, "rows", o.extent(1), "o.extent(1)");
  impl::require_extent(fn, "lse", lse, 0, "batch", o.extent(0), "o.extent(0)");
  impl::require_extent(fn, "lse", lse, 1, "heads", o.extent(2), "o.extent(2)");
  impl::require_extent(fn, "lse", lse, 2, "rows", o.extent(1), "o.extent(1)");
  const int parts = int(o_parts.extent(0)), dim = int(o.extent(3));
  impl::for_each_row(
      exec, "blockattn::merge_attention", o, KOKKOS_LAMBDA(int b, int i, int h) {
        lse(b, h, i) = impl::merge_row<T>(
            parts, dim, [&](int s, int d) { return o_parts(s, b, i, h, d); },
            [&](int s) { return T(lse_parts(s, b, h, i)); },
            [&](int d, T x) { o(b, i, h, d) = S(x); });
      });
}

/// Merges two partial results (o_a, lse_a) and (o_b, lse_b) of the same rows
/// over disjoint key sets into (o, lse), which may be (o_a, lse_a). Rules as
/// the n-part merge_attention.
template <class ExecSpace, class OAV, class LAV, class OBV, class LBV, class OV, class LV>
void merge_attention(const ExecSpace& exec, const OAV& o_a, const LAV& lse_a, const OBV& o_b,
                     const LBV& lse_b, const OV& o, const LV& lse) {
  impl::check_merge_views<OAV, LAV, OV, LV>();
  static_assert(OAV::rank == 4 && OBV::rank == 4 && OV::rank == 4 && LAV::rank == 3 &&
                    LBV::rank == 3 && LV::rank == 3,
                "BlockAttn: merge_attention takes o_a, o_b, o (batch, rows, heads, head_dim) and "
                "lse_a, lse_b, lse (batch, heads, rows)");
  using S = typename OV::non_const_value_type;
  using T = compute_t<S>;
  const char* fn = "merge_attention";
  const char* names[4] = {"batch", "rows", "heads", "head_dim"};
  for (int d = 0; d < 4; ++d) {
    impl::require_extent(fn, "o_a", o_a, d, names[d], o.extent(d), "the same extent of o");
    impl::require_extent(fn, "o_b", o_b, d, names[d], o.extent(d), "the same extent of o");
  }
  const int lse_dims[3] = {0, 2, 1};
  const char* lse_names[3] = {"batch", "heads", "rows"};
  for (int d = 0; d < 3; ++d) {
    impl::require_extent(fn, "lse_a", lse_a, d, lse_names[d], o.extent(lse_dims[d]), "o's");
    impl::require_extent(fn, "lse_b", lse_b, d, lse_names[d], o.extent(lse_dims[d]), "o's");
    impl::require_extent(fn, "lse", lse, d, lse_names[d], o.extent(lse_dims[d]), "o's");
  }
  const int dim = int(o.extent(3));
  impl::for_each_row(
      exec, "blockattn::merge_attention", o, KOKKOS_LAMBDA(int b, int i, int h) {
        const T la = lse_a(b, h, i), lb = lse_b(b, h, i);
        lse(b, h, i) = impl::merge_row<T>(
            2, dim,
            [&](int s, int d) {
              return s == 0 ? T(impl::to_compute(o_a(b, i, h, d)))
                            : T(impl::to_compute(o_b(b, i, h, d)));
            },
            [&](int s) { return s == 0 ? la : lb; }, [&](int d, T x) { o(b, i, h, d) = S(x); });
      });
}

}  // namespace blockattn
