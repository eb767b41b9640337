// SPDX-License-Identifier: Apache-2.0
// The decode kernel's host tile products for bf16 caches on AVX512-BF16 dot
// products (`vdpbf16ps`: two bf16 products added to an fp32 lane), the
// vector matrix engine of the forward (amx.hpp, bf16_vector_block) applied
// to decode:
//   scores: S = scale q k^T from q and k as they are stored (bf16, unscaled:
//     every product is exact in fp32), pairs of the head dim per lane, 4 (or
//     2) rows x 4 (or 8) keys per step of 32 dims, or one row x 16 keys key
//     by key; the 16 accumulators summed horizontally at once
//     (DecodeVec512::lane_sums_to) and scaled after the sum;
//   P V: P rounded to bf16 (round to nearest even, as the forward's engine),
//     pairs of keys per lane: the value rows j and j + 1 interleaved by
//     vpunpck{l,h}wd into the pairs (v_j[c], v_j+1[c]), which puts the
//     columns of a 32-column block in the order 0-3, 8-11, 16-19, 24-27 and
//     4-7, 12-15, 20-23, 28-31 (undone once per block by two 128-bit
//     shuffles); register tiles of 4 rows x 64 columns.
// What rounds differently from the fp32 vector path (decode_simd.hpp): P to
// bf16 before P V (|P - fl(P)| <= 2^-9 P; the row sums l come from the fp32
// P), the scale applied after the dot product, the sums' order, and
// AVX512-BF16's treatment of subnormal bf16 inputs and results as zero. The
// non-finite rule is decode_simd.hpp's: a P V block whose result is not
// finite is recomputed by the skipping scalar loop from the fp32 P.
//
// Compiled where the host matrix engine is (BLOCKATTN_HOST_AMX) and the
// AVX-512 vector class exists; run inside AmxEntry (its target has
// AVX512-BF16) where matrix_path() is MatrixPath::vectors, except for one
// row per kv head over a streaming cache (attention_decode: memory bound,
// the fp32 vectors ran it 5-8 % faster). On a 2-core Zen 4 (65 536 keys,
// D = 128, `blockattn_bench_decode`, the same binary with
// BLOCKATTN_HOST_MATRIX=off and automatic alternated): 8 query heads on 1
// kv head 1.6-1.8x faster, 32 on 8 1.2-1.6x.
#pragma once

#include <blockattn/kernel/host/amx.hpp>
#include <blockattn/kernel/host/decode_simd.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>

// (simd_vec.hpp's BLOCKATTN_SIMD_512, which micro_gemm_simd.hpp undefines.)
#if BLOCKATTN_HOST_AMX && BLOCKATTN_SIMD_KERNELS && \
    (defined(__AVX512F__) || BLOCKATTN_HOST_DISPATCH)
#define BLOCKATTN_DECODE_BF16 1

