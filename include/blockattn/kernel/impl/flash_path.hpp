// SPDX-License-Identifier: Apache-2.0
// The tensor-core forward (kernel/impl/cuda_flash.hpp) behind the block
// product: 16-bit storage on Kokkos::Cuda, a mask without a score policy,
// head dim 64 or 128 with unit stride and 16-byte aligned rows. It takes what
// cuDNN's band pieces do not (any mask on global positions, any position
// map), and writes normalised O and the LSE of the pair: single-device calls
// finish there, step loops merge it like a fused piece.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/kernel/fused.hpp>
#include <blockattn/kernel/impl/cuda_flash.hpp>
#include <blockattn/kernel/validate.hpp>
#include <blockattn/policy/positions.hpp>
#include <blockattn/policy/score.hpp>

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <type_traits>

#if defined(KOKKOS_ENABLE_CUDA) && defined(__CUDACC__)
#define BLOCKATTN_FLASH_CUDA 1
#endif

namespace blockattn::impl {

/// Whether the tensor-core forward is compiled for (ExecSpace, storage V, Mask).
template <class ExecSpace, class V, class Mask>
constexpr bool flash_enabled() {
#if defined(BLOCKATTN_FLASH_CUDA)
  return std::is_same<ExecSpace, Kokkos::Cuda>::value && is_half_storage_v<V> &&
         !has_score_mod_v<Mask>;
#else
  return false;
#endif
}

#if defined(BLOCKATTN_FLASH_CUDA)
/// The tensor-core forward's kernel variant (cuda_flash.hpp's Variant):
/// BLOCKATTN_FLASH_VARIANT=regs|smem|wide in the environment, read once;
/// wide when unset (on an H200: 1.25x regs on full masks, 1.0-1.17x causal).
/// regs and smem only where BLOCKATTN_FLASH_ALL_VARIANTS=1 compiled them.
inline flash::Variant flash_variant() {
  static const flash::Variant v = [] {
    const char* e = std::getenv("BLOCKATTN_FLASH_VARIANT");
    const std::string s = e ? e : "";
    flash::Variant r = flash::Variant::wide;
    if (!s.empty() && !flash::parse_variant(s.c_str(), r))
      throw invalid_argument("BLOCKATTN_FLASH_VARIANT: expected regs, smem or wide, got '" + s +
                             "'");
    if (r != flash::Variant::wide && !flash::all_variants)
      throw invalid_argument("BLOCKATTN_FLASH_VARIANT: '" + s +
                             "' is not compiled in (wide is; define "
                             "BLOCKATTN_FLASH_ALL_VARIANTS=1 for regs and smem)");
    return r;
  }();
  return v;
}
#endif

/// One operand of the tensor-core forward: its data and (batch, sequence,
/// head) element strides; the head dim is contiguous.
struct FlashOperand {
  const void* data = nullptr;
  std::int64_t stride[3] = {0, 0, 0};
};

/// A (batch, seq, heads, dim) View as an operand (empty data: not one, the
/// head dim is strided).
template <class View>
FlashOperand flash_operand(const View& x) {
  FlashOperand r;
  if (x.extent(3) > 1 && x.stride(3) != 1) return r;
  r.data = x.data();
  r.stride[0] = std::int64_t(x.stride(0));
  r.stride[1] = std::int64_t(x.stride(1));
  r.stride[2] = std::int64_t(x.stride(2));
  return r;
}

/// Runs the pair (q rows against k, v rows, storage V; o a (batch, seq,
/// heads, dim) View of V, lse (batch, heads, seq) fp32) on the tensor-core
/// forward when it takes it: true, O and LSE of every row written (enqueued
/// on exec). False: nothing done, the caller runs another path.
template <class ExecSpace, class OV, class LV, class Mask, class QP, class KP>
bool flash_forward(const ExecSpace& exec, const BlockExtents& e, const FlashOperand& q,
                   const FlashOperand& k, const FlashOperand& v, const OV& o, const LV& lse,
                   const Mask& mask, const QP& qpos, const KP& kpos, float scale) {
  using V = typename OV::non_const_value_type;
  if constexpr (!flash_enabled<ExecSpace, V, Mask>()) {
    (void)exec, (void)e, (void)q, (void)k, (void)v, (void)o, (void)lse, (void)mask, (void)qpos,
        (void)kpos, (void)scale;
    return false;
  } else {
#if defined(BLOCKATTN_FLASH_CUDA)
    if (e.queries <= 0 || e.keys <= 0 || !q.data || !k.data || !v.data) return false;
    const FlashOperand out = flash_operand(o);
    if (!out.data) return false;
    flash::Args a;
    a.q = q.data;
    a.k = k.data;
    a.v = v.data;
    a.o = const_cast<void*>(out.data);
    a.lse = lse.data();
    for (int i = 0; i < 3; ++i) {
      a.q_stride[i] = q.stride[i];
      a.k_stride[i] = k.stride[i];
      a.v_stride[i] = v.stride[i];
      a.o_stride[i] = out.stride[i];
    }
    a.lse_stride[0] = std::int64_t(lse.stride(0));
    a.lse_stride[1] = std::int64_t(lse.stride(1));
    a.lse_stride[2] = std::int64_t(lse.stride(2));
    a.batch = e.batch;
    a.heads = e.heads;
    a.kv_heads = e.kv_heads;
    a.queries = e.queries;
    a.keys = e.keys;
    a.scale = scale;
    a.variant = flash_variant();
    if (!flash::supports(a, e.dim)) return false;
    const cudaError_t err = flash::forward<std::is_same<V, bf16>::value>(
        a, e.dim, mask, canonical_positions(qpos), canonical_positions(kpos), exec.cuda_stream());
    if (err != cudaSuccess)
      throw std::runtime_error(std::string("blockattn: the tensor-core forward's launch failed: ") +
                               cudaGetErrorString(err));
    return true;
#endif
  }
}

/// The single-device form: q, k, v, o (batch, seq, heads, dim) Views.
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV, class Mask, class QP,
          class KP>
bool flash_forward(const ExecSpace& exec, const BlockExtents& e, const QV& q, const KV& k,
                   const VV& v, const OV& o, const LV& lse, const Mask& mask, const QP& qpos,
                   const KP& kpos, float scale) {
  return flash_forward(exec, e, flash_operand(q), flash_operand(k), flash_operand(v), o, lse, mask,
                       qpos, kpos, scale);
}

}  // namespace blockattn::impl
