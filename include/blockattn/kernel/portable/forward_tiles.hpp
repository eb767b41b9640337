// SPDX-License-Identifier: Apache-2.0
// How the portable forward kernel (forward_kernel.hpp) cuts a block pair: the
// query tiles of each (batch, head), the packed K/V block's panels, and
// whether a launch takes the AMX path.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/kernel/host/amx.hpp>
#include <blockattn/kernel/impl/pack.hpp>
#include <blockattn/kernel/tile_shape.hpp>
#include <blockattn/kernel/validate.hpp>

#include <type_traits>

namespace blockattn::impl {

/// Sizes of one forward problem (kernel/validate.hpp).
using ForwardExtents = BlockExtents;

/// How a forward launch cuts the queries of each (batch, head) into team
/// tiles: tile qt holds the row groups (micro_rows rows each, or `granule`)
/// [qt * groups / tiles, (qt + 1) * groups / tiles), the last one clipped to
/// the queries. `tiles` = 0 means tiles of block_q rows (`rows`); `even`
/// spreads all groups over `tiles` tiles whose heights differ by at most one
/// group. Every tile holds at most block_q rows (checked at the launch).
struct QueryTiles {
  int tiles = 0;    // per (batch, head); 0: tiles of block_q rows
  int groups = 0;   // row groups spread over the tiles
  int granule = 0;  // rows per group; 0: the kernel's micro_rows

  /// Tiles of `rows` rows (a multiple of micro_rows; the last one partial).
  static QueryTiles rows(int queries, int rows, int micro_rows) {
    const int t = (queries + rows - 1) / rows;
    return {t, t * (rows / micro_rows)};
  }
  /// `tiles` tiles of (nearly) equal height.
  static QueryTiles even(int queries, int tiles, int micro_rows) {
    return {tiles, (queries + micro_rows - 1) / micro_rows};
  }
  /// The concrete split of `queries` queries (resolves tiles = 0).
  QueryTiles resolved(int queries, int block_q, int micro_rows) const {
    return tiles > 0 ? *this : rows(queries, block_q, micro_rows);
  }
  /// The same split in groups of `rows` rows (the matrix engine's 32-row blocks).
  QueryTiles with_granule(int rows) const {
    QueryTiles t = *this;
    if (t.tiles > 0) t.granule = rows;
    return t;
  }
  /// Rows per group for a kernel whose micro tiles have micro_rows rows.
  KOKKOS_INLINE_FUNCTION int rows_per_group(int micro_rows) const {
    return granule > 0 ? granule : micro_rows;
  }
  /// First query row of tile qt, and one past its last.
  KOKKOS_INLINE_FUNCTION int begin(int qt, int micro_rows) const {
    return rows_per_group(micro_rows) * static_cast<int>(std::int64_t(qt) * groups / tiles);
  }
  KOKKOS_INLINE_FUNCTION int end(int qt, int micro_rows, int queries) const {
    const int stop = begin(qt + 1, micro_rows);
    return stop < queries ? stop : queries;
  }
};

/// Width of the forward's P*V micro tile, and so of the packed V panels: the
/// full micro tile for the compile-time head dims, one granule otherwise.
template <class Shape, int StaticD>
inline constexpr int forward_v_panel = StaticD > 0 ? Shape::micro_cols : Shape::dim_granule;

/// How the forward kernel of Shape and StaticD in MemorySpace reads a packed
/// K/V block: keys per K^T panel (`kt`) and head-dim columns per V panel (`v`).
///  - Host spaces: a panel is as wide as the micro tile that reads it, so one
///    thread's micro tile streams one contiguous panel (4c5ef8f).
///  - Devices: one panel spans the tile, K^T (dim_padded x block_k) and V
///    (block_k x dim_padded) row-major. The threads of a team take adjacent
///    micro tiles, so adjacent threads then read adjacent values of one row
///    (coalesced); with micro-tile panels they read values dim_padded x
///    micro_cols apart, and the forward ran 4.2-4.5x slower on an H100 (fp32,
///    D = 128: 1.25-1.47 against 5.2-6.6 TFLOP/s).
template <class MemorySpace, class Shape, int StaticD>
struct ForwardPanels {
  static constexpr bool host = std::is_same<MemorySpace, Kokkos::HostSpace>::value;
  static constexpr int kt = host ? Shape::micro_cols : Shape::block_k;
  KOKKOS_INLINE_FUNCTION static constexpr int v(int dim_padded) {
    return host ? forward_v_panel<Shape, StaticD> : dim_padded;
  }
};

/// A packed K/V block (PackedKV) laid out for the forward kernel of Shape and
/// StaticD in MemorySpace (ForwardPanels).
template <class T, class MemorySpace, class Shape, int StaticD, class Buffers = NoCallBuffers>
PackedKV<T, MemorySpace> allocate_forward_kv(int batch, int kv_heads, int keys, int dim_padded,
                                             Buffers* buffers = nullptr) {
  using Panels = ForwardPanels<MemorySpace, Shape, StaticD>;
  return allocate_packed_kv<T, MemorySpace>(batch, kv_heads, keys, dim_padded, Shape::block_k,
                                            Panels::kt, Panels::v(dim_padded), buffers);
}

/// Whether the forward kernel of (ExecSpace, T, Shape) with queries stored as
/// QS has the AMX path (run_amx): bf16 inputs on a host space whose kernels
/// are the AVX-512 ones, query and key tiles of whole 32-row blocks.
template <class ExecSpace, class T, class Shape, class QS>
inline constexpr bool forward_amx_capable =
    BLOCKATTN_HOST_AMX&& kernel_isa_v<ExecSpace, Shape> ==
        HostIsa::avx512&& std::is_same<T, float>::value&& std::is_same<QS, bf16>::value&&
                Shape::block_q %
            32 ==
        0 &&
    Shape::block_k % 32 == 0;

}  // namespace blockattn::impl
