// SPDX-License-Identifier: Apache-2.0
// The backward on AMX tiles (bf16 inputs on host spaces; kernel/host/amx.hpp
// has the engine and its detection). One team per (batch, kv head, slice)
// walks its key tiles (BK = 64 keys) and, per key tile, every query tile
// (BQ = 64 rows) of every head of its GQA group, in the key-major orientation
// of the tile pair (the key tile's rows are the products' rows):
//   S^T  = K Q^T            A: K rows       B: Q^T  (VNNI pairs over d)
//   dP^T = V dO^T           A: V rows       B: dO^T (VNNI pairs over d)
//   P^T  = 2^(S^T scale log2(e) - LSE2),  dS^T = P^T o (dP^T - D)    (fp32)
//   dV  += P^T dO           A: P^T (bf16)   B: dO (VNNI pairs over rows)
//   dK  += dS^T Q           A: dS^T (bf16)  B: Q  (VNNI pairs over rows)
//   dQ^T += K^T dS^T        A: K^T rows     B: dS^T (VNNI pairs over keys)
// Five tile products per pair with fp32 accumulation; LSE2 and D are per
// column, so the exponent pass runs along the query rows of 16 columns at a
// time. dK and dV accumulate in fp32 scratch over the key tile's query tiles;
// dQ^T in an fp32 accumulator per slice, summed and transposed into dq by
// finish_dq_transposed. What rounds differently from the fp32 kernels: P and
// dS to bf16 before the three gradient products (FlashAttention's rule on
// GPUs), and the products' accumulation order. The bound is in
// docs/numerics.md.
//
// The step loops' operands come from the fp32 packed blocks (PackedQueries,
// PackedKeys: exact widenings of bf16 inputs) through pack_amx_backward, so
// every caller of the block product takes this path by setting
// BackwardBlock::operands_bf16; the single-device backward packs them
// straight from its bf16 views (pack_amx_backward_views, the same bits:
// BackwardBlock::matrix_operands) into its cached call buffer.
//
// Masked pairs are selected out (P = dS = 0 exactly, whatever S was). A
// partial tile pair whose Q, dO or K tile holds an inf or NaN adds its
// gradient products by scalar selects instead (0 * inf would be NaN where the
// pair is masked): NaN reaches exactly the gradients the fp32 kernels reach.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/kernel/host/amx.hpp>
#include <blockattn/kernel/host/amx_backward_pack.hpp>
#include <blockattn/kernel/host/simd_vec.hpp>
#include <blockattn/kernel/impl/backward_pack.hpp>
#include <blockattn/kernel/impl/mask_columns.hpp>
#include <blockattn/kernel/impl/scratch.hpp>
#include <blockattn/kernel/validate.hpp>
#include <blockattn/policy/mask.hpp>
#include <blockattn/policy/score.hpp>

#include <cstdint>
#include <cstring>
#include <type_traits>

// BLOCKATTN_AMX_BACKWARD: host/amx_backward_pack.hpp.

namespace blockattn::impl {

#if BLOCKATTN_AMX_BACKWARD
/// The fp32 value of bf16 bits.
inline float amx_float(std::uint16_t x) {
  return bits_float(std::uint32_t(x) << 16);
}

/// The AMX backward functor (see the top of this file). GS: the storage type
/// of dk and dv.
template <class ExecSpace, class Mask, class QPos, class KPos, class GS>
struct AmxBackwardKernel : BlockExtents {
  using memory_space = typename ExecSpace::memory_space;
  using policy_type = Kokkos::TeamPolicy<ExecSpace, Kokkos::Schedule<Kokkos::Dynamic>>;
  using member_type = typename policy_type::member_type;
  using out4 = Kokkos::View<GS****, Kokkos::LayoutStride, memory_space,
                            Kokkos::MemoryTraits<Kokkos::Unmanaged>>;
  static constexpr int BK = amx_bwd_bk, BQ = amx_bwd_bq;

  const std::uint16_t* q_ops = nullptr;  // AmxBackwardOperands.queries, .keys
  const std::uint16_t* k_ops = nullptr;
  const unsigned char *q_bad = nullptr, *do_bad = nullptr, *k_bad = nullptr;
  const float *lse2 = nullptr, *drow = nullptr;
  float* dqt = nullptr;  // (slices, batch, head, da, nq): dQ^T, unscaled, zero on entry
  out4 dk, dv;
  Mask mask;
  QPos qpos;
  KPos kpos;
  int da = 0, nq = 0, nk = 0, group = 1, slices = 1, scratch_level = 0;
  bool accumulate = false, matrix_tiles = true;
  float scale = 1.0f;

