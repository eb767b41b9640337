// SPDX-License-Identifier: Apache-2.0
// What BlockAttn's tensor-core kernels share (flash_forward.hpp,
// flash_forward_f32.hpp, flash_backward.hpp): the variants and one call's
// operands, shared-memory staging (cp.async, ldmatrix), 16-bit packing, the
// masks' tile classification on the CTA's rows (CtaSpans, TileKeys) and the
// online-softmax step on mma fragments.
//
// Compiled only in nvcc's passes with Kokkos' CUDA backend, or on the host
// with BLOCKATTN_CUDA_EMULATION (tests/cuda_emu: the kernels' source run and
// checked on a CPU; the PTX wrappers below then come from cuda_emu_ptx.hpp).
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/kernel/cuda/cta_order.hpp>
#include <blockattn/kernel/cuda/flash_frag.hpp>
#include <blockattn/kernel/cuda/row_spans.hpp>
#include <blockattn/policy/mask.hpp>

#include <cstdint>

#if (defined(KOKKOS_ENABLE_CUDA) && defined(__CUDACC__)) || defined(BLOCKATTN_CUDA_EMULATION)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstring>

// kernel<<<grid, block, bytes, stream>>>, and a kernel's dynamic shared
// memory (128-byte aligned), in nvcc's passes and in the emulator.
#if defined(BLOCKATTN_CUDA_EMULATION)
#include <cuda_emu_ptx.hpp>
#define BLOCKATTN_CUDA_LAUNCH(kernel, grid, block, bytes, stream) \
  ::blockattn_cuda_emu::launch(kernel, grid, block, bytes, stream)
#define BLOCKATTN_DYNAMIC_SHARED(type, name) \
  type* const name = static_cast<type*>(::blockattn_cuda_emu::dynamic_shared())
#else
#define BLOCKATTN_CUDA_LAUNCH(kernel, grid, block, bytes, stream) \
  kernel<<<grid, block, bytes, stream>>>
#define BLOCKATTN_DYNAMIC_SHARED(type, name) extern __shared__ __align__(128) type name[]
#endif

