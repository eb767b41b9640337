// SPDX-License-Identifier: Apache-2.0
// Work accounting on the host: what the tile classifier makes a kernel do.
// Uses the same mask policy and tile sizes as the kernels, so the counts are
// exact, not estimates.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/policy/mask.hpp>
#include <blockattn/policy/positions.hpp>

namespace blockattn {

/// Tiles of one (query block x key block) product, and the query-key pairs the
/// mask allows in it.
struct TileCounts {
  std::int64_t full = 0;     // computed without evaluating the mask
  std::int64_t partial = 0;  // computed, mask evaluated per element
  std::int64_t skipped = 0;  // classified empty: never loaded
  std::int64_t allowed_pairs = 0;

  std::int64_t computed() const { return full + partial; }
  std::int64_t total() const { return full + partial + skipped; }
  TileCounts& operator+=(const TileCounts& o) {
    full += o.full;
    partial += o.partial;
    skipped += o.skipped;
    allowed_pairs += o.allowed_pairs;
    return *this;
  }
};

/// Counts the tiles of an (nq x nk) block cut into (block_q x block_k) tiles,
/// for one (batch, head). Positions come from the maps, as in the kernels.
/// Counting allowed pairs evaluates the mask on every pair of partial tiles;
/// count_pairs = false skips that (allowed_pairs then counts full tiles only).
template <class Mask, class QPos = OffsetPositions, class KPos = OffsetPositions>
TileCounts count_tiles(const Mask& mask, index_type nq, index_type nk, int block_q, int block_k,
                       const QPos& qpos = {}, const KPos& kpos = {}, bool count_pairs = true) {
  impl::check_mask_policy<Mask>();
  TileCounts c;
  for (index_type q0 = 0; q0 < nq; q0 += block_q) {
    const index_type q1 = q0 + block_q < nq ? q0 + block_q : nq;
    for (index_type k0 = 0; k0 < nk; k0 += block_k) {
      const index_type k1 = k0 + block_k < nk ? k0 + block_k : nk;
      switch (mask.classify(qpos(q0), qpos(q1 - 1) + 1, kpos(k0), kpos(k1 - 1) + 1)) {
        case TileKind::empty:
          ++c.skipped;
          break;
        case TileKind::full:
          ++c.full;
          c.allowed_pairs += (q1 - q0) * (k1 - k0);
          break;
        case TileKind::partial:
          ++c.partial;
          if (count_pairs)
            for (index_type i = q0; i < q1; ++i) {
              const impl::RowMask<Mask> allow(mask, qpos(i), true);
              for (index_type j = k0; j < k1; ++j) c.allowed_pairs += allow(kpos(j));
            }
          break;
      }
    }
  }
  return c;
}

/// FLOPs of a forward over the allowed pairs: 4 * D per pair (Q K^T and P V),
/// the FlashAttention convention.
inline double forward_flops(std::int64_t allowed_pairs, int head_dim) {
  return 4.0 * double(allowed_pairs) * double(head_dim);
}

}  // namespace blockattn