namespace blockattn::impl {

/// The AVX-512 vector class (simd_vec.hpp).
using DecodeVec512 = simd_for_t<HostIsa::avx512>;

/// The mask of the 16-bit elements of a row of D elements past its last
/// whole 32-element chunk.
inline __mmask32 decode_tail_mask(int D) {
  return (__mmask32(1) << (D % 32)) - 1u;
}

/// Chunk c (32 elements) of a row: whole below `whole` (D / 32), else the
/// tail, masked (zero past the row). (Functions, not lambdas: a lambda does
/// not inherit its enclosing function's target attribute.)
BLOCKATTN_TARGET_AMX inline __m512bh decode_bf16_chunk(const std::uint16_t* p, int c, int whole,
                                                       __mmask32 tail) {
  const __m512i x = c < whole ? _mm512_loadu_si512(static_cast<const void*>(p + 32 * c))
                              : _mm512_maskz_loadu_epi16(tail, p + 32 * c);
  return reinterpret_cast<const __m512bh&>(x);
}

/// s[r * lds + j] = scale * q_r . k_j for RQ rows of q (bf16 bits, rows of
/// D) and keys j < nk (rows of ldk elements at k): KQ = 16 / RQ keys per
/// step; with RQ = 1 each key's row is read whole before the next (address
/// order, as decode_scores_row), else the head dim outermost with each
/// key's chunk loaded once for the RQ rows.
template <int RQ>
BLOCKATTN_TARGET_AMX inline void decode_scores_bf16_rows(const std::uint16_t* __restrict__ q,
                                                         const std::uint16_t* __restrict__ k,
                                                         std::size_t ldk, int nk, int D,
                                                         float scale, float* __restrict__ s,
                                                         int lds) {
  constexpr int KQ = 16 / RQ;
  const int chunks = (D + 31) / 32, whole = D / 32;
  const __mmask32 tail = decode_tail_mask(D);
  for (int j0 = 0; j0 < nk; j0 += KQ) {
    const int n = nk - j0 < KQ ? nk - j0 : KQ;
    const std::uint16_t* kr[KQ];
    BLOCKATTN_AMX_UNROLL
    for (int j = 0; j < KQ; ++j) kr[j] = k + std::size_t(j0 + (j < n ? j : 0)) * ldk;
    __m512 acc[16];  // row r, key j at r * KQ + j
    BLOCKATTN_AMX_UNROLL
    for (int e = 0; e < 16; ++e) acc[e] = _mm512_setzero_ps();
    if constexpr (RQ == 1) {
      BLOCKATTN_AMX_UNROLL
      for (int j = 0; j < KQ; ++j)
        for (int c = 0; c < chunks; ++c)
          acc[j] = _mm512_dpbf16_ps(acc[j], decode_bf16_chunk(q, c, whole, tail),
                                    decode_bf16_chunk(kr[j], c, whole, tail));
    } else {
      for (int c = 0; c < chunks; ++c) {
        __m512bh kv[KQ];
        BLOCKATTN_AMX_UNROLL
        for (int j = 0; j < KQ; ++j) kv[j] = decode_bf16_chunk(kr[j], c, whole, tail);
        BLOCKATTN_AMX_UNROLL
        for (int r = 0; r < RQ; ++r) {
          const __m512bh qv = decode_bf16_chunk(q + std::size_t(r) * D, c, whole, tail);
          BLOCKATTN_AMX_UNROLL
          for (int j = 0; j < KQ; ++j)
            acc[r * KQ + j] = _mm512_dpbf16_ps(acc[r * KQ + j], qv, kv[j]);
        }
      }
    }
    alignas(64) float sums[16];
    DecodeVec512::lane_sums_to(sums, acc);
    for (int r = 0; r < RQ; ++r)
      for (int j = 0; j < n; ++j) s[std::size_t(r) * lds + j0 + j] = sums[r * KQ + j] * scale;
  }
}

/// S (nr x nk, rows of lds) = scale Q K^T: 4 rows at a time, then 2, then 1.
BLOCKATTN_TARGET_AMX inline void decode_scores_bf16(const std::uint16_t* q, int nr,
                                                    const std::uint16_t* k, std::size_t ldk, int nk,
                                                    int D, float scale, float* s, int lds) {
  int r = 0;
  for (; r + 4 <= nr; r += 4)
    decode_scores_bf16_rows<4>(q + std::size_t(r) * D, k, ldk, nk, D, scale,
                               s + std::size_t(r) * lds, lds);
  for (; r + 2 <= nr; r += 2)
    decode_scores_bf16_rows<2>(q + std::size_t(r) * D, k, ldk, nk, D, scale,
                               s + std::size_t(r) * lds, lds);
  for (; r < nr; ++r)
    decode_scores_bf16_rows<1>(q + std::size_t(r) * D, k, ldk, nk, D, scale,
                               s + std::size_t(r) * lds, lds);
}

/// Rows of P (nr x nk fp32, rows of ldp) rounded to bf16 (nearest even) into
/// p16 (rows of ld16 >= nk rounded up to 16), zero past nk.
BLOCKATTN_TARGET_AMX inline void decode_p_to_bf16(const float* p, int ldp, int nr, int nk,
                                                  std::uint16_t* p16, int ld16) {
  for (int r = 0; r < nr; ++r)
    for (int j = 0; j < nk; j += 16) {
      const int n = nk - j < 16 ? nk - j : 16;
      const __mmask16 m = n == 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u);
      amx_store_p16(p16 + std::size_t(r) * ld16 + j,
                    _mm512_maskz_loadu_ps(m, p + std::size_t(r) * ldp + j));
    }
}

