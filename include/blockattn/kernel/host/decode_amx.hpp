// SPDX-License-Identifier: Apache-2.0
// The decode kernel's host tile products for 16-bit and 8-bit caches on AMX
// tiles (amx.hpp), for a team's rows of one kv head (a GQA group: 2 to 16
// rows). On the vectors each (row, key) pair costs a dot product and a
// horizontal sum; on the tiles a group's rows share every instruction:
//   scores: S^T (16 keys x 16 rows) = K Q^T per 16 keys, K the A operand
//     read in place (16 key rows of 32 bf16; no packing), Q^T the B operand
//     (VNNI pairs of the head dim, packed once per team, rows past the
//     group's zero); the tile stored and transposed into the kernel's row
//     layout S (rows x keys) with 16-lane gathers, then scaled (q is used
//     unscaled, as stored: every product is exact in fp32);
//   P V: P rounded to bf16 (round to nearest even, as the forward's engine)
//     as the A operand (16 rows x 32 keys), V's key pairs interleaved by
//     vpunpck{l,h}wd into VNNI B tiles (which puts a 32-column group's
//     columns in the order 0-3, 8-11, 16-19, 24-27 | 4-7, 12-15, ...; put
//     back by two 128-bit shuffles when the tile's P V is added to O), the
//     tile's P V accumulated in C tiles over its keys and added to diag(a) O
//     in vectors.
// 8-bit codes (core/quant.hpp) are widened to bf16 (exactly: every e4m3,
// e5m2 and int8 value is a bf16 value) into a scratch block first; their
// scales multiply the scores and P outside, as on the vectors.
// What rounds differently from the fp32 vectors: decode_bf16.hpp's rules (P
// to bf16 before P V, the sums' order, subnormal bf16 inputs as zero). The
// non-finite rule is decode_simd.hpp's: a tile whose P V is not finite is
// recomputed by the skipping scalar loop from the fp32 P and the unchanged O.
#pragma once

#include <blockattn/core/quant.hpp>
#include <blockattn/kernel/host/amx.hpp>
#include <blockattn/kernel/host/decode_simd.hpp>

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace blockattn::impl {
/// Whether the tile products take head dim D (whole 32-element chunks).
inline constexpr bool decode_amx_dim(int D) {
  return D % 32 == 0 && D > 0;
}
}  // namespace blockattn::impl

#if BLOCKATTN_HOST_AMX && BLOCKATTN_SIMD_KERNELS && \
    (defined(__AVX512F__) || BLOCKATTN_HOST_DISPATCH)
#define BLOCKATTN_DECODE_AMX 1

