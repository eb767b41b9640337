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
#include <cstring>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(__CUDA_ARCH__) && !defined(__HIP_DEVICE_COMPILE__)
#include <cpuid.h>
#define BLOCKATTN_PREFETCH_CPUID 1
#else
#define BLOCKATTN_PREFETCH_CPUID 0
#endif

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

/// prefetch_span for the second-level cache only (prefetcht1): the lines
/// come closer without displacing what the first level holds.
KOKKOS_FORCEINLINE_FUNCTION void prefetch_span_l2(const void* p, std::size_t bytes) {
#if !defined(__CUDA_ARCH__) && !defined(__HIP_DEVICE_COMPILE__) && \
    !defined(__SYCL_DEVICE_ONLY__) && (defined(__GNUC__) || defined(__clang__))
  constexpr std::uintptr_t line = 64;
  const std::uintptr_t a = reinterpret_cast<std::uintptr_t>(p);
  const std::uintptr_t end = a + bytes;
  for (std::uintptr_t c = a & ~(line - 1); c < end; c += line) {  // asm: see prefetch_span
    const char* const at = reinterpret_cast<const char*>(c);
#if defined(__x86_64__) || defined(__i386__)
    asm volatile("prefetcht1 %0" : : "m"(*at));
#elif defined(__aarch64__)
    asm volatile("prfm pldl2keep, [%0]" : : "r"(at));
#else
    __builtin_prefetch(at, 0, 2);
#endif
  }
#else
  (void)p;
  (void)bytes;
#endif
}

/// The key and value rows of a decode kernel's next tile, asked for row by
/// row (row(j): key j's K and V rows; every row at once: all()). The vector
/// tile products ask for row j as their own loop reaches key j of the current
/// tile, so the misses spread over the tile's arithmetic: one burst of every
/// row before the tile (64 KB of requests for fp32 at D = 128) filled the
/// core's miss buffers, stalled it until they drained and left memory idle
/// during the arithmetic that followed (decode_prefetch_level's note).
struct DecodePrefetch {
  const char* k = nullptr;                 // key row 0 of the next tile
  const char* v = nullptr;                 // value row 0
  std::size_t k_stride = 0, v_stride = 0;  // bytes between rows
  std::size_t bytes = 0;                   // bytes of one row
  int rows = 0;                            // rows in the next tile (0: none)
  int level = 0;                           // decode_prefetch_level's
  int offset = 0;                          // row(j) asks for row offset + j
  // Paged caches (DecodePages): row i is key first + i, in page
  // pages[(first + i) >> shift * page_step] at slot (first + i) & mask; k
  // and v are then slot 0 of pool page 0, k_page and v_page the bytes
  // between pool pages. pages == nullptr: rows i at k + i * k_stride.
  const int* pages = nullptr;
  std::ptrdiff_t page_step = 1;
  std::int64_t first = 0;
  int shift = 0;
  std::size_t k_page = 0, v_page = 0;
  KOKKOS_INLINE_FUNCTION void row(int jj) const {
    const int j = jj + offset;
    if (j >= rows) return;
    const char* kr;
    const char* vr;
    if (pages != nullptr) {
      const std::int64_t key = first + j;
      const std::size_t page = std::size_t(pages[(key >> shift) * page_step]);
      const std::size_t slot = std::size_t(key & ((std::int64_t(1) << shift) - 1));
      kr = k + page * k_page + slot * k_stride;
      vr = v + page * v_page + slot * v_stride;
    } else {
      kr = k + std::size_t(j) * k_stride;
      vr = v + std::size_t(j) * v_stride;
    }
    if (level == 1) {
      prefetch_span(kr, bytes);
      prefetch_span(vr, bytes);
    } else {
      prefetch_span_l2(kr, bytes);
      prefetch_span_l2(vr, bytes);
    }
  }
  KOKKOS_INLINE_FUNCTION void all() const {
    for (int j = 0; j < rows; ++j) row(j - offset);
  }
};

/// Whether the host CPU is AMD's (CPUID leaf 0), read once.
inline bool host_cpu_is_amd() {
#if BLOCKATTN_PREFETCH_CPUID
  static const bool amd = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return false;
    char vendor[13] = {};
    std::memcpy(vendor, &b, 4);
    std::memcpy(vendor + 4, &d, 4);
    std::memcpy(vendor + 8, &c, 4);
    return std::strcmp(vendor, "AuthenticAMD") == 0;
  }();
  return amd;
#else
  return false;
#endif
}

/// How the host decode kernel asks for its next key tile: 0 not at all,
/// 1 into the first-level cache (prefetch_span), 2 into the second
/// (prefetch_span_l2). `stream`: the rows of one kv head are adjacent in
/// memory (a sequential stream the hardware prefetchers follow);
/// `tile_bytes`: the keys and values of one tile; `spread`: the rows are
/// asked for key by key inside the tile products (DecodePrefetch::row), not
/// in one burst before the tile.
///
/// Measured with the burst (bench_decode, 2 threads, 65536 keys, best of 5,
/// alternating binaries): on a Zen 4, with no software prefetch streams of
/// tiles up to 16 KB ran up to 1.8x faster than with the first-level one,
/// which displaced the tile being computed (bf16, 16 heads, D = 64: 13.3 ->
/// 7.7 ms), 32 KB tiles (fp32, D = 128) ran best with the second-level one,
/// and so did strided rows (batch, keys, heads, dim): 1.2-1.8x the
/// first-level one's rate; on an AMX Xeon the first-level one had taken a
/// stream from 0.89 to 1.07x (fp32) and 0.64 to 0.83x (bf16) the rate of a
/// plain read of the same bytes. Spread, on a Zen 3 (1 thread, D = 128 and
/// 64, fp32 and bf16, 8 to 32 heads, heads-major): the second-level one ran
/// every shape 1.2-1.35x faster than none, 16 KB tiles included, and within
/// 3 % of the first-level one; on AMD the spread requests go to the second
/// level (the Zen 4's 16 KB rule was measured with the burst only).
/// `dot`: the tiles of the AVX512-BF16 dot products (decode_bf16.hpp, GQA
/// groups of bf16 rows): on a Zen 4 (1 and 2 threads, 65 536 keys,
/// heads-major, medians of 5 alternated runs) 16 KB tiles (D = 128) ran
/// 1.14x faster (8 query heads on 1) and 0.97-1.0x (32 on 8) with the
/// second-level burst than with none, and 8 KB tiles (D = 64) 0.8-0.9x: none
/// below 16 KB.
inline int decode_prefetch_level(bool stream, std::size_t tile_bytes, bool spread,
                                 bool dot = false) {
  if (!host_cpu_is_amd()) return 1;
  if (spread) return 2;
  const std::size_t small = std::size_t(16) << 10;
  return stream && (dot ? tile_bytes < small : tile_bytes <= small) ? 0 : 2;
}

}  // namespace impl
}  // namespace blockattn
