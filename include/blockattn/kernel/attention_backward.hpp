// SPDX-License-Identifier: Apache-2.0
// Single-device blockwise attention backward: dQ, dK, dV from Q, K, V, the
// forward's O and LSE, and dO. Uses the saved LSE; never re-runs the forward.
#pragma once

#include <blockattn/kernel/attention_forward.hpp>
#include <blockattn/kernel/dispatch.hpp>

#include <cmath>

namespace blockattn {

/// dQ, dK, dV of O = softmax(scale * Q K^T, masked) V, on one device.
///   q, k, v, o, lse: as passed to / returned by attention_forward (same mask and options)
///   dout: dL/dO, shape of o;  dq, dk, dv: outputs, shapes of q, k, v.
/// Rows with no allowed key (LSE = -inf) get zero gradients.
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV, class DOV, class DQV,
          class DKV, class DVV, class Mask = FullMask,
          class = std::enable_if_t<Kokkos::is_execution_space<ExecSpace>::value>>
void attention_backward(const ExecSpace& exec, const QV& q, const KV& k, const VV& v, const OV& o,
                        const LV& lse, const DOV& dout, const DQV& dq, const DKV& dk, const DVV& dv,
                        const Mask& mask = {}, const ForwardOptions& opts = {}) {
  impl::check_forward_view_types<QV, KV, VV, OV, LV>();
  impl::check_mask_policy<Mask>();
  static_assert(impl::backward_grad_views_ok<DOV, DQV, DKV, DVV>(),
                "BlockAttn: dout, dq, dk and dv must be rank-4 Kokkos::Views "
                "(batch, seq, heads, head_dim)");
  if constexpr (impl::forward_views_ok<QV, KV, VV, OV, LV>() && is_mask_policy_v<Mask> &&
                impl::backward_grad_views_ok<DOV, DQV, DKV, DVV>()) {
    using V = typename OV::non_const_value_type;
    impl::check_backward_grad_types<V, DOV, DQV, DKV, DVV>();
    static_assert(!std::is_const<typename DQV::value_type>::value &&
                      !std::is_const<typename DKV::value_type>::value &&
                      !std::is_const<typename DVV::value_type>::value,
                  "BlockAttn: dq, dk and dv are outputs and must not be Views of const");
    // Tiles and every sum in the compute type (fp32 for bf16 and fp16).
    using T = compute_t<V>;
    const char* fn = "attention_backward";
    impl::require_offsets(fn, opts);
    const BlockExtents e =
        impl::validate_backward<ExecSpace>(fn, q, k, v, o, lse, dout, dq, dk, dv, opts.scale);
    if (impl::check_policies_always || opts.check_policies)
      impl::check_mask_contract(fn, exec, mask, opts.q_offset, opts.q_offset + e.queries,
                                opts.k_offset, opts.k_offset + e.keys);
    impl::check_score_and_sinks(fn, mask, opts, e.heads, true);
    if (opts.sink_grad.data() != nullptr && !opts.invariant)  // the invariant mode sums its own
      impl::store_sink_gradient(exec, impl::sink_gradient_part(exec, opts.sinks, o, dout, lse),
                                opts.sink_grad);
    const T scale = impl::softmax_scale<T>(opts.scale, e.dim);
    // The implementation is the dispatcher's choice (kernel/dispatch.hpp).
    impl::backward_call(exec, e, q, k, v, o, lse, dout, dq, dk, dv, mask,
                        OffsetPositions{opts.q_offset}, OffsetPositions{opts.k_offset}, scale,
                        opts);
  }
}

/// Same, on a default-constructed instance of the Views' execution space.
template <class QV, class KV, class VV, class OV, class LV, class DOV, class DQV, class DKV,
          class DVV, class Mask = FullMask, class = std::enable_if_t<Kokkos::is_view<QV>::value>>
void attention_backward(const QV& q, const KV& k, const VV& v, const OV& o, const LV& lse,
                        const DOV& dout, const DQV& dq, const DKV& dk, const DVV& dv,
                        const Mask& mask = {}, const ForwardOptions& opts = {}) {
  attention_backward(typename OV::execution_space{}, q, k, v, o, lse, dout, dq, dk, dv, mask, opts);
}

}  // namespace blockattn
