// SPDX-License-Identifier: Apache-2.0
// The register micro kernels this build selected (portable loops, or the
// explicit AVX2 / 128-bit kernels) for every micro tile the default tile shapes
// use, against an fp64 reference; and the host ISA the build was compiled for.
#include <doctest/doctest.h>

#include <blockattn/kernel/portable/micro_gemm.hpp>
#include <blockattn/kernel/tile_shape.hpp>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

namespace {

using namespace blockattn;

/// Checks C = [diag(s) C0 | 0] + A B (transposed_a: C = C0 + A^T B) for one
/// MR x NR micro tile with reduction length KD (0: run-time kdim).
/// Tolerance: each element is a sum of kdim (+1) fp32 products, accumulated
/// in order with FMA: |error| <= (kdim + 2) * eps * sum |terms| (the standard
/// bound for recursive summation).
template <HostIsa Isa, int MR, int NR, int KD>
void check_tile(int kdim, bool transposed_a, bool scaled, std::uint64_t seed) {
  constexpr int lda_pad = 3, ldb_pad = 5, ldc_pad = 7;  // leading dims wider than the tile
  const int lda = transposed_a ? MR + lda_pad : kdim + lda_pad;
  const int ldb = NR + ldb_pad, ldc = NR + ldc_pad;
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.f, 1.f);
  const std::size_t a_rows = transposed_a ? std::size_t(kdim) : std::size_t(MR);
  std::vector<float> a(a_rows * lda), b(static_cast<std::size_t>(kdim) * ldb);
  std::vector<float> c(static_cast<std::size_t>(MR) * ldc), s(static_cast<std::size_t>(MR));
  for (float& x : a) x = u(rng);
  for (float& x : b) x = u(rng);
  for (float& x : c) x = u(rng);
  for (float& x : s) x = u(rng);
  const std::vector<float> c0 = c;
  if (transposed_a)
    impl::HostIsaEntry<Isa>::run([&] {
      impl::micro_gemm_at<MR, NR, KD, Isa>(kdim, a.data(), lda, b.data(), ldb, c.data(), ldc);
    });
  else
    impl::HostIsaEntry<Isa>::run([&] {
      impl::micro_gemm<MR, NR, KD, Isa>(kdim, a.data(), lda, b.data(), ldb, c.data(), ldc,
                                        scaled ? s.data() : static_cast<const float*>(nullptr));
    });
  const double eps = std::ldexp(1.0, -24);
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) {
      double ref = 0, mag = 0;
      if (transposed_a) {
        ref = c0[r * ldc + j];
      } else if (scaled) {
        ref = double(s[r]) * c0[r * ldc + j];
      }
      mag = std::fabs(ref);
      for (int k = 0; k < kdim; ++k) {
        const double av = transposed_a ? a[std::size_t(k) * lda + r] : a[std::size_t(r) * lda + k];
        const double t = av * b[std::size_t(k) * ldb + j];
        ref += t;
        mag += std::fabs(t);
      }
      const double err = std::fabs(c[r * ldc + j] - ref);
      CHECK_MESSAGE(err <= (kdim + 2) * eps * mag, "tile ", MR, "x", NR, " KD=", KD, " kdim=", kdim,
                    " at (", r, ",", j, "): ", c[r * ldc + j], " vs ", ref);
    }
  // Nothing outside the tile is written.
  for (int r = 0; r < MR; ++r)
    for (int j = NR; j < ldc; ++j) CHECK(std::memcmp(&c[r * ldc + j], &c0[r * ldc + j], 4) == 0);
}

/// Every micro tile the forward and backward kernels instantiate for shape S
/// (with S's ISA: under run-time dispatch, one above the build's).
template <class S, int D>
void check_shape() {
  constexpr HostIsa I = S::isa;
  constexpr int MR = S::micro_rows, NR = S::micro_cols, BK = S::block_k, BQ = S::block_q;
  constexpr int NRO = D > 0 ? NR : S::dim_granule;
  for (bool scaled : {false, true}) {
    check_tile<I, MR, NR, D>(D > 0 ? D : 40, false, scaled, 1);        // S = Q K^T
    check_tile<I, MR, NRO, BK>(BK, false, scaled, 2);                  // O = diag(a) O + P V
    check_tile<I, MR, NRO, 0>(BK - S::dim_granule, false, scaled, 3);  // partial tile
  }
  check_tile<I, MR, NRO, BQ>(BQ, true, false, 4);  // backward dV, dK
}

