// SPDX-License-Identifier: Apache-2.0
// Tile shapes: the block sizes of the tile kernel and of its register micro tile.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/kernel/isa.hpp>

#include <type_traits>

namespace blockattn {

namespace impl {

/// The default tile-product policy (defined in kernel/portable/micro_gemm.hpp,
/// which the kernels include): the register micro kernel for host ISA Isa.
template <HostIsa Isa = host_isa>
struct RegisterTileGemmFor;
using RegisterTileGemm = RegisterTileGemmFor<>;

/// Host tile constants per vector ISA (isa.hpp), value type and compile-time
/// head dim (0: any other). See DefaultTileShape for what each one means.
///
/// The default (fp64 on every ISA, and the portable kernels): 64x64 tiles keep
/// the Q tile, S tile and O accumulator of one team in L2, and the 4x32 fp64
/// micro tile is 16 AVX-512 accumulators.
template <HostIsa Isa, class T, int HeadDim>
struct HostTiles {
  static constexpr int block_q = 64;
  static constexpr int block_k = 64;
  static constexpr int micro_rows = 4;
  static constexpr int micro_cols = std::is_same<T, float>::value ? 64 : 32;
  static constexpr int dim_granule = std::is_same<T, float>::value ? 16 : 8;
};

/// AVX2 + FMA (16 registers of 8 floats): the BLIS-style 6x16 fp32 micro tile
/// (12 accumulators, 2 B vectors, 1 broadcast) run by the explicit kernels of
/// host/micro_gemm_simd.hpp, in 96x128 tiles for every head dim. On a Zen 3
/// EPYC (1 thread, full mask): 96 query rows match 48 at N = 1024 and beat
/// them by ~15 % at N = 16384 (each K/V tile is streamed from L3 half as
/// often), 192 rows lose ~8 % at N = 1024 (a partial last tile) and gain
/// ~8 % at N = 16384; 128 vs 256 keys made no difference.
template <int HeadDim>
struct HostTiles<HostIsa::avx2, float, HeadDim> {
  static constexpr int block_q = 96;
  static constexpr int block_k = 128;
  static constexpr int micro_rows = 6;
  static constexpr int micro_cols = 16;
  static constexpr int dim_granule = 16;
};

/// AVX-512F, fp32 (32 registers of 16 floats): 6x64 micro tiles (24
/// accumulators, 4 B vectors, 1 broadcast) run by the explicit 512-bit kernels
/// of host/micro_gemm_simd.hpp, in the AVX2 96x128 tiles for every head dim. On a
/// 16-core Sapphire Rapids Xeon (1 and 16 threads, N = 1024 / 4096 / 16384)
/// this ran ~1.8x the portable loops; 12x32 and 6x32 micro tiles, 48- and
/// 192-row query tiles and 256-key tiles were no faster (docs/history/measurements.md).
template <int HeadDim>
struct HostTiles<HostIsa::avx512, float, HeadDim> : HostTiles<HostIsa::avx2, float, 0> {
  static constexpr int micro_cols = 64;
};

// AVX2, fp64: the default shape and the portable kernel, unchanged, so that
// fp64 results stay bitwise those of earlier releases (a 4x8 fp64 AVX2 tile
// changed the last bits for head dims other than 64 and 128); fp64 is the
// accuracy path, not the speed path.

/// SSE2 (x86-64 baseline, 16 x 128-bit registers): 6x8 fp32 micro tiles
/// (12 accumulators), the 128-bit kernel of host/micro_gemm_simd.hpp, the
/// AVX2 block sizes.
template <int HeadDim>
struct HostTiles<HostIsa::sse2, float, HeadDim> : HostTiles<HostIsa::avx2, float, 0> {
  static constexpr int micro_cols = 8;
  static constexpr int dim_granule = 8;
};

/// AArch64 NEON (32 x 128-bit registers): 6x16 fp32 micro tiles (24
/// accumulators, as AVX-512's 6x64 uses 24 of 32), the 128-bit kernel, the
/// AVX2 block sizes. Not measured: no Arm machine was available.
template <int HeadDim>
struct HostTiles<HostIsa::neon, float, HeadDim> : HostTiles<HostIsa::avx2, float, 0> {};

/// Backward tiles (one shape for every head dim; the key tile is also cut into
/// micro_rows-row micro tiles there, so block_k % micro_rows == 0).
template <HostIsa Isa, class T>
struct HostBackwardTiles : HostTiles<Isa, T, 0> {};

/// fp32 48x96 with the ISA's forward micro tiles: on AVX2 (6x16; of 48/96
/// query rows x 48/96/192 keys on Zen 3, the one within noise of the best at
/// N = 1024 and 16384, D = 64 and 128), and on SSE2 and NEON.
template <HostIsa Isa>
struct HostBackwardTiles48x96 : HostTiles<Isa, float, 0> {
  static constexpr int block_q = 48;
  static constexpr int block_k = 96;
};
template <>
struct HostBackwardTiles<HostIsa::avx2, float> : HostBackwardTiles48x96<HostIsa::avx2> {};
template <>
struct HostBackwardTiles<HostIsa::sse2, float> : HostBackwardTiles48x96<HostIsa::sse2> {};
template <>
struct HostBackwardTiles<HostIsa::neon, float> : HostBackwardTiles48x96<HostIsa::neon> {};
/// AVX-512, fp32: 64x64 with 4x64 micro tiles (16 accumulators) and the
/// explicit kernels; of 32..96 query rows x 64..128 keys with 4x64, 6x32 and
/// 12x32 micro tiles on Sapphire Rapids, the best or within noise of it.
template <>
struct HostBackwardTiles<HostIsa::avx512, float> : HostTiles<HostIsa::avx512, float, 0> {
  static constexpr int block_q = 64;
  static constexpr int block_k = 64;
  static constexpr int micro_rows = 4;
};

/// The host ISA a default shape names for a kind of execution space: the
/// compile-time one on the host, `generic` on devices. A device shape's type
/// must be the same in the host and device passes of nvcc / hipcc, and the
/// device pass sees no host ISA (host_isa is `generic` there): the kernels'
/// names contain the shape, and the CUDA runtime launches a kernel through the
/// name its device pass registered (a host pass that instantiates a kernel
/// under another name launches an unregistered function:
/// cudaErrorInvalidResourceHandle at the launch).
template <bool HostSpace>
inline constexpr HostIsa default_shape_isa = HostSpace ? host_isa : HostIsa::generic;

}  // namespace impl

/// Block sizes of the forward tile kernel, chosen per value type, per kind of
/// execution space and, on the host, per vector instruction set (host_isa(),
/// from the compiler's target flags). A team owns one (batch, head, query
/// tile); inside it one thread computes one `micro_rows x micro_cols` register
/// tile at a time.
///
///   block_q     rows of a query tile              (divisible by micro_rows)
///   block_k     rows of a key/value tile          (divisible by micro_cols)
///   micro_rows  rows of a register micro tile
///   micro_cols  columns of a register micro tile  (a multiple of the SIMD width
///               on CPUs); the fast head dims 64 and 128 are multiples of it
///   dim_granule other head dims are padded to a multiple of this and use
///               micro tiles this wide for P*V
///   tile_gemm   the policy that computes one micro tile (impl::RegisterTileGemm)
///   isa         the host ISA whose kernels run it (impl::host_isa: the
///               compile-time one; others under run-time dispatch, isa.hpp)
///
/// `for_isa<I>` is the same shape for host ISA I: with_shape_for switches to
/// the dispatched ISA's shape (fp32 on the host only; every other shape is its
/// own for_isa).
template <class T, bool HostSpace, int HeadDim = 0,
          HostIsa Isa = impl::default_shape_isa<HostSpace>>
struct DefaultTileShape {
  using tiles = impl::HostTiles<Isa, T, HeadDim>;
  static constexpr int block_q = tiles::block_q;
  static constexpr int block_k = tiles::block_k;
  static constexpr int micro_rows = tiles::micro_rows;
  static constexpr int micro_cols = tiles::micro_cols;
  static constexpr int dim_granule = tiles::dim_granule;
  static constexpr HostIsa isa = Isa;
  using tile_gemm = impl::RegisterTileGemmFor<Isa>;
  /// The shape used for a given compile-time head dim (0: any other).
  template <int D>
  using for_head_dim = DefaultTileShape<T, HostSpace, D, Isa>;
  template <HostIsa I>
  using for_isa = std::conditional_t<std::is_same<T, float>::value,
                                     DefaultTileShape<T, HostSpace, HeadDim, I>, DefaultTileShape>;
};

template <class T, int HeadDim, HostIsa Isa>
struct DefaultTileShape<T, false, HeadDim, Isa> {
  // GPUs: smaller tiles that fit level-0 scratch, many small micro tiles so
  // that a team has enough threads.
  static constexpr int block_q = 32;
  static constexpr int block_k = 32;
  static constexpr int micro_rows = 2;
  static constexpr int micro_cols = 4;
  static constexpr int dim_granule = 4;
  static constexpr HostIsa isa = HostIsa::generic;  // no host kernels (see default_shape_isa)
  using tile_gemm = impl::RegisterTileGemm;
  template <int D>
  using for_head_dim = DefaultTileShape<T, false, D, Isa>;
  template <HostIsa>
  using for_isa = DefaultTileShape;
};

/// Backward tiles: one shape for every head dim.
template <class T, bool HostSpace, HostIsa Isa = impl::default_shape_isa<HostSpace>>
struct BackwardTileShape : DefaultTileShape<T, HostSpace, 0, Isa> {
  using tiles = impl::HostBackwardTiles<Isa, T>;
  static constexpr int block_q = tiles::block_q;
  static constexpr int block_k = tiles::block_k;
  static constexpr int micro_rows = tiles::micro_rows;
  static constexpr int micro_cols = tiles::micro_cols;
  static constexpr int dim_granule = tiles::dim_granule;
  template <int D>
  using for_head_dim = BackwardTileShape;
  template <HostIsa I>
  using for_isa = std::conditional_t<std::is_same<T, float>::value,
                                     BackwardTileShape<T, HostSpace, I>, BackwardTileShape>;
};
template <class T, HostIsa Isa>
struct BackwardTileShape<T, false, Isa> : DefaultTileShape<T, false, 0> {
  template <int D>
  using for_head_dim = BackwardTileShape;
  template <HostIsa>
  using for_isa = BackwardTileShape;
};

namespace impl {
template <class ExecSpace>
inline constexpr bool is_host_space_v =
    Kokkos::SpaceAccessibility<ExecSpace, Kokkos::HostSpace>::accessible&&
        std::is_same<typename ExecSpace::memory_space, Kokkos::HostSpace>::value;

/// The concrete shape for compile-time head dim D (0 = generic): a shape may
/// specialise per head dim through a member template `for_head_dim<D>`.
template <class Shape, int D, class = void>
struct shape_for_head_dim {
  using type = Shape;
};
template <class Shape, int D>
struct shape_for_head_dim<Shape, D, std::void_t<typename Shape::template for_head_dim<D>>> {
  using type = typename Shape::template for_head_dim<D>;
};
template <class Shape, int D>
using shape_for_head_dim_t = typename shape_for_head_dim<Shape, D>::type;

/// The host ISA of a shape's kernels: its `isa`, else the compile-time one.
template <class Shape, class = void>
struct shape_isa {
  static constexpr HostIsa value = host_isa;
};
template <class Shape>
struct shape_isa<Shape, std::void_t<decltype(Shape::isa)>> {
  static constexpr HostIsa value = Shape::isa;
};
template <class Shape>
inline constexpr HostIsa shape_isa_v = shape_isa<Shape>::value;

/// The host ISA of the kernels that run Shape on ExecSpace: the shape's on
/// host spaces, `generic` on devices (whatever a user's device shape says), so
/// that the functors and the functions that launch kernels name the same
/// types in a device compiler's host and device passes (default_shape_isa).
template <class ExecSpace, class Shape>
inline constexpr HostIsa kernel_isa_v =
    is_host_space_v<ExecSpace> ? shape_isa_v<Shape> : HostIsa::generic;

/// Whether a shape follows the run-time ISA: it is of the compile-time ISA
/// (a shape named for another ISA runs that one), it has for_isa, and its
/// for_isa of its own ISA is itself (a shape derived from DefaultTileShape with
/// other members is not replaced by its base).
template <class Shape, class = void>
struct is_dispatched_shape : std::false_type {};
template <class Shape>
struct is_dispatched_shape<Shape, std::void_t<typename Shape::template for_isa<host_isa>>>
    : std::bool_constant<shape_isa<Shape>::value == host_isa &&
                         std::is_same<typename Shape::template for_isa<host_isa>, Shape>::value> {};

/// f(shape) for Shape's variant of the ISA the host kernels dispatch to
/// (isa.hpp): Shape itself without run-time dispatch, on devices, and for
/// shapes that do not follow it.
template <class Shape, class F>
decltype(auto) with_dispatched_shape(F&& f) {
#if BLOCKATTN_HOST_DISPATCH
  if constexpr (is_dispatched_shape<Shape>::value) {
    using S512 = typename Shape::template for_isa<HostIsa::avx512>;
    using S256 = typename Shape::template for_isa<HostIsa::avx2>;
    if constexpr (!std::is_same<S512, Shape>::value && host_isa_compiled(HostIsa::avx512))
      if (dispatched_host_isa() == HostIsa::avx512) return f(S512{});
    if constexpr (!std::is_same<S256, Shape>::value && host_isa_compiled(HostIsa::avx2))
      if (dispatched_host_isa() == HostIsa::avx2) return f(S256{});
  }
#endif
  return f(Shape{});
}

/// The shape the kernels use for a run-time head dim (and, for shapes that
/// follow it, the run-time host ISA).
template <class Shape, class F>
decltype(auto) with_shape_for(int head_dim, F&& f) {
  return with_dispatched_shape<Shape>([&](auto isa_shape) -> decltype(auto) {
    using S = decltype(isa_shape);
    if (head_dim == 64) return f(std::integral_constant<int, 64>{}, shape_for_head_dim_t<S, 64>{});
    if (head_dim == 128)
      return f(std::integral_constant<int, 128>{}, shape_for_head_dim_t<S, 128>{});
    return f(std::integral_constant<int, 0>{}, shape_for_head_dim_t<S, 0>{});
  });
}

template <class Shape>
constexpr void check_tile_shape();

/// The head dim as the kernels store it: the compile-time dim, or the run-time
/// dim rounded up to the shape's granule.
template <class Shape, int StaticD>
constexpr int padded_head_dim(int dim) {
  return StaticD > 0 ? StaticD
                     : (dim + Shape::dim_granule - 1) / Shape::dim_granule * Shape::dim_granule;
}
}  // namespace impl

/// Query and key tile sizes of a kernel launch (for work accounting).
struct TileSizes {
  int block_q = 0;
  int block_k = 0;
};

/// The tile sizes the forward kernel uses for value type T on ExecSpace.
template <class T, class ExecSpace = Kokkos::DefaultExecutionSpace,
          class Shape = DefaultTileShape<T, impl::is_host_space_v<ExecSpace>>>
TileSizes forward_tile_sizes(int head_dim) {
  return impl::with_shape_for<Shape>(head_dim, [](auto, auto shape) {
    using S = decltype(shape);
    return TileSizes{S::block_q, S::block_k};
  });
}

namespace impl {
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
