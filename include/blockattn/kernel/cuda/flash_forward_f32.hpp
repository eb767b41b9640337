// SPDX-License-Identifier: Apache-2.0
// A tensor-core forward for fp32 inputs on CUDA (sm_80 and later): the
// FlashAttention-2 recipe of cuda/flash_forward.hpp with mma.sync.m16n8k8 on TF32
// operands, for every mask on global positions.
//
// Products (template parameter Passes):
//   3 ("tf32x3"): each operand x is split into big = tf32(x) (cvt.rna, 10
//     explicit mantissa bits) and small = tf32(x - big), and a b is taken as
//     small_a big_b + big_a small_b + big_a big_b, accumulated in fp32. The
//     dropped small_a small_b and small's rounding are ~2^-22 relative, so the
//     products are fp32-class; PyTorch's memory-efficient SDPA computes fp32
//     the same way on sm_80 and later (CUTLASS's OpMultiplyAddFastF32), and
//     that is the backend PyTorch's fp32 SDPA runs on these GPUs.
//   1 ("tf32"): big_a big_b alone, 10-bit mantissas (PyTorch's allow_tf32).
//
// One CTA = 4 warps of one (batch, head), 64 query rows (one m-tile of 16
// per warp); Q (64 x D), K and V tiles (64 keys x D) in shared memory, staged
// by 16-byte cp.async, XOR-swizzled by 16-byte chunk (flash_frag.hpp swz32);
// Q's and K's fragments by ldmatrix (a 32-bit value is a pair of 16-bit
// halves to it); S = Q K^T; the online softmax in exp2 on the fragments
// (cuda/flash_forward.hpp's); O += P V with P's C fragments as A fragments in a
// permuted key order, so that no shuffle is needed and V's B fragments are
// 32-bit loads free of bank conflicts (flash_frag.hpp c2a32, pv32_offset).
// Shared memory (64 + 128) x D x 4 bytes: 96 KB at D = 128, 2 CTAs per SM.
// Empty key tiles are skipped, full ones take no mask work, masks with
// allowed_keys() work from the rows' intervals in shared memory, as in
// cuda/flash_forward.hpp.
//
// Inputs must be finite (the library checks and sends others to the fp32
// kernels on CUDA cores): a split of inf is NaN, and P = 0 of a masked key
// times an inf in V would be NaN where the contract wants the row untouched.
//
// Output: normalised O (fp32) and LSE (natural log); rows that see no key get
// O = 0 and LSE = -inf.
//
// Compiled only in nvcc's passes with Kokkos' CUDA backend, or on the host
// with BLOCKATTN_CUDA_EMULATION (cuda/flash_forward.hpp).
#pragma once

#include <blockattn/kernel/cuda/flash_forward.hpp>
#include <blockattn/kernel/cuda/flash_frag.hpp>

#if (defined(KOKKOS_ENABLE_CUDA) && defined(__CUDACC__)) || defined(BLOCKATTN_CUDA_EMULATION)

