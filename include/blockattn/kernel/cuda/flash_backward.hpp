// SPDX-License-Identifier: Apache-2.0
// A tensor-core backward for 16-bit inputs on CUDA (sm_80 and later), in the
// FlashAttention-2 recipe, for every mask on global positions, deterministic
// (no atomics: the same bits on every run). Three kernels on one stream:
//
//   delta:  Δ_i = Σ_d dO_id O_id (fp32) of every query row;
//   dK, dV: one CTA per (batch, kv head, 64-key tile), 4 warps of 16 keys;
//           over the query tiles (64 rows) of every query head of the kv
//           head that the mask does not hide, Q and dO staged in shared
//           memory (double-buffered, 16-byte cp.async, swizzled), the
//           transposed scores in registers:
//             S^T = K Q^T, P^T = exp2(S^T scale log2 e - LSE_2)  (masked: 0)
//             dV += P^T dO,  dP^T = V dO^T,  dS^T = P^T (dP^T - Δ),
//             dK += dS^T Q   (scaled once at the end);
//   dQ:     one CTA per (batch, head, 64-row query tile), 4 warps of 16 rows,
//           over the live key tiles (K and V double-buffered):
//             S = Q K^T, P, dP = dO V^T, dS = P (dP - Δ), dQ += dS K.
// S and dP are recomputed in the dQ kernel (7 products per pair instead of
// FlashAttention-2's 5) so that dQ needs no atomic accumulation. P and dS
// are rounded to the storage type before their products (as FlashAttention
// and cuDNN do); accumulation is fp32.
//
// Every product is one of the two warp products of flash_frag.hpp (checked
// on the host by tests/test_flash_frag.cpp). Inputs must be finite (the
// caller checks: P = 0 of a masked pair times an inf in dO or V would give
// NaN where the contract wants none); rows whose LSE is -inf (they see no
// key) get zero gradients.
//
// Compiled only in nvcc's passes with Kokkos' CUDA backend, or on the host
// with BLOCKATTN_CUDA_EMULATION (cuda/flash_forward.hpp).
#pragma once

#include <blockattn/kernel/cuda/flash_forward.hpp>

#if (defined(KOKKOS_ENABLE_CUDA) && defined(__CUDACC__)) || defined(BLOCKATTN_CUDA_EMULATION)

