// SPDX-License-Identifier: Apache-2.0
// A tensor-core forward for 16-bit inputs on CUDA (sm_80 and later), in the
// FlashAttention-2 recipe, for every mask on global positions:
//
//   one CTA = 4 warps of one (batch, head); the default variant ("wide")
//   takes 128 query rows, two 16-row m-tiles per warp, so that each K / V
//   fragment read from shared memory feeds four products; "regs" and "smem"
//   take 64 rows, one m-tile per warp (Variant);
//   Q (128 or 64 x D), K and V tiles (64 keys x D) staged in shared memory by
//   16-byte cp.async, XOR-swizzled by 16-byte chunk (chunk ^ (row & 7)) so
//   that ldmatrix reads 8 rows without bank conflicts; Q's mma A fragments
//   read from shared memory at every key tile (kept in registers by "regs");
//   S = Q K^T by mma.sync.m16n8k16 (fp32 accumulation); the
//   online softmax in exp2 on the fragments; P rounded to the storage type
//   as the A fragment of O += P V (V through ldmatrix.trans); V's load
//   overlaps Q K^T and the next K tile's load overlaps P V.
//
// Key tiles are classified: empty tiles are never loaded, full tiles take no
// mask work, partial tiles apply the mask per element. Masks with
// allowed_keys() (causal, windows, prefix-LM, documents, ...) give every row
// of the CTA its interval once, kept in shared memory (CtaSpans,
// row_spans.hpp): a tile's kind is then four comparisons, the CTA visits
// only the tiles the rows' hull reaches, and for a tile that needs masking
// one thread per row turns its interval into the tile's key indices it sees
// (TileKeys: two binary searches over the tile's positions), so that the
// mask is two 32-bit comparisons per element. Other masks: classify() on
// the tile's position box, allowed() per key of a partial tile. Positions
// come from the two maps (any increasing map: offsets, partitions' affine
// maps, tables).
//
// Output: normalised O (storage type) and LSE (fp32, natural log) of every
// row; rows that see no key get O = 0 and LSE = -inf.
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