/// The forward and backward fp32 shapes of host ISA I, when this build has
/// its kernels and this CPU runs them.
template <HostIsa I>
void check_isa_shapes() {
  if constexpr (impl::host_isa_compiled(I)) {
    if (impl::detect_host_isa() < I) return;
    const std::string name = std::string("micro kernels of ") + host_isa_name(I);
    MESSAGE(name);
    using F = DefaultTileShape<float, true, 0, I>;
#if BLOCKATTN_SIMD_KERNELS  // (not in a device compiler's device pass, which has no host kernels)
    static_assert(F::isa == I && impl::simd_tile<I, float, F::micro_rows, F::micro_cols>);
#endif
    check_shape<impl::shape_for_head_dim_t<F, 0>, 0>();
    check_shape<impl::shape_for_head_dim_t<F, 64>, 64>();
    check_shape<impl::shape_for_head_dim_t<F, 128>, 128>();
    using B = BackwardTileShape<float, true, I>;
    check_shape<B, 0>();
    check_shape<B, 128>();
  }
}

}  // namespace

TEST_CASE("host ISA: the one the compiler targets") {
#ifdef BLOCKATTN_EXPECT_ISA
  CHECK(std::string(host_isa_name()) == BLOCKATTN_EXPECT_ISA);
#endif
#if defined(__AVX512F__)
  CHECK(host_isa() == HostIsa::avx512);
  CHECK(BLOCKATTN_SIMD_KERNELS == 1);
  CHECK(DefaultTileShape<float, true>::micro_cols == 64);
#elif defined(__AVX2__) && defined(__FMA__)
  CHECK(host_isa() == HostIsa::avx2);
  CHECK(BLOCKATTN_SIMD_KERNELS == 1);
  CHECK(DefaultTileShape<float, true>::micro_cols == 16);
#elif defined(__aarch64__)
  CHECK(host_isa() == HostIsa::neon);
  CHECK(BLOCKATTN_SIMD_KERNELS == 1);
  CHECK(DefaultTileShape<float, true>::micro_cols == 16);
#elif defined(__SSE2__)
  CHECK(host_isa() == HostIsa::sse2);
  CHECK(BLOCKATTN_SIMD_KERNELS == 1);
  CHECK(DefaultTileShape<float, true>::micro_cols == 8);
#endif
  // Every fp32 micro tile of the default shapes has an explicit kernel where
  // the build has one.
#if BLOCKATTN_SIMD_KERNELS
  using F = DefaultTileShape<float, true>;
  using B = BackwardTileShape<float, true>;
  CHECK(impl::simd_tile<F::isa, float, F::micro_rows, F::micro_cols>);
  CHECK(impl::simd_tile<F::isa, float, F::micro_rows, F::dim_granule>);
  CHECK(impl::simd_tile<B::isa, float, B::micro_rows, B::micro_cols>);
#endif
  MESSAGE("host ISA: ", host_isa_name());
}

// A device shape's type must not depend on the host ISA: nvcc's device pass
// sees none (host_isa is generic there) while its host pass sees the
// compiler's, and a kernel named after a type only the host pass has is
// launched unregistered (cudaErrorInvalidResourceHandle on the GPU; the cuda
// build also checks its binaries with tests/check_cuda_kernels.sh). On an x86
// or Arm host this build's host_isa is not generic, so a shape that defaulted
// to it would fail here.
TEST_CASE("device tile shapes name no host ISA; host kernels use the shape's") {
  CHECK(std::is_same<DefaultTileShape<float, false>,
                     DefaultTileShape<float, false, 0, HostIsa::generic>>::value);
  CHECK(std::is_same<DefaultTileShape<double, false>::for_head_dim<128>,
                     DefaultTileShape<double, false, 128, HostIsa::generic>>::value);
  CHECK(std::is_same<BackwardTileShape<float, false>,
                     BackwardTileShape<float, false, HostIsa::generic>>::value);
  CHECK(DefaultTileShape<float, false>::isa == HostIsa::generic);
  CHECK(BackwardTileShape<float, false>::isa == HostIsa::generic);
  CHECK(impl::shape_isa_v<DefaultTileShape<float, false, 64>> == HostIsa::generic);
  using Host = Kokkos::DefaultHostExecutionSpace;
  CHECK(std::is_same<DefaultTileShape<float, true>,
                     DefaultTileShape<float, true, 0, impl::host_isa>>::value);
  CHECK(impl::kernel_isa_v<Host, DefaultTileShape<float, true>> == impl::host_isa);
  CHECK(impl::kernel_isa_v<Host, BackwardTileShape<float, true, HostIsa::sse2>> == HostIsa::sse2);
}

