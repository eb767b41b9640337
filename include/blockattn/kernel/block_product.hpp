// SPDX-License-Identifier: Apache-2.0
// The block product of BlockAttn's portable kernels (kernel/portable/, with
// the host/ micro kernels and the host matrix engine on host spaces): a
// (query block, key block) pair at a time, on packed operands.
//
//   forward:  layout = forward_layout<T, Exec>(dim)            tiles and packed layout
//             kv = allocate_forward_block<V, Exec>(layout, ...)   a packed K/V block
//             pack_forward_block(exec, k, v, kv)                  (what a ring sends)
//             forward_block(exec, extents, q, kv, o, lse, mask, qpos, kpos, scale, state)
//               -> partial O and the softmax state (m, l) of the rows, or,
//                  with state.finish, normalised O and LSE
//   backward: layout = backward_layout<T, Exec>(dim)
//             keys = allocate_backward_keys / pack_backward_keys
//             rows = allocate_backward_queries / pack_backward_queries (Q, dO, LSE, D)
//             backward_block(exec, extents, rows, keys, dq, dk, dv, mask, qpos, kpos,
//                            scale, options) -> dQ, dK, dV of the pair, written or added
//
// Which implementation computes a pair (a registered one of yours, cuDNN,
// the tensor-core kernels, these kernels) is decided in one place,
// kernel/dispatch.hpp, which every entry point and step loop calls; a new
// implementation registers itself there (kernel/block_implementation.hpp).
//
// Compile time: forward_block_kernel and backward_block_kernel are the
// functions that instantiate kernels. They take canonical View types
// (LayoutStride, unmanaged), so their instantiations depend only on
// (execution space, value types, mask, position map), and they are not
// inline: kernel/instantiate.hpp (included by kernel/dispatch.hpp) declares
// the built-in combinations extern when the precompiled kernels (CMake target
// BlockAttn::kernels) are linked, and BLOCKATTN_INSTANTIATE_BLOCK_PRODUCT
// compiles a user's mask once.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/kernel/buffer_cache.hpp>
#include <blockattn/kernel/impl/elementwise.hpp>
#include <blockattn/kernel/impl/softmax_state.hpp>
#include <blockattn/kernel/portable/backward_launch.hpp>
#include <blockattn/kernel/portable/forward_launch.hpp>
#include <blockattn/kernel/tile_shape.hpp>
#include <blockattn/policy/mask.hpp>
#include <blockattn/policy/positions.hpp>

#include <cstdint>
#include <type_traits>

namespace blockattn {

/// How a forward launch cuts the queries of each (batch, head) into team tiles.
using QueryTiles = impl::QueryTiles;
/// A packed K/V block in the forward product's layout (what a K/V ring sends).
template <class T, class MemorySpace>
using PackedKV = impl::PackedKV<T, MemorySpace>;
/// The packed key side of a backward block pair (K^T, V^T panels and K rows).
template <class T, class MemorySpace>
using PackedKeys = impl::PackedKeys<T, MemorySpace>;
/// The packed query side of a backward block pair: Q and dO rows (storage type
/// S), LSE * log2(e) and D = rowsum(dO o O) (compute type T).
template <class T, class MemorySpace, class S = T>
using PackedQueries = impl::PackedQueries<T, MemorySpace, S>;
/// The online-softmax state (m, l) of a set of rows between block products;
/// init, merge_partial (a normalised partial with its LSE), merge_state,
/// finalize.
template <class T, class MemorySpace>
using SoftmaxState = impl::SoftmaxState<T, MemorySpace>;
/// How one forward block product relates to the products before and after it
/// over other key blocks of the same queries: the state, resume (continue it),
/// finish (normalise into o and lse), skip_keys (only resume/finish), the teams
/// [league_begin, league_end) to launch, the query split, and o_acc (the fp32
/// unnormalised O of 16-bit outputs between products).
template <class T, class MemorySpace>
using ForwardBlockState = impl::BlockStep<T, MemorySpace>;
/// Options of one backward block product: add into dq / dk, dv instead of
/// writing them; which gradients; which kernels (automatic, split, fused).
using BackwardBlockOptions = impl::BackwardBlock;

/// How the block product of compute type T on an execution space tiles a
/// block and lays out its packed operands, for one head dim. Decided at run
/// time (the host ISA the kernels dispatch to), the same on every call.
struct BlockLayout {
  int block_q = 0, block_k = 0;   // query and key tile sizes
  int micro_rows = 1;             // rows of a register tile (query tiles are multiples of it)
  int dim = 0, dim_padded = 0;    // head dim, and as stored in packed blocks
  int kt_panel = 1, v_panel = 1;  // forward: keys per packed K^T panel, columns per V panel

