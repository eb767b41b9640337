// SPDX-License-Identifier: Apache-2.0
// Explicit instantiation of the block product (kernel/block_product.hpp), as
// Kokkos Kernels' ETI: the kernels of a (execution space, mask, position map)
// are compiled once, in one translation unit, and every other translation unit
// that includes the library declares them extern instead of compiling them
// again.
//
// The library's own set (the built-in masks and position maps, every value
// type, the host backends Kokkos enables, or the part of it the build's
// BLOCKATTN_KERNELS_SET selects) is the CMake target BlockAttn::kernels;
// linking it defines BLOCKATTN_PRECOMPILED_KERNELS, which makes
// block_product.hpp declare that set extern (below).
//
// Your own mask or partition, compiled once: in ONE .cpp file of your program
//
//   #include <blockattn/blockattn.hpp>
//   BLOCKATTN_INSTANTIATE_BLOCK_PRODUCT(Kokkos::OpenMP, MyMask, blockattn::OffsetPositions)
//
// and, in a header every other file includes after the library,
//
//   BLOCKATTN_EXTERN_BLOCK_PRODUCT(Kokkos::OpenMP, MyMask, blockattn::OffsetPositions)
//
// (the position map of a partition is its `position_map`; single-device
// calls use blockattn::OffsetPositions). Without the extern line everything
// still works: each file then compiles the kernels it calls, as before.
#pragma once

#include <blockattn/core/half.hpp>
#include <blockattn/kernel/block_product.hpp>
#include <blockattn/policy/document_mask.hpp>
#include <blockattn/policy/mask.hpp>
#include <blockattn/policy/positions.hpp>
#include <blockattn/policy/table_partition.hpp>

// One forward instantiation: compute type T, query storage QS, output storage OS.
#define BLOCKATTN_IMPL_FORWARD_BLOCK(EXT, EXEC, T, QS, OS, MASK, POS)                      \
  EXT template void ::blockattn::impl::forward_block_kernel<EXEC, T, QS, OS, MASK, POS>(   \
      const EXEC&, const ::blockattn::BlockExtents&,                                       \
      const ::blockattn::impl::strided_in4<QS, typename EXEC::memory_space>&,              \
      const ::blockattn::PackedKV<T, typename EXEC::memory_space>&,                        \
      const ::blockattn::impl::strided_out4<OS, typename EXEC::memory_space>&,             \
      const ::blockattn::impl::strided_out3<T, typename EXEC::memory_space>&, const MASK&, \
      const POS&, const POS&, T,                                                           \
      const ::blockattn::ForwardBlockState<T, typename EXEC::memory_space>&);

// One backward instantiation: compute type T, dQ storage QGS, dK/dV storage KGS.
#define BLOCKATTN_IMPL_BACKWARD_BLOCK(EXT, EXEC, T, QGS, KGS, MASK, POS)                     \
  EXT template void ::blockattn::impl::backward_block_kernel<EXEC, T, QGS, KGS, MASK, POS>(  \
      const EXEC&, const ::blockattn::BlockExtents&,                                         \
      const ::blockattn::PackedQueries<T, typename EXEC::memory_space>&,                     \
      const ::blockattn::PackedKeys<T, typename EXEC::memory_space>&,                        \
      const ::blockattn::impl::strided_out4<QGS, typename EXEC::memory_space>&,              \
      const ::blockattn::impl::strided_out4<KGS, typename EXEC::memory_space>&,              \
      const ::blockattn::impl::strided_out4<KGS, typename EXEC::memory_space>&, const MASK&, \
      const POS&, const POS&, T, const ::blockattn::BackwardBlockOptions&,                   \
      ::blockattn::impl::CallBuffers<EXEC>*);

// Every value type: fp64; fp32; bf16 and fp16 storage computed in fp32, with
// fp32 outputs as well (the distributed drivers' partial results).
#define BLOCKATTN_IMPL_BLOCK_PRODUCT(EXT, EXEC, MASK, POS)                                         \
  BLOCKATTN_IMPL_FORWARD_BLOCK(EXT, EXEC, double, double, double, MASK, POS)                       \
  BLOCKATTN_IMPL_FORWARD_BLOCK(EXT, EXEC, float, float, float, MASK, POS)                          \
  BLOCKATTN_IMPL_FORWARD_BLOCK(EXT, EXEC, float, ::blockattn::bf16, ::blockattn::bf16, MASK, POS)  \
  BLOCKATTN_IMPL_FORWARD_BLOCK(EXT, EXEC, float, ::blockattn::bf16, float, MASK, POS)              \
  BLOCKATTN_IMPL_FORWARD_BLOCK(EXT, EXEC, float, ::blockattn::fp16, ::blockattn::fp16, MASK, POS)  \
  BLOCKATTN_IMPL_FORWARD_BLOCK(EXT, EXEC, float, ::blockattn::fp16, float, MASK, POS)              \
  BLOCKATTN_IMPL_BACKWARD_BLOCK(EXT, EXEC, double, double, double, MASK, POS)                      \
  BLOCKATTN_IMPL_BACKWARD_BLOCK(EXT, EXEC, float, float, float, MASK, POS)                         \
  BLOCKATTN_IMPL_BACKWARD_BLOCK(EXT, EXEC, float, ::blockattn::bf16, ::blockattn::bf16, MASK, POS) \
  BLOCKATTN_IMPL_BACKWARD_BLOCK(EXT, EXEC, float, ::blockattn::bf16, float, MASK, POS)             \
  BLOCKATTN_IMPL_BACKWARD_BLOCK(EXT, EXEC, float, ::blockattn::fp16, ::blockattn::fp16, MASK, POS) \
  BLOCKATTN_IMPL_BACKWARD_BLOCK(EXT, EXEC, float, ::blockattn::fp16, float, MASK, POS)

/// Compiles the block product of (EXEC, MASK, POS) for every value type, here.
#define BLOCKATTN_INSTANTIATE_BLOCK_PRODUCT(EXEC, MASK, POS) \
  BLOCKATTN_IMPL_BLOCK_PRODUCT(, EXEC, MASK, POS)
/// Declares it compiled elsewhere (BLOCKATTN_INSTANTIATE_BLOCK_PRODUCT).
#define BLOCKATTN_EXTERN_BLOCK_PRODUCT(EXEC, MASK, POS) \
  BLOCKATTN_IMPL_BLOCK_PRODUCT(extern, EXEC, MASK, POS)

// Linked with BlockAttn::kernels: its set (every built-in mask, both position
// maps the kernels run -- AffinePositions: single device and the contiguous,
// striped and zigzag partitions; TablePositions: TablePartition -- every value
// type, every host backend of this Kokkos, or what the build's
// BLOCKATTN_KERNELS_SET selects of it) is compiled there and declared extern
// here, by a header the build generates (cmake/BlockAttnKernelsSet.cmake).
#if defined(BLOCKATTN_PRECOMPILED_KERNELS) && !defined(BLOCKATTN_COMPILING_KERNELS)
#if __has_include(<blockattn_precompiled_set.hpp>)
#include <blockattn_precompiled_set.hpp>
#else
#error \
    "BlockAttn: BLOCKATTN_PRECOMPILED_KERNELS is set (by linking BlockAttn::kernels), but its generated blockattn_precompiled_set.hpp is not on the include path"
#endif
#endif
