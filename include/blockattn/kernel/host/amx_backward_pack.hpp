// SPDX-License-Identifier: Apache-2.0
// The operands of the AMX backward (host/amx_backward.hpp): Q, dO, K and V of
// a block pair as bf16 tiles in VNNI order, LSE2 and D per query row, from
// the fp32 packed blocks of the step loops (pack_amx_backward) or straight
// from a single-device call's bf16 views (pack_amx_backward_views, the same
// bits), and D summed as the kernel sums dP.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/kernel/host/amx.hpp>
#include <blockattn/kernel/host/simd_vec.hpp>
#include <blockattn/kernel/impl/backward_pack.hpp>
#include <blockattn/kernel/impl/mask_columns.hpp>
#include <blockattn/kernel/validate.hpp>
#include <blockattn/policy/mask.hpp>
#include <blockattn/policy/score.hpp>

#include <cstdint>
#include <cstring>
#include <type_traits>

// Where simd_vec.hpp defines SimdVec512 (its exp2 is the exponent pass's);
// -DBLOCKATTN_AMX_BACKWARD=0 leaves it out.
#if !defined(BLOCKATTN_AMX_BACKWARD)
#if BLOCKATTN_HOST_AMX && (defined(__AVX512F__) || BLOCKATTN_HOST_DISPATCH)
#define BLOCKATTN_AMX_BACKWARD 1
#else
#define BLOCKATTN_AMX_BACKWARD 0
#endif
#endif