namespace blockattn::impl {

/// Scratch (in floats) of the tile products for head dim D and key tiles of
/// kt keys: Q^T (D / 32 B tiles), S^T (one C tile), a widened or zero-padded
/// K block (16 x D bf16), P in bf16 (16 x kt), V's VNNI tiles for 64
/// columns (4 B tiles) and the tile's P V (16 x D fp32).
struct DecodeAmxScratch {
  static constexpr int qb_floats(int D) { return D / 32 * 256; }
  static constexpr int st_floats = 1024;
  static constexpr int kblock_floats(int D) { return 8 * D; }
  static constexpr int p16_floats(int kt) { return 8 * ((kt + 31) / 32 * 32); }
  static constexpr int vb_floats = 8 * 256;
  static constexpr int pv_floats(int D) { return 16 * D; }
  static constexpr int total(int D, int kt) {
    return qb_floats(D) + st_floats + 4 * kblock_floats(D) + p16_floats(kt) + vb_floats +
           pv_floats(D);
  }
  float* base;
  int D, kt;
  std::uint32_t* qb() const { return reinterpret_cast<std::uint32_t*>(base); }
  float* st() const { return base + qb_floats(D); }
  std::uint16_t* kblock() const { return reinterpret_cast<std::uint16_t*>(st() + st_floats); }
  std::uint16_t* p16() const { return kblock() + 64 * D; }
  std::uint16_t* vb() const { return p16() + 16 * ((kt + 31) / 32 * 32); }
  float* pv() const { return reinterpret_cast<float*>(vb() + 2 * vb_floats); }
  int ld16() const { return (kt + 31) / 32 * 32; }
};

/// Q^T of nr <= 16 rows (bf16 bits, rows of D) as VNNI B tiles: tile c, row
/// p, column r = (q[r][32 c + 2 p], q[r][32 c + 2 p + 1]); zero for r >= nr.
BLOCKATTN_TARGET_AMX inline void decode_amx_pack_q(const std::uint16_t* q, int nr, int D,
                                                   std::uint32_t* qb) {
  for (int c = 0; c < D / 32; ++c)
    for (int p = 0; p < 16; ++p)
      for (int r = 0; r < 16; ++r) {
        std::uint32_t w = 0;
        if (r < nr) std::memcpy(&w, q + std::size_t(r) * D + 32 * c + 2 * p, 4);
        qb[std::size_t(c) * 256 + p * 16 + r] = w;
      }
}

/// Row j < n of `src` (n <= 16 rows of D elements, rows ld apart) as bf16
/// bits into dst (16 rows of D), rows past n zero: bf16 copied, 8-bit codes
/// widened exactly.
template <class S>
BLOCKATTN_TARGET_AMX inline void decode_amx_block16(const S* src, std::size_t ld, int n, int D,
                                                    std::uint16_t* dst) {
  using V = simd_for_t<HostIsa::avx512>;
  for (int j = 0; j < 16; ++j) {
    std::uint16_t* const out = dst + std::size_t(j) * D;
    if (j >= n) {
      std::memset(out, 0, std::size_t(D) * 2);
      continue;
    }
    const S* const row = src + std::size_t(j) * ld;
    if constexpr (std::is_same<S, bf16>::value) {
      std::memcpy(out, row, std::size_t(D) * 2);
    } else {
      for (int d = 0; d < D; d += 32) {
        typename V::type a, b;
        V::load_codes_to(a, row + d);
        V::load_codes_to(b, row + d + 16);
        const __m512bh x = _mm512_cvtne2ps_pbh(b, a);
        _mm512_storeu_si512(static_cast<void*>(out + d), reinterpret_cast<const __m512i&>(x));
      }
    }
  }
}

/// C tiles 0 .. nb - 1 = (16-key block b of A) Q^T over D / 32 chunks: the
/// blocks' chains independent (a tile product's latency is several times its
/// issue interval), Q^T's chunk loaded once for the blocks.
template <int NB>
BLOCKATTN_TARGET_AMX inline void decode_amx_st(const std::uint16_t* const (&a)[4],
                                               const int (&sa)[4], const std::uint32_t* qb,
                                               int chunks, float* st) {
  __asm__ volatile("" : : : "memory");  // the operands' stores before the tile loads
  _tile_zero(0);
  if (NB > 1) _tile_zero(1);
  if (NB > 2) _tile_zero(2);
  if (NB > 3) _tile_zero(3);
  for (int c = 0; c < chunks; ++c) {
    _tile_loadd(6, qb + std::size_t(c) * 256, 64);
    _tile_loadd(4, a[0] + 32 * c, sa[0]);
    _tile_dpbf16ps(0, 4, 6);
    if (NB > 1) {
      _tile_loadd(5, a[1] + 32 * c, sa[1]);
      _tile_dpbf16ps(1, 5, 6);
    }
    if (NB > 2) {
      _tile_loadd(4, a[2] + 32 * c, sa[2]);
      _tile_dpbf16ps(2, 4, 6);
    }
    if (NB > 3) {
      _tile_loadd(5, a[3] + 32 * c, sa[3]);
      _tile_dpbf16ps(3, 5, 6);
    }
  }
  _tile_stored(0, st, 64);
  if (NB > 1) _tile_stored(1, st + 256, 64);
  if (NB > 2) _tile_stored(2, st + 512, 64);
  if (NB > 3) _tile_stored(3, st + 768, 64);
  __asm__ volatile("" : : : "memory");
}

/// C tiles 0, 1 = (16-key blocks 0, 1 of A) Q^T with Q^T's CH chunks
/// resident in tiles 4 .. 3 + CH (tile loads cost here: 15 ns per KB on a
/// Sapphire Rapids, a tile product 4.4 ns), A's blocks in tiles 2 and 3.
template <int CH>
BLOCKATTN_TARGET_AMX inline void decode_amx_st2(const std::uint16_t* const (&a)[4],
                                                const int (&sa)[4], bool two, float* st) {
  __asm__ volatile("" : : : "memory");
  _tile_zero(0);
  _tile_zero(1);
// (The tile intrinsics are macros that paste their tile numbers: literals.)
#define BLOCKATTN_AMX_ST_CHUNK(c, q)        \
  if (CH > c) {                             \
    _tile_loadd(2, a[0] + 32 * c, sa[0]);   \
    _tile_dpbf16ps(0, 2, q);                \
    if (two) {                              \
      _tile_loadd(3, a[1] + 32 * c, sa[1]); \
      _tile_dpbf16ps(1, 3, q);              \
    }                                       \
  }
  BLOCKATTN_AMX_ST_CHUNK(0, 4)
  BLOCKATTN_AMX_ST_CHUNK(1, 5)
  BLOCKATTN_AMX_ST_CHUNK(2, 6)
  BLOCKATTN_AMX_ST_CHUNK(3, 7)
#undef BLOCKATTN_AMX_ST_CHUNK
  _tile_stored(0, st, 64);
  if (two) _tile_stored(1, st + 256, 64);
  __asm__ volatile("" : : : "memory");
}

/// Q^T's CH chunks into tiles 4 .. 3 + CH.
template <int CH>
BLOCKATTN_TARGET_AMX inline void decode_amx_load_q(const std::uint32_t* qb) {
  __asm__ volatile("" : : : "memory");
  _tile_loadd(4, qb, 64);
  if (CH > 1) _tile_loadd(5, qb + 256, 64);
  if (CH > 2) _tile_loadd(6, qb + 512, 64);
  if (CH > 3) _tile_loadd(7, qb + 768, 64);
}

/// S (nr x nk, rows of lds) = scale Q K^T for keys j < nk at k + j ldk (bf16
/// in place; 8-bit codes and a last block of fewer than 16 keys through
/// zero-padded scratch blocks), Q^T packed in sc.qb(): head dims up to 128
/// with Q^T resident in tiles, 32 keys at a time; longer ones 64 keys at a
/// time with Q^T's chunks loaded per step.
template <class S>
BLOCKATTN_TARGET_AMX inline void decode_scores_amx(const DecodeAmxScratch& sc, int nr, const S* k,
                                                   std::size_t ldk, int nk, float scale, float* s,
                                                   int lds, const DecodePrefetch& next) {
  const int D = sc.D, chunks = D / 32;
  float* const st = sc.st();
  const __m512i rows =
      _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                         _mm512_set1_epi32(16));
  const __m512 f = _mm512_set1_ps(scale);
  const bool resident = chunks <= 4;
  const int step = resident ? 32 : 64;
  switch (resident ? chunks : 0) {
    case 4:
      decode_amx_load_q<4>(sc.qb());
      break;
    case 3:
      decode_amx_load_q<3>(sc.qb());
      break;
    case 2:
      decode_amx_load_q<2>(sc.qb());
      break;
    case 1:
      decode_amx_load_q<1>(sc.qb());
      break;
    default:
      break;
  }
  for (int j0 = 0; j0 < nk; j0 += step) {
    // The first half of the next tile's rows (next.row; its offset: this run's first key / 2).
    for (int j = j0 / 2; j < (j0 + step < nk ? j0 + step : nk + 1) / 2; ++j) next.row(j);
    const int nb = (nk - j0 < step ? nk - j0 + 15 : step) / 16;
    const std::uint16_t* a[4] = {};
    int sa[4] = {};
    for (int b = 0; b < nb; ++b) {
      const int jb = j0 + 16 * b, n = nk - jb < 16 ? nk - jb : 16;
      if (std::is_same<S, bf16>::value && n == 16) {
        a[b] = reinterpret_cast<const std::uint16_t*>(k + std::size_t(jb) * ldk);
        sa[b] = int(ldk * 2);
      } else {
        std::uint16_t* const blk = sc.kblock() + std::size_t(b) * 16 * D;
        decode_amx_block16(k + std::size_t(jb) * ldk, ldk, n, D, blk);
        a[b] = blk;
        sa[b] = D * 2;
      }
    }
    switch (resident ? chunks : 0) {
      case 4:
        decode_amx_st2<4>(a, sa, nb > 1, st);
        break;
      case 3:
        decode_amx_st2<3>(a, sa, nb > 1, st);
        break;
      case 2:
        decode_amx_st2<2>(a, sa, nb > 1, st);
        break;
      case 1:
        decode_amx_st2<1>(a, sa, nb > 1, st);
        break;
      default:
        switch (nb) {
          case 4:
            decode_amx_st<4>(a, sa, sc.qb(), chunks, st);
            break;
          case 3:
            decode_amx_st<3>(a, sa, sc.qb(), chunks, st);
            break;
          case 2:
            decode_amx_st<2>(a, sa, sc.qb(), chunks, st);
            break;
          default:
            decode_amx_st<1>(a, sa, sc.qb(), chunks, st);
            break;
        }
    }
    for (int b = 0; b < nb; ++b) {
      const int jb = j0 + 16 * b, n = nk - jb < 16 ? nk - jb : 16;
      const __mmask16 m = n == 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u);
      for (int r = 0; r < nr; ++r) {
        const __m512 col =
            _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, rows, st + 256 * b + r, 4);
        _mm512_mask_storeu_ps(s + std::size_t(r) * lds + jb, m, _mm512_mul_ps(col, f));
      }
    }
  }
}