  /// Scratch: S^T and dP^T (fp32 BK x BQ); P^T, dS^T and dS^T's VNNI pairs
  /// (bf16 BK x BQ); dK, dV (fp32 BK x da); the column ranges and the keep
  /// bytes; with a score policy its factors (fp32 BK x BQ) and the tile
  /// pair's positions. Cache-line aligned pieces (impl/scratch.hpp): their
  /// lines, and what a team asks for.
  static std::size_t scratch_lines(int da) {
    auto up = scratch_line_bytes;
    const std::size_t policy = has_score_mod_v<Mask>
                                   ? up(std::size_t(4) * BK * BQ) + up(sizeof(index_type) * BQ) +
                                         up(sizeof(index_type) * BK)
                                   : 0;
    return 2 * up(std::size_t(4) * BK * BQ) + 3 * up(std::size_t(2) * BK * BQ) +
           2 * up(std::size_t(4) * BK * da) + 2 * up(std::size_t(4) * BQ) +
           up(std::size_t(BK) * BQ) + policy;
  }
  static std::size_t scratch_bytes(int da) { return scratch_request(scratch_lines(da)); }

  // run() calls the engine's functions (compiled for the AMX target) rather
  // than being flattened into one (AmxEntry): one copy of the exponent pass
  // per translation unit instead of one per mask (same speed, measured).
  void operator()(const member_type& team) const { run(team); }

