// SPDX-License-Identifier: Apache-2.0
// The host CPU's vector instruction set, as the compiler targets it
// (-march=...): chosen at compile time from the compiler's target macros, no
// run-time dispatch. The tile shapes (tile_shape.hpp) and the micro kernels
// (micro_gemm.hpp) are picked from it.
#pragma once

namespace blockattn {

/// Vector instruction sets the host tile shapes are written for.
enum class HostIsa {
  generic,  // no vector ISA known: portable C++ loops, small register tiles
  sse2,     // x86-64 baseline: 16 x 128-bit registers
  neon,     // AArch64 Advanced SIMD (also with SVE): 32 x 128-bit registers
  avx2,     // AVX2 + FMA (x86-64-v3: Haswell .. Zen 4): 16 x 256-bit registers
  avx512,   // AVX-512F (x86-64-v4: Skylake-X .. Sapphire Rapids, Zen 4/5): 32 x 512-bit registers
};

namespace impl {

// The device passes of nvcc/hipcc/SYCL see none of the host ISA: their kernels
// use the GPU tile shapes and never reach the host micro kernels.
#if defined(__CUDA_ARCH__) || defined(__HIP_DEVICE_COMPILE__) || defined(__SYCL_DEVICE_ONLY__)
inline constexpr HostIsa host_isa = HostIsa::generic;
#elif defined(__AVX512F__)
inline constexpr HostIsa host_isa = HostIsa::avx512;
#elif defined(__AVX2__) && defined(__FMA__)
inline constexpr HostIsa host_isa = HostIsa::avx2;
#elif defined(__aarch64__) && defined(__ARM_NEON)
inline constexpr HostIsa host_isa = HostIsa::neon;
#elif defined(__SSE2__) || defined(__x86_64__)
inline constexpr HostIsa host_isa = HostIsa::sse2;
#else
inline constexpr HostIsa host_isa = HostIsa::generic;
#endif

}  // namespace impl

/// The ISA this translation unit's host tile shapes were compiled for.
constexpr HostIsa host_isa() {
  return impl::host_isa;
}

/// Its name, e.g. for benchmark output: "avx512", "avx2", "neon", "sse2", "generic".
constexpr const char* host_isa_name(HostIsa isa = impl::host_isa) {
  return isa == HostIsa::avx512 ? "avx512"
         : isa == HostIsa::avx2 ? "avx2"
         : isa == HostIsa::neon ? "neon"
         : isa == HostIsa::sse2 ? "sse2"
                                : "generic";
}

}  // namespace blockattn
