// SPDX-License-Identifier: Apache-2.0
// The host matrix engine: Intel AMX (Advanced Matrix Extensions) bf16 tile
// products for the forward of bf16 inputs on x86-64 host spaces.
//
// An AMX tile product (_tile_dpbf16ps) adds A (16 x 32 bf16) times B (32 x 16
// bf16, stored in VNNI pairs: row p holds B(2p, n), B(2p + 1, n) for n = 0..15)
// to C (16 x 16 fp32): 16 K FLOP per instruction, 1,024 bf16 FLOP per cycle
// and core, 16x the fp32 FMA rate of AVX-512. The forward kernel
// (forward_kernel.hpp, run_amx) keeps its online softmax in fp32 and computes
//   S = Q K^T   from Q (bf16, unscaled: exact) and K in VNNI pairs,
//   O += P V    from P rounded to bf16 and V in VNNI pairs,
// in blocks of 2 x 2 tiles (32 x 32 of C: the eight tile registers hold four
// C, two A and two B tiles). What rounds differently from the fp32 kernels:
// P to bf16 before P V (|P - fl(P)| <= 2^-9 P; the row sum l is taken from the
// fp32 P), the products' fp32 accumulation order, and AMX's treatment of
// bf16 subnormal inputs as zero. The bound is in README.md (Numerics).
//
// Compiled where GCC >= 11 or Clang >= 12 targets x86-64 Linux host code
// (BLOCKATTN_HOST_AMX); used at run time where CPUID has AMX-TILE, AMX-BF16
// and the AVX-512 the kernels need (F, BW, DQ, VL, BF16), the OS enables the
// tile state (XCR0) and Linux grants it to the process (arch_prctl
// ARCH_REQ_XCOMP_PERM, asked once), and the environment variable
// BLOCKATTN_HOST_MATRIX is not "off". Where AMX is not, the same kernels run
// on AVX512-BF16 vector products (bf16_vector_block): by default on AMD's
// CPUs (Zen 4 and later), where they are faster than the fp32 kernels, on
// request elsewhere. host_matrix_engine() says which and why.
#pragma once

#include <blockattn/core/errors.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/kernel/host_matrix.hpp>
#include <blockattn/kernel/isa.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#if !defined(BLOCKATTN_HOST_AMX)
#if defined(__x86_64__) && defined(__linux__) && !defined(__CUDACC__) && !defined(__HIPCC__) && \
    !defined(SYCL_LANGUAGE_VERSION) && !defined(__NVCOMPILER) && !defined(__INTEL_COMPILER) &&  \
    ((defined(__clang__) && __clang_major__ >= 12) ||                                           \
     (!defined(__clang__) && defined(__GNUC__) && __GNUC__ >= 11))
#define BLOCKATTN_HOST_AMX 1
#else
#define BLOCKATTN_HOST_AMX 0
#endif
#endif

#if BLOCKATTN_HOST_AMX
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
// Full unrolling of the vector engine's register loops (the accumulators stay
// in registers only when every index is a constant).
#if defined(__clang__)
#define BLOCKATTN_AMX_UNROLL _Pragma("unroll")
#else
#define BLOCKATTN_AMX_UNROLL _Pragma("GCC unroll 16")
#endif
// Everything the AMX forward runs: the AVX-512 kernels' ISA, AVX512-BF16 (P to
// bf16) and the tile instructions.
#define BLOCKATTN_TARGET_AMX                                                    \
  __attribute__((                                                               \
      target("avx2,fma,avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,amx-tile," \
             "amx-bf16")))
#endif