  /// Query tiles of block_q rows over `queries` rows.
  int query_tiles(int queries) const { return (queries + block_q - 1) / block_q; }
  /// Teams of one forward launch over every query tile of the pair.
  int forward_league(const BlockExtents& e) const {
    return e.batch * e.heads * QueryTiles::rows(e.queries, block_q, micro_rows).tiles;
  }
};

namespace impl {
template <class T, class ExecSpace>
using forward_shape_t = DefaultTileShape<T, is_host_space_v<ExecSpace>>;
template <class T, class ExecSpace>
using backward_shape_t = BackwardTileShape<T, is_host_space_v<ExecSpace>>;

/// The canonical View types of the block product's arguments: any layout of
/// the caller's Views converts to them, so the kernels are instantiated once
/// per value type, not once per View type.
template <class S, class MemorySpace>
using strided_in4 = Kokkos::View<const S****, Kokkos::LayoutStride, MemorySpace,
                                 Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
template <class S, class MemorySpace>
using strided_out4 =
    Kokkos::View<S****, Kokkos::LayoutStride, MemorySpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
template <class T, class MemorySpace>
using strided_in3 = Kokkos::View<const T***, Kokkos::LayoutStride, MemorySpace,
                                 Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
template <class T, class MemorySpace>
using strided_out3 =
    Kokkos::View<T***, Kokkos::LayoutStride, MemorySpace, Kokkos::MemoryTraits<Kokkos::Unmanaged>>;

/// The forward block product on canonical Views: picks the head-dim variant
/// and launches. Not inline (see the header comment).
template <class ExecSpace, class T, class QS, class OS, class Mask, class Pos>
void forward_block_kernel(const ExecSpace& exec, const BlockExtents& e,
                          const strided_in4<QS, typename ExecSpace::memory_space>& q,
                          const PackedKV<T, typename ExecSpace::memory_space>& kv,
                          const strided_out4<OS, typename ExecSpace::memory_space>& o,
                          const strided_out3<T, typename ExecSpace::memory_space>& lse,
                          const Mask& mask, const Pos& qpos, const Pos& kpos, T scale,
                          const ForwardBlockState<T, typename ExecSpace::memory_space>& state) {
  with_shape_for<forward_shape_t<T, ExecSpace>>(e.dim, [&](auto sd, auto shape) {
    constexpr int SD = decltype(sd)::value;
    using S = decltype(shape);
    check_tile_shape<S>();
    launch_forward<ExecSpace, T, SD, S>(exec, e, q, kv, o, lse, mask, qpos, kpos, scale, state);
  });
}

/// The backward block product on canonical Views. Not inline.
template <class ExecSpace, class T, class QGS, class KGS, class Mask, class Pos>
void backward_block_kernel(const ExecSpace& exec, const BlockExtents& e,
                           const PackedQueries<T, typename ExecSpace::memory_space>& rows,
                           const PackedKeys<T, typename ExecSpace::memory_space>& keys,
                           const strided_out4<QGS, typename ExecSpace::memory_space>& dq,
                           const strided_out4<KGS, typename ExecSpace::memory_space>& dk,
                           const strided_out4<KGS, typename ExecSpace::memory_space>& dv,
                           const Mask& mask, const Pos& qpos, const Pos& kpos, T scale,
                           const BackwardBlockOptions& options, CallBuffers<ExecSpace>* buffers) {
  with_shape_for<backward_shape_t<T, ExecSpace>>(e.dim, [&](auto sd, auto shape) {
    constexpr int SD = decltype(sd)::value;
    using S = decltype(shape);
    launch_backward<ExecSpace, T, SD, S>(exec, e, rows, keys, dq, dk, dv, mask, qpos, kpos, scale,
                                         options, buffers);
  });
}

/// Packs K and V (storage S) into a forward block (storage V). Not inline.
template <class ExecSpace, class S, class V>
void pack_forward_block_kernel(const ExecSpace& exec,
                               const strided_in4<S, typename ExecSpace::memory_space>& k,
                               const strided_in4<S, typename ExecSpace::memory_space>& v,
                               const PackedKV<V, typename ExecSpace::memory_space>& kv) {
  pack_kv(exec, k, v, kv);
}
}  // namespace impl

/// The forward product's tiles and packed layout for compute type T on ExecSpace.
template <class T, class ExecSpace>
BlockLayout forward_layout(int dim) {
  return impl::with_shape_for<impl::forward_shape_t<T, ExecSpace>>(dim, [&](auto sd, auto shape) {
    constexpr int SD = decltype(sd)::value;
    using S = decltype(shape);
    impl::check_tile_shape<S>();
    using Panels = impl::ForwardPanels<typename ExecSpace::memory_space, S, SD>;
    BlockLayout l;
    l.block_q = S::block_q;
    l.block_k = S::block_k;
    l.micro_rows = S::micro_rows;
    l.dim = dim;
    l.dim_padded = impl::padded_head_dim<S, SD>(dim);
    l.kt_panel = Panels::kt;
    l.v_panel = Panels::v(l.dim_padded);
    return l;
  });
}

/// Whether the forward block product of compute type T with queries stored as
/// QS on ExecSpace runs on the host matrix engine (AMX) in this process, for
/// the head dim and the setting (ForwardBlockState::host_matrix).
template <class T, class QS, class ExecSpace>
bool forward_uses_matrix(int dim, HostMatrix setting = HostMatrix::automatic) {
  return impl::with_shape_for<impl::forward_shape_t<T, ExecSpace>>(dim, [&](auto, auto shape) {
    return impl::forward_uses_matrix<ExecSpace, T, decltype(shape), QS>(setting);
  });
}

/// Whether the backward block product of compute type T on ExecSpace under
/// Mask runs on the host matrix engine (AMX) in this process for the head dim
/// and the options (operands_bf16, host_matrix).
template <class T, class ExecSpace, class Mask = FullMask>
bool backward_uses_matrix(int dim, const BackwardBlockOptions& options) {
  return impl::with_shape_for<impl::backward_shape_t<T, ExecSpace>>(dim, [&](auto, auto shape) {
    return impl::backward_uses_matrix<ExecSpace, T, decltype(shape), Mask>(options, dim);
  });
}

/// The backward product's tiles and padded head dim for compute type T on ExecSpace.
template <class T, class ExecSpace>
BlockLayout backward_layout(int dim) {
  return impl::with_shape_for<impl::backward_shape_t<T, ExecSpace>>(dim, [&](auto sd, auto shape) {
    constexpr int SD = decltype(sd)::value;
    using S = decltype(shape);
    BlockLayout l;
    l.block_q = S::block_q;
    l.block_k = S::block_k;
    l.micro_rows = S::micro_rows;
    l.dim = dim;
    l.dim_padded = impl::padded_head_dim<S, SD>(dim);
    return l;
  });
}

/// A packed K/V block of `keys` keys (storage type V) in the forward layout.
/// `buffers`: carve it from a single call's cached buffer (nullptr: allocate).
template <class V, class ExecSpace>
PackedKV<V, typename ExecSpace::memory_space> allocate_forward_block(
    const BlockLayout& layout, int batch, int kv_heads, int keys,
    impl::CallBuffers<ExecSpace>* buffers = nullptr) {
  return impl::allocate_packed_kv<V, typename ExecSpace::memory_space>(
      batch, kv_heads, keys, layout.dim_padded, layout.block_k, layout.kt_panel, layout.v_panel,
      buffers);
}

/// Packs k, v (batch, keys, kv_heads, dim; any layout) into `kv` (its first
/// kv.keys keys; the rest zero).
template <class ExecSpace, class KV, class VV, class V>
void pack_forward_block(const ExecSpace& exec, const KV& k, const VV& v,
                        const PackedKV<V, typename ExecSpace::memory_space>& kv) {
  using S = typename KV::non_const_value_type;
  using mem = typename ExecSpace::memory_space;
  impl::pack_forward_block_kernel<ExecSpace, S, V>(exec, impl::strided_in4<S, mem>(k),
                                                   impl::strided_in4<S, mem>(v), kv);
}

/// The block in compute type T from a packed block in storage type S (exact).
template <class ExecSpace, class T, class S, class MemorySpace>
void widen_forward_block(const ExecSpace& exec, const PackedKV<S, MemorySpace>& from,
                         const PackedKV<T, MemorySpace>& to) {
  impl::widen_kv(exec, from, to);
}

/// The forward block product: the queries q (batch, queries, heads, dim) at
/// global positions qpos(i) against the packed keys at kpos(j), under `mask`.
/// The built-in position maps run as AffinePositions (canonical_positions).
/// With state.finish, o and lse get the normalised result (o = 0, lse = -inf
/// for a row that saw no key); otherwise the unnormalised O stays in o (or in
/// state.o_acc for 16-bit o) and (m, l) in state.state.
template <class ExecSpace, class QV, class T, class OV, class LV, class Mask, class Pos>
void forward_block(const ExecSpace& exec, const BlockExtents& e, const QV& q,
                   const PackedKV<T, typename ExecSpace::memory_space>& kv, const OV& o,
                   const LV& lse, const Mask& mask, const Pos& qpos, const Pos& kpos, T scale,
                   const ForwardBlockState<T, typename ExecSpace::memory_space>& state = {}) {
  using mem = typename ExecSpace::memory_space;
  using QS = typename QV::non_const_value_type;
  using OS = typename OV::non_const_value_type;
  using CP = std::decay_t<decltype(canonical_positions(qpos))>;
  impl::forward_block_kernel<ExecSpace, T, QS, OS, Mask, CP>(
      exec, e, impl::strided_in4<QS, mem>(q), kv, impl::strided_out4<OS, mem>(o),
      impl::strided_out3<T, mem>(lse), mask, canonical_positions(qpos), canonical_positions(kpos),
      scale, state);
}

/// The packed key side of a backward block pair.
template <class T, class ExecSpace>
PackedKeys<T, typename ExecSpace::memory_space> allocate_backward_keys(
    const BlockLayout& layout, int batch, int kv_heads, int keys,
    impl::CallBuffers<ExecSpace>* buffers = nullptr) {
  return impl::allocate_packed_keys<T, typename ExecSpace::memory_space>(
      batch, kv_heads, keys, layout.dim_padded, layout.block_k, buffers);
}

/// The packed query side of a backward block pair; Q and dO rows in storage S.
template <class T, class ExecSpace, class S = T>
PackedQueries<T, typename ExecSpace::memory_space, S> allocate_backward_queries(
    const BlockLayout& layout, int batch, int heads, int queries,
    impl::CallBuffers<ExecSpace>* buffers = nullptr) {
  return impl::allocate_packed_queries<T, typename ExecSpace::memory_space, S>(
      batch, heads, queries, layout.dim_padded, layout.block_q, buffers);
}

/// Packs K^T, V^T panels and K rows of k, v (any layout).
template <class ExecSpace, class KV, class VV, class T>
void pack_backward_keys(const ExecSpace& exec, const KV& k, const VV& v,
                        const PackedKeys<T, typename ExecSpace::memory_space>& keys) {
  impl::pack_keys(exec, k, v, keys);
}

/// Packs Q and dO rows, LSE * log2(e) and D = rowsum(dO o O) of the first
/// rows.queries rows (any layout of q, dout, o, lse). `matrix`: the rows'
/// backward_block runs on the host matrix engine (backward_uses_matrix with
/// host_matrix = `setting`), whose D is summed as its dP (bf16 dout and o;
/// see impl::amx_row_dots).
template <class ExecSpace, class QV, class DOV, class OV, class LV, class T, class S>
void pack_backward_queries(const ExecSpace& exec, const QV& q, const DOV& dout, const OV& o,
                           const LV& lse,
                           const PackedQueries<T, typename ExecSpace::memory_space, S>& rows,
                           bool matrix = false, HostMatrix setting = HostMatrix::automatic) {
  impl::with_dispatched_shape<impl::backward_shape_t<T, ExecSpace>>([&](auto shape) {
    impl::pack_queries<impl::kernel_isa_v<ExecSpace, decltype(shape)>>(exec, q, dout, o, lse, rows);
  });
#if BLOCKATTN_AMX_BACKWARD
  if constexpr (std::is_same<T, float>::value &&
                std::is_same<typename DOV::non_const_value_type, bf16>::value &&
                std::is_same<typename OV::non_const_value_type, bf16>::value &&
                impl::is_host_space_v<ExecSpace>) {
    if (matrix && rows.queries > 0)
      impl::amx_rowsum_d(exec, dout, o, impl::matrix_path(setting) == impl::MatrixPath::tiles,
                         rows);
  }
#endif
  (void)matrix;
  (void)setting;
}

/// The kernels' packed queries (compute type) from a travelling copy in storage type S.
/// (to shares from's LSE and D rows.)
template <class ExecSpace, class T, class MemorySpace, class S>
void widen_backward_queries(const ExecSpace& exec, const PackedQueries<T, MemorySpace, S>& from,
                            PackedQueries<T, MemorySpace>& to) {
  impl::widen_queries(exec, from, to);
}

/// The backward block product: dQ of the pair's queries into dq, dK and dV of
/// its keys into dk, dv (written, or added with options.accumulate_*).
/// `buffers`: where a single call carves its accumulators from (nullptr: allocate).
template <class ExecSpace, class T, class DQV, class DKV, class DVV, class Mask, class Pos>
void backward_block(const ExecSpace& exec, const BlockExtents& e,
                    const PackedQueries<T, typename ExecSpace::memory_space>& rows,
                    const PackedKeys<T, typename ExecSpace::memory_space>& keys, const DQV& dq,
                    const DKV& dk, const DVV& dv, const Mask& mask, const Pos& qpos,
                    const Pos& kpos, T scale, const BackwardBlockOptions& options = {},
                    impl::CallBuffers<ExecSpace>* buffers = nullptr) {
  using mem = typename ExecSpace::memory_space;
  using QGS = typename DQV::non_const_value_type;
  using KGS = typename DKV::non_const_value_type;
  static_assert(std::is_same<KGS, typename DVV::non_const_value_type>::value,
                "BlockAttn: dk and dv must have the same value type");
  using CP = std::decay_t<decltype(canonical_positions(qpos))>;
  impl::backward_block_kernel<ExecSpace, T, QGS, KGS, Mask, CP>(
      exec, e, rows, keys, impl::strided_out4<QGS, mem>(dq), impl::strided_out4<KGS, mem>(dk),
      impl::strided_out4<KGS, mem>(dv), mask, canonical_positions(qpos), canonical_positions(kpos),
      scale, options, buffers);
}

/// a = b converted to a's value type (widening exactly, or rounding once
/// into 16-bit storage): rank-4 Views of one shape, any layouts.
template <class ExecSpace, class AV, class BV>
void convert_views(const ExecSpace& exec, const AV& a, const BV& b) {
  impl::combine_into<false>(exec, a, b);
}

/// a += b: rank-4 Views of one shape, any layouts (partial gradients).
template <class ExecSpace, class AV, class BV>
void add_views(const ExecSpace& exec, const AV& a, const BV& b) {
  impl::combine_into<true>(exec, a, b);
}

}  // namespace blockattn