  void run(const member_type& team) const {
    const int slice = team.league_rank() % slices, pair = team.league_rank() / slices;
    const int hk = pair % kv_heads, b = pair / kv_heads;
    ScratchLines scratch(team, scratch_level, scratch_lines(da));
    float* const st = scratch.take<float>(std::size_t(BK) * BQ);
    float* const dpt = scratch.take<float>(std::size_t(BK) * BQ);
    auto* const pt16 = scratch.take<std::uint16_t>(std::size_t(BK) * BQ);
    auto* const dst16 = scratch.take<std::uint16_t>(std::size_t(BK) * BQ);
    auto* const dsv = scratch.take<std::uint16_t>(std::size_t(BK) * BQ);
    float* const dka = scratch.take<float>(std::size_t(BK) * da);
    float* const dva = scratch.take<float>(std::size_t(BK) * da);
    int* const lo = scratch.take<int>(BQ);
    int* const hi = scratch.take<int>(BQ);
    auto* const keep = scratch.take<unsigned char>(std::size_t(BK) * BQ);
    float* grad = nullptr;
    index_type *qps = nullptr, *kps = nullptr;
    if constexpr (has_score_mod_v<Mask>) {
      grad = scratch.take<float>(std::size_t(BK) * BQ);
      qps = scratch.take<index_type>(BQ);
      kps = scratch.take<index_type>(BK);
    }

    const std::size_t qs = std::size_t(nq) * da, ks = std::size_t(nk) * da;
    const std::size_t kpair = std::size_t(b) * kv_heads + hk;
    const std::uint16_t* const ka = k_ops + 3 * kpair * ks;
    const std::uint16_t* const va = ka + ks;
    const std::uint16_t* const kt = va + ks;
    if (matrix_tiles) amx_configure();
    auto block = [&](int chunks, const std::uint16_t* a, int lda, const std::uint16_t* b0,
                     const std::uint16_t* b1, float* c, int ldc, bool load_c) {
      if (matrix_tiles)
        amx_block(chunks, a, lda, b0, b1, c, ldc, load_c);
      else
        bf16_vector_block(chunks, a, lda, b0, b1, c, ldc, load_c);
    };
    const int k_tiles = nk / BK, q_tiles = nq / BQ;
    for (int kb = slice; kb < k_tiles; kb += slices) {
      const int k0 = kb * BK;
      const int k_rows = keys - k0 < BK ? keys - k0 : BK;
      if (k_rows <= 0) break;
      std::memset(dka, 0, sizeof(float) * BK * da);
      std::memset(dva, 0, sizeof(float) * BK * da);
      const unsigned char* const kbad = k_bad + kpair * (nk / 16) + k0 / 16;
      const bool k_poisoned = (kbad[0] | kbad[1] | kbad[2] | kbad[3]) != 0;
      if constexpr (has_score_mod_v<Mask>)  // past the last key: the last key's position
        for (int r = 0; r < BK; ++r) kps[r] = kpos(k0 + (r < k_rows ? r : k_rows - 1));
      for (int g = 0; g < group; ++g) {
        const int h = hk * group + g;
        const std::size_t qpair = std::size_t(b) * heads + h;
        const std::uint16_t* const qb = q_ops + 4 * qpair * qs;
        const std::uint16_t* const dob = qb + qs;
        const std::uint16_t* const qv = dob + qs;
        const std::uint16_t* const dov = qv + qs;
        float* const dq_head = dqt + ((std::size_t(slice) * batch + b) * heads + h) * qs;
        for (int qt = 0; qt < q_tiles; ++qt) {
          const int q0 = qt * BQ;
          const int q_rows = queries - q0 < BQ ? queries - q0 : BQ;
          if (q_rows <= 0) break;
          const TileKind kind = mask.classify(qpos(q0), qpos(q0 + q_rows - 1) + 1, kpos(k0),
                                              kpos(k0 + k_rows - 1) + 1);
          if (kind == TileKind::empty) continue;
          const bool partial = kind == TileKind::partial;
          // S^T and dP^T, 32 x 32 blocks.
          for (int rk = 0; rk < BK; rk += 32)
            for (int cq = 0; cq < BQ; cq += 32) {
              const std::size_t qo = std::size_t(q0 + cq) * da;
              block(da / 32, ka + std::size_t(k0 + rk) * da, da, qb + qo, qb + qo + 16 * da,
                    st + rk * BQ + cq, BQ, false);
              block(da / 32, va + std::size_t(k0 + rk) * da, da, dob + qo, dob + qo + 16 * da,
                    dpt + rk * BQ + cq, BQ, false);
            }
          // The kept rows of every column: the mask (partial tiles), the
          // tile's keys, the live queries.
          const bool bytes = partial && !has_allowed_keys<Mask>::value;
          for (int c = 0; c < BQ; ++c) {
            lo[c] = 0;
            hi[c] = c < q_rows ? k_rows : 0;
          }
          if (partial) column_ranges(q0, q_rows, k0, k_rows, lo, hi, keep);
          float s2 = scale * log2e<float>;
          if constexpr (has_score_mod_v<Mask>) {
            // The policy's logits in S^T (natural units), its factors in grad.
            for (int c = 0; c < BQ; ++c) qps[c] = qpos(q0 + (c < q_rows ? c : q_rows - 1));
            amx_bwd_score(mask, qps, kps, scale, h, st, grad);
            s2 = log2e<float>;
          }
          amx_bwd_p_ds(st, dpt, lse2 + qpair * nq + q0, drow + qpair * nq + q0, s2, lo, hi,
                       bytes ? keep : nullptr, grad, pt16, dst16, dsv);
          // The gradient products; partial tile pairs with an inf or NaN in
          // the operand select (see the top of this file).
          const unsigned char* const qbad = q_bad + qpair * (nq / 16) + q0 / 16;
          const unsigned char* const dbad = do_bad + qpair * (nq / 16) + q0 / 16;
          const bool q_poisoned = partial && (qbad[0] | qbad[1] | qbad[2] | qbad[3]) != 0;
          const bool do_poisoned = partial && (dbad[0] | dbad[1] | dbad[2] | dbad[3]) != 0;
          for (int rk = 0; rk < BK; rk += 32)
            for (int nb = 0; nb < da / 32; ++nb) {
              const std::size_t o0 = std::size_t(2 * nb) * 16 * nq + std::size_t(q0) * 16;
              const std::size_t o1 = o0 + std::size_t(16) * nq;
              if (!do_poisoned)
                block(BQ / 32, pt16 + rk * BQ, BQ, dov + o0, dov + o1, dva + rk * da + nb * 32, da,
                      true);
              if (!q_poisoned)
                block(BQ / 32, dst16 + rk * BQ, BQ, qv + o0, qv + o1, dka + rk * da + nb * 32, da,
                      true);
            }
          if (do_poisoned) select_at(pt16, dob, q0, dva);
          if (q_poisoned) select_at(dst16, qb, q0, dka);
          if (partial && k_poisoned) {
            // dQ^T(d, c) += sum over the kept rows r of dS^T(r, c) K(k0 + r, d).
            for (int c = 0; c < q_rows; ++c)
              for (int r = 0; r < BK; ++r) {
                const float x = amx_float(dst16[r * BQ + c]);
                if (x == 0.0f) continue;
                for (int d = 0; d < da; ++d)
                  dq_head[std::size_t(d) * nq + q0 + c] +=
                      x * amx_float(ka[std::size_t(k0 + r) * da + d]);
              }
          } else {
            for (int d0 = 0; d0 < da; d0 += 32)
              for (int cq = 0; cq < BQ; cq += 32)
                block(BK / 32, kt + std::size_t(d0) * nk + k0, nk, dsv + std::size_t(cq) * BK,
                      dsv + std::size_t(cq + 16) * BK, dq_head + std::size_t(d0) * nq + q0 + cq, nq,
                      true);
          }
        }
      }
      for (int r = 0; r < k_rows; ++r)
        for (int d = 0; d < dim; ++d) {
          const float kval = scale * dka[r * da + d], vval = dva[r * da + d];
          dk(b, k0 + r, hk, d) = GS(accumulate ? float(dk(b, k0 + r, hk, d)) + kval : kval);
          dv(b, k0 + r, hk, d) = GS(accumulate ? float(dv(b, k0 + r, hk, d)) + vval : vval);
        }
    }
    if (matrix_tiles) amx_release();
  }