namespace blockattn {

namespace impl {

#if BLOCKATTN_HOST_AMX
/// The CPU and OS part of host_matrix_engine() for AVX512-BF16 (the vector
/// engine): empty when it runs.
inline std::string avx512_bf16_cpu_reason() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return "the CPU has no CPUID leaf 7";
  const bool avx512 = ((b >> 16) & 1u) && ((b >> 17) & 1u) && ((b >> 30) & 1u) && ((b >> 31) & 1u);
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  const bool avx512_bf16 = __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1) && ((a1 >> 5) & 1u);
  if (!avx512 || !avx512_bf16)
    return "the CPU has neither AMX-BF16 nor AVX512-BF16 (with AVX-512 F/BW/DQ/VL)";
  unsigned a0 = 0, b0 = 0, c0 = 0, d0 = 0;
  if (!__get_cpuid(1, &a0, &b0, &c0, &d0) || !((c0 >> 27) & 1u))
    return "the OS has not enabled XSAVE (CPUID OSXSAVE)";
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  (void)hi;
  if ((lo & 0xE6u) != 0xE6u) return "the OS has not enabled the AVX-512 state (XCR0)";
  return {};
}

/// The same for AMX (on top of AVX512-BF16): the tile flags and state.
inline std::string amx_cpu_reason() {
  if (std::string why = avx512_bf16_cpu_reason(); !why.empty()) return why;
  unsigned a = 0, b = 0, c = 0, d = 0;
  __get_cpuid_count(7, 0, &a, &b, &c, &d);
  if (!((d >> 24) & 1u) || !((d >> 22) & 1u))
    return "the CPU has no AMX-BF16 (CPUID flags amx_tile, amx_bf16)";
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  (void)hi;
  // XCR0 bits 17 (XTILECFG) and 18 (XTILEDATA).
  if (((lo >> 17) & 3u) != 3u)
    return "the OS has not enabled the AMX tile state (XCR0 bits 17, 18)";
  return {};
}

/// Whether the AVX512-BF16 vector engine is automatic's engine on this CPU
/// when AMX is not: empty when it is. On AMD's CPUs with AVX512-BF16 (Zen 4
/// and later) a `vdpbf16ps` does twice the work of an fp32 FMA of the same
/// width in the same time (measured on Zen 4: the bf16 forward 1.6-2.0x the
/// fp32 kernels' rate, the backward 1.1-1.5x); on Intel's (Cooper Lake,
/// Sapphire Rapids-class CPUs whose AMX the OS or hypervisor hides) it runs at
/// the fp32 FMA rate and the forward measured slower than the fp32 kernels.
inline std::string avx512_bf16_default_reason() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid(0, &a, &b, &c, &d)) return "the CPU has no CPUID leaf 0";
  char vendor[13] = {};
  std::memcpy(vendor, &b, 4);
  std::memcpy(vendor + 4, &d, 4);
  std::memcpy(vendor + 8, &c, 4);
  if (std::strcmp(vendor, "AuthenticAMD") == 0) return {};
  return std::string("its AVX512-BF16 dot products run at the fp32 FMA rate on this CPU (") +
         vendor + "): opt-in, HostMatrix::avx512_bf16 or BLOCKATTN_HOST_MATRIX=avx512bf16";
}

/// Asks Linux for the tile data state (once per process; needed before the
/// first tile instruction of any thread). Empty when granted.
inline std::string amx_request_reason() {
  constexpr long arch_req_xcomp_perm = 0x1023;  // <asm/prctl.h>
  constexpr long xfeature_xtiledata = 18;
  if (syscall(SYS_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata) != 0) {
    const int err = errno;
    return std::string("Linux refused the AMX tile state (arch_prctl(ARCH_REQ_XCOMP_PERM): ") +
           std::strerror(err) + ")";
  }
  return {};
}
#endif

