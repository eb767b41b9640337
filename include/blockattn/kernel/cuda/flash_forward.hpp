// SPDX-License-Identifier: Apache-2.0
// A tensor-core forward for 16-bit inputs on CUDA (sm_80 and later), in the
// FlashAttention-2 recipe, for every mask on global positions:
//
//   one CTA = 4 warps of one (batch, head); the default variant ("wide")
//   takes 128 query rows, two 16-row m-tiles per warp, so that each K / V
//   fragment read from shared memory feeds four products; "regs" and "smem"
//   take 64 rows, one m-tile per warp (Variant);
//   Q (128 or 64 x D), K and V tiles (64 keys x D) staged in shared memory by
//   16-byte cp.async, XOR-swizzled by 16-byte chunk (chunk ^ (row & 7)) so
//   that ldmatrix reads 8 rows without bank conflicts; Q's mma A fragments
//   read from shared memory at every key tile (kept in registers by "regs");
//   S = Q K^T by mma.sync.m16n8k16 (fp32 accumulation); the
//   online softmax in exp2 on the fragments; P rounded to the storage type
//   as the A fragment of O += P V (V through ldmatrix.trans); V's load
//   overlaps Q K^T and the next K tile's load overlaps P V.
//
// Key tiles are classified: empty tiles are never loaded, full tiles take no
// mask work, partial tiles apply the mask per element. Masks with
// allowed_keys() (causal, windows, prefix-LM, documents, ...) give every row
// of the CTA its interval once, kept in shared memory (CtaSpans,
// row_spans.hpp): a tile's kind is then four comparisons, the CTA visits
// only the tiles the rows' hull reaches, and for a tile that needs masking
// one thread per row turns its interval into the tile's key indices it sees
// (TileKeys: two binary searches over the tile's positions), so that the
// mask is two 32-bit comparisons per element. Other masks: classify() on
// the tile's position box, allowed() per key of a partial tile. Positions
// come from the two maps (any increasing map: offsets, partitions' affine
// maps, tables).
//
// Output: normalised O (storage type) and LSE (fp32, natural log) of every
// row; rows that see no key get O = 0 and LSE = -inf.
//
// Compiled only in nvcc's passes with Kokkos' CUDA backend, or on the host
// with BLOCKATTN_CUDA_EMULATION (tests/cuda_emu: the kernels' source run and
// checked on a CPU; the PTX wrappers below then come from cuda_emu_ptx.hpp).
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/kernel/cuda/flash_common.hpp>
#include <blockattn/policy/mask.hpp>

#include <cstdint>

#if (defined(KOKKOS_ENABLE_CUDA) && defined(__CUDACC__)) || defined(BLOCKATTN_CUDA_EMULATION)