namespace blockattn::impl::flash {

/// One backward call's operands: element strides (batch, sequence, head) of
/// the (batch, seq, heads, dim) operands (head dim contiguous), (batch,
/// head, row) of LSE; `delta`: fp32 workspace of batch * heads * queries.
struct BackwardArgs {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* o = nullptr;
  const void* dout = nullptr;
  const float* lse = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  float* delta = nullptr;
  std::int64_t q_stride[3] = {0, 0, 0}, k_stride[3] = {0, 0, 0}, v_stride[3] = {0, 0, 0},
               o_stride[3] = {0, 0, 0}, dout_stride[3] = {0, 0, 0}, dq_stride[3] = {0, 0, 0},
               dk_stride[3] = {0, 0, 0}, dv_stride[3] = {0, 0, 0}, lse_stride[3] = {0, 0, 0};
  int batch = 0, heads = 0, kv_heads = 0, queries = 0, keys = 0;
  float scale = 1.0f;
  // The CTAs' order (cta_order.hpp), as Args::cta_group: 0 cta_group() for
  // the GPU, 1 unit by unit; units are (batch, head), for dK/dV (batch, kv
  // head). Each launch sets `order`, which its kernel reads.
  int cta_group = 0;
  CtaOrder order;
};

constexpr int bwd_rows = 64;  // query rows of a tile, both kernels

/// Shared-memory bytes of the dK/dV kernel: K, V, and two buffers of Q, dO,
/// LSE_2 and Δ. Of the dQ kernel: Q, dO, and two buffers of K and V.
constexpr int dkdv_smem_bytes(int D) {
  return (2 * block_n + 4 * bwd_rows) * D * 2 + 4 * bwd_rows * 4;
}
constexpr int dq_smem_bytes(int D) {
  return (2 * bwd_rows + 4 * block_n) * D * 2;
}

/// Δ of every row: D / 8 lanes per row, 16 bytes of O and dO each.
template <int D, bool IsBf16>
__global__ void __launch_bounds__(threads) delta_kernel(const BackwardArgs a) {
  constexpr int lanes = D / 8, rows_per_cta = threads / lanes;
  const int h = blockIdx.y, b = blockIdx.z;
  const int row = blockIdx.x * rows_per_cta + int(threadIdx.x) / lanes;
  const int c = int(threadIdx.x) % lanes;
  float sum = 0.0f;
  if (row < a.queries) {
    const auto* o = static_cast<const std::uint16_t*>(a.o) + b * a.o_stride[0] +
                    std::int64_t(row) * a.o_stride[1] + h * a.o_stride[2] + 8 * c;
    const auto* d = static_cast<const std::uint16_t*>(a.dout) + b * a.dout_stride[0] +
                    std::int64_t(row) * a.dout_stride[1] + h * a.dout_stride[2] + 8 * c;
    const uint4 ov = *reinterpret_cast<const uint4*>(o), dv = *reinterpret_cast<const uint4*>(d);
    const std::uint32_t ow[4] = {ov.x, ov.y, ov.z, ov.w}, dw[4] = {dv.x, dv.y, dv.z, dv.w};
#pragma unroll
    for (int i = 0; i < 4; ++i)
      sum += storage_to_float<IsBf16>(std::uint16_t(ow[i] & 0xffffu)) *
                 storage_to_float<IsBf16>(std::uint16_t(dw[i] & 0xffffu)) +
             storage_to_float<IsBf16>(std::uint16_t(ow[i] >> 16)) *
                 storage_to_float<IsBf16>(std::uint16_t(dw[i] >> 16));
  }
  for (int d = lanes / 2; d >= 1; d >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, d);
  if (row < a.queries && c == 0) a.delta[(std::int64_t(b) * a.heads + h) * a.queries + row] = sum;
}

/// acc (16 x 16 NP, 2 NP n-tiles) += X Y^T: X = rows x_row0 .. + 15 of the
/// swizzled tile x, Y = rows y_row0 .. + 16 NP - 1 of tile y (flash_frag.hpp:
/// ldsm_a, ldsm_b). NP = 4: all 64 rows of y.
template <int D, bool IsBf16, int NP = 4>
__device__ __forceinline__ void warp_x_yt(float (&acc)[2 * NP][4], const std::uint16_t* x,
                                          int x_row0, const std::uint16_t* y, int lane,
                                          int y_row0 = 0) {
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    std::uint32_t af[4];
    ldmatrix_x4(af, x + frag_offset<D>(ldsm_a(lane), x_row0, 2 * kk));
#pragma unroll
    for (int p = 0; p < NP; ++p) {
      std::uint32_t r[4];
      ldmatrix_x4(r, y + frag_offset<D>(ldsm_b(lane), y_row0 + 16 * p, 2 * kk));
      mma16816<IsBf16>(acc[2 * p], af, r[0], r[1]);
      mma16816<IsBf16>(acc[2 * p + 1], af, r[2], r[3]);
    }
  }
}

/// acc (16 x D) += P Y: P (16 x 64) from C fragments, rounded to the storage
/// type; Y = the 64 rows of tile y read k-major (c2a_*, ldsm_bt).
template <int D, bool IsBf16>
__device__ __forceinline__ void warp_p_y(float (&acc)[D / 8][4], const float (&p)[8][4],
                                         const std::uint16_t* y, int lane) {
#pragma unroll
  for (int ks = 0; ks < 4; ++ks) {
    std::uint32_t pa[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float(&c)[4] = p[2 * ks + c2a_ntile(i)];
      pa[i] = pack2<IsBf16>(c[c2a_elem(i)], c[c2a_elem(i) + 1]);
    }
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      std::uint32_t r[4];
      ldmatrix_x4_trans(r, y + frag_offset<D>(ldsm_bt(lane), 16 * ks, 2 * dp));
      mma16816<IsBf16>(acc[2 * dp], pa, r[0], r[1]);
      mma16816<IsBf16>(acc[2 * dp + 1], pa, r[2], r[3]);
    }
  }
}