namespace blockattn::impl::flash {

constexpr int block_n = 64;  // keys of one tile
constexpr int warps = 4;     // 16 query rows (one m-tile) each, or 32 (wide)
constexpr int threads = warps * 32;

/// The kernel's variants (all checked and timed by tests/cuda_flash_check.cpp;
/// the library takes wide, and compiles only wide unless
/// BLOCKATTN_FLASH_ALL_VARIANTS is 1, in which case BLOCKATTN_FLASH_VARIANT
/// may name another, see flash_path.hpp):
///   regs   64 rows per CTA, Q's fragments kept in registers (2 CTAs per SM);
///   smem   64 rows per CTA, Q's fragments re-read from shared memory at every
///          key tile (fewer registers: 3 CTAs per SM);
///   wide   128 rows per CTA (two m-tiles per warp, Q from shared memory):
///          each K and V fragment read by ldmatrix feeds four products instead
///          of two (shared-memory reads per product halved); 2 CTAs per SM,
///          254-255 registers at D = 128 and no spills (ptxas, nvcc 13.0,
///          AffinePositions, the built-in masks), since P is packed to 16
///          bits as the softmax makes it (before: 28-108 bytes spilled).
enum class Variant { regs, smem, wide };

/// Whether this translation unit compiles the kernels of every variant (for
/// comparisons: tests/cuda_flash_check.cpp) or wide alone (a third of the
/// kernels' compile time; the default).
#if defined(BLOCKATTN_FLASH_ALL_VARIANTS) && BLOCKATTN_FLASH_ALL_VARIANTS
constexpr bool all_variants = true;
#else
constexpr bool all_variants = false;
#endif

/// A variant's name, and the variant a name means (false: no variant has it).
constexpr const char* variant_name(Variant v) {
  return v == Variant::regs ? "regs" : v == Variant::smem ? "smem" : "wide";
}
inline bool parse_variant(const char* name, Variant& v) {
  for (Variant c : {Variant::regs, Variant::smem, Variant::wide})
    if (std::strcmp(name, variant_name(c)) == 0) {
      v = c;
      return true;
    }
  return false;
}

/// m-tiles (16 rows) per warp, and query rows per CTA, of a variant.
constexpr int m_tiles(Variant v) {
  return v == Variant::wide ? 2 : 1;
}
__host__ __device__ constexpr int block_m_of(int m_tiles_per_warp) {
  return warps * 16 * m_tiles_per_warp;
}
constexpr int block_m(Variant v) {
  return block_m_of(m_tiles(v));
}

/// One call's operands: element strides (batch, sequence, head) of Q, K, V,
/// O (head dim contiguous) and (batch, head, row) of LSE.
struct Args {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* o = nullptr;
  float* lse = nullptr;
  std::int64_t q_stride[3] = {0, 0, 0}, k_stride[3] = {0, 0, 0}, v_stride[3] = {0, 0, 0},
               o_stride[3] = {0, 0, 0}, lse_stride[3] = {0, 0, 0};
  int batch = 0, heads = 0, kv_heads = 0, queries = 0, keys = 0;
  float scale = 1.0f;
  Variant variant = Variant::wide;  // the kernel variant (see Variant)
  // The CTAs' order (cta_order.hpp): (batch, head) units per group; 0:
  // cta_group() for the GPU; 1: unit by unit (the order before, for
  // comparisons). The launch sets `order` from it, which the kernel reads.
  int cta_group = 0;
  CtaOrder order;
};

/// Shared-memory bytes of one CTA for head dim D: Q, K and V tiles.
constexpr int smem_bytes(int D, Variant v) {
  return (block_m(v) + 2 * block_n) * D * 2;
}

#if !defined(BLOCKATTN_CUDA_EMULATION)  // cuda_emu_ptx.hpp
__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

/// 16 bytes global -> shared; src_bytes 0 fills zeros (rows past the end).
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::);
}
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

