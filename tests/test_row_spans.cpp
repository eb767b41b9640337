// SPDX-License-Identifier: Apache-2.0
// Host-only: the key-tile kinds the GPU tensor-core kernels take from their
// query rows' intervals (kernel/cuda/row_spans.hpp), by brute force against
// allowed() for every built-in mask with allowed_keys() and several position
// maps: a tile called full has every pair allowed, a tile called empty none;
// with contiguous rows and keys the kinds are exact (nothing allowed: empty,
// everything: full). Bounds reduced in pieces (as the kernels' warps do)
// equal the bounds of all rows at once.
#include <doctest/doctest.h>

#include <blockattn/kernel/cuda/row_spans.hpp>
#include <blockattn/policy/document_mask.hpp>
#include <blockattn/policy/mask.hpp>
#include <blockattn/policy/positions.hpp>

#include <vector>

using namespace blockattn;
using impl::RowSpanBounds;

namespace {

struct Count {
  long blocks = 0, full = 0, empty = 0, partial = 0;
};

/// Every block of `rows` query rows against every tile of `cols` keys.
template <class Mask, class QPos, class KPos>
void check_mask(const Mask& mask, const QPos& qpos, index_type nq, const KPos& kpos, index_type nk,
                int rows, int cols, bool exact, bool check_rows, Count& c) {
  static_assert(impl::has_allowed_keys<Mask>::value, "a mask with allowed_keys()");
  for (index_type q0 = 0; q0 < nq; q0 += rows) {
    const index_type q1 = q0 + rows < nq ? q0 + rows : nq;
    RowSpanBounds all = RowSpanBounds::none(), pieces = RowSpanBounds::none();
    for (index_type p0 = q0; p0 < q1; p0 += 16) {  // "warps" of 16 rows
      RowSpanBounds part = RowSpanBounds::none();
      for (index_type r = p0; r < q1 && r < p0 + 16; ++r) {
        const KeyInterval iv = mask.allowed_keys(qpos(r));
        all.add(iv);
        part.add(iv);
        if (check_rows) {  // the interval is the row's mask, as KeySpanTest applies it
          const impl::KeySpanTest test{iv.begin, iv.end};
          for (index_type k = 0; k < nk; ++k)
            REQUIRE(test(kpos(k)) == bool(mask.allowed(qpos(r), kpos(k))));
        }
      }
      pieces.merge(part);
    }
    REQUIRE(pieces.lo == all.lo);
    REQUIRE(pieces.hi == all.hi);
    REQUIRE(pieces.all_lo == all.all_lo);
    REQUIRE(pieces.all_hi == all.all_hi);
    for (index_type k0 = 0; k0 < nk; k0 += cols) {
      const index_type k1 = k0 + cols < nk ? k0 + cols : nk;
      long seen = 0;
      for (index_type r = q0; r < q1; ++r)
        for (index_type k = k0; k < k1; ++k) seen += mask.allowed(qpos(r), kpos(k)) ? 1 : 0;
      const long box = long((q1 - q0) * (k1 - k0));
      const TileKind kind = all.kind(kpos(k0), kpos(k1 - 1));
      ++c.blocks;
      if (kind == TileKind::full) {
        ++c.full;
        INFO("q [", q0, ", ", q1, ") k [", k0, ", ", k1, ")");
        REQUIRE(seen == box);
      } else if (kind == TileKind::empty) {
        ++c.empty;
        INFO("q [", q0, ", ", q1, ") k [", k0, ", ", k1, ")");
        REQUIRE(seen == 0);
      } else {
        ++c.partial;
        if (exact) {
          INFO("q [", q0, ", ", q1, ") k [", k0, ", ", k1, "): ", seen, " of ", box);
          REQUIRE(seen > 0);
          REQUIRE(seen < box);
        }
      }
    }
  }
}

/// One mask under contiguous maps (exact), offsets, strided and two-piece
/// (zigzag-like) maps, at the kernels' block shapes and smaller ones.
template <class Mask>
Count check_maps(const Mask& mask, index_type n) {
  Count c;
  for (const int rows : {128, 64, 16, 5})
    for (const int cols : {64, 7}) {
      const bool first = rows == 128 && cols == 64;
      const OffsetPositions at0{0}, at_mid{n / 3};
      check_mask(mask, at0, n, at0, n, rows, cols, true, first, c);
      check_mask(mask, at_mid, n - n / 3, at0, n, rows, cols, false, first, c);
      const StridedPositions sq{1, 3}, sk{0, 3};
      check_mask(mask, sq, n / 3, sk, n / 3, rows, cols, false, first, c);
      const AffinePositions zq{n / 4, 0, n - n / 4, 1}, zk{n / 4, n / 4, n / 2, 1};
      check_mask(mask, zq, n / 2, zk, n / 2, rows, cols, false, first, c);
    }
  return c;
}

}  // namespace

TEST_CASE("row spans: tile kinds of the built-in masks with allowed_keys") {
  const index_type n = 300;
  Count total;
  auto add = [&](const Count& c) {
    CHECK(c.partial > 0);
    total.blocks += c.blocks;
    total.full += c.full;
    total.empty += c.empty;
    total.partial += c.partial;
  };
  add(check_maps(CausalMask{}, n));
  add(check_maps(causal_window(33), n));
  add(check_maps(SlidingWindowMask{20, 7}, n));
  add(check_maps(SlidingWindowMask{0, 0}, n));
  add(check_maps(PrefixLMMask{70}, n));
  // Documents [10, 15), [15, 16), [16, 90), [90, 213), [213, 280): positions
  // before 10 and from 280 on belong to none.
  const std::vector<index_type> off{10, 15, 16, 90, 213, 280};
  DocumentMask dm;
  dm.host_offsets = off.data();
  dm.documents = int(off.size()) - 1;
  add(check_maps(dm, n));
  dm.causal = false;
  add(check_maps(dm, n));
  dm.left = 9;
  dm.right = 4;
  add(check_maps(dm, n));
  dm.causal = true;
  add(check_maps(dm, n));
  CHECK(total.empty > 0);
  CHECK(total.full > 0);
  MESSAGE("row spans: ", total.blocks, " tiles (", total.full, " full, ", total.empty, " empty, ",
          total.partial, " partial)");
}

TEST_CASE("row spans: bounds of rows that see nothing") {
  RowSpanBounds b = RowSpanBounds::none();
  CHECK(b.kind(0, 10) == TileKind::empty);  // no rows
  b.add(KeyInterval{5, 5});                 // a row that sees nothing
  CHECK(b.kind(0, 10) == TileKind::empty);
  b.add(KeyInterval{0, 20});
  CHECK(b.kind(0, 10) == TileKind::partial);  // one row sees it, the other not
  CHECK(b.kind(20, 30) == TileKind::empty);
  RowSpanBounds c = RowSpanBounds::none();
  c.add(KeyInterval{INT64_MIN, INT64_MAX});
  CHECK(c.kind(INT64_MIN, INT64_MAX - 1) == TileKind::full);
}