TEST_CASE("micro kernels of the default fp32 host tile shapes vs fp64") {
  using F = DefaultTileShape<float, true>;
  check_shape<impl::shape_for_head_dim_t<F, 0>, 0>();
  check_shape<impl::shape_for_head_dim_t<F, 64>, 64>();
  check_shape<impl::shape_for_head_dim_t<F, 128>, 128>();
  using B = BackwardTileShape<float, true>;
  check_shape<B, 0>();
  check_shape<B, 64>();
  check_shape<B, 128>();
}

TEST_CASE(
    "run-time dispatch: the micro kernels of every ISA above the build's that this CPU runs") {
  check_isa_shapes<HostIsa::avx2>();
  check_isa_shapes<HostIsa::avx512>();
}

TEST_CASE("run-time dispatch: which ISA the host kernels run") {
  using impl::choose_host_isa;
  const HostIsa build = host_isa();
  // Without BLOCKATTN_HOST_ISA: the best ISA compiled here that the CPU runs,
  // never below the build's.
  const HostIsa best_compiled = impl::host_isa_compiled(HostIsa::avx512) ? HostIsa::avx512
                                : impl::host_isa_compiled(HostIsa::avx2) ? HostIsa::avx2
                                                                         : build;
  CHECK(choose_host_isa(HostIsa::avx512, nullptr) == best_compiled);
  CHECK(choose_host_isa(HostIsa::avx512, "") == best_compiled);
  CHECK(choose_host_isa(HostIsa::sse2, nullptr) == build);
#if BLOCKATTN_HOST_DISPATCH
  if (build == HostIsa::sse2) {
    CHECK(choose_host_isa(HostIsa::avx2, nullptr) == HostIsa::avx2);
    CHECK(choose_host_isa(HostIsa::avx2, "avx512") == HostIsa::avx2);  // the CPU decides
    CHECK(choose_host_isa(HostIsa::avx512, "avx2") == HostIsa::avx2);  // the cap decides
    CHECK(choose_host_isa(HostIsa::avx512, "sse2") == HostIsa::sse2);
  }
  if (build == HostIsa::avx2) {
    CHECK(choose_host_isa(HostIsa::avx512, "avx2") == HostIsa::avx2);
    CHECK(choose_host_isa(HostIsa::avx512, "sse2") == HostIsa::avx2);  // not below the build's
  }
#else
  CHECK(best_compiled == build);
  CHECK(choose_host_isa(HostIsa::avx512, "avx2") == build);
#endif
  // A cap that names no ISA is an error that names the variable and the value.
  for (const char* bad : {"AVX512", "avx-512", "native"}) {
    bool threw = false;
    try {
      (void)choose_host_isa(HostIsa::avx512, bad);
    } catch (const blockattn::invalid_argument& e) {
      threw = true;
      const std::string what = e.what();
      CHECK(what.find("BLOCKATTN_HOST_ISA") != std::string::npos);
      CHECK(what.find(std::string("\"") + bad + "\"") != std::string::npos);
      CHECK(what.find("avx512, avx2 or sse2") != std::string::npos);
    }
    CHECK(threw);
  }
  // This process: the CPU's ISA and its environment.
  const char* cap = std::getenv("BLOCKATTN_HOST_ISA");
  CHECK(dispatched_host_isa() == choose_host_isa(impl::detect_host_isa(), cap));
  CHECK(dispatched_host_isa() >= build);
  // The forward and backward shapes the kernels pick follow it.
  impl::with_shape_for<DefaultTileShape<float, true>>(
      64, [&](auto, auto shape) { CHECK(decltype(shape)::isa == dispatched_host_isa()); });
  impl::with_shape_for<BackwardTileShape<float, true>>(
      40, [&](auto, auto shape) { CHECK(decltype(shape)::isa == dispatched_host_isa()); });
  // fp64 stays on the build's ISA.
  impl::with_shape_for<DefaultTileShape<double, true>>(
      64, [&](auto, auto shape) { CHECK(decltype(shape)::isa == build); });
  // ctest names the ISA it expects this run to dispatch to.
  if (const char* want = std::getenv("BLOCKATTN_EXPECT_DISPATCHED"))
    CHECK(std::string(host_isa_name(dispatched_host_isa())) == want);
  const std::string ran = std::string("host kernels run ") + host_isa_name(dispatched_host_isa()) +
                          " (built for " + host_isa_name(build) + ")";
  MESSAGE(ran);
}