namespace blockattn::impl {

/// The bf16 operands of one AMX backward block pair (da = head dim padded to
/// 32, nq and nk = queries and keys padded to 64). Per (batch, head), nq x da
/// elements each:
///   qb, dob  Q^T, dO^T as B operands: per 16 rows i, da / 2 VNNI rows of
///            (X(i, 2p), X(i, 2p + 1)): element (i, d) at
///            (i / 16) 16 da + (d / 2) 32 + (i % 16) 2 + d % 2
///   qv, dov  Q, dO as B operands over rows: per 16 columns, rows of pairs of
///            rows: element (i, d) at (d / 16) 16 nq + (i / 2) 32 + (d % 16) 2 + i % 2
/// Per (batch, kv head), nk x da elements each:
///   ka, va   K, V rows (A operands): element (n, d) at n da + d
///   kt       K^T rows (A operand of dQ^T): element (n, d) at d nk + n
/// bad flags per 16 rows / keys: the group holds an inf or NaN. lse2 and drow
/// (batch, head, nq): LSE log2(e) (-inf past the queries) and D.
template <class MemorySpace>
struct AmxBackwardOperands {
  using u16 = Kokkos::View<std::uint16_t*, Kokkos::LayoutRight, MemorySpace>;
  using u8 = Kokkos::View<unsigned char*, Kokkos::LayoutRight, MemorySpace>;
  using f32 = Kokkos::View<float*, Kokkos::LayoutRight, MemorySpace>;
  u16 queries, keys;  // qb, dob, qv, dov per (batch, head); ka, va, kt per (batch, kv head)
  u8 q_bad, do_bad, k_bad;
  f32 lse2, drow;
  int da = 0, nq = 0, nk = 0;
  std::size_t q_size() const { return std::size_t(nq) * da; }
  std::size_t k_size() const { return std::size_t(nk) * da; }
};

#if BLOCKATTN_AMX_BACKWARD
/// Tile sizes of the AMX backward: key rows and query columns of a tile pair;
/// the largest head dim it takes (larger ones keep the fp32 kernels).
inline constexpr int amx_bwd_bk = 64, amx_bwd_bq = 64, amx_bwd_max_dim = 256;

/// The 16 bf16 bits of a packed fp32 value that is a bf16 value.
inline std::uint16_t amx_bits(float x) {
  return bf16_upper_bits(x);
}

/// The operands' views for the extents e (uninitialised: the packers write
/// every element, the flags too), carved from `buffers` when given.
template <class MemorySpace, class Buffers>
void allocate_amx_backward(const BlockExtents& e, AmxBackwardOperands<MemorySpace>& ops,
                           Buffers* buffers) {
  using Ops = AmxBackwardOperands<MemorySpace>;
  const int da = (e.dim + 31) / 32 * 32;
  const int nq = (e.queries + amx_bwd_bq - 1) / amx_bwd_bq * amx_bwd_bq;
  const int nk = (e.keys + amx_bwd_bk - 1) / amx_bwd_bk * amx_bwd_bk;
  ops.da = da;
  ops.nq = nq;
  ops.nk = nk;
  const std::size_t bh = std::size_t(e.batch) * e.heads, bk = std::size_t(e.batch) * e.kv_heads;
  ops.queries =
      allocate_view<typename Ops::u16>(buffers, "blockattn::amx_queries", 4 * bh * nq * da);
  ops.keys = allocate_view<typename Ops::u16>(buffers, "blockattn::amx_keys", 3 * bk * nk * da);
  ops.q_bad = allocate_view<typename Ops::u8>(buffers, "blockattn::amx_q_bad", bh * (nq / 16));
  ops.do_bad = allocate_view<typename Ops::u8>(buffers, "blockattn::amx_do_bad", bh * (nq / 16));
  ops.k_bad = allocate_view<typename Ops::u8>(buffers, "blockattn::amx_k_bad", bk * (nk / 16));
  ops.lse2 = allocate_view<typename Ops::f32>(buffers, "blockattn::amx_lse2", bh * nq);
  ops.drow = allocate_view<typename Ops::f32>(buffers, "blockattn::amx_drow", bh * nq);
}

/// Writes 16 query rows (q16, d16: Q and dO as bf16 bits, rows da apart,
/// 4-byte aligned, zero past the head dim) as rows i0 .. i0 + 15 of one
/// (batch, head)'s operands: Q^T, dO^T (qb, dob: VNNI pairs over d) and Q, dO
/// (qv, dov: VNNI pairs of rows, 16 columns at a time). bad_q, bad_do: the
/// rows hold an inf or NaN.
inline void amx_store_query_rows(const std::uint16_t* q16, const std::uint16_t* d16, int da, int nq,
                                 int i0, std::uint16_t* qb, std::uint16_t* dob, std::uint16_t* qv,
                                 std::uint16_t* dov, bool& bad_q, bool& bad_do) {
  amx_gather_k16(q16, da, da / 2, qb + std::size_t(i0) * da);
  amx_gather_k16(d16, da, da / 2, dob + std::size_t(i0) * da);
  bad_q = bad_do = false;
  for (int p = 0; p < 8; ++p)
    for (int n = 0; n < da / 16; ++n) {
      const std::size_t to = std::size_t(n) * 16 * nq + std::size_t(i0 / 2 + p) * 32;
      const std::size_t r0 = std::size_t(2 * p) * da + 16 * n;
      bad_q = amx_pair_bf16x16(q16 + r0, q16 + r0 + da, qv + to) || bad_q;
      bad_do = amx_pair_bf16x16(d16 + r0, d16 + r0 + da, dov + to) || bad_do;
    }
}

/// Writes 16 keys (k16, v16: K and V rows as bf16 bits, da apart, zero past
/// the head dim) as keys n0 .. n0 + 15 of one (batch, kv head)'s operands: K
/// and V rows (ka, va) and K^T (kt). True where the K rows hold an inf or NaN.
inline bool amx_store_key_rows(const std::uint16_t* k16, const std::uint16_t* v16, int da, int nk,
                               int n0, std::uint16_t* ka, std::uint16_t* va, std::uint16_t* kt) {
  std::memcpy(ka + std::size_t(n0) * da, k16, sizeof(std::uint16_t) * 16 * da);
  std::memcpy(va + std::size_t(n0) * da, v16, sizeof(std::uint16_t) * 16 * da);
  bool bad = false;
  for (int d = 0; d < da; ++d)
    for (int i = 0; i < 16; ++i) {
      const std::uint16_t x = k16[i * da + d];
      bad = bad || (x & 0x7f80u) == 0x7f80u;
      kt[std::size_t(d) * nk + n0 + i] = x;
    }
  return bad;
}

/// f(g, b, h, pair) for group g (of 16 or 32 rows or keys) of each (batch b,
/// head h) of batch x heads with `groups` groups each; pair = b heads + h.
template <class ExecSpace, class F>
void for_each_group(const ExecSpace& exec, const char* label, int batch, int heads, int groups,
                    F f) {
  const std::int64_t pairs = std::int64_t(batch) * heads;
  Kokkos::parallel_for(
      label,
      Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(exec, 0, pairs * groups),
      [=](const std::int64_t it) {
        const std::size_t pair = std::size_t(it / groups);
        f(int(it % groups), int(pair / std::size_t(heads)), int(pair % std::size_t(heads)), pair);
      });
}

/// Fills `ops` from the fp32 packed query and key sides (values that are bf16
/// values: exact). `buffers`: a single call's cached buffer to carve the
/// operands from (nullptr: allocate them).
template <class ExecSpace, class MemorySpace, class Buffers = NoCallBuffers>
void pack_amx_backward(const ExecSpace& exec, const BlockExtents& e,
                       const PackedQueries<float, MemorySpace>& rows,
                       const PackedKeys<float, MemorySpace>& keys,
                       AmxBackwardOperands<MemorySpace>& ops, Buffers* buffers = nullptr) {
  allocate_amx_backward(e, ops, buffers);
  const int da = ops.da, nq = ops.nq, nk = ops.nk;
  std::uint16_t* const qbase = ops.queries.data();
  std::uint16_t* const kbase = ops.keys.data();
  const int queries = e.queries, nkeys = e.keys;
  const int dp = int(rows.q.extent(3));
  const int vbk = int(keys.vt.extent(4));
  const std::size_t qs = ops.q_size(), ks = ops.k_size();
  auto q = rows.q;
  auto dout = rows.dout;
  auto lse2 = rows.lse2;
  auto drow = rows.drow;
  auto lse2p = ops.lse2;
  auto drowp = ops.drow;
  auto q_bad = ops.q_bad;
  auto do_bad = ops.do_bad;
  auto k_bad = ops.k_bad;
  // The query side: one group of 16 rows of one (batch, head) per iteration.
  for_each_group(exec, "blockattn::pack_amx_queries", e.batch, e.heads, nq / 16,
                 [=](const int g, const int b, const int h, const std::size_t pair) {
                   std::uint16_t* const qb = qbase + 4 * pair * qs;  // then dO^T, Q, dO: qs apart
                   std::uint16_t *const dob = qb + qs, *const qv = dob + qs, *const dov = qv + qs;
                   // The group's 16 rows as bf16 bits (exact: the packed values are bf16 values).
                   alignas(64) std::uint16_t ql[16 * amx_bwd_max_dim], dl[16 * amx_bwd_max_dim];
                   for (int r = 0; r < 16; ++r) {
                     const int i = 16 * g + r;
                     const bool in = i < queries;
                     const int live = in ? (dp < da ? dp : da) : 0;
                     const float* const qr = in ? &q(b, h, i, 0) : nullptr;
                     const float* const dr = in ? &dout(b, h, i, 0) : nullptr;
                     for (int d = 0; d < live; ++d) {
                       ql[r * da + d] = amx_bits(qr[d]);
                       dl[r * da + d] = amx_bits(dr[d]);
                     }
                     for (int d = live; d < da; ++d) ql[r * da + d] = dl[r * da + d] = 0;
                     lse2p(pair * nq + i) = in ? lse2(b, h, i) : -infinity<float>();
                     drowp(pair * nq + i) = in ? drow(b, h, i) : 0.0f;
                   }
                   bool bad_q, bad_do;
                   amx_store_query_rows(ql, dl, da, nq, 16 * g, qb, dob, qv, dov, bad_q, bad_do);
                   q_bad(pair * (nq / 16) + g) = bad_q;
                   do_bad(pair * (nq / 16) + g) = bad_do;
                 });
  auto kr = keys.k;
  auto vt = keys.vt;
  // The key side: one group of 16 keys of one (batch, kv head) per iteration.
  for_each_group(
      exec, "blockattn::pack_amx_keys", e.batch, e.kv_heads, nk / 16,
      [=](const int g, const int b, const int hk, const std::size_t pair) {
        std::uint16_t* const ka = kbase + 3 * pair * ks;  // then V, K^T: ks apart
        std::uint16_t *const va = ka + ks, *const kt = va + ks;
        // 16 keys of K and V gathered here (K rows, V from its d-major
        // panels), then written as rows (K, V) and as 16-key runs of K^T.
        std::uint16_t kloc[16 * amx_bwd_max_dim], vloc[16 * amx_bwd_max_dim];
        for (int i = 0; i < 16; ++i) {
          const int n = 16 * g + i;
          const int live = n < nkeys ? (dp < da ? dp : da) : 0;
          const float* const krow = live > 0 ? &kr(b, hk, n, 0) : nullptr;
          for (int d = 0; d < live; ++d) kloc[i * da + d] = amx_bits(krow[d]);
          for (int d = live; d < da; ++d) kloc[i * da + d] = 0;
        }
        const int n0 = 16 * g;
        const int vlive = n0 < nkeys ? (dp < da ? dp : da) : 0;
        for (int d = 0; d < vlive; ++d) {
          if (vbk % 16 == 0) {  // keys n0 .. n0 + 15 of column d: in one panel
            const float* const col = &vt(b, hk, n0 / vbk, d, n0 % vbk);
            for (int i = 0; i < 16; ++i) vloc[i * da + d] = n0 + i < nkeys ? amx_bits(col[i]) : 0;
          } else {
            for (int i = 0; i < 16; ++i) {
              const int n = n0 + i;
              vloc[i * da + d] = n < nkeys ? amx_bits(vt(b, hk, n / vbk, d, n % vbk)) : 0;
            }
          }
        }
        for (int i = 0; i < 16; ++i)
          for (int d = vlive; d < da; ++d) vloc[i * da + d] = 0;
        k_bad(pair * (nk / 16) + g) = amx_store_key_rows(kloc, vloc, da, nk, n0, ka, va, kt);
      });
}

/// S^T of a tile pair through a score policy (key-major: row r is the key at
/// kp[r], column c the query at qp[c], head h): st = score(st sc), grad =
/// score_grad, on every element (amx_bwd_p_ds selects the kept pairs after).
/// The policy by value and the rows restrict, so that its data stay in
/// registers and the column loop vectorises (as the fp32 kernels' score_row);
/// compiled for the engine's target, so x86-64 dispatch builds run it on
/// AVX-512 too.
template <class Mask>
BLOCKATTN_TARGET_AMX __attribute__((noinline)) void amx_bwd_score(
    const Mask m, const index_type* __restrict__ qp, const index_type* __restrict__ kp, float sc,
    int h, float* __restrict__ st, float* __restrict__ grad) {
  constexpr int BK = amx_bwd_bk, BQ = amx_bwd_bq;
  for (int r = 0; r < BK; ++r) {
    const index_type k = kp[r];
    float* __restrict__ const s = st + r * BQ;
    float* __restrict__ const g = grad + r * BQ;
    for (int c = 0; c < BQ; ++c) s[c] = score_and_grad(m, s[c] * sc, qp[c], k, h, g[c]);
  }
}

/// P^T and dS^T of a tile pair (BK key rows x BQ query columns, rows BQ
/// apart) from S^T and dP^T in fp32: p = 2^(s s2 - lse2[c]) (one rounding for
/// the product and difference, as the fp32 kernels), ds = p (dp - drow[c])
/// [grad: times grad, the score policy's factor], both 0 where the pair is not
/// kept: row r of column c is kept when lo[c] <= r < hi[c] and, with `keep`,
/// keep[r BQ + c] != 0. Out: P^T and dS^T in bf16 (rows BQ apart), dS^T in
/// VNNI pairs of rows for the B operand of dQ^T (per 16 columns, BK / 2 rows
/// of 32).
BLOCKATTN_TARGET_AMX __attribute__((noinline)) inline void amx_bwd_p_ds(
    const float* __restrict__ st, const float* __restrict__ dpt, const float* lse2,
    const float* drow, float s2, const int* lo, const int* hi, const unsigned char* keep,
    const float* __restrict__ grad, std::uint16_t* __restrict__ pt16,
    std::uint16_t* __restrict__ dst16, std::uint16_t* __restrict__ dsv) {
  using V = SimdVec512;
  constexpr int BK = amx_bwd_bk, BQ = amx_bwd_bq;
  const __m512 s2v = _mm512_set1_ps(s2);
  for (int c = 0; c < BQ; c += 16) {
    const __m512 l2 = _mm512_loadu_ps(lse2 + c), d = _mm512_loadu_ps(drow + c);
    // A column whose LSE is -inf saw no key: all zero (as row_live in the
    // fp32 kernels; a NaN LSE stays live and makes its column NaN).
    const __mmask16 live = _mm512_cmp_ps_mask(l2, _mm512_set1_ps(-infinity<float>()), _CMP_NEQ_UQ);
    const __m512i lov = _mm512_loadu_si512(static_cast<const void*>(lo + c));
    const __m512i hiv = _mm512_loadu_si512(static_cast<const void*>(hi + c));
    std::uint16_t* const vrow = dsv + std::size_t(c / 16) * BK * 16;
    for (int r = 0; r < BK; r += 2) {
      __m512i pair[2];
      for (int t = 0; t < 2; ++t) {
        const int row = r + t;
        const __m512i rv = _mm512_set1_epi32(row);
        __mmask16 k = live & _mm512_cmple_epi32_mask(lov, rv) & _mm512_cmplt_epi32_mask(rv, hiv);
        if (keep != nullptr)
          k &= _mm_cmpneq_epi8_mask(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(keep + row * BQ + c)),
              _mm_setzero_si128());
        const std::size_t at = std::size_t(row) * BQ + c;
        const __m512 p = _mm512_maskz_mov_ps(
            k, V::exp2_nonpositive(_mm512_fmsub_ps(_mm512_loadu_ps(st + at), s2v, l2)));
        __m512 ds = _mm512_mul_ps(p, _mm512_sub_ps(_mm512_loadu_ps(dpt + at), d));
        if (grad != nullptr) ds = _mm512_mul_ps(ds, _mm512_loadu_ps(grad + at));
        ds = _mm512_maskz_mov_ps(k, ds);
        amx_store_p16(pt16 + at, p);
        const __m256bh dsb = _mm512_cvtneps_pbh(ds);
        const __m256i dsi = reinterpret_cast<const __m256i&>(dsb);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst16 + at), dsi);
        pair[t] = _mm512_maskz_cvtepu16_epi32(0xFFFF, dsi);
      }
      _mm512_storeu_si512(static_cast<void*>(vrow + std::size_t(r / 2) * 32),
                          _mm512_or_si512(pair[0], _mm512_maskz_slli_epi32(0xFFFF, pair[1], 16)));
    }
  }
}

