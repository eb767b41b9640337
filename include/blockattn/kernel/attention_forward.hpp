// SPDX-License-Identifier: Apache-2.0
// Single-device blockwise attention forward:
//   O = softmax(scale * Q K^T  masked) V,   LSE = log sum exp(scale * Q K^T  masked)
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/kernel/block_product.hpp>
#include <blockattn/kernel/impl/flash_path.hpp>
#include <blockattn/kernel/impl/forward_launch.hpp>
#include <blockattn/kernel/impl/fused_path.hpp>
#include <blockattn/kernel/options.hpp>
#include <blockattn/kernel/tile_shape.hpp>
#include <blockattn/policy/document_mask.hpp>
#include <blockattn/policy/mask.hpp>
#include <blockattn/policy/positions.hpp>
#include <blockattn/policy/score.hpp>
#include <blockattn/policy/table_partition.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace blockattn {

namespace impl {
/// The score policy's and the sinks' checks of a single-device call.
template <class Mask>
void check_score_and_sinks(const char* fn, const Mask& mask, const ForwardOptions& opts, int heads,
                           bool backward) {
  if (const std::string why = score_check(mask, heads); !why.empty())
    fail(fn, "argument 'mask': ", why);
  check_sinks(fn, opts.sinks, opts.sink_grad, heads, backward);
}

/// The masks whose GQA rows the host matrix engine packs (below): the
/// built-in ones (cmake/BlockAttnKernelsSet.cmake's _ba_ks_masks: keep the
/// two lists alike), whose kernels on TablePositions BlockAttn::kernels
/// precompiles (a mask of yours would compile a second kernel in every file
/// that calls the forward), and none with a score policy (a policy may depend
/// on the query head, which packed rows do not keep).
template <class Mask>
inline constexpr bool gqa_packable_mask_v =
    std::is_same<Mask, FullMask>::value || std::is_same<Mask, CausalMask>::value ||
    std::is_same<Mask, SlidingWindowMask>::value || std::is_same<Mask, PrefixLMMask>::value ||
    std::is_same<Mask, DocumentMask>::value;

/// Whether a bf16 forward on the host matrix engine packs the query heads of
/// each kv head into one set of rows. The engine computes query rows in
/// blocks of 32: with grouped-query attention and few rows per head, every
/// head's tile costs whole blocks against every key (a 1-row chunk as much as
/// a 32-row one, 48 rows as much as 64), where the G heads of a kv head fill
/// the blocks together and share each K/V tile. Packs when that saves at
/// least an eighth of the blocks.
inline bool forward_packs_gqa(const BlockExtents& e) {
  if (e.kv_heads < 1 || e.heads <= e.kv_heads || e.queries < 1 || e.keys < 1) return false;
  constexpr std::int64_t R = matrix_query_rows;
  const std::int64_t G = e.heads / e.kv_heads;
  const std::int64_t apart = G * ((e.queries + R - 1) / R);
  const std::int64_t packed = (G * e.queries + R - 1) / R;
  return 8 * packed <= 7 * apart;
}

template <class ExecSpace, class QV, class KV, class VV, class OV, class LV, class Mask, class Pos,
          class T>
void forward_on_positions(const ExecSpace& exec, const BlockExtents& e, const QV& q, const KV& k,
                          const VV& v, const OV& o, const LV& lse, const Mask& mask,
                          const Pos& qpos, const Pos& kpos, T scale, const ForwardOptions& opts);

/// forward_on_positions with the G = heads / kv_heads query heads of each kv
/// head as one head of G x queries rows, row i * G + j holding query i of head
/// hk * G + j at position qpos(i) (repeated positions: the kernels bound a
/// tile by its first and last rows' positions and mask each row by its own,
/// which holds for non-decreasing maps), through position tables; o and lse
/// are copied back and the sinks applied after. Each row's arithmetic is the
/// unpacked row's: the same bits (tests/test_half_attention.cpp). Host spaces only.
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV, class Mask, class Pos,
          class T>
void forward_gqa_packed(const ExecSpace& exec, const BlockExtents& e, const QV& q, const KV& k,
                        const VV& v, const OV& o, const LV& lse, const Mask& mask, const Pos& qpos,
                        const Pos& kpos, T scale, const ForwardOptions& opts) {
  using QS = typename QV::non_const_value_type;
  using OS = typename OV::non_const_value_type;
  using LS = typename LV::non_const_value_type;
  using mem = typename ExecSpace::memory_space;
  const int B = e.batch, N = e.queries, H = e.heads, Hk = e.kv_heads, G = H / Hk, D = e.dim;
  BlockExtents pe = e;
  pe.heads = Hk;
  pe.queries = N * G;
  Kokkos::View<QS****, Kokkos::LayoutRight, mem> qp(
      Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::gqa_q"), B, N * G, Hk, D);
  Kokkos::View<OS****, Kokkos::LayoutRight, mem> op(
      Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::gqa_o"), B, N * G, Hk, D);
  Kokkos::View<LS***, Kokkos::LayoutRight, mem> lp(
      Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::gqa_lse"), B, Hk, N * G);
  const int rows = B * N * H;  // (b, i, h) rows of q and o
  const auto row = [=](int r, int& b, int& i, int& h) {
    h = r % H;
    i = (r / H) % N;
    b = r / (H * N);
  };
  Kokkos::parallel_for("blockattn::gqa_pack", Kokkos::RangePolicy<ExecSpace>(exec, 0, rows),
                       [=](const int r) {
                         int b, i, h;
                         row(r, b, i, h);
                         QS* const dst = &qp(b, i * G + h % G, h / G, 0);
                         for (int d = 0; d < D; ++d) dst[d] = q(b, i, h, d);
                       });
  std::vector<index_type> qt(std::size_t(N) * G), kt(static_cast<std::size_t>(e.keys));
  for (int i = 0; i < N; ++i)
    for (int j = 0; j < G; ++j) qt[std::size_t(i) * G + j] = qpos(i);
  for (int j = 0; j < e.keys; ++j) kt[std::size_t(j)] = kpos(j);
  ForwardOptions po = opts;
  po.sinks = SinkLogits{};
  po.paths = nullptr;
  forward_on_positions(exec, pe, qp, k, v, op, lp, mask, TablePositions{qt.data(), qt.data()},
                       TablePositions{kt.data(), kt.data()}, scale, po);
  Kokkos::parallel_for("blockattn::gqa_unpack", Kokkos::RangePolicy<ExecSpace>(exec, 0, rows),
                       [=](const int r) {
                         int b, i, h;
                         row(r, b, i, h);
                         const OS* const src = &op(b, i * G + h % G, h / G, 0);
                         for (int d = 0; d < D; ++d) o(b, i, h, d) = src[d];
                         lse(b, h, i) = lp(b, h / G, i * G + h % G);
                       });
  exec.fence();  // the tables and packed views are freed on return
  apply_sinks(exec, opts.sinks, o, lse);
}

/// attention_forward after its checks and the vendor's fused attention: the
/// queries at global positions qpos(i) against the keys at kpos(j) (any
/// position map; qpos(0), kpos(0) and the last rows' are read on the host
/// for host spaces), on BlockAttn's tensor-core kernels where they take the
/// call, the block product otherwise; the sinks folded in. Also the chunked
/// prefill's path (distributed/decode.hpp), whose keys are a cache shard.
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV, class Mask, class Pos,
          class T>
void forward_on_positions(const ExecSpace& exec, const BlockExtents& e, const QV& q, const KV& k,
                          const VV& v, const OV& o, const LV& lse, const Mask& mask,
                          const Pos& qpos, const Pos& kpos, T scale, const ForwardOptions& opts) {
  // BlockAttn's tensor-core forward (CUDA, 16-bit) where it takes the call.
  if (opts.tensor_cores && !opts.portable_only &&
      flash_forward(exec, e, q, k, v, o, lse, mask, qpos, kpos, float(scale))) {
    if (opts.paths) {
      ++opts.paths->portable;
      ++opts.paths->matrix;
    }
    apply_sinks(exec, opts.sinks, o, lse);
    return;
  }
  // fp32 on CUDA tensor cores (TF32 products) where asked for and it takes the call.
  if (!opts.portable_only && flash_forward_f32(exec, e, q, k, v, o, lse, mask, qpos, kpos,
                                               float(scale), opts.fp32_tensor_cores)) {
    if (opts.paths) {
      ++opts.paths->portable;
      ++opts.paths->matrix;
    }
    apply_sinks(exec, opts.sinks, o, lse);
    return;
  }
  const bool matrix =
      forward_uses_matrix<T, typename QV::non_const_value_type, ExecSpace>(e.dim, opts.host_matrix);
  if (opts.paths) {
    ++opts.paths->portable;
    if (matrix) ++opts.paths->matrix;
  }
  if constexpr (is_host_space_v<ExecSpace> &&
                std::is_same<typename KV::non_const_value_type, bf16>::value &&
                gqa_packable_mask_v<Mask>) {
    if (matrix && forward_packs_gqa(e)) {
      forward_gqa_packed(exec, e, q, k, v, o, lse, mask, qpos, kpos, scale, opts);
      return;
    }
  }
  const BlockLayout layout = forward_layout<T, ExecSpace>(e.dim);
  CallBuffers<ExecSpace> buffers(exec);
  // The matrix engine's block straight from k and v (its kernel reads no
  // other); the fp32 block otherwise.
  bool packed = false;
#if BLOCKATTN_HOST_AMX
  packed = is_host_space_v<ExecSpace> &&
           std::is_same<typename KV::non_const_value_type, bf16>::value && matrix && e.keys > 0;
#endif
  // Where the engine's block is packed, the fp32 block only carries the
  // extents: allocated apart (its pages are never touched), so that the
  // cached buffer holds what the call reads.
  const auto kv = allocate_forward_block<T, ExecSpace>(layout, e.batch, e.kv_heads, e.keys,
                                                       packed ? nullptr : &buffers);
  ForwardBlockState<T, typename ExecSpace::memory_space> state;
  state.host_matrix = opts.host_matrix;
#if BLOCKATTN_HOST_AMX
  if constexpr (is_host_space_v<ExecSpace> &&
                std::is_same<typename KV::non_const_value_type, bf16>::value) {
    if (packed)
      state.matrix_kv =
          pack_amx_kv_views(exec, k, v, layout.block_k, (layout.dim_padded + 31) / 32 * 32,
                            state.matrix_v_bad, &buffers);
  }
#endif
  if (!packed) pack_forward_block(exec, k, v, kv);
  if constexpr (is_host_space_v<ExecSpace>) {
    // Rows are work where every query meets every key of the block.
    const bool rows_are_work =
        e.keys > 0 && mask.classify(qpos(0), qpos(e.queries - 1) + 1, kpos(0),
                                    kpos(e.keys - 1) + 1) == TileKind::full;
    state.query_tiles =
        balanced_query_tiles(e, layout.block_q, layout.micro_rows, exec.concurrency(),
                             rows_are_work, matrix && e.keys > 0);
  }
  forward_block(exec, e, q, kv, o, lse, mask, qpos, kpos, scale, state);
  apply_sinks(exec, opts.sinks, o, lse);
}
}  // namespace impl

/// O = softmax(scale * Q K^T, masked) V and LSE, on one device.
///
///   q   (batch, queries, heads,    head_dim)   any layout (LayoutRight, LayoutStride, ...)
///   k   (batch, keys,    kv_heads, head_dim)   kv_heads divides heads (GQA / MQA)
///   v   (batch, keys,    kv_heads, head_dim)
///   o   (batch, queries, heads,    head_dim)   output
///   lse (batch, heads,   queries)              output, natural log; -inf for a row
///                                              with no allowed key (its o row is 0)
///
/// Value types: q, k, v, o all float, all double, all blockattn::bf16 or all
/// blockattn::fp16; lse is compute_t of it (float for the 16-bit types, which
/// are computed in fp32 and rounded once into o).
///
/// The mask sees global positions `opts.q_offset + i` and `opts.k_offset + j`.
/// Offsets may be negative (positions are signed: e.g. queries at -3 .. under
/// a causal mask see no key at 0 ..: those rows get O = 0, LSE = -inf); they
/// must satisfy |offset| <= 2^62.
/// Work is enqueued on `exec`; the call returns without fencing, like Kokkos.
/// Throws blockattn::invalid_argument on bad shapes or spaces.
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV, class Mask = FullMask,
          class = std::enable_if_t<Kokkos::is_execution_space<ExecSpace>::value>>
void attention_forward(const ExecSpace& exec, const QV& q, const KV& k, const VV& v, const OV& o,
                       const LV& lse, const Mask& mask = {}, const ForwardOptions& opts = {}) {
  impl::check_forward_view_types<QV, KV, VV, OV, LV>();
  impl::check_mask_policy<Mask>();
  // Stop here when a requirement failed: the static_assert above is the only
  // diagnostic, not a backtrace from deeper templates.
  if constexpr (impl::forward_views_ok<QV, KV, VV, OV, LV>() && is_mask_policy_v<Mask>) {
    // Tiles of the compute type: bf16 and fp16 are converted to fp32 when packed.
    using T = compute_t<typename OV::non_const_value_type>;
    const char* fn = "attention_forward";
    impl::require_offsets(fn, opts);
    const BlockExtents e = impl::validate_forward<ExecSpace>(fn, q, k, v, o, lse, opts.scale);
    const OffsetPositions qpos{opts.q_offset}, kpos{opts.k_offset};
    if (impl::check_policies_always || opts.check_policies)
      impl::check_mask_contract(fn, exec, mask, qpos(0), qpos(e.queries - 1) + 1, kpos(0),
                                kpos(e.keys - 1) + 1);
    impl::check_score_and_sinks(fn, mask, opts, e.heads, false);
    const T scale = impl::softmax_scale<T>(opts.scale, e.dim);
    // A vendor's fused attention where it is built in and takes the call
    // (kernel/impl/fused_path.hpp); BlockAttn's kernels otherwise.
    if (impl::fused_forward(exec, e, q, k, v, o, lse, mask, scale, opts)) {
      impl::apply_sinks(exec, opts.sinks, o, lse);
      return;
    }
    impl::forward_on_positions(exec, e, q, k, v, o, lse, mask, qpos, kpos, scale, opts);
  }
}

/// attention_forward with a tile shape of your own (tile sizes and the
/// micro-tile product; kernel/tile_shape.hpp, e.g. KokkosBatchedTileShape):
/// for tuning and benchmarks. Compiled where it is called (never precompiled).
template <class Shape, class ExecSpace, class QV, class KV, class VV, class OV, class LV,
          class Mask = FullMask>
void attention_forward_with_shape(const ExecSpace& exec, const QV& q, const KV& k, const VV& v,
                                  const OV& o, const LV& lse, const Mask& mask = {},
                                  const ForwardOptions& opts = {}) {
  impl::require_offsets("attention_forward_with_shape", opts);
  impl::forward<Shape>("attention_forward_with_shape", exec, q, k, v, o, lse, mask,
                       OffsetPositions{opts.q_offset}, OffsetPositions{opts.k_offset}, opts.scale,
                       opts.check_policies);
}

/// Same, on a default-constructed instance of the Views' execution space.
template <class QV, class KV, class VV, class OV, class LV, class Mask = FullMask,
          class = std::enable_if_t<Kokkos::is_view<QV>::value>>
void attention_forward(const QV& q, const KV& k, const VV& v, const OV& o, const LV& lse,
                       const Mask& mask = {}, const ForwardOptions& opts = {}) {
  attention_forward(typename OV::execution_space{}, q, k, v, o, lse, mask, opts);
}

}  // namespace blockattn
