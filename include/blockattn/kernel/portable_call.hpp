// SPDX-License-Identifier: Apache-2.0
// BlockAttn's portable kernels on a whole single-device call (one block pair:
// every query against every key), through the block product
// (kernel/block_product.hpp): the keys packed once per call, bf16 operands
// straight from the Views on the host matrix engine, the query heads of a
// GQA group packed into one set of rows where the engine's 32-row blocks
// would otherwise run mostly empty. The dispatcher (kernel/dispatch.hpp)
// calls these when no other implementation takes the call.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/kernel/block_product.hpp>
#include <blockattn/kernel/instantiate.hpp>
#include <blockattn/kernel/options.hpp>
#include <blockattn/kernel/sinks.hpp>
#include <blockattn/policy/document_mask.hpp>
#include <blockattn/policy/mask.hpp>
#include <blockattn/policy/positions.hpp>

#include <cstdint>
#include <type_traits>
#include <vector>

namespace blockattn {
namespace impl {

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
void portable_forward_call(const ExecSpace& exec, const BlockExtents& e, const QV& q, const KV& k,
                           const VV& v, const OV& o, const LV& lse, const Mask& mask,
                           const Pos& qpos, const Pos& kpos, T scale, HostMatrix host_matrix);

/// portable_forward_call with the G = heads / kv_heads query heads of each kv
/// head as one head of G x queries rows, row i * G + j holding query i of head
/// hk * G + j at position qpos(i) (repeated positions: the kernels bound a
/// tile by its first and last rows' positions and mask each row by its own,
/// which holds for non-decreasing maps), through position tables; o and lse
/// are copied back. Each row's arithmetic is the unpacked row's: the same
/// bits (tests/test_half_attention.cpp). Host spaces only.
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV, class Mask, class Pos,
          class T>
void forward_gqa_packed(const ExecSpace& exec, const BlockExtents& e, const QV& q, const KV& k,
                        const VV& v, const OV& o, const LV& lse, const Mask& mask, const Pos& qpos,
                        const Pos& kpos, T scale, HostMatrix host_matrix) {
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
  portable_forward_call(exec, pe, qp, k, v, op, lp, mask, TablePositions{qt.data(), qt.data()},
                        TablePositions{kt.data(), kt.data()}, scale, host_matrix);
  Kokkos::parallel_for("blockattn::gqa_unpack", Kokkos::RangePolicy<ExecSpace>(exec, 0, rows),
                       [=](const int r) {
                         int b, i, h;
                         row(r, b, i, h);
                         const OS* const src = &op(b, i * G + h % G, h / G, 0);
                         for (int d = 0; d < D; ++d) o(b, i, h, d) = src[d];
                         lse(b, h, i) = lp(b, h / G, i * G + h % G);
                       });
  exec.fence();  // the tables and packed views are freed on return
}

/// The forward of a whole call on the portable kernels: the queries at
/// global positions qpos(i) against the keys at kpos(j) (any position map;
/// qpos(0), kpos(0) and the last rows' are read on the host for host
/// spaces), normalised O and LSE into o and lse (no sinks).
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV, class Mask, class Pos,
          class T>
void portable_forward_call(const ExecSpace& exec, const BlockExtents& e, const QV& q, const KV& k,
                           const VV& v, const OV& o, const LV& lse, const Mask& mask,
                           const Pos& qpos, const Pos& kpos, T scale, HostMatrix host_matrix) {
  const bool matrix =
      blockattn::forward_uses_matrix<T, typename QV::non_const_value_type, ExecSpace>(e.dim,
                                                                                      host_matrix);
  if constexpr (is_host_space_v<ExecSpace> &&
                std::is_same<typename KV::non_const_value_type, bf16>::value &&
                gqa_packable_mask_v<Mask>) {
    if (matrix && forward_packs_gqa(e)) {
      forward_gqa_packed(exec, e, q, k, v, o, lse, mask, qpos, kpos, scale, host_matrix);
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
  state.host_matrix = host_matrix;
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
}

/// The backward of a whole call on the portable kernels (dq, dk, dv written;
/// bf16 operands on the host matrix engine where it runs them).
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV, class DOV, class DQV,
          class DKV, class DVV, class Mask, class Pos, class T>
void portable_backward_call(const ExecSpace& exec, const BlockExtents& e, const QV& q, const KV& k,
                            const VV& v, const OV& o, const LV& lse, const DOV& dout, const DQV& dq,
                            const DKV& dk, const DVV& dv, const Mask& mask, const Pos& qpos,
                            const Pos& kpos, T scale, HostMatrix host_matrix,
                            BlockPathCounts* paths) {
  BackwardBlockOptions blk;
  blk.operands_bf16 = std::is_same<typename QV::non_const_value_type, bf16>::value &&
                      std::is_same<typename KV::non_const_value_type, bf16>::value &&
                      std::is_same<typename VV::non_const_value_type, bf16>::value &&
                      std::is_same<typename DOV::non_const_value_type, bf16>::value;
  blk.host_matrix = host_matrix;
  const bool matrix = blockattn::backward_uses_matrix<T, ExecSpace, Mask>(e.dim, blk);
  if (paths) {
    ++paths->portable;
    if (matrix) ++paths->matrix;
  }
  const BlockLayout layout = backward_layout<T, ExecSpace>(e.dim);
  CallBuffers<ExecSpace> buffers(exec);
#if BLOCKATTN_AMX_BACKWARD
  // On the matrix engine with bf16 q, k, v, o and dO: its operands straight
  // from the views (pack_amx_backward_views), no fp32 blocks in between.
  if constexpr (is_host_space_v<ExecSpace> &&
                std::is_same<typename OV::non_const_value_type, bf16>::value &&
                std::is_same<typename ExecSpace::memory_space, Kokkos::HostSpace>::value) {
    if (matrix && blk.operands_bf16 && e.queries > 0 && e.keys > 0) {
      pack_amx_backward_views(exec, e, q, dout, o, lse, k, v,
                              matrix_path(host_matrix) == MatrixPath::tiles, blk.matrix_operands,
                              &buffers);
      backward_block(exec, e, PackedQueries<T, Kokkos::HostSpace>{},
                     PackedKeys<T, Kokkos::HostSpace>{}, dq, dk, dv, mask, qpos, kpos, scale, blk,
                     &buffers);
      return;
    }
  }
#endif
  const auto keys =
      allocate_backward_keys<T, ExecSpace>(layout, e.batch, e.kv_heads, e.keys, &buffers);
  pack_backward_keys(exec, k, v, keys);
  const auto rows =
      allocate_backward_queries<T, ExecSpace>(layout, e.batch, e.heads, e.queries, &buffers);
  pack_backward_queries(exec, q, dout, o, lse, rows, matrix, host_matrix);
  backward_block(exec, e, rows, keys, dq, dk, dv, mask, qpos, kpos, scale, blk, &buffers);
}

}  // namespace impl
}  // namespace blockattn