/// acc += the P V products of keys j and j + 1 (pair; else key j alone).
template <int RB, int CB>
BLOCKATTN_TARGET_AMX inline void decode_pv_bf16_step(__m512 (&acc)[RB][CB][2],
                                                     const std::uint16_t* __restrict__ p16,
                                                     int ld16, const std::uint16_t* __restrict__ v,
                                                     std::size_t ldv, int j, bool pair) {
  __m512bh w[CB][2];
  BLOCKATTN_AMX_UNROLL
  for (int c = 0; c < CB; ++c) {
    const __m512i x =
        _mm512_loadu_si512(static_cast<const void*>(v + std::size_t(j) * ldv + 32 * c));
    const __m512i y =
        pair ? _mm512_loadu_si512(static_cast<const void*>(v + std::size_t(j + 1) * ldv + 32 * c))
             : _mm512_setzero_si512();
    const __m512i lo = _mm512_unpacklo_epi16(x, y), hi = _mm512_unpackhi_epi16(x, y);
    w[c][0] = reinterpret_cast<const __m512bh&>(lo);
    w[c][1] = reinterpret_cast<const __m512bh&>(hi);
  }
  BLOCKATTN_AMX_UNROLL
  for (int r = 0; r < RB; ++r) {
    std::int32_t pp;
    std::memcpy(&pp, p16 + std::size_t(r) * ld16 + j, 4);
    const __m512i pb = _mm512_set1_epi32(pp);
    const __m512bh pv = reinterpret_cast<const __m512bh&>(pb);
    BLOCKATTN_AMX_UNROLL
    for (int c = 0; c < CB; ++c) {
      acc[r][c][0] = _mm512_dpbf16_ps(acc[r][c][0], pv, w[c][0]);
      acc[r][c][1] = _mm512_dpbf16_ps(acc[r][c][1], pv, w[c][1]);
    }
  }
}

/// RB rows x CB blocks of 32 columns of O (rows of ldo) = diag(a) O + P V
/// over nk keys, P in bf16 (p16, rows of ld16, zero past nk), in registers
/// across the keys; a non-finite result sends the block to
/// decode_pv_skipping with the fp32 P (p, rows of ldp).
template <int RB, int CB>
BLOCKATTN_TARGET_AMX inline void decode_pv_bf16_block(float* __restrict__ o, int ldo,
                                                      const float* __restrict__ a,
                                                      const float* __restrict__ p, int ldp,
                                                      const std::uint16_t* __restrict__ p16,
                                                      int ld16, const std::uint16_t* __restrict__ v,
                                                      std::size_t ldv, int nk) {
  // acc[r][c][0]: columns 32c + 8L + i (lane 4L + i), acc[r][c][1]: 32c + 8L + 4 + i.
  __m512 acc[RB][CB][2];
  BLOCKATTN_AMX_UNROLL
  for (int r = 0; r < RB; ++r) {
    const __m512 ar = _mm512_set1_ps(a[r]);
    BLOCKATTN_AMX_UNROLL
    for (int c = 0; c < CB; ++c) {
      const __m512 o0 = _mm512_loadu_ps(o + r * ldo + 32 * c);
      const __m512 o1 = _mm512_loadu_ps(o + r * ldo + 32 * c + 16);
      acc[r][c][0] = _mm512_mul_ps(ar, _mm512_maskz_shuffle_f32x4(0xFFFF, o0, o1, 0x88));
      acc[r][c][1] = _mm512_mul_ps(ar, _mm512_maskz_shuffle_f32x4(0xFFFF, o0, o1, 0xDD));
    }
  }
  int j = 0;
  for (; j + 2 <= nk; j += 2) decode_pv_bf16_step<RB, CB>(acc, p16, ld16, v, ldv, j, true);
  if (j < nk)  // the last key alone: its pair's second P is 0 in p16
    decode_pv_bf16_step<RB, CB>(acc, p16, ld16, v, ldv, j, false);
  // x - x is 0 for finite x and NaN otherwise; their sum is NaN iff one is.
  __m512 bad = _mm512_setzero_ps();
  BLOCKATTN_AMX_UNROLL
  for (int r = 0; r < RB; ++r) {
    BLOCKATTN_AMX_UNROLL
    for (int c = 0; c < CB; ++c) {
      bad = _mm512_add_ps(bad, _mm512_sub_ps(acc[r][c][0], acc[r][c][0]));
      bad = _mm512_add_ps(bad, _mm512_sub_ps(acc[r][c][1], acc[r][c][1]));
    }
  }
  float flag;
  DecodeVec512::reduce_add_to(flag, bad);
  if (flag != flag) {
    decode_pv_skipping(o, ldo, a, p, ldp, reinterpret_cast<const bf16*>(v), ldv, nk, RB, 32 * CB);
    return;
  }
  BLOCKATTN_AMX_UNROLL
  for (int r = 0; r < RB; ++r) {
    BLOCKATTN_AMX_UNROLL
    for (int c = 0; c < CB; ++c) {
      const __m512 lo = acc[r][c][0], hi = acc[r][c][1];
      const __m512 t0 = _mm512_maskz_shuffle_f32x4(0xFFFF, lo, hi, 0x44),
                   t1 = _mm512_maskz_shuffle_f32x4(0xFFFF, lo, hi, 0xEE);
      _mm512_storeu_ps(o + r * ldo + 32 * c, _mm512_maskz_shuffle_f32x4(0xFFFF, t0, t0, 0xD8));
      _mm512_storeu_ps(o + r * ldo + 32 * c + 16, _mm512_maskz_shuffle_f32x4(0xFFFF, t1, t1, 0xD8));
    }
  }
}