/// Writes a warp's 16 x D accumulator (times `mul`) to rows row0 + c_row of
/// a (rows, D) operand with row stride `stride`, rows at or past `end` not.
template <int D, bool IsBf16>
__device__ __forceinline__ void store_rows(std::uint16_t* base, std::int64_t stride, int row0,
                                           int end, const float (&acc)[D / 8][4], float mul,
                                           int lane) {
  const int r_lo = row0 + c_row(lane, 0), r_hi = row0 + c_row(lane, 2);
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    const int col = 8 * n + c_col(lane, 0);
    if (r_lo < end)
      *reinterpret_cast<std::uint32_t*>(base + std::int64_t(r_lo) * stride + col) =
          pack2<IsBf16>(acc[n][0] * mul, acc[n][1] * mul);
    if (r_hi < end)
      *reinterpret_cast<std::uint32_t*>(base + std::int64_t(r_hi) * stride + col) =
          pack2<IsBf16>(acc[n][2] * mul, acc[n][3] * mul);
  }
}

/// LSE in base 2 for P = exp2(s scale log2 e - lse2): +inf where the row
/// sees no key (LSE = -inf) or does not exist, so that its P is 0.
__device__ __forceinline__ float lse_base2(float lse) {
  return lse == -INFINITY ? INFINITY : lse * 1.4426950408889634f;
}

/// Masks with allowed_keys(): the TileKeys of query rows [q0, q0 + bwd_rows)
/// (none past `queries`) in key tile [k0, k1) into out[0, bwd_rows) when
/// the pair needs masking (`edge`: partial, or a short key tile); nothing
/// otherwise, nor for other masks. The caller's next barrier makes them
/// visible.
template <class Mask, class QPos, class KPos>
__device__ __forceinline__ void stage_pair_keys(const Mask& mask, const QPos& qpos,
                                                const KPos& kpos, int q0, int queries, int k0,
                                                int k1, bool edge, std::uint32_t* out) {
  if constexpr (has_allowed_keys<Mask>::value) {
    const int q1 = q0 + bwd_rows < queries ? q0 + bwd_rows : queries;
    if (edge)
      for (int r = int(threadIdx.x); r < bwd_rows; r += threads) {
        std::uint32_t keys = 0;  // (an empty range)
        if (q0 + r < q1) {
          const KeyInterval iv = mask.allowed_keys(qpos(q0 + r));
          keys = tile_key_range(kpos, k0, k1 - k0, iv.begin, iv.end);
        }
        out[r] = keys;
      }
  } else {
    (void)mask, (void)qpos, (void)kpos, (void)q0, (void)queries, (void)k0, (void)k1, (void)edge,
        (void)out;
  }
}

