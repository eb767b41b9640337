// SPDX-License-Identifier: Apache-2.0
// The tensor-core forward (kernel/cuda/flash_forward.hpp) behind the block
// product: 16-bit storage on Kokkos::Cuda, a mask without a score policy,
// head dim 64 or 128 with unit stride and 16-byte aligned rows. It takes what
// cuDNN's band pieces do not (any mask on global positions, any position
// map), and writes normalised O and the LSE of the pair: single-device calls
// finish there, step loops merge it like a fused piece. The tensor-core
// backward (cuda/flash_backward.hpp) behind the single-device backward, on
// the same conditions and finite inputs (ForwardOptions::tensor_core_backward).
// The fp32 tensor-core forward (cuda/flash_forward_f32.hpp) behind the single-device
// fp32 forward (ForwardOptions::fp32_tensor_cores).
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/kernel/cuda/flash_backward.hpp>
#include <blockattn/kernel/cuda/flash_forward.hpp>
#include <blockattn/kernel/cuda/flash_forward_f32.hpp>
#include <blockattn/kernel/fused.hpp>
#include <blockattn/kernel/impl/pair_ops.hpp>
#include <blockattn/kernel/options.hpp>
#include <blockattn/kernel/validate.hpp>
#include <blockattn/policy/positions.hpp>
#include <blockattn/policy/score.hpp>

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <type_traits>