namespace blockattn::impl::flash {

constexpr int f32_block_m = warps * 16;  // query rows of a CTA: one m-tile per warp

/// Shared-memory bytes of one CTA of the fp32 kernel for head dim D.
constexpr int smem_bytes_f32(int D) {
  return (f32_block_m + 2 * block_n) * D * 4;
}

#if !defined(BLOCKATTN_CUDA_EMULATION)  // cuda_emu_ptx.hpp
__device__ __forceinline__ std::uint32_t to_tf32(float x) {
  std::uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return r;
}

#endif

/// x as TF32: big, and with Passes == 3 also small = tf32(x - big).
template <int Passes>
__device__ __forceinline__ void split_tf32(float x, std::uint32_t& big, std::uint32_t& small) {
  big = to_tf32(x);
  if constexpr (Passes == 3)
    small = to_tf32(x - __uint_as_float(big));
  else
    small = 0u;
}

#if !defined(BLOCKATTN_CUDA_EMULATION)  // cuda_emu_ptx.hpp
/// c += a b, m16n8k8, TF32 operands, fp32 accumulation.
__device__ __forceinline__ void mma1688(float c[4], const std::uint32_t a[4], std::uint32_t b0,
                                        std::uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

#endif

/// c += a b from split operands: the small terms first (Passes == 3), then
/// big_a big_b.
template <int Passes>
__device__ __forceinline__ void mma_tf32(float c[4], const std::uint32_t (&a_big)[4],
                                         const std::uint32_t (&a_small)[4], std::uint32_t b_big0,
                                         std::uint32_t b_big1, std::uint32_t b_small0,
                                         std::uint32_t b_small1) {
  if constexpr (Passes == 3) {
    mma1688(c, a_small, b_big0, b_big1);
    mma1688(c, a_big, b_small0, b_small1);
  }
  mma1688(c, a_big, b_big0, b_big1);
}

/// Loads rows [row0, row0 + TileRows) of a (rows x D) fp32 operand into a
/// swizzled tile; rows at or past `rows` are zero-filled.
template <int D, int TileRows>
__device__ __forceinline__ void load_tile32(float* tile, const float* base, std::int64_t row_stride,
                                            int row0, int rows) {
  constexpr int chunks = D / 4;  // 16-byte chunks per row
  for (int i = threadIdx.x; i < TileRows * chunks; i += threads) {
    const int r = i / chunks, c = i % chunks;
    const int row = row0 + r;
    const bool in = row < rows;
    const float* src = base + (in ? std::int64_t(row) * row_stride : 0) + c * 4;
    cp_async16(tile + swz32<D>(r, c), src, in ? 16 : 0);
  }
}

template <int D, int Passes, class Mask, class QPos, class KPos>
__global__ void __launch_bounds__(threads, 2)
    forward_f32_kernel(const Args a, const Mask mask, const QPos qpos, const KPos kpos) {
  static_assert(D % 8 == 0 && D <= 128, "head dim: a multiple of 8 up to 128");
  static_assert(Passes == 1 || Passes == 3, "TF32 products: 1 or 3 per product");
  constexpr int BM = f32_block_m;
  BLOCKATTN_DYNAMIC_SHARED(float, smem_f32);
  float* sq = smem_f32;
  float* sk = smem_f32 + BM * D;
  float* sv = sk + block_n * D;

  // The last rows (the longest under a causal mask) first (cta_order.hpp).
  const CtaTile cta = cta_tile(a.order, blockIdx.x, blockIdx.y, blockIdx.z, true);
  if (!cta.live) return;  // (the whole CTA: an idle place of a last group)
  const int m_block = cta.block, h = cta.head, b = cta.batch;
  const int kvh = a.order.per_kv.div(h);
  const int q0 = m_block * BM;
  const int q1 = q0 + BM < a.queries ? q0 + BM : a.queries;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;

  const auto* qg = static_cast<const float*>(a.q) + b * a.q_stride[0] + h * a.q_stride[2];
  const auto* kg = static_cast<const float*>(a.k) + b * a.k_stride[0] + kvh * a.k_stride[2];
  const auto* vg = static_cast<const float*>(a.v) + b * a.v_stride[0] + kvh * a.v_stride[2];

  __shared__ cta_spans_t<Mask, BM> spans;
  // Masks with allowed_keys(): the rows' TileKeys of the tile being computed
  // (read before the loop's second barrier, then written for the next).
  constexpr bool ranged = has_allowed_keys<Mask>::value;
  __shared__ std::uint32_t tile_keys[ranged ? BM : 1];
  int tiles = (a.keys + block_n - 1) / block_n, j_first = 0;
  if constexpr (ranged) cta_spans(mask, qpos, kpos, q0, q1, a.keys, spans, j_first, tiles);
  int j = block_next_tile(mask, spans, qpos, kpos, q0, q1, a.keys, j_first, tiles);
  if (j < tiles) stage_tile_keys(mask, spans, kpos, a.keys, j, tile_keys);

  load_tile32<D, BM>(sq, qg + std::int64_t(q0) * a.q_stride[1], a.q_stride[1], 0, q1 - q0);
  if (j < tiles) load_tile32<D, block_n>(sk, kg, a.k_stride[1], j * block_n, a.keys);
  cp_async_commit();

  const int row_lo = q0 + warp * 16 + g, row_hi = row_lo + 8;  // this thread's rows
  const float scale_log2 = a.scale * 1.4426950408889634f;

  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) o[n][e] = 0.0f;
  float m_lo = -INFINITY, m_hi = -INFINITY, l_lo = 0.0f, l_hi = 0.0f;

  while (j < tiles) {
    const int k0 = j * block_n;
    const int k1 = k0 + block_n < a.keys ? k0 + block_n : a.keys;
    const TileKind kind = block_tile_kind(mask, spans, qpos, kpos, q0, q1, k0, k1);
    cp_async_wait_all();  // K_j (and Q)
    __syncthreads();      // ... visible to every warp; V's buffer free
    load_tile32<D, block_n>(sv, vg, a.v_stride[1], k0, a.keys);
    cp_async_commit();

    // S = Q K^T: 16 rows x 64 keys per warp, 8 n-tiles, D / 8 k-steps.
    float s[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) s[n][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < D / 8; ++kk) {
      std::uint32_t qr[4], qb[4], qs[4];
      ldmatrix_x4(qr, sq + frag32_offset<D>(ldsm_a(lane), warp * 16, 2 * kk));
#pragma unroll
      for (int i = 0; i < 4; ++i) split_tf32<Passes>(__uint_as_float(qr[i]), qb[i], qs[i]);
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        std::uint32_t r[4], rb[4], rs[4];
        ldmatrix_x4(r, sk + frag32_offset<D>(ldsm_b(lane), 16 * p, 2 * kk));
#pragma unroll
        for (int i = 0; i < 4; ++i) split_tf32<Passes>(__uint_as_float(r[i]), rb[i], rs[i]);
        mma_tf32<Passes>(s[2 * p], qb, qs, rb[0], rb[1], rs[0], rs[1]);
        mma_tf32<Passes>(s[2 * p + 1], qb, qs, rb[2], rb[3], rs[2], rs[3]);
      }
    }

    // Mask: keys past the end, and the mask itself in partial tiles.
    if (kind == TileKind::partial || k1 - k0 < block_n) {
      const int r = row_lo - q0;  // this thread's row lo in the CTA
      if constexpr (ranged) {
        mask_fragment_keys(s, TileKeys(tile_keys[r]), TileKeys(tile_keys[r + 8]), t);
      } else {
        const bool check = kind == TileKind::partial;
        mask_fragment(s, row_test(mask, spans, qpos, q0, q1, r, check),
                      row_test(mask, spans, qpos, q0, q1, r + 8, check), kpos, k0, k1, t);
      }
    }

    // Online softmax of the rows.
    softmax_step(s, o, m_lo, m_hi, l_lo, l_hi, scale_log2);

    // V_j ready; every warp is done with K_j: load the next live K tile.
    cp_async_wait_all();
    __syncthreads();
    const int next = block_next_tile(mask, spans, qpos, kpos, q0, q1, a.keys, j + 1, tiles);
    if (next < tiles) {
      load_tile32<D, block_n>(sk, kg, a.k_stride[1], next * block_n, a.keys);
      stage_tile_keys(mask, spans, kpos, a.keys, next, tile_keys);
    }
    cp_async_commit();

    // O += P V: k-step ks takes the 8 keys of P's n-tile ks (c2a32's order).
#pragma unroll
    for (int ks = 0; ks < 8; ++ks) {
      std::uint32_t pb[4], ps[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) split_tf32<Passes>(s[ks][c2a32(i)], pb[i], ps[i]);
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        std::uint32_t vb[2], vs[2];
#pragma unroll
        for (int i = 0; i < 2; ++i)
          split_tf32<Passes>(sv[pv32_offset<D>(lane, i, 8 * ks, 8 * n)], vb[i], vs[i]);
        mma_tf32<Passes>(o[n], pb, ps, vb[0], vb[1], vs[0], vs[1]);
      }
    }
    j = next;
  }
  cp_async_wait_all();

  // Normalise and write O and LSE.
  auto* og = static_cast<float*>(a.o) + b * a.o_stride[0] + h * a.o_stride[2];
  float* lg = a.lse + b * a.lse_stride[0] + h * a.lse_stride[1];
  float ll = l_lo, lh = l_hi;
