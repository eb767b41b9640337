// SPDX-License-Identifier: Apache-2.0
// The index maths of the tensor-core kernels (cuda_flash.hpp,
// cuda_flash_backward.hpp), host and device: the swizzled shared-memory tile,
// the row and 16-byte chunk each lane hands to ldmatrix, and the fragment
// layouts of mma.sync.m16n8k16. tests/test_flash_frag.cpp checks them on the
// host against a lane-by-lane model of ldmatrix and mma (PTX ISA, "Matrix
// fragments for mma.m16n8k16"), so an index slip shows without a GPU.
//
// Layouts (g = lane / 4, t = lane % 4):
//   A (16 x 16, row-major): a[0] = (row g, cols 2t, 2t+1), a[1] = (g + 8, 2t..),
//                           a[2] = (g, 2t + 8..), a[3] = (g + 8, 2t + 8..);
//   B (16 x 8, k x n):      b[0] = (k 2t, 2t+1; n g), b[1] = (k 2t + 8..; n g);
//   C (16 x 8, fp32):       c[e] = (row g + 8 (e / 2), col 2t + e % 2).
// ldmatrix .x4: lanes 8i .. 8i + 7 give the row addresses of 8 x 8 matrix i;
// register i of lane L holds matrix i's (row g, cols 2t, 2t+1), or with
// .trans (rows 2t, 2t+1, col g).
#pragma once

#if defined(__CUDACC__)
#define BLOCKATTN_FRAG_FN __host__ __device__ __forceinline__ constexpr
#else
#define BLOCKATTN_FRAG_FN inline constexpr
#endif

namespace blockattn::impl::flash {

/// Element offset of (row, 16-byte chunk) in a swizzled tile of D 16-bit
/// columns: chunk ^ (row & 7), so that the 8 rows one ldmatrix matrix reads
/// lie in 8 different 16-byte bank groups.
template <int D>
BLOCKATTN_FRAG_FN int swz(int row, int chunk) {
  return row * D + ((chunk ^ (row & 7)) << 3);
}

/// A lane's row and 16-byte chunk, relative to a 16 x 16 block of a tile.
struct RowChunk {
  int row, chunk;
};

/// A operand (16 rows x 16 columns of a row-major tile, e.g. Q rows x head
/// dims): matrices (rows 0-7, chunk 0), (8-15, 0), (0-7, 1), (8-15, 1) give
/// a[0..3].
BLOCKATTN_FRAG_FN RowChunk ldsm_a(int lane) {
  return {lane & 15, lane >> 4};
}

/// B operands of two n-tiles from a tile stored n-major ([n][k] row-major,
/// e.g. K rows = keys x head dims for Q K^T): matrices (n 0-7, chunk 0),
/// (0-7, 1), (8-15, 0), (8-15, 1) give b[0], b[1] of n-tile 0, then of n-tile 1.
BLOCKATTN_FRAG_FN RowChunk ldsm_b(int lane) {
  return {(lane & 7) + ((lane >> 4) << 3), (lane >> 3) & 1};
}

/// The same from a tile stored k-major ([k][n] row-major, e.g. V rows = keys
/// x head dims for P V), by ldmatrix .trans: matrices (k 0-7, chunk 0),
/// (8-15, 0), (0-7, 1), (8-15, 1).
BLOCKATTN_FRAG_FN RowChunk ldsm_bt(int lane) {
  return {(lane & 7) + (((lane >> 3) & 1) << 3), lane >> 4};
}

/// Offset of a lane's ldmatrix row in a swizzled tile: the 16 x 16 block at
/// (row0, chunk0).
template <int D>
BLOCKATTN_FRAG_FN int frag_offset(RowChunk rc, int row0, int chunk0) {
  return swz<D>(row0 + rc.row, chunk0 + rc.chunk);
}

/// Row and column of element e of a lane's C fragment (16 x 8).
BLOCKATTN_FRAG_FN int c_row(int lane, int e) {
  return lane / 4 + 8 * (e >> 1);
}
BLOCKATTN_FRAG_FN int c_col(int lane, int e) {
  return 2 * (lane % 4) + (e & 1);
}

/// C fragments as an A fragment (P, dS as the left operand of the next
/// product): register i of the A fragment of k-step ks packs elements
/// c2a_elem(i), c2a_elem(i) + 1 of n-tile 2 ks + c2a_ntile(i).
BLOCKATTN_FRAG_FN int c2a_ntile(int i) {
  return i >> 1;
}
BLOCKATTN_FRAG_FN int c2a_elem(int i) {
  return (i & 1) * 2;
}

}  // namespace blockattn::impl::flash

#undef BLOCKATTN_FRAG_FN