namespace blockattn::impl {

// The execution space the tensor-core kernels run behind, and its stream;
// BLOCKATTN_FLASH_CUDA where there is one.
#if defined(KOKKOS_ENABLE_CUDA) && defined(__CUDACC__)
#define BLOCKATTN_FLASH_CUDA 1
using flash_space = Kokkos::Cuda;
inline cudaStream_t flash_stream(const Kokkos::Cuda& exec) {
  return exec.cuda_stream();
}
#elif defined(BLOCKATTN_CUDA_EMULATION) && defined(KOKKOS_ENABLE_SERIAL)
// Tests only (tests/cuda_emu, on the include path): the kernels behind
// Kokkos::Serial, run by the host emulator of their CUDA subset, so that this
// file's path (operands, strides, fallbacks) runs in CI as it does on a GPU.
#define BLOCKATTN_FLASH_CUDA 1
using flash_space = Kokkos::Serial;
inline cudaStream_t flash_stream(const Kokkos::Serial&) {
  return nullptr;
}
#endif

/// Whether the tensor-core forward is compiled for (ExecSpace, storage V, Mask).
template <class ExecSpace, class V, class Mask>
constexpr bool flash_enabled() {
#if defined(BLOCKATTN_FLASH_CUDA)
  return std::is_same<ExecSpace, flash_space>::value && is_half_storage_v<V> &&
         !has_score_mod_v<Mask>;
#else
  return false;
#endif
}

#if defined(BLOCKATTN_FLASH_CUDA)
/// The tensor-core forward's kernel variant (cuda/flash_forward.hpp's Variant):
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

/// Whether the fp32 tensor-core forward is compiled for (ExecSpace, V, Mask).
template <class ExecSpace, class V, class Mask>
constexpr bool flash_f32_enabled() {
#if defined(BLOCKATTN_FLASH_CUDA)
  return std::is_same<ExecSpace, flash_space>::value && std::is_same<V, float>::value &&
         !has_score_mod_v<Mask>;
#else
  return false;
#endif
}

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

#if defined(BLOCKATTN_FLASH_CUDA)
/// What the forward and backward kernels' arguments share: LSE, extents, scale.
template <class A, class LV>
void flash_shared_args(A& a, const BlockExtents& e, const LV& lse, float scale) {
  a.lse = lse.data();
  for (int i = 0; i < 3; ++i) a.lse_stride[i] = std::int64_t(lse.stride(i));
  a.batch = e.batch;
  a.heads = e.heads;
  a.kv_heads = e.kv_heads;
  a.queries = e.queries;
  a.keys = e.keys;
  a.scale = scale;
}

/// The forward kernels' arguments (cuda/flash_forward.hpp Args) of a call; false
/// where an operand is not one (empty, or its head dim strided).
template <class OV, class LV>
bool flash_args(const BlockExtents& e, const FlashOperand& q, const FlashOperand& k,
                const FlashOperand& v, const OV& o, const LV& lse, float scale, flash::Args& a) {
  if (e.queries <= 0 || e.keys <= 0 || !q.data || !k.data || !v.data) return false;
  const FlashOperand out = flash_operand(o);
  if (!out.data) return false;
  a.q = q.data;
  a.k = k.data;
  a.v = v.data;
  a.o = const_cast<void*>(out.data);
  flash_shared_args(a, e, lse, scale);
  for (int i = 0; i < 3; ++i) {
    a.q_stride[i] = q.stride[i];
    a.k_stride[i] = k.stride[i];
    a.v_stride[i] = v.stride[i];
    a.o_stride[i] = out.stride[i];
  }
  return true;
}
#endif

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
    flash::Args a;
    if (!flash_args(e, q, k, v, o, lse, scale, a)) return false;
    a.variant = flash_variant();
    if (!flash::supports(a, e.dim)) return false;
    const cudaError_t err = flash::forward<std::is_same<V, bf16>::value>(
        a, e.dim, mask, canonical_positions(qpos), canonical_positions(kpos), flash_stream(exec));
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

/// The single-device fp32 forward on tensor cores (cuda/flash_forward_f32.hpp) when
/// it takes the call: q, k, v, o (batch, seq, heads, dim) Views of float, lse
/// (batch, heads, seq); mode tf32x3 or tf32 (off: false). True: O and LSE of
/// every row written (enqueued on exec); false: nothing done. Finite q, k, v
/// only (one pass over each, waited for; see the kernel).
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV, class Mask, class QP,
          class KP>
bool flash_forward_f32(const ExecSpace& exec, const BlockExtents& e, const QV& q, const KV& k,
                       const VV& v, const OV& o, const LV& lse, const Mask& mask, const QP& qpos,
                       const KP& kpos, float scale, Fp32TensorCores mode) {
  using V = typename OV::non_const_value_type;
  if constexpr (!flash_f32_enabled<ExecSpace, V, Mask>()) {
    (void)exec, (void)e, (void)q, (void)k, (void)v, (void)o, (void)lse, (void)mask, (void)qpos,
        (void)kpos, (void)scale, (void)mode;
    return false;
  } else {
#if defined(BLOCKATTN_FLASH_CUDA)
    if (mode == Fp32TensorCores::off) return false;
    flash::Args a;
    if (!flash_args(e, flash_operand(q), flash_operand(k), flash_operand(v), o, lse, scale, a) ||
        !flash::supports_f32(a, e.dim))
      return false;
    if (has_nonfinite(exec, q) || has_nonfinite(exec, k) || has_nonfinite(exec, v)) return false;
    const auto qp = canonical_positions(qpos);
    const auto kp = canonical_positions(kpos);
    const cudaError_t err = mode == Fp32TensorCores::tf32x3
                                ? flash::forward_f32<3>(a, e.dim, mask, qp, kp, flash_stream(exec))
                                : flash::forward_f32<1>(a, e.dim, mask, qp, kp, flash_stream(exec));
    if (err != cudaSuccess)
      throw std::runtime_error(
          std::string("blockattn: the fp32 tensor-core forward's launch failed: ") +
          cudaGetErrorString(err));
    return true;
#endif
  }
}

/// The single-device backward on the tensor-core kernels when they take it
/// (true: dq, dk, dv written, enqueued on exec); false: nothing done. Takes
/// what the forward takes, with every (batch, seq, heads, dim) operand's head
/// dim contiguous, and only finite q, k, v, o and dout (one pass over each,
/// waited for: a masked pair's P = 0 times an inf would make NaN where the
/// portable kernels keep the contract).
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV, class DOV, class DQV,
          class DKV, class DVV, class Mask, class QP, class KP>
bool flash_backward(const ExecSpace& exec, const BlockExtents& e, const QV& q, const KV& k,
                    const VV& v, const OV& o, const LV& lse, const DOV& dout, const DQV& dq,
                    const DKV& dk, const DVV& dv, const Mask& mask, const QP& qpos, const KP& kpos,
                    float scale) {
  using V = typename OV::non_const_value_type;
  if constexpr (!flash_enabled<ExecSpace, V, Mask>()) {
    (void)exec, (void)e, (void)q, (void)k, (void)v, (void)o, (void)lse, (void)dout, (void)dq,
        (void)dk, (void)dv, (void)mask, (void)qpos, (void)kpos, (void)scale;
    return false;
  } else {
#if defined(BLOCKATTN_FLASH_CUDA)
    if (e.queries <= 0 || e.keys <= 0) return false;
    const FlashOperand ops[8] = {flash_operand(q),  flash_operand(k),    flash_operand(v),
                                 flash_operand(o),  flash_operand(dout), flash_operand(dq),
                                 flash_operand(dk), flash_operand(dv)};
    for (const FlashOperand& x : ops)
      if (!x.data) return false;
    flash::BackwardArgs a;
    a.q = ops[0].data;
    a.k = ops[1].data;
    a.v = ops[2].data;
    a.o = ops[3].data;
    a.dout = ops[4].data;
    a.dq = const_cast<void*>(ops[5].data);
    a.dk = const_cast<void*>(ops[6].data);
    a.dv = const_cast<void*>(ops[7].data);
    std::int64_t* strides[8] = {a.q_stride,    a.k_stride,  a.v_stride,  a.o_stride,
                                a.dout_stride, a.dq_stride, a.dk_stride, a.dv_stride};
    for (int x = 0; x < 8; ++x)
      for (int i = 0; i < 3; ++i) strides[x][i] = ops[x].stride[i];
    flash_shared_args(a, e, lse, scale);
    if (!flash::supports(a, e.dim)) return false;
    if (has_nonfinite(exec, q) || has_nonfinite(exec, k) || has_nonfinite(exec, v) ||
        has_nonfinite(exec, o) || has_nonfinite(exec, dout))
      return false;
    Kokkos::View<float*, typename ExecSpace::memory_space> delta(
        Kokkos::view_alloc(exec, Kokkos::WithoutInitializing, "blockattn::flash_delta"),
        std::size_t(e.batch) * e.heads * e.queries);
    a.delta = delta.data();
    const cudaError_t err = flash::backward<std::is_same<V, bf16>::value>(
        a, e.dim, mask, canonical_positions(qpos), canonical_positions(kpos), flash_stream(exec));
    if (err != cudaSuccess)
      throw std::runtime_error(
          std::string("blockattn: the tensor-core backward's launch failed: ") +
          cudaGetErrorString(err));
    exec.fence();  // delta is freed on return
    return true;
#endif
  }
}

}  // namespace blockattn::impl
