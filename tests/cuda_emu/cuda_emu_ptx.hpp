// SPDX-License-Identifier: Apache-2.0
// cuda_emu (cuda_emu.hpp): the PTX wrappers of BlockAttn's tensor-core
// kernels, on the host's warp model. The same names and signatures as the
// inline-PTX versions in include/blockattn/kernel/cuda/flash_forward.hpp and
// cuda/flash_forward_f32.hpp, which include this file instead of defining theirs when
// BLOCKATTN_CUDA_EMULATION is defined.
//
// Layouts (PTX ISA, "Matrix fragments for mma.m16n8k16 / m16n8k8" and
// "ldmatrix"; g = lane / 4, t = lane % 4):
//   ldmatrix .x4: lanes 8i .. 8i + 7 give the 8 row addresses of matrix i;
//     register i of a lane = matrix i's (row g, 16-bit cols 2t, 2t + 1);
//     .trans: (rows 2t, 2t + 1, col g);
//   m16n8k16: A a[0] (g, k 2t..2t+1), a[1] (g + 8, 2t..), a[2] (g, 2t + 8..),
//     a[3] (g + 8, 2t + 8..); B b0 (k 2t..2t+1, n g), b1 (k 2t + 8.., n g);
//   m16n8k8 .tf32: A a[0] (g, t), a[1] (g + 8, t), a[2] (g, t + 4),
//     a[3] (g + 8, t + 4); B b0 (k t, n g), b1 (k t + 4, n g);
//   C / D of both: c[e] = (row g + 8 (e / 2), col 2t + e % 2).
#pragma once

#include "cuda_emu.hpp"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace blockattn::impl::flash {

/// 16 bytes global -> shared, deferred to the wait; src_bytes 0 fills zeros.
inline void cp_async16(void* dst, const void* src, int src_bytes) {
  ::blockattn_cuda_emu::cp_async(dst, src, src_bytes);
}
inline void cp_async_commit() {
  ::blockattn_cuda_emu::cp_async_commit();
}
inline void cp_async_wait_all() {
  ::blockattn_cuda_emu::cp_async_wait(0);
}

namespace emu_detail {
inline void ldmatrix(std::uint32_t r[4], const void* p, bool trans) {
  namespace e = ::blockattn_cuda_emu;
  if (reinterpret_cast<std::uintptr_t>(p) % 16 != 0)
    e::fail("ldmatrix: row address %p is not 16-byte aligned", p);
  e::check_shared(p, 16, "ldmatrix row");
  const unsigned char* slots =
      e::warp_exchange(&p, sizeof p, trans ? e::Op::ldmatrix_trans : e::Op::ldmatrix);
  const int lane = e::lane_id(), g = lane / 4, t = lane % 4;
  auto row = [&](int i, int rr) {
    const unsigned char* a;
    std::memcpy(&a, slots + 64 * (8 * i + rr), sizeof a);
    return a;
  };
  for (int i = 0; i < 4; ++i) {
    std::uint16_t lo, hi;
    if (!trans) {
      std::memcpy(&lo, row(i, g) + 4 * t, 2);
      std::memcpy(&hi, row(i, g) + 4 * t + 2, 2);
    } else {
      std::memcpy(&lo, row(i, 2 * t) + 2 * g, 2);
      std::memcpy(&hi, row(i, 2 * t + 1) + 2 * g, 2);
    }
    r[i] = std::uint32_t(lo) | (std::uint32_t(hi) << 16);
  }
}

/// d = c + A B for this lane's four C elements (the warp's product in fp64,
/// rounded once).
inline void mma_apply(float c[4], const unsigned char* slots, ::blockattn_cuda_emu::Op op) {
  const double* ab = ::blockattn_cuda_emu::warp_mma_product(slots, op);
  const int lane = ::blockattn_cuda_emu::lane_id(), g = lane / 4, t = lane % 4;
  for (int e = 0; e < 4; ++e) {
    const int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
    c[e] = float(double(c[e]) + ab[row * 8 + col]);
  }
}
}  // namespace emu_detail

inline void ldmatrix_x4(std::uint32_t r[4], const void* p) {
  emu_detail::ldmatrix(r, p, false);
}
inline void ldmatrix_x4_trans(std::uint32_t r[4], const void* p) {
  emu_detail::ldmatrix(r, p, true);
}

/// c += a * b, m16n8k16, fp32 accumulation; bf16 (IsBf16) or fp16 operands.
template <bool IsBf16>
inline void mma16816(float c[4], const std::uint32_t a[4], std::uint32_t b0, std::uint32_t b1) {
  namespace e = ::blockattn_cuda_emu;
  const std::uint32_t in[6] = {a[0], a[1], a[2], a[3], b0, b1};
  const e::Op op = IsBf16 ? e::Op::mma_bf16 : e::Op::mma_f16;
  emu_detail::mma_apply(c, e::warp_exchange(in, sizeof in, op), op);
}

/// c += a b, m16n8k8, TF32 operands (their 13 low mantissa bits ignored).
inline void mma1688(float c[4], const std::uint32_t a[4], std::uint32_t b0, std::uint32_t b1) {
  namespace e = ::blockattn_cuda_emu;
  const std::uint32_t in[6] = {a[0], a[1], a[2], a[3], b0, b1};
  emu_detail::mma_apply(c, e::warp_exchange(in, sizeof in, e::Op::mma_tf32), e::Op::mma_tf32);
}

/// cvt.rna.tf32.f32: round to 10 mantissa bits, ties away from zero (the
/// result's 13 low bits zero); NaN stays NaN.
inline std::uint32_t to_tf32(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fffffffu;
  if ((u & 0x7f800000u) == 0x7f800000u) return u;  // inf
  return (u + 0x1000u) & ~0x1fffu;
}

/// ex2.approx.ftz.f32 (exact here; the hardware's is within 2 ulp):
/// subnormal inputs and results flushed to zero.
inline float fast_exp2(float x) {
  if (std::fpclassify(x) == FP_SUBNORMAL) x = 0.0f;
  const float y = std::exp2(x);
  return std::fpclassify(y) == FP_SUBNORMAL ? 0.0f : y;
}

}  // namespace blockattn::impl::flash