namespace blockattn::impl::flash {

/// One CTA: MT m-tiles of 16 query rows per warp (Variant). QInRegs (regs):
/// Q's fragments loaded once and kept in registers (1 CTA per SM guaranteed
/// by the bounds, the compiler takes what it needs); otherwise read from
/// shared memory at every key tile (smem: bounded for 3 CTAs per SM; wide: 2).
template <int D, bool IsBf16, int MT, bool QInRegs, class Mask, class QPos, class KPos>
__global__ void __launch_bounds__(threads, QInRegs ? 1 : (MT == 1 ? 3 : 2))
    forward_kernel(const Args a, const Mask mask, const QPos qpos, const KPos kpos) {
  static_assert(D % 16 == 0 && D <= 256, "head dim: a multiple of 16 up to 256");
  static_assert(!QInRegs || MT == 1, "Q in registers: one m-tile per warp");
  constexpr int BM = block_m_of(MT);  // query rows of the CTA
  BLOCKATTN_DYNAMIC_SHARED(std::uint16_t, smem);
  std::uint16_t* sq = smem;
  std::uint16_t* sk = smem + BM * D;
  std::uint16_t* sv = sk + block_n * D;

  // The last rows (the longest under a causal mask) first (cta_order.hpp).
  const CtaTile cta = cta_tile(a.order, blockIdx.x, blockIdx.y, blockIdx.z, true);
  if (!cta.live) return;  // (the whole CTA: an idle place of a last group)
  const int m_block = cta.block, h = cta.head, b = cta.batch;
  const int kvh = a.order.per_kv.div(h);
  const int q0 = m_block * BM;
  const int q1 = q0 + BM < a.queries ? q0 + BM : a.queries;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;

  const auto* qg = static_cast<const std::uint16_t*>(a.q) + b * a.q_stride[0] + h * a.q_stride[2];
  const auto* kg = static_cast<const std::uint16_t*>(a.k) + b * a.k_stride[0] + kvh * a.k_stride[2];
  const auto* vg = static_cast<const std::uint16_t*>(a.v) + b * a.v_stride[0] + kvh * a.v_stride[2];

  __shared__ cta_spans_t<Mask, BM> spans;
  // Masks with allowed_keys(): the rows' TileKeys of the tile being computed
  // (read before the loop's second barrier, then written for the next).
  constexpr bool ranged = has_allowed_keys<Mask>::value;
  __shared__ std::uint32_t tile_keys[ranged ? BM : 1];
  int tiles = (a.keys + block_n - 1) / block_n, j_first = 0;
  if constexpr (ranged) cta_spans(mask, qpos, kpos, q0, q1, a.keys, spans, j_first, tiles);
  int j = block_next_tile(mask, spans, qpos, kpos, q0, q1, a.keys, j_first, tiles);
  if (j < tiles) stage_tile_keys(mask, spans, kpos, a.keys, j, tile_keys);

  // Q and the first K tile.
  load_tile<D, BM>(sq, qg + std::int64_t(q0) * a.q_stride[1], a.q_stride[1], 0, q1 - q0);
  if (j < tiles) load_tile<D>(sk, kg, a.k_stride[1], j * block_n, a.keys);
  cp_async_commit();

  // This thread's rows: g and g + 8 of each of its warp's m-tiles (warp w
  // holds rows [16 MT w, 16 MT (w + 1)) of the CTA); their masks are read
  // where a partial tile needs them (registers are scarce at MT = 2).
  const int row0 = q0 + warp * MT * 16 + g;  // row g of m-tile 0
  const float scale_log2 = a.scale * 1.4426950408889634f;

  constexpr int kd = D / 16;  // k-steps of Q K^T, and 16-column pairs of O
  std::uint32_t qf[QInRegs ? kd : MT][4];
  float o[MT][2 * kd][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int n = 0; n < 2 * kd; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][n][e] = 0.0f;
  float m_lo[MT], m_hi[MT], l_lo[MT], l_hi[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    m_lo[mt] = m_hi[mt] = -INFINITY;
    l_lo[mt] = l_hi[mt] = 0.0f;
  }
  bool have_q = false;

  while (j < tiles) {
    const int k0 = j * block_n;
    const int k1 = k0 + block_n < a.keys ? k0 + block_n : a.keys;
    const TileKind kind = block_tile_kind(mask, spans, qpos, kpos, q0, q1, k0, k1);
    cp_async_wait_all();  // K_j (and Q)
    __syncthreads();      // ... visible to every warp; V's buffer free
    load_tile<D>(sv, vg, a.v_stride[1], k0, a.keys);
    cp_async_commit();
    if (QInRegs && !have_q) {
#pragma unroll
      for (int kk = 0; kk < kd; ++kk)
        ldmatrix_x4(qf[QInRegs ? kk : 0], sq + frag_offset<D>(ldsm_a(lane), warp * 16, 2 * kk));
      have_q = true;
    }

    // S = Q K^T: 16 MT rows x 64 keys per warp, 8 n-tiles of 8 keys; each K
    // fragment feeds the products of every m-tile.
    float s[MT][8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][n][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kd; ++kk) {
      if constexpr (!QInRegs) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          ldmatrix_x4(qf[mt], sq + frag_offset<D>(ldsm_a(lane), (warp * MT + mt) * 16, 2 * kk));
      }
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        std::uint32_t r[4];
        ldmatrix_x4(r, sk + frag_offset<D>(ldsm_b(lane), 16 * p, 2 * kk));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const std::uint32_t(&qa)[4] = qf[QInRegs ? kk : mt];
          mma16816<IsBf16>(s[mt][2 * p], qa, r[0], r[1]);
          mma16816<IsBf16>(s[mt][2 * p + 1], qa, r[2], r[3]);
        }
      }
    }

    // Mask: keys past the end, and the mask itself in partial tiles.
    // `masked` (mask_fragment): the keys masked out, which P V must skip
    // when V holds inf or NaN.
    std::uint32_t masked[MT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) masked[mt] = 0;
    if (kind == TileKind::partial || k1 - k0 < block_n) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int r = row0 - q0 + 16 * mt;  // this thread's row lo of m-tile mt in the CTA
        if constexpr (ranged) {
          masked[mt] =
              mask_fragment_keys(s[mt], TileKeys(tile_keys[r]), TileKeys(tile_keys[r + 8]), t);
        } else {
          const bool check = kind == TileKind::partial;
          masked[mt] =
              mask_fragment(s[mt], row_test(mask, spans, qpos, q0, q1, r, check),
                            row_test(mask, spans, qpos, q0, q1, r + 8, check), kpos, k0, k1, t);
        }
      }
    }

    // Online softmax of the rows; P packed in pairs of the storage type at
    // once (the products' A operand: 32 registers where S held 64).
    std::uint32_t pk[MT][8][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      softmax_step(s[mt], o[mt], m_lo[mt], m_hi[mt], l_lo[mt], l_hi[mt], scale_log2);
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        pk[mt][n][0] = pack2<IsBf16>(s[mt][n][0], s[mt][n][1]);
        pk[mt][n][1] = pack2<IsBf16>(s[mt][n][2], s[mt][n][3]);
      }
    }

    // V_j ready; every warp is done with K_j: load the next live K tile.
    cp_async_wait_all();
    // A partial tile whose V holds inf or NaN: masked keys (P = 0) must not
    // turn 0 * inf into NaN, so P V skips them (rare: a slower exact loop).
    bool v_bad = false;
    if (kind == TileKind::partial) {
      __syncthreads();
      v_bad = __syncthreads_or(tile_not_finite<D, IsBf16>(sv));
    } else {
      __syncthreads();
    }
    const int next = block_next_tile(mask, spans, qpos, kpos, q0, q1, a.keys, j + 1, tiles);
    if (next < tiles) {
      load_tile<D>(sk, kg, a.k_stride[1], next * block_n, a.keys);
      stage_tile_keys(mask, spans, kpos, a.keys, next, tile_keys);
    }
    cp_async_commit();
    if (v_bad) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) masked_pv<D, IsBf16>(o[mt], pk[mt], masked[mt], sv, lane);
      j = next;
      continue;
    }

    // O += P V: P's C fragments are the A fragments of 16-key steps; each V
    // fragment feeds the products of every m-tile.
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      std::uint32_t pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) pa[mt][i] = pk[mt][2 * ks + c2a_ntile(i)][c2a_elem(i) / 2];
      }