/// Columns [0, D) of RB rows (O rows of D floats): blocks of 64, then 32
/// columns on the bf16 products, the columns past the last 32 on the fp32
/// vectors of decode_simd.hpp (fp32 P).
template <int RB>
BLOCKATTN_TARGET_AMX inline void decode_pv_bf16_rows(float* o, const float* a, const float* p,
                                                     int ldp, const std::uint16_t* p16, int ld16,
                                                     const std::uint16_t* v, std::size_t ldv,
                                                     int nk, int D) {
  int c = 0;
  for (; c + 64 <= D; c += 64)
    decode_pv_bf16_block<RB, 2>(o + c, D, a, p, ldp, p16, ld16, v + c, ldv, nk);
  for (; c + 32 <= D; c += 32)
    decode_pv_bf16_block<RB, 1>(o + c, D, a, p, ldp, p16, ld16, v + c, ldv, nk);
  const bf16* const vb = reinterpret_cast<const bf16*>(v);
  for (; c + 16 <= D; c += 16)
    decode_pv_block<DecodeVec512, RB, 1>(o + c, D, a, p, ldp, vb + c, ldv, nk);
  if (c < D) decode_pv_skipping(o + c, D, a, p, ldp, vb + c, ldv, nk, RB, D - c);
}

/// O (nr x D, rows of D floats) = diag(a) O + P V over nk keys: P (nr x nk
/// fp32, rows of ldp) rounded into p16 (nr rows of ld16 >= nk rounded up to
/// 16, scratch), value row j at v + j * ldv (bf16 bits). Register tiles of
/// 4 rows, then 2, then 1.
BLOCKATTN_TARGET_AMX inline void decode_pv_bf16(float* o, const float* a, const float* p, int ldp,
                                                int nr, const std::uint16_t* v, std::size_t ldv,
                                                int nk, int D, std::uint16_t* p16, int ld16) {
  decode_p_to_bf16(p, ldp, nr, nk, p16, ld16);
  int r = 0;
  for (; r + 4 <= nr; r += 4)
    decode_pv_bf16_rows<4>(o + std::size_t(r) * D, a + r, p + std::size_t(r) * ldp, ldp,
                           p16 + std::size_t(r) * ld16, ld16, v, ldv, nk, D);
  for (; r + 2 <= nr; r += 2)
    decode_pv_bf16_rows<2>(o + std::size_t(r) * D, a + r, p + std::size_t(r) * ldp, ldp,
                           p16 + std::size_t(r) * ld16, ld16, v, ldv, nk, D);
  for (; r < nr; ++r)
    decode_pv_bf16_rows<1>(o + std::size_t(r) * D, a + r, p + std::size_t(r) * ldp, ldp,
                           p16 + std::size_t(r) * ld16, ld16, v, ldv, nk, D);
}

}  // namespace blockattn::impl

#else
#define BLOCKATTN_DECODE_BF16 0
#endif