/// The engine from the CPU, the OS and the environment variable
/// BLOCKATTN_HOST_MATRIX (unset or "auto": AMX where it runs, else
/// AVX512-BF16 vectors where they run faster than the fp32 kernels (AMD Zen 4
/// and later: avx512_bf16_default_reason); "amx": AMX only; "avx512bf16":
/// the vectors wherever the CPU has AVX512-BF16, never AMX; "off": none).
/// Throws blockattn::invalid_argument for any other value.
inline HostMatrixEngine detect_host_matrix_engine(const char* env) {
  HostMatrixEngine e;
  const std::string setting = env != nullptr ? env : "";
  if (!setting.empty() && setting != "auto" && setting != "amx" && setting != "avx512bf16" &&
      setting != "off")
    fail("host_matrix_engine", "environment variable BLOCKATTN_HOST_MATRIX is \"", setting,
         "\"; expected auto, amx, avx512bf16 or off");
  if (setting == "off") {
    e.reason = "BLOCKATTN_HOST_MATRIX=off";
    return e;
  }
#if BLOCKATTN_HOST_AMX
  e.vector_by_default = setting == "avx512bf16";  // the setting, whatever the CPU runs (or below)
  // The engine lives in the AVX-512 kernels: none where the host kernels run
  // another ISA (the CPU's, or a cap by BLOCKATTN_HOST_ISA).
  if (const HostIsa isa = dispatched_host_isa(); isa != HostIsa::avx512) {
    e.reason = std::string("the host kernels run ") + host_isa_name(isa) +
               " (the matrix engine needs the AVX-512 ones)";
    return e;
  }
  const std::string vec_why = avx512_bf16_cpu_reason();
  e.avx512_bf16 = vec_why.empty();
  if (e.vector_by_default) {
    e.reason = e.avx512_bf16 ? "" : vec_why;
  } else {
    e.reason = amx_cpu_reason();
    if (e.reason.empty()) e.reason = amx_request_reason();
    e.amx = e.reason.empty();
    if (!e.amx && e.avx512_bf16 && setting != "amx") {
      // No AMX: the vectors where they pay.
      const std::string slow = avx512_bf16_default_reason();
      e.vector_by_default = slow.empty();
      e.reason = slow.empty() ? std::string() : e.reason + "; " + slow;
    }
  }
#else
  e.reason = "not compiled in (AMX needs GCC >= 11 or Clang >= 12 host code for x86-64 Linux)";
#endif
  return e;
}

inline const HostMatrixEngine& host_matrix_engine() {
  static const HostMatrixEngine e = detect_host_matrix_engine(std::getenv("BLOCKATTN_HOST_MATRIX"));
  return e;
}

/// How a bf16 forward on a host space runs for `setting` in this process.
enum class MatrixPath { none, tiles, vectors };
inline MatrixPath matrix_path(HostMatrix setting) {
  const HostMatrixEngine& e = host_matrix_engine();
  if (setting == HostMatrix::automatic) {
    if (e.amx) return MatrixPath::tiles;
    if (e.vector_by_default && e.avx512_bf16) return MatrixPath::vectors;
  } else if (setting == HostMatrix::avx512_bf16 && e.avx512_bf16) {
    return MatrixPath::vectors;
  }
  return MatrixPath::none;
}

#if BLOCKATTN_HOST_AMX
/// Tile configuration: palette 1, tiles 0-7 of 16 rows x 64 bytes (C: 16 x 16
/// fp32; A: 16 x 32 bf16; B: 16 VNNI rows of 16 bf16 pairs).
struct alignas(64) AmxTileConfig {
  std::uint8_t palette = 1;
  std::uint8_t start_row = 0;
  std::uint8_t reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};

/// The one configuration every kernel loads.
constexpr AmxTileConfig amx_make_config() {
  AmxTileConfig c;
  for (int i = 0; i < 8; ++i) {
    c.colsb[i] = 64;
    c.rows[i] = 16;
  }
  return c;
}
inline constexpr AmxTileConfig amx_tile_config = amx_make_config();

// GCC's (12) tile intrinsics are inline assembly that under-state their
// memory: _tile_loadconfig names 8 bytes of the 64-byte configuration as
// read (a configuration built on the stack lost its later stores to
// dead-store elimination: an all-zero tile shape, and the first tile
// instruction raised SIGILL; seen in a -O2 build), and _tile_loadd names no
// memory at all (stores to a tile's source could move past the load). The
// configuration is loaded from constant storage through an operand that
// covers all of it, and every tile block starts with a compiler barrier.
BLOCKATTN_TARGET_AMX inline void amx_configure() {
  __asm__ volatile("ldtilecfg %0" : : "m"(amx_tile_config));
}

BLOCKATTN_TARGET_AMX inline void amx_release() {
  _tile_release();
}

/// Elements of one B tile (16 VNNI rows of 32 bf16).
inline constexpr int amx_b_tile = 512;