/// d[i] = sum over the head dim of O(i, :) dO(i, :) for 32 rows (bf16 bits,
/// rows da apart), summed as the kernel sums dP^T: the same block product
/// (amx_block or bf16_vector_block) over the same chunks, with O's rows where
/// the kernel has V's and dO's B operand laid out as it is there. So a row
/// that sees one key (O = V bitwise) gets dP - D = 0 exactly, and dS = 0, as
/// on the fp32 kernels (whose D is summed as their dP).
BLOCKATTN_TARGET_AMX inline void amx_row_dots(const std::uint16_t* o, const std::uint16_t* dout,
                                              int da, bool tiles, float* d) {
  std::uint16_t bp[32 * amx_bwd_max_dim];
  float c[32 * 32];
  for (int r = 0; r < 32; ++r)
    for (int x = 0; x < da; ++x)
      bp[(r / 16) * 16 * da + (x / 2) * 32 + (r % 16) * 2 + x % 2] = dout[r * da + x];
  if (tiles) {
    amx_configure();
    amx_block(da / 32, o, da, bp, bp + 16 * da, c, 32, false);
    amx_release();
  } else {
    bf16_vector_block(da / 32, o, da, bp, bp + 16 * da, c, 32, false);
  }
  for (int i = 0; i < 32; ++i) d[i] = c[i * 32 + i];
}

