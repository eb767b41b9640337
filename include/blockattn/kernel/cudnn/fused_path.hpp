// SPDX-License-Identifier: Apache-2.0
// The fused path of the single-device calls: when a vendor's fused attention
// is built in for the execution space and value type (kernel/fused.hpp), the
// call's mask over its positions is one band piece (kernel/band.hpp) and the
// provider supports it, the call runs there; otherwise (or with
// ForwardOptions::portable_only) on BlockAttn's kernels.
#pragma once

#include <blockattn/core/config.hpp>
#include <blockattn/core/half.hpp>
#include <blockattn/kernel/band.hpp>
#include <blockattn/kernel/fused.hpp>
#include <blockattn/kernel/impl/exp2.hpp>
#include <blockattn/kernel/impl/pair_ops.hpp>
#include <blockattn/kernel/options.hpp>
#include <blockattn/kernel/validate.hpp>

#if defined(BLOCKATTN_ENABLE_CUDNN) && defined(KOKKOS_ENABLE_CUDA)
#define BLOCKATTN_FUSED_CUDNN 1
#include <blockattn/kernel/cudnn/cudnn.hpp>
#endif
#if defined(BLOCKATTN_EMULATE_FUSED)
#include <blockattn/kernel/cudnn/fused_emulation.hpp>
#endif

#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <string>
#include <type_traits>