/// C (32 x 32 fp32, rows ldc floats apart) = [C +] A B over `chunks` chunks of
/// 32: A (32 x 32 chunks bf16, rows lda apart, chunk kc at a + 32 kc), B's
/// left and right 16 columns as VNNI tiles at b0 + kc * amx_b_tile and
/// b1 + kc * amx_b_tile.
BLOCKATTN_TARGET_AMX inline void amx_block(int chunks, const std::uint16_t* a, int lda,
                                           const std::uint16_t* b0, const std::uint16_t* b1,
                                           float* c, int ldc, bool load_c) {
  const int sa = lda * 2, sc = ldc * 4;
  float* const c1 = c + 16 * ldc;
  __asm__ volatile("" : : : "memory");  // the operands' stores before the tile loads
  if (load_c) {
    _tile_loadd(0, c, sc);
    _tile_loadd(1, c + 16, sc);
    _tile_loadd(2, c1, sc);
    _tile_loadd(3, c1 + 16, sc);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  const std::uint16_t* const a1 = a + 16 * lda;
  for (int kc = 0; kc < chunks; ++kc) {
    _tile_loadd(4, a + 32 * kc, sa);
    _tile_loadd(6, b0 + amx_b_tile * kc, 64);
    _tile_loadd(7, b1 + amx_b_tile * kc, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_loadd(5, a1 + 32 * kc, sa);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, sc);
  _tile_stored(1, c + 16, sc);
  _tile_stored(2, c1, sc);
  _tile_stored(3, c1 + 16, sc);
}

/// dst[0, 16) = bf16(p) (round to nearest even).
BLOCKATTN_TARGET_AMX inline void amx_store_p16(std::uint16_t* dst, const __m512& p) {
  const __m256bh x = _mm512_cvtneps_pbh(p);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), reinterpret_cast<const __m256i&>(x));
}

/// o[0, n) *= alpha (n a multiple of 16; nothing when alpha is 1).
BLOCKATTN_TARGET_AMX inline void amx_scale_o(float* o, int n, float alpha) {
  if (alpha != 1.0f) {
    const __m512 s = _mm512_set1_ps(alpha);
    for (int d = 0; d < n; d += 16)
      _mm512_storeu_ps(o + d, _mm512_mul_ps(_mm512_loadu_ps(o + d), s));
  }
}

/// 16 VNNI pairs: out[2 i] = bf16 bits of a[i], out[2 i + 1] = of b[i]
/// (fp32 values that are bf16 values: their upper halves).
BLOCKATTN_TARGET_AMX inline void amx_pair16(const float* a, const float* b, std::uint16_t* out) {
  const __m512i x = _mm512_castps_si512(_mm512_loadu_ps(a));
  const __m512i y = _mm512_castps_si512(_mm512_loadu_ps(b));
  const __m512i w = _mm512_or_si512(_mm512_maskz_srli_epi32(0xFFFF, x, 16),
                                    _mm512_and_si512(y, _mm512_set1_epi32(int(0xFFFF0000u))));
  _mm512_storeu_si512(static_cast<void*>(out), w);
}