/// D = rowsum(dO o O) of packed query rows `p` (pack_queries), summed as the
/// AMX backward sums dP (amx_row_dots), from the bf16 views dout and o
/// (batch, queries, heads, dim). For head dims up to amx_bwd_max_dim.
template <class ExecSpace, class MemorySpace, class S, class DOV, class OV>
void amx_rowsum_d(const ExecSpace& exec, const DOV& dout, const OV& o, bool tiles,
                  const PackedQueries<float, MemorySpace, S>& p) {
  const int heads = int(p.q.extent(1)), queries = p.queries, dim = int(dout.extent(3));
  const int da = (dim + 31) / 32 * 32, groups = (queries + 31) / 32;
  auto drow = p.drow;
  const std::ptrdiff_t ds = std::ptrdiff_t(dout.stride(3)), os = std::ptrdiff_t(o.stride(3));
  for_each_group(exec, "blockattn::amx_rowsum_d", int(p.q.extent(0)), heads, groups,
                 [=](const int g, const int b, const int h, std::size_t) {
                   std::uint16_t ob[32 * amx_bwd_max_dim], db[32 * amx_bwd_max_dim];
                   for (int r = 0; r < 32; ++r) {
                     const int i = 32 * g + r;
                     const int live = i < queries ? dim : 0;
                     if (live > 0) {
                       const auto* const orow = &o(b, i, h, 0);
                       const auto* const drow_ = &dout(b, i, h, 0);
                       for (int x = 0; x < live; ++x) {
                         ob[r * da + x] = orow[x * os].bits;
                         db[r * da + x] = drow_[x * ds].bits;
                       }
                     }
                     for (int x = live; x < da; ++x) ob[r * da + x] = db[r * da + x] = 0;
                   }
                   float d[32];
                   amx_row_dots(ob, db, da, tiles, d);
                   for (int r = 0; r < 32 && 32 * g + r < queries; ++r)
                     drow(b, h, 32 * g + r) = d[r];
                 });
}

