// SPDX-License-Identifier: Apache-2.0
// The host CPU's vector instruction set: the one the compiler targets
// (-march=...), chosen at compile time from the compiler's target macros, and,
// on x86-64 with GCC or Clang, the one the host fp32 kernels dispatch to at
// run time (BLOCKATTN_HOST_DISPATCH). The tile shapes (tile_shape.hpp) and the
// micro kernels (micro_gemm.hpp) are picked from it.
#pragma once

#include <blockattn/core/errors.hpp>

#include <cstdlib>
#include <cstring>

namespace blockattn {

/// Vector instruction sets the host tile shapes are written for, in order:
/// on x86-64 each one's kernels run on every CPU of the ones after it.
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

// Run-time dispatch of the host fp32 kernels (BLOCKATTN_HOST_DISPATCH): a
// translation unit compiled for less than AVX-512 on x86-64 (the compiler's
// default x86-64 target, or -march=x86-64-v3) also compiles the AVX2 and
// AVX-512 kernels under GCC/Clang target attributes, and the first host call
// picks the best one the CPU and the OS support (CPUID through
// __builtin_cpu_supports), so that one binary runs the 512-bit kernels on
// AVX-512 machines and the 256-bit ones on AVX2 machines. fp64 keeps the
// compile-time ISA (its results stay bitwise those of the build), and so does
// every device pass. On by default where it applies; define it to 0 to build
// only the compile-time ISA (each dispatched ISA is one more instantiation of
// the kernels: compile time). The environment variable BLOCKATTN_HOST_ISA
// (avx512, avx2, sse2) caps the choice at run time.
#if !defined(BLOCKATTN_HOST_DISPATCH)
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(__CUDACC__) && \
    !defined(__HIPCC__) && !defined(SYCL_LANGUAGE_VERSION) && !defined(__NVCOMPILER) &&         \
    !defined(__INTEL_COMPILER)
#define BLOCKATTN_HOST_DISPATCH 1
#else
#define BLOCKATTN_HOST_DISPATCH 0
#endif
#endif
#if BLOCKATTN_HOST_DISPATCH &&                                                                    \
    (!defined(__x86_64__) || !(defined(__GNUC__) || defined(__clang__)) || defined(__CUDACC__) || \
     defined(__HIPCC__) || defined(SYCL_LANGUAGE_VERSION))
#error "BlockAttn: BLOCKATTN_HOST_DISPATCH=1 needs x86-64 host code compiled by GCC or Clang"
#endif

// BLOCKATTN_HOST_DISPATCH_AVX512=0 leaves the AVX-512 kernels out of a
// dispatch build (AVX2 only above the compile-time ISA): a third less compile
// time and code for binaries that never meet an AVX-512 CPU.
#if !defined(BLOCKATTN_HOST_DISPATCH_AVX512)
#define BLOCKATTN_HOST_DISPATCH_AVX512 1
#endif

#if BLOCKATTN_HOST_DISPATCH
// The target attributes of the dispatched kernels: x86-64-v3's vector part,
// and x86-64-v4's.
#define BLOCKATTN_TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define BLOCKATTN_TARGET_AVX512 \
  __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512dq,avx512vl")))
#endif

namespace impl {

/// Whether this translation unit has the host fp32 kernels of `isa`.
constexpr bool host_isa_compiled(HostIsa isa) {
  return isa == host_isa ||
         (BLOCKATTN_HOST_DISPATCH && host_isa != HostIsa::generic &&
          (isa == HostIsa::avx2 || (isa == HostIsa::avx512 && BLOCKATTN_HOST_DISPATCH_AVX512)) &&
          isa > host_isa);
}

/// Whether the kernels of `isa` run under target attributes here (compiled
/// for an ISA above the translation unit's).
constexpr bool host_isa_targeted(HostIsa isa) {
  return isa != host_isa && host_isa_compiled(isa);
}

/// "avx512", "avx2", "sse2" -> the ISA; anything else -> generic.
inline HostIsa parse_host_isa(const char* name) {
  if (name == nullptr) return HostIsa::generic;
  if (std::strcmp(name, "avx512") == 0) return HostIsa::avx512;
  if (std::strcmp(name, "avx2") == 0) return HostIsa::avx2;
  if (std::strcmp(name, "sse2") == 0) return HostIsa::sse2;
  return HostIsa::generic;
}

/// The best x86 level this CPU and its OS run (CPUID and XCR0, through the
/// compiler's runtime); the compile-time ISA where there is no dispatch.
inline HostIsa detect_host_isa() {
#if BLOCKATTN_HOST_DISPATCH
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("f16c");
  if (avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
    return HostIsa::avx512;
  if (avx2) return HostIsa::avx2;
  return HostIsa::sse2;
#else
  return host_isa;
#endif
}

/// The ISA the host fp32 kernels run: the best one compiled here that the CPU
/// runs, at most BLOCKATTN_HOST_ISA when that is set, never below the
/// compile-time ISA (whose instructions the whole binary already uses).
/// Throws blockattn::invalid_argument for a BLOCKATTN_HOST_ISA other than
/// avx512, avx2 or sse2.
inline HostIsa choose_host_isa(HostIsa detected, const char* cap) {
  HostIsa best = detected;
  if (cap != nullptr && cap[0] != '\0') {
    const HostIsa c = parse_host_isa(cap);
    if (c == HostIsa::generic)
      fail("dispatched_host_isa", "environment variable BLOCKATTN_HOST_ISA is \"", cap,
           "\"; expected avx512, avx2 or sse2");
    if (c < best) best = c;
  }
  for (HostIsa isa : {HostIsa::avx512, HostIsa::avx2})
    if (isa <= best && isa > host_isa && host_isa_compiled(isa)) return isa;
  return host_isa;
}

inline HostIsa dispatched_host_isa() {
#if BLOCKATTN_HOST_DISPATCH
  static const HostIsa isa = choose_host_isa(detect_host_isa(), std::getenv("BLOCKATTN_HOST_ISA"));
  return isa;
#else
  return host_isa;
#endif
}

/// Runs f() inside a function compiled for `Isa` that inlines everything f
/// calls (GCC/Clang `flatten`): the whole kernel body, with the intrinsics of
/// that ISA, in one function of its target. Without dispatch: f().
template <HostIsa Isa>
struct HostIsaEntry {
  template <class F>
  static void run(const F& f) {
    f();
  }
};
#if BLOCKATTN_HOST_DISPATCH
template <>
struct HostIsaEntry<HostIsa::avx2> {
  template <class F>
  BLOCKATTN_TARGET_AVX2 __attribute__((flatten)) static void run(const F& f) {
    f();
  }
};
template <>
struct HostIsaEntry<HostIsa::avx512> {
  template <class F>
  BLOCKATTN_TARGET_AVX512 __attribute__((flatten)) static void run(const F& f) {
    f();
  }
};
#endif

/// f() inside HostIsaEntry<Isa> where the host dispatches at run time and Isa
/// is one it targets, else f() directly: the body of a host kernel's
/// operator() (the whole team's work in one function of its ISA).
template <HostIsa Isa, class F>
KOKKOS_FORCEINLINE_FUNCTION void run_in_isa(const F& f) {
#if BLOCKATTN_HOST_DISPATCH
  if constexpr (host_isa_targeted(Isa)) {
    HostIsaEntry<Isa>::run(f);
    return;
  }
#endif
  f();
}

}  // namespace impl

/// The ISA this translation unit's host tile shapes were compiled for.
constexpr HostIsa host_isa() {
  return impl::host_isa;
}

/// The ISA the host fp32 kernels of this translation unit run on this machine:
/// host_isa(), or a higher one chosen at run time (BLOCKATTN_HOST_DISPATCH).
/// Throws blockattn::invalid_argument when BLOCKATTN_HOST_ISA is set to
/// something other than avx512, avx2 or sse2.
inline HostIsa dispatched_host_isa() {
  return impl::dispatched_host_isa();
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