/// dK and dV of one 64-key tile of one (batch, kv head).
template <int D, bool IsBf16, class Mask, class QPos, class KPos>
__global__ void __launch_bounds__(threads, 2)
    dkdv_kernel(const BackwardArgs a, const Mask mask, const QPos qpos, const KPos kpos) {
  static_assert(D % 16 == 0 && D <= 256, "head dim: a multiple of 16 up to 256");
  BLOCKATTN_DYNAMIC_SHARED(std::uint16_t, smem);
  std::uint16_t* sk = smem;
  std::uint16_t* sv = sk + block_n * D;
  // Buffer i of Q at sq + i * tile, of dO at sdo + i * tile (offsets, not a
  // pointer array: an array indexed at run time would live in local memory).
  constexpr int tile = bwd_rows * D;
  std::uint16_t* sq = sv + block_n * D;
  std::uint16_t* sdo = sq + 2 * tile;
  float* slse = reinterpret_cast<float*>(sdo + 2 * tile);  // [2][bwd_rows]
  float* sdelta = slse + 2 * bwd_rows;                     // [2][bwd_rows]

  // The first keys (seen by the most rows under a causal mask) first
  // (cta_order.hpp).
  const CtaTile cta = cta_tile(a.order, blockIdx.x, blockIdx.y, blockIdx.z, false);
  if (!cta.live) return;  // (the whole CTA: an idle place of a last group)
  const int kvh = cta.head, b = cta.batch;
  const int k0 = cta.block * block_n;
  const int k1 = k0 + block_n < a.keys ? k0 + block_n : a.keys;
  const int group = a.heads / a.kv_heads;
  const int q_tiles = (a.queries + bwd_rows - 1) / bwd_rows;
  // The (query head h, query tile qt) pairs of this kv head: u = h q_tiles +
  // qt in [u_begin, u_end) (h / group = kvh).
  const int u_begin = kvh * group * q_tiles, u_end = u_begin + group * q_tiles;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  // Masks with allowed_keys(): the TileKeys of each buffer's query rows.
  constexpr bool ranged = has_allowed_keys<Mask>::value;
  __shared__ std::uint32_t tile_keys[ranged ? 2 : 1][ranged ? bwd_rows : 1];
  __shared__ int pair_kind[2];  // each buffer's pair's TileKind

  const auto* kg = static_cast<const std::uint16_t*>(a.k) + b * a.k_stride[0] + kvh * a.k_stride[2];
  const auto* vg = static_cast<const std::uint16_t*>(a.v) + b * a.v_stride[0] + kvh * a.v_stride[2];

  // The next (query head, query tile) at or after u whose tile the mask does
  // not hide from this key tile (`u_end` if none), and its kind. The warp's
  // lanes test 32 pairs at once (every warp the same ones): a mask's
  // classify() may search its data in global memory (documents: binary
  // searches over the offsets), and a key tile of a short document sees few
  // of the pairs it scans. Each live pair is classified once.
  auto next_live = [&](int u, TileKind& kind) {
    for (; u < u_end; u += 32) {
      const int c = u + lane;
      TileKind mine = TileKind::empty;
      if (c < u_end) {
        const int q0 = (c % q_tiles) * bwd_rows;
        const int q1 = q0 + bwd_rows < a.queries ? q0 + bwd_rows : a.queries;
        mine = tile_kind(mask, qpos, kpos, q0, q1, k0, k1);
      }
      const unsigned hits = __ballot_sync(0xffffffffu, mine != TileKind::empty);
      if (hits != 0u) {
        const int first = __ffs(int(hits)) - 1;
        kind = TileKind(__shfl_sync(0xffffffffu, int(mine), first));
        return u + first;
      }
    }
    kind = TileKind::empty;
    return u_end;
  };
  // Stages Q, dO, LSE_2, Δ and the kind of pair u into buffer `buf`.
  auto stage = [&](int u, TileKind kind, int buf) {
    const int h = u / q_tiles, q0 = (u % q_tiles) * bwd_rows;
    const auto* qg = static_cast<const std::uint16_t*>(a.q) + b * a.q_stride[0] + h * a.q_stride[2];
    const auto* dg =
        static_cast<const std::uint16_t*>(a.dout) + b * a.dout_stride[0] + h * a.dout_stride[2];
    load_tile<D, bwd_rows>(sq + buf * tile, qg, a.q_stride[1], q0, a.queries);
    load_tile<D, bwd_rows>(sdo + buf * tile, dg, a.dout_stride[1], q0, a.queries);
    for (int r = threadIdx.x; r < bwd_rows; r += threads) {
      const int row = q0 + r;
      const bool in = row < a.queries;
      slse[buf * bwd_rows + r] =
          in ? lse_base2(a.lse[b * a.lse_stride[0] + h * a.lse_stride[1] + row * a.lse_stride[2]])
             : INFINITY;
      sdelta[buf * bwd_rows + r] =
          in ? a.delta[(std::int64_t(b) * a.heads + h) * a.queries + row] : 0.0f;
    }
    if (threadIdx.x == 0) pair_kind[buf] = int(kind);
    const bool edge = kind == TileKind::partial || k1 - k0 < block_n;
    stage_pair_keys(mask, qpos, kpos, q0, a.queries, k0, k1, edge, tile_keys[ranged ? buf : 0]);
  };

  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.0f;

  const float scale_log2 = a.scale * 1.4426950408889634f;
  load_tile<D>(sk, kg, a.k_stride[1], k0, a.keys);
  load_tile<D>(sv, vg, a.v_stride[1], k0, a.keys);
  TileKind first_kind;
  int u = next_live(u_begin, first_kind), buf = 0;
  if (u < u_end) stage(u, first_kind, 0);
  cp_async_commit();

  while (u < u_end) {
    cp_async_wait_all();  // K, V, and pair u's Q and dO
    __syncthreads();      // ... visible to every warp; the other buffer free
    const TileKind kind = TileKind(pair_kind[buf]);  // (staged with pair u)
    TileKind next_kind;
    const int next = next_live(u + 1, next_kind);
    if (next < u_end) stage(next, next_kind, buf ^ 1);
    cp_async_commit();

    const std::uint16_t* q_tile = sq + buf * tile;
    const std::uint16_t* do_tile = sdo + buf * tile;
    const float* lse2 = slse + buf * bwd_rows;
    const float* dlt = sdelta + buf * bwd_rows;

    // P^T (16 keys of this warp x 64 queries).
    float pt[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) pt[n][e] = 0.0f;
    warp_x_yt<D, IsBf16>(pt, sk, 16 * warp, q_tile, lane);
    const bool check = kind == TileKind::partial;
    const bool edge = check || k1 - k0 < block_n;
    // This thread's keys, relative to k0: kr_lo = 16 warp + c_row(lane, 0)
    // and kr_lo + 8 (absolute keys kept live across the loop spilled).
    const int kr_lo = 16 * warp + c_row(lane, 0);
    [[maybe_unused]] const int q0 = (u % q_tiles) * bwd_rows;
    [[maybe_unused]] const int q1 = q0 + bwd_rows < a.queries ? q0 + bwd_rows : a.queries;
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int col = 8 * n + c_col(lane, e), kr = e < 2 ? kr_lo : kr_lo + 8;
        bool keep = true;
        if (edge) {
          if constexpr (ranged) {
            keep = TileKeys(tile_keys[buf][col])(kr);
          } else {
            const int qi = q0 + col < q1 ? q0 + col : q1 - 1, key = k0 + kr;
            keep = key < k1 && (!check || mask.allowed(qpos(qi), kpos(key)));
          }
        }
        pt[n][e] = keep ? fast_exp2(fmaf(pt[n][e], scale_log2, -lse2[col])) : 0.0f;
      }
    // dV += P^T dO
    warp_p_y<D, IsBf16>(dv, pt, do_tile, lane);
    // dS^T = P^T (dP^T - Δ), dP^T = V dO^T: in two halves of 32 queries
    // (16 accumulator registers live beside dK, dV and P^T instead of 32).
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      float dpt[4][4];
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) dpt[n][e] = 0.0f;
      warp_x_yt<D, IsBf16, 2>(dpt, sv, 16 * warp, do_tile, lane, 32 * half);
