// SPDX-License-Identifier: Apache-2.0
// The calls of a registered block-product implementation
// (kernel/block_implementation.hpp) from the operands the dispatcher holds:
// the caller's Views, a packed K/V block in its rows layout, a travelled
// query slot; and the strided row Views every implementation outside the
// portable kernels reads.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/kernel/block_implementation.hpp>
#include <blockattn/kernel/impl/backward_pack.hpp>
#include <blockattn/kernel/impl/pack.hpp>
#include <blockattn/policy/positions.hpp>

#include <cstddef>
#include <type_traits>
#include <utility>

namespace blockattn::impl {

/// Whether an implementation of your own takes (ExecSpace, V, Mask).
template <class ExecSpace, class V, class Mask>
constexpr bool user_enabled() {
  return BlockProductImplementation<ExecSpace, V, Mask>::available;
}

/// Rows [0, n) of a (batch, seq, heads, dim) View, or of a packed (batch,
/// heads, seq, dim_padded) query slot's rows seen in (batch, seq, heads, dim)
/// order (`packed`), as an unmanaged strided View.
template <class V, class MemorySpace>
using StridedRows = PairIn4<V, MemorySpace>;
template <class View>
auto strided_rows(const View& x, index_type n, bool packed = false, int dim = 0) {
  using V = typename View::non_const_value_type;
  const Kokkos::LayoutStride l =
      packed ? Kokkos::LayoutStride(x.extent(0), x.stride(0), std::size_t(n), x.stride(2),
                                    x.extent(1), x.stride(1), std::size_t(dim), x.stride(3))
             : Kokkos::LayoutStride(x.extent(0), x.stride(0), std::size_t(n), x.stride(1),
                                    x.extent(2), x.stride(2), x.extent(3), x.stride(3));
  return StridedRows<V, typename View::memory_space>(x.data(), l);
}

/// Rows [0, n) of a (batch, heads, seq) View as an unmanaged strided View.
template <class View>
auto strided_lse(const View& x, index_type n) {
  using L = typename View::non_const_value_type;
  const Kokkos::LayoutStride l(x.extent(0), x.stride(0), x.extent(1), x.stride(1), std::size_t(n),
                               x.stride(2));
  return PairIn3<L, typename View::memory_space>(x.data(), l);
}

/// The keys (k) or values (v) of a packed K/V block in its rows layout
/// (panel 1, v_panel = dim_padded) as a (batch, keys, kv_heads, dim) View.
template <class V, class MemorySpace>
PairIn4<V, MemorySpace> packed_rows(const PackedKV<V, MemorySpace>& kv, bool values, int keys,
                                    int dim) {
  if (values)
    return PairIn4<V, MemorySpace>(
        kv.v.data(),
        Kokkos::LayoutStride(kv.v.extent(0), kv.v.stride(0), std::size_t(keys), kv.v.stride(2),
                             kv.v.extent(1), kv.v.stride(1), std::size_t(dim), 1));
  return PairIn4<V, MemorySpace>(
      kv.kt.data(),
      Kokkos::LayoutStride(kv.kt.extent(0), kv.kt.stride(0), std::size_t(keys), kv.kt.extent(3),
                           kv.kt.extent(1), kv.kt.stride(1), std::size_t(dim), 1));
}

template <class View>
auto as_pair_out4(const View& x) {
  using X = typename View::non_const_value_type;
  return PairOut4<X, typename View::memory_space>(x);
}
template <class View>
auto as_pair_out3(const View& x) {
  using X = typename View::non_const_value_type;
  return PairOut3<X, typename View::memory_space>(x);
}

/// A call of kind Call (ForwardPairCall, BackwardPairCall) of storage V on
/// ExecSpace, with the fields both kinds share (q, k, v among them); the
/// built-in position maps as AffinePositions (canonical_positions).
template <template <class, class, class, class, class> class Call, class ExecSpace, class V,
          class QV, class KV, class VV, class Mask, class QP, class KP, class T>
auto pair_call(const BlockExtents& e, const QV& q, const KV& k, const VV& v, const Mask& mask,
               const QP& qpos, const KP& kpos, T scale) {
  using CQ = std::decay_t<decltype(canonical_positions(qpos))>;
  using CK = std::decay_t<decltype(canonical_positions(kpos))>;
  using mem = typename ExecSpace::memory_space;
  Call<V, mem, Mask, CQ, CK> c;
  c.extents = e;
  c.q = PairIn4<V, mem>(q);
  c.k = PairIn4<V, mem>(k);
  c.v = PairIn4<V, mem>(v);
  c.mask = mask;
  c.qpos = canonical_positions(qpos);
  c.kpos = canonical_positions(kpos);
  c.scale = scale;
  return c;
}

/// A forward pair on the implementation registered for (ExecSpace, V, Mask)
/// (callers check user_enabled() first): o, lse (compute type) get its
/// normalised result. False: it declined the pair (nothing done).
template <class ExecSpace, class Mask, class QV, class KV, class VV, class OV, class LV, class QP,
          class KP, class T>
bool user_forward(const ExecSpace& exec, const BlockExtents& e, const QV& q, const KV& k,
                  const VV& v, const OV& o, const LV& lse, const Mask& mask, const QP& qpos,
                  const KP& kpos, T scale) {
  using V = typename QV::non_const_value_type;
  auto c = pair_call<ForwardPairCall, ExecSpace, V>(e, q, k, v, mask, qpos, kpos, scale);
  c.o = as_pair_out4(o);
  c.lse = as_pair_out3(lse);
  return BlockProductImplementation<ExecSpace, V, Mask>::forward(exec, c);
}

/// A backward pair on the registered implementation (callers check
/// user_enabled() first): its gradients added into dq, dk, dv (compute
/// type). False: it declined the pair.
template <class ExecSpace, class Mask, class QV, class DOV, class KV, class VV, class LV, class DV,
          class GQ, class GK, class QP, class KP, class T>
bool user_backward(const ExecSpace& exec, const BlockExtents& e, const QV& q, const DOV& dout,
                   const KV& k, const VV& v, const LV& lse, const DV& delta, const GQ& dq,
                   const GK& dk, const GK& dv, const Mask& mask, const QP& qpos, const KP& kpos,
                   T scale) {
  using V = typename QV::non_const_value_type;
  using mem = typename ExecSpace::memory_space;
  auto c = pair_call<BackwardPairCall, ExecSpace, V>(e, q, k, v, mask, qpos, kpos, scale);
  c.dout = PairIn4<V, mem>(dout);
  c.lse = PairIn3<T, mem>(lse);
  c.delta = PairIn3<T, mem>(delta);
  c.dq = as_pair_out4(dq);
  c.dk = as_pair_out4(dk);
  c.dv = as_pair_out4(dv);
  return BlockProductImplementation<ExecSpace, V, Mask>::backward(exec, c);
}

/// The natural-log LSE of a packed query slot (lse2 = LSE log2 e) into
/// `out` (batch, heads, rows), for an implementation that takes LSE.
template <class ExecSpace, class LV, class OV>
void natural_lse(const ExecSpace& exec, const LV& lse2, const OV& out, index_type rows) {
  using T = typename OV::non_const_value_type;
  const int batch = int(out.extent(0)), heads = int(out.extent(1));
  if (rows <= 0) return;
  Kokkos::parallel_for(
      "blockattn::natural_lse",
      Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<3>>(exec, {0, 0, 0}, {batch, heads, int(rows)}),
      KOKKOS_LAMBDA(int b, int h, int i) { out(b, h, i) = T(lse2(b, h, i)) * ln2<T>; });
}

}  // namespace blockattn::impl