#pragma unroll
      for (int dp = 0; dp < kd; ++dp) {
        std::uint32_t r[4];
        ldmatrix_x4_trans(r, sv + frag_offset<D>(ldsm_bt(lane), 16 * ks, 2 * dp));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816<IsBf16>(o[mt][2 * dp], pa[mt], r[0], r[1]);
          mma16816<IsBf16>(o[mt][2 * dp + 1], pa[mt], r[2], r[3]);
        }
      }
    }
    j = next;
  }
  cp_async_wait_all();

  // Normalise and write O and LSE.
  auto* og = static_cast<std::uint16_t*>(a.o) + b * a.o_stride[0] + h * a.o_stride[2];
  float* lg = a.lse + b * a.lse_stride[0] + h * a.lse_stride[1];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int row_lo = row0 + 16 * mt, row_hi = row_lo + 8;
    float ll = l_lo[mt], lh = l_hi[mt];
#pragma unroll
    for (int d = 1; d <= 2; d <<= 1) {
      ll += __shfl_xor_sync(0xffffffffu, ll, d);
      lh += __shfl_xor_sync(0xffffffffu, lh, d);
    }
    // l == 0: the row saw nothing (O = 0, LSE = -inf); a NaN l stays NaN.
    const float inv_lo = ll == 0.0f ? 0.0f : 1.0f / ll;
    const float inv_hi = lh == 0.0f ? 0.0f : 1.0f / lh;
#pragma unroll
    for (int n = 0; n < 2 * kd; ++n) {
      const int col = 8 * n + 2 * t;
      if (row_lo < q1)
        *reinterpret_cast<std::uint32_t*>(og + std::int64_t(row_lo) * a.o_stride[1] + col) =
            pack2<IsBf16>(o[mt][n][0] * inv_lo, o[mt][n][1] * inv_lo);
      if (row_hi < q1)
        *reinterpret_cast<std::uint32_t*>(og + std::int64_t(row_hi) * a.o_stride[1] + col) =
            pack2<IsBf16>(o[mt][n][2] * inv_hi, o[mt][n][3] * inv_hi);
    }
    if (t == 0) {
      if (row_lo < q1)
        lg[std::int64_t(row_lo) * a.lse_stride[2]] =
            ll == 0.0f ? -INFINITY : m_lo[mt] * a.scale + logf(ll);
      if (row_hi < q1)
        lg[std::int64_t(row_hi) * a.lse_stride[2]] =
            lh == 0.0f ? -INFINITY : m_hi[mt] * a.scale + logf(lh);
    }
  }
}