#pragma unroll
      for (int n = 0; n < 4; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e)
          pt[4 * half + n][e] *= dpt[n][e] - dlt[32 * half + 8 * n + c_col(lane, e)];
    }
    // dK += dS^T Q
    warp_p_y<D, IsBf16>(dk, pt, q_tile, lane);

    u = next;
    buf ^= 1;
  }
  cp_async_wait_all();

  auto* dkg = static_cast<std::uint16_t*>(a.dk) + b * a.dk_stride[0] + kvh * a.dk_stride[2];
  auto* dvg = static_cast<std::uint16_t*>(a.dv) + b * a.dv_stride[0] + kvh * a.dv_stride[2];
  store_rows<D, IsBf16>(dkg, a.dk_stride[1], k0 + 16 * warp, k1, dk, a.scale, lane);
  store_rows<D, IsBf16>(dvg, a.dv_stride[1], k0 + 16 * warp, k1, dv, 1.0f, lane);
}

/// dQ of one 64-row query tile of one (batch, head).
template <int D, bool IsBf16, class Mask, class QPos, class KPos>
__global__ void __launch_bounds__(threads, 2)
    dq_kernel(const BackwardArgs a, const Mask mask, const QPos qpos, const KPos kpos) {
  static_assert(D % 16 == 0 && D <= 256, "head dim: a multiple of 16 up to 256");
  BLOCKATTN_DYNAMIC_SHARED(std::uint16_t, smem);
  std::uint16_t* sq = smem;
  std::uint16_t* sdo = sq + bwd_rows * D;
  // Buffer i of K at sk + i * kv_buf, of V at sv + i * kv_buf.
  constexpr int kv_buf = 2 * block_n * D;
  std::uint16_t* sk = sdo + bwd_rows * D;
  std::uint16_t* sv = sk + block_n * D;

  // The last rows (the longest under a causal mask) first (cta_order.hpp).
  const CtaTile cta = cta_tile(a.order, blockIdx.x, blockIdx.y, blockIdx.z, true);
  if (!cta.live) return;  // (the whole CTA: an idle place of a last group)
  const int m_block = cta.block, h = cta.head, b = cta.batch;
  const int kvh = a.order.per_kv.div(h);
  const int q0 = m_block * bwd_rows;
  const int q1 = q0 + bwd_rows < a.queries ? q0 + bwd_rows : a.queries;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  const auto* qg = static_cast<const std::uint16_t*>(a.q) + b * a.q_stride[0] + h * a.q_stride[2];
  const auto* dg =
      static_cast<const std::uint16_t*>(a.dout) + b * a.dout_stride[0] + h * a.dout_stride[2];
  const auto* kg = static_cast<const std::uint16_t*>(a.k) + b * a.k_stride[0] + kvh * a.k_stride[2];
  const auto* vg = static_cast<const std::uint16_t*>(a.v) + b * a.v_stride[0] + kvh * a.v_stride[2];

  __shared__ cta_spans_t<Mask, bwd_rows> spans;
  // Masks with allowed_keys(): the rows' TileKeys of each K/V buffer's tile.
  constexpr bool ranged = has_allowed_keys<Mask>::value;
  __shared__ std::uint32_t tile_keys[ranged ? 2 : 1][ranged ? bwd_rows : 1];
  int tiles = (a.keys + block_n - 1) / block_n, j_first = 0;
  if constexpr (ranged) cta_spans(mask, qpos, kpos, q0, q1, a.keys, spans, j_first, tiles);
  int j = block_next_tile(mask, spans, qpos, kpos, q0, q1, a.keys, j_first, tiles);
  if (j < tiles) stage_tile_keys(mask, spans, kpos, a.keys, j, tile_keys[0]);

  load_tile<D, bwd_rows>(sq, qg + std::int64_t(q0) * a.q_stride[1], a.q_stride[1], 0, q1 - q0);
  load_tile<D, bwd_rows>(sdo, dg + std::int64_t(q0) * a.dout_stride[1], a.dout_stride[1], 0,
                         q1 - q0);
  if (j < tiles) {
    load_tile<D>(sk, kg, a.k_stride[1], j * block_n, a.keys);
    load_tile<D>(sv, vg, a.v_stride[1], j * block_n, a.keys);
  }
  cp_async_commit();

  // This thread's rows: c_row(lane, 0) and c_row(lane, 2) of its warp's 16.
  const int r_lo = q0 + 16 * warp + c_row(lane, 0), r_hi = q0 + 16 * warp + c_row(lane, 2);
  auto row_lse2 = [&](int r) {
    return r < q1 ? lse_base2(a.lse[b * a.lse_stride[0] + h * a.lse_stride[1] +
                                    std::int64_t(r) * a.lse_stride[2]])
                  : INFINITY;
  };
  auto row_delta = [&](int r) {
    return r < q1 ? a.delta[(std::int64_t(b) * a.heads + h) * a.queries + r] : 0.0f;
  };
  const float lse_lo = row_lse2(r_lo), lse_hi = row_lse2(r_hi);
  const float dl_lo = row_delta(r_lo), dl_hi = row_delta(r_hi);
  const float scale_log2 = a.scale * 1.4426950408889634f;

  float dq[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dq[n][e] = 0.0f;

  int buf = 0;
  while (j < tiles) {
    cp_async_wait_all();  // Q, dO, K_j, V_j
    __syncthreads();      // ... visible to every warp; the other buffer free
    const int next = block_next_tile(mask, spans, qpos, kpos, q0, q1, a.keys, j + 1, tiles);
    if (next < tiles) {
      load_tile<D>(sk + (buf ^ 1) * kv_buf, kg, a.k_stride[1], next * block_n, a.keys);
      load_tile<D>(sv + (buf ^ 1) * kv_buf, vg, a.v_stride[1], next * block_n, a.keys);
      stage_tile_keys(mask, spans, kpos, a.keys, next, tile_keys[ranged ? buf ^ 1 : 0]);
    }
    cp_async_commit();

    const int k0 = j * block_n;
    const int k1 = k0 + block_n < a.keys ? k0 + block_n : a.keys;
    const TileKind kind = block_tile_kind(mask, spans, qpos, kpos, q0, q1, k0, k1);
    float p[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) p[n][e] = 0.0f;
    const std::uint16_t* k_tile = sk + buf * kv_buf;
    const std::uint16_t* v_tile = sv + buf * kv_buf;
    warp_x_yt<D, IsBf16>(p, sq, 16 * warp, k_tile, lane);
    const bool check = kind == TileKind::partial;
    const bool edge = check || k1 - k0 < block_n;
    if constexpr (ranged) {
      const TileKeys keys_lo(edge ? tile_keys[buf][r_lo - q0] : 0u),
          keys_hi(edge ? tile_keys[buf][r_hi - q0] : 0u);
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int i = 8 * n + c_col(lane, e);  // the key's index in the tile
          const bool lo = e < 2;
          const bool keep = !edge || (lo ? keys_lo(i) : keys_hi(i));
          p[n][e] = keep ? fast_exp2(fmaf(p[n][e], scale_log2, -(lo ? lse_lo : lse_hi))) : 0.0f;
        }
    } else {
      const auto rm_lo = row_test(mask, spans, qpos, q0, q1, r_lo - q0, check),
                 rm_hi = row_test(mask, spans, qpos, q0, q1, r_hi - q0, check);
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = k0 + 8 * n + c_col(lane, e);
          const bool lo = e < 2;
          bool keep = true;
          if (edge) {
            const index_type kp = kpos(key < k1 ? key : k1 - 1);
            keep = key < k1 && (lo ? rm_lo(kp) : rm_hi(kp));
          }
          p[n][e] = keep ? fast_exp2(fmaf(p[n][e], scale_log2, -(lo ? lse_lo : lse_hi))) : 0.0f;
        }
    }
    float dp[8][4];
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) dp[n][e] = 0.0f;
    warp_x_yt<D, IsBf16>(dp, sdo, 16 * warp, v_tile, lane);
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) p[n][e] *= dp[n][e] - (e < 2 ? dl_lo : dl_hi);
    // dQ += dS K
    warp_p_y<D, IsBf16>(dq, p, k_tile, lane);
    j = next;
    buf ^= 1;
  }
  cp_async_wait_all();

  auto* dqg = static_cast<std::uint16_t*>(a.dq) + b * a.dq_stride[0] + h * a.dq_stride[2];
  store_rows<D, IsBf16>(dqg, a.dq_stride[1], q0 + 16 * warp, q1, dq, a.scale, lane);
}