__device__ __forceinline__ void ldmatrix_x4(std::uint32_t r[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t r[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

/// c += a * b, m16n8k16, fp32 accumulation; bf16 (IsBf16) or fp16 operands.
template <bool IsBf16>
__device__ __forceinline__ void mma16816(float c[4], const std::uint32_t a[4], std::uint32_t b0,
                                         std::uint32_t b1) {
  if constexpr (IsBf16) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

#endif  // !BLOCKATTN_CUDA_EMULATION

/// Two floats as a packed pair of the storage type (lo in the low half).
template <bool IsBf16>
__device__ __forceinline__ std::uint32_t pack2(float lo, float hi) {
  if constexpr (IsBf16) {
    const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const std::uint32_t*>(&h);
  } else {
    const __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<const std::uint32_t*>(&h);
  }
}

#if !defined(BLOCKATTN_CUDA_EMULATION)  // cuda_emu_ptx.hpp
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}
#endif

/// Loads rows [row0, row0 + TileRows) of a (rows x D) operand into a
/// swizzled tile; rows at or past `rows` are zero-filled.
template <int D, int TileRows = block_n>
__device__ __forceinline__ void load_tile(std::uint16_t* tile, const std::uint16_t* base,
                                          std::int64_t row_stride, int row0, int rows) {
  constexpr int chunks = D / 8;  // 16-byte chunks per row
  for (int i = threadIdx.x; i < TileRows * chunks; i += threads) {
    const int r = i / chunks, c = i % chunks;
    const int row = row0 + r;
    const bool in = row < rows;
    const std::uint16_t* src = base + (in ? std::int64_t(row) * row_stride : 0) + c * 8;
    cp_async16(tile + swz<D>(r, c), src, in ? 16 : 0);
  }
}

template <class Mask, class QPos, class KPos>
__device__ __forceinline__ TileKind tile_kind(const Mask& mask, const QPos& qpos, const KPos& kpos,
                                              int q0, int q1, int k0, int k1) {
  return mask.classify(qpos(q0), qpos(q1 - 1) + 1, kpos(k0), kpos(k1 - 1) + 1);
}

/// Whether this thread's share of a V tile holds inf or NaN.
template <int D, bool IsBf16>
__device__ __forceinline__ bool tile_not_finite(const std::uint16_t* tile) {
  constexpr std::uint32_t exp = IsBf16 ? 0x7f80u : 0x7c00u;  // exponent all ones
  bool bad = false;
  for (int i = threadIdx.x; i < block_n * D / 8; i += threads) {
    const uint4 x = reinterpret_cast<const uint4*>(tile)[i];
    for (std::uint32_t w : {x.x, x.y, x.z, x.w})
      bad = bad || (w & exp) == exp || ((w >> 16) & exp) == exp;
  }
  return bad;
}

template <bool IsBf16>
__device__ __forceinline__ float storage_to_float(std::uint16_t u) {
  if constexpr (IsBf16) {
    __nv_bfloat16_raw r;
    r.x = u;
    return __bfloat162float(__nv_bfloat16(r));
  } else {
    __half_raw r;
    r.x = u;
    return __half2float(__half(r));
  }
}

/// O += P V for one tile, skipping the masked keys (bits of `masked`, see
/// the kernel): each thread gathers its group's P (packed pairs of the
/// storage type, as the tensor-core product takes them) by shuffles and
/// reads V from shared memory.
template <int D, bool IsBf16>
__device__ __forceinline__ void masked_pv(float (&o)[D / 8][4], const std::uint32_t (&p)[8][2],
                                          std::uint32_t masked, const std::uint16_t* sv, int lane) {
  const int t = lane % 4;
  for (int src = 0; src < 4; ++src) {
    const int from = (lane & ~3) | src;
    const std::uint32_t mk = __shfl_sync(0xffffffffu, masked, from);
#pragma unroll
    for (int nn = 0; nn < 8; ++nn) {
      const std::uint32_t w_lo = __shfl_sync(0xffffffffu, p[nn][0], from);
      const std::uint32_t w_hi = __shfl_sync(0xffffffffu, p[nn][1], from);
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int key = 8 * nn + 2 * src + e;
        const float p_lo = storage_to_float<IsBf16>(std::uint16_t(e ? w_lo >> 16 : w_lo & 0xffffu));
        const float p_hi = storage_to_float<IsBf16>(std::uint16_t(e ? w_hi >> 16 : w_hi & 0xffffu));
        const bool lo = ((mk >> (2 * nn + e)) & 1u) == 0,
                   hi = ((mk >> (16 + 2 * nn + e)) & 1u) == 0;
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            const int col = 8 * n + 2 * t + c;
            const float x = storage_to_float<IsBf16>(sv[swz<D>(key, col >> 3) + (col & 7)]);
            if (lo) o[n][c] += p_lo * x;
            if (hi) o[n][2 + c] += p_hi * x;
          }
      }
    }
  }
}

/// The first key index in [0, keys) whose position is >= p (keys if none):
/// positions increase with the index.
template <class KPos>
__device__ __forceinline__ int first_key_at(const KPos& kpos, int keys, index_type p) {
  int lo = 0, hi = keys;
  while (lo < hi) {
    const int mid = lo + (hi - lo) / 2;
    if (kpos(mid) < p)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/// The keys of tile [k0, k0 + n) (n <= 64) whose position is below p: a
/// prefix of the tile, positions increasing with the index.
template <class KPos>
__device__ __forceinline__ int keys_below(const KPos& kpos, int k0, int n, index_type p) {
  if (kpos(k0) >= p) return 0;
  if (kpos(k0 + n - 1) < p) return n;
  int lo = 1, hi = n - 1;  // kpos(k0 + lo - 1) < p <= kpos(k0 + hi)
  while (lo < hi) {
    const int mid = (lo + hi) / 2;
    if (kpos(k0 + mid) < p)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

/// For masks with allowed_keys(): the keys of tile [k0, k0 + n) that a row
/// with interval [begin, end) sees, as a range of the tile's indices
/// [lo, hi), packed lo | hi << 16 (TileKeys). One thread per row computes it
/// once per tile into shared memory, so that masking a fragment takes two
/// 32-bit comparisons per element, where testing positions took a position
/// and two 64-bit comparisons per element (and the registers to hold them).
template <class KPos>
__device__ __forceinline__ std::uint32_t tile_key_range(const KPos& kpos, int k0, int n,
                                                        index_type begin, index_type end) {
  const int lo = keys_below(kpos, k0, n, begin);
  int hi = begin < end ? keys_below(kpos, k0, n, end) : lo;
  if (hi < lo) hi = lo;
  return std::uint32_t(lo) | (std::uint32_t(hi) << 16);
}

/// A row's keys in a tile (tile_key_range): index i of the tile is seen
/// when lo <= i < hi.
struct TileKeys {
  int lo, hi;
  __device__ __forceinline__ explicit TileKeys(std::uint32_t packed)
      : lo(int(packed & 0xffffu)), hi(int(packed >> 16)) {}
  __device__ __forceinline__ bool operator()(int i) const { return lo <= i && i < hi; }
};

/// Masks one m-tile's S fragments (a thread's rows lo and hi = lo + 8) by
/// the rows' TileKeys; returns the masked elements as mask_fragment() does.
__device__ __forceinline__ std::uint32_t mask_fragment_keys(float (&s)[8][4], TileKeys lo_keys,
                                                            TileKeys hi_keys, int t) {
  std::uint32_t masked = 0;
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int i = 8 * n + 2 * t + e;
      if (!lo_keys(i)) {
        s[n][e] = -INFINITY;
        masked |= 1u << (2 * n + e);
      }
      if (!hi_keys(i)) {
        s[n][2 + e] = -INFINITY;
        masked |= 1u << (16 + 2 * n + e);
      }
    }
  return masked;
}

/// The intervals of a CTA's query rows in shared memory, for masks with
/// allowed_keys(): row r of the block sees key positions [begin[r], end[r]);
/// `bounds` reduces the live rows' (row_spans.hpp). Masks without
/// allowed_keys() get CtaSpans<1>, unused.
template <int BM>
struct CtaSpans {
  index_type begin[BM], end[BM];
  RowSpanBounds bounds;
  RowSpanBounds part[warps];  // per warp, on the way to `bounds`
};

/// The CtaSpans type of a kernel of BM rows for Mask.
template <class Mask, int BM>
using cta_spans_t = CtaSpans<has_allowed_keys<Mask>::value ? BM : 1>;

__device__ __forceinline__ index_type shfl_xor_index(index_type x, int d) {
  return index_type(__shfl_xor_sync(0xffffffffu, static_cast<long long>(x), d));
}

/// For masks with allowed_keys(), one thread per row: the intervals of rows
/// [q0, q1) into `sp` (rows at or past q1 see nothing), their bounds, and the
/// key tiles [j_begin, j_end) the hull of the intervals reaches (a CTA of a
/// short document never visits the tiles of others). Ends with a barrier.
template <int BM, class Mask, class QPos, class KPos>
__device__ void cta_spans(const Mask& mask, const QPos& qpos, const KPos& kpos, int q0, int q1,
                          int keys, CtaSpans<BM>& sp, int& j_begin, int& j_end) {
  static_assert(BM <= threads, "cta_spans: one thread per row");
  RowSpanBounds bd = RowSpanBounds::none();
  const int r = int(threadIdx.x);
  if (r < BM) {
    KeyInterval iv{0, 0};
    if (q0 + r < q1) {
      iv = mask.allowed_keys(qpos(q0 + r));
      bd.add(iv);
    }
    sp.begin[r] = iv.begin;
    sp.end[r] = iv.end;
  }
  for (int d = 16; d >= 1; d >>= 1) {
    RowSpanBounds o;
    o.lo = shfl_xor_index(bd.lo, d);
    o.hi = shfl_xor_index(bd.hi, d);
    o.all_lo = shfl_xor_index(bd.all_lo, d);
    o.all_hi = shfl_xor_index(bd.all_hi, d);
    bd.merge(o);
  }
  if (threadIdx.x % 32 == 0) sp.part[threadIdx.x / 32] = bd;
  __syncthreads();
  RowSpanBounds u = sp.part[0];
  for (int w = 1; w < warps; ++w) u.merge(sp.part[w]);
  if (threadIdx.x == 0) sp.bounds = u;
  __syncthreads();
  if (u.lo >= u.hi) {  // no row sees a key
    j_begin = j_end = 0;
    return;
  }
  const int k_lo = first_key_at(kpos, keys, u.lo), k_hi = first_key_at(kpos, keys, u.hi);
  j_begin = k_lo / block_n;
  j_end = (k_hi + block_n - 1) / block_n;
}

/// The kind of key tile [k0, k1) for the CTA's rows [q0, q1): from the rows'
/// intervals where the mask has allowed_keys(), else the mask's classify().
template <class Mask, class Spans, class QPos, class KPos>
__device__ __forceinline__ TileKind block_tile_kind(const Mask& mask, const Spans& sp,
                                                    const QPos& qpos, const KPos& kpos, int q0,
                                                    int q1, int k0, int k1) {
  if constexpr (has_allowed_keys<Mask>::value)
    return sp.bounds.kind(kpos(k0), kpos(k1 - 1));
  else
    return tile_kind(mask, qpos, kpos, q0, q1, k0, k1);
}

/// The first key tile at or after j that block_tile_kind() does not call
/// empty (`tiles` if none).
template <class Mask, class Spans, class QPos, class KPos>
__device__ __forceinline__ int block_next_tile(const Mask& mask, const Spans& sp, const QPos& qpos,
                                               const KPos& kpos, int q0, int q1, int keys, int j,
                                               int tiles) {
  for (; j < tiles; ++j) {
    const int k0 = j * block_n, k1 = k0 + block_n < keys ? k0 + block_n : keys;
    if (block_tile_kind(mask, sp, qpos, kpos, q0, q1, k0, k1) != TileKind::empty) return j;
  }
  return tiles;
}

/// Masks with allowed_keys(): the TileKeys of the CTA's BM rows in key tile
/// j into out[0, BM), one thread per row, when the tile needs masking
/// (partial, or short: past the last key); nothing otherwise, nor for other
/// masks. The caller's next barrier makes them visible.
template <int BM, class Mask, class KPos>
__device__ __forceinline__ void stage_tile_keys(const Mask&, const CtaSpans<BM>& sp,
                                                const KPos& kpos, int keys, int j,
                                                std::uint32_t* out) {
  if constexpr (has_allowed_keys<Mask>::value) {
    const int k0 = j * block_n, k1 = k0 + block_n < keys ? k0 + block_n : keys;
    if (k1 - k0 < block_n || sp.bounds.kind(kpos(k0), kpos(k1 - 1)) == TileKind::partial) {
      const int r = int(threadIdx.x);
      if (r < BM) out[r] = tile_key_range(kpos, k0, k1 - k0, sp.begin[r], sp.end[r]);
    }
  } else {
    (void)sp, (void)kpos, (void)keys, (void)j, (void)out;
  }
}

/// The mask of CTA row r (of rows [q0, q1)) in a tile: its interval from
/// `sp` where the mask has allowed_keys(), else allowed() per key; `check`
/// false (a full tile): every key.
template <class Mask, class Spans, class QPos>
__device__ __forceinline__ auto row_test(const Mask& mask, const Spans& sp, const QPos& qpos,
                                         int q0, int q1, int r, bool check) {
  if constexpr (has_allowed_keys<Mask>::value) {
    KeySpanTest ks;
    if (check) {
      ks.begin = sp.begin[r];
      ks.end = sp.end[r];
    }
    return ks;
  } else {
    const int row = q0 + r;
    return RowMask<Mask>(mask, qpos(row < q1 ? row : q1 - 1), check);
  }
}

/// Masks one m-tile's S fragments (a thread's rows lo and hi = lo + 8; 8
/// n-tiles of 8 keys) in key tile [k0, k0 + 64): keys at or past k1 and the
/// keys the rows' tests reject get -inf. Returns which: bit 2n + e (row lo)
/// and 16 + 2n + e (row hi) for element e of n-tile n.
template <class RT, class KPos>
__device__ __forceinline__ std::uint32_t mask_fragment(float (&s)[8][4], const RT& rt_lo,
                                                       const RT& rt_hi, const KPos& kpos, int k0,
                                                       int k1, int t) {
  std::uint32_t masked = 0;
#pragma unroll
  for (int n = 0; n < 8; ++n)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int key = k0 + 8 * n + 2 * t + e;
      const bool in = key < k1;
      const index_type kp = kpos(in ? key : k1 - 1);
      if (!in || !rt_lo(kp)) {
        s[n][e] = -INFINITY;
        masked |= 1u << (2 * n + e);
      }
      if (!in || !rt_hi(kp)) {
        s[n][2 + e] = -INFINITY;
        masked |= 1u << (16 + 2 * n + e);
      }
    }
  return masked;
}

/// One key tile's step of the online softmax of a thread's two rows (lo, hi)
/// of one m-tile (the 4 threads of a group share a row): S (8 n-tiles of 8
/// keys) becomes P = exp2(scale_log2 S - running max), O (N n-tiles of 8
/// columns) is rescaled to the new max, m (the max of raw scores) and l (this
/// thread's share of the row sums) are updated. A row that has seen nothing
/// yet keeps max -inf and subtracts 0 instead.
template <int N>
__device__ __forceinline__ void softmax_step(float (&s)[8][4], float (&o)[N][4], float& m_lo,
                                             float& m_hi, float& l_lo, float& l_hi,
                                             float scale_log2) {
  float mx_lo = -INFINITY, mx_hi = -INFINITY;
#pragma unroll
  for (int n = 0; n < 8; ++n) {
    mx_lo = fmaxf(mx_lo, fmaxf(s[n][0], s[n][1]));
    mx_hi = fmaxf(mx_hi, fmaxf(s[n][2], s[n][3]));
  }
#pragma unroll
  for (int d = 1; d <= 2; d <<= 1) {
    mx_lo = fmaxf(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, d));
    mx_hi = fmaxf(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, d));
  }
  const float mn_lo = fmaxf(m_lo, mx_lo), mn_hi = fmaxf(m_hi, mx_hi);
  const float mu_lo = mn_lo == -INFINITY ? 0.0f : mn_lo * scale_log2;
  const float mu_hi = mn_hi == -INFINITY ? 0.0f : mn_hi * scale_log2;
  const float alpha_lo = fast_exp2(m_lo * scale_log2 - mu_lo);
  const float alpha_hi = fast_exp2(m_hi * scale_log2 - mu_hi);
  m_lo = mn_lo;
  m_hi = mn_hi;
  float sum_lo = 0.0f, sum_hi = 0.0f;
#pragma unroll
  for (int n = 0; n < 8; ++n) {
    s[n][0] = fast_exp2(fmaf(s[n][0], scale_log2, -mu_lo));
    s[n][1] = fast_exp2(fmaf(s[n][1], scale_log2, -mu_lo));
    s[n][2] = fast_exp2(fmaf(s[n][2], scale_log2, -mu_hi));
    s[n][3] = fast_exp2(fmaf(s[n][3], scale_log2, -mu_hi));
    sum_lo += s[n][0] + s[n][1];
    sum_hi += s[n][2] + s[n][3];
  }
  l_lo = l_lo * alpha_lo + sum_lo;
  l_hi = l_hi * alpha_hi + sum_hi;
#pragma unroll
  for (int n = 0; n < N; ++n) {
    o[n][0] *= alpha_lo;
    o[n][1] *= alpha_lo;
    o[n][2] *= alpha_hi;
    o[n][3] *= alpha_hi;
  }
}

}  // namespace blockattn::impl::flash

#endif