/// Enqueues `kernel` (threads per CTA, `bytes` of dynamic shared memory,
/// allowed here by cudaFuncSetAttribute) over `blocks` CTAs for each of
/// batch x heads units in the order of cta_order.hpp: `args` (Args or
/// BackwardArgs) with its `order` set, one launch per max_ranks ranks.
/// args.cta_group 0: cta_group() for the slots of the current device (its SM
/// count times the kernel's occupancy). Returns CUDA's error of the first
/// launch that failed; cudaErrorInvalidConfiguration where blocks or units
/// pass 2^31 - 1.
template <class Kernel, class KArgs, class... Rest>
cudaError_t launch_ordered(Kernel kernel, int bytes, cudaStream_t stream, long long blocks,
                           int heads, KArgs args, const Rest&... rest) {
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e != cudaSuccess) return e;
  int group = args.cta_group;
  if (group < 1) {
    int device = 0, sms = 0, per_sm = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, bytes) !=
            cudaSuccess) {
      (void)cudaGetLastError();  // (not sticky) the order falls back to unit by unit
      sms = per_sm = 0;
    }
    const long long units = static_cast<long long>(args.batch) * heads;
    group = cta_group(units < INT_MAX ? int(units) : INT_MAX, static_cast<long long>(sms) * per_sm);
  }
  if (!cta_order(blocks, args.batch, heads, group, args.order))
    return cudaErrorInvalidConfiguration;
  const int kv_group = args.kv_heads > 0 ? args.heads / args.kv_heads : 1;
  args.order.per_kv = FastDiv(kv_group > 1 ? kv_group : 1);
  for (long long first = 0; first < blocks; first += max_ranks) {
    args.order.rank_offset = int(first);
    const CtaGrid g = cta_grid_extents(args.order);
    BLOCKATTN_CUDA_LAUNCH(kernel, dim3(unsigned(g.x), unsigned(g.y), unsigned(g.z)), threads, bytes,
                          stream)
    (args, rest...);
    e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

/// Whether a forward kernel whose rows hold `align` values per 16 bytes (8
/// for 16-bit, 4 for fp32) takes a problem: head dim 64 or 128, contiguous
/// head dims, rows 16-byte aligned, heads a multiple of kv_heads.
inline bool supports_rows(const Args& a, int dim, int align) {
  if (dim != 64 && dim != 128) return false;
  if (a.kv_heads <= 0 || a.heads % a.kv_heads != 0) return false;
  for (const void* p : {a.q, a.k, a.v, static_cast<const void*>(a.o)})
    if (reinterpret_cast<std::uintptr_t>(p) % 16 != 0) return false;
  for (const std::int64_t* s : {a.q_stride, a.k_stride, a.v_stride, a.o_stride})
    for (int i = 0; i < 3; ++i)
      if (s[i] % align != 0) return false;
  return true;
}

/// Whether this (16-bit) kernel takes a problem (supports_rows).
inline bool supports(const Args& a, int dim) {
  return supports_rows(a, dim, 8);
}

/// Enqueues the forward on `stream`; returns CUDA's error of the launch.
template <bool IsBf16, class Mask, class QPos, class KPos>
cudaError_t forward(const Args& a, int dim, const Mask& mask, const QPos& qpos, const KPos& kpos,
                    cudaStream_t stream) {
  if (a.queries <= 0 || a.batch <= 0 || a.heads <= 0) return cudaSuccess;
  auto launch = [&](auto kernel, Variant v) {
    return launch_ordered(kernel, smem_bytes(dim, v), stream,
                          (a.queries + block_m(v) - 1) / block_m(v), a.heads, a, mask, qpos, kpos);
  };
  if constexpr (all_variants) {
    switch (a.variant) {
      case Variant::regs:
        if (dim == 64)
          return launch(forward_kernel<64, IsBf16, 1, true, Mask, QPos, KPos>, Variant::regs);
        return launch(forward_kernel<128, IsBf16, 1, true, Mask, QPos, KPos>, Variant::regs);
      case Variant::smem:
        if (dim == 64)
          return launch(forward_kernel<64, IsBf16, 1, false, Mask, QPos, KPos>, Variant::smem);
        return launch(forward_kernel<128, IsBf16, 1, false, Mask, QPos, KPos>, Variant::smem);
      case Variant::wide:
        break;
    }
  } else if (a.variant != Variant::wide) {
    return cudaErrorNotSupported;  // flash_variant() accepts only wide here
  }
  if (dim == 64)
    return launch(forward_kernel<64, IsBf16, 2, false, Mask, QPos, KPos>, Variant::wide);
  return launch(forward_kernel<128, IsBf16, 2, false, Mask, QPos, KPos>, Variant::wide);
}

}  // namespace blockattn::impl::flash

#endif
