// SPDX-License-Identifier: Apache-2.0
// Tile shapes: the block sizes of the tile kernel and of its register micro tile.
#pragma once

#include <blockattn/config.hpp>
#include <blockattn/impl/micro_gemm.hpp>

#include <type_traits>

namespace blockattn {

/// Block sizes of the forward tile kernel, chosen per value type and per kind
/// of execution space. A team owns one (batch, head, query tile); inside it one
/// thread computes one `micro_rows x micro_cols` register tile at a time.
///
///   block_q     rows of a query tile              (divisible by micro_rows)
///   block_k     rows of a key/value tile          (divisible by micro_cols)
///   micro_rows  rows of a register micro tile
///   micro_cols  columns of a register micro tile  (a multiple of the SIMD width
///               on CPUs); the fast head dims 64 and 128 are multiples of it
///   dim_granule other head dims are padded to a multiple of this (one SIMD
///               vector on CPUs) and use micro tiles this wide for P*V
///   tile_gemm   the policy that computes one micro tile (impl::RegisterTileGemm)
template <class T, bool HostSpace>
struct DefaultTileShape {
  // CPU: 64x64 tiles keep the Q tile, S tile and O accumulator of one team
  // (~ 80 KiB at D = 128, fp32) in L2, and the 4x64 fp32 micro tile is 16
  // AVX-512 accumulators (4x32 for fp64: also 16).
  static constexpr int block_q = 64;
  static constexpr int block_k = 64;
  static constexpr int micro_rows = 4;
  static constexpr int micro_cols = std::is_same<T, float>::value ? 64 : 32;
  static constexpr int dim_granule = std::is_same<T, float>::value ? 16 : 8;
  using tile_gemm = impl::RegisterTileGemm;
};

template <class T>
struct DefaultTileShape<T, false> {
  // GPUs: smaller tiles that fit level-0 scratch, many small micro tiles so
  // that a team has enough threads.
  static constexpr int block_q = 32;
  static constexpr int block_k = 32;
  static constexpr int micro_rows = 2;
  static constexpr int micro_cols = 4;
  static constexpr int dim_granule = 4;
  using tile_gemm = impl::RegisterTileGemm;
};

namespace impl {
template <class ExecSpace>
inline constexpr bool is_host_space_v =
    Kokkos::SpaceAccessibility<ExecSpace, Kokkos::HostSpace>::accessible&&
        std::is_same<typename ExecSpace::memory_space, Kokkos::HostSpace>::value;

template <class Shape>
constexpr void check_tile_shape() {
  static_assert(Shape::block_q % Shape::micro_rows == 0,
                "BlockAttn: tile shape: block_q must be a multiple of micro_rows");
  static_assert(Shape::block_k % Shape::micro_cols == 0,
                "BlockAttn: tile shape: block_k must be a multiple of micro_cols");
  static_assert(Shape::micro_cols % Shape::dim_granule == 0,
                "BlockAttn: tile shape: micro_cols must be a multiple of dim_granule");
}
}  // namespace impl

}  // namespace blockattn
