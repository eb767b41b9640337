// SPDX-License-Identifier: Apache-2.0
// Software prefetch of strided rows on host backends.
//
// A (batch, seq, heads, dim) View with the head dim contiguous keeps the rows
// of one head heads * dim values apart: at H = 16, D = 64 in fp32, 4 KB, so
// every row of a head sits on its own page, where the hardware prefetchers
// (which stop at page boundaries) do not follow. The forward kernel copies
// the query rows of a team, writes its output rows and packs K/V rows one
// after another; each row waited for memory on its own. On a Zen 3 EPYC
// (1 thread, H = 16, D = 64, N = 1024, fp32, perf): the Q copy and the O
// write took 6 % and 5 % of the kernel, the K/V packing 5 % of the call,
// none of them visible with each head's rows contiguous ([heads][seq][dim]
// memory). Asking for every row first lets the misses overlap: the copy and
// the write left the profile, packing fell to 3 %.
#pragma once

#include <blockattn/core/config.hpp>

#include <cstddef>
#include <cstdint>

namespace blockattn {
namespace impl {

/// How many rows ahead the row-at-a-time packing loops (backward_pack.hpp)
/// ask for their source rows.
inline constexpr int prefetch_ahead = 8;

/// Asks the host's caches for the cache lines of [p, p + bytes), for reading
/// or (write) for a store. Only a hint: never faults, changes no value; a
/// no-op in device code and on compilers without GNU extensions.
KOKKOS_FORCEINLINE_FUNCTION void prefetch_span(const void* p, std::size_t bytes,
                                               bool write = false) {
#if !defined(__CUDA_ARCH__) && !defined(__HIP_DEVICE_COMPILE__) && \
    !defined(__SYCL_DEVICE_ONLY__) && (defined(__GNUC__) || defined(__clang__))
  constexpr std::uintptr_t line = 64;
  const std::uintptr_t a = reinterpret_cast<std::uintptr_t>(p);
  const std::uintptr_t end = a + bytes;
  // An asm statement, not __builtin_prefetch: GCC counts the builtin as
  // free of side effects, finds the team loop that only prefetches pure and
  // deletes it (GCC 12, -O2 and above: no prefetch left in the kernel).
  for (std::uintptr_t c = a & ~(line - 1); c < end; c += line) {
    const char* const at = reinterpret_cast<const char*>(c);
#if defined(__x86_64__) || defined(__i386__)
    // prefetchw (for a store) where the compile target has PRFCHW
    // (-march=native on AMD, or on Intel since Broadwell); else prefetcht0.
#if defined(__PRFCHW__)
    if (write)
      asm volatile("prefetchw %0" : : "m"(*at));
    else
      asm volatile("prefetcht0 %0" : : "m"(*at));
#else
    (void)write;
    asm volatile("prefetcht0 %0" : : "m"(*at));
#endif
#elif defined(__aarch64__)
    if (write)
      asm volatile("prfm pstl1keep, [%0]" : : "r"(at));
    else
      asm volatile("prfm pldl1keep, [%0]" : : "r"(at));
#else
    if (write)
      __builtin_prefetch(at, 1, 3);
    else
      __builtin_prefetch(at, 0, 3);
#endif
  }
#else
  (void)p;
  (void)bytes;
  (void)write;
#endif
}

}  // namespace impl
}  // namespace blockattn
