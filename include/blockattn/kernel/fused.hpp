// SPDX-License-Identifier: Apache-2.0
// A vendor's fused attention behind the block product: the call one band
// piece (kernel/band.hpp) makes, as plain pointers and strides, so that the
// vendor library stays out of every translation unit that includes
// BlockAttn's headers.
//
// Providers:
//   cuDNN   Kokkos::Cuda with -DBLOCKATTN_ENABLE_CUDNN (CMake option
//           BLOCKATTN_ENABLE_CUDNN): cuDNN's SDPA through its C++ frontend,
//           compiled once in src/cudnn_attention.cpp (target BlockAttn::cudnn).
//   emulated  host spaces with -DBLOCKATTN_EMULATE_FUSED (tests only): a
//           plain reference with cuDNN's semantics, so that CI runs every
//           path around the vendor call (band pieces, rows no piece covers,
//           merges, counts) without a GPU.
// Both take 16-bit storage (bf16, fp16) with fp32 statistics; fp32 and fp64
// always run on BlockAttn's kernels.
#pragma once

// This header includes no Kokkos (the cuDNN translation unit includes it).

#include <cstdint>
#include <stdexcept>

namespace blockattn {

/// cuDNN's form of a band piece: top-left diagonal alignment (row 0 against
/// key 0), key j seen by row i iff j <= i + right_bound (when has_right) and
/// j > i - left_bound (when has_left, the "sliding window length"). cuDNN 9
/// takes right_bound >= 0 and left_bound >= 1, and a left bound only with a
/// right bound and with no more rows than keys: `supported` says whether
/// this piece fits.
struct CudnnBand {
  bool supported = false;
  bool has_right = false, has_left = false;
  std::int64_t right_bound = 0, left_bound = 0;
};

/// A vendor library's failure (cuDNN's status text in what()).
class vendor_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// How many block pairs each implementation computed (ForwardOptions::paths,
/// RunStats): BlockAttn's kernels, or a vendor's fused attention (in `pieces`
/// band pieces; kernel/band.hpp).
struct BlockPathCounts {
  /// A registered implementation of yours (kernel/block_implementation.hpp).
  std::int64_t user = 0;
  std::int64_t portable = 0;
  std::int64_t fused = 0;
  std::int64_t fused_pieces = 0;
  /// Of `portable`: computed on a matrix engine: the host's (AMX, bf16
  /// forward, 16-bit P) or the GPU's tensor cores (CUDA: 16-bit forward with
  /// 16-bit P; fp32 forward with TF32 products, ForwardOptions::fp32_tensor_cores).
  std::int64_t matrix = 0;
  BlockPathCounts& operator+=(const BlockPathCounts& o) {
    user += o.user;
    portable += o.portable;
    matrix += o.matrix;
    fused += o.fused;
    fused_pieces += o.fused_pieces;
    return *this;
  }
};

/// Which implementation computed a block pair: BlockAttn's kernels (in fp32,
/// or on a matrix engine with 16-bit P: the tensor-core forward on CUDA) or a
/// vendor's fused attention.
enum class BlockPath : int { none = 0, portable = 1, fused = 2, matrix = 3, user = 4 };

/// The storage type of a fused call's Q, K, V, O, dO, dQ, dK, dV.
enum class FusedType : int { bf16 = 0, fp16 = 1 };

/// One operand in (batch, heads, sequence, head dim) order: element strides
/// (the head dim's must be 1).
struct FusedTensor {
  const void* data = nullptr;
  std::int64_t stride[4] = {0, 0, 0, 1};
};

/// The problem of one band piece: queries x keys rows, GQA (heads a
/// multiple of kv_heads), cuDNN's band (kernel/band.hpp), the softmax scale.
struct FusedProblem {
  std::int64_t batch = 0, heads = 0, kv_heads = 0, queries = 0, keys = 0, dim = 0;
  FusedType type = FusedType::bf16;
  CudnnBand band;
  float scale = 1.0f;
};

/// Forward: o (storage type) and lse (fp32, natural log; stride[3] unused)
/// of the piece's rows.
struct FusedForwardCall {
  FusedProblem p;
  FusedTensor q, k, v, o, lse;
  void* stream = nullptr;     // cudaStream_t for cuDNN
  void* workspace = nullptr;  // fused_forward_workspace() bytes
};

/// Backward: dq, dk, dv (storage type, written) of the piece from q, k, v,
/// the forward's o and lse (over every key of the rows, not only the
/// piece's) and dout.
struct FusedBackwardCall {
  FusedProblem p;
  FusedTensor q, k, v, o, dout, lse, dq, dk, dv;
  void* stream = nullptr;
  void* workspace = nullptr;
};

}  // namespace blockattn