/// One CTA: MT m-tiles of 16 query rows per warp (Variant). QInRegs (regs):
/// Q's fragments loaded once and kept in registers (1 CTA per SM guaranteed
/// by the bounds, the compiler takes what it needs); otherwise read from
/// shared memory at every key tile (smem: bounded for 3 CTAs per SM; wide: 2).
template <int D, bool IsBf16, int MT, bool QInRegs, class Mask, class QPos, class KPos>
__global__ void __launch_bounds__(threads, QInRegs ? 1 : (MT == 1 ? 3 : 2))
    forward_kernel(const Args a, const Mask mask, const QPos qpos, const KPos kpos) {
  static_assert(D % 16 == 0 && D <= 256, "head dim: a multiple of 16 up to 256");
  static_assert(!QInRegs || MT == 1, "Q in registers: one m-tile per warp");
  constexpr int BM = block_m_of(MT);  // query rows of the CTA
  BLOCKATTN_DYNAMIC_SHARED(std::uint16_t, smem);
  std::uint16_t* sq = smem;
  std::uint16_t* sk = smem + BM * D;
  std::uint16_t* sv = sk + block_n * D;

  // The last rows (the longest under a causal mask) first (cta_order.hpp).
  const CtaTile cta = cta_tile(a.order, blockIdx.x, blockIdx.y, blockIdx.z, true);
  if (!cta.live) return;  // (the whole CTA: an idle place of a last group)
  const int m_block = cta.block, h = cta.head, b = cta.batch;
  const int kvh = a.order.per_kv.div(h);
  const int q0 = m_block * BM;
  const int q1 = q0 + BM < a.queries ? q0 + BM : a.queries;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;

  const auto* qg = static_cast<const std::uint16_t*>(a.q) + b * a.q_stride[0] + h * a.q_stride[2];
  const auto* kg = static_cast<const std::uint16_t*>(a.k) + b * a.k_stride[0] + kvh * a.k_stride[2];
  const auto* vg = static_cast<const std::uint16_t*>(a.v) + b * a.v_stride[0] + kvh * a.v_stride[2];

  __shared__ cta_spans_t<Mask, BM> spans;
  // Masks with allowed_keys(): the rows' TileKeys of the tile being computed
  // (read before the loop's second barrier, then written for the next).
  constexpr bool ranged = has_allowed_keys<Mask>::value;
  __shared__ std::uint32_t tile_keys[ranged ? BM : 1];
  int tiles = (a.keys + block_n - 1) / block_n, j_first = 0;
  if constexpr (ranged) cta_spans(mask, qpos, kpos, q0, q1, a.keys, spans, j_first, tiles);
  int j = block_next_tile(mask, spans, qpos, kpos, q0, q1, a.keys, j_first, tiles);
  if (j < tiles) stage_tile_keys(mask, spans, kpos, a.keys, j, tile_keys);

  // Q and the first K tile.
  load_tile<D, BM>(sq, qg + std::int64_t(q0) * a.q_stride[1], a.q_stride[1], 0, q1 - q0);
  if (j < tiles) load_tile<D>(sk, kg, a.k_stride[1], j * block_n, a.keys);
  cp_async_commit();

  // This thread's rows: g and g + 8 of each of its warp's m-tiles (warp w
  // holds rows [16 MT w, 16 MT (w + 1)) of the CTA); their masks are read
  // where a partial tile needs them (registers are scarce at MT = 2).
  const int row0 = q0 + warp * MT * 16 + g;  // row g of m-tile 0
  const float scale_log2 = a.scale * 1.4426950408889634f;

  constexpr int kd = D / 16;  // k-steps of Q K^T, and 16-column pairs of O
  std::uint32_t qf[QInRegs ? kd : MT][4];
  float o[MT][2 * kd][4];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int n = 0; n < 2 * kd; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) o[mt][n][e] = 0.0f;
  float m_lo[MT], m_hi[MT], l_lo[MT], l_hi[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    m_lo[mt] = m_hi[mt] = -INFINITY;
    l_lo[mt] = l_hi[mt] = 0.0f;
  }
  bool have_q = false;

  while (j < tiles) {
    const int k0 = j * block_n;
    const int k1 = k0 + block_n < a.keys ? k0 + block_n : a.keys;
    const TileKind kind = block_tile_kind(mask, spans, qpos, kpos, q0, q1, k0, k1);
    cp_async_wait_all();  // K_j (and Q)
    __syncthreads();      // ... visible to every warp; V's buffer free
    load_tile<D>(sv, vg, a.v_stride[1], k0, a.keys);
    cp_async_commit();
    if (QInRegs && !have_q) {
#pragma unroll
      for (int kk = 0; kk < kd; ++kk)
        ldmatrix_x4(qf[QInRegs ? kk : 0], sq + frag_offset<D>(ldsm_a(lane), warp * 16, 2 * kk));
      have_q = true;
    }

    // S = Q K^T: 16 MT rows x 64 keys per warp, 8 n-tiles of 8 keys; each K
    // fragment feeds the products of every m-tile.
    float s[MT][8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[mt][n][e] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < kd; ++kk) {
      if constexpr (!QInRegs) {
#pragma unroll
        for (int mt = 0; mt < MT; ++mt)
          ldmatrix_x4(qf[mt], sq + frag_offset<D>(ldsm_a(lane), (warp * MT + mt) * 16, 2 * kk));
      }
#pragma unroll
      for (int p = 0; p < 4; ++p) {
        std::uint32_t r[4];
        ldmatrix_x4(r, sk + frag_offset<D>(ldsm_b(lane), 16 * p, 2 * kk));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const std::uint32_t(&qa)[4] = qf[QInRegs ? kk : mt];
          mma16816<IsBf16>(s[mt][2 * p], qa, r[0], r[1]);
          mma16816<IsBf16>(s[mt][2 * p + 1], qa, r[2], r[3]);
        }
      }
    }

    // Mask: keys past the end, and the mask itself in partial tiles.
    // `masked` (mask_fragment): the keys masked out, which P V must skip
    // when V holds inf or NaN.
    std::uint32_t masked[MT];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) masked[mt] = 0;
    if (kind == TileKind::partial || k1 - k0 < block_n) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        const int r = row0 - q0 + 16 * mt;  // this thread's row lo of m-tile mt in the CTA
        if constexpr (ranged) {
          masked[mt] =
              mask_fragment_keys(s[mt], TileKeys(tile_keys[r]), TileKeys(tile_keys[r + 8]), t);
        } else {
          const bool check = kind == TileKind::partial;
          masked[mt] =
              mask_fragment(s[mt], row_test(mask, spans, qpos, q0, q1, r, check),
                            row_test(mask, spans, qpos, q0, q1, r + 8, check), kpos, k0, k1, t);
        }
      }
    }

    // Online softmax of the rows; P packed in pairs of the storage type at
    // once (the products' A operand: 32 registers where S held 64).
    std::uint32_t pk[MT][8][2];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      softmax_step(s[mt], o[mt], m_lo[mt], m_hi[mt], l_lo[mt], l_hi[mt], scale_log2);
