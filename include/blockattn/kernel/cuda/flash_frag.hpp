// SPDX-License-Identifier: Apache-2.0
// The index maths of the tensor-core kernels (cuda/flash_forward.hpp,
// cuda/flash_backward.hpp, cuda/flash_forward_f32.hpp), host and device: the
// swizzled shared-memory tile, the row and 16-byte chunk each lane hands to
// ldmatrix, and the fragment layouts of mma.sync.m16n8k16 (16-bit) and
// m16n8k8 (.tf32, at the end). tests/test_flash_frag.cpp checks them on the
// host against a lane-by-lane model of ldmatrix and mma (PTX ISA, "Matrix
// fragments for mma.m16n8k16" and "... m16n8k8"), so an index slip shows
// without a GPU.
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

// ---- fp32 tiles and mma.sync.m16n8k8 (.tf32): cuda/flash_forward_f32.hpp ----------
//
// Layouts (g = lane / 4, t = lane % 4), one 32-bit value per register:
//   A (16 x 8):  a[0] = (row g, col t), a[1] = (g + 8, t), a[2] = (g, t + 4),
//                a[3] = (g + 8, t + 4);
//   B (8 x 8):   b[0] = (k t, n g), b[1] = (k t + 4, n g);
//   C (16 x 8):  as m16n8k16's (c_row, c_col).
// ldmatrix (.b16) of 32-bit values: a 16-byte row is 4 values, and register i
// of lane L holds matrix i's (row g, value t). So ldsm_a's lanes give a[0..3]
// of a 16 x 8 block (two chunks) and ldsm_b's give b[0], b[1] of two n-tiles
// of a tile stored n-major: Q K^T needs no other helper.

/// Offset (in values) of (row, 16-byte chunk) in a swizzled tile of D fp32
/// columns: chunk ^ (row & 7), as swz.
template <int D>
BLOCKATTN_FRAG_FN int swz32(int row, int chunk) {
  return row * D + ((chunk ^ (row & 7)) << 2);
}

/// Offset of a lane's ldmatrix row in a swizzled fp32 tile: the 16-row,
/// two-chunk (8-value) block at (row0, chunk0).
template <int D>
BLOCKATTN_FRAG_FN int frag32_offset(RowChunk rc, int row0, int chunk0) {
  return swz32<D>(row0 + rc.row, chunk0 + rc.chunk);
}

/// P V in fp32 without shuffles: a k-step takes the 8 keys of one n-tile of
/// P's C fragments, and the k index runs over them in the order of the C
/// layout (k t is key 2t, k t + 4 is key 2t + 1), so A register i is C
/// element c2a32(i) of the same lane, and B register i is V at key
/// pv32_key(lane, i) of the step, column pv32_col(lane) of the n-tile (read
/// by one 32-bit load: .trans of ldmatrix moves 16-bit halves, not values).
BLOCKATTN_FRAG_FN int c2a32(int i) {
  return ((i & 1) << 1) | (i >> 1);
}
BLOCKATTN_FRAG_FN int pv32_key(int lane, int i) {
  return 2 * (lane % 4) + i;
}
BLOCKATTN_FRAG_FN int pv32_col(int lane) {
  return lane / 4;
}

/// Offset of B register i of a lane for the k-step of keys key0 .. key0 + 7
/// and the n-tile of columns col0 .. col0 + 7 (key0, col0 multiples of 8) in
/// a swizzled fp32 tile stored k-major (V: keys x head dims).
template <int D>
BLOCKATTN_FRAG_FN int pv32_offset(int lane, int i, int key0, int col0) {
  return swz32<D>(key0 + pv32_key(lane, i), (col0 + pv32_col(lane)) >> 2) +
         ((col0 + pv32_col(lane)) & 3);
}

}  // namespace blockattn::impl::flash

#undef BLOCKATTN_FRAG_FN