namespace blockattn::impl {

/// Whether a fused provider is built in for ExecSpace and storage type V.
template <class ExecSpace, class V>
constexpr bool fused_enabled() {
  if constexpr (!is_half_storage_v<V>) {
    return false;
  } else {
#if defined(BLOCKATTN_FUSED_CUDNN)
    if constexpr (std::is_same<ExecSpace, Kokkos::Cuda>::value) return true;
#endif
#if defined(BLOCKATTN_EMULATE_FUSED)
    if constexpr (is_host_space_v<ExecSpace>) return true;
#endif
    return false;
  }
}

template <class V>
constexpr FusedType fused_type() {
  return std::is_same<V, bf16>::value ? FusedType::bf16 : FusedType::fp16;
}

/// A fused operand at `data` with (batch, head, sequence, dim) element strides.
inline FusedTensor fused_tensor(const void* data, std::size_t b, std::size_t h, std::size_t s,
                                std::size_t d) {
  FusedTensor t;
  t.data = data;
  t.stride[0] = std::int64_t(b);
  t.stride[1] = std::int64_t(h);
  t.stride[2] = std::int64_t(s);
  t.stride[3] = std::int64_t(d);
  return t;
}

/// Rows [row0, ...) of a (batch, seq, heads, dim) View as a fused operand.
template <class View>
FusedTensor fused_rows(const View& x, index_type row0) {
  return fused_tensor(x.data() + row0 * index_type(x.stride(1)), x.stride(0), x.stride(2),
                      x.stride(1), x.stride(3));
}

/// The operand t (rows from 0) from row row0 on: stride[2] is the sequence
/// stride of both kinds of operand (fused_rows, fused_lse); `elem` its bytes.
inline FusedTensor fused_offset(FusedTensor t, index_type row0, std::size_t elem) {
  t.data = static_cast<const char*>(t.data) + std::int64_t(row0) * t.stride[2] * std::int64_t(elem);
  return t;
}

/// Rows [row0, ...) of a (batch, heads, seq) LSE View.
template <class View>
FusedTensor fused_lse(const View& x, index_type row0) {
  return fused_tensor(x.data() + row0 * index_type(x.stride(2)), x.stride(0), x.stride(1),
                      x.stride(2), 1);
}

/// The fused calls' workspace, kept per stream between calls: calls on one
/// stream run in order, so the next call may reuse it without a fence (it
/// grows to the largest need; freed at Kokkos::finalize). A fresh
/// allocation per call (and the fence its release needed) cost a cuDNN
/// backward of 1 ms about a fifth of its time.
template <class MemorySpace>
Kokkos::View<char*, MemorySpace> fused_workspace(const void* stream, std::size_t bytes) {
  using view = Kokkos::View<char*, MemorySpace>;
  struct Cache {
    std::mutex mu;
    std::map<const void*, view> by_stream;
    bool hook = false;
  };
  static Cache c;
  std::lock_guard<std::mutex> lock(c.mu);
  if (!c.hook) {
    Kokkos::push_finalize_hook([] {
      std::lock_guard<std::mutex> l(c.mu);
      c.by_stream.clear();
    });
    c.hook = true;
  }
  view& w = c.by_stream[stream];
  if (w.extent(0) < bytes)
    w = view(Kokkos::view_alloc(Kokkos::WithoutInitializing, "blockattn::fused_workspace"), bytes);
  return w;
}

/// The provider of ExecSpace: cuDNN on Kokkos::Cuda, the emulation on host spaces.
template <class ExecSpace, class V>
struct FusedProvider {
  static bool supports(const FusedForwardCall& c) {
#if defined(BLOCKATTN_FUSED_CUDNN)
    if constexpr (std::is_same<ExecSpace, Kokkos::Cuda>::value) return cudnn::supports_forward(c);
#endif
    (void)c;
    return true;
  }
  static bool supports(const FusedBackwardCall& c) {
#if defined(BLOCKATTN_FUSED_CUDNN)
    if constexpr (std::is_same<ExecSpace, Kokkos::Cuda>::value) return cudnn::supports_backward(c);
#endif
    (void)c;
    return true;
  }
  static std::size_t workspace(const FusedForwardCall& c) {
#if defined(BLOCKATTN_FUSED_CUDNN)
    if constexpr (std::is_same<ExecSpace, Kokkos::Cuda>::value) return cudnn::forward_workspace(c);
#endif
    (void)c;
    return 0;
  }
  static std::size_t workspace(const FusedBackwardCall& c) {
#if defined(BLOCKATTN_FUSED_CUDNN)
    if constexpr (std::is_same<ExecSpace, Kokkos::Cuda>::value) return cudnn::backward_workspace(c);
#endif
    (void)c;
    return 0;
  }
  template <class Call>
  static void run(const ExecSpace& exec, Call c) {
    const std::size_t bytes = workspace(c);
#if defined(BLOCKATTN_FUSED_CUDNN)
    if constexpr (std::is_same<ExecSpace, Kokkos::Cuda>::value) {
      c.stream = static_cast<void*>(exec.cuda_stream());
      if (bytes > 0)
        c.workspace = fused_workspace<typename ExecSpace::memory_space>(c.stream, bytes).data();
      if constexpr (std::is_same<Call, FusedForwardCall>::value)
        cudnn::forward(c);
      else
        cudnn::backward(c);
      return;
    }
#endif
    (void)bytes;
#if defined(BLOCKATTN_EMULATE_FUSED)
    if constexpr (is_host_space_v<ExecSpace>) {
      exec.fence();  // the fills and packs before it
      if constexpr (std::is_same<Call, FusedForwardCall>::value)
        emulated_forward<V>(c);
      else
        emulated_backward<V>(c);
      return;
    }
#endif
    (void)exec;
  }
};

/// Rows [row0, ...) of a packed (batch, heads, seq, dim) View (a travelling
/// query slot, kernel/impl/backward_pack.hpp) as a fused operand.
template <class View>
FusedTensor fused_packed_rows(const View& x, index_type row0) {
  FusedTensor t;
  t.data = x.data() + row0 * index_type(x.stride(2));
  for (int a = 0; a < 4; ++a) t.stride[a] = std::int64_t(x.stride(a));
  return t;
}

/// The smallest normal magnitude of the 16-bit storage type V.
template <class V>
KOKKOS_INLINE_FUNCTION constexpr float smallest_normal() {
  return std::is_same<V, bf16>::value ? 1.17549435e-38f : 6.103515625e-05f;
}

/// A travelled query slot's operands for a fused backward, which takes O
/// where the slot carries D = rowsum(dO o O) (fused_travelled_rows): per
/// packed row (batch, head, row) of dout (storage V), lse (natural log) from
/// lse2 (LSE log2 e), and a proxy O (storage V) whose rowsum with dO is D:
/// o_proxy_d = sign(dO_d) D / sum_d |dO_d|. Every term dO_d o_proxy_d then
/// has D's sign, so the provider's fp32 rowsum is D times (1 + theta), theta
/// one rounding of the proxy to V (and the fp32 sum), and |o_proxy_d| <=
/// max_d |O_d|: nothing overflows that O did not. Where that magnitude is
/// below V's normal range (tiny D), the whole of D sits on the row's largest
/// |dO_d| (at most dim times larger). Non-finite D or dO: a NaN row (the
/// provider's D is then NaN, as it is from such an O); dO = 0: a zero row.
template <class ExecSpace, class DV, class LV, class OV, class NV>
void travelled_operands(const ExecSpace& exec, const DV& dout, const LV& lse2, const LV& drow,
                        int dim, const OV& o_proxy, const NV& lse) {
  using V = typename OV::non_const_value_type;
  const int batch = int(dout.extent(0)), heads = int(dout.extent(1)), rows = int(dout.extent(2)),
            padded_dim = int(dout.extent(3));
  if (rows <= 0) return;
  Kokkos::parallel_for(
      "blockattn::fused_travelled_rows",
      Kokkos::MDRangePolicy<ExecSpace, Kokkos::Rank<3>>(exec, {0, 0, 0}, {batch, heads, rows}),
      KOKKOS_LAMBDA(int b, int h, int i) {
        lse(b, h, i) = float(lse2(b, h, i)) * ln2<float>;
        const float D = float(drow(b, h, i));
        float m = 0.0f;
        int arg = 0;
        for (int d = 0; d < dim; ++d) {
          const float a = float(dout(b, h, i, d));
          const float x = a < 0.0f ? -a : a;
          if (x > m || !(x == x)) arg = d;
          m = x > m || !(x == x) ? x : m;
        }
        const bool finite = D - D == 0.0f && m - m == 0.0f;
        float n1 = 0.0f;  // sum |dO_d| / m, in [1, dim]
        if (finite && m > 0.0f)
          for (int d = 0; d < dim; ++d) {
            const float a = float(dout(b, h, i, d));
            n1 += (a < 0.0f ? -a : a) / m;
          }
        float r = finite && m > 0.0f ? D / (m * n1) : 0.0f;
        const bool one = r != 0.0f && (r < 0.0f ? -r : r) < smallest_normal<V>();
        if (one) r = D / m;
        for (int d = 0; d < padded_dim; ++d) {
          const float a = d < dim ? float(dout(b, h, i, d)) : 0.0f;
          float y = 0.0f;
          if (!finite)
            y = quiet_nan<float>();
          else if (one)
            y = d == arg ? (a < 0.0f ? -r : r) : 0.0f;
          else
            y = a < 0.0f ? -r : (a > 0.0f ? r : 0.0f);
          o_proxy(b, h, i, d) = V(y);
        }
      });
}

/// The shapes a fused provider takes (cuDNN 9's limits for SDPA): head dim a
/// multiple of 8 up to 256, GQA with heads a multiple of kv_heads.
inline bool fused_shape_ok(const BlockExtents& e) {
  return e.dim % 8 == 0 && e.dim <= 256 && e.kv_heads > 0 && e.heads % e.kv_heads == 0;
}

/// The band piece of a single-device call, when the fused path may take it:
/// a provider for (ExecSpace, V), not portable_only, one piece at most.
template <class ExecSpace, class V, class Mask>
bool fused_single_piece(const Mask& mask, const BlockExtents& e, const ForwardOptions& opts,
                        BandSplit& s) {
  if constexpr (!fused_enabled<ExecSpace, V>()) {
    (void)mask, (void)e, (void)opts, (void)s;
    return false;
  } else {
    if (opts.portable_only || !fused_shape_ok(e)) return false;
    s = band_split(mask, OffsetPositions{opts.q_offset}, e.queries, OffsetPositions{opts.k_offset},
                   e.keys);
    if (!s.expressible || s.count > 1) return false;
    return s.count == 0 || cudnn_band(s.pieces[0]).supported;
  }
}

/// Whether the mask allows every (query, key) pair of a single-device call.
template <class Mask>
bool covers_all(const Mask& mask, const BlockExtents& e, const ForwardOptions& opts) {
  return e.queries <= 0 || e.keys <= 0 ||
         mask.classify(opts.q_offset, opts.q_offset + e.queries, opts.k_offset,
                       opts.k_offset + e.keys) == TileKind::full;
}

inline FusedProblem fused_problem(const BlockExtents& e, const BandPiece& piece, FusedType type,
                                  float scale) {
  FusedProblem p;
  p.batch = e.batch;
  p.heads = e.heads;
  p.kv_heads = e.kv_heads;
  p.queries = piece.rows();
  p.keys = piece.cols();
  p.dim = e.dim;
  p.type = type;
  p.band = cudnn_band(piece);
  p.scale = scale;
  return p;
}

/// The checks both directions of a single-device call share before the
/// fused path takes it: one band piece at most that the provider's form
/// holds (fused_single_piece), unit head strides of every operand, and, with
/// the guard and a mask that hides keys, no inf / NaN in v. `piece`: the
/// call's piece (empty when no pair is allowed). False: the kernels take it.
template <class ExecSpace, class V, class Mask, class VV, class... Views>
bool fused_call_piece(const ExecSpace& exec, const Mask& mask, const BlockExtents& e,
                      const ForwardOptions& opts, const VV& v, BandSplit& s, BandPiece& piece,
                      const Views&... operands) {
  if (!fused_single_piece<ExecSpace, V>(mask, e, opts, s)) return false;
  if (!unit_head_stride(v, operands...)) return false;
  if (s.count == 1 && opts.guard_masked_nonfinite && !covers_all(mask, e, opts) &&
      has_nonfinite(exec, v))
    return false;
  if (s.count == 1) piece = s.pieces[0];
  return true;
}

/// The operands a forward and a backward call of one piece share.
template <class Call, class QV, class KV, class VV, class OV, class LV>
void fused_call_operands(Call& c, const BlockExtents& e, const BandPiece& piece, FusedType type,
                         float scale, const QV& q, const KV& k, const VV& v, const OV& o,
                         const LV& lse) {
  c.p = fused_problem(e, piece, type, scale);
  c.q = fused_rows(q, piece.row_begin);
  c.k = fused_rows(k, piece.col_begin);
  c.v = fused_rows(v, piece.col_begin);
  c.o = fused_rows(o, piece.row_begin);
  c.lse = fused_lse(lse, piece.row_begin);
}

/// The single-device forward on the fused path (`pieces`: the band pieces
/// run, 0 or 1); false (nothing done) when the call takes BlockAttn's kernels.
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV, class Mask, class T>
bool fused_forward(const ExecSpace& exec, const BlockExtents& e, const QV& q, const KV& k,
                   const VV& v, const OV& o, const LV& lse, const Mask& mask, T scale,
                   const ForwardOptions& opts, int& pieces) {
  using V = typename OV::non_const_value_type;
  BandSplit s;
  BandPiece piece;
  if (!fused_call_piece<ExecSpace, V>(exec, mask, e, opts, v, s, piece, q, k, o)) return false;
  FusedForwardCall c;
  if (s.count == 1) {
    fused_call_operands(c, e, piece, fused_type<V>(), float(scale), q, k, v, o, lse);
    if (!FusedProvider<ExecSpace, V>::supports(c)) return false;
  }
  if (piece.rows() < e.queries) fill_unseen_rows(exec, o, lse, piece.row_begin, piece.row_end);
  if (s.count == 1) FusedProvider<ExecSpace, V>::run(exec, c);
  pieces = s.count;
  return true;
}

/// The single-device backward on the fused path (gradients written).
template <class ExecSpace, class QV, class KV, class VV, class OV, class LV, class DOV, class DQV,
          class DKV, class DVV, class Mask, class T>
bool fused_backward(const ExecSpace& exec, const BlockExtents& e, const QV& q, const KV& k,
                    const VV& v, const OV& o, const LV& lse, const DOV& dout, const DQV& dq,
                    const DKV& dk, const DVV& dv, const Mask& mask, T scale,
                    const ForwardOptions& opts, int& pieces) {
  using V = typename OV::non_const_value_type;
  BandSplit s;
  BandPiece piece;
  if (!fused_call_piece<ExecSpace, V>(exec, mask, e, opts, v, s, piece, q, k, o, dout, dq, dk, dv))
    return false;
  FusedBackwardCall c;
  if (s.count == 1) {
    fused_call_operands(c, e, piece, fused_type<V>(), float(scale), q, k, v, o, lse);
    c.dout = fused_rows(dout, piece.row_begin);
    c.dq = fused_rows(dq, piece.row_begin);
    c.dk = fused_rows(dk, piece.col_begin);
    c.dv = fused_rows(dv, piece.col_begin);
    if (!FusedProvider<ExecSpace, V>::supports(c)) return false;
  }
  if (piece.rows() < e.queries) zero_rows_outside(exec, dq, piece.row_begin, piece.row_end);
  if (piece.cols() < e.keys) {
    zero_rows_outside(exec, dk, piece.col_begin, piece.col_end);
    zero_rows_outside(exec, dv, piece.col_begin, piece.col_end);
  }
  if (s.count == 1) FusedProvider<ExecSpace, V>::run(exec, c);
  pieces = s.count;
  return true;
}

}  // namespace blockattn::impl