#pragma unroll
      for (int n = 0; n < 8; ++n) {
        pk[mt][n][0] = pack2<IsBf16>(s[mt][n][0], s[mt][n][1]);
        pk[mt][n][1] = pack2<IsBf16>(s[mt][n][2], s[mt][n][3]);
      }
    }

    // V_j ready; every warp is done with K_j: load the next live K tile.
    cp_async_wait_all();
    // A partial tile whose V holds inf or NaN: masked keys (P = 0) must not
    // turn 0 * inf into NaN, so P V skips them (rare: a slower exact loop).
    bool v_bad = false;
    if (kind == TileKind::partial) {
      __syncthreads();
      v_bad = __syncthreads_or(tile_not_finite<D, IsBf16>(sv));
    } else {
      __syncthreads();
    }
    const int next = block_next_tile(mask, spans, qpos, kpos, q0, q1, a.keys, j + 1, tiles);
    if (next < tiles) {
      load_tile<D>(sk, kg, a.k_stride[1], next * block_n, a.keys);
      stage_tile_keys(mask, spans, kpos, a.keys, next, tile_keys);
    }
    cp_async_commit();
    if (v_bad) {
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) masked_pv<D, IsBf16>(o[mt], pk[mt], masked[mt], sv, lane);
      j = next;
      continue;
    }

    // O += P V: P's C fragments are the A fragments of 16-key steps; each V
    // fragment feeds the products of every m-tile.
#pragma unroll
    for (int ks = 0; ks < 4; ++ks) {
      std::uint32_t pa[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
        for (int i = 0; i < 4; ++i) pa[mt][i] = pk[mt][2 * ks + c2a_ntile(i)][c2a_elem(i) / 2];
      }
#pragma unroll
      for (int dp = 0; dp < kd; ++dp) {
        std::uint32_t r[4];
        ldmatrix_x4_trans(r, sv + frag_offset<D>(ldsm_bt(lane), 16 * ks, 2 * dp));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          mma16816<IsBf16>(o[mt][2 * dp], pa[mt], r[0], r[1]);
          mma16816<IsBf16>(o[mt][2 * dp + 1], pa[mt], r[2], r[3]);
        }
      }
    }
    j = next;
  }
  cp_async_wait_all();

  // Normalise and write O and LSE.
  auto* og = static_cast<std::uint16_t*>(a.o) + b * a.o_stride[0] + h * a.o_stride[2];
  float* lg = a.lse + b * a.lse_stride[0] + h * a.lse_stride[1];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const int row_lo = row0 + 16 * mt, row_hi = row_lo + 8;
    float ll = l_lo[mt], lh = l_hi[mt];
#pragma unroll
    for (int d = 1; d <= 2; d <<= 1) {
      ll += __shfl_xor_sync(0xffffffffu, ll, d);
      lh += __shfl_xor_sync(0xffffffffu, lh, d);
    }
    // l == 0: the row saw nothing (O = 0, LSE = -inf); a NaN l stays NaN.
    const float inv_lo = ll == 0.0f ? 0.0f : 1.0f / ll;
    const float inv_hi = lh == 0.0f ? 0.0f : 1.0f / lh;
#pragma unroll
    for (int n = 0; n < 2 * kd; ++n) {
      const int col = 8 * n + 2 * t;
      if (row_lo < q1)
        *reinterpret_cast<std::uint32_t*>(og + std::int64_t(row_lo) * a.o_stride[1] + col) =
            pack2<IsBf16>(o[mt][n][0] * inv_lo, o[mt][n][1] * inv_lo);
      if (row_hi < q1)
        *reinterpret_cast<std::uint32_t*>(og + std::int64_t(row_hi) * a.o_stride[1] + col) =
            pack2<IsBf16>(o[mt][n][2] * inv_hi, o[mt][n][3] * inv_hi);
    }
    if (t == 0) {
      if (row_lo < q1)
        lg[std::int64_t(row_lo) * a.lse_stride[2]] =
            ll == 0.0f ? -INFINITY : m_lo[mt] * a.scale + logf(ll);
      if (row_hi < q1)
        lg[std::int64_t(row_hi) * a.lse_stride[2]] =
            lh == 0.0f ? -INFINITY : m_hi[mt] * a.scale + logf(lh);
    }
  }
}

