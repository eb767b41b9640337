// SPDX-License-Identifier: Apache-2.0
// Which block pairs a vendor's fused attention can compute, and how: the
// mask of a (query block, key block) pair, restricted to the pair's global
// positions, as a few sub-pairs each of which is a band of diagonals in
// local indices (what cuDNN's SDPA expresses with a diagonal alignment and
// left / right bounds).
//
//   const BandSplit s = band_split(mask, qpos, queries, kpos, keys);
//   s.expressible   false: the pair needs our kernels (a mask without band(),
//                   positions that are not affine with one stride, a box
//                   where band() says none)
//   s.pieces        up to four sub-pairs (zigzag's two chunks on each side);
//                   every allowed (row, key) of the pair lies in exactly
//                   one of them, nothing disallowed lies in any, and every
//                   row of a piece sees at least one key of it. Rows in no
//                   piece see no key (O = 0, LSE = -inf).
//
// Host code, decided once per pair before any launch; tests/test_band.cpp
// checks it by brute force against allowed() for every built-in mask and
// partition.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/kernel/fused.hpp>
#include <blockattn/policy/mask.hpp>
#include <blockattn/policy/positions.hpp>

#include <algorithm>
#include <array>
#include <cstdint>
#include <type_traits>

namespace blockattn {

/// A sub-pair of a block pair: local query rows [row_begin, row_end) against
/// local keys [col_begin, col_end); row i sees key j iff
///   lo <= (j - col_begin) - (i - row_begin) <= hi,
/// with lo <= 0 <= hi, -(rows - 1) <= lo and hi <= cols - 1 (every row sees
/// a key, every key is seen).
struct BandPiece {
  index_type row_begin = 0, row_end = 0;
  index_type col_begin = 0, col_end = 0;
  index_type lo = 0, hi = 0;

