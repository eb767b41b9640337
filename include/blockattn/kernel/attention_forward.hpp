// SPDX-License-Identifier: Apache-2.0
// Single-device blockwise attention forward:
//   O = softmax(scale * Q K^T  masked) V,   LSE = log sum exp(scale * Q K^T  masked)
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/kernel/impl/forward_launch.hpp>
#include <blockattn/kernel/options.hpp>
#include <blockattn/kernel/tile_shape.hpp>
#include <blockattn/policy/mask.hpp>
#include <blockattn/policy/positions.hpp>

#include <cmath>
#include <limits>
#include <type_traits>

namespace blockattn {

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
  // Tiles of the compute type: bf16 and fp16 are converted to fp32 when packed.
  using T = compute_t<typename OV::non_const_value_type>;
  using Shape = DefaultTileShape<T, impl::is_host_space_v<ExecSpace>>;
  impl::require_offsets("attention_forward", opts);
  impl::forward<Shape>("attention_forward", exec, q, k, v, o, lse, mask,
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