/// 32 elements of a value row from column c as bf16 bits: bf16 loaded, 8-bit
/// codes widened exactly (two 16-code halves, packed); zero when `present`
/// is false (a key past the tile's).
template <class S>
BLOCKATTN_TARGET_AMX inline __m512i decode_amx_row32(const S* row, int c, bool present) {
  if (!present) return _mm512_setzero_si512();
  if constexpr (std::is_same<S, bf16>::value) {
    return _mm512_loadu_si512(static_cast<const void*>(row + c));
  } else {
    using V = simd_for_t<HostIsa::avx512>;
    typename V::type lo, hi;
    V::load_codes_to(lo, row + c);
    V::load_codes_to(hi, row + c + 16);
    const __m512bh x = _mm512_cvtne2ps_pbh(hi, lo);
    return reinterpret_cast<const __m512i&>(x);
  }
}

/// O (nr x D, rows of D floats) = diag(a) O + P V over the tile's nk keys: P
/// (nr x nk fp32, rows of ldp) rounded to bf16 into sc.p16(), value row j at
/// vrow(j) (bf16 in place, 8-bit codes widened in registers). The whole
/// tile in one call whatever pages hold its rows: the tile products' sums
/// do not depend on where a cache's pages end. A tile whose P V is not
/// finite goes to decode_pv_skipping (fp32 P, the unchanged O).
template <class S, class Row>
BLOCKATTN_TARGET_AMX inline void decode_pv_amx(const DecodeAmxScratch& sc, float* o, const float* a,
                                               const float* p, int ldp, int nr, const Row& vrow,
                                               int nk, const DecodePrefetch& next) {
  const int D = sc.D, ld16 = sc.ld16(), nkp = (nk + 31) / 32 * 32;
  std::uint16_t* const p16 = sc.p16();
  // P in bf16: rows past nr and keys past nk zero (the A operand's padding).
  for (int r = 0; r < 16; ++r)
    for (int j = 0; j < nkp; j += 16) {
      std::uint16_t* const out = p16 + std::size_t(r) * ld16 + j;
      const int n = r < nr ? (nk - j < 16 ? (nk - j > 0 ? nk - j : 0) : 16) : 0;
      const __mmask16 m = n == 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1u);
      amx_store_p16(out, _mm512_maskz_loadu_ps(m, p + std::size_t(r) * ldp + j));
    }
  float* const t = sc.pv();
  std::uint16_t* const vb2 = sc.vb();
  // The value rows' addresses once per tile (the column passes read each
  // row once per pass: with a page lookup per read, a paged cache in pool
  // order ran 0.89-0.96x the contiguous one, 0.92-0.97x with the list; a
  // Sapphire Rapids, bf16, 65 536 keys, 32/8 and 8/1, pages of 64 and 256).
  constexpr int most = 256;
  const S* rows[most];
  const bool listed = nk <= most;
  if (listed)
    for (int j = 0; j < nk; ++j) rows[j] = vrow(j);
  const auto row = [&](const int j) { return listed ? rows[j] : vrow(j); };
  for (int c0 = 0; c0 < D; c0 += 64) {
    const int groups = D - c0 >= 64 ? 2 : 1;  // 32-column groups in this pass
    __asm__ volatile("" : : : "memory");
    _tile_zero(4);
    _tile_zero(5);
    if (groups == 2) {
      _tile_zero(6);
      _tile_zero(7);
    }
    for (int j0 = 0; j0 < nk; j0 += 32) {
      if (c0 == 0) {  // the second half of the next tile's rows
        const int end = j0 + 32 < nk ? (nk + j0 + 32) / 2 : next.rows;
        for (int j = (nk + j0) / 2; j < end; ++j) next.row(j);
      }
      // V's key pairs of keys j0 .. j0 + 31, columns c0 .. c0 + 32 groups,
      // into two buffers taken in turn (this chunk's pairs are written while
      // the previous chunk's tile products still read theirs).
      std::uint16_t* const vb = vb2 + ((j0 / 32) & 1) * 2048;
      for (int kp = 0; kp < 16; ++kp) {
        const int j = j0 + 2 * kp;
        const S* const r0 = j < nk ? row(j) : nullptr;
        const S* const r1 = j + 1 < nk ? row(j + 1) : nullptr;
        for (int g = 0; g < groups; ++g) {
          const __m512i x = decode_amx_row32(r0, c0 + 32 * g, j < nk);
          const __m512i y = decode_amx_row32(r1, c0 + 32 * g, j + 1 < nk);
          _mm512_storeu_si512(static_cast<void*>(vb + (2 * g) * 512 + kp * 32),
                              _mm512_unpacklo_epi16(x, y));
          _mm512_storeu_si512(static_cast<void*>(vb + (2 * g + 1) * 512 + kp * 32),
                              _mm512_unpackhi_epi16(x, y));
        }
      }
      __asm__ volatile("" : : : "memory");
      _tile_loadd(0, p16 + j0, ld16 * 2);
      _tile_loadd(1, vb, 64);
      _tile_dpbf16ps(4, 0, 1);
      _tile_loadd(2, vb + 512, 64);
      _tile_dpbf16ps(5, 0, 2);
      if (groups == 2) {
        _tile_loadd(3, vb + 1024, 64);
        _tile_dpbf16ps(6, 0, 3);
        _tile_loadd(1, vb + 1536, 64);
        _tile_dpbf16ps(7, 0, 1);
      }
    }
    // t's columns c0 + 16 i .. of tile 4 + i (the interleaved order).
    _tile_stored(4, t + c0, D * 4);
    _tile_stored(5, t + c0 + 16, D * 4);
    if (groups == 2) {
      _tile_stored(6, t + c0 + 32, D * 4);
      _tile_stored(7, t + c0 + 48, D * 4);
    }
    __asm__ volatile("" : : : "memory");
  }
  // x - x is 0 for finite x and NaN otherwise.
  __m512 bad = _mm512_setzero_ps();
  for (int r = 0; r < nr; ++r)
    for (int c = 0; c < D; c += 16) {
      const __m512 x = _mm512_loadu_ps(t + std::size_t(r) * D + c);
      bad = _mm512_add_ps(bad, _mm512_sub_ps(x, x));
    }
  float flag;
  simd_for_t<HostIsa::avx512>::reduce_add_to(flag, bad);
  if (flag != flag) {  // key by key (the rows may sit on several pages)
    for (int j = 0; j < nk; ++j) {
      float ones[16];
      for (int r = 0; r < 16; ++r) ones[r] = j == 0 ? a[r < nr ? r : 0] : 1.0f;
      decode_pv_skipping(o, D, ones, p + j, ldp, vrow(j), 0, 1, nr, D);
    }
    return;
  }
  for (int r = 0; r < nr; ++r) {
    const __m512 ar = _mm512_set1_ps(a[r]);
    float* const orow = o + std::size_t(r) * D;
    const float* const trow = t + std::size_t(r) * D;
    for (int c = 0; c < D; c += 32) {
      // Tile columns 0-15 (lo): 8 L + i, 16-31 (hi): 8 L + 4 + i (L the 128-bit lane).
      const __m512 lo = _mm512_loadu_ps(trow + c), hi = _mm512_loadu_ps(trow + c + 16);
      const __m512 t0 = _mm512_maskz_shuffle_f32x4(0xFFFF, lo, hi, 0x44),
                   t1 = _mm512_maskz_shuffle_f32x4(0xFFFF, lo, hi, 0xEE);
      const __m512 n0 = _mm512_maskz_shuffle_f32x4(0xFFFF, t0, t0, 0xD8),
                   n1 = _mm512_maskz_shuffle_f32x4(0xFFFF, t1, t1, 0xD8);
      _mm512_storeu_ps(orow + c, _mm512_fmadd_ps(ar, _mm512_loadu_ps(orow + c), n0));
      _mm512_storeu_ps(orow + c + 16, _mm512_fmadd_ps(ar, _mm512_loadu_ps(orow + c + 16), n1));
    }
  }
}

}  // namespace blockattn::impl

#else
#define BLOCKATTN_DECODE_AMX 0
#endif
