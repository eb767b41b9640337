// SPDX-License-Identifier: Apache-2.0
// The order in which the tensor-core kernels' CTAs start (cuda/flash_forward.hpp,
// cuda/flash_backward.hpp, cuda/flash_forward_f32.hpp), host and device.
//
// Each kernel runs `blocks` CTAs (query-row or key blocks) for each of
// `units` (batch, head) units, unit = batch * heads + head (for the dK/dV
// kernel, kv heads). A GPU starts a grid's CTAs in the order of their linear
// index (x fastest, then y, then z) as slots free up. Under a causal mask the
// blocks' work differs up to `blocks`-fold, so the order decides how long the
// last CTAs run alone: unit after unit, each with its longest block first
// (the order before this file), the short blocks of one head run beside the
// long ones of the next and the grid ends on long blocks; longest processing
// time first over all units ends on short blocks instead.
//
// The grid: x = the unit within its group, y = the block's rank (0: the
// longest), z = the group; so within a group of `group` consecutive units (a
// GQA group's query heads are consecutive: they share their K and V), all
// its units' longest blocks first, then the next rank. cta_group() puts every
// unit in one group unless that leaves fewer than ~8 running CTAs per unit
// (their K and V reads then stop sharing L2); group = 1 is the old order. A
// last group with fewer units has idle CTAs in each rank (they return at
// once). CUDA's grids stop at 65535 in y and z: more ranks take several
// launches (rank_offset), more groups larger groups.
//
// The kernels used to read their block, head and batch straight from
// blockIdx, which nvcc re-reads where it needs them at no register cost.
// Derived values must be held, so they are derived without a division by a
// run-time value (FastDiv: a multiply and a shift), which nvcc keeps in the
// uniform registers: a division put them in the per-thread registers and
// cost the forward's 64-row variant 32-40 bytes of spills (ptxas, sm_90).
// The kernels' kv head (head / (heads / kv_heads)) the same way (per_kv).
//
// A model of the order (greedy list scheduling, a CTA's time proportional to
// its key tiles; tests/test_flash_frag.cpp): causal, B = 1, H = 16, 128-row
// blocks on 264 slots (an H200 at 2 CTAs per SM): the grid's efficiency
// (work / (slots x makespan)) 0.62, 0.78, 0.89 at N = 4096, 8192, 16384 in
// the old order, 0.99-1.00 in this one; >= 0.96 for 8-128 units, 64- and
// 128-row blocks, 132-528 slots, wherever the grid is over twice the slots.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define BLOCKATTN_CTA_FN __host__ __device__ __forceinline__ constexpr
#else
#define BLOCKATTN_CTA_FN inline constexpr
#endif

namespace blockattn::impl::flash {

/// Division of 0 <= n < 2^31 by a fixed 1 <= d < 2^31 as a multiply and a
/// shift (Granlund and Montgomery, "Division by invariant integers using
/// multiplication", 1994: l = ceil(log2 d), m = ceil(2^(31 + l) / d) < 2^32,
/// n / d = (n m) >> (31 + l), exact for every n < 2^31).
struct FastDiv {
  std::uint32_t m = 0x80000000u;  // d = 1
  int shift = 31;
  FastDiv() = default;
  BLOCKATTN_CTA_FN explicit FastDiv(int d) {
    int l = 0;
    while ((std::uint64_t(1) << l) < std::uint64_t(d)) ++l;
    shift = 31 + l;
    m = std::uint32_t(((std::uint64_t(1) << shift) + std::uint64_t(d) - 1) / std::uint64_t(d));
  }
  BLOCKATTN_CTA_FN int div(int n) const {
    return int((std::uint64_t(std::uint32_t(n)) * m) >> shift);
  }
};

/// A launch's CTA order: set by the host (cta_order()), read by the kernels.
struct CtaOrder {
  int blocks = 1;        // blocks (CTAs) per unit
  int units = 1;         // (batch, head) units
  int group = 1;         // units per group
  int heads = 1;         // units per batch (heads, or kv heads for dK/dV)
  FastDiv per_batch{1};  // division by `heads`
  int rank_offset = 0;   // the first rank of this launch (max_ranks per launch)
  FastDiv per_kv{1};     // division of a query head by heads / kv_heads: its kv head
};

/// Ranks per launch: CUDA's limit of a grid's y.
constexpr int max_ranks = 65535;

/// The block, batch and head a CTA computes; `live` false for the idle CTAs
/// of a last, smaller group (nothing to do).
struct CtaTile {
  int block, batch, head;
  bool live;
};

/// The CTA at grid coordinates (x, y, z) of an order. `longest_last`: rank r
/// is block blocks - 1 - r (causal query blocks: the last rows see the most
/// keys), else block r (causal key blocks of the dK/dV kernel: the first
/// keys are seen by the most rows).
BLOCKATTN_CTA_FN CtaTile cta_tile(const CtaOrder& o, int x, int y, int z, bool longest_last) {
  y += o.rank_offset;
  const int unit = z * o.group + x;
  const int batch = o.per_batch.div(unit);
  return {longest_last ? o.blocks - 1 - y : y, batch, unit - batch * o.heads, unit < o.units};
}

/// The grid of an order's launch (from its rank_offset): its (x, y, z)
/// extents.
struct CtaGrid {
  int x, y, z;
};
BLOCKATTN_CTA_FN CtaGrid cta_grid_extents(const CtaOrder& o) {
  const int ranks = o.blocks - o.rank_offset;
  return {o.group, ranks < max_ranks ? ranks : max_ranks, (o.units + o.group - 1) / o.group};
}

/// The units per group on a GPU that runs `slots` CTAs at once (SMs x CTAs
/// per SM): every unit in one group where at most slots / 8 of them, so that
/// at least ~8 CTAs of each unit run at once and share their K and V reads in
/// L2; otherwise groups of equal size (at most one unit apart) up to that.
/// slots <= 0 (unknown): 1.
inline int cta_group(int units, long long slots) {
  if (units <= 1 || slots <= 0) return 1;
  const long long cap = slots / 8 > 1 ? slots / 8 : 1;
  const long long groups = (units + cap - 1) / cap;
  return int((units + groups - 1) / groups);
}

/// The order of `blocks` CTAs for each of batch x heads units in groups of
/// `group` (>= 1; at least units / 65535, CUDA's limit of a grid's z).
/// False where blocks or units pass 2^31 - 1.
inline bool cta_order(long long blocks, int batch, int heads, int group, CtaOrder& o) {
  if (blocks <= 0 || batch <= 0 || heads <= 0 || blocks > 0x7fffffffLL) return false;
  const long long units = static_cast<long long>(batch) * heads;
  if (units > 0x7fffffffLL) return false;
  o.blocks = int(blocks);
  o.units = int(units);
  o.heads = heads;
  o.per_batch = FastDiv(heads);
  const long long least = (units + 65534) / 65535;
  o.group = int(group < least ? least : group > units ? units : group);
  o.rank_offset = 0;
  return true;
}

}  // namespace blockattn::impl::flash