/// Enqueues `kernel` (threads per CTA, `bytes` of dynamic shared memory,
/// allowed here by cudaFuncSetAttribute) over `blocks` CTAs for each of
/// batch x heads units in the order of cta_order.hpp: `args` (Args or
/// BackwardArgs) with its `order` set, one launch per max_ranks ranks.
/// args.cta_group 0: cta_group() for the slots of the current device (its SM
/// count times the kernel's occupancy). Returns CUDA's error of the first
/// launch that failed; cudaErrorInvalidConfiguration where blocks or units
/// pass 2^31 - 1.
template <class Kernel, class KArgs, class... Rest>
cudaError_t launch_ordered(Kernel kernel, int bytes, cudaStream_t stream, long long blocks,
                           int heads, KArgs args, const Rest&... rest) {
  cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (e != cudaSuccess) return e;
  int group = args.cta_group;
  if (group < 1) {
    int device = 0, sms = 0, per_sm = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess ||
        cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, bytes) !=
            cudaSuccess) {
      (void)cudaGetLastError();  // (not sticky) the order falls back to unit by unit
      sms = per_sm = 0;
    }
    const long long units = static_cast<long long>(args.batch) * heads;
    group = cta_group(units < INT_MAX ? int(units) : INT_MAX, static_cast<long long>(sms) * per_sm);
  }
  if (!cta_order(blocks, args.batch, heads, group, args.order))
    return cudaErrorInvalidConfiguration;
  const int kv_group = args.kv_heads > 0 ? args.heads / args.kv_heads : 1;
  args.order.per_kv = FastDiv(kv_group > 1 ? kv_group : 1);
  for (long long first = 0; first < blocks; first += max_ranks) {
    args.order.rank_offset = int(first);
    const CtaGrid g = cta_grid_extents(args.order);
    BLOCKATTN_CUDA_LAUNCH(kernel, dim3(unsigned(g.x), unsigned(g.y), unsigned(g.z)), threads, bytes,
                          stream)
    (args, rest...);
    e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

/// Whether this kernel takes a problem: head dim 64 or 128, contiguous head
/// dims, rows 16-byte aligned, heads a multiple of kv_heads.
inline bool supports(const Args& a, int dim) {
  if (dim != 64 && dim != 128) return false;
  if (a.kv_heads <= 0 || a.heads % a.kv_heads != 0) return false;
  for (const void* p : {a.q, a.k, a.v, static_cast<const void*>(a.o)})
    if (reinterpret_cast<std::uintptr_t>(p) % 16 != 0) return false;
  for (const std::int64_t* s : {a.q_stride, a.k_stride, a.v_stride, a.o_stride})
    for (int i = 0; i < 3; ++i)
      if (s[i] % 8 != 0) return false;
  return true;
}

/// Enqueues the forward on `stream`; returns CUDA's error of the launch.
template <bool IsBf16, class Mask, class QPos, class KPos>
cudaError_t forward(const Args& a, int dim, const Mask& mask, const QPos& qpos, const KPos& kpos,
                    cudaStream_t stream) {
  if (a.queries <= 0 || a.batch <= 0 || a.heads <= 0) return cudaSuccess;
  auto launch = [&](auto kernel, Variant v) {
    return launch_ordered(kernel, smem_bytes(dim, v), stream,
                          (a.queries + block_m(v) - 1) / block_m(v), a.heads, a, mask, qpos, kpos);
  };
  if constexpr (all_variants) {
    switch (a.variant) {
      case Variant::regs:
        if (dim == 64)
          return launch(forward_kernel<64, IsBf16, 1, true, Mask, QPos, KPos>, Variant::regs);
        return launch(forward_kernel<128, IsBf16, 1, true, Mask, QPos, KPos>, Variant::regs);
      case Variant::smem:
        if (dim == 64)
          return launch(forward_kernel<64, IsBf16, 1, false, Mask, QPos, KPos>, Variant::smem);
        return launch(forward_kernel<128, IsBf16, 1, false, Mask, QPos, KPos>, Variant::smem);
      case Variant::wide:
        break;
    }
  } else if (a.variant != Variant::wide) {
    return cudaErrorNotSupported;  // flash_variant() accepts only wide here
  }
  if (dim == 64)
    return launch(forward_kernel<64, IsBf16, 2, false, Mask, QPos, KPos>, Variant::wide);
  return launch(forward_kernel<128, IsBf16, 2, false, Mask, QPos, KPos>, Variant::wide);
}

}  // namespace blockattn::impl::flash

#endif
