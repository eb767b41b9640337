// SPDX-License-Identifier: Apache-2.0
// Single-device blockwise attention forward:
//   O = softmax(scale * Q K^T  masked) V,   LSE = log sum exp(scale * Q K^T  masked)
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/kernel/dispatch.hpp>
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

/// attention_forward after its checks (kernel/dispatch.hpp forward_call):
/// the queries at qpos(i) against the keys at kpos(j), the sinks folded in.
/// Also the chunked prefill's path (distributed/decode.hpp), whose keys are
/// a cache shard.
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV, class Mask, class Pos,
          class T>
void forward_on_positions(const ExecSpace& exec, const BlockExtents& e, const QV& q, const KV& k,
                          const VV& v, const OV& o, const LV& lse, const Mask& mask,
                          const Pos& qpos, const Pos& kpos, T scale, const ForwardOptions& opts) {
  forward_call(exec, e, q, k, v, o, lse, mask, qpos, kpos, scale, opts);
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
    // The implementation is the dispatcher's choice (kernel/dispatch.hpp).
    impl::forward_call(exec, e, q, k, v, o, lse, mask, qpos, kpos, scale, opts);
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