/// One key tile of a packed fp32 block (kernel/impl/pack.hpp: K^T in panels
/// of kp keys, V in panels of vp columns, head dim dp, a multiple of 16) in
/// the AMX forward's VNNI layout (forward_launch.hpp, pack_amx_kv), head dim
/// padded with zeros to da: K's 16-key chunks from kd (da / 2 rows of 32 each),
/// V's rows of the tile's key pairs from vd in each 16-column chunk (chunks
/// v_chunk elements apart). Returns whether V holds an inf or NaN.
BLOCKATTN_TARGET_AMX inline bool amx_pack_tile(const float* kt_tile, const float* v_tile, int bk,
                                               int kp, int vp, int dp, int da, std::uint16_t* kd,
                                               std::uint16_t* vd, std::size_t v_chunk) {
  for (int j = 0; j < bk / 16; ++j) {
    const float* const panel = kt_tile + (16 * j / kp) * dp * kp + (16 * j) % kp;
    for (int p = 0; p < da / 2; ++p) {
      std::uint16_t* const row = kd + (std::size_t(j) * (da / 2) + p) * 32;
      if (2 * p < dp)
        amx_pair16(panel + 2 * p * kp, panel + (2 * p + 1) * kp, row);
      else
        std::memset(row, 0, 64);
    }
  }
  const __m512i exp_mask = _mm512_set1_epi32(0x7f800000);
  __mmask16 bad = 0;
  for (int n = 0; n < da / 16; ++n)
    for (int p = 0; p < bk / 2; ++p) {
      std::uint16_t* const row = vd + std::size_t(n) * v_chunk + std::size_t(p) * 32;
      const int d0 = 16 * n;
      if (d0 < dp) {
        const float* const col = v_tile + (d0 / vp) * bk * vp + d0 % vp;
        for (int t = 0; t < 2; ++t) {
          const __m512i x = _mm512_castps_si512(_mm512_loadu_ps(col + (2 * p + t) * vp));
          bad |= _mm512_cmpeq_epi32_mask(_mm512_and_si512(x, exp_mask), exp_mask);
        }
        amx_pair16(col + 2 * p * vp, col + (2 * p + 1) * vp, row);
      } else {
        std::memset(row, 0, 64);
      }
    }
  return bad != 0;
}

/// K pairs of 16 keys in VNNI rows: out[(p 16 + i) 2 + t] = k0[i key_stride
/// + 2 p + t] for p < pairs, i < 16 (bf16 bits; key_stride even, k0 4-byte
/// aligned: one 32-bit gather per row).
BLOCKATTN_TARGET_AMX inline void amx_gather_k16(const std::uint16_t* k0, std::ptrdiff_t key_stride,
                                                int pairs, std::uint16_t* out) {
  const __m512i idx =
      _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                         _mm512_set1_epi32(static_cast<int>(key_stride / 2)));
  for (int p = 0; p < pairs; ++p)
    _mm512_storeu_si512(static_cast<void*>(out + 32 * p),
                        _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), 0xFFFF, idx,
                                                    static_cast<const void*>(k0 + 2 * p), 4));
}

/// 16 VNNI pairs of two bf16 rows: out[2 i] = a[i], out[2 i + 1] = b[i];
/// true when one of them is an inf or NaN.
BLOCKATTN_TARGET_AMX inline bool amx_pair_bf16x16(const std::uint16_t* a, const std::uint16_t* b,
                                                  std::uint16_t* out) {
  const __m512i x =
      _mm512_maskz_cvtepu16_epi32(0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a)));
  const __m512i y =
      _mm512_maskz_cvtepu16_epi32(0xFFFF, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)));
  _mm512_storeu_si512(static_cast<void*>(out),
                      _mm512_or_si512(x, _mm512_maskz_slli_epi32(0xFFFF, y, 16)));
  const __m512i e = _mm512_set1_epi32(0x7f80);
  return (_mm512_cmpeq_epi32_mask(_mm512_and_si512(x, e), e) |
          _mm512_cmpeq_epi32_mask(_mm512_and_si512(y, e), e)) != 0;
}

/// dst[0, n) = bf16 bits of src[d] * scale, rounded to nearest even with NaN
/// quieted: bitwise impl::bf16_bits (half.hpp), 16 values at a time.
BLOCKATTN_TARGET_AMX inline void amx_store_bf16_row(std::uint16_t* dst, const float* src, int n,
                                                    float scale) {
  const __m512 f = _mm512_set1_ps(scale);
  const __m512i bias = _mm512_set1_epi32(0x7fff), one = _mm512_set1_epi32(1);
  const __m512i abs_mask = _mm512_set1_epi32(0x7fffffff), inf = _mm512_set1_epi32(0x7f800000);
  const __m512i quiet = _mm512_set1_epi32(0x00400000);
  int d = 0;
  for (; d + 16 <= n; d += 16) {
    const __m512i u = _mm512_castps_si512(_mm512_mul_ps(_mm512_loadu_ps(src + d), f));
    const __m512i rounded = _mm512_add_epi32(
        u, _mm512_add_epi32(bias, _mm512_and_si512(_mm512_maskz_srli_epi32(0xFFFF, u, 16), one)));
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, abs_mask), inf);
    const __m512i bits = _mm512_mask_or_epi32(rounded, nan, u, quiet);
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(dst + d),
        _mm512_maskz_cvtepi32_epi16(0xFFFF, _mm512_maskz_srli_epi32(0xFFFF, bits, 16)));
  }
  for (; d < n; ++d) dst[d] = bf16_bits(src[d] * scale);
}