  /// acc (BK x da) += A X over the kept pairs: A (BK x BQ bf16: P^T or dS^T),
  /// X the B operand over d (qb / dob layout) from row q0; zeros skipped.
  void select_at(const std::uint16_t* a, const std::uint16_t* xb, int q0, float* acc) const {
    for (int r = 0; r < BK; ++r)
      for (int c = 0; c < BQ; ++c) {
        const float x = amx_float(a[r * BQ + c]);
        if (x == 0.0f) continue;
        const int i = q0 + c;
        const std::uint16_t* const row = xb + std::size_t(i / 16) * 16 * da + (i % 16) * 2;
        for (int d = 0; d < da; ++d) acc[r * da + d] += x * amx_float(row[(d / 2) * 32 + d % 2]);
      }
  }

  /// The kept key rows of each query column of a partial tile pair: an
  /// interval (masks with allowed_keys), else keep bytes (rows BQ apart).
  void column_ranges(int q0, int q_rows, int k0, int k_rows, int* lo, int* hi,
                     unsigned char* keep) const {
    for (int c = 0; c < q_rows; ++c) {
      const index_type qp = qpos(q0 + c);
      if constexpr (has_allowed_keys<Mask>::value) {
        const ColumnRange cols = allowed_columns(mask, qp, kpos, k0, k_rows);
        lo[c] = cols.lo;
        hi[c] = cols.hi;
      } else {
        const RowMask<Mask> allow(mask, qp, true);
        for (int r = 0; r < BK; ++r) keep[r * BQ + c] = r < k_rows && allow(kpos(k0 + r));
      }
    }
    if constexpr (!has_allowed_keys<Mask>::value)
      for (int c = q_rows; c < BQ; ++c)
        for (int r = 0; r < BK; ++r) keep[r * BQ + c] = 0;
  }
};

/// dq = [dq +] scale * (sum over the slices of dQ^T), transposed: dqt
/// (slices, batch, head, da, nq) as AmxBackwardKernel leaves it. By blocks
/// of 16 rows: each head-dim row of dQ^T read as 16 consecutive floats (one
/// cache line per slice), the block transposed through a local buffer, then
/// written row by row (reading one element per line, row by row, cost about
/// 5-8 % of the bf16 backward at 1024 queries on a Zen 4); the same sums
/// in the same order.
template <class ExecSpace, class DQV>
void finish_dq_transposed(const ExecSpace& exec, const float* dqt, const DQV& dq, int nq, int da,
                          float scale, bool accumulate, int slices) {
  using GS = typename DQV::non_const_value_type;
  constexpr int R = 16;
  const int batch = int(dq.extent(0)), queries = int(dq.extent(1)), heads = int(dq.extent(2)),
            dim = int(dq.extent(3));
  const int blocks = (queries + R - 1) / R;
  const std::size_t per_slice = std::size_t(batch) * heads * da * nq;
  Kokkos::parallel_for(
      "blockattn::backward_finish_dq_amx",
      Kokkos::RangePolicy<ExecSpace, Kokkos::IndexType<std::int64_t>>(
          exec, 0, std::int64_t(batch) * heads * blocks),
      [=](const std::int64_t unit) {
        const int blk = int(unit % blocks), h = int((unit / blocks) % heads),
                  b = int(unit / (std::int64_t(blocks) * heads));
        const int i0 = blk * R, n = queries - i0 < R ? queries - i0 : R;
        const float* const base = dqt + (std::size_t(b) * heads + h) * da * nq + i0;
        alignas(64) float t[R * amx_bwd_max_dim];  // t[r dim + d]
        for (int d = 0; d < dim; ++d) {
          const float* const col = base + std::size_t(d) * nq;
          float sum[R];
          for (int r = 0; r < R; ++r) sum[r] = col[r];
          for (int s = 1; s < slices; ++s)
            for (int r = 0; r < R; ++r) sum[r] += col[s * per_slice + r];
          for (int r = 0; r < R; ++r) t[r * dim + d] = scale * sum[r];
        }
        for (int r = 0; r < n; ++r)
          for (int d = 0; d < dim; ++d) {
            const float val = t[r * dim + d];
            dq(b, i0 + r, h, d) = GS(accumulate ? float(dq(b, i0 + r, h, d)) + val : val);
          }
      });
}
#endif  // BLOCKATTN_AMX_BACKWARD

}  // namespace blockattn::impl