#pragma unroll
  for (int d = 1; d <= 2; d <<= 1) {
    ll += __shfl_xor_sync(0xffffffffu, ll, d);
    lh += __shfl_xor_sync(0xffffffffu, lh, d);
  }
  // l == 0: the row saw nothing (O = 0, LSE = -inf); a NaN l stays NaN.
  const float inv_lo = ll == 0.0f ? 0.0f : 1.0f / ll;
  const float inv_hi = lh == 0.0f ? 0.0f : 1.0f / lh;
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    const int col = 8 * n + 2 * t;
    if (row_lo < q1)
      *reinterpret_cast<float2*>(og + std::int64_t(row_lo) * a.o_stride[1] + col) =
          make_float2(o[n][0] * inv_lo, o[n][1] * inv_lo);
    if (row_hi < q1)
      *reinterpret_cast<float2*>(og + std::int64_t(row_hi) * a.o_stride[1] + col) =
          make_float2(o[n][2] * inv_hi, o[n][3] * inv_hi);
  }
  if (t == 0) {
    if (row_lo < q1)
      lg[std::int64_t(row_lo) * a.lse_stride[2]] =
          ll == 0.0f ? -INFINITY : m_lo * a.scale + logf(ll);
    if (row_hi < q1)
      lg[std::int64_t(row_hi) * a.lse_stride[2]] =
          lh == 0.0f ? -INFINITY : m_hi * a.scale + logf(lh);
  }
}

/// Whether the fp32 kernel takes a problem (supports_rows: fp32 rows).
inline bool supports_f32(const Args& a, int dim) {
  return supports_rows(a, dim, 4);
}

/// Enqueues the fp32 forward with Passes TF32 products per product (3 or 1)
/// on `stream`; returns CUDA's error of the launch.
template <int Passes, class Mask, class QPos, class KPos>
cudaError_t forward_f32(const Args& a, int dim, const Mask& mask, const QPos& qpos,
                        const KPos& kpos, cudaStream_t stream) {
  if (a.queries <= 0 || a.batch <= 0 || a.heads <= 0) return cudaSuccess;
  auto launch = [&](auto kernel) {
    return launch_ordered(kernel, smem_bytes_f32(dim), stream,
                          (a.queries + f32_block_m - 1) / f32_block_m, a.heads, a, mask, qpos,
                          kpos);
  };
  if (dim == 64) return launch(forward_f32_kernel<64, Passes, Mask, QPos, KPos>);
  return launch(forward_f32_kernel<128, Passes, Mask, QPos, KPos>);
}

}  // namespace blockattn::impl::flash

#endif
