// SPDX-License-Identifier: Apache-2.0
// cuDNN's fused attention (or its host emulation) on one block pair of the
// step loops: which band pieces of the pair's mask it takes, a piece's
// forward into a normalised partial, a helper's whole result, the backward's
// pieces added into the pair's fp32 sums. The dispatcher (kernel/dispatch.hpp)
// decides when it runs.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/kernel/band.hpp>
#include <blockattn/kernel/cudnn/fused_path.hpp>
#include <blockattn/kernel/fused.hpp>
#include <blockattn/kernel/impl/backward_pack.hpp>
#include <blockattn/kernel/impl/pack.hpp>
#include <blockattn/kernel/impl/pair_ops.hpp>

#include <array>
#include <cstddef>
#include <tuple>
#include <utility>

namespace blockattn::impl {

/// Whether a packed block's V holds inf or NaN (the host waits for the
/// answer): a fused provider would leak it into rows the mask hides it from
/// (impl/pair_ops.hpp has_nonfinite).
template <class ExecSpace, class V>
bool packed_v_has_nonfinite(const ExecSpace& exec,
                            const PackedKV<V, typename ExecSpace::memory_space>& kv) {
  return has_nonfinite(exec, kv.v);
}

/// A block pair's band pieces and whether the fused provider takes them all.
struct FusedPair {
  bool fused = false;
  BandSplit split;
};

/// The fused forward of one band piece: queries q (batch, rows, heads, dim;
/// storage V) against the packed block kv (rows layout), into rows
/// [piece.row_begin, piece.row_end) of part_o and part_lse.
template <class ExecSpace, class QV, class V, class PO, class PL>
FusedForwardCall fused_forward_call(const BlockExtents& e, const BandPiece& piece, const QV& q,
                                    const PackedKV<V, typename ExecSpace::memory_space>& kv,
                                    const PO& part_o, const PL& part_lse, float scale) {
  FusedForwardCall c;
  c.p = fused_problem(e, piece, fused_type<V>(), scale);
  c.q = fused_rows(q, piece.row_begin);
  c.o = fused_rows(part_o, piece.row_begin);
  c.lse = fused_lse(part_lse, piece.row_begin);
  const std::int64_t dp = std::int64_t(kv.kt.extent(3));
  c.k.data = kv.kt.data() + piece.col_begin * dp;
  c.k.stride[0] = std::int64_t(kv.kt.stride(0));
  c.k.stride[1] = std::int64_t(kv.kt.stride(1));
  c.k.stride[2] = dp;
  c.k.stride[3] = 1;
  c.v.data = kv.v.data() + piece.col_begin * dp;
  c.v.stride[0] = std::int64_t(kv.v.stride(0));
  c.v.stride[1] = std::int64_t(kv.v.stride(1));
  c.v.stride[2] = std::int64_t(kv.v.stride(2));
  c.v.stride[3] = 1;
  return c;
}

/// Which implementation computes the pair: the fused provider when it is
/// built in for (ExecSpace, V), not options.portable_only, the pair's mask is
/// band pieces in cuDNN's form and the provider supports each piece's
/// problem (a probe call with the pair's shapes; q, kv, part_o, part_lse:
/// the Views the pieces will use).
template <class ExecSpace, class V, class Mask, class QP, class KP, class QV, class PO, class PL>
FusedPair fused_pair(const Mask& mask, const QP& qpos, const KP& kpos, const BlockExtents& e,
                     bool portable_only, const QV& q,
                     const PackedKV<V, typename ExecSpace::memory_space>& kv, const PO& part_o,
                     const PL& part_lse, float scale) {
  FusedPair f;
  if constexpr (fused_enabled<ExecSpace, V>()) {
    if (portable_only || kv.panel != 1 || e.queries <= 0 || e.keys <= 0) return f;
    if (!fused_shape_ok(e)) return f;
    if (!unit_head_stride(q, part_o)) return f;
    f.split = band_split(mask, qpos, e.queries, kpos, e.keys);
    if (!f.split.expressible) return f;
    for (const BandPiece& p : f.split) {
      if (!cudnn_band(p).supported) return f;
      const FusedForwardCall c =
          fused_forward_call<ExecSpace>(e, p, q, kv, part_o, part_lse, scale);
      if (!FusedProvider<ExecSpace, V>::supports(c)) return f;
    }
    f.fused = true;
  } else {
    (void)mask, (void)qpos, (void)kpos, (void)e, (void)portable_only, (void)q, (void)kv,
        (void)part_o, (void)part_lse, (void)scale;
  }
  return f;
}

/// Runs one piece (see fused_forward_call); part_lse rows outside every
/// piece must hold -inf before the merge.
template <class ExecSpace, class QV, class V, class PO, class PL>
void fused_forward_piece(const ExecSpace& exec, const BlockExtents& e, const BandPiece& piece,
                         const QV& q, const PackedKV<V, typename ExecSpace::memory_space>& kv,
                         const PO& part_o, const PL& part_lse, float scale) {
  FusedProvider<ExecSpace, V>::run(
      exec, fused_forward_call<ExecSpace>(e, piece, q, kv, part_o, part_lse, scale));
}

/// A block pair's normalised result on the fused path, for rows that merge
/// elsewhere (a helper's task: another rank's queries q, e.queries rows,
/// against the packed block kv in its rows layout), when the pair is one band
/// piece (what the balanced schedule's contiguous blocks give): it runs into
/// part_o, part_lse (storage type, natural log) and is widened into out_o
/// (compute type) and out_lse, which hold O = 0, LSE = -inf on the rows the
/// piece does not cover. False, nothing done: the pair takes the kernels (see
/// fused_pair; more than one piece; with `guard` and a mask that hides keys,
/// inf / NaN in V).
template <class ExecSpace, class V, class Mask, class QP, class KP, class QV, class PO, class PL,
          class OO, class OL>
bool fused_forward_result(const ExecSpace& exec, const Mask& mask, const QP& qpos, const KP& kpos,
                          const BlockExtents& e, const QV& q,
                          const PackedKV<V, typename ExecSpace::memory_space>& kv, const PO& part_o,
                          const PL& part_lse, const OO& out_o, const OL& out_lse, float scale,
                          bool guard, int& pieces) {
  if constexpr (fused_enabled<ExecSpace, V>()) {
    const FusedPair pair =
        fused_pair<ExecSpace, V>(mask, qpos, kpos, e, false, q, kv, part_o, part_lse, scale);
    if (!pair.fused || pair.split.count != 1) return false;
    if (guard && !pair_covers_all(mask, qpos, e.queries, kpos, e.keys) &&
        packed_v_has_nonfinite(exec, kv))
      return false;
    using L = typename PL::non_const_value_type;
    fill_unseen_rows(exec, out_o, out_lse, 0, 0);       // every row: O = 0, LSE = -inf
    Kokkos::deep_copy(exec, part_lse, -infinity<L>());  // rows outside the piece
    fused_forward_piece(exec, e, pair.split.pieces[0], q, kv, part_o, part_lse, scale);
    widen_result(exec, out_o, out_lse, part_o, part_lse, e.queries);
    pieces = 1;
    return true;
  } else {
    (void)exec, (void)mask, (void)qpos, (void)kpos, (void)e, (void)q, (void)kv, (void)part_o,
        (void)part_lse, (void)out_o, (void)out_lse, (void)scale, (void)guard, (void)pieces;
    return false;
  }
}

/// A distributed backward's own query rows as fused operands, from row 0:
/// Q, O, dO (storage type) and the forward's LSE (fp32, natural log, over
/// every key of the rows). `usable`: their head dims have unit strides.
struct FusedQueryRows {
  FusedTensor q, o, dout, lse;
  bool usable = false;
};

template <class QV, class OV, class DOV, class LV>
FusedQueryRows fused_query_rows(const QV& q, const OV& o, const DOV& dout, const LV& lse) {
  FusedQueryRows r;
  r.usable = unit_head_stride(q, o, dout);
  r.q = fused_rows(q, 0);
  r.o = fused_rows(o, 0);
  r.dout = fused_rows(dout, 0);
  r.lse = fused_lse(lse, 0);
  return r;
}

/// A travelled query slot (another rank's Q, dO, LSE log2 e and D =
/// rowsum(dO o O) in the packed layout, as the Q ring and the balanced
/// helpers carry them: O does not travel) as fused operands, from row 0. A
/// fused backward takes O only to form D itself; it gets a proxy O whose
/// rowsum with dO is the travelled D up to one 16-bit rounding
/// (travelled_operands), in o_proxy (storage V, the slot's dout
/// extents), and the LSE in the natural log in lse (fp32, the slot's lse2
/// extents). Enqueued on exec.
template <class ExecSpace, class T, class MemorySpace, class V, class OP, class LN>
FusedQueryRows fused_travelled_rows(const ExecSpace& exec,
                                    const PackedQueries<T, MemorySpace, V>& slot, int dim,
                                    const OP& o_proxy, const LN& lse) {
  travelled_operands(exec, slot.dout, slot.lse2, slot.drow, dim, o_proxy, lse);
  FusedQueryRows r;
  r.usable = slot.q.stride(3) == 1 && o_proxy.stride(3) == 1;
  r.q = fused_packed_rows(slot.q, 0);
  r.o = fused_packed_rows(o_proxy, 0);
  r.dout = fused_packed_rows(slot.dout, 0);
  r.lse = fused_lse(lse, 0);
  return r;
}

/// The backward of one block pair on the fused path: the queries `rows`
/// (e.queries of them: own, or a travelled slot's) against the K/V block k,
/// v (e.keys rows, storage V). The provider writes each band piece's dQ, dK,
/// dV in the storage type into tq (query rows) and tk, tv (key rows), from
/// the forward's O (or its proxy) and LSE (so a pair's gradients are the
/// exact partials of the whole softmax); they are added, widened, into dq,
/// dk, dv (the pair's sums in the compute type), which are first zeroed
/// unless acc_dq / acc_dkv. Each piece's gradients are thus rounded to 16
/// bits once before the fp32 sum over the pairs (the fused bound:
/// docs/numerics.md). False, nothing done: the pair takes the
/// kernels (no provider, not band pieces in cuDNN's form, a shape or stride
/// the provider declines, or, with `guard` and a mask that hides keys of the
/// pair, inf / NaN in v). `pieces`: the band pieces run.
template <class ExecSpace, class V, class Mask, class QP, class KP, class KV, class VV, class TQ,
          class TK, class GQ, class GK>
bool fused_backward_pair(const ExecSpace& exec, const Mask& mask, const QP& qpos, const KP& kpos,
                         const BlockExtents& e, const FusedQueryRows& rows, const KV& k,
                         const VV& v, const TQ& tq, const TK& tk, const TK& tv, const GQ& dq,
                         const GK& dk, const GK& dv, bool acc_dq, bool acc_dkv, float scale,
                         bool guard, int& pieces) {
  if constexpr (fused_enabled<ExecSpace, V>()) {
    if (!rows.usable || e.queries <= 0 || e.keys <= 0 || !fused_shape_ok(e) ||
        !unit_head_stride(k, v, tq, tk, tv))
      return false;
    const BandSplit split = band_split(mask, qpos, e.queries, kpos, e.keys);
    if (!split.expressible || split.count == 0) return false;
    std::array<FusedBackwardCall, std::tuple_size<decltype(BandSplit::pieces)>::value> calls;
    const std::size_t s = sizeof(V), f = sizeof(float);
    for (int i = 0; i < split.count; ++i) {
      const BandPiece& p = split.pieces[std::size_t(i)];
      if (!cudnn_band(p).supported) return false;
      FusedBackwardCall& c = calls[std::size_t(i)];
      c.p = fused_problem(e, p, fused_type<V>(), scale);
      c.q = fused_offset(rows.q, p.row_begin, s);
      c.o = fused_offset(rows.o, p.row_begin, s);
      c.dout = fused_offset(rows.dout, p.row_begin, s);
      c.lse = fused_offset(rows.lse, p.row_begin, f);
      c.k = fused_rows(k, p.col_begin);
      c.v = fused_rows(v, p.col_begin);
      c.dq = fused_rows(tq, p.row_begin);
      c.dk = fused_rows(tk, p.col_begin);
      c.dv = fused_rows(tv, p.col_begin);
      if (!FusedProvider<ExecSpace, V>::supports(c)) return false;
    }
    if (guard && !pair_covers_all(mask, qpos, e.queries, kpos, e.keys) && has_nonfinite(exec, v))
      return false;
    clear_pair_sums(exec, dq, dk, dv, acc_dq, acc_dkv);
    for (int i = 0; i < split.count; ++i) {
      const BandPiece& p = split.pieces[std::size_t(i)];
      FusedProvider<ExecSpace, V>::run(exec, calls[std::size_t(i)]);
      add_piece_rows(exec, dq, tq, p.row_begin, p.row_end);
      add_piece_rows(exec, dk, tk, p.col_begin, p.col_end);
      add_piece_rows(exec, dv, tv, p.col_begin, p.col_end);
    }
    pieces = split.count;
    return true;
  } else {
    (void)exec, (void)mask, (void)qpos, (void)kpos, (void)e, (void)rows, (void)k, (void)v, (void)tq,
        (void)tk, (void)tv, (void)dq, (void)dk, (void)dv, (void)acc_dq, (void)acc_dkv, (void)scale,
        (void)guard, (void)pieces;
    return false;
  }
}

}  // namespace blockattn::impl