/// pack_amx_backward straight from the caller's bf16 views (the
/// single-device backward: no fp32 blocks in between): q, dout, o (batch,
/// queries, heads, dim), lse (batch, heads, queries), k, v (batch, keys,
/// kv_heads, dim), any layout. lse2 as pack_queries scales it, D summed as
/// amx_rowsum_d sums it (`tiles`: on AMX tiles): bitwise the operands of
/// pack_queries + amx_rowsum_d + pack_keys + pack_amx_backward, at a third
/// of the memory traffic and none of the fp32 blocks' memory.
template <class ExecSpace, class QV, class DOV, class OV, class LV, class KV, class VV,
          class Buffers = NoCallBuffers>
void pack_amx_backward_views(const ExecSpace& exec, const BlockExtents& e, const QV& q,
                             const DOV& dout, const OV& o, const LV& lse, const KV& k, const VV& v,
                             bool tiles, AmxBackwardOperands<typename ExecSpace::memory_space>& ops,
                             Buffers* buffers = nullptr) {
  allocate_amx_backward(e, ops, buffers);
  const int da = ops.da, nq = ops.nq, nk = ops.nk;
  const int queries = e.queries, nkeys = e.keys, dim = e.dim;
  const std::size_t qs = ops.q_size(), ks = ops.k_size();
  std::uint16_t* const qbase = ops.queries.data();
  std::uint16_t* const kbase = ops.keys.data();
  float* const lse2p = ops.lse2.data();
  float* const drowp = ops.drow.data();
  unsigned char* const q_bad = ops.q_bad.data();
  unsigned char* const do_bad = ops.do_bad.data();
  unsigned char* const k_bad = ops.k_bad.data();
  const std::ptrdiff_t sq = q.stride(3), sd = dout.stride(3), so = o.stride(3);
  // The bits of a row of `live` values (stride st) into dst, zeros up to da.
  auto gather_row = [da](std::uint16_t* dst, const auto* src, std::ptrdiff_t st, int live) {
    if (st == 1 && live > 0)
      std::memcpy(dst, &src[0].bits, sizeof(std::uint16_t) * std::size_t(live));
    else
      for (int d = 0; d < live; ++d) dst[d] = src[d * st].bits;
    for (int d = live; d < da; ++d) dst[d] = 0;
  };
  // The query side: one group of 32 rows of one (batch, head) per iteration
  // (amx_row_dots sums D of 32 rows at once).
  for_each_group(exec, "blockattn::pack_amx_queries", e.batch, e.heads, nq / 32,
                 [=](const int g, const int b, const int h, const std::size_t pair) {
                   std::uint16_t* const qb = qbase + 4 * pair * qs;  // then dO^T, Q, dO: qs apart
                   std::uint16_t *const dob = qb + qs, *const qv = dob + qs, *const dov = qv + qs;
                   alignas(64) std::uint16_t ql[32 * amx_bwd_max_dim], dl[32 * amx_bwd_max_dim],
                       ol[32 * amx_bwd_max_dim];
                   for (int r = 0; r < 32; ++r) {
                     const int i = 32 * g + r;
                     const int live = i < queries ? dim : 0;
                     const std::size_t at = std::size_t(r) * da;
                     gather_row(ql + at, live > 0 ? &q(b, i, h, 0) : nullptr, sq, live);
                     gather_row(dl + at, live > 0 ? &dout(b, i, h, 0) : nullptr, sd, live);
                     gather_row(ol + at, live > 0 ? &o(b, i, h, 0) : nullptr, so, live);
                   }
                   float dsum[32];
                   amx_row_dots(ol, dl, da, tiles, dsum);
                   for (int s = 0; s < 2; ++s) {
                     const int i0 = 32 * g + 16 * s;  // the 16-row group's first row
                     const std::uint16_t* const q16 = ql + std::size_t(16 * s) * da;
                     const std::uint16_t* const d16 = dl + std::size_t(16 * s) * da;
                     bool bad_q, bad_do;
                     amx_store_query_rows(q16, d16, da, nq, i0, qb, dob, qv, dov, bad_q, bad_do);
                     q_bad[pair * (nq / 16) + i0 / 16] = bad_q;
                     do_bad[pair * (nq / 16) + i0 / 16] = bad_do;
                   }
                   for (int r = 0; r < 32; ++r) {
                     const int i = 32 * g + r;
                     const bool in = i < queries;
                     lse2p[pair * nq + i] =
                         in ? float(lse(b, h, i)) * log2e<float> : -infinity<float>();
                     drowp[pair * nq + i] = in ? dsum[r] : 0.0f;
                   }
                 });
  const std::ptrdiff_t sk = k.stride(3), sv = v.stride(3);
  // The key side: one group of 16 keys of one (batch, kv head) per iteration.
  for_each_group(exec, "blockattn::pack_amx_keys", e.batch, e.kv_heads, nk / 16,
                 [=](const int g, const int b, const int hk, const std::size_t pair) {
                   std::uint16_t* const ka = kbase + 3 * pair * ks;  // then V, K^T: ks apart
                   std::uint16_t *const va = ka + ks, *const kt = va + ks;
                   const int n0 = 16 * g;
                   std::uint16_t kl[16 * amx_bwd_max_dim], vl[16 * amx_bwd_max_dim];
                   for (int i = 0; i < 16; ++i) {
                     const int n = n0 + i;
                     const int live = n < nkeys ? dim : 0;
                     gather_row(kl + i * da, live > 0 ? &k(b, n, hk, 0) : nullptr, sk, live);
                     gather_row(vl + i * da, live > 0 ? &v(b, n, hk, 0) : nullptr, sv, live);
                   }
                   k_bad[pair * (nk / 16) + g] = amx_store_key_rows(kl, vl, da, nk, n0, ka, va, kt);
                 });
}
#endif  // BLOCKATTN_AMX_BACKWARD

}  // namespace blockattn::impl