/// amx_block on AVX512-BF16 vectors (the engine of CPUs without AMX: Zen 4,
/// Cooper Lake): C (32 x 32) [+]= A B in groups of 8 rows x 32 columns, 16
/// accumulators, each k pair one broadcast of A's two bf16 and a
/// _mm512_dpbf16_ps per 16 columns. The same operands and layouts.
BLOCKATTN_TARGET_AMX inline void bf16_vector_block(int chunks, const std::uint16_t* a, int lda,
                                                   const std::uint16_t* b0, const std::uint16_t* b1,
                                                   float* c, int ldc, bool load_c) {
  for (int r0 = 0; r0 < 32; r0 += 8) {
    __m512 acc[8][2];
    BLOCKATTN_AMX_UNROLL
    for (int i = 0; i < 8; ++i) {
      float* const cr = c + std::size_t(r0 + i) * ldc;
      acc[i][0] = load_c ? _mm512_loadu_ps(cr) : _mm512_setzero_ps();
      acc[i][1] = load_c ? _mm512_loadu_ps(cr + 16) : _mm512_setzero_ps();
    }
    for (int kc = 0; kc < chunks; ++kc)
      for (int p = 0; p < 16; ++p) {
        const __m512i x0 =
            _mm512_loadu_si512(static_cast<const void*>(b0 + amx_b_tile * kc + 32 * p));
        const __m512i x1 =
            _mm512_loadu_si512(static_cast<const void*>(b1 + amx_b_tile * kc + 32 * p));
        const __m512bh y0 = reinterpret_cast<const __m512bh&>(x0);
        const __m512bh y1 = reinterpret_cast<const __m512bh&>(x1);
        BLOCKATTN_AMX_UNROLL
        for (int i = 0; i < 8; ++i) {
          std::int32_t pair;
          std::memcpy(&pair, a + std::size_t(r0 + i) * lda + 32 * kc + 2 * p, 4);
          const __m512i w = _mm512_set1_epi32(pair);
          const __m512bh v = reinterpret_cast<const __m512bh&>(w);
          acc[i][0] = _mm512_dpbf16_ps(acc[i][0], v, y0);
          acc[i][1] = _mm512_dpbf16_ps(acc[i][1], v, y1);
        }
      }
    BLOCKATTN_AMX_UNROLL
    for (int i = 0; i < 8; ++i) {
      float* const cr = c + std::size_t(r0 + i) * ldc;
      _mm512_storeu_ps(cr, acc[i][0]);
      _mm512_storeu_ps(cr + 16, acc[i][1]);
    }
  }
}

/// Runs f() inside a function compiled for AMX that inlines what f calls.
struct AmxEntry {
  template <class F>
  BLOCKATTN_TARGET_AMX __attribute__((flatten)) static void run(const F& f) {
    f();
  }
};
#endif

/// The bf16 bits of an fp32 value that is a bf16 value (the packed blocks of
/// bf16 inputs are exact widenings): its upper half.
KOKKOS_FORCEINLINE_FUNCTION std::uint16_t bf16_upper_bits(float x) {
  std::uint32_t u;
  std::memcpy(&u, &x, 4);
  return static_cast<std::uint16_t>(u >> 16);
}

}  // namespace impl

/// The host matrix engine of this process (see kernel/host/amx.hpp): whether
/// bf16 forwards on host spaces run AMX tile products, and why not. Throws
/// blockattn::invalid_argument when BLOCKATTN_HOST_MATRIX is not auto, amx, avx512bf16 or off.
inline HostMatrixEngine host_matrix_engine() {
  return impl::host_matrix_engine();
}

}  // namespace blockattn
