// SPDX-License-Identifier: Apache-2.0
// Split-KV decode over an 8-bit KV cache (fp8_e4m3, fp8_e5m2 or int8 codes,
// one fp32 scale per (slot, kv head): core/quant.hpp), dequantized inside
// attention_decode's kernel as the rows are read: half the bytes of a bf16
// cache, a quarter of fp32's.
#pragma once

#include <blockattn/core/quant.hpp>
#include <blockattn/kernel/decode.hpp>

#include <cstdint>

namespace blockattn {

namespace impl {
template <class QV, class KV, class VV, class SV, class OV, class LV>
constexpr bool decode_quant_views_ok() {
  if constexpr (Kokkos::is_view<QV>::value && Kokkos::is_view<KV>::value &&
                Kokkos::is_view<VV>::value && Kokkos::is_view<SV>::value &&
                Kokkos::is_view<OV>::value && Kokkos::is_view<LV>::value) {
    using Q = value_of<QV>;
    using O = value_of<OV>;
    return QV::rank == 4 && KV::rank == 4 && VV::rank == 4 && SV::rank == 3 && OV::rank == 4 &&
           LV::rank == 3 && is_kv_quant_v<value_of<KV>> &&
           std::is_same<value_of<KV>, value_of<VV>>::value &&
           (std::is_same<Q, float>::value || std::is_same<Q, bf16>::value ||
            std::is_same<Q, fp16>::value) &&
           std::is_same<value_of<SV>, float>::value &&
           (std::is_same<O, Q>::value || std::is_same<O, float>::value) &&
           std::is_same<value_of<LV>, float>::value &&
           !std::is_const<typename OV::value_type>::value &&
           !std::is_const<typename LV::value_type>::value;
  } else {
    return false;
  }
}

/// attention_decode_quantized's body; `pages`: the block table of a paged
/// 8-bit cache (k, v, the scales its pools), or empty.
template <class ExecSpace, class QV, class KV, class VV, class SV, class LenV, class PosV, class OV,
          class LV, class Mask, class KPos>
void decode_quantized(const ExecSpace& exec, const char* fn, const QV& q, const KV& k, const VV& v,
                      const SV& k_scales, const SV& v_scales, const LenV& lengths,
                      const PosV& q_positions, const OV& o, const LV& lse, const Mask& mask,
                      const KPos& kpos, const DecodeOptions& opts,
                      DecodePages<typename ExecSpace::memory_space> pages, index_type capacity) {
  static_assert(decode_quant_views_ok<QV, KV, VV, SV, OV, LV>(),
                "BlockAttn: attention_decode_quantized takes q (rank 4) of float, bf16 or fp16; "
                "k, v (rank 4) of fp8_e4m3, fp8_e5m2 or std::int8_t; k_scales, v_scales (rank 3) "
                "of float; o of q's type or float; lse (rank 3) of float");
  check_mask_policy<Mask>();
  check_position_map<KPos>();
  if constexpr (decode_quant_views_ok<QV, KV, VV, SV, OV, LV>() && is_mask_policy_v<Mask>) {
    if (opts.invariant)
      fail(fn,
           "argument 'options.invariant' is set: 8-bit caches have no invariant mode (their "
           "dequantized keys are not the ones attention_forward sees); use a bf16, fp16 or fp32 "
           "cache");
    require_accessible<ExecSpace, typename SV::memory_space>(fn, "k_scales");
    require_accessible<ExecSpace, typename SV::memory_space>(fn, "v_scales");
    const char* names[3] = {"batch", "capacity", "kv_heads"};
    if (pages.paged) names[0] = "pages", names[1] = "page_size";
    for (int d = 0; d < 3; ++d) {
      require_extent(fn, "k_scales", k_scales, d, names[d], k.extent(d), "the same extent of k");
      require_extent(fn, "v_scales", v_scales, d, names[d], v.extent(d), "the same extent of v");
    }
    // Paged: q, o, lse and the scale against the sequences' slots seen as one
    // (batch, capacity, kv_heads, head_dim) cache (never read through it).
    using Logical =
        Kokkos::View<const value_of<KV>****, Kokkos::LayoutStride, typename ExecSpace::memory_space,
                     Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
    const Logical logical(k.data(), Kokkos::LayoutStride(q.extent(0), 1, std::size_t(capacity), 1,
                                                         k.extent(2), 1, k.extent(3), 1));
    const BlockExtents e =
        pages.paged ? validate_forward<ExecSpace>(fn, q, logical, logical, o, lse, opts.scale, true)
                    : validate_forward<ExecSpace>(fn, q, k, v, o, lse, opts.scale, true);
    const DecodeChecked checked =
        decode_checks(exec, fn, e, q, lengths, q_positions, mask, opts, "k.extent(1)", capacity);
    pages.kscale = k_scales;
    pages.vscale = v_scales;
    decode_launch(exec, e, checked, q, k, v, lengths, q_positions, o, lse, mask, kpos, opts, pages);
  }
}
}  // namespace impl

/// attention_decode over an 8-bit cache: k, v (batch, capacity, kv_heads,
/// head_dim) of fp8_e4m3, fp8_e5m2 or std::int8_t (any layout), k_scales,
/// v_scales View<float***> (batch, capacity, kv_heads): key j of sequence b,
/// kv head g, is float(k(b, j, g, d)) * k_scales(b, j, g) (core/quant.hpp).
/// q of float, bf16 or fp16; o of q's type (or float); lse float. The other
/// arguments, the rules for masked rows, NaN and sinks: attention_decode's.
template <class ExecSpace, class QV, class KV, class VV, class SV, class LenV, class PosV, class OV,
          class LV, class Mask = FullMask, class KPos = OffsetPositions,
          class = std::enable_if_t<Kokkos::is_execution_space<ExecSpace>::value>>
void attention_decode_quantized(const ExecSpace& exec, const QV& q, const KV& k, const VV& v,
                                const SV& k_scales, const SV& v_scales, const LenV& lengths,
                                const PosV& q_positions, const OV& o, const LV& lse,
                                const Mask& mask = {}, const KPos& kpos = {},
                                const DecodeOptions& opts = {}) {
  static_assert(Kokkos::is_view<LenV>::value && LenV::rank == 1 &&
                    std::is_same<typename LenV::non_const_value_type, int>::value,
                "BlockAttn: attention_decode_quantized's lengths must be a rank-1 View of int");
  static_assert(Kokkos::is_view<PosV>::value && PosV::rank == 1 &&
                    std::is_same<typename PosV::non_const_value_type, index_type>::value,
                "BlockAttn: attention_decode_quantized's q_positions must be a rank-1 View of "
                "blockattn::index_type");
  impl::decode_quantized(exec, "attention_decode_quantized", q, k, v, k_scales, v_scales, lengths,
                         q_positions, o, lse, mask, kpos, opts,
                         impl::DecodePages<typename ExecSpace::memory_space>{},
                         index_type(k.extent(1)));
}

}  // namespace blockattn