/// Whether the backward takes a problem: head dim 64 or 128, rows 16-byte
/// aligned (strides multiples of 8 elements), heads a multiple of kv_heads.
inline bool supports(const BackwardArgs& a, int dim) {
  if (dim != 64 && dim != 128) return false;
  if (a.kv_heads <= 0 || a.heads % a.kv_heads != 0) return false;
  for (const void* p : {a.q, a.k, a.v, a.o, a.dout, static_cast<const void*>(a.dq),
                        static_cast<const void*>(a.dk), static_cast<const void*>(a.dv)})
    if (p == nullptr || reinterpret_cast<std::uintptr_t>(p) % 16 != 0) return false;
  for (const std::int64_t* s : {a.q_stride, a.k_stride, a.v_stride, a.o_stride, a.dout_stride,
                                a.dq_stride, a.dk_stride, a.dv_stride})
    for (int i = 0; i < 3; ++i)
      if (s[i] % 8 != 0) return false;
  return a.lse != nullptr;
}

/// Enqueues the backward (Δ into a.delta, then dK and dV, then dQ) on `stream`; returns
/// CUDA's error of the first launch that failed. Keys that no query sees get
/// dK = dV = 0, rows that see no key dQ = 0.
template <bool IsBf16, class Mask, class QPos, class KPos>
cudaError_t backward(const BackwardArgs& a, int dim, const Mask& mask, const QPos& qpos,
                     const KPos& kpos, cudaStream_t stream) {
  if (a.batch <= 0 || a.heads <= 0 || (a.queries <= 0 && a.keys <= 0)) return cudaSuccess;
  auto run = [&](auto d) -> cudaError_t {
    constexpr int D = decltype(d)::value;
    if (a.queries > 0) {
      constexpr int rows_per_cta = threads / (D / 8);
      const dim3 grid((a.queries + rows_per_cta - 1) / rows_per_cta, a.heads, a.batch);
      auto* const delta = delta_kernel<D, IsBf16>;
      BLOCKATTN_CUDA_LAUNCH(delta, grid, threads, 0, stream)(a);
      const cudaError_t e = cudaGetLastError();
      if (e != cudaSuccess) return e;
    }
    // One kernel of `bytes` dynamic shared memory, `blocks` CTAs for each
    // (batch, one of `heads`).
    auto launch = [&](auto kernel, int bytes, long long blocks, int heads) {
      return launch_ordered(kernel, bytes, stream, blocks, heads, a, mask, qpos, kpos);
    };
    if (a.keys > 0) {
      const cudaError_t e = launch(dkdv_kernel<D, IsBf16, Mask, QPos, KPos>, dkdv_smem_bytes(D),
                                   (a.keys + block_n - 1) / block_n, a.kv_heads);
      if (e != cudaSuccess) return e;
    }
    if (a.queries > 0)
      return launch(dq_kernel<D, IsBf16, Mask, QPos, KPos>, dq_smem_bytes(D),
                    (a.queries + bwd_rows - 1) / bwd_rows, a.heads);
    return cudaSuccess;
  };
  if (dim == 64) return run(std::integral_constant<int, 64>{});
  return run(std::integral_constant<int, 128>{});
}

}  // namespace blockattn::impl::flash

#endif