  index_type rows() const { return row_end - row_begin; }
  index_type cols() const { return col_end - col_begin; }
  /// Every row sees every key of the piece (no mask).
  bool full() const { return lo == -(rows() - 1) && hi == cols() - 1; }
  /// Whether local row i sees local key j (both of the whole pair).
  bool allowed(index_type i, index_type j) const {
    if (i < row_begin || i >= row_end || j < col_begin || j >= col_end) return false;
    const index_type d = (j - col_begin) - (i - row_begin);
    return lo <= d && d <= hi;
  }
};

/// A block pair as band pieces (see the top of this file).
struct BandSplit {
  bool expressible = false;
  int count = 0;
  std::array<BandPiece, 4> pieces{};
  const BandPiece* begin() const { return pieces.data(); }
  const BandPiece* end() const { return pieces.data() + count; }
};

/// cuDNN's form of a band piece (CudnnBand, kernel/fused.hpp).
inline CudnnBand cudnn_band(const BandPiece& p) {
  CudnnBand c;
  if (p.full()) {
    c.supported = true;
    return c;
  }
  c.has_right = true;  // also when only the left edge cuts: cuDNN wants a right bound then
  c.right_bound = p.hi;
  if (p.lo > -(p.rows() - 1)) {
    c.has_left = true;
    c.left_bound = 1 - p.lo;  // j - i >= lo  <=>  j > i - (1 - lo)
  }
  c.supported = c.right_bound >= 0 && (!c.has_left || (c.left_bound >= 1 && p.rows() <= p.cols()));
  return c;
}

namespace impl {

/// An affine run of a position map: local rows [begin, end) at positions
/// first + stride * (i - begin).
struct AffineRun {
  index_type begin = 0, end = 0, first = 0, stride = 1;
};

/// The affine runs of a position map over rows [0, n): up to two for the
/// built-in maps (canonical_positions gives AffinePositions), none for
/// others (count = -1: not affine).
struct AffineRuns {
  int count = -1;
  std::array<AffineRun, 2> run{};
};

template <class P>
AffineRuns affine_runs(const P& pos, index_type n) {
  AffineRuns r;
  using C = std::decay_t<decltype(canonical_positions(pos))>;
  if constexpr (std::is_same<C, AffinePositions>::value) {
    const AffinePositions a = canonical_positions(pos);
    r.count = 0;
    const index_type split = std::min(std::max(a.split, index_type(0)), n);
    if (split > 0) r.run[r.count++] = AffineRun{0, split, a.first, a.stride};
    if (split < n) r.run[r.count++] = AffineRun{split, n, a.second, a.stride};
  } else {
    (void)pos;
    (void)n;
  }
  return r;
}

/// floor(a / b), ceil(a / b) for b > 0.
inline index_type floor_div(index_type a, index_type b) {
  const index_type q = a / b;
  return (a % b != 0 && a < 0) ? q - 1 : q;
}
inline index_type ceil_div(index_type a, index_type b) {
  const index_type q = a / b;
  return (a % b != 0 && a > 0) ? q + 1 : q;
}

/// Normalises rows [r0, r0 + rows) x keys [c0, c0 + cols) with band
/// lo <= j - i <= hi (local to the piece) into a BandPiece: rows and keys
/// that see nothing are cut off. False when nothing is left.
inline bool normalise_piece(index_type r0, index_type rows, index_type c0, index_type cols,
                            index_type lo, index_type hi, BandPiece& out) {
  if (rows <= 0 || cols <= 0) return false;
  lo = std::max(lo, -(rows - 1));
  hi = std::min(hi, cols - 1);
  if (lo > hi) return false;
  if (hi < 0) {  // the first -hi rows see no key
    r0 -= hi;
    rows += hi;
    lo -= hi;
    hi = 0;
  }
  if (lo > 0) {  // the first lo keys are seen by no row
    c0 += lo;
    cols -= lo;
    hi -= lo;
    lo = 0;
  }
  if (rows <= 0 || cols <= 0) return false;
  rows = std::min(rows, cols - lo);  // row i sees a key iff i + lo <= cols - 1
  cols = std::min(cols, rows + hi);  // key j is seen iff j - hi <= rows - 1
  out = BandPiece{r0, r0 + rows, c0, c0 + cols, std::max(lo, -(rows - 1)), std::min(hi, cols - 1)};
  return true;
}

/// The whole sub-pair as one full piece.
inline BandPiece full_piece(index_type r0, index_type r1, index_type c0, index_type c1) {
  return BandPiece{r0, r1, c0, c1, -(r1 - r0 - 1), c1 - c0 - 1};
}

}  // namespace impl

/// The pair of `queries` rows at qpos(i) and `keys` keys at kpos(j) under
/// `mask`, as band pieces (see the top of this file).
template <class Mask, class QPos, class KPos>
BandSplit band_split(const Mask& mask, const QPos& qpos, index_type queries, const KPos& kpos,
                     index_type keys) {
  BandSplit s;
  s.expressible = true;
  if (queries <= 0 || keys <= 0) return s;
  const TileKind whole = mask.classify(qpos(0), qpos(queries - 1) + 1, kpos(0), kpos(keys - 1) + 1);
  if (whole == TileKind::empty) return s;
  if (whole == TileKind::full) {
    s.pieces[s.count++] = impl::full_piece(0, queries, 0, keys);
    return s;
  }
  const impl::AffineRuns qr = impl::affine_runs(qpos, queries), kr = impl::affine_runs(kpos, keys);
  if (qr.count < 0 || kr.count < 0) return BandSplit{};
  for (int a = 0; a < qr.count; ++a)
    for (int b = 0; b < kr.count; ++b) {
      const impl::AffineRun& q = qr.run[a];
      const impl::AffineRun& k = kr.run[b];
      const index_type rows = q.end - q.begin, cols = k.end - k.begin;
      const index_type q_end = q.first + q.stride * (rows - 1) + 1;
      const index_type k_end = k.first + k.stride * (cols - 1) + 1;
      const TileKind kind = mask.classify(q.first, q_end, k.first, k_end);
      if (kind == TileKind::empty) continue;
      if (kind == TileKind::full) {
        s.pieces[s.count++] = impl::full_piece(q.begin, q.end, k.begin, k.end);
        continue;
      }
      // A partial box: needs band() and one stride on both sides (then
      // k - q = (k.first - q.first) + stride * ((j - k.begin) - (i - q.begin))).
      if constexpr (impl::has_band<Mask>::value) {
        // (One row or one key: only the other side's stride matters.)
        if (rows > 1 && cols > 1 && q.stride != k.stride) return BandSplit{};
        const index_type s0 = rows == 1 ? k.stride : q.stride;
        const MaskBand mb = mask.band(q.first, q_end, k.first, k_end);
        if (!mb.is_band) return BandSplit{};
        const index_type d0 = k.first - q.first;  // |d0| < 2^63: positions are within 2^62
        // Bounds beyond +-(rows + cols) * stride cut nothing: clamp before dividing.
        const index_type reach =
            impl::saturating_add(rows * s0, impl::saturating_add(cols * s0, s0));
        const auto clamp = [&](index_type bound, index_type inf) {
          if (bound == inf) return inf < 0 ? -reach : reach;
          return std::min(std::max(impl::saturating_add(bound, -d0), -reach), reach);
        };
        const index_type lo = impl::ceil_div(clamp(mb.lo, INT64_MIN), s0);
        const index_type hi = impl::floor_div(clamp(mb.hi, INT64_MAX), s0);
        BandPiece p;
        if (impl::normalise_piece(q.begin, rows, k.begin, cols, lo, hi, p)) s.pieces[s.count++] = p;
      } else {
        return BandSplit{};
      }
    }
  return s;
}

}  // namespace blockattn
